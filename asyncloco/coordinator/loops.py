"""The coordinator's timed loops, each feeding the node (coordinator/node.py) with events: the 1-second
``Tick``, speed reports read from the DHT (transport/records.py), revocations written by
``asyncloco coordinator token revoke`` (coordinator/admission.py), and the run's announcement in the DHT.
coordinator/daemon.py starts them next to the RPC service and cancels them at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any, Callable

from asyncloco.config import RunConfig
from asyncloco.coordinator.admission import REVOKED_FILE, read_revoked
from asyncloco.coordinator.logic import Revoke, SpeedReport, Tick
from asyncloco.coordinator.monitoring import Stats
from asyncloco.coordinator.node import CoordinatorNode

__all__ = ["announce_loop", "revocation_loop", "speed_loop", "tick_loop"]

logger = logging.getLogger(__name__)


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except asyncio.TimeoutError:
        pass


async def _ping_peers(peer_ids: list[str], _dht: Any, node: Any) -> int:
    """Runs inside the DHT process (``dht.run_coroutine``): ping peers by id, so each side puts the other
    back in its routing table. Needed after a restart: the coordinator is the run's bootstrap node, comes
    back with an empty routing table under a new DHT node id, and the peers dropped the old one while it
    was down — so neither side's store/get reached the other and no speed report was seen again. The
    peers' p2p daemons are reachable by id alone once they have called an RPC (an open connection)."""
    from hivemind.p2p import PeerID

    found = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(peer)) for peer in peer_ids))
    return sum(node_id is not None for node_id in found)


async def tick_loop(node: CoordinatorNode, stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with node.lock:
            await node.decide(Tick())
        await _pause(stop, 1.0)


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
        await _pause(stop, period)


async def speed_loop(node: CoordinatorNode, stats: Stats, cfg: RunConfig, records: Any, stop: asyncio.Event, dht: Any = None) -> None:
    """Speed reports from the DHT to the logic; silent peers are pinged (see ``_ping_peers``)."""
    from hivemind.utils import get_dht_time

    period = cfg.runtime.speed_report_period
    while not stop.is_set():
        try:
            signed = await asyncio.to_thread(records.read_signed_speeds)
        except Exception as error:  # a DHT hiccup must not stop the coordinator; it retries next period
            logger.warning("could not read speed reports from the DHT: %r", error)
            signed = []
        now_dht = get_dht_time()
        fresh = {report.peer_id for _, report in signed if now_dht - report.last_seen <= 3 * period}
        unseen = sorted(peer for peer, info in node.state.peers.items() if info.alive and peer not in fresh)
        if unseen and dht is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(dht.run_coroutine, partial(_ping_peers, unseen)), timeout=period * 2)
            except Exception as error:  # best effort; the peer may really be gone
                logger.debug("pinging %d silent peer(s) failed: %r", len(unseen), error)
        async with node.lock:
            # The logic takes a record only when it is signed by the key its claimed peer bound over its
            # authenticated hello, new (not a re-read), and not from the future; silence is judged on
            # Tick (policy.peer_timeout).
            for signer, report in sorted(signed, key=lambda item: (item[1].peer_id, item[0])):
                info = node.state.peers.get(report.peer_id)
                if info is None or info.signer != signer or (info.reported_at or -1.0) >= report.last_seen:
                    continue  # nothing for the logic to take: skip the log record
                split = tuple(report.time_split) if report.time_split is not None else None
                await node.decide(SpeedReport(report.peer_id, report.tokens_per_s, report.last_seen, signer,
                                              report.link_up, report.link_down, split))
                stats.peer(report.peer_id).device = report.device[:32]
        await _pause(stop, max(0.5, period / 2))


async def announce_loop(
    records: Any, stop: asyncio.Event, cfg: RunConfig, peer_id: str, multiaddrs: list[str], numel: int, version: Callable[[], int]
) -> None:
    """The run's coordinator announcement in the DHT, refreshed every 30 s (90 s expiry)."""
    from asyncloco.transport.records import CoordinatorAnnouncement
    from hivemind.utils import get_dht_time

    while not stop.is_set():
        announcement = CoordinatorAnnouncement(
            peer_id=peer_id,
            multiaddrs=tuple(multiaddrs),
            run_id=cfg.runtime.run_id,
            model_numel=numel,
            codec=cfg.runtime.codec,
            version=version(),
            timestamp=get_dht_time(),
        )
        try:
            await asyncio.to_thread(records.announce_coordinator, announcement, 90.0)
        except Exception as error:  # retried next period
            logger.warning("could not announce the coordinator in the DHT: %r", error)
        await _pause(stop, 30.0)
