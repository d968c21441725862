"""Paper Fig. 3 on explicit timelines: A, B, C finish at 10.0, 10.4, 10.8 with grace 0.5.

"A and B will therefore use the same server model to start the new training jobs, while C will
start its own grace period." Checked offline (Algorithm 2/5 grouping), in the online coordinator
logic, and end to end in the fake-time simulator (docs/algorithm.md §6).
"""

from __future__ import annotations

import io
import json

import pytest
import torch

from asyncloco.algo.grace import Completion, grace_windows
from asyncloco.algo.outer import OuterSGD
from asyncloco.coordinator.logic import (
    Applied,
    Assign,
    CoordinatorPolicy,
    Hold,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    Tick,
    handle,
    new_state,
)

pytestmark = pytest.mark.timeout(60)

G = torch.tensor([1.0, -1.0])


def test_offline_windows_follow_fig3() -> None:
    a, b, c = Completion("A", 10.0), Completion("B", 10.4), Completion("C", 10.8)
    assert grace_windows([c, a, b], grace=0.5) == [[a, b], [c]]
    d = Completion("D", 10.9)  # inside C's own window (10.8 + 0.5), not A's
    assert grace_windows([a, b, c, d], grace=0.5) == [[a, b], [c, d]]
    assert grace_windows([a, b, c], grace=0.0) == [[a], [b], [c]]
    assert grace_windows([a, b, c], grace=1.0) == [[a, b, c]]
    assert grace_windows([], grace=0.5) == []


def _fig3_state():
    # fixed H = 10 steps, one unit per step: a lease at speed v takes 10 / v seconds
    policy = CoordinatorPolicy(max_local_steps=10, dylu=False, grace_period=0.5, units_per_step=1)
    state = new_state(torch.zeros(2), OuterSGD(1.0), [], policy, [1000], seed=0)
    leases = {}
    for peer, seconds_per_step in (("A", 1.0), ("B", 1.04), ("C", 1.08)):
        handle(state, SpeedReport(peer, 1.0 / seconds_per_step), 0.0)
        (assign,) = handle(state, RequestWork(peer), 0.0)[1]
        assert isinstance(assign, Assign)
        leases[peer] = assign.lease
    assert [round(leases[p].expected_finish, 9) for p in "ABC"] == [10.0, 10.4, 10.8]
    return state, leases


def _submit(state, lease, now):
    return handle(state, SubmitUpdate(lease.peer, lease.lease_id, lease.base_version, G), now)[1]


def test_online_logic_follows_fig3() -> None:
    state, leases = _fig3_state()
    (applied_a,) = _submit(state, leases["A"], 10.0)
    assert isinstance(applied_a, Applied) and applied_a.version == 1
    (hold_a,) = handle(state, RequestWork("A"), 10.0)[1]
    assert hold_a == Hold("A", 10.5, (leases["B"].lease_id,), hold_a.reason)  # waits for B only, not C

    t_b = leases["B"].expected_finish
    applied_b, release_a = _submit(state, leases["B"], t_b)
    assert isinstance(applied_b, Applied) and applied_b.version == 2
    assert isinstance(release_a, Assign) and release_a.peer == "A" and release_a.lease.base_version == 2
    (assign_b,) = handle(state, RequestWork("B"), t_b)[1]
    # B starts at once from the same server model as A: it does not open a window that waits for C
    assert isinstance(assign_b, Assign) and assign_b.lease.base_version == 2 and assign_b.lease.issued_at == t_b
    assert "settled grace window" in assign_b.reason

    assert handle(state, Tick(), 10.5)[1] == []  # the window's end passes with nobody held
    t_c = leases["C"].expected_finish
    (applied_c,) = _submit(state, leases["C"], t_c)
    assert applied_c.version == 3
    (assign_c,) = handle(state, RequestWork("C"), t_c)[1]
    # C starts its own grace period: nothing else is due within 0.5 s of 10.8, so it starts at once
    assert isinstance(assign_c, Assign) and assign_c.lease.base_version == 3
    assert "no active lease expected" in assign_c.reason
    assert state.window_end is None and state.held == {}


def test_online_logic_c_opens_its_own_window_for_d() -> None:
    state, leases = _fig3_state()
    handle(state, SpeedReport("D", 1.0 / 1.09), 0.0)
    (assign_d,) = handle(state, RequestWork("D"), 0.0)[1]
    lease_d = assign_d.lease  # due at 10.9: outside A's window, inside C's
    _submit(state, leases["A"], 10.0)
    handle(state, RequestWork("A"), 10.0)
    _submit(state, leases["B"], leases["B"].expected_finish)
    handle(state, RequestWork("B"), leases["B"].expected_finish)
    t_c = leases["C"].expected_finish
    _submit(state, leases["C"], t_c)
    (hold_c,) = handle(state, RequestWork("C"), t_c)[1]
    assert isinstance(hold_c, Hold) and hold_c.waiting_for == (lease_d.lease_id,)
    assert hold_c.until == pytest.approx(t_c + 0.5)
    applied_d, release_c = _submit(state, lease_d, lease_d.expected_finish)
    assert applied_d.version == 4 and release_c.peer == "C" and release_c.lease.base_version == 4
    (assign_d2,) = handle(state, RequestWork("D"), lease_d.expected_finish)[1]
    assert assign_d2.lease.base_version == 4


@pytest.mark.timeout(120)
def test_simulator_follows_fig3() -> None:
    from asyncloco.config import RunConfig
    from asyncloco.sim.engine import Simulation

    cfg = RunConfig.model_validate(
        {
            "task": {"dim": 8, "hidden": 8, "clusters_per_class": 2, "points": 1024, "eval_points": 64},
            "inner": {"lr": 1e-2, "min_lr": 1e-3, "total_steps_per_shard": 100},
            "schedule": {"max_local_steps": 10, "grace_period": 0.5},
            "sim": {"workers": 3, "profile": [1.0, 1.04, 1.08], "total_local_updates": 60, "eval_every": 30},
        }
    )
    trace = io.StringIO()
    Simulation(cfg, "async_dn").run(trace=trace)  # fixed H: A, B, C finish at 10.0, 10.4, 10.8
    tasks = [r for r in map(json.loads, trace.getvalue().splitlines()) if r["type"] == "task"]
    second = {t["worker"]: t for t in tasks[3:6]}
    assert second["w0"]["time"] == pytest.approx(10.4) and second["w1"]["time"] == pytest.approx(10.4)
    assert second["w0"]["base_version"] == second["w1"]["base_version"] == 2
    assert second["w2"]["time"] == pytest.approx(10.8) and second["w2"]["base_version"] == 3
