"""The default repair (runtime.verify.repair: rerun): an expelled peer's updates are replaced by honest re-runs of its
leases from the θs of the replay (asyncloco/coordinator/repair.py, asyncloco/coordinator/substitute.py;
docs/threat-model.md, "The remedy: honest re-runs"). Closed-form checks against an outer optimizer stepping on the
expected updates, and against a peer's own inner loop run lease after lease."""

from __future__ import annotations

import dataclasses

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.outer import DelayedNesterov, OuterNesterov
from asyncloco.coordinator.logic import Lease, SubmitUpdate
from asyncloco.coordinator.rerun import Rerunner
from asyncloco.coordinator.substitute import Substitutes
from asyncloco.coordinator.repair import repair
from asyncloco.train.inner import InnerTrainer
from asyncloco.workloads import build_workload

from tests.test_verify import DIM, lease_record, scripted_run, toy_config, verify_state

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("make", [lambda: OuterNesterov(0.7, 0.9), lambda: DelayedNesterov(0.7, 0.9, 2)], ids=["nesterov", "dn"])
def test_a_rerun_repair_applies_the_re_runs_in_place_of_the_attackers_updates(make: Any) -> None:
    anchor = verify_state(make(), fraction=0.0, probation=0)
    live, log, honest = scripted_run(make(), rounds=5)
    calls: list[tuple[str, torch.Tensor]] = []

    def substitute(event: SubmitUpdate, lease: Lease, base: torch.Tensor) -> torch.Tensor:
        assert event.peer == "a" and lease.peer == "a" and lease.lease_id == event.lease_id
        calls.append((lease.lease_id, base.clone()))
        return torch.full((DIM,), 0.01 * len(calls))  # a stand-in for the honest re-run of this lease

    result = repair(anchor, log, live.verification.expelled, live.version, substitute=substitute)
    assert result.substituted == 5 and result.discarded == 0 and len(calls) == 5
    assert len({lease_id for lease_id, _ in calls}) == 5
    # the reference: the outer optimizer stepping on h0, the re-run, h1 in each round (the order they were applied);
    # each re-run was asked for from θ as it stood when the replay issued the attacker's lease
    reference_params = torch.zeros(DIM)
    reference = make()
    bases = [reference_params.clone()]  # its first lease: issued before any update
    for round_index in range(5):
        reference.step(reference_params, honest[2 * round_index])
        reference.step(reference_params, torch.full((DIM,), 0.01 * (round_index + 1)))
        bases.append(reference_params.clone())  # its next lease: asked for right after its submission
        reference.step(reference_params, honest[2 * round_index + 1])
    assert torch.equal(result.state.params, reference_params)
    assert all(torch.equal(base, expected) for (_, base), expected in zip(calls, bases))
    # none of the attacker's updates is in θ: the discard repair (nothing in their place) differs exactly by them
    discarded = repair(verify_state(make(), fraction=0.0, probation=0), log, ["a"], live.version)
    assert discarded.discarded == 5 and not torch.equal(discarded.state.params, result.state.params)
    # a substitute that cannot be had (None) leaves the update out, as the discard repair does
    none = repair(verify_state(make(), fraction=0.0, probation=0), log, ["a"], live.version, substitute=lambda *_: None)
    assert none.discarded == 5 and torch.equal(none.state.params, discarded.state.params)


LEASES = [(0, 0, 3, 0), (1, 2, 4, 3), (0, 3, 2, 7)]  # (shard, start offset, steps, lr offset)


def leases() -> list[Lease]:
    return [lease_record(lease_id=f"L{i}", peer="p", shard=shard, start_offset=start, steps=steps, lr_offset=lr)
            for i, (shard, start, steps, lr) in enumerate(LEASES)]


def submission(lease: Lease) -> SubmitUpdate:
    return SubmitUpdate("p", lease.lease_id, 0, torch.zeros(1))


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_substitutes_are_a_peers_honest_leases_with_the_inner_state_carried_and_read_back(tmp_path: Path, codec: str) -> None:
    cfg = toy_config(codec=codec, verify={"enabled": True, "inner_state": "carry"})
    workload = build_workload(cfg)
    peer = InnerTrainer.from_config(cfg, workload)
    assert not peer.reset_state
    theta = peer.full_params()
    bases = [theta + 0.01 * i for i in range(len(LEASES))]
    # the reference: an honest peer running the three leases one after another (its AdamW state carried)
    rerunner = Rerunner(cfg, workload)
    reference = []
    for lease, base in zip(leases(), bases):
        update = peer.run(base, lease.shard, lease.start_offset, lease.steps, lease.lr_offset).pseudo_gradient
        if codec != "none":
            from asyncloco.transport.codecs import decode, encode

            update = decode(encode(codec, update), update.numel())
        reference.append(update)
    first = Substitutes(rerunner, tmp_path, theta.numel())
    got = [first(submission(lease), lease, base) for lease, base in zip(leases(), bases)]
    assert all(g is not None and torch.equal(g, r) for g, r in zip(got, reference))
    assert first.computed == 3 and first.loaded == 0 and first.steps == sum(steps for _, _, steps, _ in LEASES)
    # a carried state matters: the third lease re-run from a fresh state differs
    fresh = Substitutes(rerunner, tmp_path / "fresh", theta.numel(), carry=False)
    alone = fresh(submission(leases()[2]), leases()[2], bases[2])
    assert alone is not None and not torch.equal(alone, reference[2])
    # a lease granted with a fresh start (Lease.fresh: its peer's uplink could not carry a reveal) is re-run fresh in a
    # carried replay too, exactly as its peer trained it — and keyed so, apart from the carried one
    granted = dataclasses.replace(leases()[2], fresh=True)
    carried = Substitutes(rerunner, tmp_path / "granted", theta.numel())
    chain = [carried(submission(lease), lease, base) for lease, base in zip([*leases()[:2], granted], bases)]
    assert chain[2] is not None and torch.equal(chain[2], alone) and carried.computed == 3
    # the same replay again reads every re-run back (the daemon's second replay, a --resume): the same bits
    again = Substitutes(rerunner, tmp_path, theta.numel())
    read = [again(submission(lease), lease, base) for lease, base in zip(leases(), bases)]
    assert again.computed == 0 and again.loaded == 3
    assert all(g is not None and torch.equal(g, r) for g, r in zip(read, reference))
    # stored through the second lease only: the third is trained from the stored state after the second
    partial = tmp_path / "partial"
    ahead = Substitutes(rerunner, partial, theta.numel())
    for lease, base in list(zip(leases(), bases))[:2]:
        ahead(submission(lease), lease, base)
    later = Substitutes(rerunner, partial, theta.numel())
    continued = [later(submission(lease), lease, base) for lease, base in zip(leases(), bases)]
    assert later.loaded == 2 and later.computed == 1
    assert continued[2] is not None and torch.equal(continued[2], reference[2])
    # another base θ for the first lease is another computation: nothing stored fits it or what follows
    moved = Substitutes(rerunner, tmp_path, theta.numel())
    other = [moved(submission(lease), lease, base + (0.001 if i == 0 else 0.0)) for i, (lease, base) in enumerate(zip(leases(), bases))]
    assert moved.computed == 3 and moved.loaded == 0
    assert other[0] is not None and not torch.equal(other[0], reference[0])


def test_no_snapshot_falls_between_an_expulsion_and_its_repair(tmp_path: Path) -> None:
    """The repair comes after the expulsion (once its re-runs are trained): a snapshot between the two would let a
    --resume start after the Verified record and never repair θ, so none is taken while a repair is pending."""
    import asyncio

    from asyncloco.coordinator.daemon import CoordinatorDaemon
    from asyncloco.coordinator.logic import Expelled

    from tests.test_verify_runtime import config

    daemon = CoordinatorDaemon(config(), checkpoint_dir=tmp_path)
    try:
        verification = daemon.verification
        assert verification is not None and verification.reruns is not None  # repair: rerun, the default
        verification.pending_repairs.append(Expelled("mal", "L1", "did not reproduce", 0))
        daemon.durability.updates_since_snapshot = 10**6  # a snapshot is due
        asyncio.run(daemon.durability.save())
        assert not (tmp_path / "state.pt").exists()
        verification.pending_repairs.clear()
        asyncio.run(daemon.durability.save())
        assert (tmp_path / "state.pt").is_file()
    finally:
        daemon.monitoring.journal.close()
        daemon.node.wal.close()


def gated_state(optimizer: Any) -> Any:
    """verify_state's coordinator with the update gate on (no probe)."""

    from asyncloco.coordinator.gate import GatePolicy

    state = verify_state(optimizer, fraction=0.0, probation=0)
    state.policy = dataclasses.replace(state.policy, gate=GatePolicy(
        warmup=2, probation_updates=0, quarantine_after=100, quarantine_window=100, probe=False))
    return state


def gated_run(optimizer: Any, rounds: int, huge: set[int]) -> tuple[Any, list[Any], list[torch.Tensor], list[str]]:
    """scripted_run's turns with the update gate on: the attacker's update is 1000 × too large in the rounds of
    ``huge`` (the gate rejects it and gives its steps back). Returns the live state, the log, the honest updates
    in the order they were applied, and the attacker's verdicts (applied / rejected), round by round."""
    from asyncloco.coordinator.logic import Applied, Assign, Held, RequestWork, Rejected, SpeedReport, Verified, handle

    state = gated_state(optimizer)
    log: list[Any] = []
    honest: list[torch.Tensor] = []
    outcomes: list[str] = []
    generator = torch.Generator().manual_seed(11)

    def feed(event: Any, now: float) -> list[Any]:
        log.append((event, now))
        return handle(state, event, now)[1]

    for peer in ("h0", "h1", "a"):
        feed(SpeedReport(peer, 10.0), 0.0)
    leases = {peer: next(x.lease for x in feed(RequestWork(peer), 0.0) if isinstance(x, Assign)) for peer in ("h0", "h1", "a")}
    direction = torch.linspace(1.0, 2.0, DIM)  # what every update shares: the gate's consensus
    now = 0.0
    for round_index in range(rounds):
        for peer in ("h0", "a", "h1"):
            now += 1.0
            update = direction + 0.3 * torch.randn(DIM, generator=generator)
            if peer == "a" and round_index in huge:
                update = update * 1000.0
            sent = update.clone()
            actions = feed(SubmitUpdate(peer, leases[peer].lease_id, leases[peer].base_version, update), now)
            assert torch.equal(update, sent)  # handle never changes its event (a replay feeds it again)
            if peer == "a":  # a held update of the attacker waits for a check it never passes
                outcomes.append("applied" if any(isinstance(x, Applied) for x in actions) else
                                "rejected" if any(isinstance(x, Rejected) for x in actions) else
                                "held" if any(isinstance(x, Held) for x in actions) else "?")
            else:
                if any(isinstance(x, Held) for x in actions):  # a suspect's (the echo rule) lease was checked: it agrees
                    actions = feed(Verified(peer, leases[peer].lease_id, True, "bitwise"), now)
                assert any(isinstance(x, Applied) for x in actions)
                honest.append(update)
            leases[peer] = next(x.lease for x in feed(RequestWork(peer), now) if isinstance(x, Assign))
    feed(Verified("a", "Lfailed", False, "relative error 1.9"), now + 1.0)
    return state, log, honest, outcomes


@pytest.mark.parametrize("make", [lambda: OuterNesterov(0.7, 0.9), lambda: DelayedNesterov(0.7, 0.9, 2)], ids=["nesterov", "dn"])
def test_a_repair_keeps_every_decision_of_the_live_run(make: Any) -> None:
    """The repair changes θ only: what the live gate refused of the expelled peer stays refused (its steps given back,
    as the live run gave them back: a re-run in its place numbered every later lease one off in a benchmark run),
    what it applied is replaced by the re-run, and the gate's statistics stay the live ones (they saw the
    submissions as sent), so every honest verdict is the live verdict."""
    live, log, honest, outcomes = gated_run(make(), rounds=5, huge={1, 3})
    # rejected by the gate, the attacker became a suspect: its later leases were checked and held, never applied
    assert outcomes == ["applied", "rejected", "held", "rejected", "held"]
    assert not live.verification.held and live.verification.dropped == 2
    calls: list[str] = []

    def substitute(event: SubmitUpdate, lease: Lease, base: torch.Tensor) -> torch.Tensor:
        calls.append(lease.lease_id)
        return torch.full((DIM,), 0.01 * len(calls))

    result = repair(gated_state(make()), log, ["a"], live.version, substitute=substitute)
    assert (result.substituted, result.refused, result.held, result.discarded) == (1, 2, 2, 0) and len(calls) == 1
    # θ: the outer optimizer stepping on h0, (the re-run where the live run applied the attacker's update), h1
    reference_params = torch.zeros(DIM)
    reference = make()
    for round_index in range(5):
        reference.step(reference_params, honest[2 * round_index])
        if outcomes[round_index] == "applied":
            reference.step(reference_params, torch.full((DIM,), 0.01 * (1 + sum(o == "applied" for o in outcomes[:round_index]))))
        reference.step(reference_params, honest[2 * round_index + 1])
    assert torch.equal(result.state.params, reference_params)
    # the gate's statistics are the live ones, exactly
    gate, live_gate = result.state.gate, live.gate
    assert gate.reference is not None and live_gate.reference is not None
    assert torch.equal(gate.reference, live_gate.reference) and gate.norms == live_gate.norms and gate.cosines == live_gate.cosines
    assert gate.accepted == live_gate.accepted and gate.peer_accepted == live_gate.peer_accepted


def test_handle_never_changes_the_event_it_clips() -> None:
    """A clipped update is scaled into a new tensor: the event stays as it was logged (the repair's re-run preparation
    and its replay feed the same decoded events again; scaled in place, the second pass saw an update already clipped)."""
    from asyncloco.coordinator.logic import Applied, Assign, RequestWork, SpeedReport, handle

    state = gated_state(OuterNesterov(0.7, 0.9))
    handle(state, SpeedReport("p", 10.0), 0.0)
    notes = []
    for i in range(4):
        lease = next(x.lease for x in handle(state, RequestWork("p"), float(i))[1] if isinstance(x, Assign))
        update = torch.linspace(1.0, 2.0, DIM) * (10.0 if i == 3 else 1.0)
        sent = update.clone()
        actions = handle(state, SubmitUpdate("p", lease.lease_id, lease.base_version, update), float(i) + 0.5)[1]
        notes += [x.gate for x in actions if isinstance(x, Applied)]
        assert torch.equal(update, sent)
    assert notes[-1].startswith("clipped ×0.4:"), notes  # 4 × the median per-step norm, of 10 ×
