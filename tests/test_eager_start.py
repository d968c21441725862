"""The eager start (``schedule.eager_start``, algo/eager.py): a lease granted while its peer's previous lease is still
out starts from θ − s × that lease's update as the coordinator decodes it.

The logic (coordinator/logic/leases.py ``eager_of``, submit.py): decided at the grant from the peer's lease still out;
a shifted submission is refused until that update was accepted, and one naming another lease always; a checked lease
keeps the update its start subtracted until its submission takes it into the check. The re-run (coordinator/rerun.py
``start_theta``) starts where the peer did. The runtime — the real daemon and runner over the in-memory transport,
every lease checked bitwise — trains, submits and passes with it; a peer that says it shifted and did not is caught.
The simulator (sim/engine.py) follows the lease's ``eager_of`` as a peer does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.eager import eager_start
from asyncloco.algo.outer import OuterSGD
from asyncloco.config import RunConfig
from asyncloco.coordinator.logic import (
    Applied, Assign, CoordinatorPolicy, Expired, Held, Rejected, RequestWork, SpeedReport, SubmitUpdate, Verify,
    handle, new_state,
)
from asyncloco.coordinator.logic.state import VerifyPolicy
from asyncloco.coordinator.rerun import start_theta
from asyncloco.refusals import RefusalCode
from asyncloco.transport.wire import LeaseGrant, MessageError, SubmitHeader

from tests.test_overlap_runtime import Gates, _every_lease_applied_once_or_given_back, _one_gated_peer, config, journal


# ------------------------------------------------------------------------------------------------ the arithmetic


def test_the_eager_start_is_theta_minus_the_share_of_the_update_in_fp32_on_the_cpu() -> None:
    theta = torch.tensor([1.0, -2.0, 0.5, 3.0])
    update = torch.tensor([2.0, 4.0, -1.0, 0.0])
    start = eager_start(theta, update, 0.5)
    assert torch.equal(start, torch.tensor([0.0, -4.0, 1.0, 3.0]))
    assert torch.equal(theta, torch.tensor([1.0, -2.0, 0.5, 3.0]))  # neither input changes
    # the product is rounded before the difference (no fused multiply-add): bitwise the two-step fp32 reference
    g = torch.Generator().manual_seed(0)
    theta, update = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    assert torch.equal(eager_start(theta, update, 0.7), theta - update * 0.7)
    with pytest.raises(ValueError, match="shape"):
        eager_start(theta, update[:5], 0.7)


def test_the_wire_carries_the_eager_start_both_ways() -> None:
    fields = dict(lease_id="L2", base_version=3, shard=0, start_offset=0, steps=5, lr_offset=0, batch_size=8,
                  issued_at=1.0, deadline=9.0)
    grant = LeaseGrant(**fields, eager_of="L1", eager_share=0.7)
    assert LeaseGrant.from_wire(grant.to_wire()) == grant
    plain = LeaseGrant.from_wire(LeaseGrant(**fields).to_wire())
    assert (plain.eager_of, plain.eager_share) == (None, None)
    with pytest.raises(MessageError, match="eager_of"):
        LeaseGrant(**fields, eager_of="L1")
    with pytest.raises(MessageError, match="eager_share"):
        LeaseGrant(**fields, eager_of="L1", eager_share=2.5)
    header = SubmitHeader("L2", 3, "int8", 10, eager_of="L1")
    assert SubmitHeader.from_wire(header.to_wire()).eager_of == "L1"
    assert SubmitHeader.from_wire(SubmitHeader("L2", 3, "int8", 10).to_wire()).eager_of is None


# ------------------------------------------------------------------------------------------------ the logic


def _state(share: float = 0.7, verify: VerifyPolicy | None = None, barrier: bool = False) -> Any:
    policy = CoordinatorPolicy(max_local_steps=10, min_steps=1, grace_period=0.0, units_per_step=1,
                               lease_timeout_factor=3.0, lease_slack=5.0, eager_share=share, verify=verify,
                               barrier=barrier)
    state = new_state(torch.zeros(4), OuterSGD(0.5), (), policy, (1000,), 0)
    handle(state, SpeedReport("a", 1.0), 0.0)
    return state


def _granted(state: Any, request: RequestWork, now: float) -> Any:
    actions = handle(state, request, now)[1]
    assigned = [a for a in actions if isinstance(a, Assign)]
    assert len(assigned) == 1, actions
    return assigned[0].lease


def _submit(state: Any, lease: Any, update: torch.Tensor, now: float, eager_of: str | None = None) -> list[Any]:
    return handle(state, SubmitUpdate("a", lease.lease_id, lease.base_version, update, eager_of=eager_of), now)[1]


def test_a_lease_granted_while_the_last_is_out_starts_eagerly_and_its_shift_waits_for_that_update() -> None:
    state = _state()
    first = _granted(state, RequestWork("a"), 0.0)
    assert (first.eager_of, first.eager_share) == ("", 0.0)  # nothing out
    second = _granted(state, RequestWork("a", keep=first.lease_id), 1.0)
    assert (second.eager_of, second.eager_share, second.eager_ready) == (first.lease_id, 0.7, False)
    assert second.base_version == 0
    update = torch.ones(4)
    # before the first update is accepted: a shifted submission is refused, naming why
    refused = _submit(state, second, update, 2.0, eager_of=first.lease_id)
    assert [(type(a), a.code) for a in refused] == [(Rejected, RefusalCode.INVALID_UPDATE)]
    assert "has not accepted" in refused[0].reason and second.lease_id in state.leases
    applied = _submit(state, first, update, 3.0)
    assert [type(a) for a in applied] == [Applied] and state.leases[second.lease_id].eager_ready
    # a shift naming another lease is refused; the one it was granted with is applied
    wrong = _submit(state, second, update, 4.0, eager_of="L-other")
    assert wrong[0].code == RefusalCode.INVALID_UPDATE and "granted with the eager start of" in wrong[0].reason
    assert [type(a) for a in _submit(state, second, update, 5.0, eager_of=first.lease_id)] == [Applied]
    # a lease asked for without keep (the peer lost its upload) gives any other back and starts from θ
    third = _granted(state, RequestWork("a"), 6.0)
    fourth_actions = handle(state, RequestWork("a"), 7.0)[1]
    assert [type(a) for a in fourth_actions] == [Expired, Assign] and fourth_actions[1].lease.eager_of == ""
    assert third.eager_of == ""


def test_an_eager_lease_trained_from_theta_itself_is_accepted_and_a_shift_claimed_without_a_grant_refused() -> None:
    state = _state()
    first = _granted(state, RequestWork("a"), 0.0)
    second = _granted(state, RequestWork("a", keep=first.lease_id), 1.0)
    assert [type(a) for a in _submit(state, first, torch.ones(4), 2.0)] == [Applied]
    assert [type(a) for a in _submit(state, second, torch.ones(4), 3.0)] == [Applied]  # no shift claimed
    third = _granted(state, RequestWork("a"), 4.0)
    refused = _submit(state, third, torch.ones(4), 5.0, eager_of=second.lease_id)
    assert refused[0].code == RefusalCode.INVALID_UPDATE and "no eager start" in refused[0].reason


@pytest.mark.parametrize("share,barrier", [(0.0, False), (0.7, True)], ids=["off", "sync-barrier"])
def test_no_eager_start_when_off_or_in_a_sync_round(share: float, barrier: bool) -> None:
    state = _state(share, barrier=barrier)
    first = _granted(state, RequestWork("a"), 0.0)
    if barrier:  # a sync round: the next lease waits until the round's update is in
        assert [type(a) for a in _submit(state, first, torch.ones(4), 1.0)] == [Applied]
        second = _granted(state, RequestWork("a", keep=first.lease_id), 2.0)
    else:
        second = _granted(state, RequestWork("a", keep=first.lease_id), 1.0)
    assert (second.eager_of, second.eager_share) == ("", 0.0)


def test_a_checked_eager_lease_takes_the_update_its_start_subtracted_into_its_check() -> None:
    verify = VerifyPolicy(fraction=1.0, probation_updates=0, hold_backlog=8)
    state = _state(verify=verify)
    first = _granted(state, RequestWork("a"), 0.0)
    second = _granted(state, RequestWork("a", keep=first.lease_id), 1.0)
    assert first.verify and second.verify
    delta = torch.tensor([1.0, 2.0, 3.0, 4.0])
    held = _submit(state, first, delta, 2.0)
    assert {type(a) for a in held} == {Verify, Held}
    kept = state.verification.eager[second.lease_id]
    assert torch.equal(kept, delta) and kept is not delta  # a copy: the daemon decodes into the same buffer
    actions = _submit(state, second, torch.ones(4), 3.0, eager_of=first.lease_id)
    check = next(a for a in actions if isinstance(a, Verify))
    assert check.lease.eager_of == first.lease_id and check.lease.eager_share == 0.7
    assert check.eager is not None and torch.equal(check.eager, delta)
    assert second.lease_id not in state.verification.eager
    assert torch.equal(state.verification.held[second.lease_id].eager, delta)  # a restart rebuilds the check with it
    # the re-run starts where the peer did: θ it decoded minus 0.7 × the update
    start, why = start_theta(check)
    assert why == "" and start is not None and torch.equal(start, check.base - delta * 0.7)
    # the same lease trained from θ itself: checked as a plain lease
    plain = start_theta(check.__class__(**{**check.__dict__, "lease": first, "eager": None}))[0]
    assert plain is not None and torch.equal(plain, check.base)
    # a check whose update is gone (a restart, a repair) never re-runs from the wrong start
    with pytest.raises(RuntimeError, match="not at hand"):
        start_theta(check.__class__(**{**check.__dict__, "eager": None}))


def test_an_eager_lease_given_back_drops_the_update_kept_for_it() -> None:
    state = _state(verify=VerifyPolicy(fraction=1.0, probation_updates=0, hold_backlog=8))
    first = _granted(state, RequestWork("a"), 0.0)
    second = _granted(state, RequestWork("a", keep=first.lease_id), 1.0)
    _submit(state, first, torch.ones(4), 2.0)
    assert second.lease_id in state.verification.eager
    actions = handle(state, RequestWork("a"), 3.0)[1]  # asked again without keep: the second is given back
    assert any(isinstance(a, Expired) and a.lease_id == second.lease_id for a in actions)
    assert state.verification.eager == {}


# ------------------------------------------------------------------------------------------------ the runtime


def _eager_config(**runtime: Any) -> RunConfig:
    cfg = config(**runtime)
    return cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"eager_start": 0.7})})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("feedback", [False, True], ids=["int8", "sgn15of16-feedback"])
def test_every_lease_after_the_first_starts_eagerly_and_every_check_is_bitwise(tmp_path: Path, feedback: bool) -> None:
    upload = {"codec": "sgn15of16", "error_feedback": True, "error_feedback_decay": 0.5} if feedback else {"codec": "int8"}
    cfg, gates, rounds = _eager_config(**upload), Gates(4), 4
    peer, _, status = asyncio.run(asyncio.wait_for(_one_gated_peer(cfg, tmp_path / "run", gates), timeout=150.0))
    run_dir = tmp_path / "run"
    applied, back = _every_lease_applied_once_or_given_back(run_dir)
    assert len(applied) == rounds and back == [] and peer.runner.summary.discarded == 0
    granted = peer.client.granted
    eager = [r for r in journal(run_dir, "assign") if "eager start" in r["reason"]]
    assert [r["lease_id"] for r in eager] == granted[1:]
    assert all(f"θ − 0.7 × the update of {granted[k]}" in eager[k]["reason"] for k in range(rounds - 1))
    assert peer.client.eager == granted[:-1]  # each submission after the first named the lease before it
    verdicts = journal(run_dir, "verdict")
    assert sorted(v["lease_id"] for v in verdicts) == sorted(applied)
    assert all(v["ok"] and v["detail"] == "bitwise equal to the re-run" for v in verdicts), verdicts


@pytest.mark.timeout(180)
def test_a_peer_that_claims_an_eager_start_it_did_not_take_is_caught(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncloco.peer import pipeline

    async def claims_only(self: Any, lease: Any, theta: Any) -> tuple[Any, Any]:
        return theta, lease.eager_of or None  # trains from θ itself, says it shifted

    monkeypatch.setattr(pipeline.OverlappedRounds, "_eager_start", claims_only)
    cfg, gates = _eager_config(codec="int8"), Gates(3)
    peer, _, status = asyncio.run(asyncio.wait_for(_one_gated_peer(cfg, tmp_path / "run", gates), timeout=150.0))
    verdicts = journal(tmp_path / "run", "verdict")
    first, second = peer.client.granted[:2]
    assert {v["lease_id"]: v["ok"] for v in verdicts}[first] is True
    failed = [v for v in verdicts if not v["ok"]]
    assert [v["lease_id"] for v in failed] == [second]
    assert journal(tmp_path / "run", "expelled")[0]["peer"] == "a"


# ------------------------------------------------------------------------------------------------ the simulator


@pytest.mark.timeout(120)
def test_the_simulator_starts_each_overlapped_lease_eagerly_as_a_peer_does() -> None:
    from tests.test_sim import _records, _run, toy_config

    def run(share: float) -> tuple[Any, list[dict[str, Any]]]:
        cfg = toy_config(schedule={"grace_period": 0.0, "eager_start": share}, outer={"buffer_size": 3},
                         sim={"profile": "very", "total_local_updates": 200, "overlap": True})
        return _run(cfg, "async_dn_dylu")

    simulation, trace = run(0.7)
    tasks: dict[str, list[dict[str, Any]]] = {}
    for record in _records(trace, "task"):
        tasks.setdefault(record["worker"], []).append(record)
    for records in tasks.values():  # each lease after a worker's first: from θ minus the update of the one before
        assert "eager_of" not in records[0]
        assert [r["eager_of"] for r in records[1:]] == [r["lease_id"] for r in records[:-1]]
    applied = {r["lease_id"] for r in _records(trace, "applied")}
    assert _records(trace, "rejected") == [] and len(applied) == simulation.result.applied
    plain, plain_trace = run(0.0)
    assert all("eager_of" not in r for r in _records(plain_trace, "task"))
    assert plain.result.evals[-1] != simulation.result.evals[-1]


def test_no_eager_start_is_granted_while_the_kept_updates_fill_their_bound_checked_or_not() -> None:
    numel_bytes = 4 * 4  # θ has 4 fp32 weights: one kept update
    state = _state(verify=VerifyPolicy(fraction=1.0, probation_updates=0, hold_backlog=8, eager_keep_bytes=numel_bytes))
    handle(state, SpeedReport("b", 1.0), 0.0)
    first = _granted(state, RequestWork("a"), 0.0)
    second = _granted(state, RequestWork("a", keep=first.lease_id), 1.0)
    _submit(state, first, torch.ones(4), 2.0)
    assert list(state.verification.eager) == [second.lease_id]  # the bound is full
    other = _granted(state, RequestWork("b"), 3.0)
    b_first = handle(state, RequestWork("b", keep=other.lease_id), 4.0)[1]
    assert b_first[-1].lease.eager_of == ""  # no eager start while it is full
    assert [type(a) for a in _submit(state, second, torch.ones(4), 5.0, eager_of=first.lease_id)
            if not isinstance(a, Verify)] == [Held]
    assert state.verification.eager == {}  # taken into the check: the bound is free again
    b_lease = b_first[-1].lease
    assert _granted(state, RequestWork("b", keep=b_lease.lease_id), 6.0).eager_of == b_lease.lease_id


@pytest.mark.parametrize("drawn", [True, False], ids=["drawn-kept", "not-drawn"])
def test_a_probe_only_rejection_of_an_eager_lease_is_checked_only_where_its_start_was_kept(drawn: bool) -> None:
    """The gate's probe alone refuses nothing where work is verified: the update is held for a re-run (tests/test_verify.py).
    An eager lease's re-run needs the update its start subtracted, kept only for a lease drawn at issue; otherwise the
    update is refused as the gate says (counted as doubted, not toward quarantine), never held for a check that could
    only end unverified. The repair's replay predicate (refused_as_sent) agrees."""
    from asyncloco.algo.outer import OuterNesterov
    from asyncloco.coordinator import gate as G
    from asyncloco.coordinator.logic.submit import refused_as_sent
    from tests.test_gate_probe import N, warm_state, with_cosine

    policy = CoordinatorPolicy(max_local_steps=10, dylu=False, grace_period=0.0, lease_timeout_factor=3.0,
                               lease_slack=100.0, gate=G.GatePolicy(), eager_share=0.7,
                               verify=VerifyPolicy(fraction=1.0 if drawn else 0.0, probation_updates=0, hold_backlog=8))
    state = new_state(torch.zeros(N), OuterNesterov(0.5, 0.9), [], policy, [10_000], seed=3, lease_secret=b"s" * 32)
    state.gate = warm_state()
    handle(state, SpeedReport("old", 10.0), 0.0)
    first = _granted(state, RequestWork("old"), 0.0)
    second = _granted(state, RequestWork("old", keep=first.lease_id), 0.5)
    assert second.eager_of == first.lease_id and bool(second.verify) == drawn
    honest = with_cosine(0.9)
    accepted = handle(state, SubmitUpdate("old", first.lease_id, 0, honest), 1.0)[1]
    assert any(isinstance(a, (Applied, Held)) for a in accepted)
    assert (second.lease_id in state.verification.eager) == drawn
    flipped = SubmitUpdate("old", second.lease_id, 0, with_cosine(-0.05), probe_before=5.0, probe_after=5.02,
                           eager_of=first.lease_id)
    assert refused_as_sent(state, flipped) is (not drawn)
    actions = handle(state, flipped, 2.0)[1]
    if drawn:
        check = next(a for a in actions if isinstance(a, Verify))
        assert check.eager is not None and torch.equal(check.eager, honest) and any(isinstance(a, Held) for a in actions)
        return
    assert [type(a) for a in actions] == [Rejected, Expired] and actions[0].code == RefusalCode.GATE
    assert "the update its eager start subtracted, is not kept" in actions[0].reason
