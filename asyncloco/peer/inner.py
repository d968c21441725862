"""The inner loop of one round (algorithm.md §1), shared by simulated workers and real peers.

Start from θ(v0) exactly as received, run ``steps`` inner AdamW steps on the lease's batches with the
shard's learning-rate schedule, and return the pseudo-gradient g = θ_start − θ_end. The inner
optimizer state persists across rounds on the same trainer and is never sent (paper §10.1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from asyncloco.algo.schedule import ShardSchedule
from asyncloco.models.workload import Workload, flatten_params, load_flat_params

if TYPE_CHECKING:
    from asyncloco.config import RunConfig

__all__ = ["InnerTrainer", "RoundResult", "build_inner_optimizer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundResult:
    pseudo_gradient: torch.Tensor
    steps: int
    mean_loss: float


def build_inner_optimizer(
    kind: str, params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "adamw8bit":
        if not all(p.is_cuda for p in params):
            raise ValueError("inner.optimizer 'adamw8bit' (bitsandbytes) needs a CUDA device; use 'adamw' on CPU")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown inner optimizer {kind!r}; use 'adamw' or 'adamw8bit'")


class InnerTrainer:
    """One worker's model replica plus its persistent inner optimizer."""

    def __init__(
        self,
        workload: Workload,
        schedule: ShardSchedule,
        seed: int,
        optimizer: str = "adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.workload = workload
        self.schedule = schedule
        self.device = torch.device(device)
        self.model = workload.build_model(seed).to(self.device)
        self.grad_clip = grad_clip
        self.optimizer = build_inner_optimizer(
            optimizer, list(self.model.parameters()), schedule.peak_lr, betas, weight_decay
        )

    @classmethod
    def from_config(cls, cfg: "RunConfig", workload: Workload, device: str | torch.device = "cpu") -> "InnerTrainer":
        """The trainer a run config describes (inner optimizer, schedule, clipping, model seed)."""
        return cls(
            workload,
            cfg.inner.schedule(),
            seed=cfg.seed,
            optimizer=cfg.inner.optimizer,
            betas=cfg.inner.betas,
            weight_decay=cfg.inner.weight_decay,
            grad_clip=cfg.inner.grad_clip,
            device=device,
        )

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def run(
        self,
        params: torch.Tensor,
        shard: int,
        start_offset: int,
        steps: int,
        lr_offset: int,
        on_step: Callable[[float], None] | None = None,
    ) -> RoundResult:
        """Train ``steps`` steps from θ = ``params`` and return θ_start − θ_end (fp32, on CPU).

        ``on_step(seconds)`` is called after every step with that step's duration (progress bars,
        emulated slow devices)."""
        if steps < 1:
            raise ValueError(f"a round needs at least one step, got {steps}")
        theta_start = params.detach().to(torch.float32).cpu()
        load_flat_params(self.model, theta_start.to(self.device))
        self.model.train()
        total = 0.0
        for j in range(steps):
            step_started = time.perf_counter()
            lr = self.schedule.lr(lr_offset + j)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = self.workload.batch(shard, start_offset + j)
            loss = self.workload.loss(self.model, batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            total += float(loss.detach())
            if on_step is not None:
                on_step(time.perf_counter() - step_started)
        theta_end = flatten_params(self.model).cpu()
        return RoundResult(theta_start - theta_end, steps, total / steps)
