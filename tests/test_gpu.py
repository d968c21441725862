"""The CUDA paths, and CPU twins of them that run in every suite.

Tests marked ``gpu`` need a CUDA device and skip without one, saying so; ``scripts/gpu_check.py`` runs them
(``pytest -m gpu tests/test_gpu.py``) on a GPU machine and records the outcome (docs/gpu.md). What each pins:

* ``test_peer_on_cuda_trains_against_a_cpu_coordinator_evaluating_on_cuda`` — real processes: a coordinator
  (state on the CPU, ``runtime.eval_device: cuda``, so its evaluations and the gate's probe run on the GPU)
  and one ``asyncloco peer join --device cuda``; updates are applied, the peer reports a CUDA device, the
  validation perplexity is finite and falls.
* ``test_bf16_autocast_round[cuda]`` — the inner loop under bf16 autocast on the GPU: the model's linear
  layers really compute in bf16, weights and the pseudo-gradient stay fp32, and the update stays within
  the AdamW bound (``2 × steps × lr`` per value) of the fp32 one on the CPU.
* ``test_pinned_copies_carry_theta_and_the_pseudo_gradient_exactly`` — θ goes in and the pseudo-gradient
  comes out through pinned host buffers; an fp32 round on the GPU is the CPU's round up to float rounding
  (relative L2 error below 1e-3).
* ``test_adamw8bit_trains_the_20m_preset`` — bitsandbytes' 8-bit AdamW (its state really uint8) trains the
  20m preset on the embedded corpus: the mean loss of the last lease is well below the first's and within
  5 % of torch's AdamW (fp32 moments) on the same batches.
* ``test_evaluation_on_cuda_matches_the_cpu`` — ``workload.evaluate`` of a model on the GPU equals the CPU's.
* ``test_world_size_one_group[nccl-ddp|nccl-fsdp]`` — a one-GPU torch.distributed group (NCCL) under DDP and
  under FSDP2 gives the pseudo-gradient of a single process.

CPU twins (no marker, run everywhere): ``test_bf16_autocast_round[cpu]`` (the same autocast path on the CPU)
and ``test_world_size_one_group[gloo-*]`` (the group code path with one rank, on gloo). Pinned memory needs
CUDA (torch refuses ``pin_memory`` without it), so that path has no CPU twin.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import yaml
from torch import nn

from asyncloco.algo.schedule import ShardSchedule
from asyncloco.models.lm import causal_lm_loss
from asyncloco.models.presets import build_causal_lm
from asyncloco.models.workload import Workload, flatten_params
from asyncloco.train.device_io import StepClock, released
from asyncloco.train.inner import InnerTrainer

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU: none is visible to torch here (scripts/gpu_check.py runs these on a GPU machine)"
needs_cuda = pytest.mark.skipif(not CUDA, reason=NO_CUDA)
VOCAB, SEQ, ROWS = 256, 32, 8
LR, STEPS = 1e-2, 5


class RandomTokens(Workload):
    """Fixed random token batches for the ``tiny`` Llama preset: the inner loop without the data pipeline."""

    name = "random-tokens"
    units_per_step = ROWS * SEQ

    def __init__(self, batches: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, VOCAB, (batches, ROWS, SEQ + 1), generator=generator)

    def build_model(self, seed: int) -> nn.Module:
        return build_causal_lm("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=seed)

    def shard_sizes(self) -> list[int]:
        return [len(self.rows)]

    def batch(self, shard: int, index: int) -> torch.Tensor:
        return self.rows[index % len(self.rows)]

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(model, batch)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with torch.no_grad():
            loss = float(causal_lm_loss(model, self.rows[0]))
        return {"loss": loss, "perplexity": math.exp(loss)}


def _schedule() -> ShardSchedule:
    return ShardSchedule(LR, LR, 0, 1000)  # constant lr: each AdamW step moves a value by at most ~lr


def _theta(workload: Workload) -> torch.Tensor:
    return flatten_params(workload.build_model(seed=0)).detach().cpu()


# ------------------------------------------------------------------------------ bf16 autocast


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_bf16_autocast_round(device: str) -> None:
    workload = RandomTokens()
    theta = _theta(workload)
    reference = InnerTrainer(workload, _schedule(), seed=0).run(theta, 0, 0, STEPS, 0)  # fp32 on the CPU
    trainer = InnerTrainer(workload, _schedule(), seed=0, device=device, precision="bf16")
    dtypes: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
             for m in trainer.model.modules() if isinstance(m, nn.Linear)]
    result = trainer.run(theta, 0, 0, STEPS, 0)
    for hook in hooks:
        hook.remove()
    assert dtypes == {torch.bfloat16}  # every linear layer computed in bf16 under autocast
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # weights stay fp32
    delta = result.pseudo_gradient
    assert delta.dtype == torch.float32 and delta.device.type == "cpu" and delta.shape == theta.shape
    assert not torch.equal(delta, reference.pseudo_gradient)  # the rounding really differs
    # AdamW moves each value by at most about lr per step whatever the gradient's rounding, so two trajectories
    # of STEPS steps end at most 2 × STEPS × lr apart (on the CPU the gap is within STEPS × lr)
    assert float((delta - reference.pseudo_gradient).abs().max()) <= 2 * STEPS * LR
    assert abs(result.mean_loss - reference.mean_loss) < 0.05 * reference.mean_loss


# ------------------------------------------------------------------------------ pinned copies


@pytest.mark.gpu
@needs_cuda
def test_pinned_copies_carry_theta_and_the_pseudo_gradient_exactly() -> None:
    workload = RandomTokens()
    theta = _theta(workload)
    reference = InnerTrainer(workload, _schedule(), seed=0).run(theta, 0, 0, STEPS, 0).pseudo_gradient
    trainer = InnerTrainer(workload, _schedule(), seed=0, device="cuda")
    first = trainer.run(theta, 0, 0, STEPS, 0).pseudo_gradient
    assert trainer._pinned is not None and trainer._pinned.is_pinned()  # θ went in through the pinned buffer
    assert torch.equal(trainer._pinned, theta)
    assert first.device.type == "cpu" and first.is_pinned() and first.dtype == torch.float32
    # the same fp32 round on another device: equal up to float rounding of different kernels, which AdamW's
    # m/√v amplifies for values whose gradients are near zero (an H100 gave 16 of 123,200 values 8e-5 apart):
    # judged as verified work judges a re-run, by the relative L2 error of the whole pseudo-gradient
    error = float((first.double() - reference.double()).norm() / reference.double().norm())
    assert error < 1e-3, f"relative L2 error {error:.3g} of the GPU's fp32 round vs the CPU's"
    # a second lease from another θ reuses the pinned buffer and starts exactly from that θ
    buffer = trainer._pinned.data_ptr()
    shifted = theta + 0.01
    kept = first.clone()
    second = trainer.run(shifted, 0, 0, 1, 0).pseudo_gradient
    assert trainer._pinned.data_ptr() == buffer and torch.equal(trainer._pinned, shifted)
    # the pseudo-gradient's pinned buffer is not reused while the caller holds the last one (still encoding or
    # uploading it), and is reused once it is released
    assert torch.equal(first, kept) and second.data_ptr() != first.data_ptr() and second.is_pinned()
    out = second.data_ptr()
    del first, second
    third = trainer.run(theta, 0, 0, 1, 0).pseudo_gradient
    assert third.data_ptr() == out and third.is_pinned()


def test_step_clock_waits_on_the_previous_step_and_reports_every_step_once() -> None:
    """The CPU side of the CUDA per-step timing (inner.StepClock): with a fence, step j's completion is waited
    for only once step j + 1 is queued, every step is reported exactly once in order (the last by flush),
    and the reports add up to the time from the clock's start to the last completion."""
    log: list[str] = []
    reports: list[float] = []

    class Marker:
        def __init__(self, step: int) -> None:
            self.step = step

        def synchronize(self) -> None:
            log.append(f"wait {self.step}")

    queued = iter(range(100))

    def fence() -> Marker:
        step = next(queued)
        log.append(f"queue {step}")
        return Marker(step)

    def on_step(seconds: float) -> None:
        reports.append(seconds)
        log.append(f"report {len(reports) - 1}")

    before = time.perf_counter()
    clock = StepClock(on_step, fence)
    for _ in range(3):
        clock.step_done(time.perf_counter())
    clock.flush()
    clock.flush()  # nothing left: no second report
    after = time.perf_counter()
    assert log == ["queue 0", "queue 1", "wait 0", "report 0", "queue 2", "wait 1", "report 1", "wait 2", "report 2"]
    assert len(reports) == 3 and all(r >= 0 for r in reports) and sum(reports) <= after - before
    assert clock.last - sum(reports) >= before  # the reports span the clock's start to the last completion

    # without a fence (CPU) each step is reported at once with its own duration
    cpu: list[float] = []
    plain = StepClock(cpu.append)
    started = time.perf_counter()
    plain.step_done(started)
    plain.flush()
    assert len(cpu) == 1 and 0 <= cpu[0] <= time.perf_counter() - started


def test_released_counts_views_and_arrays_of_a_buffer() -> None:
    """The CPU side of the pinned output buffer's reuse rule (inner.released): any view or numpy array over
    the buffer's memory keeps it from being reused."""
    buffer = torch.zeros(8)
    assert released(buffer)
    handed_out = buffer.view(-1)  # what InnerTrainer._to_host returns
    assert not released(buffer)
    del handed_out
    assert released(buffer)
    array = buffer[2:].numpy()
    assert not released(buffer)
    del array
    assert released(buffer)


# ------------------------------------------------------------------------------ 8-bit AdamW


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(120)
def test_adamw8bit_trains_the_20m_preset(tmp_path: Path) -> None:
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (scripts/gpu_wheels.sh)")
    from asyncloco.models.config import LMTaskConfig
    from asyncloco.models.lm import build_lm_workload

    cfg = LMTaskConfig(model="20m", source="embedded", seq_len=128, batch_size=16, num_shards=1,
                       max_train_sequences=1024, val_sequences=16, cache_dir=str(tmp_path / "cache"))
    workload = build_lm_workload(cfg)
    trainer = InnerTrainer(workload, ShardSchedule(1e-3, 1e-4, 10, 1000), seed=0, optimizer="adamw8bit",
                           weight_decay=0.1, grad_clip=1.0, device="cuda", precision="bf16")
    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)

    def leases(trainer: InnerTrainer) -> list[float]:  # four leases of 15 steps, each from the θ the last ended at
        return [trainer.run(trainer.full_params(), 0, k * 15, 15, k * 15).mean_loss for k in range(4)]

    losses = leases(trainer)
    states = [s for s in trainer.optimizer.state.values() if "state1" in s]
    assert states and any(s["state1"].dtype == torch.uint8 for s in states)  # the moments really are 8-bit
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # it learns
    # and as well as torch's AdamW (fp32 moments) on the same batches from the same start: within 5 %
    reference = leases(InnerTrainer(workload, ShardSchedule(1e-3, 1e-4, 10, 1000), seed=0, optimizer="adamw",
                                    weight_decay=0.1, grad_clip=1.0, device="cuda", precision="bf16"))
    assert abs(losses[-1] - reference[-1]) <= 0.05 * reference[-1], (losses, reference)


# ------------------------------------------------------------------------------ eval on cuda


@pytest.mark.gpu
@needs_cuda
def test_evaluation_on_cuda_matches_the_cpu() -> None:
    workload = RandomTokens()
    model = workload.build_model(seed=0)
    on_cpu = workload.evaluate(model)
    on_gpu = workload.evaluate(workload.build_model(seed=0).to("cuda"))
    assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=1e-4)


# ------------------------------------------------------------------------------ groups of one


@contextlib.contextmanager
def _one_rank_group(backend: str, tmp_path: Path) -> Iterator[Any]:
    import torch.distributed as dist

    from asyncloco.train.group import GroupContext

    if dist.is_initialized():
        pytest.skip("a torch.distributed group is already initialised in this process")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield GroupContext(rank=0, world_size=1, local_rank=0, backend=backend, device=device)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, needs_cuda])])
@pytest.mark.timeout(240, method="thread")  # a hang inside torch's C++ (a process group's destructor) ends the worker, not the suite
def test_world_size_one_group(backend: str, parallel: str, tmp_path: Path) -> None:
    workload = RandomTokens()
    theta = _theta(workload)
    device = "cuda:0" if backend == "nccl" else "cpu"
    single = InnerTrainer(workload, _schedule(), seed=0, device=device)
    expected = [single.run(theta, 0, 0, STEPS, 0), single.run(theta, 0, STEPS, STEPS, STEPS)]
    with _one_rank_group(backend, tmp_path) as group:
        trainer = InnerTrainer(workload, _schedule(), seed=0, device=group.device, group=group, parallel=parallel)
        assert trainer.sharded == (parallel == "fsdp")
        if parallel == "ddp":
            assert isinstance(trainer.forward_model, torch.nn.parallel.DistributedDataParallel)
        got = [trainer.run(theta, 0, 0, STEPS, 0), trainer.run(theta, 0, STEPS, STEPS, STEPS)]  # state carried over
        assert trainer.full_params().shape == theta.shape
        # the DDP reducer holds the process group: free it while the group is alive (a gloo group whose last reference
        # went with the reducer after destroy_process_group hung in its destructor, past pytest's timeout, in a
        # fresh-venv suite run)
        del trainer
        gc.collect()
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine.pseudo_gradient, theirs.pseudo_gradient, rtol=0, atol=1e-5)
        assert mine.mean_loss == pytest.approx(theirs.mean_loss, rel=1e-5)


# ------------------------------------------------------------------------------ a real peer on cuda


@pytest.mark.gpu
@needs_cuda
@pytest.mark.integration
@pytest.mark.timeout(150)
def test_peer_on_cuda_trains_against_a_cpu_coordinator_evaluating_on_cuda(tmp_path: Path) -> None:
    from asyncloco.local_cluster import LocalCluster

    config = {
        "name": "gpu-peer", "seed": 0,
        "task": {"kind": "lm", "model": "tiny", "source": "embedded", "seq_len": 64, "batch_size": 8,
                 "num_shards": 2, "val_sequences": 16, "max_train_sequences": 2000},
        "inner": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0,
                  "precision": "bf16"},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": 1},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 20, "min_steps": 1, "grace_period": 0.2},
        "sim": {"workers": 1},
        "runtime": {"run_id": f"gpu-{uuid.uuid4().hex[:12]}", "codec": "int8", "eval_every": 2,
                    "speed_report_period": 1.0, "lease_slack": 10.0, "eval_device": "cuda"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    threads = max(1, min(4, (os.cpu_count() or 1) // 2))
    with LocalCluster(path, tmp_path / "cluster", threads=threads) as cluster:
        cluster.start_coordinator()
        cluster.start_peer("gpu", extra=("--device", "cuda"))

        def trained() -> bool:
            status = cluster.status()
            return status.get("version", 0) >= 6 and len(status.get("evals", [])) >= 3

        cluster.wait_for(trained, 110.0, "six updates from the CUDA peer and three evaluations")
        assert cluster.stop(cluster.peers["gpu"], timeout=60.0) == 0
        assert cluster.stop_coordinator(timeout=60.0) == 0
        status, summary = cluster.status(), cluster.peer_summary("gpu")
    (peer,) = status["peers"].values()
    assert str(peer["device"]).startswith("cuda"), peer
    assert summary["accepted"] >= 6 and peer["applied"] == summary["accepted"]
    perplexities = [e["perplexity"] for e in status["evals"]]
    assert all(math.isfinite(p) for p in perplexities)
    assert perplexities[-1] < perplexities[0], perplexities
