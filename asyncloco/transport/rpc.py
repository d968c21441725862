"""Coordinator RPCs on raw libp2p streams: ``assign``, ``get_model`` (θ download), ``submit`` (update upload).

Server side: :class:`CoordinatorService` wraps an injected :class:`CoordinatorHandler` that owns all
business logic. Client side: :class:`CoordinatorClient` (transport/rpc_client.py; shared names and
counters: transport/rpc_common.py). Messages: :mod:`asyncloco.transport.wire`;
frames, deadlines and byte accounting: :mod:`asyncloco.transport.framing`; errors:
:mod:`asyncloco.transport.errors`. Protocol and limits: docs/transport.md.

Each call is one stream (handle ``{namespace}::asyncloco.{rpc}``):

- ``assign``: client → :class:`~asyncloco.transport.wire.AssignRequest`; service →
  :class:`~asyncloco.transport.wire.HelloReply` (kind "config") or
  :class:`~asyncloco.transport.wire.LeaseReply` (kind "lease"), or an ERROR frame.
- ``get_model``: client → :class:`~asyncloco.transport.wire.ModelRequest`; service →
  :class:`~asyncloco.transport.wire.ModelHeader` then exactly ``wire_bytes(codec, numel)`` body bytes in
  chunks, or no body when ``unchanged`` (the client already holds that version). With a lossy codec the
  body is θ in full or, when the header names ``delta_from``, a delta from the client's anchor
  (transport/delta.py).
- ``submit``: client → :class:`~asyncloco.transport.wire.SubmitHeader`; service → ``Ready`` (or ERROR);
  client → body chunks; service → :class:`~asyncloco.transport.wire.Ack` (or ERROR).

Bounds (:class:`ServiceLimits`): every frame's declared length is checked before it is read; per-peer and
global limits on calls in flight; a global cap on submit bodies and downloads in flight (memory ≤ cap ×
body); an idle deadline per read and write and a total deadline scaled to the body size. Input that
breaks the protocol is counted per peer, logged at a bounded rate (one line, no traceback) and reported
to ``on_protocol_error(peer_id, reason)`` at the same bounded rate. The caller's peer id always comes from
the authenticated libp2p stream, never from a payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Any, Awaitable, Callable, Dict, Optional, Protocol, Sequence, Tuple, TypeVar, Union

import torch
from hivemind.p2p import P2P

from asyncloco.transport.codecs import CODECS, EncodedTensor, encode, wire_bytes
from asyncloco.transport.delta import DELTA_CODECS, AnchorStore
from asyncloco.transport.errors import PeerUnreachable, ProtocolError, RpcTimeout, TransportError
from asyncloco.refusals import Refusal, frame_text
from asyncloco.transport.rpc_client import CoordinatorClient  # re-exported: the client lives in rpc_client.py
from asyncloco.transport.rpc_common import RPC_NAMES, RpcTraffic, TrafficCounters, handle_name
from asyncloco.transport.framing import CHUNK_BYTES, FrameReader, FrameWriter, read_until_closed
from asyncloco.transport.wire import (
    Ack,
    AssignRequest,
    CheckHeader,
    CheckRequest,
    HelloReply,
    LeaseReply,
    ModelHeader,
    ModelRequest,
    Ready,
    RevealHeader,
    RevealReply,
    SubmitHeader,
    VerdictHeader,
    VerdictReply,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CoordinatorHandler",
    "CoordinatorService",
    "CoordinatorClient",
    "ServiceLimits",
    "RpcTraffic",
    "TrafficCounters",
    "RPC_NAMES",
]

# after an ERROR frame, what the service reads and drops until the caller closes (CoordinatorService._linger)
ERROR_LINGER_S = 5.0
ERROR_LINGER_BYTES = 8 << 20
T = TypeVar("T")


class CoordinatorHandler(Protocol):
    """The coordinator's business logic, injected into :class:`CoordinatorService`. ``peer_id`` is the
    authenticated libp2p id of the caller. An exception refuses the call: the caller gets a
    :class:`RemoteError` with its text (a :class:`TransportError`, e.g. a :class:`CodecError` from decoding,
    also counts as a protocol error of that peer)."""

    async def assign(self, request: AssignRequest, peer_id: str) -> Union[HelloReply, LeaseReply]:
        """``request.kind == "config"`` → :class:`HelloReply`; ``"lease"`` → :class:`LeaseReply`. May wait
        (a grace period); clients set their assign timeout above that wait."""
        ...

    async def get_model(self, version: Optional[int], peer_id: str) -> Tuple[int, torch.Tensor]:
        """Return ``(version, θ)``: θ flat fp32 CPU of the model's numel, never mutated afterwards (a
        snapshot; the service may cache its encoding by version). ``None``: the latest; raise to refuse."""
        ...

    # Optional: ``async def check_admitted(self, peer_id: str) -> None`` — raise to refuse a submission at
    # its header, before its body is read (admission; the coordinator daemon has it).

    async def submit(self, header: SubmitHeader, pseudo_gradient: EncodedTensor, peer_id: str, upload_seconds: float = 0.0) -> Ack:
        """Validate and apply (or refuse) an update. ``pseudo_gradient`` matches the header's codec and
        the model's numel exactly (so ``decode`` cannot fail on size; it refuses NaN/Inf). Must be
        idempotent by ``header.lease_id``. ``upload_seconds``: how long the body took to arrive, measured here
        (the coordinator times a peer's transfers itself instead of trusting a claim)."""
        ...

    # Optional (commitments; coordinator/serving.py has them): ``async def reveal_limit(self, header: RevealHeader,
    # peer_id: str) -> int`` — the most bytes this reveal may carry (raise to refuse it), checked before its body is read;
    # ``async def reveal(self, header: RevealHeader, state: bytes, peer_id: str) -> RevealReply``.


def _count_down(counts: dict[str, int], key: str) -> None:
    """One fewer for ``key`` in a per-peer count (the key leaves at zero: the dict stays as small as the peers active)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


@dataclass(frozen=True)
class ServiceLimits:
    """Bounds of :class:`CoordinatorService` (see docs/transport.md, "Limits").

    :param idle_timeout: a read or write that makes no progress for this long ends the call.
    :param header_timeout: total time for a request header to arrive after the stream opens.
    :param transfer_base_s, transfer_min_bytes_per_s: a body transfer must complete within
        ``transfer_base_s + bytes / transfer_min_bytes_per_s``.
    :param max_calls_per_peer: calls in flight per peer id (a peer runner has at most two: a held
        ``assign`` beside a θ prefetch; the third allows a retry while an abandoned call is torn down).
    :param max_streams: calls in flight in total (each holds at most one 64 KiB header before admission
        to a body slot).
    :param max_submit_bodies: submit bodies in flight: memory ≤ this × ``wire_bytes(codec, numel)``.
    :param max_bodies_per_peer: submit or reveal bodies one peer id may send at once (an honest runner sends one at
        a time, in order): a single slow sender cannot hold more than this many of the ``max_submit_bodies`` slots.
    :param max_downloads: downloads in flight.
    :param queue_timeout: how long a call waits for a body slot before it is refused as busy.
    :param error_log_interval, error_log_burst: at most ``burst`` protocol-error lines (and callbacks)
        per interval; the rest are counted and summarised in the next line.
    :param model_cache: encoded θ bodies kept by (version, codec) for concurrent and repeated downloads.
    :param download_anchors: full encodings of θ (lossy download codecs) kept as anchors for delta
        downloads, each ``wire_bytes(codec, numel)`` bytes (transport/delta.py); also the number of
        encoded delta bodies kept.
    """

    idle_timeout: float = 30.0
    header_timeout: float = 30.0
    transfer_base_s: float = 60.0
    # 64 KiB/s (0.5 Mbit/s): a home uplink of 1 Mbit/s sends the 150m preset's int8 update (151 MB) in 20 min — at the
    # earlier 256 KiB/s floor it was cut off after 10.6 min and could never submit. A slow sender holds one body slot
    # at most (max_bodies_per_peer)
    transfer_min_bytes_per_s: float = 64 << 10
    max_calls_per_peer: int = 3
    max_streams: int = 256
    max_submit_bodies: int = 4
    max_bodies_per_peer: int = 2  # one, and a resend while a broken stream of the first still lingers
    max_downloads: int = 4
    queue_timeout: float = 60.0
    error_log_interval: float = 10.0
    error_log_burst: int = 5
    model_cache: int = 2
    download_anchors: int = 4

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"ServiceLimits.{name} must be positive, got {value!r}")

    def transfer_timeout(self, nbytes: int) -> float:
        return self.transfer_base_s + nbytes / self.transfer_min_bytes_per_s


class _RateLimitedReport:
    """Counts events per peer; logs (and calls back) at most ``burst`` times per ``interval`` seconds."""

    MAX_PEERS = 4096  # beyond this many distinct ids, counts go to "<other>" (bounded memory)

    def __init__(self, what: str, level: int, interval: float, burst: int,
                 callback: Optional[Callable[[str, str], None]] = None) -> None:
        self.what, self.level, self.interval, self.burst, self.callback = what, level, interval, burst, callback
        self.per_peer: Dict[str, int] = {}
        self.total = 0
        self.lines = 0
        self._window_start = -float("inf")
        self._used = 0
        self._suppressed = 0

    def __call__(self, peer_id: str, rpc: str, reason: str) -> None:
        self.total += 1
        key = peer_id if peer_id in self.per_peer or len(self.per_peer) < self.MAX_PEERS else "<other>"
        self.per_peer[key] = self.per_peer.get(key, 0) + 1
        now = time.monotonic()
        if now - self._window_start >= self.interval:
            self._window_start, self._used = now, 0
        if self._used >= self.burst:
            self._suppressed += 1
            return
        self._used += 1
        self.lines += 1
        suppressed, self._suppressed = self._suppressed, 0
        reason = reason if len(reason) <= 300 else reason[:300] + "..."
        logger.log(self.level, "%s %s from %s: %s (%d from this peer, %d in all%s)", self.what, rpc, peer_id, reason,
                   self.per_peer[key], self.total, f"; {suppressed} not logged since the last line" if suppressed else "")
        if self.callback is not None:
            try:
                self.callback(peer_id, f"{rpc}: {reason}")
            except Exception as error:  # the callback must never break the service
                logger.debug("on_protocol_error callback failed: %r", error)


class _Busy(Exception):
    """A call refused for load (not the caller's fault): the caller may retry."""


class _Refused(Exception):
    """The handler raised: the call is refused with its message."""


class CoordinatorService:
    """Serves a :class:`CoordinatorHandler` on a P2P instance with bounded memory and time per call.

    :param model_numel: number of elements of θ; every body is checked against it before allocation.
    :param submit_codecs: codecs accepted for pseudo-gradients (usually just the run's codec).
    :param model_codecs: codecs offered for θ downloads.
    :param on_protocol_error: ``(peer_id, reason)``, called at the bounded rate of the log lines for input
        that breaks the protocol (e.g. to journal transport-level rejections).
    :param max_concurrent_submits: shorthand for ``limits.max_submit_bodies``.

    Usage: ``await service.add_p2p_handlers(p2p, namespace=run_id)``; remove with
    ``await service.remove_p2p_handlers(p2p, namespace=run_id)`` before ``p2p.shutdown()``.
    ``protocol_errors`` maps peer ids to their count of protocol errors.
    """

    def __init__(
        self,
        handler: CoordinatorHandler,
        model_numel: int,
        *,
        submit_codecs: Sequence[str] = CODECS,
        model_codecs: Sequence[str] = ("none", "bf16", "int8"),
        chunk_bytes: int = CHUNK_BYTES,
        limits: Optional[ServiceLimits] = None,
        max_concurrent_submits: Optional[int] = None,
        counters: Optional[TrafficCounters] = None,
        on_protocol_error: Optional[Callable[[str, str], None]] = None,
    ) -> None:
        for codec in (*submit_codecs, *model_codecs):
            wire_bytes(codec, model_numel)  # raises CodecError on an unknown codec or bad numel
        limits = limits if limits is not None else ServiceLimits()
        if max_concurrent_submits is not None:
            limits = replace(limits, max_submit_bodies=max_concurrent_submits)
        self.handler, self.model_numel, self.limits = handler, model_numel, limits
        self.submit_codecs, self.model_codecs = tuple(submit_codecs), tuple(model_codecs)
        self.chunk_bytes = chunk_bytes
        self.counters = counters if counters is not None else TrafficCounters()
        self._protocol_errors = _RateLimitedReport(
            "refused", logging.WARNING, limits.error_log_interval, limits.error_log_burst, on_protocol_error
        )
        self._refusals = _RateLimitedReport("handler refused", logging.INFO, limits.error_log_interval, limits.error_log_burst)
        self._submit_slots = asyncio.Semaphore(limits.max_submit_bodies)
        self._bodies: dict[str, int] = {}  # bodies each peer id is sending now (max_bodies_per_peer)
        self._download_slots = asyncio.Semaphore(limits.max_downloads)
        self._active: Dict[str, int] = {}
        self._streams = 0
        self._lingering = 0  # streams answered with an error, reading what their caller still sends
        self._model_cache: OrderedDict[Tuple[int, str], Any] = OrderedDict()
        # lossy downloads are full encodings (anchors) or deltas from the peer's anchor
        self.downloads = AnchorStore(model_numel, max_anchors=limits.download_anchors, max_bodies=limits.download_anchors)

    @property
    def protocol_errors(self) -> Dict[str, int]:
        return dict(self._protocol_errors.per_peer)

    @property
    def active_calls(self) -> int:
        return self._streams

    async def add_p2p_handlers(self, p2p: P2P, *, namespace: Optional[str] = None) -> None:
        for rpc in RPC_NAMES:
            await p2p.add_binary_stream_handler(handle_name(namespace, rpc), self._make_stream_handler(rpc))

    async def remove_p2p_handlers(self, p2p: P2P, *, namespace: Optional[str] = None) -> None:
        for rpc in RPC_NAMES:
            await p2p.remove_binary_stream_handler(handle_name(namespace, rpc))

    def _make_stream_handler(self, rpc: str) -> Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(rpc, info.peer_id.to_base58(), reader, writer)

        return handle

    async def _serve(self, rpc: str, peer_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limits = self.limits
        traffic: RpcTraffic = getattr(self.counters, rpc)
        traffic.calls += 1
        frames_in = FrameReader(reader, idle_timeout=limits.idle_timeout, deadline=time.monotonic() + limits.header_timeout)
        frames_out = FrameWriter(writer, idle_timeout=limits.idle_timeout)
        admitted = self._streams < limits.max_streams and self._active.get(peer_id, 0) < limits.max_calls_per_peer
        if admitted:
            self._streams += 1
            self._active[peer_id] = self._active.get(peer_id, 0) + 1
        answered: Optional[str] = None  # "reply" or "error" went out: close only once it has arrived (_linger)
        try:
            if not admitted:
                raise _Busy(
                    f"too many calls in flight ({self._active.get(peer_id, 0)} from this peer, at most "
                    f"{limits.max_calls_per_peer}; {self._streams} in all, at most {limits.max_streams}); retry later"
                )
            await getattr(self, f"_serve_{rpc}")(peer_id, frames_in, frames_out, traffic)
            answered = "reply"  # a whole reply went out: it must arrive too (a reset overtook a θ body, twice)
        except asyncio.CancelledError:
            traffic.failures += 1
            raise
        except (TransportError, _Busy) as error:  # the caller's input or behaviour, or load
            traffic.failures += 1
            self._protocol_errors(peer_id, rpc, f"{type(error).__name__}: {error}")
            if not isinstance(error, (RpcTimeout, PeerUnreachable)):  # nobody is listening after those
                answered = await self._send_error(frames_out, str(error))
        except _Refused as error:
            traffic.failures += 1
            self._refusals(peer_id, rpc, str(error))
            answered = await self._send_error(frames_out, str(error))
        except Exception as error:  # a bug here or in the handler: one line, traceback at DEBUG
            traffic.failures += 1
            logger.error("%s from %s failed: %r", rpc, peer_id, error)
            logger.debug("%s failure", rpc, exc_info=True)
            answered = await self._send_error(frames_out, f"internal error: {type(error).__name__}")
        finally:
            if admitted:
                self._streams -= 1
                _count_down(self._active, peer_id)
            # counted before lingering: the call's bytes are known once its reply is written
            traffic.bytes_received += frames_in.bytes_read
            traffic.bytes_sent += frames_out.bytes_written
            if answered is not None:
                traffic.bytes_received += await self._linger(reader, writer, answered)
            writer.close()

    @staticmethod
    async def _send_error(frames_out: FrameWriter, message: str) -> Optional[str]:
        """Send an ERROR frame; ``"error"`` if it was written, None if not (the caller may be gone)."""
        try:
            await frames_out.error(message)
        except Exception:
            return None
        return "error"

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answered: str) -> int:
        """Before closing a stream that carried an answer: read (and drop) what the caller still sends until it
        closes its side; returns the bytes dropped (at most :data:`ERROR_LINGER_BYTES`).

        After a whole reply (``answered == "reply"``) the stream is not half-closed and the wait lasts up to
        the idle timeout: the caller closes once it has read the last byte, so nothing we sent can still be
        in flight when we hang up. Half-closing instead (``write_eof``) makes p2pd close the libp2p stream
        in both directions at once, and under load that close raced the last chunk of a θ body (the caller
        read 0 or 32,763 of 34,567 bytes, then "stream closed"). After an ERROR frame (``"error"``) the
        stream is half-closed (a caller reading until we hang up stops now) and the wait is at most
        :data:`ERROR_LINGER_S`.

        A refusal is sent before the request is read (admission) or mid-body. Closing our socket to p2pd
        with those bytes unread resets it (ECONNRESET on p2pd's read); p2pd then *resets* the libp2p stream,
        and a reset can overtake the ERROR frame still on its way: the caller read the frame's 5-byte prefix,
        then "stream closed after 0 of 90 bytes" instead of the refusal. The caller closes the stream as
        soon as it has read the error, so this wait is one round trip. At most ``limits.max_streams`` streams
        wait like this at once; beyond that (a flood of refused calls) they are closed at once."""
        if self._lingering >= self.limits.max_streams:  # a flood of refused calls: close at once
            return 0
        self._lingering += 1
        reply = answered == "reply"
        deadline = time.monotonic() + (self.limits.idle_timeout if reply else min(ERROR_LINGER_S, self.limits.idle_timeout))
        try:
            if not reply and writer.can_write_eof():
                writer.write_eof()  # the error is all we send: a caller reading until we hang up stops now
            return await read_until_closed(reader, deadline - time.monotonic(), ERROR_LINGER_BYTES)
        finally:
            self._lingering -= 1

    async def _call_handler(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except (asyncio.CancelledError, TransportError):
            raise
        except Refusal as error:  # a typed refusal (asyncloco/refusals.py): its code leads the ERROR frame's text
            raise _Refused(frame_text(error.code, f"{type(error).__name__}: {error}")) from error
        except Exception as error:
            raise _Refused(f"{type(error).__name__}: {error}") from error

    @contextlib.asynccontextmanager
    async def _body_slot(self, peer_id: str, what: str) -> Any:
        """A submit body slot for one body of ``peer_id`` (a submission or a reveal), at most
        ``max_bodies_per_peer`` of them per peer at once."""
        sending = self._bodies.get(peer_id, 0)
        if sending >= self.limits.max_bodies_per_peer:
            raise _Busy(f"this peer already sends {sending} body (a submission or a reveal); at most "
                        f"{self.limits.max_bodies_per_peer} at once: retry once it is done")
        self._bodies[peer_id] = sending + 1
        try:
            async with self._slot(self._submit_slots, what):
                yield
        finally:
            _count_down(self._bodies, peer_id)

    @contextlib.asynccontextmanager
    async def _slot(self, slots: asyncio.Semaphore, what: str) -> Any:
        try:
            await asyncio.wait_for(slots.acquire(), timeout=self.limits.queue_timeout)
        except asyncio.TimeoutError:
            raise _Busy(f"all {what} slots stayed busy for {self.limits.queue_timeout:.0f} s; retry later") from None
        try:
            yield
        finally:
            slots.release()

    async def _serve_assign(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        request = AssignRequest.from_wire(await frames_in.read_header())
        reply = await self._call_handler(self.handler.assign(request, peer_id))
        expected = HelloReply if request.kind == "config" else LeaseReply
        if not isinstance(reply, expected):
            raise TypeError(f"handler answered a {request.kind!r} request with {type(reply).__name__}, not {expected.__name__}")
        await frames_out.header(reply.to_wire())

    async def _serve_get_model(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        request = ModelRequest.from_wire(await frames_in.read_header())
        if request.codec not in self.model_codecs:
            raise ProtocolError(f"codec {request.codec!r} not offered for the model; choose one of {self.model_codecs}")
        async with self._slot(self._download_slots, "download"):
            version, theta = await self._call_handler(self.handler.get_model(request.version, peer_id))
            if theta.numel() != self.model_numel:
                raise ValueError(f"handler returned {theta.numel()} elements, the service expects {self.model_numel}")
            if request.have_version == version:
                await frames_out.header(ModelHeader(version, request.codec, self.model_numel, unchanged=True).to_wire())
                logger.debug("get_model: %s already holds v%d; no body", peer_id, version)
                self._served(peer_id, version, request.codec, None, unchanged=True)
                return
            delta_from: Optional[int] = None
            if request.codec in DELTA_CODECS:
                served = await asyncio.to_thread(self.downloads.serve, version, request.codec, theta, request.anchor_version)
                body, delta_from = served.body, served.delta_from
            else:  # fp32: exact, always in full (a delta would cost the same bytes)
                body = await self._encoded_model(version, request.codec, theta)
            self._served(peer_id, version, request.codec, delta_from)  # before the body: it may take a while on a slow link
            await frames_out.header(ModelHeader(version, request.codec, self.model_numel, delta_from=delta_from).to_wire())
            nbytes = wire_bytes(request.codec, self.model_numel)
            try:
                await asyncio.wait_for(frames_out.body(body, self.chunk_bytes), timeout=self.limits.transfer_timeout(nbytes))
            except asyncio.TimeoutError:
                raise RpcTimeout(f"sending {nbytes} B took longer than {self.limits.transfer_timeout(nbytes):.0f} s") from None
            traffic.payload_bytes_sent += nbytes
            logger.debug("get_model: sent v%s (%s, %d B, delta from %s) to %s", version, request.codec, nbytes, delta_from, peer_id)

    def _served(self, peer_id: str, version: int, codec: str, delta_from: Optional[int], unchanged: bool = False) -> None:
        """Tell the handler (its optional ``served``) which θ is going to ``peer_id``; its failure never fails the call."""
        served = getattr(self.handler, "served", None)
        if served is None:
            return
        try:
            served(peer_id, version, codec, delta_from, unchanged)
        except Exception as error:  # a bug in the hook: the download goes on
            logger.error("the served hook failed for v%s to %s: %r", version, peer_id, error)

    async def _encoded_model(self, version: int, codec: str, theta: torch.Tensor) -> Any:
        key = (version, codec)
        cached = self._model_cache.get(key)
        if cached is not None:
            self._model_cache.move_to_end(key)
            return cached
        if codec == "none":  # the snapshot's own memory, no copy
            body: Any = theta.detach().contiguous().numpy().view("u1").data  # a memoryview of the snapshot
        else:
            body = (await asyncio.to_thread(encode, codec, theta)).to_bytes()
        self._model_cache[key] = body
        while len(self._model_cache) > self.limits.model_cache:
            self._model_cache.popitem(last=False)
        return body

    async def _serve_submit(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        header = SubmitHeader.from_wire(await frames_in.read_header())
        if header.codec not in self.submit_codecs:
            raise ProtocolError(f"codec {header.codec!r} not accepted; this run accepts {self.submit_codecs}")
        if header.numel != self.model_numel:
            raise ProtocolError(f"pseudo-gradient declares numel={header.numel}, the model has {self.model_numel}")
        nbytes = wire_bytes(header.codec, header.numel)
        # --- admission (coordinator/admission.py): an optional handler hook refuses an unadmitted sender
        # before a body slot is taken or a byte of its body is read
        check_admitted = getattr(self.handler, "check_admitted", None)
        if check_admitted is not None:
            await self._call_handler(check_admitted(peer_id))
        async with self._body_slot(peer_id, "submit"):
            # Answer the header before the body is sent: a refusal reaches the client cleanly.
            frames_in.extend(self.limits.transfer_timeout(nbytes))
            await frames_out.header(Ready().to_wire())
            receiving = time.monotonic()
            body = await frames_in.read_body(nbytes)
            traffic.payload_bytes_received += nbytes
            pseudo_gradient = EncodedTensor.from_bytes(header.codec, header.numel, body)
            upload_seconds = time.monotonic() - receiving
            ack = await self._call_handler(self.handler.submit(header, pseudo_gradient, peer_id, upload_seconds))
            if not isinstance(ack, Ack):
                raise TypeError(f"handler answered submit with {type(ack).__name__}, not Ack")
        # the body's arrival time, without the handler's work: the caller's uplink sample (transport/linkspeed.py)
        await frames_out.header(dataclasses.replace(ack, received_s=round(upload_seconds, 6)).to_wire())

    async def _serve_reveal(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        header = RevealHeader.from_wire(await frames_in.read_header())
        reveal_limit = getattr(self.handler, "reveal_limit", None)
        if reveal_limit is None:
            raise _Refused("this coordinator does not take revealed inner states (runtime.verify is off)")
        limit = await self._call_handler(reveal_limit(header, peer_id))  # raises to refuse; bounds the body first
        if header.size > limit:
            raise ProtocolError(f"revealed state of {header.size} bytes; this model's inner state has at most {limit}")
        async with self._body_slot(peer_id, "reveal"):
            frames_in.extend(self.limits.transfer_timeout(header.size))
            await frames_out.header(Ready().to_wire())
            # a read-only view of the body, ours alone: no copy of it (1.8–3.6 GB at 150m) with the GIL held on the loop
            state = memoryview(await frames_in.read_body(header.size)).toreadonly() if header.size else b""
            traffic.payload_bytes_received += header.size
            reply = await self._call_handler(self.handler.reveal(header, state, peer_id))  # type: ignore[attr-defined]
            if not isinstance(reply, RevealReply):
                raise TypeError(f"handler answered reveal with {type(reply).__name__}, not RevealReply")
        await frames_out.header(reply.to_wire())



    async def _serve_verify_task(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        """A validator peer (asyncloco/validator.py) asks for a check: the handler lends one (or none within
        ``wait_s``); θ_base and the update follow as fp32 bodies, then the revealed start state. A check whose
        bodies do not all go out is given back to the queue at once."""
        request = CheckRequest.from_wire(await frames_in.read_header())
        lend = getattr(self.handler, "verify_task", None)
        if lend is None:
            raise _Refused("this coordinator takes no validators (runtime.verify is off)")
        header, bodies = await self._call_handler(lend(request, peer_id))
        if not isinstance(header, CheckHeader):
            raise TypeError(f"handler answered verify_task with {type(header).__name__}, not CheckHeader")
        sent = False
        try:
            await frames_out.header(header.to_wire())
            if not header.empty:
                async with self._slot(self._download_slots, "download"):
                    for body in bodies:
                        if len(body):
                            await asyncio.wait_for(frames_out.body(body, self.chunk_bytes),
                                                   timeout=self.limits.transfer_timeout(len(body)))
                            traffic.payload_bytes_sent += len(body)
            sent = True
        finally:
            if not sent and not header.empty:
                give_back = getattr(self.handler, "return_check", None)
                if give_back is not None:
                    give_back(header.lease_id, peer_id)

    async def _serve_verdict(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        """A validator's verdict on the check it was lent."""
        header = VerdictHeader.from_wire(await frames_in.read_header())
        take = getattr(self.handler, "verdict", None)
        if take is None:
            raise _Refused("this coordinator takes no validators (runtime.verify is off)")
        reply = await self._call_handler(take(header, peer_id))
        if not isinstance(reply, VerdictReply):
            raise TypeError(f"handler answered verdict with {type(reply).__name__}, not VerdictReply")
        await frames_out.header(reply.to_wire())
