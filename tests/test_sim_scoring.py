"""Scoring in the simulator (docs/algorithm.md §8): final = θ after the last update that moved it
within the budget; sync DiLoCo never scored mid-round; "time to reach" is inclusive."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch

from asyncloco.config import RunConfig
from asyncloco.sim.engine import Simulation, build_workload

H = 10
WORKERS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _cfg(budget: int, profile: str = "very", eval_every: int = 40) -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": {"dim": 16, "hidden": 16, "clusters_per_class": 2, "points": 2048, "eval_points": 256},
            "inner": {"lr": 1e-2, "min_lr": 1e-3, "total_steps_per_shard": 200},
            "schedule": {"max_local_steps": H, "grace_period": 0.5},
            "sim": {"workers": WORKERS, "profile": profile, "total_local_updates": budget, "eval_every": eval_every},
        }
    )


def _run(cfg: RunConfig, method: str, workload=None) -> tuple[Simulation, list[dict[str, Any]]]:
    simulation = Simulation(cfg, method, workload)
    trace = io.StringIO()
    simulation.run(trace=trace)
    return simulation, [json.loads(line) for line in trace.getvalue().splitlines()]


@pytest.mark.timeout(180)
def test_sync_diloco_is_never_scored_mid_round() -> None:
    # k·H = 40: a budget of 100 ends half-way through the third round
    workload = build_workload(_cfg(100))
    half, trace = _run(_cfg(100), "sync_diloco", workload)
    whole, _ = _run(_cfg(80), "sync_diloco", workload)
    round_time = 3.33 * H  # the slowest worker sets every round
    assert half.result.final["local_updates"] == whole.result.final["local_updates"] == 80
    assert half.result.final["time"] == pytest.approx(2 * round_time, rel=1e-12)
    assert half.result.final["loss"] == whole.result.final["loss"]  # the same θ, bit for bit
    evals = [r for r in trace if r["type"] == "eval"]
    assert [e["local_updates"] for e in evals] == [0, 40, 80]  # evaluations only at round boundaries
    assert half.state.local_updates == 100  # the run itself went on into the third round


@pytest.mark.timeout(180)
def test_async_final_never_exceeds_the_budget() -> None:
    budget = 105
    simulation, trace = _run(_cfg(budget, eval_every=1000), "async_dn_dylu")
    cumulative = [r["local_updates"] for r in trace if r["type"] == "applied"]
    within = [u for u in cumulative if u <= budget]
    assert cumulative[-1] > budget  # the last update crossed the budget (DyLU steps 10, 7, 3, 1)...
    final = simulation.result.final
    assert final["local_updates"] == within[-1] < budget  # ...and is left out of the score
    last_within = [r for r in trace if r["type"] == "applied" and r["local_updates"] == within[-1]][0]
    assert final["time"] == last_within["time"] and final["version"] == last_within["version"]


@pytest.mark.timeout(180)
def test_a_method_identical_to_sync_reaches_its_final_loss_at_the_same_time() -> None:
    cfg = _cfg(120)
    workload = build_workload(cfg)
    first, _ = _run(cfg, "sync_diloco", workload)
    second, _ = _run(cfg, "sync_diloco", workload)
    target = first.result.final["loss"]
    assert second.result.time_to_reach(target) == first.result.final["time"] == pytest.approx(3 * 3.33 * H)
    assert first.result.time_to_reach(target - 1e-6) is None  # below its own final: never
