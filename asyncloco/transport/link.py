"""The transport seam between the peer runner, the coordinator daemon and the network.

Two sides, two implementations each:

* what a peer needs from its coordinator — :class:`CoordinatorLink` (``hello``, a lease request ``assign``,
  ``get_model``, ``submit``) and :class:`SpeedPublisher` (its speed report). Over hivemind:
  :class:`~asyncloco.transport.rpc.CoordinatorClient` and :class:`DhtSpeedPublisher` (a signed DHT record,
  :mod:`asyncloco.transport.records`). In memory (:mod:`asyncloco.testing.memory`): the same client on an
  in-memory stream double (:mod:`asyncloco.testing.memory_p2p`), and a speed publisher that hands the report
  to the daemon.
* what the daemon offers the network — :class:`~asyncloco.transport.rpc.CoordinatorHandler` (``assign``,
  ``get_model``, ``submit``, ``check_admitted``), served by
  :class:`~asyncloco.transport.rpc.CoordinatorService` over libp2p streams, or over in-memory streams in the
  same event loop by :class:`~asyncloco.testing.memory.MemoryTransport` (the same service).

Failures reach the peer as :class:`~asyncloco.transport.errors.TransportError` in both implementations
(:class:`~asyncloco.transport.errors.PeerUnreachable` for a lost connection, ``RemoteError`` for a refusal).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple, Union

import torch

from asyncloco.transport.codecs import EncodedTensor
from asyncloco.transport.wire import Ack, HelloReply, LeaseReply

__all__ = ["CoordinatorLink", "SpeedPublisher", "DhtSpeedPublisher"]

logger = logging.getLogger(__name__)


class CoordinatorLink(Protocol):
    """A peer's calls to its coordinator (signatures of :class:`~asyncloco.transport.rpc.CoordinatorClient`)."""

    async def hello(
        self, *, name: Optional[str] = None, token: Optional[str] = None, timeout: Optional[float] = None
    ) -> HelloReply: ...

    async def assign(
        self,
        tokens_per_s: Optional[float] = None,
        *,
        name: Optional[str] = None,
        token: Optional[str] = None,
        signer: Optional[str] = None,
        timeout: Optional[float] = None,
        keep: Optional[str] = None,
    ) -> LeaseReply: ...

    async def get_model(
        self, version: Optional[int] = None, *, codec: Optional[str] = None, timeout: Optional[float] = None
    ) -> Tuple[int, torch.Tensor]: ...

    async def submit(
        self,
        lease_id: str,
        base_version: int,
        pseudo_gradient: Union[torch.Tensor, EncodedTensor],
        *,
        codec: Optional[str] = None,
        inner_loss: Optional[float] = None,
        timeout: Optional[float] = None,
    ) -> Ack: ...


@dataclass(frozen=True)
class LinkReport:
    """What a speed report carries besides the throughput (transport/records.py ``SpeedRecord``): the link's bytes per
    second up and down as measured on the peer's real transfers (transport/linkspeed.py; None: not yet), and its time
    split — seconds computing, uploading, downloading, and its wall seconds since its first lease request
    (peer/summary.py ``time_split``; None: not yet)."""

    link_up: Optional[float] = None
    link_down: Optional[float] = None
    time_split: Optional[Tuple[float, float, float, float]] = None

    def fields(self) -> dict[str, Any]:
        """The set fields, bounded as the DHT record's schema takes them (rates in (0, 1e15), seconds in [0, 1e12))."""
        out: dict[str, Any] = {}
        for name in ("link_up", "link_down"):
            value = getattr(self, name)
            if value is not None and 0.0 < value < 1e15:
                out[name] = float(value)
        if self.time_split is not None and all(0.0 <= s < 1e12 for s in self.time_split):
            out["time_split"] = tuple(float(s) for s in self.time_split)
        return out


class SpeedPublisher(Protocol):
    """Publishes a peer's measured throughput (units per second) where its coordinator reads it."""

    @property
    def signer(self) -> Optional[str]:
        """The fingerprint of the key the reports are signed with (sent with lease requests), or None."""
        ...

    async def publish_speed(self, tokens_per_s: float, link: Optional["LinkReport"] = None) -> None: ...


class DhtSpeedPublisher:
    """The hivemind implementation: a signed :class:`~asyncloco.transport.records.SpeedRecord` in the DHT
    under the run id, valid for three report periods. Before each store the coordinator is pinged, so that
    it stays in this DHT client's routing table (it may have restarted with an empty one; see
    :func:`asyncloco.transport.dht.ping_peer`)."""

    def __init__(self, records: Any, coordinator_id: str, peer_id: str, device: str, software_version: str, period: float) -> None:
        self.records, self.coordinator_id, self.peer_id = records, coordinator_id, peer_id
        self.device, self.software_version, self.period = device, software_version, period

    @property
    def signer(self) -> Optional[str]:
        signer: Optional[str] = self.records.signer
        return signer

    async def publish_speed(self, tokens_per_s: float, link: Optional["LinkReport"] = None) -> None:
        from hivemind.utils import get_dht_time

        from asyncloco.transport.dht import ping_peer
        from asyncloco.transport.records import SpeedRecord

        report = SpeedRecord(
            peer_id=self.peer_id,
            tokens_per_s=float(tokens_per_s),
            device=self.device,
            software_version=self.software_version,
            last_seen=get_dht_time(),
            **(link.fields() if link is not None else {}),
        )
        await asyncio.to_thread(ping_peer, self.records.dht, self.coordinator_id, min(10.0, self.period))
        await asyncio.to_thread(self.records.publish_speed, report, 3 * self.period)
