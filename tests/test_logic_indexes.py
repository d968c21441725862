"""The coordinator's sorted lease indexes (grace windows, expiry) answer exactly what a scan over every
lease answers, through issues, applications, give-backs and a checkpoint reload."""

from __future__ import annotations

import random

import pytest
import torch

from asyncloco.algo.outer import OuterSGD
from asyncloco.coordinator.logic import queries
from asyncloco.coordinator.logic import Assign, CoordinatorPolicy, PeerLeft, RequestWork, SpeedReport, SubmitUpdate, Tick, handle, new_state

pytestmark = pytest.mark.timeout(60)


def _scan(state, key: str, bound: float, strict: bool) -> list[str]:
    return sorted(lid for lid, l in state.leases.items() if (getattr(l, key) < bound if strict else getattr(l, key) <= bound))


def _check(state, now: float) -> None:
    for bound in (now, now + 0.5, now + 3.0, now + 50.0):
        assert list(queries.expected_in_window(state, bound)) == _scan(state, "expected_finish", bound, False)
        assert sorted(queries.leases_due(state, "deadline", bound, strict=True)) == _scan(state, "deadline", bound, True)


def test_indexes_match_a_full_scan_on_a_random_run() -> None:
    rng = random.Random(3)
    policy = CoordinatorPolicy(max_local_steps=8, grace_period=0.5, units_per_step=1, lease_timeout_factor=1.5, lease_slack=1.0)
    state = new_state(torch.zeros(3), OuterSGD(0.1), [], policy, [500, 500], seed=1)
    peers = [f"p{i}" for i in range(12)]
    current: dict[str, object] = {}
    now = 0.0
    kinds: set[str] = set()
    for peer in peers:
        handle(state, SpeedReport(peer, rng.uniform(0.5, 4.0)), now)
    for step in range(600):
        now += rng.uniform(0.0, 0.7)
        peer = rng.choice(peers)
        roll = rng.random()
        if roll < 0.45:
            event = RequestWork(peer)
        elif roll < 0.8 and peer in current:
            lease = current.pop(peer)
            event = SubmitUpdate(peer, lease.lease_id, lease.base_version, torch.full((3,), 0.01))
        elif roll < 0.85:
            event = PeerLeft(peer)
            current.pop(peer, None)
        elif roll < 0.9:
            event = SpeedReport(peer, rng.uniform(0.5, 4.0))
        else:
            event = Tick()
        for action in handle(state, event, now)[1]:
            kinds.add(type(action).__name__)
            if isinstance(action, Assign):
                current[action.peer] = action.lease
        _check(state, now)
        if step == 300:  # a checkpoint reload replaces the lease table: the indexes follow
            snapshot = state.state_dict()
            state.load_state_dict(snapshot)
            _check(state, now)
    assert state.version > 10 and len(state.leases) > 0
    assert {"Applied", "Expired", "Hold", "Assign"} <= kinds  # every path that adds or removes leases ran
