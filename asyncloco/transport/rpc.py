"""Coordinator RPCs on raw libp2p streams: ``assign``, ``get_model`` (θ download), ``submit`` (update upload).

Server side: :class:`CoordinatorService` wraps an injected :class:`CoordinatorHandler` that owns all
business logic. Client side: :class:`CoordinatorClient`. Messages: :mod:`asyncloco.transport.wire`;
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
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Awaitable, Callable, Dict, Optional, Protocol, Sequence, Tuple, TypeVar, Union

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError

from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.delta import DELTA_CODECS, AnchorStore, apply_delta
from asyncloco.transport.linkspeed import LinkSpeed
from asyncloco.transport.errors import (
    CodecError,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    RpcTimeout,
    TransportError,
)
from asyncloco.refusals import Refusal, frame_text
from asyncloco.transport.framing import CHUNK_BYTES, FrameReader, FrameWriter
from asyncloco.transport.wire import (
    Ack,
    AssignRequest,
    HelloReply,
    LeaseReply,
    ModelHeader,
    ModelRequest,
    Ready,
    RevealHeader,
    RevealReply,
    SubmitHeader,
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

RPC_NAMES = ("assign", "get_model", "submit", "reveal")
# after an ERROR frame, what the service reads and drops until the caller closes (CoordinatorService._close_after_error)
ERROR_LINGER_S = 5.0
ERROR_LINGER_BYTES = 8 << 20
T = TypeVar("T")


def handle_name(namespace: Optional[str], rpc: str) -> str:
    return f"{namespace}::asyncloco.{rpc}" if namespace else f"asyncloco.{rpc}"


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

    async def submit(self, header: SubmitHeader, pseudo_gradient: EncodedTensor, peer_id: str) -> Ack:
        """Validate and apply (or refuse) an update. ``pseudo_gradient`` matches the header's codec and
        the model's numel exactly (so ``decode`` cannot fail on size; it refuses NaN/Inf). Must be
        idempotent by ``header.lease_id``."""
        ...

    # Optional (issue 16, commitments; coordinator/serving.py has them): ``async def reveal_limit(self, header: RevealHeader,
    # peer_id: str) -> int`` — the most bytes this reveal may carry (raise to refuse it), checked before its body is read;
    # ``async def reveal(self, header: RevealHeader, state: bytes, peer_id: str) -> RevealReply``.


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
    transfer_min_bytes_per_s: float = 256 << 10
    max_calls_per_peer: int = 3
    max_streams: int = 256
    max_submit_bodies: int = 4
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


@dataclass
class RpcTraffic:
    """Counters of one RPC on one side. ``bytes_*``: framed bytes on the stream (see framing);
    ``payload_*``: codec bytes of tensor bodies alone (``wire_bytes(codec, numel)`` per transfer)."""

    calls: int = 0
    failures: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0


@dataclass
class TrafficCounters:
    """Per-RPC traffic of a client or a service; share one instance to aggregate."""

    assign: RpcTraffic = field(default_factory=RpcTraffic)
    get_model: RpcTraffic = field(default_factory=RpcTraffic)
    submit: RpcTraffic = field(default_factory=RpcTraffic)
    reveal: RpcTraffic = field(default_factory=RpcTraffic)

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        return {name: asdict(getattr(self, name)) for name in RPC_NAMES}


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
        # seconds the body of each peer's submission in progress took to arrive (read by the handler: the
        # coordinator measures a peer's transfer time itself instead of trusting a claim)
        self.upload_seconds: Dict[str, float] = {}
        self._download_slots = asyncio.Semaphore(limits.max_downloads)
        self._active: Dict[str, int] = {}
        self._streams = 0
        self._lingering = 0  # streams answered with an error, reading what their caller still sends
        self._model_cache: OrderedDict[Tuple[int, str], Any] = OrderedDict()
        # issue 8 item 4: lossy downloads are full encodings (anchors) or deltas from the peer's anchor
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
        answered_error = False  # a reply or an ERROR frame went out: close so that it arrives (_close_after_error)
        try:
            if not admitted:
                raise _Busy(
                    f"too many calls in flight ({self._active.get(peer_id, 0)} from this peer, at most "
                    f"{limits.max_calls_per_peer}; {self._streams} in all, at most {limits.max_streams}); retry later"
                )
            await getattr(self, f"_serve_{rpc}")(peer_id, frames_in, frames_out, traffic)
            answered_error = True  # a whole reply went out: it must arrive too (a reset overtook a θ body once)
        except asyncio.CancelledError:
            traffic.failures += 1
            raise
        except (TransportError, _Busy) as error:  # the caller's input or behaviour, or load
            traffic.failures += 1
            self._protocol_errors(peer_id, rpc, f"{type(error).__name__}: {error}")
            if not isinstance(error, (RpcTimeout, PeerUnreachable)):  # nobody is listening after those
                answered_error = await self._send_error(frames_out, str(error))
        except _Refused as error:
            traffic.failures += 1
            self._refusals(peer_id, rpc, str(error))
            answered_error = await self._send_error(frames_out, str(error))
        except Exception as error:  # a bug here or in the handler: one line, traceback at DEBUG
            traffic.failures += 1
            logger.error("%s from %s failed: %r", rpc, peer_id, error)
            logger.debug("%s failure", rpc, exc_info=True)
            answered_error = await self._send_error(frames_out, f"internal error: {type(error).__name__}")
        finally:
            if admitted:
                self._streams -= 1
                left = self._active[peer_id] - 1
                if left:
                    self._active[peer_id] = left
                else:
                    del self._active[peer_id]
            # counted before lingering: the call's bytes are known once its reply is written
            traffic.bytes_received += frames_in.bytes_read
            traffic.bytes_sent += frames_out.bytes_written
            if answered_error:
                traffic.bytes_received += await self._close_after_error(reader, writer)
            writer.close()

    @staticmethod
    async def _send_error(frames_out: FrameWriter, message: str) -> bool:
        """Send an ERROR frame; whether it was written (the caller may be gone)."""
        try:
            await frames_out.error(message)
        except Exception:
            return False
        return True

    async def _close_after_error(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        """Before closing a stream answered with an error: half-close it, then read (and drop) what the caller
        still sends until it closes its side, within :data:`ERROR_LINGER_S` and :data:`ERROR_LINGER_BYTES`;
        returns the bytes dropped.

        A refusal is sent before the request is read (admission) or mid-body. Closing our socket to p2pd
        with those bytes unread resets it (ECONNRESET on p2pd's read); p2pd then *resets* the libp2p stream,
        and a reset can overtake the ERROR frame still on its way: the caller read the frame's 5-byte prefix,
        then "stream closed after 0 of 90 bytes" instead of the refusal. The caller closes the stream as
        soon as it has read the error, so this wait is one round trip. At most ``limits.max_streams`` streams
        wait like this at once; beyond that (a flood of refused calls) they are closed at once."""
        discarded = 0
        if self._lingering >= self.limits.max_streams:  # a flood of refused calls: close at once
            return discarded
        self._lingering += 1
        deadline = time.monotonic() + min(ERROR_LINGER_S, self.limits.idle_timeout)
        try:
            if writer.can_write_eof():
                writer.write_eof()  # the error is all we send: a caller reading until we hang up stops now
            while discarded < ERROR_LINGER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                data = await asyncio.wait_for(reader.read(64 << 10), timeout=left)
                if not data:
                    break
                discarded += len(data)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            self._lingering -= 1
        return discarded

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
                return
            delta_from: Optional[int] = None
            if request.codec in DELTA_CODECS:
                served = await asyncio.to_thread(self.downloads.serve, version, request.codec, theta, request.anchor_version)
                body, delta_from = served.body, served.delta_from
            else:  # fp32: exact, always in full (a delta would cost the same bytes)
                body = await self._encoded_model(version, request.codec, theta)
            await frames_out.header(ModelHeader(version, request.codec, self.model_numel, delta_from=delta_from).to_wire())
            nbytes = wire_bytes(request.codec, self.model_numel)
            try:
                await asyncio.wait_for(frames_out.body(body, self.chunk_bytes), timeout=self.limits.transfer_timeout(nbytes))
            except asyncio.TimeoutError:
                raise RpcTimeout(f"sending {nbytes} B took longer than {self.limits.transfer_timeout(nbytes):.0f} s") from None
            traffic.payload_bytes_sent += nbytes
            logger.debug("get_model: sent v%s (%s, %d B, delta from %s) to %s", version, request.codec, nbytes, delta_from, peer_id)

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
        async with self._slot(self._submit_slots, "submit"):
            # Answer the header before the body is sent: a refusal reaches the client cleanly.
            frames_in.extend(self.limits.transfer_timeout(nbytes))
            await frames_out.header(Ready().to_wire())
            receiving = time.monotonic()
            body = await frames_in.read_body(nbytes)
            traffic.payload_bytes_received += nbytes
            pseudo_gradient = EncodedTensor.from_bytes(header.codec, header.numel, body)
            self.upload_seconds[peer_id] = time.monotonic() - receiving
            try:
                ack = await self._call_handler(self.handler.submit(header, pseudo_gradient, peer_id))
            finally:
                self.upload_seconds.pop(peer_id, None)
            if not isinstance(ack, Ack):
                raise TypeError(f"handler answered submit with {type(ack).__name__}, not Ack")
        await frames_out.header(ack.to_wire())

    async def _serve_reveal(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter, traffic: RpcTraffic) -> None:
        header = RevealHeader.from_wire(await frames_in.read_header())
        reveal_limit = getattr(self.handler, "reveal_limit", None)
        if reveal_limit is None:
            raise _Refused("this coordinator does not take revealed inner states (runtime.verify is off)")
        limit = await self._call_handler(reveal_limit(header, peer_id))  # raises to refuse; bounds the body first
        if header.size > limit:
            raise ProtocolError(f"revealed state of {header.size} bytes; this model's inner state has at most {limit}")
        async with self._slot(self._submit_slots, "reveal"):
            frames_in.extend(self.limits.transfer_timeout(header.size))
            await frames_out.header(Ready().to_wire())
            state = bytes(await frames_in.read_body(header.size)) if header.size else b""
            traffic.payload_bytes_received += header.size
            reply = await self._call_handler(self.handler.reveal(header, state, peer_id))  # type: ignore[attr-defined]
            if not isinstance(reply, RevealReply):
                raise TypeError(f"handler answered reveal with {type(reply).__name__}, not RevealReply")
        await frames_out.header(reply.to_wire())


class CoordinatorClient:
    """Calls a coordinator's :class:`CoordinatorService`. All methods are coroutines on the P2P's loop.

    :param p2p: this peer's ``hivemind.P2P`` (e.g. ``await dht.replicate_p2p()``).
    :param coordinator_peer_id: the pinned coordinator; libp2p authenticates it on connect.
    :param model_numel: the model size from the run config / hello; bodies are checked against it.
    :param timeouts: defaults per call in seconds. ``assign`` must exceed the coordinator's grace hold;
        ``get_model``/``submit`` about 3x the transfer time at your slowest expected bandwidth.
    :param idle_timeout: a read that makes no progress for this long (other than waiting for an
        ``assign`` reply, which may be held) fails the call.
    :param download_codec: the default codec of ``get_model`` (the run's ``runtime.download_codec``).
    :param liveness_period: while a call runs, check this often that the connection to the coordinator is
        still open, and fail the call (:class:`PeerUnreachable`) once it is gone. p2pd does not end a
        stream whose connection died (a SIGKILLed coordinator): without this a peer waiting for an ack
        sat out the whole timeout.

    The client keeps the θ it last downloaded (:attr:`held`): ``get_model`` tells the coordinator which
    version it holds and gets no body when that is the version served. With a lossy download codec it also
    keeps its last full download as received (:attr:`anchor`, ``wire_bytes(codec, numel)`` bytes): the
    coordinator may then send θ as a delta from it (transport/delta.py). Do not modify a returned θ.
    """

    def __init__(
        self,
        p2p: P2P,
        coordinator_peer_id: Union[PeerID, str],
        model_numel: int,
        *,
        namespace: Optional[str] = None,
        chunk_bytes: int = CHUNK_BYTES,
        assign_timeout: float = 120.0,
        get_model_timeout: float = 600.0,
        submit_timeout: float = 600.0,
        idle_timeout: float = 60.0,
        counters: Optional[TrafficCounters] = None,
        liveness_period: float = 1.0,
        download_codec: str = "none",
        link: Optional[LinkSpeed] = None,
    ) -> None:
        if isinstance(coordinator_peer_id, str):
            coordinator_peer_id = PeerID.from_base58(coordinator_peer_id)
        wire_bytes("none", model_numel)  # validates model_numel
        self.p2p, self.coordinator_peer_id, self.model_numel = p2p, coordinator_peer_id, model_numel
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.timeouts = {"assign": assign_timeout, "get_model": get_model_timeout, "submit": submit_timeout}
        self.idle_timeout = idle_timeout
        wire_bytes(download_codec, 1)  # validates the codec name
        self.download_codec = download_codec
        self.liveness_period = liveness_period
        self.counters = counters if counters is not None else TrafficCounters()
        self.held: Optional[Tuple[int, str, torch.Tensor]] = None  # (version, codec it came in, θ)
        # issue 8 item 4: the last full download in a lossy codec, as received: deltas are taken from it
        self.anchor: Optional[Tuple[int, str, bytearray]] = None  # (version, codec, encoded body)
        # issue 11: with a LinkSpeed, get_model/submit without an explicit timeout get one derived from the
        # measured throughput of this link (transport/linkspeed.py), and each completed body is a sample
        self.link = link

    async def _call(self, name: str, call: Callable[[FrameReader, FrameWriter], Awaitable[T]], timeout: Optional[float]) -> T:
        traffic: RpcTraffic = getattr(self.counters, name)
        traffic.calls += 1
        limit = self.timeouts[name] if timeout is None else timeout
        try:
            return await asyncio.wait_for(self._while_connected(name, self._on_stream(name, call)), timeout=limit)
        except asyncio.TimeoutError:
            traffic.failures += 1
            raise RpcTimeout(f"{name} to {self.coordinator_peer_id} timed out after {limit:.1f} s") from None
        except (P2PDaemonError, ConnectionError, asyncio.IncompleteReadError, OSError) as error:
            traffic.failures += 1
            raise PeerUnreachable(f"{name} to {self.coordinator_peer_id}: {error!r}") from error
        except TransportError:
            traffic.failures += 1
            raise

    async def _on_stream(self, name: str, call: Callable[[FrameReader, FrameWriter], Awaitable[T]]) -> T:
        traffic: RpcTraffic = getattr(self.counters, name)
        _, reader, writer = await self.p2p.call_binary_stream_handler(
            self.coordinator_peer_id, handle_name(self.namespace, name)
        )
        frames_in = FrameReader(reader, idle_timeout=self.idle_timeout)
        frames_out = FrameWriter(writer, idle_timeout=self.idle_timeout)
        try:
            return await call(frames_in, frames_out)
        finally:
            traffic.bytes_sent += frames_out.bytes_written
            traffic.bytes_received += frames_in.bytes_read
            writer.close()

    async def _connected(self) -> bool:
        return any(info.peer_id == self.coordinator_peer_id for info in await self.p2p.list_peers())

    async def _while_connected(self, name: str, call: Awaitable[T]) -> T:
        """Run ``call``; raise :class:`PeerUnreachable` once the connection it runs on is gone. Only a
        connection seen open during this call counts as lost (a call may still be dialing)."""
        task = asyncio.ensure_future(call)
        try:
            seen = await self._connected()
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.liveness_period)
                if done:
                    return task.result()
                connected = await self._connected()
                if seen and not connected:
                    raise PeerUnreachable(f"{name} to {self.coordinator_peer_id}: the connection closed mid-call")
                seen = seen or connected
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def hello(
        self, *, name: Optional[str] = None, token: Optional[str] = None, timeout: Optional[float] = None
    ) -> HelloReply:
        """The run's description (config, model size, codecs). ``token``: the admission token, if the run
        needs one (coordinator/admission.py)."""
        reply = await self._request("assign", AssignRequest("config", name=name, token=token), HelloReply, timeout, hold=False)
        assert isinstance(reply, HelloReply)
        return reply

    async def assign(
        self,
        tokens_per_s: Optional[float] = None,
        *,
        name: Optional[str] = None,
        token: Optional[str] = None,
        signer: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> LeaseReply:
        """Ask for a lease (the coordinator may hold the answer for a grace period)."""
        request = AssignRequest(
            "lease", tokens_per_s=None if tokens_per_s is None else float(tokens_per_s), name=name, token=token,
            signer=signer,
        )
        reply = await self._request("assign", request, LeaseReply, timeout, hold=True)
        assert isinstance(reply, LeaseReply)
        return reply

    async def _request(self, name: str, request: AssignRequest, reply_type: Any, timeout: Optional[float], hold: bool) -> Any:
        async def call(frames_in: FrameReader, frames_out: FrameWriter) -> Any:
            await frames_out.header(request.to_wire())
            if hold:  # the coordinator may hold a lease request: only the call timeout applies
                frames_in.idle_timeout = None
            return reply_type.from_wire(await frames_in.read_header(allow_error=True))

        return await self._call(name, call, timeout)

    async def get_model(
        self, version: Optional[int] = None, *, codec: Optional[str] = None, timeout: Optional[float] = None
    ) -> Tuple[int, torch.Tensor]:
        """θ at ``version`` (``None``: the latest) as ``(version, flat fp32 tensor)`` in ``codec`` (default:
        the client's ``download_codec``). When this client already holds that version (in the same codec),
        no body is sent and the held tensor is returned; with a lossy codec the body may be a delta from the
        client's :attr:`anchor`."""
        chosen = self.download_codec if codec is None else codec
        if self.link is None:
            return await self._call("get_model", lambda r, w: self._get_model(r, w, version, chosen), timeout)
        nbytes, received, started = wire_bytes(chosen, self.model_numel), self.counters.get_model.payload_bytes_received, time.monotonic()
        limit = self.link.timeout("down", nbytes) if timeout is None else timeout
        result = await self._call("get_model", lambda r, w: self._get_model(r, w, version, chosen), limit)
        if self.counters.get_model.payload_bytes_received > received:  # a body came (not "unchanged")
            self.link.observe("down", nbytes, time.monotonic() - started)
        return result

    async def _get_model(
        self, frames_in: FrameReader, frames_out: FrameWriter, version: Optional[int], codec: str
    ) -> Tuple[int, torch.Tensor]:
        held = self.held if self.held is not None and self.held[1] == codec else None
        anchor = self.anchor if self.anchor is not None and self.anchor[1] == codec else None
        request = ModelRequest(codec, version, None if held is None else held[0], None if anchor is None else anchor[0])
        await frames_out.header(request.to_wire())
        header = ModelHeader.from_wire(await frames_in.read_header(allow_error=True))
        if header.codec != codec or header.numel != self.model_numel or (version is not None and header.version != version):
            raise ProtocolError(
                f"get_model header {header} does not match version={version} codec={codec!r} numel={self.model_numel}"
            )
        if header.unchanged:
            if held is None or held[0] != header.version:
                raise ProtocolError(f"the coordinator says v{header.version} is unchanged, but this peer holds {held and held[0]}")
            return header.version, held[2]
        if header.delta_from is not None and (anchor is None or anchor[0] != header.delta_from):
            raise ProtocolError(f"the coordinator sent a delta from v{header.delta_from}, but this peer's anchor is {anchor and anchor[0]}")
        nbytes = wire_bytes(codec, self.model_numel)
        body = await frames_in.read_body(nbytes, allow_error=True)
        self.counters.get_model.payload_bytes_received += nbytes
        if anchor is not None and header.delta_from is not None:  # θ = F_anchor + decode(delta)
            theta = await asyncio.to_thread(apply_delta, codec, self.model_numel, anchor[2], body)
        else:
            theta = await asyncio.to_thread(decode, EncodedTensor.from_bytes(codec, self.model_numel, body), self.model_numel)
            if codec in DELTA_CODECS:
                self.anchor = (header.version, codec, body)
        self.held = (header.version, codec, theta)
        return header.version, theta

    async def submit(
        self,
        lease_id: str,
        base_version: int,
        pseudo_gradient: Union[torch.Tensor, EncodedTensor],
        *,
        codec: Optional[str] = None,
        inner_loss: Optional[float] = None,
        timeout: Optional[float] = None,
        state_start: Optional[str] = None,
        state_end: Optional[str] = None,
    ) -> Ack:
        """Upload a pseudo-gradient; returns the coordinator's :class:`Ack`. Pass a tensor and ``codec``,
        or an :class:`EncodedTensor` (keep it to resend the exact bytes after a failure)."""
        if isinstance(pseudo_gradient, torch.Tensor):
            if codec is None:
                raise ValueError("submit(tensor) needs codec=...; or pass an EncodedTensor")
            pseudo_gradient = await asyncio.to_thread(encode, codec, pseudo_gradient)
        elif codec is not None and codec != pseudo_gradient.codec:
            raise ValueError(f"codec={codec!r} contradicts the EncodedTensor's {pseudo_gradient.codec!r}")
        if pseudo_gradient.numel != self.model_numel:
            raise CodecError(f"pseudo-gradient has {pseudo_gradient.numel} elements, the model {self.model_numel}")
        header = SubmitHeader(lease_id, base_version, pseudo_gradient.codec, pseudo_gradient.numel,
                              None if inner_loss is None else float(inner_loss), state_start, state_end)
        encoded = pseudo_gradient
        if self.link is None:
            return await self._call("submit", lambda r, w: self._submit(r, w, header, encoded), timeout)
        nbytes, started = wire_bytes(encoded.codec, encoded.numel), time.monotonic()
        limit = self.link.timeout("up", nbytes) if timeout is None else timeout
        ack = await self._call("submit", lambda r, w: self._submit(r, w, header, encoded), limit)
        self.link.observe("up", nbytes, time.monotonic() - started)
        return ack

    async def reveal(self, lease_id: str, state: bytes, *, timeout: Optional[float] = None) -> RevealReply:
        """Send the inner state this peer started lease ``lease_id`` from (its canonical layout, peer/inner.py), as an
        :class:`Ack` with ``reveal`` asked (issue 16, commitments)."""
        header = RevealHeader(lease_id, len(state))

        async def call(frames_in: FrameReader, frames_out: FrameWriter) -> RevealReply:
            await frames_out.header(header.to_wire())
            frames_in.idle_timeout = None  # the service may queue for a body slot; the call timeout applies
            Ready.from_wire(await frames_in.read_header(allow_error=True))
            if state:
                await frames_out.body(state, self.chunk_bytes)
            self.counters.reveal.payload_bytes_sent += len(state)
            return RevealReply.from_wire(await frames_in.read_header(allow_error=True))

        return await self._call("reveal", call, timeout if timeout is not None else self.timeouts["submit"])

    async def _submit(self, frames_in: FrameReader, frames_out: FrameWriter, header: SubmitHeader, encoded: EncodedTensor) -> Ack:
        await frames_out.header(header.to_wire())
        frames_in.idle_timeout = None  # the service may queue for a body slot; the call timeout applies
        Ready.from_wire(await frames_in.read_header(allow_error=True))
        body = encoded.to_bytes()
        await frames_out.body(body, self.chunk_bytes)
        self.counters.submit.payload_bytes_sent += len(body)
        # the coordinator decodes, validates, applies and makes the update durable before it acks
        return Ack.from_wire(await frames_in.read_header(allow_error=True))
