"""The coordinator logic's per-event indexes (a peer's leases, θ versions still needed, Eq. 2's in-flight steps,
the fastest alive speed) agree with a brute-force scan after every event of a random run, and a state restored
from a snapshot mid-run decides exactly as the original from then on."""

from __future__ import annotations

import io
import random

import pytest
import torch

from asyncloco.algo.outer import DelayedNesterov
from asyncloco.algo.staleness import DelayCompensation
from asyncloco.coordinator.logic import queries
from asyncloco.coordinator.logic import (
    Assign,
    CoordinatorPolicy,
    CoordinatorState,
    Fetched,
    PeerLeft,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    Tick,
    handle,
    new_state,
)

DIM = 6
PEERS = [f"p{i}" for i in range(7)]


def _state(needs_base: bool) -> CoordinatorState:
    policy = CoordinatorPolicy(
        max_local_steps=10, min_steps=1, grace_period=0.3, lease_timeout_factor=2.0, lease_slack=1.0,
        max_retained_versions=3,
    )
    transforms = [DelayCompensation(0.5)] if needs_base else []
    return new_state(torch.zeros(DIM), DelayedNesterov(0.5, 0.9, 3), transforms, policy, [50, 80, 20], seed=3)


def _check_indexes(state: CoordinatorState) -> None:
    for peer in PEERS:
        expected = [lease for lease in state.leases.values() if lease.peer == peer]
        assert queries.peer_leases(state, peer) == expected
    versions = {lease.base_version for lease in state.leases.values()} | set(state.base_params) | {state.version}
    for version in versions:
        expected_needed = any(
            lease.base_version == version and (state.needs_base_params or not lease.fetched)
            for lease in state.leases.values()
        )
        assert queries.version_needed(state, version) == expected_needed
    in_flight = [0] * len(state.shards)
    for lease in state.leases.values():
        in_flight[lease.shard] += lease.steps
    assert queries.in_flight(state) == in_flight
    alive = [info.speed for info in state.peers.values() if info.alive]
    if alive:
        assert queries.fastest_alive(state) == max(alive)


def _random_events(seed: int, count: int) -> list[tuple[float, object]]:
    """A replayable event stream: the events only name leases by (peer, the peer's n-th assignment)."""
    rng = random.Random(seed)
    out: list[tuple[float, object]] = []
    now = 0.0
    for peer in PEERS:
        out.append((now, SpeedReport(peer, rng.uniform(0.5, 4.0))))
    for _ in range(count):
        now += rng.uniform(0.0, 1.5)
        peer = rng.choice(PEERS)
        kind = rng.random()
        if kind < 0.12:
            out.append((now, SpeedReport(peer, rng.uniform(0.5, 4.0))))  # speeds change, peers come back
        elif kind < 0.17:
            out.append((now, PeerLeft(peer)))
        elif kind < 0.35:
            out.append((now, ("fetch", peer)))
        elif kind < 0.75:
            out.append((now, ("submit", peer)))
        elif kind < 0.9:
            out.append((now, RequestWork(peer)))
        else:
            out.append((now, Tick()))
    return out


def _apply(state: CoordinatorState, when: float, event: object) -> list[str]:
    """Resolve a symbolic event against ``state`` (the peer's newest lease) and handle it."""
    if isinstance(event, tuple):
        what, peer = event
        mine = [lease for lease in state.leases.values() if lease.peer == peer]
        if not mine:
            event = RequestWork(peer)
        elif what == "fetch":
            event = Fetched(peer, mine[-1].base_version)
        else:
            lease = mine[-1]
            update = torch.full((DIM,), 0.01 * lease.steps) + 0.001 * torch.arange(DIM)
            event = SubmitUpdate(peer, lease.lease_id, lease.base_version, update)
    _, actions = handle(state, event, when)
    return [repr(action) for action in actions]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("needs_base", [False, True])
def test_indexes_match_a_scan_and_survive_a_snapshot(needs_base: bool) -> None:
    events = _random_events(seed=11 if needs_base else 5, count=400)
    state = _state(needs_base)
    restored: CoordinatorState | None = None
    assigned = 0
    for i, (when, event) in enumerate(events):
        actions = _apply(state, when, event)
        assigned += sum(a.startswith("Assign(") for a in actions)
        _check_indexes(state)
        if restored is not None:
            assert _apply(restored, when, event) == actions  # the restored state decides identically
            _check_indexes(restored)
        if i in (100, 250):  # snapshot mid-run: a fresh state loads it and runs beside the original
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            buffer.seek(0)
            restored = _state(needs_base)
            restored.load_state_dict(torch.load(buffer, weights_only=True))
            _check_indexes(restored)
    assert restored is not None
    torch.testing.assert_close(restored.params, state.params, rtol=0, atol=0)
    assert restored.version == state.version > 20
    assert assigned > 100  # the run exercised issue/submit/give-back many times
    assert not isinstance(events[0][1], Assign)
