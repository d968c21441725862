"""What the write-ahead log and snapshots record about the software that wrote them, and the daemon's last
decision made outside ``handle`` moved into it.

* every log record and every snapshot carries ``software_stamp`` (asyncloco version + a fingerprint of the
  event schema); ``--resume`` refuses a snapshot or a record written with another one, naming both and the fix;
* a held request the daemon stops waiting on is the ``HoldDropped`` event of the logic, logged and replayed
  like every other (no more log "marks"); the leftover ``model_snapshots`` is gone from snapshots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco import __version__
from asyncloco.coordinator import durability as durability_module
from asyncloco.coordinator import logic as logic_module
from asyncloco.coordinator.checkpoint import SNAPSHOT_NAME, load_snapshot, save_snapshot
from asyncloco.coordinator.daemon import EVENT_TYPES, SOFTWARE_STAMP, CoordinatorDaemon
from asyncloco.coordinator.logic import Applied, HoldDropped, Hold, RequestWork
from asyncloco.coordinator.wal import WAL_DIR, WalError, check_stamp, decode_event, open_log, read_records, software_stamp
from tests.test_coordinator_logic import _two_peers_in_flight, do, lease_of, submit
from tests.test_crash_replay import lease_for, small_config
from tests.test_crash_replay import submit as submit_update

G = torch.full((4,), 0.1)


# ------------------------------------------------------------------------------------------- stamps


def test_the_stamp_names_the_version_and_fingerprints_the_event_schema() -> None:
    assert SOFTWARE_STAMP == software_stamp(__version__, EVENT_TYPES)
    prefix, fingerprint = SOFTWARE_STAMP.rsplit(" ", 1)
    assert prefix == f"asyncloco {__version__}, events" and len(fingerprint) == 12 and int(fingerprint, 16) >= 0

    @dataclasses.dataclass(frozen=True)
    class Tick:  # the same name with a field added: another schema
        extra: int = 0

    @dataclasses.dataclass(frozen=True)
    class Renamed:
        pass

    assert software_stamp(__version__, dict(EVENT_TYPES)) == SOFTWARE_STAMP  # deterministic
    assert software_stamp(__version__, {**EVENT_TYPES, "Tick": Tick}) != SOFTWARE_STAMP
    assert software_stamp(__version__, {**EVENT_TYPES, "Renamed": Renamed}) != SOFTWARE_STAMP
    assert software_stamp("9.9.9", EVENT_TYPES) == f"asyncloco 9.9.9, events {fingerprint}"


def test_every_record_carries_its_writers_stamp(tmp_path: Path) -> None:
    log = open_log(tmp_path, 0, stamp="asyncloco 9.9.9, events 0123456789ab")
    log.append_event(RequestWork("peer-a"), 12.5)
    log.append_event(HoldDropped("peer-a"), 13.0)
    log.sync()
    log.close()
    records = list(read_records(tmp_path / WAL_DIR, 0))
    assert [(r.seq, r.type, r.stamp) for r in records] == [
        (1, "RequestWork", "asyncloco 9.9.9, events 0123456789ab"),
        (2, "HoldDropped", "asyncloco 9.9.9, events 0123456789ab"),
    ]
    assert decode_event(records[1], EVENT_TYPES, lambda *_: None) == HoldDropped("peer-a")
    check_stamp(records[0].stamp, "asyncloco 9.9.9, events 0123456789ab", "x")  # equal: accepted
    with pytest.raises(WalError, match=r"x was written by asyncloco 9\.9\.9, events 0123456789ab; this is asyncloco 1\.0"):
        check_stamp(records[0].stamp, "asyncloco 1.0, events 0123456789ab", "x")


def _first_life(run_dir: Path, cfg: Any, stamp_after_snapshot: str | None = None) -> CoordinatorDaemon:
    """A run: the start-up snapshot, two applied updates, a lease in flight; then a crash (nothing closed)."""
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=run_dir)

    async def life() -> None:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()
        if stamp_after_snapshot is not None:
            daemon.node.wal.stamp = stamp_after_snapshot  # what another asyncloco would have appended
        for _ in range(2):
            lease = await lease_for(daemon, "peer-a", 100.0)
            assert isinstance(await submit_update(daemon, "peer-a", lease, torch.full((daemon.numel,), 1e-5)), Applied)
        await lease_for(daemon, "peer-a", 100.0)

    asyncio.run(life())
    daemon.monitoring.journal.close()
    if daemon.node.wal._fd is not None:
        os.close(daemon.node.wal._fd)
    return daemon


@pytest.mark.timeout(120)
def test_resume_refuses_a_snapshot_of_another_version_and_accepts_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_config(gate={"enabled": False})
    run_dir = tmp_path / "run"
    first = _first_life(run_dir, cfg)
    snapshot = load_snapshot(run_dir)
    assert snapshot["stamp"] == SOFTWARE_STAMP and "model_snapshots" not in snapshot
    other = "asyncloco 0.0.1, events 000000000000"
    monkeypatch.setattr(durability_module, "SOFTWARE_STAMP", other)  # what --resume accepts
    with pytest.raises(WalError) as refused:
        CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)
    message = str(refused.value)
    assert f"the snapshot {run_dir / SNAPSHOT_NAME} was written by {SOFTWARE_STAMP}; this is {other}" in message
    assert "Resume this run with the asyncloco version that wrote it" in message and "empty --checkpoint-dir" in message
    assert isinstance(refused.value, ValueError)  # the CLI prints it as an error, not a traceback
    monkeypatch.undo()
    resumed = CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)  # the same software: replayed
    assert resumed.durability.replayed >= 5 and resumed.node.state.version == first.node.state.version == 2
    assert torch.equal(resumed.node.state.params, first.node.state.params)
    resumed.monitoring.journal.close()
    resumed.node.wal.close()


@pytest.mark.timeout(120)
def test_resume_refuses_log_records_of_another_version(tmp_path: Path) -> None:
    cfg = small_config(gate={"enabled": False})
    run_dir = tmp_path / "run"
    other = "asyncloco 0.2.0, events ffffffffffff"
    _first_life(run_dir, cfg, stamp_after_snapshot=other)
    with pytest.raises(WalError, match=rf"log record 1 in {run_dir / WAL_DIR} was written by {other}; this is {SOFTWARE_STAMP}\."):
        CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)


@pytest.mark.timeout(120)
def test_a_snapshot_from_before_stamps_is_refused_with_the_fix(tmp_path: Path) -> None:
    cfg = small_config(gate={"enabled": False})
    run_dir = tmp_path / "run"
    _first_life(run_dir, cfg)
    old = load_snapshot(run_dir)
    del old["stamp"]
    old["model_snapshots"] = {}  # what the previous format held (always empty)
    old.pop("format")
    save_snapshot(run_dir, old)
    with pytest.raises(WalError, match=r"written by an asyncloco from before version stamps \(no stamp recorded\); this is asyncloco"):
        CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)


# ------------------------------------------------------------------------------------- HoldDropped


def test_a_dropped_hold_is_an_event_of_the_logic() -> None:
    state, lease_a, lease_b = _two_peers_in_flight()
    submit(state, lease_a, G, 10.0)
    (hold,) = do(state, RequestWork("a"), 10.0)
    assert isinstance(hold, Hold) and state.held == {"a": 10.0}
    assert do(state, HoldDropped("a"), 10.1) == [] and state.held == {}
    assert do(state, HoldDropped("a"), 10.2) == []  # dropping it again (or an unknown peer) changes nothing
    (applied,) = submit(state, lease_b, G, 10.2)  # b's update settles the window: nobody is waiting any more
    assert isinstance(applied, Applied) and applied.version == 2
    (assign,) = do(state, RequestWork("a"), 10.3)  # a asks again and is answered at once
    assert lease_of(assign).base_version == 2


@pytest.mark.timeout(120)
def test_the_daemon_logs_a_dropped_hold_and_replay_feeds_it_to_handle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = small_config(gate={"enabled": False})
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"grace_period": 30.0})})
    run_dir = tmp_path / "run"
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=run_dir)
    handled: list[Any] = []

    async def life() -> None:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()
        # a is slow (its lease is due far beyond the grace period), b fast (due at once): b is answered at once,
        # and a, asking again after its update, is held in the grace window for b's update
        lease_a = await lease_for(daemon, "peer-a", 1e-3)
        await lease_for(daemon, "peer-b", 1e9)
        assert isinstance(await submit_update(daemon, "peer-a", lease_a, torch.full((daemon.numel,), 1e-5)), Applied)
        async with daemon.node.lock:
            (hold,) = await daemon.node.decide(RequestWork("peer-a"))  # b is still due: a waits in the grace window
            assert isinstance(hold, Hold) and "peer-a" in daemon.node.state.held
            assert await daemon.node.decide(HoldDropped("peer-a")) == []  # what assign() does when its wait times out
        assert "peer-a" not in daemon.node.state.held

    asyncio.run(life())
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    records = list(read_records(run_dir / WAL_DIR, 0))
    assert [(r.kind, r.type, r.fields) for r in records if r.type == "HoldDropped"] == [("event", "HoldDropped", {"peer": "peer-a"})]
    assert all(r.kind == "event" for r in records)  # no daemon-side marks any more
    real_handle = logic_module.handle

    def spy(state: Any, event: Any, now: float) -> Any:
        handled.append(event)
        return real_handle(state, event, now)

    monkeypatch.setattr(logic_module, "handle", spy)  # the node and the replay call it through the module
    resumed = CoordinatorDaemon(cfg, checkpoint_dir=run_dir, resume=True)
    assert HoldDropped("peer-a") in handled and resumed.durability.replayed == len(records)
    assert torch.equal(resumed.node.state.params, daemon.node.state.params)
    resumed.monitoring.journal.close()
    resumed.node.wal.close()


# ---------------------------------------------------------------------------------- snapshot copies


@pytest.mark.timeout(120)
def test_background_snapshot_copies_reuse_their_buffers_and_equal_the_state(tmp_path: Path) -> None:
    cfg = small_config(gate={"enabled": False})
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=tmp_path / "run")

    async def life() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()
        for _ in range(2):  # the DN buffer and momentum exist after an update
            lease = await lease_for(daemon, "peer-a", 100.0)
            assert isinstance(await submit_update(daemon, "peer-a", lease, torch.full((daemon.numel,), 1e-5)), Applied)
        first = daemon.durability.snapshot_payload(copy=True, reuse=True)["coordinator"]
        first_params = first["params"].clone()
        lease = await lease_for(daemon, "peer-a", 100.0)
        assert isinstance(await submit_update(daemon, "peer-a", lease, torch.full((daemon.numel,), 2e-5)), Applied)
        second = daemon.durability.snapshot_payload(copy=True, reuse=True)["coordinator"]
        live = daemon.durability.snapshot_payload(copy=False)["coordinator"]
        assert not torch.equal(first_params, live["params"])  # θ moved between the two snapshots
        return first, second, live

    first, second, live = asyncio.run(life())
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    assert second["params"].data_ptr() == first["params"].data_ptr() != live["params"].data_ptr()
    assert torch.equal(second["params"], live["params"])
    momentum, live_momentum = second["optimizer"]["momentum_buffer"], live["optimizer"]["momentum_buffer"]
    assert momentum.data_ptr() == first["optimizer"]["momentum_buffer"].data_ptr() != live_momentum.data_ptr()
    assert torch.equal(momentum, live_momentum) and second["version"] == live["version"] == 3


@pytest.mark.timeout(120)
def test_a_background_snapshot_shares_a_held_updates_tensors_and_copies_the_rest(tmp_path: Path) -> None:
    """A held update's pseudo-gradient and base θ never change until it is applied or dropped: the snapshot's copy
    shares them (no θ-sized copy under the lock, none kept between snapshots) while θ is still copied."""
    from asyncloco.coordinator.logic.state import HeldUpdate

    cfg = small_config(gate={"enabled": False})
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=tmp_path / "run")

    async def life() -> tuple[dict[str, Any], HeldUpdate]:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()
        lease = await lease_for(daemon, "peer-a", 100.0)
        held = HeldUpdate(lease=lease, update=torch.full((daemon.numel,), 3e-5), base=daemon.node.state.params.clone(),
                          scale=1.0, submitted_at=0.0)
        daemon.node.state.verification.held[lease.lease_id] = held
        return daemon.durability.snapshot_payload(copy=True, reuse=True)["coordinator"], held

    copied, held = asyncio.run(life())
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    (entry,) = copied["verification"]["held"].values()
    assert entry["update"] is held.update and entry["base"] is held.base
    assert copied["params"].data_ptr() != daemon.node.state.params.data_ptr()
    assert torch.equal(copied["params"], daemon.node.state.params)
    kept = daemon.durability.snapshot_payload(copy=True, reuse=True)["coordinator"]
    assert kept["params"].data_ptr() == copied["params"].data_ptr()  # θ's buffer is reused; the held tensors never copied
