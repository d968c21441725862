"""The fake-time simulator: bit-identical traces (§7.5), sync-DiLoCo equivalence (§7.2), DyLU in traces."""

from __future__ import annotations

import io
import json
import math
from fractions import Fraction
from typing import Any

import pytest
import torch

from asyncloco.config import HETEROGENEITY_PROFILES, RunConfig, worker_seconds_per_step
from asyncloco.sim.engine import Simulation, build_workload

H = 10
WORKERS = 4


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def toy_config(**sections: Any) -> RunConfig:
    raw = {
        "name": "toy-test",
        "seed": 0,
        "task": {"dim": 16, "hidden": 16, "clusters_per_class": 2, "points": 2048, "eval_points": 256, "batch_size": 32},
        "inner": {"lr": 1e-2, "min_lr": 1e-3, "total_steps_per_shard": 200},
        "schedule": {"max_local_steps": H, "min_steps": 1, "grace_period": 0.5},
        "sim": {"workers": WORKERS, "profile": "none", "total_local_updates": 200, "eval_every": 40, "seed": 0},
    }
    return RunConfig.model_validate(_merge(raw, sections))


def _run(cfg: RunConfig, method: str, workload=None) -> tuple[Simulation, str]:
    simulation = Simulation(cfg, method, workload)
    trace = io.StringIO()
    simulation.run(trace=trace)
    return simulation, trace.getvalue()


def _records(trace: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, trace.splitlines()) if r["type"] == kind]


# ------------------------------------------------------------------------------ §7.5 determinism


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["async_dn_dylu", "asynclm"])
def test_same_seed_same_config_gives_a_bit_identical_trace(method: str) -> None:
    cfg = toy_config(sim={"profile": "very", "total_local_updates": 120})
    _, first = _run(cfg, method)
    _, second = _run(cfg, method)  # fresh workload, fresh model, fresh coordinator
    assert first == second
    assert _records(first, "task") and _records(first, "applied") and len(_records(first, "eval")) >= 2
    reseeded = toy_config(sim={"profile": "very", "total_local_updates": 120, "seed": 1})
    _, other = _run(reseeded, method)
    # the sim seed drives shard sampling only: a different seed gives a different assignment sequence
    shards = lambda trace: [r["shard"] for r in _records(trace, "task")]  # noqa: E731
    assert shards(other) != shards(first)


# ------------------------------------------------------------------------------ §7.2 sync equivalence


@pytest.mark.timeout(120)
def test_homogeneous_async_dn_dylu_reproduces_sync_diloco() -> None:
    """N = k, c = 0, equal speeds, grace covering the completions: async DN + DyLU == sync DiLoCo."""
    cfg = toy_config()  # profile "none": every worker takes 1 s per step, grace 0.5 s
    assert cfg.outer.buffer_size is None and cfg.outer.activation == 0.0
    workload = build_workload(cfg)
    sync_sim, sync_trace = _run(cfg, "sync_diloco", workload)
    dn_sim, dn_trace = _run(cfg, "async_dn_dylu", workload)

    rounds = cfg.sim.total_local_updates // (WORKERS * H)
    sync_evals, dn_evals = sync_sim.result.evals, dn_sim.result.evals
    assert len(sync_evals) == len(dn_evals) == 1 + cfg.sim.total_local_updates // cfg.sim.eval_every
    for sync_record, dn_record in zip(sync_evals, dn_evals):
        for key in ("time", "local_updates", "version"):
            assert sync_record[key] == dn_record[key], key
        assert dn_record["loss"] == pytest.approx(sync_record["loss"], rel=1e-5)
        assert dn_record["accuracy"] == pytest.approx(sync_record["accuracy"], abs=1.0 / 256 + 1e-9)
    assert [r["local_updates"] for r in dn_evals] == list(range(0, cfg.sim.total_local_updates + 1, cfg.sim.eval_every))
    assert sync_evals[-1]["loss"] < sync_evals[0]["loss"]  # it really trained, so the match is not trivial
    assert torch.allclose(dn_sim.state.params, sync_sim.state.params, rtol=0, atol=1e-5)

    # same work, same order: every round all four restart together from the newest θ
    task_keys = ("time", "worker", "lease_id", "shard", "steps", "start_offset", "lr_offset", "base_version", "finish")
    sync_tasks = [{k: r[k] for k in task_keys} for r in _records(sync_trace, "task")]
    dn_tasks = [{k: r[k] for k in task_keys} for r in _records(dn_trace, "task")]
    assert sync_tasks == dn_tasks
    applied_ids = [r["lease_id"] for r in _records(dn_trace, "applied")]
    assert applied_ids == [r["lease_id"] for r in _records(sync_trace, "applied")]
    dn_tasks = [t for t in dn_tasks if t["lease_id"] in set(applied_ids)]  # leases issued as the budget ran out never finish
    assert len(dn_tasks) == len(applied_ids) == WORKERS * rounds
    assert [t["base_version"] for t in dn_tasks] == [WORKERS * (i // WORKERS) for i in range(len(dn_tasks))]
    assert all(t["steps"] == H for t in dn_tasks)
    assert dn_sim.result.staleness == list(range(WORKERS)) * rounds
    assert dn_sim.result.local_updates == sync_sim.result.local_updates == cfg.sim.total_local_updates

    # the comparison discriminates: plain async Nesterov (a full step per arrival) leaves the trajectory
    nesterov_sim, _ = _run(cfg, "async_diloco", workload)
    assert not torch.allclose(nesterov_sim.state.params, sync_sim.state.params, rtol=0, atol=1e-3)


# ------------------------------------------------------------------------------ DyLU in the trace


@pytest.mark.timeout(120)
def test_very_heterogeneous_profile_gives_dylu_steps_in_the_trace() -> None:
    cfg = toy_config(schedule={"max_local_steps": 20}, sim={"profile": "very", "total_local_updates": 160})
    seconds = HETEROGENEITY_PROFILES["very"]
    fastest = min(Fraction(str(s)) for s in seconds)
    # H_w = floor(v_w / v_max · H) with v = units / (seconds per step): the unit cancels
    expected = {f"w{i}": max(1, math.floor(fastest / Fraction(str(s)) * 20)) for i, s in enumerate(seconds)}
    assert expected == {"w0": 20, "w1": 15, "w2": 7, "w3": 3}
    _, trace = _run(cfg, "async_dn_dylu")
    tasks = _records(trace, "task")
    assert {t["worker"] for t in tasks} == set(expected)
    for task in tasks:
        assert task["steps"] == expected[task["worker"]], task
        assert task["finish"] == pytest.approx(task["time"] + task["steps"] * seconds[int(task["worker"][1:])])
    _, fixed = _run(cfg, "async_diloco")  # no DyLU: everyone runs H
    assert {t["steps"] for t in _records(fixed, "task")} == {20}


@pytest.mark.timeout(30)
def test_worker_seconds_per_step_profiles() -> None:
    assert worker_seconds_per_step("very", 4) == [0.58, 0.75, 1.51, 3.33]
    assert worker_seconds_per_step("none", 6) == [1.0] * 6
    assert worker_seconds_per_step("very", 1) == [0.58]
    assert worker_seconds_per_step("very", 2) == [0.58, pytest.approx(3.33, rel=1e-12)]
    three = worker_seconds_per_step("moderate", 3)
    assert three == pytest.approx([0.7, math.sqrt(0.7 * 2.0), 2.0], rel=1e-12)  # geometric interpolation
    assert worker_seconds_per_step([0.5, 2], 2) == [0.5, 2.0]
    with pytest.raises(ValueError, match="lists 3 speeds but sim.workers is 2"):
        worker_seconds_per_step([1.0, 2.0, 3.0], 2)


@pytest.mark.timeout(60)
def test_sync_diloco_waits_for_the_slowest_worker_every_round() -> None:
    cfg = toy_config(sim={"profile": "very", "total_local_updates": 80})
    simulation, trace = _run(cfg, "sync_diloco")
    slowest = max(HETEROGENEITY_PROFILES["very"]) * H
    tasks = [t for t in _records(trace, "task") if t["lease_id"] in {r["lease_id"] for r in _records(trace, "applied")}]
    assert len(tasks) == 8
    for index, task in enumerate(tasks):
        round_index = index // WORKERS
        assert task["steps"] == H
        assert task["base_version"] == WORKERS * round_index
        assert task["time"] == pytest.approx(round_index * slowest, rel=1e-12)
    assert simulation.result.sim_time == pytest.approx(2 * slowest, rel=1e-12)
    assert simulation.result.staleness == [0, 1, 2, 3] * 2


# ------------------------------------------------------------------------------ held checks (sim.checks)


@pytest.mark.timeout(180)
def test_held_checks_apply_each_chosen_update_when_one_verifiers_rerun_of_it_ends() -> None:
    """sim.checks: the leases verification chooses (every worker's probation, then its draws) are held until a single
    verifier, first come first served, has re-run their steps at rerun_seconds_per_step; the others apply when they
    arrive. Nothing chosen: the run is the unchecked run, bit for bit."""
    rerun = 0.25
    cfg = toy_config(sim={"profile": "very", "total_local_updates": 200, "checks": True, "rerun_seconds_per_step": rerun},
                     runtime={"verify": {"fraction": 0.45, "probation_updates": 2, "hold_backlog": 2}})  # drawn ones held too
    simulation, trace = _run(cfg, "async_dn_dylu")
    finish = {r["lease_id"]: (r["finish"], r["steps"], r["worker"]) for r in _records(trace, "task")}
    applied = {r["lease_id"]: r["time"] for r in _records(trace, "applied")}
    held = _records(trace, "held")
    assert held and simulation.result.held == len(held)
    free = 0.0
    for record in held:  # in the order they arrived: the verifier's queue
        submitted, steps, _ = finish[record["lease_id"]]
        assert record["time"] == submitted
        free = max(submitted, free) + steps * rerun
        assert record["verdict_at"] == free
        if record["lease_id"] in applied:
            assert applied[record["lease_id"]] == free
    for lease_id, time in applied.items():
        if lease_id not in {r["lease_id"] for r in held}:
            assert time == finish[lease_id][0]
    for worker in {w for _, _, w in finish.values()}:  # every worker's first two leases are its probation
        first = sorted((f, lease_id) for lease_id, (f, _, w) in finish.items() if w == worker)[:2]
        chosen = {r["lease_id"]: r["why"] for r in held}
        assert all(chosen.get(lease_id, "").startswith("probation") for _, lease_id in first)
    assert 0 < sum(r["why"].startswith("sampled") for r in held) < len(finish)

    nothing = toy_config(sim={"profile": "very", "total_local_updates": 200, "checks": True},
                         runtime={"verify": {"fraction": 0.0, "probation_updates": 0}})
    plain = toy_config(sim={"profile": "very", "total_local_updates": 200})
    quiet, quiet_trace = _run(nothing, "async_dn_dylu")
    unchecked, unchecked_trace = _run(plain, "async_dn_dylu")
    assert quiet.result.held == 0 and quiet_trace == unchecked_trace
    assert torch.equal(quiet.state.params, unchecked.state.params)
    with pytest.raises(ValueError, match="runtime.verify.enabled"):
        Simulation(toy_config(sim={"checks": True}, runtime={"verify": {"enabled": False}}), "async_dn_dylu")


@pytest.mark.timeout(180)
def test_with_re_runs_ahead_the_verifier_starts_each_chosen_lease_when_it_is_issued() -> None:
    """runtime.verify.ahead with inner_state reset (coordinator/ahead.py): the verifier's queue takes each chosen lease
    when it is issued, not when its update arrives, and the update's verdict comes at its arrival or when that re-run
    ends, whichever is later; the same run without it queues at arrival."""
    rerun = 0.25
    verify = {"fraction": 0.45, "probation_updates": 2, "inner_state": "reset", "hold_backlog": 2}  # drawn ones held too
    cfg = toy_config(sim={"profile": "very", "total_local_updates": 200, "checks": True, "rerun_seconds_per_step": rerun},
                     runtime={"verify": verify})
    assert cfg.runtime.verify.ahead > 0
    simulation, trace = _run(cfg, "async_dn_dylu")
    tasks = _records(trace, "task")
    held = {r["lease_id"]: r for r in _records(trace, "held")}
    ready: dict[str, float] = {}
    free = 0.0
    for task in tasks:  # in the order they were issued
        if not task.get("verify", "probation: held").startswith("probation: held"):
            free = ready[task["lease_id"]] = max(task["time"], free) + task["steps"] * rerun
    assert held and set(held) <= set(ready)
    finish = {task["lease_id"]: task["finish"] for task in tasks}
    early = 0
    for lease_id, record in held.items():
        assert record["time"] == finish[lease_id]
        assert record["verdict_at"] == max(finish[lease_id], ready[lease_id])
        early += ready[lease_id] <= finish[lease_id]  # judged the moment it arrived
    assert early > 0
    applied = {r["lease_id"]: r["time"] for r in _records(trace, "applied")}
    assert all(applied[lease_id] == held[lease_id]["verdict_at"] for lease_id in held if lease_id in applied)
    # a verdict ready on arrival is decided right after its submit (the leases that submit itself released may come
    # first): no other update is submitted or applied in between
    order = [r for r in map(json.loads, trace.splitlines()) if r["type"] in ("applied", "held")]
    on_arrival = 0
    for index, record in enumerate(order):
        if record["type"] == "held" and ready[record["lease_id"]] <= record["time"] and record["lease_id"] in applied:
            assert (order[index + 1]["type"], order[index + 1]["lease_id"]) == ("applied", record["lease_id"])
            on_arrival += 1
    assert on_arrival == early
    later, later_trace = _run(toy_config(sim={"profile": "very", "total_local_updates": 200, "checks": True,
                                              "rerun_seconds_per_step": rerun},
                                         runtime={"verify": {**verify, "ahead": 0}}), "async_dn_dylu")
    at_arrival = _records(later_trace, "held")
    free = 0.0
    for record in at_arrival:
        free = max(record["time"], free) + next(t["steps"] for t in _records(later_trace, "task")
                                                if t["lease_id"] == record["lease_id"]) * rerun
        assert record["verdict_at"] == free


@pytest.mark.timeout(180)
def test_upload_time_delays_each_update_while_the_next_lease_trains() -> None:
    """sim.upload_s: a slow link's order — one upload at a time: an update's upload starts at its lease's end or, if
    the worker's previous update is still on its way, when that one arrives; it arrives ``upload_s`` later (its
    applied record's time), and the worker's next lease starts when its upload starts, from θ without it. The
    staleness this adds is counted as any other (every applied update's staleness is its version gap), larger than
    with instantaneous uploads. Asking for it without sim.overlap is a clear error."""
    upload = 7.25
    sections: dict[str, Any] = {"schedule": {"grace_period": 0.0}, "outer": {"buffer_size": 3}}
    cfg = toy_config(**sections, sim={"profile": "very", "total_local_updates": 200, "overlap": True, "upload_s": upload})
    simulation, trace = _run(cfg, "async_dn_dylu")
    tasks = {r["lease_id"]: r for r in _records(trace, "task")}
    applied = _records(trace, "applied")
    assert len(applied) >= 10
    assert all(r["staleness"] == r["version"] - 1 - tasks[r["lease_id"]]["base_version"] for r in applied)
    arrived = {r["lease_id"]: r["time"] for r in applied}
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for record in _records(trace, "task"):
        by_worker.setdefault(record["worker"], []).append(record)
    waited = 0
    for records in by_worker.values():
        previous_arrival = -math.inf
        for lease, following in zip(records, records[1:]):
            if lease["lease_id"] not in arrived:
                break  # the run ended with it on its way
            start = max(lease["finish"], previous_arrival)  # its upload's start: the next lease starts then
            waited += start > lease["finish"]
            assert arrived[lease["lease_id"]] == start + upload and following["time"] == start
            previous_arrival = arrived[lease["lease_id"]]
    assert waited >= 1  # the fastest worker's leases are shorter than an upload: it waits for its link
    instant, _ = _run(toy_config(**sections, sim={"profile": "very", "total_local_updates": 200, "overlap": True}),
                      "async_dn_dylu")
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(simulation.result.staleness) > mean(instant.result.staleness)
    with pytest.raises(ValueError, match="sim.upload_s needs sim.overlap: true"):
        toy_config(sim={"upload_s": 1.0})


@pytest.mark.timeout(180)
def test_asking_ahead_starts_each_lease_from_the_theta_granted_before_its_predecessor_ended() -> None:
    """sim.ask_ahead_s: a slow download link's order (peer/pipeline.py) — a worker asks for its next lease ``ask_ahead_s``
    before its lease in training ends, or when its previous update arrives if that is later, and takes its θ then; the
    next lease trains the moment its predecessor ends, from that θ minus the predecessor's update (the eager start),
    its base version the one granted at the ask. Its θ being older, the staleness is larger than when asked at the
    upload's start. Asking for it without sim.upload_s is a clear error."""
    upload, ahead = 3.25, 6.5
    sections: dict[str, Any] = {"schedule": {"grace_period": 0.0}, "outer": {"buffer_size": 3}}
    sim = {"profile": "very", "total_local_updates": 200, "overlap": True, "upload_s": upload}
    simulation, trace = _run(toy_config(**sections, sim={**sim, "ask_ahead_s": ahead}), "async_dn_dylu")
    applied = sorted((r["time"], r["version"], r["lease_id"]) for r in _records(trace, "applied"))
    arrived = {lease_id: time for time, _, lease_id in applied}
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for record in _records(trace, "task"):
        by_worker.setdefault(record["worker"], []).append(record)
    ahead_leases = 0
    for records in by_worker.values():
        for before, lease, following in zip(records, records[1:], records[2:]):
            if before["lease_id"] not in arrived or "asked" not in following:
                continue
            asked = max(lease["time"], lease["finish"] - ahead, arrived[before["lease_id"]])
            assert following["asked"] == asked and following["time"] == lease["finish"]
            assert following["eager_of"] == lease["lease_id"]
            versions = [v for t, v, _ in applied if t < asked] or [0]
            assert following["base_version"] in range(max(versions), max([v for t, v, _ in applied if t <= asked] or [0]) + 1)
            ahead_leases += 1
    assert ahead_leases >= 10
    later, _ = _run(toy_config(**sections, sim=sim), "async_dn_dylu")
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(simulation.result.staleness) > mean(later.result.staleness)
    with pytest.raises(ValueError, match="sim.ask_ahead_s models a slow link's asking ahead and needs sim.upload_s"):
        toy_config(sim={"overlap": True, "ask_ahead_s": 1.0})


@pytest.mark.timeout(180)
def test_overlap_asks_for_the_next_lease_before_the_update_is_in_and_doubles_dns_n() -> None:
    """sim.overlap: runtime.overlap's order with instantaneous transfers — each worker's next lease is issued the moment
    its lease ends, from θ without that lease's update (applied right after), and DN's N counts two updates per worker."""
    cfg = toy_config(schedule={"grace_period": 0.0}, outer={"buffer_size": 3},
                     sim={"profile": "very", "total_local_updates": 200, "overlap": True})
    simulation, trace = _run(cfg, "async_dn_dylu")
    assert simulation.state.optimizer.buffer_size == 6
    applied = {r["lease_id"]: r["version"] for r in _records(trace, "applied")}
    tasks: dict[str, list[dict[str, Any]]] = {}
    for record in _records(trace, "task"):
        tasks.setdefault(record["worker"], []).append(record)
    pairs = 0
    for records in tasks.values():
        for previous, current in zip(records, records[1:]):
            assert current["time"] == previous["finish"]
            if previous["lease_id"] in applied:  # its own update reached θ only after the next lease's base
                assert current["base_version"] < applied[previous["lease_id"]]
                pairs += 1
    assert pairs >= 10
    serial, serial_trace = _run(toy_config(schedule={"grace_period": 0.0}, outer={"buffer_size": 3},
                                           sim={"profile": "very", "total_local_updates": 200}), "async_dn_dylu")
    assert serial.state.optimizer.buffer_size == 3
    serial_applied = {r["lease_id"]: r["version"] for r in _records(serial_trace, "applied")}
    serial_tasks = _records(serial_trace, "task")
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for record in serial_tasks:
        by_worker.setdefault(record["worker"], []).append(record)
    for records in by_worker.values():  # serial rounds: the next lease starts from θ with the worker's own update
        for previous, current in zip(records, records[1:]):
            assert current["base_version"] >= serial_applied[previous["lease_id"]]
