"""The client of the coordinator's RPCs (transport/rpc.py has the protocol, the service and the bounds;
docs/transport.md): one stream per call, deadlines, liveness checks, traffic counters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Optional, Tuple, TypeVar, Union

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError

from asyncloco.transport.codecs import EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.delta import DELTA_CODECS, apply_delta, theta_digest
from asyncloco.transport.errors import CodecError, PeerUnreachable, ProtocolError, RpcTimeout, TransportError
from asyncloco.transport.framing import CHUNK_BYTES, FrameReader, FrameWriter
from asyncloco.transport.linkspeed import LinkSpeed
from asyncloco.transport.rpc_common import RpcTraffic, TrafficCounters, handle_name
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

__all__ = ["CoordinatorClient"]

T = TypeVar("T")


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
        # the last full download in a lossy codec, as received: deltas are taken from it
        self.anchor: Optional[Tuple[int, str, bytearray]] = None  # (version, codec, encoded body)
        # how each recent version's θ was decoded: version -> (codec, anchor version of a delta or None, sha256 of θ);
        # a submission names its base version's (SubmitHeader.theta_*), so a re-run starts from the same θ
        self.decoded: dict[int, Tuple[str, Optional[int], str]] = {}
        # with a LinkSpeed, get_model/submit without an explicit timeout get one derived from the
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
        keep: Optional[str] = None,
    ) -> LeaseReply:
        """Ask for a lease (the coordinator may hold the answer for a grace period); ``keep``: the lease whose update
        this peer is still uploading (overlapped rounds: it stays active)."""
        measured = self.link.measured if self.link is not None else {}
        request = AssignRequest(
            "lease", tokens_per_s=None if tokens_per_s is None else float(tokens_per_s), name=name, token=token,
            signer=signer, keep=keep, link_up=measured.get("up"), link_down=measured.get("down"),
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
        await asyncio.to_thread(self.note_decoded, header.version, codec, header.delta_from, theta)
        self.held = (header.version, codec, theta)
        return header.version, theta

    def note_decoded(self, version: int, codec: str, anchor: Optional[int], theta: torch.Tensor) -> None:
        """Remember how θ at ``version`` was decoded (``anchor``: the version of the full encoding a delta was added to,
        None: in full) and its digest, for the submissions of leases based on it; the newest 8 versions are kept."""
        self.decoded[version] = (codec, anchor, theta_digest(theta))
        while len(self.decoded) > 8:
            del self.decoded[min(self.decoded)]

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
        device_class: Optional[str] = None,
        eager_of: Optional[str] = None,
    ) -> Ack:
        """Upload a pseudo-gradient; returns the coordinator's :class:`Ack`. Pass a tensor and ``codec``,
        or an :class:`EncodedTensor` (keep it to resend the exact bytes after a failure). ``eager_of``: the lease whose
        update the training's start subtracted (algo/eager.py; None: it started from θ itself)."""
        if isinstance(pseudo_gradient, torch.Tensor):
            if codec is None:
                raise ValueError("submit(tensor) needs codec=...; or pass an EncodedTensor")
            pseudo_gradient = await asyncio.to_thread(encode, codec, pseudo_gradient)
        elif codec is not None and codec != pseudo_gradient.codec:
            raise ValueError(f"codec={codec!r} contradicts the EncodedTensor's {pseudo_gradient.codec!r}")
        if pseudo_gradient.numel != self.model_numel:
            raise CodecError(f"pseudo-gradient has {pseudo_gradient.numel} elements, the model {self.model_numel}")
        source = self.decoded.get(base_version)  # the θ it trained from, as decoded (None: not downloaded here)
        theta_codec, theta_anchor, digest = source if source is not None else (None, None, None)
        header = SubmitHeader(lease_id, base_version, pseudo_gradient.codec, pseudo_gradient.numel,
                              None if inner_loss is None else float(inner_loss), state_start, state_end,
                              device_class, theta_codec, theta_anchor, digest, eager_of)
        encoded = pseudo_gradient
        if self.link is None:
            return await self._call("submit", lambda r, w: self._submit(r, w, header, encoded), timeout)
        nbytes, started = wire_bytes(encoded.codec, encoded.numel), time.monotonic()
        limit = self.link.timeout("up", nbytes) if timeout is None else timeout
        ack = await self._call("submit", lambda r, w: self._submit(r, w, header, encoded), limit)
        # the uplink sample: the body's arrival as the service measured it (not its decode, gate, lock wait and
        # decision, which made a fast peer's first sample look slow), else the whole call
        self.link.observe("up", nbytes, ack.received_s if ack.received_s is not None else time.monotonic() - started)
        return ack

    async def reveal(self, lease_id: str, state: Any, *, timeout: Optional[float] = None) -> RevealReply:
        """Send the inner state this peer started lease ``lease_id`` from (its canonical layout, train/commitments.py), as an
        :class:`Ack` with ``reveal`` asked (commitments). ``state``: bytes-like, or a list of bytes-like parts sent one
        after another as one body (peer/reveal.py ``RevealStore.reveal_parts``: no joined copy of gigabytes)."""
        parts = list(state) if isinstance(state, (list, tuple)) else [state]
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(view.nbytes for view in views)
        header = RevealHeader(lease_id, size)

        async def call(frames_in: FrameReader, frames_out: FrameWriter) -> RevealReply:
            await frames_out.header(header.to_wire())
            frames_in.idle_timeout = None  # the service may queue for a body slot; the call timeout applies
            Ready.from_wire(await frames_in.read_header(allow_error=True))
            for view in views:
                if view.nbytes:
                    await frames_out.body(view, self.chunk_bytes)
            self.counters.reveal.payload_bytes_sent += size
            return RevealReply.from_wire(await frames_in.read_header(allow_error=True))

        return await self._call("reveal", call, timeout if timeout is not None else self.timeouts["submit"])

    async def verify_task(
        self, wait_s: float, max_revealed: int, *, timeout: Optional[float] = None
    ) -> Tuple[CheckHeader, Optional[torch.Tensor], Optional[torch.Tensor], Optional[bytes]]:
        """A validator peer's request for a check (asyncloco/validator.py): ``(header, θ_base, update, revealed)``,
        or ``(header, None, None, None)`` when none was pending within ``wait_s``. ``revealed`` is None for a re-run
        from a fresh inner state; a revealed state above ``max_revealed`` bytes is refused before it is read."""
        request = CheckRequest(float(wait_s))

        async def call(frames_in: FrameReader, frames_out: FrameWriter) -> Tuple[CheckHeader, Optional[torch.Tensor], Optional[torch.Tensor], Optional[bytes]]:
            await frames_out.header(request.to_wire())
            frames_in.idle_timeout = None  # the coordinator holds the request up to wait_s; the call timeout applies
            header = CheckHeader.from_wire(await frames_in.read_header(allow_error=True))
            if header.empty:
                return header, None, None, None
            if header.numel != self.model_numel:
                raise ProtocolError(f"check of {header.numel} elements; this model has {self.model_numel}")
            if header.revealed is not None and header.revealed > max_revealed:
                raise ProtocolError(f"revealed state of {header.revealed} bytes; this model's inner state has at most {max_revealed}")
            frames_in.idle_timeout = self.idle_timeout
            nbytes = 4 * self.model_numel
            tensors = []
            for _ in range(2):  # θ at the base version, then the update as submitted: fp32, little-endian
                body = await frames_in.read_body(nbytes, allow_error=True)
                tensors.append(torch.frombuffer(body, dtype=torch.float32))
            revealed = None
            if header.revealed is not None:
                revealed = bytes(await frames_in.read_body(header.revealed, allow_error=True)) if header.revealed else b""
            self.counters.verify_task.payload_bytes_received += 2 * nbytes + (header.revealed or 0)
            return header, tensors[0], tensors[1], revealed

        limit = timeout if timeout is not None else wait_s + self.timeouts["get_model"]
        return await self._call("verify_task", call, limit)

    async def verdict(self, header: VerdictHeader, *, timeout: Optional[float] = None) -> VerdictReply:
        """Send a validator's verdict on the check it was lent."""

        async def call(frames_in: FrameReader, frames_out: FrameWriter) -> VerdictReply:
            await frames_out.header(header.to_wire())
            frames_in.idle_timeout = None  # the coordinator decides it under its lock; the call timeout applies
            return VerdictReply.from_wire(await frames_in.read_header(allow_error=True))

        return await self._call("verdict", call, timeout if timeout is not None else self.timeouts["assign"])

    async def _submit(self, frames_in: FrameReader, frames_out: FrameWriter, header: SubmitHeader, encoded: EncodedTensor) -> Ack:
        await frames_out.header(header.to_wire())
        frames_in.idle_timeout = None  # the service may queue for a body slot; the call timeout applies
        Ready.from_wire(await frames_in.read_header(allow_error=True))
        body = encoded.to_bytes()
        await frames_out.body(body, self.chunk_bytes)
        self.counters.submit.payload_bytes_sent += len(body)
        # the coordinator decodes, validates, applies and makes the update durable before it acks
        return Ack.from_wire(await frames_in.read_header(allow_error=True))
