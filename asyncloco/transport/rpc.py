"""Coordinator RPCs over hivemind P2P: ``assign``, ``get_model`` (streamed θ), ``submit`` (streamed update).

Server side: :class:`CoordinatorService` (a hivemind ``ServicerBase``, ``rpc_*`` convention) wraps an
injected :class:`CoordinatorHandler` that owns all business logic. Client side: :class:`CoordinatorClient`.

- ``assign`` (unary): msgpack map in, lease map out. The caller's peer id comes from the authenticated
  libp2p stream (``context.remote_id``), never from the payload.
- ``get_model`` (unary request, streamed response): request ``{"version": int | None, "codec": str}``;
  response header ``{"version", "codec", "numel"}`` then the body in chunks. Codec negotiable among the
  service's ``model_codecs`` (default ``("none", "bf16")``).
- ``submit`` (bidirectional stream): the client sends the header ``{"lease_id", "base_version", "codec",
  "numel"}``; the service checks it and answers ``{"ready": true}`` (or fails the call); only then the
  client sends the body in chunks; the service answers with the ack
  ``{"accepted": bool, "version": int, "reason": str, "duplicate": bool, ...}``. The extra round trip
  makes a refused header (wrong model size, codec) a clean :class:`RemoteError` instead of a reset.

Both receivers check the header's ``numel`` against the locally known model size and the codec against
the allowed set *before* allocating exactly ``wire_bytes(codec, numel)`` bytes, and refuse extra bytes.
Framing and byte accounting: :mod:`asyncloco.transport.framing`. Errors: :mod:`asyncloco.transport.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Awaitable, Dict, Optional, Protocol, Sequence, Tuple, TypeVar, Union

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError, P2PHandlerError
from hivemind.proto import runtime_pb2

from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.errors import (
    CodecError,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    RpcTimeout,
    TransportError,
)
from asyncloco.transport.framing import (
    CHUNK_BYTES,
    BodyAssembler,
    chunk_buffer,
    chunk_messages,
    framed_size,
    pack_header,
    unpack_header,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CoordinatorHandler",
    "CoordinatorService",
    "CoordinatorClient",
    "RpcTraffic",
    "TrafficCounters",
    "ACK_FIELDS",
]

ACK_FIELDS: Dict[str, type] = {"accepted": bool, "version": int, "reason": str, "duplicate": bool}
MAX_LEASE_ID_CHARS = 128
READY = pack_header({"ready": True})  # the service's answer to an acceptable submit header
T = TypeVar("T")


class CoordinatorHandler(Protocol):
    """The coordinator's business logic, injected into :class:`CoordinatorService`."""

    async def assign(self, request: Dict[str, Any], peer_id: str) -> Dict[str, Any]:
        """Return a lease map (msgpack-able: lease_id, base_version, shard, steps, lr offset, deadline...).
        May wait (e.g. a grace period); clients should set their assign timeout above that wait."""
        ...

    async def get_model(self, version: Optional[int]) -> Tuple[int, torch.Tensor]:
        """Return ``(version, θ)``; θ flat fp32 CPU of the model's numel, not mutated while being sent
        (return a snapshot). ``version=None`` means the latest; raise to refuse an unknown version."""
        ...

    async def submit(
        self, lease_id: str, base_version: int, pseudo_gradient: EncodedTensor, peer_id: str
    ) -> Dict[str, Any]:
        """Validate and apply (or refuse) an update; return an ack with at least :data:`ACK_FIELDS`.
        ``pseudo_gradient`` has been checked for codec and exact sizes; ``decode(pg, numel)`` cannot fail
        on size, finiteness and norm are the handler's checks. Must be idempotent by ``lease_id``."""
        ...


@dataclass
class RpcTraffic:
    """Counters of one RPC on one side. ``bytes_*``: framed protobuf bytes (see framing); ``payload_*``:
    codec bytes of tensor bodies alone (equal to ``wire_bytes(codec, numel)`` per transfer)."""

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

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        return {name: asdict(getattr(self, name)) for name in ("assign", "get_model", "submit")}


def _require(header: Dict[str, Any], name: str, kind: Union[type, Tuple[type, ...]]) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(f"header field {name!r} must be {kind}, got {value!r}")
    return value


def _check_ack(ack: Any) -> Dict[str, Any]:
    if not isinstance(ack, dict):
        raise ProtocolError(f"ack must be a map, got {type(ack).__name__}")
    for name, kind in ACK_FIELDS.items():
        _require(ack, name, kind)
    return ack


class CoordinatorService(ServicerBase):
    """Serves a :class:`CoordinatorHandler` on a P2P instance.

    :param model_numel: number of elements of θ; every body is checked against it before allocation.
    :param submit_codecs: codecs accepted for pseudo-gradients (usually just the run's codec).
    :param model_codecs: codecs offered for θ downloads.
    :param max_concurrent_submits: bounds memory: each submit in flight holds one encoded body.

    Usage: ``await service.add_p2p_handlers(p2p, namespace=run_id)``; remove with
    ``await service.remove_p2p_handlers(p2p, namespace=run_id)`` before ``p2p.shutdown()``.
    """

    def __init__(
        self,
        handler: CoordinatorHandler,
        model_numel: int,
        *,
        submit_codecs: Sequence[str] = CODECS,
        model_codecs: Sequence[str] = ("none", "bf16"),
        chunk_bytes: int = CHUNK_BYTES,
        max_concurrent_submits: int = 4,
        counters: Optional[TrafficCounters] = None,
    ) -> None:
        for codec in (*submit_codecs, *model_codecs):
            wire_bytes(codec, model_numel)  # raises CodecError on an unknown codec or bad numel
        self.handler, self.model_numel = handler, model_numel
        self.submit_codecs, self.model_codecs = tuple(submit_codecs), tuple(model_codecs)
        self.chunk_bytes = chunk_bytes
        self.counters = counters if counters is not None else TrafficCounters()
        self._submit_slots = asyncio.Semaphore(max_concurrent_submits)

    async def rpc_assign(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        traffic = self.counters.assign
        traffic.calls += 1
        traffic.bytes_received += request.ByteSize()
        peer_id = context.remote_id.to_base58()
        try:
            lease = await self.handler.assign(unpack_header(request.metadata), peer_id)
            response = runtime_pb2.ExpertResponse(metadata=pack_header(lease))
        except BaseException:
            traffic.failures += 1
            raise
        traffic.bytes_sent += response.ByteSize()
        return response

    async def rpc_get_model(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        traffic = self.counters.get_model
        traffic.calls += 1
        traffic.bytes_received += request.ByteSize()
        try:
            asked = unpack_header(request.metadata)
            codec = _require(asked, "codec", str)
            version = asked.get("version")
            if codec not in self.model_codecs:
                raise ProtocolError(f"codec {codec!r} not offered for the model; choose one of {self.model_codecs}")
            if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
                raise ProtocolError(f"version must be a non-negative int or None, got {version!r}")
            served_version, theta = await self.handler.get_model(version)
            if theta.numel() != self.model_numel:
                raise ValueError(f"handler returned {theta.numel()} elements, the service expects {self.model_numel}")
            encoded = await asyncio.to_thread(encode, codec, theta)
            body = encoded.to_bytes()
            header = runtime_pb2.ExpertResponse(
                metadata=pack_header({"version": served_version, "codec": codec, "numel": self.model_numel})
            )
            traffic.bytes_sent += framed_size(header)
            yield header
            for message in chunk_messages(body, runtime_pb2.ExpertResponse, self.chunk_bytes):
                traffic.bytes_sent += framed_size(message)
                yield message
            traffic.payload_bytes_sent += len(body)
            logger.debug("get_model: sent v%s (%s, %d B) to %s", served_version, codec, len(body), context.remote_id)
        except BaseException:
            traffic.failures += 1
            raise

    async def rpc_submit(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        traffic = self.counters.submit
        traffic.calls += 1
        peer_id = context.remote_id.to_base58()
        try:
            first = await anext(requests, None)
            if first is None:
                raise ProtocolError("submit stream ended before its header")
            traffic.bytes_received += framed_size(first)
            lease_id, base_version, codec, numel = self._check_submit_header(unpack_header(first.metadata))
            # Answer the header before the body is sent: a refusal here reaches the client cleanly
            # instead of resetting a stream it is still writing to.
            ready = runtime_pb2.ExpertResponse(metadata=READY)
            traffic.bytes_sent += framed_size(ready)
            yield ready
            async with self._submit_slots:
                assembler = BodyAssembler(wire_bytes(codec, numel))
                async for message in requests:
                    traffic.bytes_received += framed_size(message)
                    assembler.add(chunk_buffer(message))
                body = assembler.finish()
                traffic.payload_bytes_received += len(body)
                pseudo_gradient = EncodedTensor.from_bytes(codec, numel, body)
                ack = _check_ack(await self.handler.submit(lease_id, base_version, pseudo_gradient, peer_id))
            response = runtime_pb2.ExpertResponse(metadata=pack_header(ack))
            traffic.bytes_sent += framed_size(response)
            yield response
        except BaseException:
            traffic.failures += 1
            raise

    def _check_submit_header(self, header: Dict[str, Any]) -> Tuple[str, int, str, int]:
        lease_id = _require(header, "lease_id", str)
        base_version = _require(header, "base_version", int)
        codec = _require(header, "codec", str)
        numel = _require(header, "numel", int)
        if len(lease_id) > MAX_LEASE_ID_CHARS or base_version < 0:
            raise ProtocolError("lease_id too long or negative base_version")
        if codec not in self.submit_codecs:
            raise ProtocolError(f"codec {codec!r} not accepted; this run accepts {self.submit_codecs}")
        if numel != self.model_numel:
            raise ProtocolError(f"pseudo-gradient declares numel={numel}, the model has {self.model_numel}")
        return lease_id, base_version, codec, numel


class CoordinatorClient:
    """Calls a coordinator's :class:`CoordinatorService`. All methods are coroutines on the P2P's loop.

    :param p2p: this peer's ``hivemind.P2P`` (e.g. ``await dht.replicate_p2p()``).
    :param coordinator_peer_id: the pinned coordinator; libp2p authenticates it on connect.
    :param model_numel: the model size from the run config / announcement; bodies are checked against it.
    :param timeouts: defaults per call in seconds. ``assign`` must exceed the coordinator's grace hold;
        ``get_model``/``submit`` about 3x the transfer time at your slowest expected bandwidth.
    :param liveness_period: while a call runs, check this often that the connection to the coordinator is
        still open, and fail the call (:class:`PeerUnreachable`) once it is gone. hivemind's p2pd does not
        end a stream whose connection died (a SIGKILLed or crashed coordinator): without this check a peer
        waiting for the submit READY/ack or a held lease sat out the whole timeout (10 min for submit),
        by which time its lease had expired and its work was lost.
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
        counters: Optional[TrafficCounters] = None,
        liveness_period: float = 1.0,
    ) -> None:
        if isinstance(coordinator_peer_id, str):
            coordinator_peer_id = PeerID.from_base58(coordinator_peer_id)
        wire_bytes("none", model_numel)  # validates model_numel
        self.p2p, self.coordinator_peer_id, self.model_numel = p2p, coordinator_peer_id, model_numel
        self.chunk_bytes = chunk_bytes
        self.timeouts = {"assign": assign_timeout, "get_model": get_model_timeout, "submit": submit_timeout}
        self.liveness_period = liveness_period
        self.counters = counters if counters is not None else TrafficCounters()
        self._stub: Any = CoordinatorService.get_stub(p2p, coordinator_peer_id, namespace=namespace)

    async def _call(self, name: str, call: Awaitable[T], timeout: Optional[float]) -> T:
        traffic: RpcTraffic = getattr(self.counters, name)
        traffic.calls += 1
        limit = self.timeouts[name] if timeout is None else timeout
        try:
            return await asyncio.wait_for(self._while_connected(name, call), timeout=limit)
        except asyncio.TimeoutError:
            traffic.failures += 1
            raise RpcTimeout(f"{name} to {self.coordinator_peer_id} timed out after {limit:.1f} s") from None
        except P2PHandlerError as error:
            traffic.failures += 1
            raise RemoteError(str(error)) from None
        except (P2PDaemonError, ConnectionError, asyncio.IncompleteReadError, OSError) as error:
            traffic.failures += 1
            raise PeerUnreachable(f"{name} to {self.coordinator_peer_id}: {error!r}") from error
        except TransportError:
            traffic.failures += 1
            raise

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

    async def assign(self, request: Dict[str, Any], *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Ask for a lease. ``request`` is a msgpack-able map (e.g. ``{"tokens_per_s": 1e4}``)."""
        return await self._call("assign", self._assign(request), timeout)

    async def _assign(self, request: Dict[str, Any]) -> Dict[str, Any]:
        message = runtime_pb2.ExpertRequest(metadata=pack_header(request))
        self.counters.assign.bytes_sent += message.ByteSize()
        response = await self._stub.rpc_assign(message)
        self.counters.assign.bytes_received += response.ByteSize()
        return unpack_header(response.metadata)

    async def get_model(
        self, version: Optional[int] = None, *, codec: str = "none", timeout: Optional[float] = None
    ) -> Tuple[int, torch.Tensor]:
        """Download θ (``version=None``: the latest) as ``(version, flat fp32 tensor)``."""
        return await self._call("get_model", self._get_model(version, codec), timeout)

    async def _get_model(self, version: Optional[int], codec: str) -> Tuple[int, torch.Tensor]:
        traffic = self.counters.get_model
        request = runtime_pb2.ExpertRequest(metadata=pack_header({"version": version, "codec": codec}))
        traffic.bytes_sent += request.ByteSize()
        stream = await self._stub.rpc_get_model(request)
        async with contextlib.aclosing(stream):
            first = await anext(stream, None)
            if first is None:
                raise ProtocolError("get_model stream ended before its header")
            traffic.bytes_received += framed_size(first)
            header = unpack_header(first.metadata)
            served_version = _require(header, "version", int)
            if _require(header, "codec", str) != codec or _require(header, "numel", int) != self.model_numel:
                raise ProtocolError(f"get_model header {header} does not match codec={codec!r} numel={self.model_numel}")
            assembler = BodyAssembler(wire_bytes(codec, self.model_numel))
            async for message in stream:
                traffic.bytes_received += framed_size(message)
                assembler.add(chunk_buffer(message))
            body = assembler.finish()
        traffic.payload_bytes_received += len(body)
        encoded = EncodedTensor.from_bytes(codec, self.model_numel, body)
        return served_version, await asyncio.to_thread(decode, encoded, self.model_numel)

    async def submit(
        self,
        lease_id: str,
        base_version: int,
        pseudo_gradient: Union[torch.Tensor, EncodedTensor],
        *,
        codec: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Upload a pseudo-gradient; returns the coordinator's ack (:data:`ACK_FIELDS`). Pass a tensor and
        ``codec``, or an :class:`EncodedTensor` (keep it to resend the exact bytes after a failure)."""
        if isinstance(pseudo_gradient, torch.Tensor):
            if codec is None:
                raise ValueError("submit(tensor) needs codec=...; or pass an EncodedTensor")
            pseudo_gradient = await asyncio.to_thread(encode, codec, pseudo_gradient)
        elif codec is not None and codec != pseudo_gradient.codec:
            raise ValueError(f"codec={codec!r} contradicts the EncodedTensor's {pseudo_gradient.codec!r}")
        if pseudo_gradient.numel != self.model_numel:
            raise CodecError(f"pseudo-gradient has {pseudo_gradient.numel} elements, the model {self.model_numel}")
        return await self._call("submit", self._submit(lease_id, base_version, pseudo_gradient), timeout)

    async def _submit(self, lease_id: str, base_version: int, encoded: EncodedTensor) -> Dict[str, Any]:
        traffic = self.counters.submit
        header = {"lease_id": lease_id, "base_version": base_version, "codec": encoded.codec, "numel": encoded.numel}
        body = encoded.to_bytes()
        ready = asyncio.Event()

        async def messages() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            first = runtime_pb2.ExpertRequest(metadata=pack_header(header))
            traffic.bytes_sent += framed_size(first)
            yield first
            await ready.wait()  # the service accepted the header (or refused it: then we are cancelled)
            for message in chunk_messages(body, runtime_pb2.ExpertRequest, self.chunk_bytes):
                traffic.bytes_sent += framed_size(message)
                yield message
            traffic.payload_bytes_sent += len(body)

        stream = await self._stub.rpc_submit(messages())
        async with contextlib.aclosing(stream):
            go = await anext(stream, None)
            if go is None or go.metadata != READY:
                raise ProtocolError("submit: the service did not acknowledge the header")
            traffic.bytes_received += framed_size(go)
            ready.set()
            response = await anext(stream, None)
            if response is None:
                raise ProtocolError("submit: stream ended without an ack")
            traffic.bytes_received += framed_size(response)
        return _check_ack(unpack_header(response.metadata))
