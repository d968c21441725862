"""The toy task's inner loop without autograd or ``torch.optim``: same maths, a fraction of the overhead.

The toy model is a one-hidden-layer MLP (``Linear → ReLU → Linear``, asyncloco/models/toy.py) trained with
AdamW. :class:`~asyncloco.train.inner.InnerTrainer` runs it through autograd and ``torch.optim.AdamW``;
at batch 32 most of a step's time is Python and dispatch overhead around two small matrix products.
This trainer keeps θ, its gradient and both AdamW moments as *one flat vector each* (in
``model.parameters()`` order, so θ is the coordinator's flat vector as is), writes the backward pass
by hand (cross-entropy → second layer → ReLU → first layer) and applies AdamW as a handful of in-place
ops on the whole vector — the update ``torch.optim.AdamW`` computes (decoupled weight decay,
bias-corrected moments, ε outside the square root), step for step. A lease's batches are gathered
with one index operation.

The result equals InnerTrainer's to float rounding (tests/test_sim_fast_toy.py); the simulator uses it
for the toy task with the plain fp32 AdamW inner optimizer (docs/algorithm.md §8, "Cost").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncloco.algo.schedule import ShardSchedule
from asyncloco.train.inner import RoundResult
from asyncloco.models.toy import ToyWorkload

__all__ = ["FlatAdamState", "FastToyTrainer"]


@dataclass
class FlatAdamState:
    """One worker's AdamW state over the flat parameter vector (the paper keeps it across rounds)."""

    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class FastToyTrainer:
    """``run(state, θ, shard, start_offset, steps, lr_offset)`` trains one lease and returns θ_start − θ_end."""

    def __init__(
        self,
        workload: ToyWorkload,
        schedule: ShardSchedule,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
        eps: float = 1e-8,
    ) -> None:
        cfg = workload.cfg
        self.workload = workload
        self.schedule = schedule
        self.betas = betas
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        self.eps = eps
        self.dim, self.hidden, self.classes = cfg.dim, cfg.hidden, cfg.classes
        d, h, c = self.dim, self.hidden, self.classes
        self.numel = h * d + h + c * h + c
        self.params = torch.zeros(self.numel)
        self.grad = torch.zeros(self.numel)
        self._denom = torch.zeros(self.numel)
        self.w1, self.b1, self.w2, self.b2 = self._views(self.params)
        self.gw1, self.gb1, self.gw2, self.gb2 = self._views(self.grad)

    def _views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        d, h, c = self.dim, self.hidden, self.classes
        a, b, e = h * d, h * d + h, h * d + h + c * h
        return flat[:a].view(h, d), flat[a:b], flat[b:e].view(c, h), flat[e:]

    def new_state(self) -> FlatAdamState:
        return FlatAdamState(0, torch.zeros(self.numel), torch.zeros(self.numel))

    def _lease_batches(self, shard: int, start_offset: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All of a lease's batches, ``(steps, batch, dim)`` and ``(steps, batch)``, in one gather."""
        w = self.workload
        rows = [w.batch_rows(shard, start_offset + j) for j in range(steps)]
        index = torch.stack(rows)
        return w.train_x[index], w.train_y[index]

    @torch.no_grad()
    def run(
        self, state: FlatAdamState, params: torch.Tensor, shard: int, start_offset: int, steps: int, lr_offset: int
    ) -> RoundResult:
        if steps < 1:
            raise ValueError(f"a round needs at least one step, got {steps}")
        if params.dim() != 1 or params.numel() != self.numel:
            raise ValueError(f"flat parameter vector has {params.numel()} values, the toy MLP needs {self.numel}")
        xs, ys = self._lease_batches(shard, start_offset, steps)
        batch = ys.shape[1]
        theta = self.params
        theta.copy_(params)
        w1, b1, w2, b2 = self.w1, self.b1, self.w2, self.b2
        gw1, gb1, gw2, gb2 = self.gw1, self.gb1, self.gw2, self.gb2
        m, v, denom = state.exp_avg, state.exp_avg_sq, self._denom
        beta1, beta2 = self.betas
        total = 0.0
        for j in range(steps):
            x, y = xs[j], ys[j]
            hidden = torch.addmm(b1, x, w1.t())
            active = hidden.clamp_(min=0.0)  # ReLU in place: hidden is not needed again
            logits = torch.addmm(b2, active, w2.t())
            log_probs = torch.log_softmax(logits, dim=1)
            picked = log_probs.gather(1, y.unsqueeze(1))
            total += -float(picked.sum()) / batch
            # d loss / d logits = (softmax − one-hot) / batch
            dlogits = log_probs.exp_()
            dlogits.scatter_add_(1, y.unsqueeze(1), torch.full_like(picked, -1.0))
            dlogits.div_(batch)
            torch.mm(dlogits.t(), active, out=gw2)
            torch.sum(dlogits, dim=0, out=gb2)
            dhidden = torch.mm(dlogits, w2)
            dhidden.mul_(active > 0)
            torch.mm(dhidden.t(), x, out=gw1)
            torch.sum(dhidden, dim=0, out=gb1)
            if self.grad_clip is not None:  # as torch.nn.utils.clip_grad_norm_ (one vector: its norm is the total)
                coef = self.grad_clip / (float(self.grad.norm()) + 1e-6)
                if coef < 1.0:
                    self.grad.mul_(coef)
            # AdamW, as torch.optim.AdamW computes it
            lr = self.schedule.lr(lr_offset + j)
            state.step += 1
            if self.weight_decay:
                theta.mul_(1.0 - lr * self.weight_decay)
            m.lerp_(self.grad, 1.0 - beta1)
            v.mul_(beta2).addcmul_(self.grad, self.grad, value=1.0 - beta2)
            step_size = lr / (1.0 - beta1**state.step)
            torch.sqrt(v, out=denom).div_(math.sqrt(1.0 - beta2**state.step)).add_(self.eps)
            theta.addcdiv_(m, denom, value=-step_size)
        return RoundResult(params.to(torch.float32) - theta, steps, total / steps)
