"""Decision tables for public runs: the update gate, bound and capped speeds, liveness, holds, θ retention,
unguessable lease ids — all through ``handle`` with an explicit clock."""

from __future__ import annotations

import dataclasses
import math
from statistics import median as median_of

import pytest
import torch

from asyncloco.algo.outer import OuterSGD
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.gate import GatePolicy, GateState, adamw_norm_bound
from asyncloco.coordinator.logic import (
    Applied,
    Assign,
    CoordinatorPolicy,
    CoordinatorState,
    Expired,
    Fetched,
    Hello,
    Left,
    Notice,
    Quarantined,
    Rejected,
    Released,
    RequestWork,
    Restarted,
    SpeedReport,
    SubmitUpdate,
    Tick,
    base_theta,
    handle,
    new_state,
)

pytestmark = pytest.mark.timeout(60)

DIM = 64


def policy(**overrides: object) -> CoordinatorPolicy:
    base: dict[str, object] = dict(max_local_steps=10, min_steps=1, units_per_step=1, lease_timeout_factor=3.0, lease_slack=5.0)
    base.update(overrides)
    return CoordinatorPolicy(**base)  # type: ignore[arg-type]


def make_state(pol: CoordinatorPolicy, secret: bytes = b"") -> CoordinatorState:
    return new_state(torch.zeros(DIM), OuterSGD(1.0), [], pol, [10_000], 0, lease_secret=secret)


def do(state: CoordinatorState, event: object, now: float) -> list:
    _, actions = handle(state, event, now)  # type: ignore[arg-type]
    return actions


def lease_for(state: CoordinatorState, peer: str, now: float):  # type: ignore[no-untyped-def]
    (assign,) = [a for a in do(state, RequestWork(peer), now) if isinstance(a, Assign)]
    return assign.lease


def honest(seed: int, scale: float = 1.0) -> torch.Tensor:
    """Honest updates share a common direction plus noise (cosine ≈ 0.7 with each other)."""
    common = torch.ones(DIM) / math.sqrt(DIM)
    noise = torch.randn(DIM, generator=torch.Generator().manual_seed(seed)) / math.sqrt(DIM)
    return scale * (common + 0.6 * noise)


# ----------------------------------------------------------------------------------------- the gate


def test_gate_score_norms_directions_and_nan() -> None:
    pol = GatePolicy(warmup=3, probation_updates=0)
    gate = GateState()
    first = update_gate.score(pol, gate, honest(0), 10, "a")
    assert (first.action, first.scale) == ("accept", 1.0)
    assert update_gate.score(pol, gate, honest(0), 10, "a", bound_per_step=0.01).action == "reject"
    nan = honest(1).clone()
    nan[3] = math.nan
    assert update_gate.score(pol, gate, nan, 10, "a").action == "reject"
    for seed in range(6):
        update = honest(seed)
        verdict = update_gate.score(pol, gate, update, 10, "a")
        assert verdict.action == "accept", verdict
        update_gate.record(pol, gate, verdict, update, 10, "a", 0.0)
    median = median_of(gate.norms)
    # 30× the median per-step norm: rejected (limit 20×); 10×: clipped to exactly 4× the median
    assert update_gate.score(pol, gate, honest(7) * 30 * median * 10 / honest(7).norm(), 10, "a").action == "reject"
    big = honest(8) * (10 * median * 10 / float(honest(8).norm()))
    clipped = update_gate.score(pol, gate, big, 10, "a")
    assert clipped.action == "clip"
    assert clipped.scale * clipped.norm / 10 == pytest.approx(4 * median, rel=1e-5)
    # a sign-flipped update at the honest norm, and a random direction, disagree with the consensus
    assert update_gate.score(pol, gate, -honest(9), 10, "a").action == "reject"
    orthogonal = torch.zeros(DIM)
    orthogonal[0], orthogonal[1] = 1.0, -1.0
    random = update_gate.score(pol, gate, orthogonal * float(honest(10).norm()) / math.sqrt(2), 10, "a")
    # (a random one from an established peer is taken with weak agreement at ≤ the median norm)
    assert random.weak and random.action == "accept" and random.norm / 10 <= median, random.reason
    # the same update from a 1-step lease has 10× the per-step norm: judged per step
    assert update_gate.score(pol, gate, honest(11), 1, "a").action == "clip"


def test_adamw_bound_closed_form() -> None:
    # (1 − 0.9) / sqrt(1 − 0.999) = 3.1623; + 10 × 0.1 weight decay; × 2 × lr × sqrt(n)
    assert adamw_norm_bound(1e-3, 10_000, 0.1) == pytest.approx(2 * 1e-3 * (0.1 / math.sqrt(0.001) + 1.0) * 100)


def _gated_state(**extra: object) -> CoordinatorState:
    pol = policy(gate=GatePolicy(warmup=3, probation_updates=0, quarantine_after=3, quarantine_window=6), **extra)
    state = make_state(pol)
    for peer in ("a", "b", "h"):
        do(state, SpeedReport(peer, 1.0), 0.0)
    now = 0.0
    for seed in range(6):  # honest history from a and b
        peer = "ab"[seed % 2]
        lease = lease_for(state, peer, now)
        now += 10.0
        (applied,) = [x for x in do(state, SubmitUpdate(peer, lease.lease_id, lease.base_version, honest(seed)), now) if isinstance(x, Applied)]
    return state


def test_gate_in_handle_rejects_and_gives_the_steps_back_then_quarantines() -> None:
    state = _gated_state()
    theta = state.params.clone()
    assigned = state.shards[0].assigned
    now = 100.0
    for attempt in range(3):
        lease = lease_for(state, "h", now)
        actions = do(state, SubmitUpdate("h", lease.lease_id, lease.base_version, -honest(50 + attempt) * 1000), now + 1)
        assert isinstance(actions[0], Rejected) and actions[0].reason.startswith("update gate:")
        assert any(isinstance(a, Expired) and a.lease_id == lease.lease_id for a in actions)
        now += 2
    assert torch.equal(state.params, theta) and state.shards[0].assigned == assigned
    assert isinstance(actions[-1], Quarantined) and actions[-1].until == pytest.approx(now - 2 + 1 + 600.0)
    (refused,) = do(state, RequestWork("h"), now)
    assert isinstance(refused, Rejected) and "quarantined" in refused.reason
    # honest peers still train, and the quarantined one's claimed speed no longer counts
    assert lease_for(state, "a", now).steps == 10


def test_gate_clip_moves_theta_by_the_clipped_update() -> None:
    state = _gated_state()
    median = median_of(state.gate.norms)
    lease = lease_for(state, "a", 100.0)
    update = honest(70) * (10 * median * lease.steps / float(honest(70).norm()))
    scale = 4 * median * lease.steps / float(update.norm())  # clipped to 4× the median per-step norm
    theta = state.params.clone()
    (applied,) = [a for a in do(state, SubmitUpdate("a", lease.lease_id, lease.base_version, update.clone()), 110.0) if isinstance(a, Applied)]
    assert applied.gate.startswith(f"clipped ×{scale:.3g}") and scale == pytest.approx(0.4, rel=1e-5)
    assert torch.allclose(theta - state.params, update * scale, rtol=1e-5, atol=1e-7)  # OuterSGD(1.0)


# ---------------------------------------------------------------------------------------- speeds


def test_dht_speed_reports_count_only_when_bound_new_and_not_from_the_future() -> None:
    state = make_state(policy(trust_speeds=False, max_local_steps=100))
    do(state, SpeedReport("ghost", 1e9, reported_at=0.0, signer="k-ghost"), 0.0)  # never said hello
    assert "ghost" not in state.peers
    do(state, Hello("a", "k-a", "alice", 100.0), 0.0)
    do(state, Hello("b", "k-b", "bob", 50.0), 0.0)
    do(state, SpeedReport("a", 1.0, reported_at=1.0, signer="k-b"), 1.0)  # signed by another peer's key
    assert state.peers["a"].speed == 100.0
    do(state, SpeedReport("a", 200.0, reported_at=100.0, signer="k-a"), 1.0)  # 99 s in the future
    assert state.peers["a"].speed == 100.0
    do(state, SpeedReport("a", 80.0, reported_at=1.0, signer="k-a"), 1.0)
    assert (state.peers["a"].speed, state.peers["a"].name) == (80.0, "alice")
    assert lease_for(state, "b", 2.0).steps == 62  # floor(50 / 80 × 100)


def test_observed_speed_counts_from_the_end_of_the_theta_download() -> None:
    """On a slow link the θ download is not compute: the busy time runs from the download's end (as the coordinator
    saw it) to the start of the upload — not from the lease's issue; a lease asked for ahead (while the previous one
    trains) is busy from the previous upload's start."""
    state = make_state(policy(trust_speeds=False, max_local_steps=100, lease_slack=1000.0))
    do(state, Hello("a", "k-a", "", 10.0), 0.0)
    lease = lease_for(state, "a", 0.0)
    do(state, Fetched("a", lease.base_version), 4.0)  # 4 s downloading
    assert state.leases[lease.lease_id].fetched_at == 4.0
    do(state, Fetched("a", lease.base_version), 5.0)  # a second download of the same θ: the first end counts
    # asked for ahead at t = 8 (the first lease still trains, kept), its θ fetched at t = 9
    ahead = next(a for a in do(state, RequestWork("a", keep=lease.lease_id), 8.0) if isinstance(a, Assign)).lease
    do(state, Fetched("a", ahead.base_version), 9.0)
    do(state, SubmitUpdate("a", lease.lease_id, 0, torch.zeros(DIM), transfer_s=2.0), 12.0)  # 100 units in 6 s busy
    assert state.peers["a"].observed == pytest.approx(100 / 6)
    # the second trains from the first one's upload start (t = 10): 100 units by its own upload's start (t = 18)
    do(state, SubmitUpdate("a", ahead.lease_id, ahead.base_version, torch.zeros(DIM), transfer_s=2.0), 20.0)
    assert state.peers["a"].observed == pytest.approx(0.5 * 100 / 6 + 0.5 * 100 / 8)


def test_claims_are_capped_by_delivered_throughput_and_unproven_claims_count_boundedly() -> None:
    state = make_state(policy(trust_speeds=False, max_local_steps=100, lease_slack=1000.0))
    do(state, Hello("a", "k-a", "", 10.0), 0.0)
    do(state, Hello("b", "k-b", "", 5.0), 0.0)
    lease = lease_for(state, "a", 0.0)
    assert lease.steps == 100
    do(state, SubmitUpdate("a", lease.lease_id, 0, torch.zeros(DIM), transfer_s=2.0), 12.0)  # 100 units in 10 s busy
    assert state.peers["a"].observed == pytest.approx(10.0)
    lease_b = lease_for(state, "b", 12.0)
    do(state, SubmitUpdate("b", lease_b.lease_id, lease_b.base_version, torch.zeros(DIM)), 12.0 + lease_b.steps / 5.0)
    # a ghost-like newcomer claiming 1e6 units/s gets H for itself; its unproven claim counts for the others
    # at most as 4 × the median claim (10): b's steps shrink to floor(5 / 40 × 100) ...
    do(state, Hello("g", "k-g", "", 1e6), 30.0)
    assert lease_for(state, "g", 30.0).steps == 100
    assert lease_for(state, "b", 31.0).steps == 12
    # ... only until it gives a lease back without delivering (here: by asking again); then not at all
    lease_for(state, "g", 32.0)
    assert state.peers["g"].failed and lease_for(state, "b", 33.0).steps == 50
    # a proven peer that inflates its claim counts at most 1.5 × what it delivered
    do(state, SpeedReport("a", 1000.0, reported_at=34.0, signer="k-a"), 34.0)
    lease_a = lease_for(state, "a", 34.0)
    assert lease_a.steps == 100 and lease_a.expected_finish == pytest.approx(34.0 + 100 / 15.0)
    assert lease_for(state, "b", 35.0).steps == 33  # floor(5 / 15 × 100)


# -------------------------------------------------------------------------- leases, liveness, holds


def test_lease_ids_are_unguessable_but_replayable_and_deadlines_are_capped() -> None:
    pol = policy(max_lease_s=100.0, transfer_allowance_s=7.0)
    one, two = make_state(pol, secret=b"s" * 32), make_state(pol, secret=b"s" * 32)
    other = make_state(pol, secret=b"t" * 32)
    ids = []
    for state in (one, two, other):
        do(state, SpeedReport("slow", 1e-6), 0.0)
        ids.append(lease_for(state, "slow", 0.0))
    assert ids[0].lease_id == ids[1].lease_id != ids[2].lease_id
    assert len(ids[0].lease_id) == 25 and ids[0].lease_id != "L00000001"
    assert ids[0].deadline == 100.0  # 1e6 s of claimed work, capped
    fast = make_state(pol)
    do(fast, SpeedReport("a", 1.0), 0.0)
    assert lease_for(fast, "a", 0.0).deadline == 10 * 3.0 + 5.0 + 7.0  # duration × factor + slack + transfer


def test_silent_peers_leave_on_tick_and_overdue_holds_are_released() -> None:
    state = make_state(policy(peer_timeout=30.0, hold_limit=20.0, grace_period=50.0, lease_slack=1000.0))
    do(state, SpeedReport("a", 1.0), 0.0)
    do(state, SpeedReport("b", 1.0), 0.0)
    do(state, SpeedReport("idle", 1.0), 0.0)
    lease_a = lease_for(state, "a", 0.0)  # expected to finish at 10
    assert lease_a.expected_finish == 10.0
    do(state, Fetched("a", 0), 0.5)  # a downloaded θ: the restart below keeps its deadline
    held = do(state, RequestWork("b"), 1.0)  # a finishes within the grace period: b is held
    assert state.held == {"b": 1.0}, held
    assert do(state, Tick(), 21.0) == []
    (released,) = [a for a in do(state, Tick(), 21.5) if isinstance(a, Released)]
    assert released.peer == "b" and "b" not in state.held
    do(state, SpeedReport("a", 1.0, reported_at=25.0), 25.0)  # a reports while it trains
    left = [a for a in do(state, Tick(), 31.0) if isinstance(a, Left)]
    assert [a.peer for a in left] == ["idle"]  # b asked at 1.0 → silent for more than 30 s only after 31.0
    assert [a.peer for a in do(state, Tick(), 31.5) if isinstance(a, Left)] == ["b"]
    assert state.peers["a"].alive and not state.peers["idle"].alive
    do(state, Restarted(grace_s=10.0), 40.0)
    assert state.peers["a"].last_seen == 50.0
    # silent with a lease in hand: judged by the lease's deadline, not by its reports — 5 + 10 × 3 + 1000 s, and from
    # the restart at 40 its slack again (a peer that finished meanwhile may be resending): 1040
    assert state.leases[lease_a.lease_id].deadline == 1040.0
    assert [a for a in do(state, Tick(), 80.5) if isinstance(a, (Left, Expired))] == []
    assert [a for a in do(state, Tick(), 1039.5) if isinstance(a, (Left, Expired))] == []
    actions = do(state, Tick(), 1040.5)  # the deadline passes: its steps go back, and it has left
    assert [a.lease_id for a in actions if isinstance(a, Expired)] == [lease_a.lease_id]
    assert [a.peer for a in actions if isinstance(a, Left)] == ["a"]


def test_a_deadline_that_passed_while_the_coordinator_was_down_gets_the_restart_grace() -> None:
    """Suite runs under load: a coordinator restart took 34-44 s, the resumed coordinator expired leases whose
    deadlines had passed meanwhile and refused their updates 0.4-5 s later. The downtime is not the peers' fault:
    on ``Restarted`` a lease whose θ was never downloaded (its peer could not start) gets its whole time again from
    the restart, a downloaded one at least the grace (here more than the slack, 5 s, and no transfer allowance);
    later deadlines stay."""
    state = make_state(policy(lease_slack=5.0))
    for peer in ("a", "b", "c"):
        do(state, SpeedReport(peer, 1.0), 0.0)
    lease_a = lease_for(state, "a", 0.0)  # downloaded, trained during the downtime, resending
    lease_b = lease_for(state, "b", 2.0)  # issued just before the crash, θ never downloaded
    lease_c = lease_for(state, "c", 30.0)
    assert (lease_a.deadline, lease_b.deadline, lease_c.deadline) == (35.0, 37.0, 65.0)  # 10 steps × 3 + 5
    do(state, Fetched("a", 0), 1.0)
    do(state, Fetched("c", 0), 31.0)
    assert do(state, Tick(), 34.0) == []  # the indexes are built, a's lease first
    do(state, Restarted(grace_s=10.0), 50.0)  # down from 34 to 50: a's and b's deadlines passed meanwhile
    leases = state.leases
    assert (leases[lease_a.lease_id].deadline, leases[lease_b.lease_id].deadline, leases[lease_c.lease_id].deadline) == (
        60.0, 85.0, 65.0)  # a: the grace; b: 35 s again from 50; c: its own
    assert leases[lease_b.lease_id].expected_finish == 60.0  # 10 s of work from 50
    assert [a for a in do(state, Tick(), 55.0) if isinstance(a, Expired)] == []
    applied = do(state, SubmitUpdate("a", lease_a.lease_id, 0, torch.ones(DIM)), 55.5)
    assert [type(a).__name__ for a in applied if isinstance(a, (Applied, Rejected))] == ["Applied"]
    # the index was rebuilt: each lease expires at its new deadline, not before
    assert [a for a in do(state, Tick(), 64.0) if isinstance(a, Expired)] == []
    assert [a.lease_id for a in do(state, Tick(), 65.5) if isinstance(a, Expired)] == [lease_c.lease_id]
    assert [a for a in do(state, Tick(), 84.0) if isinstance(a, Expired)] == []
    assert [a.lease_id for a in do(state, Tick(), 85.5) if isinstance(a, Expired)] == [lease_b.lease_id]


def test_a_lease_in_training_gets_its_slack_and_transfer_time_again_from_the_restart() -> None:
    """A CI run: a resending peer's update came past the 10 s grace after a coordinator restart (its resends 10 s apart,
    its dials to the new listener held back by libp2p's dial backoff) and was refused as an expired lease. A lease in
    training gets from the restart what its deadline allowed after the compute — the slack plus the peer's transfer
    allowance (measured from its last upload, else the configured one) — and at least the grace."""
    state = make_state(policy(lease_slack=30.0, transfer_allowance_s=4.0, trust_speeds=False))  # uploads timed here
    for peer in ("a", "b"):
        do(state, SpeedReport(peer, 1.0), 0.0)
    lease_a = lease_for(state, "a", 0.0)
    assert lease_a.deadline == 10 * 3.0 + 30.0 + 4.0  # the configured allowance: a's transfer is not measured
    first_b = lease_for(state, "b", 0.0)
    do(state, Fetched("a", 0), 1.0)
    do(state, Fetched("b", 0), 1.0)
    applied = do(state, SubmitUpdate("b", first_b.lease_id, 0, torch.ones(DIM), transfer_s=2.0), 12.0)
    assert [type(a).__name__ for a in applied if isinstance(a, (Applied, Rejected))] == ["Applied"]
    lease_b = lease_for(state, "b", 12.0)
    compute = (lease_b.expected_finish - 12.0) * 3.0  # b's observed speed: 10 steps in 9 s
    assert lease_b.deadline == 12.0 + compute + 30.0 + 2 * 2.0 * 2  # 2 s up, as much down, twice over
    do(state, Fetched("b", 1), 13.0)
    assert do(state, Tick(), 60.0) == []
    do(state, Restarted(grace_s=10.0), 100.0)  # down from 60 to 100: both deadlines passed meanwhile
    assert (state.leases[lease_a.lease_id].deadline, state.leases[lease_b.lease_id].deadline) == (134.0, 138.0)
    applied = do(state, SubmitUpdate("a", lease_a.lease_id, 0, torch.ones(DIM)), 120.0)  # 20 s after the restart
    assert [type(a).__name__ for a in applied if isinstance(a, (Applied, Rejected))] == ["Applied"]
    assert [a for a in do(state, Tick(), 137.5) if isinstance(a, Expired)] == []
    assert [a.lease_id for a in do(state, Tick(), 138.5) if isinstance(a, Expired)] == [lease_b.lease_id]


def test_theta_is_retained_copy_on_write_until_fetched_and_bounded() -> None:
    state = make_state(policy(max_retained_versions=1, lease_slack=1000.0))
    for peer in ("a", "b", "c", "d"):
        do(state, SpeedReport(peer, 1.0), 0.0)
    lease_a, lease_b = lease_for(state, "a", 0.0), lease_for(state, "b", 0.0)
    theta0 = state.params.clone()
    assert state.base_params == {} and base_theta(state, 0) is state.params
    do(state, SubmitUpdate("a", lease_a.lease_id, 0, torch.ones(DIM)), 10.0)
    assert set(state.base_params) == {0} and torch.equal(base_theta(state, 0), theta0)  # b has not fetched θ(0)
    do(state, Fetched("b", 0), 11.0)
    assert state.base_params == {}  # fetched: no longer retained
    lease_b2 = lease_for(state, "b", 11.0)  # gives back b's first lease, takes one at version 1
    assert lease_b2.base_version == 1
    lease_c, lease_d = lease_for(state, "c", 11.0), lease_for(state, "d", 11.0)  # version 1, not fetched
    do(state, SubmitUpdate("c", lease_c.lease_id, 1, torch.ones(DIM)), 20.0)
    assert set(state.base_params) == {1}  # θ(1) kept for b and d
    lease_a2 = lease_for(state, "a", 20.0)  # version 2, not fetched
    actions = do(state, SubmitUpdate("d", lease_d.lease_id, 1, torch.ones(DIM)), 21.0)
    # θ(2) must be kept for a, a second retained version: the oldest (1) goes, and b's unfetched lease with it
    assert [a.lease_id for a in actions if isinstance(a, Expired)] == [lease_b2.lease_id]
    assert set(state.base_params) == {2} and lease_a2.lease_id in state.leases


def test_notice_when_live_peers_differ_from_n() -> None:
    state = make_state(policy(buffer_size=3))
    notices = [a for p in ("a", "b") for a in do(state, SpeedReport(p, 1.0), 0.0) if isinstance(a, Notice)]
    assert len(notices) == 1 and "fewer than the outer optimizer's N = 3" in notices[0].reason
    assert [a for a in do(state, SpeedReport("c", 1.0), 0.0) if isinstance(a, Notice)] == []
    (more,) = [a for a in do(state, SpeedReport("d", 1.0), 0.0) if isinstance(a, Notice)]
    assert "4 live peer(s), more than" in more.reason


def test_snapshot_round_trip_keeps_gate_and_secret() -> None:
    state = _gated_state()
    state.lease_secret = b"x" * 32
    copy = make_state(dataclasses.replace(state.policy))
    copy.load_state_dict(state.state_dict())
    assert copy.lease_secret == state.lease_secret and copy.gate.norms == state.gate.norms
    assert copy.gate.reference is not None and torch.equal(copy.gate.reference, state.gate.reference)


def test_gate_direction_bar_never_lets_a_flipped_update_in_when_honest_cosines_are_spread() -> None:
    # honest cosines with median 0.34 and MAD 0.11: median − 6 MAD = −0.32 would admit a sign-flipped
    # update (≈ −0.34); the bar stays at −0.25 × median = −0.085, and never above the 0.05 cap
    pol = GatePolicy(warmup=1, probation_updates=0)
    reference = torch.zeros(DIM)
    reference[0] = 1.0
    gate = GateState(norms=[1.0] * 8, cosines=[0.12, 0.23, 0.30, 0.34, 0.34, 0.45, 0.56, 0.60], reference=reference,
                     reference_norm=1.0, accepted=8)

    def at_cosine(cosine: float) -> torch.Tensor:
        update = torch.zeros(DIM)
        update[0], update[1] = cosine, math.sqrt(1 - cosine * cosine)
        return update * 10.0  # per-step norm 1.0 over 10 steps: the median

    assert update_gate.score(pol, gate, at_cosine(-0.30), 10, "h").action == "reject"
    assert update_gate.score(pol, gate, at_cosine(-0.09), 10, "h").action == "reject"
    assert update_gate.score(pol, gate, at_cosine(-0.08), 10, "h").action == "accept"  # a noisy honest one
    tight = GateState(norms=[1.0] * 8, cosines=[0.33, 0.34, 0.34, 0.35, 0.35, 0.36, 0.36, 0.37], reference=reference,
                      reference_norm=1.0, accepted=8)
    assert update_gate.score(pol, tight, at_cosine(0.06), 10, "h").action == "accept"  # the cap: 0.05
    # below the cap but not pointing away: an established peer's update is taken with weak agreement
    assert update_gate.score(pol, tight, at_cosine(0.04), 10, "h").weak


def test_weak_agreement_is_refused_without_quarantine_but_pointing_away_quarantines() -> None:
    # "weak" on probation (weak agreement from an established peer is taken, at ≤ the median norm)
    pol = GatePolicy(warmup=1, probation_updates=1, quarantine_after=3, quarantine_window=6)
    reference = torch.zeros(DIM)
    reference[0] = 1.0
    gate = GateState(norms=[1.0] * 8, cosines=[0.33, 0.34, 0.34, 0.35, 0.35, 0.36, 0.36, 0.37], reference=reference,
                     reference_norm=1.0, accepted=8, peer_accepted={"away": 1})

    def at_cosine(cosine: float) -> torch.Tensor:
        update = torch.zeros(DIM)
        update[0], update[1] = cosine, math.sqrt(1 - cosine * cosine)
        return update * 10.0

    for _ in range(6):  # ≈ 0: a random direction, or an honest newcomer's first update
        verdict = update_gate.score(pol, gate, at_cosine(0.0), 10, "weak")
        assert verdict.action == "reject" and not verdict.counts and "not counted" in verdict.reason
        assert update_gate.record(pol, gate, verdict, None, 10, "weak", 0.0) is None
    assert not update_gate.is_quarantined(gate, "weak", 1.0)
    for attempt in range(3):  # below −0.25 × median: pointing away
        verdict = update_gate.score(pol, gate, at_cosine(-0.2), 10, "away")
        assert verdict.action == "reject" and verdict.counts
        quarantined = update_gate.record(pol, gate, verdict, None, 10, "away", 0.0)
    assert quarantined is not None and update_gate.is_quarantined(gate, "away", 1.0)


def test_deadline_allows_for_the_measured_transfer_scaled_to_a_download_and_an_upload() -> None:
    state = make_state(policy(trust_speeds=False, transfer_allowance_s=60.0, download_upload_ratio=4.0))
    do(state, Hello("a", "k-a", "", 1.0), 0.0)
    first = lease_for(state, "a", 0.0)
    assert first.deadline == 10 * 3.0 + 5.0 + 60.0  # not measured yet: the configured allowance
    do(state, SubmitUpdate("a", first.lease_id, 0, torch.zeros(DIM), transfer_s=1.5), 12.0)
    second = lease_for(state, "a", 12.0)
    # observed 10 units in 10.5 s busy → 0.952/s; the claim (1/s) is under 1.5 × that: 10 steps at 1/s
    assert second.deadline == pytest.approx(12.0 + 10 * 3.0 + 5.0 + 2 * 1.5 * (1 + 4.0))
