"""Peers: what the coordinator knows of each (SpeedReport, Hello: its speed, link rates and signing key) and whether
it is still there (Tick: lease deadlines, hold limits, silent peers; PeerLeft; Restarted: the coordinator's own
downtime is not the peers' fault; Reconfigured: a restart under a config that decides differently), and the notice
when the live peers stop matching the outer optimizer's N."""

from __future__ import annotations

import json
import math

from asyncloco.coordinator.logic.events import (
    Action, Hello, Left, Notice, PeerLeft, Reconfigured, Released, Restarted, SpeedReport,
)
from asyncloco.coordinator.logic.indexes import note_speed
from asyncloco.coordinator.logic.leases import expire, give_back, note_link, transfer_allowance
from asyncloco.coordinator.logic.state import CoordinatorState, PeerInfo, install_decisions


# ------------------------------------------------------------------------------ SpeedReport, Hello


def on_speed(state: CoordinatorState, event: SpeedReport, now: float) -> list[Action]:
    """Take a throughput claim. The peer smooths its own measurements, so a new report replaces the
    old value (no second smoothing here); a record read again with the same timestamp is no new sample.
    Unless ``trust_speeds`` (the simulator), a DHT record counts only for a peer that said hello over its
    authenticated RPC and only when signed by the key it bound there, and never from the future."""
    speed = float(event.units_per_second)
    if not (math.isfinite(speed) and speed > 0):
        return []  # a bogus report never reaches DyLU; the peer keeps its previous speed
    info = state.peers.get(event.peer)
    if not state.policy.trust_speeds and event.signer is not None:
        if info is None or info.signer is None or info.signer != event.signer:
            return []  # about a peer that never said hello, or signed by a key that is not its own
    if event.reported_at is not None:
        if event.reported_at > now + state.policy.max_clock_skew:
            return []
        if info is not None and info.reported_at is not None and event.reported_at <= info.reported_at:
            return []
    if info is None or not info.alive:
        keep = info if info is not None else PeerInfo(speed, now)
        keep.speed, keep.last_seen, keep.alive, keep.reported_at = speed, now, True, event.reported_at
        _note_link(keep, event)
        state.peers[event.peer] = keep
        note_speed(state, event.peer)
        return []
    info.speed, info.last_seen = speed, now
    if event.reported_at is not None:
        info.reported_at = event.reported_at
    _note_link(info, event)
    note_speed(state, event.peer)
    return []


def _note_link(info: PeerInfo, event: SpeedReport) -> None:
    """Keep the link rates and time split a speed report carries (finite and positive / non-negative, else kept)."""
    note_link(info, event.link_up, event.link_down)
    split = event.time_split
    if split is not None and len(split) == 4 and all(math.isfinite(s) and s >= 0 for s in split):
        info.time_split = (float(split[0]), float(split[1]), float(split[2]), float(split[3]))


def on_hello(state: CoordinatorState, event: Hello, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    speed = event.units_per_second
    if info is None:
        if speed is None or not (math.isfinite(speed) and speed > 0):
            return []  # registered once it reports a usable speed
        info = state.peers[event.peer] = PeerInfo(float(speed), now)
    elif speed is not None and math.isfinite(speed) and speed > 0:
        info.speed = float(speed)
    info.alive, info.last_seen = True, now
    note_speed(state, event.peer)
    info.signer = event.signer  # the authenticated peer itself re-binds its key (a restart makes a new one)
    info.name = event.name[:64]
    return []


# ----------------------------------------------------------------------- Tick, PeerLeft, Restarted


def on_tick(state: CoordinatorState, now: float) -> list[Action]:
    actions = expire(state, now)
    policy = state.policy
    for peer, since in list(state.held.items()):
        if now - since > policy.hold_limit:
            del state.held[peer]
            actions.append(Released(peer, f"held {now - since:.0f} s, longer than the hold limit {policy.hold_limit:g} s; ask again"))
    if math.isfinite(policy.peer_timeout):
        # A peer with a lease in hand or a held request is judged by its lease's deadline (which allows for its
        # measured transfer time), not by its speed reports: those travel through the DHT and may not reach
        # the coordinator over a slow or lossy link (a peer behind a latency spike was declared gone mid-lease
        # over and over when silence counted for it too).
        busy = {lease.peer for lease in state.leases.values()} | set(state.held)
        for peer, info in sorted(state.peers.items()):
            if info.alive and peer not in busy and now - info.last_seen > policy.peer_timeout:
                actions += on_peer_left(state, PeerLeft(peer), now)
                actions.append(Left(peer, f"no report, request or submission for {now - info.last_seen:.0f} s (limit {policy.peer_timeout:g} s)"))
    return actions


def on_peer_left(state: CoordinatorState, event: PeerLeft, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    if info is not None:
        info.alive = False
    state.held.pop(event.peer, None)
    actions: list[Action] = []
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == event.peer:
            actions += give_back(state, lease, "peer left")
    return actions


def on_reconfigured(state: CoordinatorState, event: Reconfigured) -> list[Action]:
    """A restart's new policy and hyper-parameters decide from here on (the optimizer's and transforms' state kept)."""
    changes = install_decisions(state, json.loads(event.decisions))
    return [Notice("restarted with a config that decides differently from here on: " + "; ".join(changes))]


def on_restarted(state: CoordinatorState, event: Restarted, now: float) -> list[Action]:
    state.held.clear()
    state.window_end = None
    for info in state.peers.values():
        info.last_seen = max(info.last_seen, now + event.grace_s)
    # The downtime is not the peers' fault: a lease whose θ was not downloaded (nor held) could not start, so it gets
    # its whole time again. One in training may have finished during the downtime and be resending: from the restart
    # it gets what its deadline allowed after the compute — the slack and its transfer time (its update goes up again)
    # — and at least the grace. (34-44 s restarts under load had expired such leases and refused their updates 0.4-5 s
    # after the resume. With the grace alone, resends came 10-12 s after a 15 s restart on a loaded machine — a peer's
    # resends are up to 10 s apart and its dials to the new listener held back by libp2p's dial backoff — and a CI
    # run saw one refused as an expired lease.)
    policy = state.policy
    for lease in state.leases.values():
        if not (lease.fetched or lease.held):
            lease.expected_finish = max(lease.expected_finish, now + lease.expected_finish - lease.issued_at)
            lease.deadline = max(lease.deadline, now + lease.deadline - lease.issued_at)
        owner = state.peers.get(lease.peer)
        after = policy.lease_slack + (transfer_allowance(policy, owner) if owner is not None else policy.transfer_allowance_s)
        lease.deadline = max(lease.deadline, now + min(max(event.grace_s, after), policy.max_lease_s))
    for key in ("deadline", "expected_finish"):
        state.indexes.lease_indexes.pop(key, None)  # rebuilt from the table on its next query
    return []


def notice_peer_count(state: CoordinatorState) -> list[Action]:
    """Tell the organiser when the live peers stop matching the outer optimizer's N. N stays as configured
    (changing it mid-run would change the method); fewer peers than N make DN's momentum step rarer (every N
    arrivals), more peers make it more frequent relative to each peer's rounds. docs/algorithm.md."""
    n = state.policy.buffer_size
    if n is None:
        return []
    live = sum(1 for info in state.peers.values() if info.alive)
    if live == state.noticed_peers:
        return []
    previous, state.noticed_peers = state.noticed_peers, live
    if live == n or live == 0 or (previous != n and previous > 0 and (previous < n) == (live < n)):
        return []
    relation = "fewer" if live < n else "more"
    return [Notice(f"{live} live peer(s), {relation} than the outer optimizer's N = {n} (outer.buffer_size): "
                   "the DN buffer steps every N arrivals; set outer.buffer_size to the number of peers you expect")]
