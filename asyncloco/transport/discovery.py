"""Which run does this coordinator serve, and does this peer fit it? One tiny RPC outside every run's namespace.

The coordinator's RPCs live under the run id (``<run_id>.assign`` ...), so a peer started with the
wrong ``--run-id`` calls a handler that does not exist and, before this, waited out its whole connect
timeout without a word about run ids. :func:`serve_run_info` registers ``asyncloco.run_info`` (no
namespace) on the coordinator; :func:`ask_run_info` lets a peer learn the run id (and the coordinator's
software version) in one round trip, so it can refuse at once, naming the right run id — or, without
``--run-id``, simply join the run the coordinator serves.

The same call checks compatibility: a peer that built its model sends its fingerprint
(:mod:`asyncloco.fingerprint`) and software version, and the coordinator answers with the reason it
refuses the peer (empty when it fits).

Wire format: a hivemind ``ExpertRequest`` whose metadata is empty or a msgpack map
``{"fingerprint": {component: hash}, "software_version": str}``; an ``ExpertResponse`` whose metadata is
a msgpack map ``{"run_id": str, "software_version": str, "refused": str}``. Strings are bounded
(:data:`_MAX_CHARS`, the refusal 1,000 characters), a fingerprint has at most 8 components.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from asyncloco.transport.errors import PeerUnreachable, ProtocolError, RpcTimeout

__all__ = ["RUN_INFO_PROTOCOL", "FingerprintCheck", "RunInfo", "serve_run_info", "stop_serving_run_info", "ask_run_info"]

logger = logging.getLogger(__name__)

RUN_INFO_PROTOCOL = "asyncloco.run_info"
_MAX_CHARS = 128


FingerprintCheck = Callable[[str, Dict[str, str], str], Awaitable[Optional[str]]]
"""``check(peer_id, fingerprint, software_version)`` → the reason to refuse the peer, or None."""


def _unpack_map(metadata: bytes, what: str) -> Dict[str, Any]:
    try:
        raw: Any = msgpack.unpackb(metadata, raw=False)
    except (ValueError, msgpack.ExtraData) as error:
        raise ProtocolError(f"{what} is not msgpack: {error}") from error
    if not isinstance(raw, dict):
        raise ProtocolError(f"{what} must be a map, got {type(raw).__name__}")
    return raw


def _text(raw: Dict[str, Any], name: str, what: str, max_chars: int = _MAX_CHARS, empty: bool = False) -> str:
    value = raw.get(name)
    if not isinstance(value, str) or not (0 if empty else 1) <= len(value) <= max_chars:
        raise ProtocolError(f"{what} field {name!r} must be a string of at most {max_chars} characters, got {value!r}"[:300])
    return value


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    software_version: str
    refused: str = ""  # why the coordinator refuses the fingerprint the peer sent (empty: it fits, or none sent)

    @classmethod
    def from_wire(cls, metadata: bytes) -> "RunInfo":
        raw = _unpack_map(metadata, "run info")
        return cls(
            _text(raw, "run_id", "run info"),
            _text(raw, "software_version", "run info"),
            _text(raw, "refused", "run info", max_chars=1000, empty=True),
        )

    def to_wire(self) -> bytes:
        packed: bytes = msgpack.packb(
            {"run_id": self.run_id, "software_version": self.software_version, "refused": self.refused}
        )
        return packed


def _fingerprint_request(metadata: bytes) -> Optional[Tuple[Dict[str, str], str]]:
    if not metadata:
        return None
    raw = _unpack_map(metadata, "run info request")
    fingerprint = raw.get("fingerprint")
    if (
        not isinstance(fingerprint, dict)
        or not 0 < len(fingerprint) <= 8
        or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 32 and len(v) <= 64 for k, v in fingerprint.items())
    ):
        raise ProtocolError("run info request field 'fingerprint' must map at most 8 names to hashes")
    return dict(fingerprint), _text(raw, "software_version", "run info request")


async def serve_run_info(p2p: P2P, info: RunInfo, check: Optional[FingerprintCheck] = None) -> None:
    """Answer :func:`ask_run_info` on ``p2p`` until :func:`stop_serving_run_info`; ``check`` judges the
    fingerprints peers send (without it every fingerprint is accepted)."""

    async def handle(request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        presented = _fingerprint_request(request.metadata)
        refused = ""
        if presented is not None and check is not None:
            refused = (await check(context.remote_id.to_base58(), *presented) or "")[:1000]
        return runtime_pb2.ExpertResponse(metadata=replace(info, refused=refused).to_wire())

    await p2p.add_protobuf_handler(RUN_INFO_PROTOCOL, handle, runtime_pb2.ExpertRequest)


async def stop_serving_run_info(p2p: P2P) -> None:
    await p2p.remove_protobuf_handler(RUN_INFO_PROTOCOL)


async def ask_run_info(
    p2p: P2P,
    peer_id: str,
    timeout: float = 10.0,
    *,
    fingerprint: Optional[Dict[str, str]] = None,
    software_version: str = "",
) -> RunInfo:
    """The run ``peer_id`` coordinates (and, with ``fingerprint``, its verdict on this peer). Raises
    :class:`RpcTimeout`, :class:`PeerUnreachable` (not connected, or not an asyncloco coordinator) or
    :class:`ProtocolError` (a malformed answer)."""
    metadata = b""
    if fingerprint is not None:
        metadata = msgpack.packb({"fingerprint": fingerprint, "software_version": software_version})
    try:
        response = await asyncio.wait_for(
            p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id),
                RUN_INFO_PROTOCOL,
                runtime_pb2.ExpertRequest(metadata=metadata),
                runtime_pb2.ExpertResponse,
            ),
            timeout=timeout,
        )
    except asyncio.TimeoutError as error:
        raise RpcTimeout(f"{peer_id} did not say which run it serves within {timeout:.0f}s") from error
    except Exception as error:  # hivemind raises P2PDaemonError / P2PHandlerError / ControlFailure here
        raise PeerUnreachable(f"could not ask {peer_id} which run it serves: {error}") from error
    return RunInfo.from_wire(response.metadata)
