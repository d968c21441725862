"""The coordinator's timed loops, each feeding the node (coordinator/node.py) with events: the 1-second
``Tick``, speed reports read from the run's records (the DHT: transport/records.py), revocations written by
``asyncloco coordinator token revoke`` (coordinator/admission.py), and the run's announcement in the records.

Every loop sleeps on the node's :class:`~asyncloco.clock.Clock` (the daemon's: the real one in a run, a
:class:`~asyncloco.clock.FakeClock` under the in-memory double, asyncloco/testing/memory.py, whose ``drive``
moves it) and ends promptly once its stop event is set (:func:`~asyncloco.clock.pause`). The records are read and
written through :class:`RunRecordsPort`: :class:`DhtRecords` over hivemind in a run, an in-memory store in the
tests; which speed records the logic is given (:func:`speed_events`) is decided here, once, for both.
coordinator/daemon.py starts the loops (:meth:`~asyncloco.coordinator.daemon.CoordinatorDaemon.loops`) next to the
RPC service and cancels them at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

from asyncloco.clock import Clock, pause
from asyncloco.config import RunConfig
from asyncloco.coordinator.admission import REVOKED_FILE, read_revoked
from asyncloco.coordinator.logic import Revoke, SpeedReport, Tick
from asyncloco.coordinator.monitoring import Stats
from asyncloco.coordinator.node import CoordinatorNode

if TYPE_CHECKING:
    from asyncloco.transport.records import CoordinatorAnnouncement, SpeedRecord

__all__ = [
    "DhtRecords", "RunRecordsPort", "announce_loop", "revocation_loop", "speed_events", "speed_loop", "tick_loop",
]

logger = logging.getLogger(__name__)


class RunRecordsPort(Protocol):
    """The run's records as the loops use them: the peers' signed speed records, the coordinator's announcement,
    and the records' own time (the time the records are stamped with: DHT time)."""

    def time(self) -> float: ...

    async def read_signed_speeds(self) -> list[tuple[str, "SpeedRecord"]]:
        """Every unexpired speed record with the fingerprint of the key that signed it."""
        ...

    async def reach(self, peers: list[str]) -> None:
        """Make silent ``peers`` reachable again for their records (best effort)."""
        ...

    async def announce(self, announcement: "CoordinatorAnnouncement", ttl_s: float) -> None: ...


class DhtRecords:
    """:class:`RunRecordsPort` over hivemind: ``records`` a transport.records.RunRecords, ``dht`` its node (None:
    silent peers are not pinged). Reads and writes run in a thread (they block on the DHT)."""

    def __init__(self, records: Any, dht: Any = None) -> None:
        self.records, self.dht = records, dht

    def time(self) -> float:
        from hivemind.utils import get_dht_time

        now: float = get_dht_time()
        return now

    async def read_signed_speeds(self) -> list[tuple[str, "SpeedRecord"]]:
        signed: list[tuple[str, SpeedRecord]] = await asyncio.to_thread(self.records.read_signed_speeds)
        return signed

    async def reach(self, peers: list[str]) -> None:
        if self.dht is not None:
            await asyncio.to_thread(self.dht.run_coroutine, partial(_ping_peers, peers))

    async def announce(self, announcement: "CoordinatorAnnouncement", ttl_s: float) -> None:
        await asyncio.to_thread(self.records.announce_coordinator, announcement, ttl_s)


async def _ping_peers(peer_ids: list[str], _dht: Any, node: Any) -> int:
    """Runs inside the DHT process (``dht.run_coroutine``): ping peers by id, so each side puts the other
    back in its routing table. Needed after a restart: the coordinator is the run's bootstrap node, comes
    back with an empty routing table under a new DHT node id, and the peers dropped the old one while it
    was down — so neither side's store/get reached the other and no speed report was seen again. The
    peers' p2p daemons are reachable by id alone once they have called an RPC (an open connection)."""
    from hivemind.p2p import PeerID

    found = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(peer)) for peer in peer_ids))
    return sum(node_id is not None for node_id in found)


async def tick_loop(node: CoordinatorNode, stop: asyncio.Event, period: float = 1.0) -> None:
    """A ``Tick`` every ``period`` seconds of the node's clock, the first at once: expiries, grace windows, silent peers."""
    while not stop.is_set():
        async with node.lock:
            await node.decide(Tick())
        await pause(node.clock, stop, period)


async def revocation_loop(node: CoordinatorNode, stop: asyncio.Event, period: float = 1.0) -> None:
    """Feed revocations written by ``asyncloco coordinator token revoke`` (revoked.json) to the logic."""
    seen_mtime = -1.0
    while not stop.is_set():
        try:
            mtime = (node.dir / REVOKED_FILE).stat().st_mtime
        except FileNotFoundError:
            mtime = -1.0
        if mtime != seen_mtime:
            try:
                revoked = read_revoked(node.dir)
                seen_mtime = mtime
            except ValueError as error:  # a half-edited file: try again next period
                logger.warning("%s", error)
                revoked = {}
            fresh = sorted((t, when) for t, when in revoked.items() if t not in node.state.revoked)
            if fresh:
                async with node.lock:
                    if not node.stopping:
                        for token_id, when in fresh:
                            await node.decide(Revoke(token_id, when))
        await pause(node.clock, stop, period)


def speed_events(node: CoordinatorNode, signed: list[tuple[str, "SpeedRecord"]]) -> list[tuple[SpeedReport, str]]:
    """The speed records the logic is given, as events (with each record's device), in a stable order: a record
    is taken only when it is signed by the key its claimed peer bound over its authenticated hello, and new (not a
    re-read of the last one taken). The logic refuses one from the future; silence is judged on ``Tick``
    (policy.peer_timeout). Call with the node's lock held."""
    events: list[tuple[SpeedReport, str]] = []
    for signer, report in sorted(signed, key=lambda item: (item[1].peer_id, item[0])):
        info = node.state.peers.get(report.peer_id)
        if info is None or info.signer != signer or (info.reported_at or -1.0) >= report.last_seen:
            continue  # nothing for the logic to take: no log record
        split = cast("tuple[float, float, float, float]", tuple(report.time_split)) if report.time_split is not None else None
        events.append((SpeedReport(report.peer_id, report.tokens_per_s, report.last_seen, signer, report.link_up,
                                   report.link_down, split), report.device))
    return events


async def speed_loop(node: CoordinatorNode, stats: Stats, cfg: RunConfig, records: RunRecordsPort, stop: asyncio.Event) -> None:
    """Speed reports from the run's records to the logic (:func:`speed_events`), every half report period of the
    node's clock; alive peers without a fresh record are reached for (``records.reach``: over the DHT, a ping —
    see ``_ping_peers``)."""
    period = cfg.runtime.speed_report_period
    while not stop.is_set():
        try:
            signed = await records.read_signed_speeds()
        except Exception as error:  # a DHT hiccup must not stop the coordinator; it retries next period
            logger.warning("could not read speed reports from the DHT: %r", error)
            signed = []
        now = records.time()
        fresh = {report.peer_id for _, report in signed if now - report.last_seen <= 3 * period}
        unseen = sorted(peer for peer, info in node.state.peers.items() if info.alive and peer not in fresh)
        if unseen:
            try:
                await asyncio.wait_for(records.reach(unseen), timeout=period * 2)
            except Exception as error:  # best effort; the peer may really be gone
                logger.debug("pinging %d silent peer(s) failed: %r", len(unseen), error)
        async with node.lock:
            for event, device in speed_events(node, signed):
                await node.decide(event)
                stats.peer(event.peer).device = device[:32]
        await pause(node.clock, stop, max(0.5, period / 2))


async def announce_loop(
    records: RunRecordsPort, stop: asyncio.Event, clock: Clock, cfg: RunConfig, peer_id: str, multiaddrs: list[str],
    numel: int, version: Callable[[], int],
) -> None:
    """The run's coordinator announcement in the records, refreshed every 30 s of ``clock`` (90 s expiry)."""
    from asyncloco.transport.records import CoordinatorAnnouncement

    while not stop.is_set():
        announcement = CoordinatorAnnouncement(
            peer_id=peer_id,
            multiaddrs=tuple(multiaddrs),
            run_id=cfg.runtime.run_id,
            model_numel=numel,
            codec=cfg.runtime.codec,
            version=version(),
            timestamp=records.time(),
        )
        try:
            await records.announce(announcement, 90.0)
        except Exception as error:  # retried next period
            logger.warning("could not announce the coordinator in the DHT: %r", error)
        await pause(clock, stop, 30.0)
