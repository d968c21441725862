"""One loop: the coordinator's timed loops (asyncloco/coordinator/loops.py) sleep on the daemon's
clock, and the in-memory double (asyncloco/testing/memory.py) runs those very loops — only the streams and the DHT
records are in memory. Under a :class:`~asyncloco.clock.FakeClock` moved by :func:`~asyncloco.testing.memory.drive`:

* a stop ends a loop's pause at once, however long it is (nothing waits for the fake clock to move);
* the real tick loop ticks at the start and every fake second after it: a lease expires at the first tick past its
  deadline, to the fake second, minutes of fake time in well under those minutes of real time;
* a speed record written into the in-memory records reaches the logic only through the real speed loop, at its
  next read, and only when signed by the peer's bound key: the peer's next lease is sized (DyLU) by it;
* a kill point that a loop passes crashes the coordinator, and a restart runs a new life's loops.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from asyncloco.clock import FakeClock, pause
from asyncloco.config import RunConfig
from asyncloco.coordinator.daemon import JOURNAL_FILE, RESUME_GRACE_S
from asyncloco.testing.memory import MemoryTransport, as_actor, drive

pytestmark = pytest.mark.timeout(120)
SPEED = 1000.0


def config(**runtime: Any) -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 2},
        "sim": {"workers": 2},
        "runtime": {"eval_every": 100000, "gate": {"enabled": False}, "verify": {"enabled": False}, **runtime},
    })


def journal(transport: MemoryTransport, kind: Optional[str] = None) -> list[dict[str, Any]]:
    path = transport.dir / JOURNAL_FILE
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [e for e in events if kind is None or e["type"] == kind]


def clock_start() -> float:
    return FakeClock().time()


def first_tick_after(start: float, when: float) -> float:
    """The first tick of a tick loop started at ``start`` (one a second) strictly after ``when``."""
    ticks = int(when - start) + 1
    return start + ticks


def test_a_stop_ends_a_pause_on_a_fake_clock_at_once() -> None:
    async def scenario() -> tuple[bool, int, float]:
        clock, stop = FakeClock(), asyncio.Event()
        pausing = as_actor("loop", pause(clock, stop, 1e6))
        await clock.wait_for_sleeper()
        assert clock.wake_time_of("loop") == clock.time() + 1e6
        stop.set()
        stopped = await asyncio.wait_for(pausing, timeout=5.0)
        await asyncio.sleep(0)
        return stopped, clock.sleepers, clock.monotonic()

    stopped, sleepers, moved = asyncio.run(scenario())
    assert stopped and sleepers == 0 and moved == 0.0  # ended by the stop, its sleep cancelled, the clock never moved


def test_the_real_tick_loop_expires_a_lease_at_the_first_tick_past_its_deadline(tmp_path: Path) -> None:
    cfg = config(lease_slack=300.0)  # a deadline minutes of fake time away
    clock = FakeClock()

    async def scenario() -> tuple[Any, float, float, list[dict[str, Any]]]:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        started = clock.time()
        await transport.start()
        try:
            reply = await transport.client("a").assign(SPEED)
            assert reply.lease is not None
            began = time.monotonic()
            await drive(clock, {}, until=lambda: bool(journal(transport, "expired")), real_timeout=60.0, idle_step=1.0)
            return reply.lease, started, time.monotonic() - began, journal(transport, "expired")
        finally:
            await transport.close()

    lease, started, real_seconds, expired = asyncio.run(scenario())
    assert [e["lease_id"] for e in expired] == [lease.lease_id]
    assert lease.deadline - started > 300.0
    assert expired[0]["time"] == first_tick_after(started, lease.deadline)  # to the fake second
    assert real_seconds < (lease.deadline - started) / 5  # fake minutes, real seconds


def test_a_speed_record_reaches_dylu_through_the_real_speed_loop(tmp_path: Path) -> None:
    cfg = config(speed_report_period=4.0)  # the speed loop reads every 2 fake seconds
    clock = FakeClock()

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        started = clock.time()
        daemon = await transport.start()
        try:
            a, b = transport.client("a"), transport.client("b")
            assert (await b.assign(SPEED, signer="key-b")).lease is not None  # b stays the fastest
            first = (await a.assign(SPEED, signer="key-a")).lease
            assert first is not None
            _, theta = await a.get_model(first.base_version)
            assert (await a.submit(first.lease_id, first.base_version, torch.full_like(theta, 1e-3), codec=cfg.runtime.codec)).accepted
            await transport.clock.advance(0.5)  # off the speed loop's beat: what follows waits for its next read
            await transport.publisher("a", signer="key-evil").publish_speed(SPEED / 20)  # a key a never bound
            await transport.publisher("a", signer="key-a").publish_speed(SPEED / 5)
            peers = daemon.node.state.peers
            unread = peers["a"].speed  # in the records, not yet in the logic
            await drive(clock, {}, until=lambda: peers["a"].speed != SPEED, real_timeout=30.0, idle_step=0.25)
            taken_at = clock.time() - started
            second = (await a.assign(None, signer="key-a")).lease
            assert second is not None
            return {"first": first.steps, "second": second.steps, "unread": unread, "speed": peers["a"].speed,
                    "taken_at": taken_at, "device": daemon.monitoring.stats.peer("a").device}
        finally:
            await transport.close()

    result = asyncio.run(scenario())
    assert result["unread"] == SPEED
    assert result["taken_at"] == 2.0  # the speed loop's second read: reads at 0, 2, 4, ... fake seconds
    assert result["speed"] == SPEED / 5 and result["device"] == "memory"  # the evil key's record was not taken
    assert result["first"] == cfg.schedule.max_local_steps and result["second"] == 1  # DyLU: 5 × 200 / 1000


def test_a_loop_passing_a_kill_point_crashes_the_coordinator_and_a_restart_runs_new_loops(tmp_path: Path) -> None:
    cfg = config(lease_slack=20.0)
    clock = FakeClock()

    async def scenario() -> tuple[Any, tuple[float, float, float], MemoryTransport, list[dict[str, Any]]]:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            lease = (await transport.client("a").assign(SPEED)).lease
            assert lease is not None
            transport.kill.arm("wal_appended")  # the next event logged: the tick loop's next tick
            await drive(clock, {}, until=lambda: transport.down, real_timeout=30.0, idle_step=1.0)
            died = clock.time()
            await drive(clock, {}, until=lambda: clock.time() >= died + 5.0, real_timeout=30.0, idle_step=1.0)  # while down
            daemon = await transport.restart()
            restarted, deadline = clock.time(), daemon.node.state.leases[lease.lease_id].deadline
            await drive(clock, {}, until=lambda: bool(journal(transport, "expired")), real_timeout=60.0, idle_step=1.0)
            return lease, (died, restarted, deadline), transport, journal(transport, "expired")
        finally:
            await transport.close()

    lease, (died, restarted, deadline), transport, expired = asyncio.run(scenario())
    assert transport.crashes == ["wal_appended"] and transport.lives == 2 and died < lease.deadline
    assert died == clock_start() + 1.0  # the tick after the one at the start
    # the lease lives on in the replayed state, its deadline extended for the downtime (logic: Restarted); the new
    # life's tick loop, ticking from the restart, gives it back at its first tick past that
    assert deadline >= max(lease.deadline, restarted + RESUME_GRACE_S)
    assert [e["lease_id"] for e in expired] == [lease.lease_id]
    assert expired[0]["time"] == first_tick_after(restarted, deadline)
