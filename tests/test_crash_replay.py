"""Crash durability of the coordinator: write-ahead log + background snapshots + replay.

* ``test_replay_after_crashes_equals_the_replay_of_the_whole_log`` — in-process (no network): a daemon is
  abandoned without any shutdown ("crashed") three times mid-run, each time resumed from its directory;
  every update acknowledged before a crash is in the resumed state at its version, snapshots are written in
  the background and the segments they cover leave the log, and the final state equals a replay of the whole
  log from the initial snapshot (θ bitwise, optimizer state, leases, shard progress, counters).
* ``test_a_resume_under_a_changed_config_replays_the_log_as_decided_then_decides_with_the_new_one`` — the log
  after a snapshot is replayed with the outer lr and H that decided it (θ bitwise), a ``Reconfigured`` record makes
  the new ones decide from the restart on, a second crash replays the same, and a changed method is refused.
* ``test_coordinator_main_process_sigkill_at_random_points`` — real processes: the coordinator's Python
  process alone is SIGKILLed (what the OOM killer does) at a random moment while two peers train; its DHT
  process dies with it, ``--resume`` reaps the orphaned p2pd, updates are applied again within seconds, the
  same peer processes carry on; every update a peer saw acknowledged is applied exactly once, at the version
  it was told, and the final state equals a replay of the log. One kill here (what only real processes can
  show); ``scripts/crash_test.py --kills 20`` is the acceptance run, and crashes at each named point of the
  decision path are tested in-process in tests/test_inprocess_runtime.py.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.config import RunConfig
from asyncloco.coordinator.daemon import INITIAL_SNAPSHOT, CoordinatorDaemon
from asyncloco.coordinator.logic import (
    Action, Applied, Assign, Duplicate, Lease, Rejected, RequestWork, SpeedReport, SubmitUpdate,
)
from asyncloco.coordinator.wal import ARCHIVE_DIR, WAL_DIR, WalError, read_records
from asyncloco.transport.codecs import decode, encode

ROOT = Path(__file__).resolve().parents[1]
TAG_VAR = "ASYNCLOCO_TEST_TAG"  # every process the test starts inherits it: how leftovers are recognised

# ------------------------------------------------------------------------------------------- helpers


def replay_whole_log(cfg: RunConfig, checkpoint_dir: Path, out: Path) -> CoordinatorDaemon:
    """A coordinator rebuilt from the run's initial snapshot and every log record (``runtime.wal_archive``)."""
    wal = out / WAL_DIR
    wal.mkdir(parents=True)
    archive = checkpoint_dir / WAL_DIR / ARCHIVE_DIR
    shutil.copyfile(archive / INITIAL_SNAPSHOT, out / "state.pt")
    for segment in sorted(archive.glob("*.wal")) + sorted((checkpoint_dir / WAL_DIR).glob("*.wal")):
        shutil.copyfile(segment, wal / segment.name)
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=out, resume=True)
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    return daemon


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal coordinator states: θ and the optimizer's tensors bitwise, and every plain value — except
    what a restart itself changes (held requests, peers' last-seen times, the times of leases whose θ was not
    downloaded: ``Restarted`` gives them their time again)."""
    for key in ("params", "optimizer", "transforms", "shards", "version", "local_updates", "lease_counter", "applied"):
        _assert_equal(a[key], b[key], key)
    _assert_equal(*(untimed(x["leases"]) for x in (a, b)), "leases")


def untimed(leases: dict[str, Any]) -> dict[str, Any]:
    return {k: {f: v for f, v in lease.items() if f not in ("deadline", "expected_finish")} for k, lease in leases.items()}


def _assert_equal(x: Any, y: Any, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), (where, sorted(x), sorted(y))
        for k in x:
            _assert_equal(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_equal(u, v, f"{where}[{i}]")
    else:
        assert x == y, (where, x, y)


def small_config(**runtime: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2},
            "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
            "outer": {"buffer_size": 2},
            "sim": {"workers": 2},
            # raw submissions without inner-state commitments; verification's own logs: tests/test_verify*.py
            "runtime": {"snapshot_every": 3, "wal_archive": True, "eval_every": 1000, "verify": {"enabled": False},
                        **runtime},
        }
    )


# ------------------------------------------------------------------------------------- in-process
# Driven through the daemon's durable path itself (``_decide``: handle → log → fsync → actions), as its RPC
# handlers do, so these tests do not depend on the wire format of the requests.


async def lease_for(daemon: CoordinatorDaemon, peer: str, speed: float) -> Lease:
    async with daemon.node.lock:
        await daemon.node.decide(SpeedReport(peer, speed))
        actions = await daemon.node.decide(RequestWork(peer))
    (assign,) = [a for a in actions if isinstance(a, Assign) and a.peer == peer]
    return assign.lease


async def submit(daemon: CoordinatorDaemon, peer: str, lease: Lease, update: torch.Tensor) -> Action:
    wire = encode("int8", update)
    async with daemon.node.lock:
        actions = await daemon.node.decide(SubmitUpdate(peer, lease.lease_id, lease.base_version, decode(wire, daemon.numel)), wire=wire)
    # the verdict (a gate rejection also gives the lease's steps back: an Expired for the same lease follows)
    (verdict,) = [a for a in actions if isinstance(a, (Applied, Rejected, Duplicate)) and a.lease_id == lease.lease_id]
    return verdict


@pytest.mark.timeout(120)
def test_replay_after_crashes_equals_the_replay_of_the_whole_log(tmp_path: Path) -> None:
    # random pseudo-gradients have no common direction: the update gate (rightly) refuses most of them, and
    # this test wants every one applied (the gate's decisions are replayed like any other: test_coordinator_public)
    cfg = small_config(gate={"enabled": False})
    run_dir = tmp_path / "run"
    generator = torch.Generator().manual_seed(0)
    acked: dict[str, int] = {}

    async def life(daemon: CoordinatorDaemon, rounds: int, first: bool) -> None:
        daemon.node.stop_event = asyncio.Event()
        if first:
            await daemon.durability.save()  # what run() writes at start
        for i in range(rounds):
            peer = f"peer-{i % 2}"
            lease = await lease_for(daemon, peer, 100.0 + i)
            verdict = await submit(daemon, peer, lease, torch.randn(daemon.numel, generator=generator) * 1e-4)
            assert isinstance(verdict, Applied), verdict
            acked[lease.lease_id] = verdict.version
        # the last lease is handed out and never submitted: it must survive the crash as well
        await lease_for(daemon, "peer-0", 99.0)
        await daemon.durability.wait_for_snapshot()

    daemon = CoordinatorDaemon(cfg, checkpoint_dir=run_dir)
    asyncio.run(life(daemon, 7, first=True))
    snapshots = [daemon.durability.snapshots_written]
    for crash in range(3):
        before = daemon.durability.snapshot_payload(copy=True)["coordinator"]
        _crash(daemon)
        daemon = CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)
        assert daemon.durability.replayed >= 1
        assert_same_state(daemon.node.state.state_dict(), before)
        assert {k: v for k, v in daemon.node.state.applied.items() if k in acked} == acked
        assert not daemon.node.state.held and daemon.node.state.window_end is None
        asyncio.run(life(daemon, 5, first=False))
        snapshots.append(daemon.durability.snapshots_written)
    final = daemon.durability.snapshot_payload(copy=True)["coordinator"]
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    assert daemon.node.state.version == len(acked) == 7 + 3 * 5
    # background snapshots every 3 updates; the segments they covered left the live log
    assert all(n >= 1 for n in snapshots[1:]), snapshots
    assert sorted((run_dir / WAL_DIR / ARCHIVE_DIR).glob("*.wal"))
    reference = replay_whole_log(cfg, run_dir, tmp_path / "replay")
    assert_same_state(reference.node.state.state_dict(), final)
    assert reference.durability.replayed > len(acked)


@pytest.mark.timeout(60)
def test_a_snapshot_older_than_the_log_is_refused_at_resume(tmp_path: Path) -> None:
    cfg = small_config(wal_archive=False)
    run_dir = tmp_path / "run"
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=run_dir)

    async def run() -> None:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()
        shutil.copyfile(run_dir / "state.pt", tmp_path / "old-state.pt")
        for i in range(4):
            lease = await lease_for(daemon, "peer-a", 100.0)
            assert isinstance(await submit(daemon, "peer-a", lease, torch.full((daemon.numel,), 1e-5)), Applied)
        async with daemon.node.lock:
            await daemon.durability.save()  # covers every record: the segments before it are deleted

    asyncio.run(run())
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    assert [p.stat().st_size for p in (run_dir / WAL_DIR).glob("*.wal")] == [0]  # only the marker of where it goes on
    shutil.copyfile(tmp_path / "old-state.pt", run_dir / "state.pt")  # someone restores an old snapshot
    with pytest.raises(WalError, match=r"covers the log up to record 0 but the log .* starts at record 13: records 1..12 were deleted.*older than the log"):
        CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)


def _changed(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """``cfg`` with some values of some sections replaced."""
    values = cfg.model_dump()
    for section, changes in sections.items():
        values[section] = {**values[section], **changes}
    return RunConfig.model_validate(values)


def _crash(daemon: CoordinatorDaemon) -> None:
    """Abandon a daemon: no snapshot, no log close — only what was fsync-ed counts."""
    daemon.monitoring.journal.close()
    os.close(daemon.node.wal._fd) if daemon.node.wal._fd is not None else None


@pytest.mark.timeout(120)
def test_a_resume_under_a_changed_config_replays_the_log_as_decided_then_decides_with_the_new_one(tmp_path: Path) -> None:
    # the outer lr and H changed between a crash and its --resume: the logged updates (after the last snapshot) must be
    # replayed with the lr that applied them, and the new lr decides from the restart on, recorded in the log
    old = small_config(gate={"enabled": False}, snapshot_every=1000)  # no snapshot after the first: the log replays
    new = _changed(old, outer={"lr": old.outer.lr / 2}, schedule={"max_local_steps": 7})
    run_dir = tmp_path / "run"
    generator = torch.Generator().manual_seed(1)

    async def life(daemon: CoordinatorDaemon, rounds: int, first: bool) -> None:
        daemon.node.stop_event = asyncio.Event()
        if first:
            await daemon.durability.save()
        for i in range(rounds):
            lease = await lease_for(daemon, f"peer-{i % 2}", 100.0)
            assert isinstance(await submit(daemon, f"peer-{i % 2}", lease, torch.randn(daemon.numel, generator=generator) * 1e-3), Applied)

    daemon = CoordinatorDaemon(old, checkpoint_dir=run_dir)
    asyncio.run(life(daemon, 5, first=True))
    before = daemon.durability.snapshot_payload(copy=True)["coordinator"]
    _crash(daemon)
    daemon = CoordinatorDaemon(new, checkpoint_dir=run_dir, resume=True)
    assert daemon.durability.replayed >= 10  # five speed reports, requests and submissions
    assert_same_state(daemon.node.state.state_dict(), before)  # θ bitwise: replayed at the old lr
    state = daemon.node.state
    assert (state.optimizer.lr, state.policy.max_local_steps) == (new.outer.lr, 7)
    assert before["decisions"]["optimizer"]["settings"]["lr"] == old.outer.lr
    types = [r.type for r in read_records(run_dir / WAL_DIR, 0)]
    assert types.count("Reconfigured") == 1 and types[-2:] == ["Reconfigured", "Restarted"]
    # from here on the new lr applies: the next update moves θ as a copy of the optimizer stepping it at lr / 2
    reference, theta = copy.deepcopy(state.optimizer), state.params.clone()
    g = torch.randn(daemon.numel, generator=generator) * 1e-3

    async def one() -> None:
        daemon.node.stop_event = asyncio.Event()
        lease = await lease_for(daemon, "peer-0", 100.0)
        assert lease.steps <= 7
        assert isinstance(await submit(daemon, "peer-0", lease, g), Applied)

    asyncio.run(one())
    reference.step(theta, decode(encode("int8", g), daemon.numel), steps=0)
    assert reference.lr == new.outer.lr and torch.equal(state.params, theta)
    # crashed again before any snapshot: the same log replays to the same state under the new config, the initial
    # snapshot's decisions (the old lr) up to the Reconfigured record, the new ones after it
    final = daemon.durability.snapshot_payload(copy=True)["coordinator"]
    _crash(daemon)
    daemon = CoordinatorDaemon(new, checkpoint_dir=run_dir, resume=True)
    assert_same_state(daemon.node.state.state_dict(), final)
    types = [r.type for r in read_records(run_dir / WAL_DIR, 0)]
    assert types.count("Reconfigured") == 1 and types.count("Restarted") == 2  # nothing changed at this restart
    _crash(daemon)
    # a change of the outer optimizer's kind is refused, naming both and the fix
    with pytest.raises(ValueError, match=r"outer optimizer .* 'delayed_nesterov' .* 'async_buffer' .* cannot change within a run"):
        CoordinatorDaemon(_changed(new, schedule={"method": "async_buffer"}), checkpoint_dir=run_dir, resume=True)


# ------------------------------------------------------------------------------------ real processes


def _crash_script() -> Any:
    spec = importlib.util.spec_from_file_location("crash_test", ROOT / "scripts" / "crash_test.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _p2pd_with_tag(tag: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() != "p2pd":
                continue
            if f"{TAG_VAR}={tag}".encode() in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_coordinator_main_process_sigkill_at_random_points(tmp_path: Path) -> None:
    crash = _crash_script()
    tag = uuid.uuid4().hex
    config = tmp_path / "toy.yaml"  # the toy task: process start-up, not training, is what this test waits for
    config.write_text(crash.SMOKE_CONFIG)
    try:  # the script's --smoke run (one kill), with the cluster's processes tagged
        result = crash.run_crash_test(config, tmp_path / "crash", env={TAG_VAR: tag}, **crash.SMOKE)
    finally:
        # LocalCluster.close() stopped every process group; p2pd of a cleanly stopped process exits within seconds
        deadline = time.monotonic() + 20.0
        while _p2pd_with_tag(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _p2pd_with_tag(tag), "p2pd left behind"
    assert result["kills"] == 1 and len(result["recover_s"]) == 1
    # serving again → an update applied: a peer's resend backoff (≤ 10 s) plus a round, not minutes
    assert max(result["recover_s"]) < 30.0, result["recover_s"]
    assert result["acknowledged"] >= result["kills"] and result["version"] >= result["acknowledged"] - result["duplicate_acks"]
