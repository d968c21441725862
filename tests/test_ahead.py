"""Re-runs ahead (asyncloco/coordinator/ahead.py, ``runtime.verify.ahead``): a checked reset-state lease is re-run
while its peer trains, from the θ the coordinator sent it, and its update is judged from that re-run when it arrives.

Pinned here: a result is used only for the lease and the θ (codec, anchor, digest) it was made for, and then gives the
same verdict as a re-run made after the update came (an honest update bitwise equal, a tampered one refused); the
bounds; and end to end, over the in-memory transport with peers that train slower than the coordinator re-runs,
every check judged from its re-run ahead — none re-run twice — with a cheating peer still caught on probation and
nothing of it applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.clock import FakeClock
from asyncloco.coordinator.ahead import PLANS_PER_LEASE, Ahead, AheadRun
from asyncloco.coordinator.logic import Lease, Verify
from asyncloco.coordinator.rerun import Rerunner
from asyncloco.peer.runner import PeerError
from asyncloco.testing.memory import MemoryTransport, drive
from asyncloco.transport.delta import AnchorStore, decoded_theta, theta_digest
from asyncloco.workloads import build_workload

sys.path.insert(0, str(Path(__file__).parent))
from test_verify_runtime import HONEST, HOSTILE, HostileRunner, config, read_journal, start_peer  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def lease(lease_id: str = "L1", steps: int = 4, start_offset: int = 3) -> Lease:
    return Lease(lease_id, "peer", shard=0, start_offset=start_offset, steps=steps, lr_offset=0, base_version=0,
                 issued_at=0.0, expected_finish=1.0, deadline=1e9, verify="drawn")


def check(task_lease: Lease, base: torch.Tensor, update: torch.Tensor, codec: str = "", anchor: Any = None,
          digest: str = "", anchor_body: Any = None) -> Verify:
    return Verify("peer", task_lease, base, update, task_lease.verify, theta_codec=codec, theta_anchor=anchor,
                  theta_digest=digest, anchor_body=anchor_body)


def test_a_result_is_used_only_for_its_lease_and_theta_and_judges_as_a_re_run() -> None:
    cfg = config()
    workload = build_workload(cfg)
    rerunner = Rerunner(cfg, workload)
    numel = rerunner.trainer.numel
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    ahead = Ahead(limit=4)
    # θ sent in int8 as a delta from an anchor the peer held: the re-run starts from that θ, bit for bit
    store = AnchorStore(numel, max_anchors=2, max_bodies=2)
    anchor_theta = base + 0.01 * torch.randn(numel, generator=torch.Generator().manual_seed(2))
    anchor_body = store.serve(0, "int8", anchor_theta, None).body
    served = store.serve(1, "int8", base, 0)
    assert served.delta_from == 0
    sent = decoded_theta("int8", base, bytes(anchor_body))
    honest = rerunner.rerun(lease(), sent)
    assert ahead.plan(AheadRun(lease(), base, "int8", 0, bytes(anchor_body)))
    run = ahead.next()
    assert run is not None and ahead.running == "L1"
    ahead.finish(Ahead.run(run, rerunner))
    assert ahead.stats.run == 1 and ahead.stats.steps == 4

    result = ahead.take("L1")
    assert result is not None and ahead.take("L1") is None
    named = check(lease(), base, honest, "int8", 0, theta_digest(sent))
    verdict = ahead.judge(named, result, rerunner)
    assert verdict is not None and verdict.ok and verdict.bitwise
    # the same verdict a re-run after the update gives (the daemon attaches the anchor's bytes to a queued check)
    assert verdict == rerunner.check(dataclasses.replace(named, anchor_body=bytes(anchor_body)))
    tampered = honest + 0.05 * honest.norm() * torch.ones(numel) / numel ** 0.5
    refused = ahead.judge(check(lease(), base, tampered, "int8", 0, theta_digest(sent)), result, rerunner)
    assert refused is not None and not refused.ok
    assert refused == rerunner.check(check(lease(), base, tampered, "int8", 0, theta_digest(sent), bytes(anchor_body)))
    # another θ named (in full, or another digest), another lease, or no provenance for a lossy θ: not this result
    assert ahead.judge(check(lease(), base, honest, "int8", None, theta_digest(sent)), result, rerunner) is None
    assert ahead.judge(check(lease(), base, honest, "int8", 0, theta_digest(base)), result, rerunner) is None
    assert ahead.judge(check(lease(steps=5), base, honest, "int8", 0, theta_digest(sent)), result, rerunner) is None
    assert ahead.judge(check(lease(start_offset=4), base, honest, "int8", 0, theta_digest(sent)), result, rerunner) is None
    assert ahead.judge(check(lease(), base, honest), result, rerunner) is None
    # fp32 sent, a submission naming no provenance: θ at the base version itself, matched by its digest
    assert ahead.plan(AheadRun(lease("L2"), base, "none", None, None))
    run = ahead.next()
    assert run is not None
    ahead.finish(Ahead.run(run, rerunner))
    plain = ahead.take("L2")
    assert plain is not None
    fp32 = rerunner.rerun(lease("L2"), base)
    verdict = ahead.judge(check(lease("L2"), base, fp32), plain, rerunner)
    assert verdict is not None and verdict.ok and verdict.bitwise
    other_base = base.clone()
    other_base[0] += 1.0
    assert ahead.judge(check(lease("L2"), other_base, fp32), plain, rerunner) is None


def test_plans_are_bounded() -> None:
    ahead = Ahead(limit=2)
    base = torch.zeros(4)
    for index in range(3):
        assert ahead.plan(AheadRun(lease(f"L{index}"), base, "none", None, None))
    assert list(ahead.planned) == ["L1", "L2"] and ahead.stats.superseded == 1
    assert not ahead.plan(AheadRun(lease("L2"), base, "none", None, None))  # planned already, from this θ
    # the same lease downloaded again in other encodings: re-planned PLANS_PER_LEASE times at most
    for anchor in range(5):
        ahead.plan(AheadRun(lease("L9"), base, "int8", anchor, b""))
    assert ahead.plans["L9"] == PLANS_PER_LEASE
    # a planned run its update overtook is dropped at the check (the check re-runs it)
    assert ahead.take("L2") is None and "L2" not in ahead.planned
    ahead.forget({"L1"})
    assert "L1" not in ahead.planned


def test_checks_are_judged_from_re_runs_made_while_their_peers_trained(tmp_path: Path) -> None:
    """Peers that train slower than the coordinator re-runs (each waits, with a deadline, for the coordinator to have
    re-run its lease ahead when the lease is chosen): every check is judged from its re-run ahead on arrival — none
    re-run after its update, each verdict decided right after its submit — every honest verdict is a bitwise match,
    and a peer cheating from its first lease is caught on probation with nothing of it applied."""
    cfg = config(verify={"enabled": True, "inner_state": "reset", "fraction": 0.5, "probation_updates": 2,
                         "horizon": 100000, "queue": 256, "ahead": 8})
    clock = FakeClock()
    run_dir = tmp_path / "run"
    holder: dict[str, Any] = {}

    def wait_for_ahead(lease_id: str) -> None:
        """In the peer's training thread: a chosen lease trains until its re-run ahead is done (10 s deadline)."""
        daemon = holder["transport"].daemon
        chosen = daemon.node.state.leases.get(lease_id)
        if chosen is None or not chosen.verify or chosen.verify.startswith("probation: held"):
            return
        deadline = time.monotonic() + 10.0
        while lease_id not in daemon.verification.verifier.ahead.done:
            assert time.monotonic() < deadline, f"lease {lease_id} was not re-run ahead within 10 s"
            time.sleep(0.005)

    def slow(runner_cls: Any) -> Any:
        class Slow(runner_cls):  # type: ignore[misc, valid-type]
            def _train(self, trainer: Any, theta: torch.Tensor, grant: Any, bar: Any) -> Any:
                result = super()._train(trainer, theta, grant, bar)
                wait_for_ahead(grant.lease_id)
                return result
        return Slow

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        holder["transport"] = transport
        await transport.start()
        try:
            tasks = {name: start_peer(transport, name, rounds=6, runner_cls=slow(HostileRunner), honest_leases=10**6)[1]
                     for name in HONEST}
            hostile = start_peer(transport, HOSTILE, rounds=10, runner_cls=slow(HostileRunner), honest_leases=0)[1]
            await drive(clock, tasks | {HOSTILE: hostile}, real_timeout=150.0)
            daemon = transport.daemon
            assert daemon is not None and daemon.verification is not None
            await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)
            with pytest.raises(PeerError, match="expelled from this run"):
                hostile.result()
            return daemon.verification.status()
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    status = asyncio.run(asyncio.wait_for(scenario(), timeout=200.0))
    ahead = status["ahead"]
    journal = read_journal(run_dir)
    verdicts = [r for r in journal if r["type"] == "verdict"]
    honest = [r for r in verdicts if r["peer"] != HOSTILE]
    assert honest and all(r["ok"] and "bitwise equal" in r["detail"] for r in honest)
    assert [r["ok"] for r in verdicts if r["peer"] == HOSTILE] == [False]
    assert not [r for r in journal if r["type"] == "applied" and r["peer"] == HOSTILE]
    # every verdict came from a re-run ahead, none from a re-run after the update; nothing was re-run twice
    assert ahead["used"] == len(verdicts) and ahead["mismatched"] == 0
    assert ahead["on_arrival"] == len(verdicts)  # each decided by its update's submit, right after it
    assert status["rerun_steps"] == ahead["steps"] and ahead["run"] >= ahead["used"]
    # judged on arrival: each checked update's verdict (and, if it agrees, its application) follows its held record
    # with nothing decided in between — θ took it as if it had never been held
    decided = [r for r in journal if r["type"] in ("held", "verdict", "applied", "assign", "rejected")]
    checked = {r["lease_id"] for r in honest}  # (the others held wait for their peer's probation verdicts)
    assert checked
    for index, record in enumerate(decided):
        if record["type"] == "held" and record["lease_id"] in checked:
            following = decided[index + 1: index + 3]
            assert [(r["type"], r["lease_id"]) for r in following] == [("verdict", record["lease_id"]),
                                                                       ("applied", record["lease_id"])], decided[index: index + 4]
