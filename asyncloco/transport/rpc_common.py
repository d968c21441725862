"""What the coordinator's RPC service (transport/rpc.py) and client (transport/rpc_client.py) share: the
RPC names, their stream handle names and the traffic counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, Optional

__all__ = ["RPC_NAMES", "handle_name", "RpcTraffic", "TrafficCounters"]


RPC_NAMES = ("assign", "get_model", "submit", "reveal", "verify_task", "verdict")


def handle_name(namespace: Optional[str], rpc: str) -> str:
    return f"{namespace}::asyncloco.{rpc}" if namespace else f"asyncloco.{rpc}"


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
    verify_task: RpcTraffic = field(default_factory=RpcTraffic)  # validator peers (asyncloco/validator.py)
    verdict: RpcTraffic = field(default_factory=RpcTraffic)

    def as_dict(self) -> Dict[str, Dict[str, int]]:
        return {name: asdict(getattr(self, name)) for name in RPC_NAMES}
