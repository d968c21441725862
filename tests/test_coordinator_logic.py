"""Decision tables for the coordinator's brain ``handle(state, event, now)``, with an explicit clock.

Every scenario feeds events at chosen times and asserts the exact actions (and θ where it moves).
No sleeps: time is just the ``now`` argument.
"""

from __future__ import annotations

import io
import json
import math
from typing import Sequence

import pytest
import torch

from asyncloco.algo.outer import AsyncBuffer, DelayedNesterov, OuterSGD
from asyncloco.algo.staleness import AsyncAwareLR, DelayCompensation, PolyDiscount, StalenessTransform
from asyncloco.coordinator.logic import (
    Applied,
    Assign,
    CoordinatorPolicy,
    CoordinatorState,
    Duplicate,
    Expired,
    Hold,
    PeerLeft,
    Rejected,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    Tick,
    handle,
    new_state,
)

pytestmark = pytest.mark.timeout(30)

DIM = 4


def policy(**overrides) -> CoordinatorPolicy:
    base = dict(max_local_steps=10, min_steps=1, grace_period=0.0, units_per_step=1, lease_timeout_factor=3.0, lease_slack=5.0)
    base.update(overrides)
    return CoordinatorPolicy(**base)


def make_state(
    pol: CoordinatorPolicy | None = None,
    optimizer=None,
    transforms: Sequence[StalenessTransform] = (),
    shard_sizes: Sequence[int] = (1000,),
    seed: int = 0,
) -> CoordinatorState:
    return new_state(torch.zeros(DIM), optimizer or OuterSGD(0.5), transforms, pol or policy(), shard_sizes, seed)


def do(state: CoordinatorState, event, now: float) -> list:
    returned, actions = handle(state, event, now)
    assert returned is state
    for action in actions:
        assert isinstance(action.reason, str) and action.reason.strip(), action
    return actions


def join(state: CoordinatorState, peer: str, speed: float, now: float = 0.0) -> None:
    assert do(state, SpeedReport(peer, speed), now) == []


def lease_of(action) -> object:
    assert isinstance(action, Assign), action
    return action.lease


def submit(state, lease, g, now, peer=None, base_version=None):
    event = SubmitUpdate(peer or lease.peer, lease.lease_id, lease.base_version if base_version is None else base_version, g)
    return do(state, event, now)


G = torch.tensor([1.0, 2.0, 3.0, 4.0])


# ------------------------------------------------------------------------------ speed and assign


def test_request_before_speed_report_is_rejected_and_bogus_speeds_are_ignored() -> None:
    state = make_state()
    (action,) = do(state, RequestWork("a"), 0.0)
    assert isinstance(action, Rejected) and action.peer == "a" and "speed" in action.reason
    for bogus in (0.0, -3.0, math.nan, math.inf):
        assert do(state, SpeedReport("a", bogus), 0.0) == []
    assert "a" not in state.peers
    (action,) = do(state, RequestWork("a"), 0.0)
    assert isinstance(action, Rejected)


def test_assign_fields() -> None:
    state = make_state(policy(units_per_step=4))
    join(state, "a", 8.0)  # 2 steps/s
    join(state, "b", 4.0)  # 1 step/s
    (first,) = do(state, RequestWork("a"), 1.0)
    lease = lease_of(first)
    assert (lease.peer, lease.shard, lease.start_offset, lease.steps, lease.lr_offset, lease.base_version) == ("a", 0, 0, 10, 0, 0)
    assert lease.lease_id == "L00000001"
    assert lease.issued_at == 1.0
    assert lease.expected_finish == pytest.approx(1.0 + 10 * 4 / 8.0)  # 6.0
    assert lease.deadline == pytest.approx(1.0 + 5.0 * 3.0 + 5.0)  # duration × factor + slack
    (second,) = do(state, RequestWork("b"), 2.0)
    lease_b = lease_of(second)
    assert (lease_b.start_offset, lease_b.steps, lease_b.lr_offset) == (10, 5, 10)
    assert lease_b.expected_finish == pytest.approx(2.0 + 5 * 4 / 4.0)
    assert state.shards[0].assigned == 15 and state.shards[0].cursor == 15
    assert set(state.leases) == {"L00000001", "L00000002"}


def test_dylu_paper_example_through_the_coordinator() -> None:
    state = make_state(policy(max_local_steps=100))
    for peer, speed in (("a", 1.0), ("b", 0.5), ("c", 0.25)):
        join(state, peer, speed)
    steps = [lease_of(do(state, RequestWork(p), 0.0)[0]).steps for p in "abc"]
    assert steps == [100, 50, 25]


def test_min_steps_and_fixed_h_without_dylu() -> None:
    state = make_state(policy(max_local_steps=20, min_steps=4))
    join(state, "fast", 100.0)
    join(state, "slow", 1.0)
    assert lease_of(do(state, RequestWork("slow"), 0.0)[0]).steps == 4
    fixed = make_state(policy(max_local_steps=20, dylu=False))
    join(fixed, "fast", 100.0)
    join(fixed, "slow", 1.0)
    assert lease_of(do(fixed, RequestWork("slow"), 0.0)[0]).steps == 20


def test_speed_reports_replace_and_a_reread_record_is_no_new_sample() -> None:
    # The peer smooths its own measurements: the coordinator takes each new report as it is (no second
    # smoothing), and a DHT record read again with the same timestamp changes nothing.
    state = make_state(policy(max_local_steps=100, speed_ema=0.5))
    do(state, SpeedReport("a", 4.0, reported_at=0.0), 0.0)
    do(state, SpeedReport("a", 2.0, reported_at=1.0), 1.0)
    assert state.peers["a"].speed == 2.0 and state.peers["a"].last_seen == 1.0
    do(state, SpeedReport("a", 8.0, reported_at=1.0), 2.0)  # the same record again (forged value, same stamp)
    assert state.peers["a"].speed == 2.0 and state.peers["a"].last_seen == 1.0
    do(state, SpeedReport("a", 8.0, reported_at=0.5), 2.0)  # older than the one taken
    assert state.peers["a"].speed == 2.0
    join(state, "b", 1.0)
    assert lease_of(do(state, RequestWork("b"), 2.0)[0]).steps == 50


def test_departed_fastest_peer_no_longer_sets_the_max() -> None:
    state = make_state(policy(max_local_steps=100))
    for peer, speed in (("a", 4.0), ("b", 2.0), ("c", 1.0)):
        join(state, peer, speed)
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])
    lease_b = lease_of(do(state, RequestWork("b"), 0.0)[0])
    assert (lease_a.steps, lease_b.steps) == (100, 50)
    (gone,) = do(state, PeerLeft("a"), 1.0)
    assert isinstance(gone, Expired) and (gone.peer, gone.lease_id, gone.steps) == ("a", lease_a.lease_id, 100)
    assert "peer left" in gone.reason
    assert not state.peers["a"].alive and lease_a.lease_id not in state.leases
    assert isinstance(submit(state, lease_b, G, 2.0)[0], Applied)
    assert lease_of(do(state, RequestWork("b"), 2.0)[0]).steps == 100  # b is the fastest alive now
    assert lease_of(do(state, RequestWork("c"), 2.0)[0]).steps == 50
    (again,) = do(state, RequestWork("a"), 3.0)
    assert isinstance(again, Rejected)  # gone until it reports its speed again
    join(state, "a", 4.0, now=3.0)
    assert state.peers["a"].alive and state.peers["a"].speed == 4.0  # a fresh EMA, not mixed with the old one


def test_shard_sampling_follows_eq2_and_the_seed() -> None:
    state = make_state(policy(shard_progress="assigned"), shard_sizes=(100, 100))  # default "learned": test_eq2_progress.py
    for peer in "ab":
        join(state, peer, 1.0)
    first = lease_of(do(state, RequestWork("a"), 0.0)[0])
    second = lease_of(do(state, RequestWork("b"), 0.0)[0])
    assert {first.shard, second.shard} == {0, 1}  # the less-assigned shard has all the probability
    assert [s.assigned for s in state.shards] == [10, 10]
    shards = []
    for seed in (0, 0, 1, 2, 3, 4, 5, 6, 7):
        other = make_state(shard_sizes=(100, 100), seed=seed)
        join(other, "a", 1.0)
        shards.append(lease_of(do(other, RequestWork("a"), 0.0)[0]).shard)
    assert shards[0] == shards[1] == first.shard  # same seed, same draw
    assert set(shards) == {0, 1}  # Σn = 0: uniform, so different seeds reach both shards


# ------------------------------------------------------------------------------ submissions


def test_applied_staleness_and_duplicates() -> None:
    state = make_state(optimizer=OuterSGD(0.5))
    join(state, "a", 2.0)
    join(state, "b", 1.0)
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])
    lease_b = lease_of(do(state, RequestWork("b"), 0.0)[0])
    (applied,) = submit(state, lease_a, G, 5.0)
    assert applied == Applied("a", lease_a.lease_id, 1, 0, 10, 0, True, applied.reason)
    assert torch.equal(state.params, -0.5 * G)
    assert state.version == 1 and state.local_updates == 10
    g_b = torch.tensor([0.5, -1.0, 0.0, 2.0])
    (applied_b,) = submit(state, lease_b, g_b, 5.5)
    assert (applied_b.version, applied_b.staleness, applied_b.steps) == (2, 1, 5)
    expected = -0.5 * G - 0.5 * g_b
    assert torch.equal(state.params, expected)
    # a resend is acknowledged and not applied twice
    (dup,) = submit(state, lease_a, G, 6.0)
    assert isinstance(dup, Duplicate) and dup.version == 1 and dup.lease_id == lease_a.lease_id
    assert torch.equal(state.params, expected) and state.version == 2 and state.local_updates == 15
    assert state.applied == {lease_a.lease_id: 1, lease_b.lease_id: 2}


def test_invalid_submissions_are_rejected_and_leave_theta_alone() -> None:
    state = make_state()
    join(state, "a", 1.0)
    join(state, "b", 1.0)
    lease = lease_of(do(state, RequestWork("a"), 0.0)[0])
    cases = [
        (dict(peer="b"), G, "belongs to another peer"),
        (dict(base_version=3), G, "base_version 3 does not match"),
        ({}, torch.zeros(DIM + 1), "shape"),
        ({}, torch.tensor([1.0, math.nan, 0.0, 0.0]), "NaN or Inf"),
        ({}, torch.tensor([1.0, math.inf, 0.0, 0.0]), "NaN or Inf"),
        ({}, G.double(), "float32"),
    ]
    for kwargs, g, why in cases:
        (action,) = submit(state, lease, g, 1.0, **kwargs)
        assert isinstance(action, Rejected) and why in action.reason, (why, action)
    (unknown,) = do(state, SubmitUpdate("a", "L99999999", 0, G), 1.0)
    assert isinstance(unknown, Rejected) and "unknown" in unknown.reason
    assert torch.equal(state.params, torch.zeros(DIM)) and state.version == 0 and state.applied == {}
    assert lease.lease_id in state.leases  # the lease survives a bad upload; a correct one still counts
    (applied,) = submit(state, lease, G, 2.0)
    assert isinstance(applied, Applied) and applied.version == 1


def test_staleness_bound() -> None:
    state = make_state(policy(max_staleness=1))
    for peer in "abc":
        join(state, peer, 1.0)
    leases = [lease_of(do(state, RequestWork(p), 0.0)[0]) for p in "abc"]
    assert isinstance(submit(state, leases[0], G, 1.0)[0], Applied)
    (second,) = submit(state, leases[1], G, 1.0)
    assert isinstance(second, Applied) and second.staleness == 1
    (third,) = submit(state, leases[2], G, 1.0)
    assert isinstance(third, Rejected) and "staleness 2 exceeds the bound 1" in third.reason
    assert state.version == 2


def test_norm_bound() -> None:
    state = make_state(policy(max_update_norm=5.0))
    join(state, "a", 1.0)
    lease = lease_of(do(state, RequestWork("a"), 0.0)[0])
    (rejected,) = submit(state, lease, torch.tensor([3.0, 4.0, 0.0, 1.0]), 1.0)
    assert isinstance(rejected, Rejected) and "norm" in rejected.reason and "5" in rejected.reason
    (applied,) = submit(state, lease, torch.tensor([3.0, 4.0, 0.0, 0.0]), 1.0)  # norm exactly 5
    assert isinstance(applied, Applied)


def test_dropped_by_policy_consumes_the_lease_without_moving_theta() -> None:
    state = make_state(transforms=[PolyDiscount(0.5, max_staleness=0)])
    join(state, "a", 1.0)
    join(state, "b", 1.0)
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])
    lease_b = lease_of(do(state, RequestWork("b"), 0.0)[0])
    submit(state, lease_a, G, 1.0)
    theta = state.params.clone()
    (dropped,) = submit(state, lease_b, G, 1.0)
    assert isinstance(dropped, Rejected) and "staleness 1 > threshold 0" in dropped.reason
    assert torch.equal(state.params, theta) and state.version == 1 and state.local_updates == 10
    assert lease_b.lease_id not in state.leases
    (resend,) = submit(state, lease_b, G, 2.0)
    assert isinstance(resend, Duplicate) and torch.equal(state.params, theta)


def test_delay_compensation_uses_theta_at_the_lease_base_version() -> None:
    state = make_state(optimizer=OuterSGD(1.0), transforms=[DelayCompensation(0.5)])
    join(state, "a", 1.0)
    join(state, "b", 1.0)
    theta0 = state.params.clone()
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])
    lease_b = lease_of(do(state, RequestWork("b"), 0.0)[0])
    assert state.base_params == {}  # copy-on-write: θ(0) is the live θ until an update changes it
    g_a, g_b = torch.tensor([1.0, -2.0, 0.5, 0.0]), torch.tensor([2.0, 1.0, -1.0, 3.0])
    submit(state, lease_a, g_a, 1.0)
    theta1 = theta0 - g_a
    assert torch.equal(state.params, theta1)
    assert set(state.base_params) == {0} and torch.equal(state.base_params[0], theta0)  # b's base, kept
    submit(state, lease_b, g_b, 1.0)
    compensated = g_b + 0.5 * g_b * g_b * (theta1 - theta0)
    assert torch.allclose(state.params, theta1 - compensated, rtol=1e-6, atol=1e-7)
    assert state.base_params == {}  # no lease is based on version 0 any more


# ------------------------------------------------------------------------------ expiry and give-back


def test_expired_lease_gives_its_steps_back_and_the_range_is_reissued() -> None:
    state = make_state()
    join(state, "a", 1.0)
    lease = lease_of(do(state, RequestWork("a"), 0.0)[0])
    assert lease.deadline == 35.0  # 10 s × 3 + 5
    assert do(state, Tick(), 35.0) == []  # not past the deadline yet
    (expired,) = do(state, Tick(), 35.5)
    assert expired == Expired("a", lease.lease_id, 0, 10, expired.reason)
    assert "deadline" in expired.reason
    assert state.shards[0].assigned == 0 and state.shards[0].cursor == 0 and state.leases == {}
    (late,) = submit(state, lease, G, 36.0)
    assert isinstance(late, Rejected) and "expired" in late.reason
    again = lease_of(do(state, RequestWork("a"), 36.0)[0])
    assert (again.start_offset, again.steps, again.lr_offset) == (0, 10, 0)
    assert again.lease_id != lease.lease_id


def test_given_back_middle_range_is_reissued_split_and_shortened() -> None:
    state = make_state()
    join(state, "a", 2.0)  # 10 steps in 5 s
    join(state, "b", 1.0)  # 5 steps in 5 s
    join(state, "c", 1.0)
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])  # batches 0..9, deadline 20
    lease_b = lease_of(do(state, RequestWork("b"), 1.0)[0])  # batches 10..14, deadline 21
    (expired,) = do(state, Tick(), 20.5)
    assert expired.lease_id == lease_a.lease_id
    shard = state.shards[0]
    assert (shard.assigned, shard.cursor, shard.returned) == (5, 15, [(0, 10)])
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    restored = make_state()
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert [s.__dict__ for s in restored.shards] == [s.__dict__ for s in state.shards]
    lease_c = lease_of(do(state, RequestWork("c"), 20.5)[0])  # 5 steps out of the returned 10
    assert (lease_c.start_offset, lease_c.steps, lease_c.lr_offset) == (0, 5, 5)
    assert shard.returned == [(5, 5)]
    (assign_a,) = do(state, RequestWork("a"), 20.5)  # wants 10, only 5 are left in the returned range
    lease_a2 = lease_of(assign_a)
    assert (lease_a2.start_offset, lease_a2.steps, lease_a2.lr_offset) == (5, 5, 10)
    assert "shortened" in assign_a.reason
    assert (shard.assigned, shard.cursor, shard.returned) == (15, 15, [])
    lease_b_after = state.leases[lease_b.lease_id]
    assert lease_b_after.start_offset == 10
    assert sorted((l.start_offset, l.steps) for l in state.leases.values()) == [(0, 5), (5, 5), (10, 5)]


def test_asking_again_abandons_the_current_lease() -> None:
    state = make_state()
    join(state, "a", 1.0)
    old = lease_of(do(state, RequestWork("a"), 0.0)[0])
    expired, assign = do(state, RequestWork("a"), 3.0)
    assert isinstance(expired, Expired) and expired.lease_id == old.lease_id
    assert "before submitting" in expired.reason
    new = lease_of(assign)
    assert (new.start_offset, new.steps, new.issued_at) == (0, 10, 3.0)
    assert list(state.leases) == [new.lease_id] and state.shards[0].assigned == 10


# ------------------------------------------------------------------------------ grace windows


def _two_peers_in_flight(grace: float = 0.5):
    state = make_state(policy(grace_period=grace), optimizer=OuterSGD(0.5))
    join(state, "a", 1.0)
    join(state, "b", 1.0)
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])  # finishes at 10.0
    (assign_b,) = do(state, RequestWork("b"), 0.2)  # a's lease is due at 10.0, far beyond 0.7: answered now
    lease_b = lease_of(assign_b)  # finishes at 10.2
    return state, lease_a, lease_b


def test_hold_until_the_expected_update_is_applied() -> None:
    state, lease_a, lease_b = _two_peers_in_flight()
    assert isinstance(submit(state, lease_a, G, 10.0)[0], Applied)
    (hold,) = do(state, RequestWork("a"), 10.0)
    assert hold == Hold("a", 10.5, (lease_b.lease_id,), hold.reason)
    assert do(state, RequestWork("a"), 10.1) == []  # asking again while held changes nothing
    applied, released = submit(state, lease_b, G, 10.2)
    assert isinstance(applied, Applied) and applied.version == 2
    new_a = lease_of(released)
    assert new_a.peer == "a" and new_a.base_version == 2 and new_a.issued_at == 10.2
    assert "applied" in released.reason
    (assign_b,) = do(state, RequestWork("b"), 10.2)  # the window is settled: answered at once, same θ
    assert lease_of(assign_b).base_version == 2 and "settled grace window" in assign_b.reason
    assert state.held == {} and state.window_end == 10.5  # open until its end (paper Fig. 3)
    assert do(state, Tick(), 10.6) == [] and state.window_end is None


def test_hold_is_released_when_the_window_closes() -> None:
    state, lease_a, lease_b = _two_peers_in_flight()
    submit(state, lease_a, G, 10.0)
    (hold,) = do(state, RequestWork("a"), 10.0)
    assert hold.until == 10.5
    assert do(state, Tick(), 10.4) == []
    (released,) = do(state, Tick(), 10.5)
    lease = lease_of(released)
    assert lease.peer == "a" and lease.base_version == 1 and lease.issued_at == 10.5
    assert "grace window closed" in released.reason
    assert lease_b.lease_id in state.leases


def test_later_requests_join_the_open_window_and_are_released_in_request_order() -> None:
    state = make_state(policy(grace_period=0.5))
    leases = {}
    for peer, t in (("a", 0.0), ("b", 0.1), ("c", 0.2)):
        join(state, peer, 1.0, now=t)
        leases[peer] = lease_of(do(state, RequestWork(peer), t)[0])
    submit(state, leases["a"], G, 10.0)
    (hold_a,) = do(state, RequestWork("a"), 10.0)
    assert hold_a.until == 10.5 and hold_a.waiting_for == (leases["b"].lease_id, leases["c"].lease_id)
    assert submit(state, leases["b"], G, 10.1)[0].version == 2  # c is still due: nobody released
    (hold_b,) = do(state, RequestWork("b"), 10.1)
    assert hold_b == Hold("b", 10.5, (leases["c"].lease_id,), hold_b.reason)
    assert "joined" in hold_b.reason
    applied, first, second = submit(state, leases["c"], G, 10.2)
    assert applied.version == 3 and applied.staleness == 2
    assert [first.peer, second.peer] == ["a", "b"]
    assert lease_of(first).base_version == lease_of(second).base_version == 3
    (assign_c,) = do(state, RequestWork("c"), 10.2)
    assert lease_of(assign_c).base_version == 3


def test_expired_lease_in_the_window_releases_the_held_peers() -> None:
    state = make_state(policy(grace_period=0.5, lease_timeout_factor=1.0, lease_slack=0.0))
    join(state, "a", 1.0)
    join(state, "b", 1.0)
    lease_a = lease_of(do(state, RequestWork("a"), 0.0)[0])  # due 10.0, deadline 10.0
    lease_b = lease_of(do(state, RequestWork("b"), 0.0)[0])  # due 10.0, deadline 10.0
    submit(state, lease_a, G, 9.9)
    (hold,) = do(state, RequestWork("a"), 9.9)
    assert hold.until == pytest.approx(10.4) and hold.waiting_for == (lease_b.lease_id,)
    expired, released = do(state, Tick(), 10.1)
    assert isinstance(expired, Expired) and expired.lease_id == lease_b.lease_id
    assert lease_of(released).peer == "a" and lease_of(released).base_version == 1


def test_held_peer_that_leaves_is_not_assigned() -> None:
    state, lease_a, lease_b = _two_peers_in_flight()
    submit(state, lease_a, G, 10.0)
    do(state, RequestWork("a"), 10.0)
    assert do(state, PeerLeft("a"), 10.1) == []
    (applied,) = submit(state, lease_b, G, 10.2)
    assert isinstance(applied, Applied) and state.held == {}


# ------------------------------------------------------------------------------ barrier (sync DiLoCo)


def test_barrier_mode_runs_a_sync_round() -> None:
    lr, beta = 0.7, 0.9
    state = make_state(policy(barrier=True), optimizer=AsyncBuffer(lr, beta, 3))
    leases = {}
    for peer in "abc":
        join(state, peer, 1.0)
        (assign,) = do(state, RequestWork(peer), 0.0)
        assert "sync round starts" in assign.reason
        leases[peer] = lease_of(assign)
    assert {l.base_version for l in leases.values()} == {0}
    grads = {p: torch.randn(DIM, generator=torch.Generator().manual_seed(i)) for i, p in enumerate("abc")}

    (applied_a,) = submit(state, leases["a"], grads["a"], 10.0)
    assert (applied_a.version, applied_a.moved) == (1, False)
    (hold_a,) = do(state, RequestWork("a"), 10.0)
    assert hold_a == Hold("a", math.inf, (leases["b"].lease_id, leases["c"].lease_id), hold_a.reason)
    assert do(state, Tick(), 30.0) == []  # a barrier does not close by time (deadlines are at 35)
    (applied_b,) = submit(state, leases["b"], grads["b"], 12.0)
    assert applied_b.moved is False
    (hold_b,) = do(state, RequestWork("b"), 12.0)
    assert hold_b.until == math.inf and hold_b.waiting_for == (leases["c"].lease_id,)
    assert torch.equal(state.params, torch.zeros(DIM))

    applied_c, release_a, release_b = submit(state, leases["c"], grads["c"], 15.0)
    assert (applied_c.version, applied_c.moved) == (3, True)
    assert [release_a.peer, release_b.peer] == ["a", "b"]
    assert all("barrier released" in r.reason and lease_of(r).base_version == 3 for r in (release_a, release_b))
    mean = (grads["a"] + grads["b"] + grads["c"]) / 3
    assert torch.allclose(state.params, -lr * (1 + beta) * mean, rtol=1e-6, atol=1e-7)
    (assign_c,) = do(state, RequestWork("c"), 15.0)
    assert lease_of(assign_c).base_version == 3 and "sync round starts" in assign_c.reason


def test_barrier_round_that_loses_a_lease_closes_on_the_mean_of_what_arrived() -> None:
    """A sync round whose lease expired steps on the mean of the arrivals it got; the next round starts clean."""
    lr, beta = 0.7, 0.9
    state = make_state(policy(barrier=True), optimizer=AsyncBuffer(lr, beta, 3))
    leases = {}
    for peer in "abc":
        join(state, peer, 1.0)
        leases[peer] = lease_of(do(state, RequestWork(peer), 0.0)[0])
    g_a, g_b = torch.tensor([1.0, 0.0, 2.0, -1.0]), torch.tensor([3.0, 2.0, 0.0, 1.0])
    submit(state, leases["a"], g_a, 10.0)
    do(state, RequestWork("a"), 10.0)
    submit(state, leases["b"], g_b, 11.0)
    do(state, RequestWork("b"), 11.0)
    assert torch.equal(state.params, torch.zeros(DIM))
    expired, release_a, release_b = do(state, Tick(), 36.0)  # c's deadline was 35
    assert isinstance(expired, Expired) and expired.peer == "c"
    round_one = -lr * (1 + beta) * (g_a + g_b) / 2
    assert torch.allclose(state.params, round_one, rtol=1e-6, atol=1e-7)
    assert [release_a.peer, release_b.peer] == ["a", "b"]
    assert all("mean of 2" in r.reason and lease_of(r).base_version == 2 for r in (release_a, release_b))
    # round two: a's update is buffered on its own, never averaged with round one's
    after_round_one = state.params.clone()
    (applied,) = submit(state, lease_of(release_a), 5 * g_a, 50.0)
    assert applied.moved is False and torch.equal(state.params, after_round_one)
    assert state.optimizer.buffered == 1


# ------------------------------------------------------------------------------ checkpoint (§7.6)


def _fresh_checkpoint_state() -> CoordinatorState:
    return make_state(
        policy(grace_period=0.5, max_local_steps=8, min_steps=2),
        optimizer=DelayedNesterov(0.7, 0.9, buffer_size=3, activation=0.2),
        transforms=[DelayCompensation(0.3, groups=[(0, 2), (2, DIM)]), AsyncAwareLR(1.0, window=4)],
        shard_sizes=(40, 40, 20),
        seed=7,
    )


def _gradient_for(lease_id: str) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(int(lease_id[1:]))) * 0.1


class _Driver:
    """A deterministic stand-in for the runtime: remembers each peer's lease, submits on cue."""

    def __init__(self) -> None:
        self.current: dict[str, object] = {}
        self.log: list = []

    def apply(self, state: CoordinatorState, script: list[tuple[float, str, str]]) -> None:
        for now, kind, peer in script:
            if kind == "speed":
                event = SpeedReport(peer, {"a": 4.0, "b": 2.0, "c": 1.0}[peer])
            elif kind == "request":
                event = RequestWork(peer)
            elif kind == "submit":
                lease = self.current.pop(peer)
                event = SubmitUpdate(peer, lease.lease_id, lease.base_version, _gradient_for(lease.lease_id))
            elif kind == "leave":
                event = PeerLeft(peer)
            else:
                event = Tick()
            for action in do(state, event, now):
                self.log.append((now, type(action).__name__, action.peer, getattr(action, "lease_id", None), action.reason))
                if isinstance(action, Assign):
                    self.current[action.peer] = action.lease
                    self.log.append(("lease", action.lease.to_dict()))


SCRIPT_BEFORE = [
    (0.0, "speed", "a"), (0.0, "speed", "b"), (0.0, "speed", "c"),
    (0.0, "request", "a"), (0.0, "request", "b"), (0.0, "request", "c"),  # 8, 4, 2 steps: all due at 2.0
    (2.0, "submit", "a"), (2.0, "request", "a"),  # held until 2.5 for b and c
    (2.1, "submit", "b"), (2.1, "request", "b"),  # joins the window
    (2.2, "submit", "c"), (2.2, "request", "c"),  # releases a and b, c is answered at once: all from v3
    (4.2, "submit", "a"), (4.2, "request", "a"),  # held again, until 4.7: the snapshot is taken here
]
SCRIPT_AFTER = [
    (4.3, "tick", ""),
    (4.4, "submit", "b"), (4.4, "request", "b"),
    (4.7, "tick", ""),  # the window closes with c overdue: a and b start from v5
    (5.0, "submit", "c"), (5.0, "request", "c"),  # staleness 3
    (5.5, "leave", "b"),  # its lease is given back
    (6.7, "submit", "a"), (6.7, "request", "a"),
    (7.0, "submit", "c"), (7.0, "request", "c"),
    (7.0, "speed", "b"), (7.0, "request", "b"),
    (9.0, "submit", "a"), (9.0, "submit", "b"), (9.5, "tick", ""),
]


def test_checkpoint_round_trip_resumes_the_same_trajectory() -> None:
    reference, driver = _fresh_checkpoint_state(), _Driver()
    driver.apply(reference, SCRIPT_BEFORE + SCRIPT_AFTER)

    first, driver_before = _fresh_checkpoint_state(), _Driver()
    driver_before.apply(first, SCRIPT_BEFORE)
    # the snapshot point is interesting: a partial DN buffer, active leases, progress on several shards
    assert first.optimizer.arrivals == 4 and first.held == {"a": 4.2} and first.window_end == 4.7
    assert len(first.leases) == 2 and set(first.base_params) == {3}
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    snapshot = torch.load(saved, weights_only=True)
    for key in ("params", "optimizer", "transforms", "shards", "version", "leases", "lease_counter", "applied", "held"):
        assert key in snapshot
    assert torch.equal(snapshot["params"], first.params)
    assert torch.equal(snapshot["optimizer"]["momentum_buffer"], first.optimizer.momentum_buffer)
    assert torch.equal(snapshot["optimizer"]["buffer"], first.optimizer.buffer)
    assert snapshot["optimizer"]["arrivals"] == first.optimizer.arrivals
    assert snapshot["version"] == first.version
    assert [s["assigned"] for s in snapshot["shards"]] == [s.assigned for s in first.shards]
    assert set(snapshot["leases"]) == set(first.leases)
    assert snapshot["held"] == {"a": 4.2} and snapshot["window_end"] == 4.7

    resumed = _fresh_checkpoint_state()
    resumed.load_state_dict(snapshot)
    driver_before.log.clear()
    driver_before.apply(resumed, SCRIPT_AFTER)

    assert torch.equal(resumed.params, reference.params)
    assert torch.equal(resumed.optimizer.momentum_buffer, reference.optimizer.momentum_buffer)
    assert torch.equal(resumed.optimizer.buffer, reference.optimizer.buffer)
    assert resumed.version == reference.version and resumed.local_updates == reference.local_updates
    assert [s.__dict__ for s in resumed.shards] == [s.__dict__ for s in reference.shards]
    assert driver_before.log == driver.log[len(driver.log) - len(driver_before.log) :]
    assert reference.version == 10 and reference.optimizer.arrivals == 10  # six updates after the snapshot
    kinds = [entry[1] for entry in driver_before.log if entry[0] != "lease"]
    assert kinds.count("Applied") == 6 and kinds.count("Expired") == 1 and kinds.count("Hold") == 2


def test_load_state_dict_rejects_a_different_model_or_shard_count() -> None:
    state = make_state()
    other = new_state(torch.zeros(DIM + 1), OuterSGD(0.5), [], policy(), (1000,), 0)
    with pytest.raises(ValueError, match="values"):
        state.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="shards"):
        state.load_state_dict(make_state(shard_sizes=(10, 10)).state_dict())


def test_new_state_validation() -> None:
    with pytest.raises(ValueError, match="flat float32"):
        new_state(torch.zeros(2, 2), OuterSGD(0.5), [], policy(), (10,), 0)
    with pytest.raises(ValueError, match="at least one batch"):
        new_state(torch.zeros(DIM), OuterSGD(0.5), [], policy(), (10, 0), 0)


def test_a_recorded_policy_and_hyper_parameters_rebuild_what_decides() -> None:
    """What a snapshot records of the decisions (logic/state.py ``decision_record``) rebuilds them exactly, and a
    ``Reconfigured`` event installs another record while the optimizer's and transforms' state carry over."""
    from asyncloco.algo.outer import OuterAdam, OuterNesterov, OuterSGDMomentum
    from asyncloco.algo.staleness import OuterWarmup, StalenessLR
    from asyncloco.coordinator.gate import GatePolicy
    from asyncloco.coordinator.logic import Notice, Reconfigured, VerifyPolicy, decision_record
    from asyncloco.coordinator.logic.state import policy_from_record, policy_record

    optimizers = [OuterSGD(0.3), OuterSGDMomentum(0.4, 0.8, reference_steps=9), OuterNesterov(0.5, 0.7),
                  OuterAdam(0.01, (0.8, 0.95), 1e-6), DelayedNesterov(0.7, 0.9, 3, activation=0.2, reference_steps=30),
                  AsyncBuffer(0.6, 0.85, 4)]
    transforms = [PolyDiscount(0.7, 5), DelayCompensation(0.3, [(0, 2), (2, 4)], ema=0.9, cap=2.0), StalenessLR(),
                  AsyncAwareLR(1.5, 8), OuterWarmup(12)]
    for thing in optimizers + transforms:
        assert type(thing)(**thing.settings()).settings() == thing.settings(), thing.name
    policy = CoordinatorPolicy(max_local_steps=11, grace_period=0.5, gate=GatePolicy(clip_factor=3.0, window=9),
                               verify=VerifyPolicy(fraction=0.2, average_released=False, keep_class="cpu:x"),
                               admission="allowlist", allowlist=frozenset({"b", "a"}), hold_limit=math.inf)
    assert policy_from_record(policy_record(policy)) == policy
    with pytest.raises(ValueError, match=r"fields this version does not know: \['surprise'\]"):
        policy_from_record({**policy_record(policy), "surprise": 1})

    params = torch.zeros(4)
    optimizer = DelayedNesterov(0.7, 0.9, 2)
    state = new_state(params, optimizer, [PolyDiscount(0.5)], policy, [8], seed=0)
    optimizer.step(state.params, torch.ones(4))  # state to carry: the buffer holds one arrival
    new = decision_record(state)
    new["optimizer"]["settings"]["lr"] = 0.35
    new["transforms"][0]["settings"]["exponent"] = 1.0
    new["policy"]["verify"]["fraction"] = 0.5
    _, actions = handle(state, Reconfigured(json.dumps(new)), now=0.0)
    assert decision_record(state) == new
    assert (state.optimizer.lr, state.transforms[0].settings()["exponent"], state.policy.verify.fraction) == (0.35, 1.0, 0.5)
    assert isinstance(state.optimizer, DelayedNesterov) and state.optimizer.arrivals == 1
    assert torch.equal(state.optimizer.buffer, torch.ones(4))  # the buffered arrival kept
    assert [a.reason for a in actions if isinstance(a, Notice)] == [
        "restarted with a config that decides differently from here on: optimizer.settings.lr: 0.7 -> 0.35; "
        "policy.verify.fraction: 0.2 -> 0.5; transforms.0.settings.exponent: 0.5 -> 1.0"]
