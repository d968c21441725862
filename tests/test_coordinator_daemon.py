"""The daemon's durability rules, in-process (no network): fail-stop on a broken disk (the write-ahead log),
crash leftovers."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.config import RunConfig
from asyncloco.coordinator.checkpoint import remove_partial_snapshots
from asyncloco.coordinator.daemon import CoordinatorDaemon
from asyncloco.transport.codecs import encode
from asyncloco.transport.wire import AssignRequest, SubmitHeader


def small_config() -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2},
            "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
            "sim": {"workers": 2},
        }
    )


def durable_state(checkpoint_dir: Path, tmp_path: Path) -> Any:
    """What ``--resume`` would continue from (snapshot + write-ahead log replayed), read from a copy."""
    copy = tmp_path / f"resume-copy-{len(list(tmp_path.glob('resume-copy-*')))}"
    shutil.copytree(checkpoint_dir, copy)
    resumed = CoordinatorDaemon(small_config(), checkpoint_dir=copy, resume=True)
    resumed.monitoring.journal.close()
    resumed.node.wal.close()
    return resumed.node.state


@pytest.mark.timeout(60)
def test_failed_log_write_is_never_acknowledged_and_stops_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    daemon = CoordinatorDaemon(small_config(), checkpoint_dir=run_dir)

    async def scenario() -> None:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()  # what run() writes at start
        reply = await daemon.serving.assign(AssignRequest("lease", tokens_per_s=100.0), "peer-a")
        lease = reply.to_wire().get("lease")
        assert lease is not None and durable_state(run_dir, tmp_path).leases.keys() == {lease["lease_id"]}
        theta_before = daemon.node.state.params.clone()

        def broken_disk(*args: Any, **kwargs: Any) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(daemon.node.wal, "append", broken_disk)
        update = encode("none", torch.full_like(theta_before, 1e-4))
        with pytest.raises(OSError):
            await daemon.serving.submit(SubmitHeader(lease["lease_id"], lease["base_version"], "none", update.numel), update, "peer-a")
        # not acknowledged, not durable, and the daemon stops taking work
        assert daemon.node.stop_event.is_set()
        durable = durable_state(run_dir, tmp_path)
        assert durable.version == 0 and torch.equal(durable.params, theta_before)
        with pytest.raises(ConnectionAbortedError):
            await daemon.serving.submit(SubmitHeader(lease["lease_id"], lease["base_version"], "none", update.numel), update, "peer-a")

    asyncio.run(scenario())
    daemon.monitoring.journal.close()


def test_partial_snapshots_from_an_interrupted_save_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".state-abc.tmp").write_bytes(b"half a snapshot")
    (tmp_path / ".state-def.tmp").write_bytes(b"")
    (tmp_path / ".state.pt.x1y2.tmp").write_bytes(b"half a snapshot")  # asyncloco/durable.py's naming
    (tmp_path / "state.pt").write_bytes(b"keep")
    assert remove_partial_snapshots(tmp_path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
