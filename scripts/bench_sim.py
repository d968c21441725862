"""Simulator scale: events/s at 16, 128 and 1,024 workers.

Two figures per worker count, measured side by side in one process:

* ``logic_events_per_s``: events per CPU-second of the coordinator's decision function alone (``handle``), driven by the
  simulator's fake-time loop with Async DN + DyLU, grace 0.5 s, the "very" profile interpolated over
  the workers, and a constant pseudo-gradient on a small θ (no training) — the cost per event of the
  decisions themselves (grace windows, DyLU, Eq. 2, the outer step);
* ``sim_events_per_s`` / ``sim_wall_s`` / ``peak_rss_mb``: the full simulator on a small toy task
  (workers really train), for a fixed budget of local updates per worker count.

An event is one ``handle`` call (speed report, request, submission, tick). The ratio
``logic_events_per_s(16) / logic_events_per_s(n)`` shows how the per-event cost grows with n.

Usage: ``python scripts/bench_sim.py [--workers 16,128,1024] [--events 20000] [--json out.json]``
(about 1-2 min on 2 idle cores).
"""

from __future__ import annotations

import argparse
import heapq
import json
import resource
import time

import torch

from asyncloco.config import RunConfig, worker_seconds_per_step
from asyncloco.coordinator.logic import (
    Assign,
    Hold,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    Tick,
    handle,
    new_state,
)
from asyncloco.coordinator.methods import build_method, coordinator_policy
from asyncloco.sim.engine import Simulation


def _config(workers: int, budget: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": {"dim": 32, "hidden": 32, "clusters_per_class": 2, "points": 8192, "eval_points": 256},
            "inner": {"lr": 1e-3, "min_lr": 1e-4, "total_steps_per_shard": 10_000},
            "schedule": {"max_local_steps": 20, "grace_period": 0.5},
            "sim": {"workers": workers, "profile": "very", "total_local_updates": budget, "eval_every": budget},
        }
    )


def logic_events_per_s(workers: int, events: int) -> float:
    """handle() calls per second over ``events`` events of a fake-time Async DN + DyLU run."""
    cfg = _config(workers, 10**9)
    spec, optimizer, transforms = build_method("async_dn_dylu", cfg.outer, workers)
    policy = coordinator_policy(cfg, spec, 1, simulated=True)
    state = new_state(torch.zeros(1024), optimizer, transforms, policy, [10**6] * 4, seed=0)
    update = torch.full((1024,), 1e-6)
    seconds = worker_seconds_per_step("very", workers)
    queue: list[tuple[float, int, str, str]] = []
    leases: dict[str, tuple[str, int]] = {}
    counter = 0

    def dispatch(actions: list, now: float) -> None:
        nonlocal counter
        for action in actions:
            counter += 1
            if isinstance(action, Assign):
                leases[action.peer] = (action.lease.lease_id, action.lease.base_version)
                heapq.heappush(queue, (now + action.lease.steps * seconds[int(action.peer[1:])], counter, "done", action.peer))
            elif isinstance(action, Hold):
                heapq.heappush(queue, (action.until, counter, "tick", action.peer))

    started = time.process_time()  # CPU seconds: on a machine shared with other jobs, less noisy than wall
    count = 0
    for i in range(workers):
        dispatch(handle(state, SpeedReport(f"w{i}", 1.0 / seconds[i]), 0.0)[1], 0.0)
        dispatch(handle(state, RequestWork(f"w{i}"), 0.0)[1], 0.0)
        count += 2
    while count < events and queue:
        now, _, kind, peer = heapq.heappop(queue)
        if kind == "done":
            lease_id, base = leases.pop(peer)
            dispatch(handle(state, SubmitUpdate(peer, lease_id, base, update.clone()), now)[1], now)
            dispatch(handle(state, RequestWork(peer), now)[1], now)
            count += 2
        else:
            dispatch(handle(state, Tick(), now)[1], now)
            count += 1
    return count / (time.process_time() - started)


def simulate(workers: int, budget: int) -> dict[str, float]:
    simulation = Simulation(_config(workers, budget), "async_dn_dylu")
    started = time.perf_counter()
    result = simulation.run()
    wall = time.perf_counter() - started
    events = 2 * workers + 2 * result.applied  # reports + first requests, then a submission + request each
    return {
        "sim_wall_s": wall,
        "sim_events_per_s": events / wall,
        "sim_applied": result.applied,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="16,128,1024")
    parser.add_argument("--events", type=int, default=20_000, help="logic events per worker count")
    parser.add_argument("--budget-per-worker", type=int, default=40, help="simulated local updates per worker")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--logic-only", action="store_true", help="only the decision function (no training)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: 4 and 8 workers, few events (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.workers, args.events, args.budget_per_worker = "4,8", 400, 5
    torch.set_num_threads(1)
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        row: dict[str, float] = {"workers": workers, "logic_events_per_s": logic_events_per_s(workers, args.events)}
        if args.logic_only:
            rows.append(row)
            print(f"{workers:6d} workers: logic {row['logic_events_per_s']:9.0f} events per CPU-second", flush=True)
            continue
        row.update(simulate(workers, args.budget_per_worker * workers))
        rows.append(row)
        print(
            f"{workers:6d} workers: logic {row['logic_events_per_s']:9.0f} events per CPU-second | simulator "
            f"{row['sim_events_per_s']:7.0f} events/s, {row['sim_applied']:.0f} updates in {row['sim_wall_s']:.1f} s, "
            f"peak RSS {row['peak_rss_mb']:.0f} MB",
            flush=True,
        )
    base = rows[0]["logic_events_per_s"]
    for row in rows[1:]:
        print(f"logic events/s, {rows[0]['workers']:.0f} vs {row['workers']:.0f} workers: ×{base / row['logic_events_per_s']:.2f} slower per event")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
