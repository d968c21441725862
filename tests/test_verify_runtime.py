"""Verification end to end in the real runtime: the real coordinator daemon and real peer runners over the in-memory
transport (asyncloco/testing/memory.py), with ``runtime.verify`` on (asyncloco/coordinator/verify.py).

Three honest peers and one hostile peer. The hostile peer trains its leases honestly (it passes its probation),
then adds a hidden direction of 5 % of the update's norm — a cosine of 0.999 with its honest work, inside every
statistical test of the gate. The coordinator re-runs a sample of the leases (fraction 0.5 after a probation of 2
verified updates; the draw is an HMAC under a secret the peers never see). What this pins:

* the hostile peer is caught on a sampled lease and expelled (its next call is refused, naming the expulsion);
* honest peers are never flagged: every verdict on an honest lease is a match (bitwise), and every applied honest
  lease chosen for verification got its verdict;
* the exact remedy: θ was repaired by replaying the log with each of the attacker's submissions replaced by the
  honest re-run of its lease (``runtime.verify.repair: rerun``, the default) or discarded (``discard``), and the live
  coordinator's final θ (with the outer optimizer's state, the version and the local-update count) equals, bitwise,
  an independent replay of the whole write-ahead log from the initial anchor doing the same at the expulsion (its
  re-runs trained again);
* verdicts are in the journal and in status.json (checked / failed / expelled / repairs).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.checkpoint import load_snapshot
from asyncloco.coordinator.daemon import EVENT_TYPES, JOURNAL_FILE, STATUS_FILE, CoordinatorDaemon
from asyncloco.coordinator.wal import ARCHIVE_DIR, WAL_DIR, decode_event, read_records
from asyncloco.coordinator.logic import Repaired, SubmitUpdate, Verified, handle
from asyncloco.coordinator.substitute import Substitutes
from asyncloco.coordinator.repair import ANCHOR_DIR, log_events, repair
from asyncloco.coordinator.rerun import Rerunner
from asyncloco.coordinator.verify import live_base
from asyncloco.workloads import build_workload
from asyncloco.train.inner import InnerTrainer
from asyncloco.peer.runner import PeerError, PeerOptions, PeerRunner
from asyncloco.testing.memory import MemoryClient, MemoryTransport, as_actor, drive
from asyncloco.transport.rpc import TrafficCounters
from asyncloco.transport.wire import LeaseGrant

pytestmark = pytest.mark.timeout(240)

SPEED = 1000.0
HONEST = ("h0", "h1", "h2")
HOSTILE = "mal"


def config(repair: str = "rerun", **runtime: Any) -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 4},
        "sim": {"workers": 4},
        "runtime": {
            "snapshot_every": 4, "eval_every": 100000, "lease_slack": 30.0, "speed_report_period": 600.0,
            "gate": {"enabled": False},  # the hidden direction is shaped to pass it anyway; verification does not need it
            "verify": {"enabled": True, "inner_state": "reset", "fraction": 0.5, "probation_updates": 2, "horizon": 100000,
                       "queue": 256, "repair": repair},
            **runtime,
        },
    })


class HostileRunner(PeerRunner):
    """Honest for its first ``honest_leases`` leases, then honest work plus a hidden direction of 5 % of its norm."""

    def __init__(self, *args: Any, honest_leases: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.honest_leases = honest_leases
        self.trained = 0
        self.tampered: list[str] = []

    def _train(self, trainer: InnerTrainer, theta: torch.Tensor, lease: LeaseGrant, bar: Any) -> tuple[torch.Tensor, float, list[float]]:
        update, seconds, steps = super()._train(trainer, theta, lease, bar)
        self.trained += 1
        if self.trained > self.honest_leases:
            direction = torch.randn(update.numel(), generator=torch.Generator().manual_seed(99))
            update = update + 0.05 * update.norm() * direction / direction.norm()
            self.tampered.append(lease.lease_id)
        return update, seconds, steps


def start_peer(transport: MemoryTransport, name: str, rounds: int, runner_cls: Any = PeerRunner, **kwargs: Any) -> tuple[PeerRunner, "asyncio.Task[Any]"]:
    cfg = transport.cfg
    options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                          progress=False, max_rounds=rounds)
    runner = runner_cls(options, clock=transport.clock, **kwargs)
    runner.summary.peer_id = name
    runner.speed = SPEED
    counters = TrafficCounters()
    client = MemoryClient(transport, name, counters=counters, download_codec=cfg.runtime.download_codec)
    trainer = InnerTrainer.from_config(cfg, transport.workload)
    assert trainer.reset_state  # the peers read runtime.verify.inner_state from the run's config
    task = as_actor(name, runner.serve(client, transport.publisher(name, signer=f"key-{name}"), cfg, transport.workload,
                                       trainer, cfg.runtime.codec, counters))
    return runner, task


def re_run(verify: str) -> bool:
    """Was a lease with this ``verify`` reason chosen for a re-run (not merely held while its peer's probation checks
    were on their way)?"""
    from asyncloco.coordinator.logic import PROBATION_WAIT

    return bool(verify) and not verify.startswith(PROBATION_WAIT)


def read_journal(run_dir: Path, kind: Optional[str] = None) -> list[dict[str, Any]]:
    lines = (run_dir / JOURNAL_FILE).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if kind is None or r["type"] == kind]


def test_a_peer_caught_on_probation_never_touches_theta(tmp_path: Path) -> None:
    """Checked work waits for its verdict: a peer that cheats from its first lease has every update held until its
    check, the first check fails, its held updates are dropped — none is ever applied, no repair runs — and θ equals,
    bitwise, the log replayed without its submissions."""
    cfg = config(verify={"enabled": True, "inner_state": "reset", "fraction": 0.5, "probation_updates": 2,
                         "horizon": 100000, "queue": 256, "sketch_threshold": 1.0})
    clock = FakeClock()
    run_dir = tmp_path / "run"

    async def scenario() -> tuple[Any, int, int, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        daemon = await transport.start()
        try:
            peers = {name: start_peer(transport, name, rounds=8) for name in HONEST}
            _, hostile_task = start_peer(transport, HOSTILE, rounds=20, runner_cls=HostileRunner, honest_leases=0)
            tasks = {name: task for name, (_, task) in peers.items()} | {HOSTILE: hostile_task}
            await drive(clock, tasks, real_timeout=150.0)
            daemon = transport.daemon
            assert daemon is not None and daemon.verification is not None
            await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)
            with pytest.raises(PeerError, match="expelled from this run"):
                hostile_task.result()
            return daemon.node.state, daemon.node.wal.last_seq, daemon.numel, daemon.verification.fresh_state
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    live, last_seq, numel, fresh = asyncio.run(asyncio.wait_for(scenario(), timeout=200.0))
    assert list(live.verification.expelled) == [HOSTILE] and not live.verification.held
    journal = read_journal(run_dir)
    held = [r for r in journal if r["type"] == "held" and r["peer"] == HOSTILE]
    assert held and not [r for r in journal if r["type"] == "applied" and r["peer"] == HOSTILE]
    assert [r["repair"] for r in journal if r["type"] == "expelled"] == [False]
    assert not [r for r in journal if r["type"] == "repaired"] and live.verification.unchecked.get(HOSTILE, 0) == 0
    dropped = [r for r in journal if r["type"] == "rejected" and r["peer"] == HOSTILE and "held update not applied" in r["reason"]]
    assert {r["lease_id"] for r in dropped} == {r["lease_id"] for r in held}
    # the log replayed without the hostile peer's submissions gives the same θ, bitwise
    anchor = load_snapshot(run_dir / ANCHOR_DIR / f"{0:020d}")
    state = fresh()
    state.load_state_dict(anchor["coordinator"])
    events = list(log_events(run_dir / "wal", 0, last_seq, EVENT_TYPES, numel))
    for event, now in events:
        if not (isinstance(event, SubmitUpdate) and event.peer == HOSTILE):
            handle(state, event, now)
    assert torch.equal(state.params, live.params) and state.version == live.version and live.version > 0


@pytest.mark.parametrize("mode", ["rerun", "discard"])
def test_a_hostile_peer_is_caught_expelled_and_its_updates_are_gone(tmp_path: Path, mode: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the repair of what got through: the attacker's first two leases after probation are not drawn for a check (so its
    # tampered updates are applied), its third is (the sketch that would make it a suspect sooner is off). Decided per
    # lease id, so every replay of the log draws the same
    cfg = config(repair=mode, verify={"enabled": True, "inner_state": "reset", "fraction": 0.5, "probation_updates": 2,
                                      "horizon": 100000, "queue": 256, "repair": mode, "sketch_threshold": 1.0})
    from asyncloco.coordinator.logic import leases as lease_logic

    drawn = lease_logic.verify_reason
    decided: dict[str, str] = {}

    def verify_reason(state: Any, policy: Any, peer: str, lease_id: str) -> str:
        reason = drawn(state, policy, peer, lease_id)
        if peer != HOSTILE or reason.startswith("probation"):
            return reason
        if lease_id not in decided:
            decided[lease_id] = "sampled at 0.5" if len(decided) >= 2 else ""
        return decided[lease_id]

    monkeypatch.setattr(lease_logic, "verify_reason", verify_reason)
    clock = FakeClock()
    run_dir = tmp_path / "run"

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        daemon = await transport.start()
        try:
            peers = {name: start_peer(transport, name, rounds=12) for name in HONEST}
            hostile, hostile_task = start_peer(transport, HOSTILE, rounds=40, runner_cls=HostileRunner, honest_leases=2)
            tasks = {name: task for name, (_, task) in peers.items()} | {HOSTILE: hostile_task}
            await drive(clock, tasks, real_timeout=150.0)
            verification = transport.daemon.verification if transport.daemon is not None else None
            assert verification is not None
            await asyncio.wait_for(verification.drain(), timeout=60.0)
            daemon = transport.daemon
            assert daemon is not None
            daemon.monitoring.write_status()
            with pytest.raises(PeerError, match="expelled from this run"):
                hostile_task.result()
            for name, (runner, task) in peers.items():
                task.result()
            return {
                "hostile": hostile,
                "honest": {name: runner.summary for name, (runner, _) in peers.items()},
                "state": daemon.node.state,
                "last_seq": daemon.node.wal.last_seq,
                "numel": daemon.numel,
                "status": json.loads((run_dir / STATUS_FILE).read_text()),
                "fresh": daemon.verification.fresh_state if daemon.verification is not None else None,
            }
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    out = asyncio.run(asyncio.wait_for(scenario(), timeout=200.0))
    live = out["state"]
    hostile: HostileRunner = out["hostile"]
    book = live.verification
    # caught on a tampered lease, expelled; nobody else
    assert list(book.expelled) == [HOSTILE] and book.failed == 1
    verdicts = [v for v in read_journal(run_dir, "verdict") if "(peer already expelled)" not in v["detail"]]
    failed = [v for v in verdicts if not v["ok"]]
    assert len(failed) == 1 and failed[0]["peer"] == HOSTILE and failed[0]["lease_id"] in hostile.tampered
    assert "bitwise equality" in failed[0]["detail"]
    # honest peers are never flagged, and every applied honest lease chosen for verification got a match
    honest_verdicts = [v for v in verdicts if v["peer"] in HONEST]
    assert honest_verdicts and all(v["ok"] and v["detail"] == "bitwise equal to the re-run" for v in honest_verdicts)
    assigned = {a["lease_id"]: a for a in read_journal(run_dir, "assign")}
    applied_honest = [a for a in read_journal(run_dir, "applied") if a["peer"] in HONEST]
    chosen = {a["lease_id"] for a in applied_honest if re_run(assigned[a["lease_id"]]["verify"])}
    assert {v["lease_id"] for v in honest_verdicts} == chosen and len(honest_verdicts) == len(chosen)
    assert sum(book.passed.get(name, 0) for name in HONEST) == len(chosen) and not book.pending
    # the repair: every applied update of the attacker before the expulsion was replaced by the honest re-run of its
    # lease (rerun), or discarded
    repairs = read_journal(run_dir, "repaired")
    assert len(repairs) == 1 and repairs[0]["peer"] == HOSTILE and repairs[0]["anchor"] == 0
    # what the journal recorded before the expulsion (in its order: on the fake clock many records share one time)
    records = read_journal(run_dir)
    logged_before = records[:next(i for i, r in enumerate(records) if r["type"] == "expelled")]
    hostile_applied = [a for a in logged_before if a["type"] == "applied" and a["peer"] == HOSTILE]
    # its held leases (probation always; a drawn one while the verifier's backlog was short) waited for their (passed)
    # checks: the repair's replay keeps them as the live run applied them; what was applied before any verdict — not
    # drawn, or drawn behind a busy verifier (runtime.verify.hold_backlog) — is taken out
    held = [h for h in logged_before if h["type"] == "held" and h["peer"] == HOSTILE]
    held_ids = {h["lease_id"] for h in held}
    unchecked = [a for a in hostile_applied if a["lease_id"] not in held_ids]
    assert all(not assigned[a["lease_id"]]["verify"] or not assigned[a["lease_id"]]["verify"].startswith("probation")
               for a in unchecked)  # probation is never applied before its verdict
    assert len(hostile_applied) - len(unchecked) >= 2  # its probation leases, applied once their checks agreed
    # held: applied once its check agreed, or dropped (the one that failed if it was held, and any still pending then)
    dropped = {r["lease_id"] for r in read_journal(run_dir, "rejected")
               if r["peer"] == HOSTILE and "held update not applied" in r["reason"]}
    checked_applied = {a["lease_id"] for a in hostile_applied} - {a["lease_id"] for a in unchecked}
    applied_first = {a["lease_id"] for a in unchecked if assigned[a["lease_id"]]["verify"]}
    assert (failed[0]["lease_id"] in dropped) != (failed[0]["lease_id"] in applied_first)
    assert not dropped & checked_applied
    assert repairs[0]["held"] == len(held) and {h["lease_id"] for h in held} == checked_applied | dropped
    # the remedy: both candidates' θ evaluated, the lower validation loss installed (never worse than leaving it out)
    remedy, losses = repairs[0]["remedy"], repairs[0]["losses"]
    candidates = ["rerun", "discard"] if mode == "rerun" else ["discard"]
    assert sorted(losses) == sorted(candidates + ["live"]) and all(math.isfinite(v) for v in losses.values())
    assert remedy == min(candidates, key=lambda kind: (losses[kind], candidates.index(kind)))
    assert repairs[0]["loss_before"] == losses["live"] and repairs[0]["loss_after"] == losses[remedy] <= losses["discard"]
    if remedy == "rerun":
        # (a submission the live coordinator did not apply is a no-op Discard in either mode)
        assert repairs[0]["substituted"] == len(unchecked) >= 1
        # trained after the expulsion (nothing more of the peer's was taken), outside the daemon's lock, and read back
        # by the repair: nothing trained under the lock
        assert repairs[0]["rerun_stored"] == repairs[0]["substituted"] and repairs[0]["rerun_now"] == 0
    else:
        assert repairs[0]["discarded"] >= len(unchecked) >= 1 and repairs[0]["substituted"] == 0
    # status.json
    section = out["status"]["verification"]
    assert section["failed"] == 1 and list(section["expelled"]) == [HOSTILE] and len(section["repairs"]) == 1
    assert section["checked"] == book.checked and section["skipped"] == 0 and section["compute_fraction"] > 0

    # an independent replay of the whole log: from the initial anchor, the attacker's submissions replaced by re-runs
    # of its leases trained again here (or discarded) up to its expulsion (verify.repair), then every later record as
    # it was — equals the live coordinator, bitwise
    substitute = Substitutes(Rerunner(cfg, build_workload(cfg)), tmp_path / "reruns", out["numel"], carry=False) \
        if remedy == "rerun" else None
    anchor = load_snapshot(run_dir / ANCHOR_DIR / f"{0:020d}")
    state = out["fresh"]()
    state.load_state_dict(anchor["coordinator"])
    events = list(log_events(run_dir / "wal", 0, out["last_seq"], EVENT_TYPES, out["numel"]))
    expelled = next(i for i, (e, _) in enumerate(events) if isinstance(e, Verified) and not e.ok)
    # the repair came after the expulsion, once its re-runs were trained: right before its Repaired record
    cut = next(i for i, (e, _) in enumerate(events) if isinstance(e, Repaired)) - 1
    assert cut >= expelled
    before = out["fresh"]()  # the live coordinator as the repair found it: the log replayed as it was
    before.load_state_dict(anchor["coordinator"])
    for event, now in events[: cut + 1]:
        handle(before, event, now)
    result = repair(state, events[: cut + 1], [HOSTILE], repairs[0]["version_before"], before.leases,
                    before.lease_counter, before.verification.chain, live_base(before), substitute)
    replayed = result.state
    repaired_params, repaired_version = replayed.params.clone(), replayed.version  # θ right after the repair
    # the repair's own decisions are the log's next record (a later repair's replay repeats them there)
    assert events[cut + 1][0] == dataclasses.replace(result.repaired, remedy=remedy)
    assert sum(isinstance(e, Repaired) for e, _ in events) == 1
    for event, now in events[cut + 1 :]:
        handle(replayed, event, now)
    assert torch.equal(replayed.params, live.params)
    assert replayed.version == live.version and replayed.local_updates == live.local_updates
    for key, value in live.optimizer.state_dict().items():
        other = replayed.optimizer.state_dict()[key]
        assert torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value

    # --resume from the initial anchor with the whole log replays the Verified record (the repair, again: its
    # re-runs trained again, the stored ones are not copied) and then meets the logged Repaired: the resumed
    # coordinator equals the live one
    resumed = resume_from_anchor(cfg, run_dir, tmp_path / "resumed")
    assert torch.equal(resumed.node.state.params, live.params) and resumed.node.state.version == live.version
    assert resumed.node.state.lease_counter == live.lease_counter and resumed.node.state.local_updates == live.local_updates
    # a coordinator that died between the Verified record and its Repaired: the replay re-derives the repair and
    # writes the missing record, which a later repair's replay will meet
    cut_seq = next(record.seq for record in read_records(run_dir / WAL_DIR / ARCHIVE_DIR, 0) if record.type == "Repaired")
    died = resume_from_anchor(cfg, run_dir, tmp_path / "died", upto=cut_seq - 1)
    assert torch.equal(died.node.state.params, repaired_params) and died.node.state.version == repaired_version
    written = list(read_records(tmp_path / "died" / WAL_DIR, cut_seq - 1))
    assert [r.type for r in written] == ["Repaired", "Restarted"] and written[0].seq == cut_seq
    assert decode_event(written[0], EVENT_TYPES, lambda *_: None) == dataclasses.replace(result.repaired, remedy=remedy)


def resume_from_anchor(cfg: RunConfig, run_dir: Path, out: Path, upto: Optional[int] = None) -> CoordinatorDaemon:
    """A coordinator resumed (in ``out``) from the run's initial repair anchor and its whole log, cut after record
    ``upto`` when given (a crash there); closed again after loading."""
    from asyncloco.coordinator.wal import _scan_segment

    wal = out / WAL_DIR
    wal.mkdir(parents=True)
    shutil.copytree(run_dir / ANCHOR_DIR, out / ANCHOR_DIR)
    shutil.copyfile(run_dir / ANCHOR_DIR / f"{0:020d}" / "state.pt", out / "state.pt")
    segments = sorted((run_dir / WAL_DIR / ARCHIVE_DIR).glob("*.wal")) + sorted((run_dir / WAL_DIR).glob("*.wal"))
    for segment in segments:
        records, _ = _scan_segment(segment, last=False)
        if upto is not None and records and records[0][0] > upto:
            break
        target = wal / segment.name
        shutil.copyfile(segment, target)
        cut = [offset for seq, offset, _ in records if upto is not None and seq > upto]
        if cut:
            with target.open("r+b") as fh:
                fh.truncate(cut[0])
            break
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=out, resume=True)
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    return daemon


def without_verifier_worker(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """A coordinator life without a verification worker (its checks stay queued); call the result before the restart
    to give the next life one."""
    from asyncloco.coordinator.verify import DaemonVerification

    original = DaemonVerification.start_worker
    monkeypatch.setattr(DaemonVerification, "start_worker", lambda self: None)
    return lambda: monkeypatch.setattr(DaemonVerification, "start_worker", original)


@pytest.mark.parametrize("snapshot", [False, True], ids=["replayed", "before-snapshot"])
def test_checks_unjudged_at_a_restart_are_run_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snapshot: bool) -> None:
    """A coordinator that dies with checks queued (their verdicts not yet in the log) queues them again after
    ``--resume`` where the replay met them (their Verify actions), or from their held updates in the snapshot the
    resume starts from (``snapshot``: one written just before the crash): every such lease gets its verdict, and its
    held update is applied then. Nothing stays pending — before, a restart dropped checks unjudged and a newcomer's
    dropped probation checks counted as "on the way" forever. A check whose re-run fails ends ``Unverified`` (counted,
    journaled), its held update dropped."""
    from asyncloco.coordinator.rerun import Rerunner

    # the first life runs no verifier at all: every drawn check is held (not applied first behind the backlog: those
    # are the next test's)
    verify = {"enabled": True, "inner_state": "reset", "fraction": 0.5, "probation_updates": 2, "horizon": 100000,
              "queue": 256, "hold_backlog": 1_000}
    # (int8 downloads, the default: a check whose peer decoded a delta re-runs from the anchor the download service kept
    # on disk across the restart, and passes like any other)
    cfg = config(snapshot_every=100_000, verify=verify)  # the log holds every check (unless ``snapshot``)
    clock = FakeClock()
    run_dir = tmp_path / "run"
    second_life = without_verifier_worker(monkeypatch)  # first life: no worker, checks stay queued

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        await transport.start()
        try:
            # one round each: with no verdict θ never moves, and a peer whose update from θ(v0) awaits its check gets
            # no second lease from that θ (its request would wait for ever)
            peers = {name: start_peer(transport, name, rounds=1) for name in HONEST}
            await drive(clock, {name: task for name, (_, task) in peers.items()}, real_timeout=150.0)
            first = transport.daemon
            assert first is not None and first.node.state.verification.checked == 0
            chosen = dict(first.node.state.verification.pending)
            if snapshot:
                async with first.node.lock:
                    await first.durability.save()
            second_life()
            failing = sorted(chosen)[0]
            check = Rerunner.check

            def check_or_fail(self: Rerunner, task: Any) -> Any:
                if task.lease.lease_id == failing:
                    raise RuntimeError("the workload cannot serve this lease")
                return check(self, task)

            monkeypatch.setattr(Rerunner, "check", check_or_fail)
            daemon = await transport.restart()
            assert daemon.verification is not None
            await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)
            return {"chosen": chosen, "failing": failing, "book": daemon.node.state.verification}
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    out = asyncio.run(asyncio.wait_for(scenario(), timeout=200.0))
    chosen, book = out["chosen"], out["book"]
    assert len(chosen) == len(HONEST)  # every peer's first (probation) lease
    assert book.pending == {} and book.failed == 0 and not book.expelled
    verdicts = read_journal(run_dir, "verdict")
    unverified = {u["lease_id"]: u["reason"] for u in read_journal(run_dir, "unverified")}
    # (with the snapshot: the checks held before it are rebuilt from their held updates in it, and run all the same)
    assert book.checked == len(chosen) - 1 and sum(book.passed.values()) == len(chosen) - 1 and book.unverifiable == 1
    assert sorted(v["lease_id"] for v in verdicts) == sorted(set(chosen) - {out["failing"]}) and all(v["ok"] for v in verdicts)
    assert list(unverified) == [out["failing"]] and "the re-run failed" in unverified[out["failing"]]
    # their updates were held meanwhile: each applied once its check agreed; the one without a verdict never
    applied = {a["lease_id"] for a in read_journal(run_dir, "applied")}
    assert not book.held and set(chosen) - {out["failing"]} <= applied and out["failing"] not in applied


@pytest.mark.timeout(300)
def test_checks_applied_first_are_run_after_a_restart_from_a_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drawn check behind a busy verifier has its update applied first and is checked later (``hold_backlog``).
    The coordinator dies with such checks unjudged, after a snapshot that holds them (the replay does not meet
    them): ``--resume`` re-runs each from the copies the snapshot kept (θ at its base, the update as submitted), so
    an update that reached θ unchecked is never left unjudged across a restart — before, such checks ended
    Unverified. The verdicts clear the kept copies."""

    verify = {"enabled": True, "inner_state": "reset", "fraction": 1.0, "probation_updates": 0, "horizon": 100000,
              "queue": 256, "hold_backlog": 0}  # every lease drawn, every drawn check applied first
    cfg = config(snapshot_every=100_000, verify=verify)
    clock = FakeClock()
    run_dir = tmp_path / "run"
    second_life = without_verifier_worker(monkeypatch)  # first life: no worker, checks stay queued

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        await transport.start()
        try:
            peers = {name: start_peer(transport, name, rounds=2) for name in HONEST}
            await drive(clock, {name: task for name, (_, task) in peers.items()}, real_timeout=150.0)
            first = transport.daemon
            assert first is not None and first.node.state.verification.checked == 0
            book = first.node.state.verification
            chosen = dict(book.pending)
            kept = sorted(book.applied_first)
            version = first.node.state.version
            async with first.node.lock:
                await first.durability.save()
            second_life()
            daemon = await transport.restart()
            assert daemon.verification is not None and daemon.node.state.version == version
            await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)
            return {"chosen": chosen, "kept": kept, "version": version, "book": daemon.node.state.verification,
                    "after": daemon.node.state.version}
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    out = asyncio.run(asyncio.wait_for(scenario(), timeout=250.0))
    chosen, book = out["chosen"], out["book"]
    assert len(chosen) == 2 * len(HONEST) and out["kept"] == sorted(chosen)  # every update applied first, all kept
    applied = {a["lease_id"] for a in read_journal(run_dir, "applied")}
    assert set(chosen) <= applied and out["version"] == 2 * len(HONEST) and out["after"] == out["version"]
    # after the restart every one was re-run from the snapshot's copies and agreed; nothing is left pending or kept
    verdicts = read_journal(run_dir, "verdict")
    assert sorted(v["lease_id"] for v in verdicts) == sorted(chosen) and all(v["ok"] for v in verdicts)
    assert book.pending == {} and book.applied_first == {} and book.unverifiable == 0
    assert book.checked == len(chosen) and sum(book.passed.values()) == len(chosen)
    assert not read_journal(run_dir, "unverified")
