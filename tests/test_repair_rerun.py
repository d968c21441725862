"""The default repair (runtime.verify.repair: rerun): an expelled peer's updates are replaced by honest re-runs of its
leases from the θs of the replay (asyncloco/coordinator/repair.py, asyncloco/coordinator/substitute.py;
docs/threat-model.md, "The remedy: honest re-runs"). Closed-form checks against an outer optimizer stepping on the
expected updates, and against a peer's own inner loop run lease after lease."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.outer import DelayedNesterov, OuterNesterov
from asyncloco.coordinator.logic import Lease, SubmitUpdate
from asyncloco.coordinator.rerun import Rerunner
from asyncloco.coordinator.substitute import Substitutes
from asyncloco.coordinator.verify import repair
from asyncloco.peer.inner import InnerTrainer
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
        daemon.journal.close()
        daemon.wal.close()
