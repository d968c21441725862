"""1,024 simulated workers on the toy task: the run completes, and memory holds one model replica plus
each worker's inner optimizer moments (docs/algorithm.md §8)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from asyncloco.config import RunConfig, worker_seconds_per_step
from asyncloco.sim.engine import Simulation

WORKERS = 1024
H = 10


@pytest.mark.timeout(600)
def test_1024_workers_toy_run_completes() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = RunConfig.model_validate(
            {
                "task": {"dim": 8, "hidden": 8, "clusters_per_class": 2, "points": 8192, "eval_points": 128},
                "inner": {"lr": 1e-3, "min_lr": 1e-4, "total_steps_per_shard": 10_000},
                "schedule": {"max_local_steps": H, "grace_period": 0.5},
                "sim": {"workers": WORKERS, "profile": "very", "total_local_updates": 3000, "eval_every": 1000},
            }
        )
        simulation = Simulation(cfg, "async_dn_dylu")
        trace = io.StringIO()
        result = simulation.run(trace=trace)
    finally:
        torch.set_num_threads(previous)
    records = [json.loads(line) for line in trace.getvalue().splitlines()]
    tasks = [r for r in records if r["type"] == "task"]
    assert {t["worker"] for t in tasks} == {f"w{i}" for i in range(WORKERS)}  # every worker trained
    seconds = worker_seconds_per_step("very", WORKERS)
    for task in tasks[:WORKERS]:  # DyLU over 1,024 speeds: floor(v / v_max · H), at least 1
        expected = max(1, math.floor(seconds[0] / seconds[int(task["worker"][1:])] * H + 1e-9))
        assert task["steps"] == expected, task
    assert result.local_updates >= 3000 and result.final["local_updates"] <= 3000
    assert result.final["loss"] < result.evals[0]["loss"]
    # memory: one replica trains every lease; a worker keeps only its AdamW moments (2 × the model)
    numel = sum(p.numel() for p in simulation.trainer.model.parameters())
    assert simulation.fast is not None  # the toy task trains on the flat fast loop
    held = sum(
        w.fast_state.exp_avg.numel() + w.fast_state.exp_avg_sq.numel()
        for w in simulation.workers.values()
        if w.fast_state is not None
    )
    assert held == WORKERS * 2 * numel
