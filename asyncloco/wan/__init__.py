"""Emulating wide-area links: a userspace TCP fault proxy (latency, bandwidth, loss stalls, resets,
partitions) and network-namespace links with ``tc tbf`` bandwidth. See docs/wan.md."""

from asyncloco.wan.proxy import Direction, FaultProxy, LinkShape

__all__ = ["Direction", "FaultProxy", "LinkShape"]
