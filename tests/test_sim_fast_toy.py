"""The toy task's hand-written inner loop (asyncloco/sim/fast_toy.py) against InnerTrainer (autograd + torch AdamW)."""

from __future__ import annotations

import pytest
import torch

from asyncloco.models.workload import flatten_params
from asyncloco.train.inner import InnerTrainer
from asyncloco.sim.engine import Simulation, build_workload
from asyncloco.sim.fast_toy import FastToyTrainer
from tests.test_sim import toy_config


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inner", [{}, {"weight_decay": 0.1, "grad_clip": 0.05}])
def test_fast_trainer_matches_inner_trainer_over_consecutive_leases(inner: dict[str, float]) -> None:
    cfg = toy_config(inner=inner)
    workload = build_workload(cfg)
    reference = InnerTrainer.from_config(cfg, workload)
    theta = flatten_params(reference.model)
    fast = FastToyTrainer(workload, cfg.inner.schedule(), cfg.inner.betas, cfg.inner.weight_decay, cfg.inner.grad_clip)
    state = fast.new_state()
    # two leases on different shards, the AdamW state carried from the first into the second (as a worker's is);
    # the second lease crosses an epoch boundary of its shard (a reshuffle)
    for shard, start, steps, lr_offset in ((1, 3, 7, 3), (2, 60, 9, 60)):
        expected = reference.run(theta, shard, start, steps, lr_offset)
        got = fast.run(state, theta, shard, start, steps, lr_offset)
        assert got.steps == expected.steps == steps
        assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-6)
        torch.testing.assert_close(got.pseudo_gradient, expected.pseudo_gradient, rtol=1e-4, atol=1e-6)
        assert expected.pseudo_gradient.abs().max() > 1e-3  # the leases really moved θ
        theta = theta - 0.5 * got.pseudo_gradient  # the next lease starts from another θ
    torch_state = [reference.optimizer.state[p] for p in reference.model.parameters()]
    assert state.step == 16 and all(int(s["step"]) == 16 for s in torch_state)
    torch.testing.assert_close(state.exp_avg, torch.cat([s["exp_avg"].reshape(-1) for s in torch_state]), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(
        state.exp_avg_sq, torch.cat([s["exp_avg_sq"].reshape(-1) for s in torch_state]), rtol=1e-4, atol=1e-10
    )


@pytest.mark.timeout(180)
def test_simulation_with_the_fast_loop_equals_the_autograd_loop() -> None:
    cfg = toy_config(sim={"profile": "very"})
    workload = build_workload(cfg)
    fast = Simulation(cfg, "async_dn_dylu", workload).run()
    slow_sim = Simulation(cfg, "async_dn_dylu", workload, fast=False)
    assert slow_sim.fast is None
    slow = slow_sim.run()
    assert [e["local_updates"] for e in fast.evals] == [e["local_updates"] for e in slow.evals]
    assert [e["time"] for e in fast.evals] == [e["time"] for e in slow.evals]  # the same timeline
    for a, b in zip(fast.evals, slow.evals):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert len({round(e["loss"], 4) for e in fast.evals}) >= 3  # θ moved: the comparison is not of constants


@pytest.mark.timeout(30)
def test_fast_trainer_rejects_a_wrong_sized_theta() -> None:
    cfg = toy_config()
    workload = build_workload(cfg)
    fast = FastToyTrainer(workload, cfg.inner.schedule())
    with pytest.raises(ValueError, match="toy MLP needs"):
        fast.run(fast.new_state(), torch.zeros(3), 0, 0, 1, 0)
    with pytest.raises(ValueError, match="at least one step"):
        fast.run(fast.new_state(), torch.zeros(fast.numel), 0, 0, 0, 0)
