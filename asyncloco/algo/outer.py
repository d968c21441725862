"""Outer optimizers: how the coordinator turns one pseudo-gradient into a change of θ.

Every optimizer works on *flat* fp32 vectors: θ is one 1-D tensor (the model's parameters
concatenated in ``named_parameters()`` order), and so is every pseudo-gradient
``g = θ_start − θ_end`` (the outer step *subtracts* g, as in DiLoCo and the async paper).

All of them are pure: no clock, no I/O, no randomness. ``step`` changes θ in place (θ can be
hundreds of MB; copying it per arrival would dominate the coordinator's time) and returns an
:class:`OuterStepInfo` that says what happened and why. ``state_dict``/``load_state_dict``
round-trip the full optimizer state so a coordinator checkpoint resumes the same trajectory.

Conventions (see docs/algorithm.md §2):

* ``lr_scale`` multiplies the outer learning rate ε for this one step (used by ElasticDL's
  staleness-modulated lr and AsyncLM's async-aware regulator);
* ``DelayedNesterov`` is Algorithm 3 of the paper, with ε the sync-DiLoCo outer lr so that with
  N = k and no staleness it reproduces sync DiLoCo exactly;
* ``AsyncBuffer`` (FedBuff) averages N arrivals and then takes *one* Nesterov step — it is *not*
  Delayed Nesterov, which moves θ at every arrival.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "OuterStepInfo",
    "OuterOptimizer",
    "MomentumOptimizer",
    "OuterSGD",
    "OuterSGDMomentum",
    "OuterNesterov",
    "OuterAdam",
    "DelayedNesterov",
    "AsyncBuffer",
]


@dataclass(frozen=True)
class OuterStepInfo:
    """What one ``step`` did. ``moved`` is False when θ was left untouched (e.g. buffered)."""

    moved: bool
    reason: str


def _check_vectors(params: torch.Tensor, pseudo_gradient: torch.Tensor) -> None:
    assert params.dim() == 1 and params.dtype == torch.float32, "θ must be a flat fp32 vector"
    assert pseudo_gradient.shape == params.shape, (
        f"pseudo-gradient has shape {tuple(pseudo_gradient.shape)}, θ has {tuple(params.shape)}"
    )


class OuterOptimizer(ABC):
    """Base class: hyper-parameters are constructor arguments, state lives in tensors/ints."""

    name: str = "outer"
    #: the constructor's arguments, kept as attributes of the same names (:meth:`settings`)
    SETTINGS: tuple[str, ...] = ("lr",)

    def __init__(self, lr: float) -> None:
        if not (lr > 0 and math.isfinite(lr)):
            raise ValueError(f"outer lr must be a positive finite number, got {lr!r}")
        self.lr = float(lr)

    @abstractmethod
    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        """Apply one pseudo-gradient to ``params`` in place. ``steps``: the local steps it was made of (0: not
        known); the momentum methods use it only with ``reference_steps`` set (``MomentumOptimizer.beta``)."""

    def flush(self, params: torch.Tensor) -> OuterStepInfo | None:
        """Apply whatever is still buffered (a sync round that closed short); None when nothing is."""
        return None

    def settings(self) -> dict[str, Any]:
        """The hyper-parameters, as constructor arguments: ``type(self)(**settings())`` is this optimizer without its
        state. A coordinator snapshot records them (coordinator/logic/state.py ``decision_record``)."""
        return {name: getattr(self, name) for name in self.SETTINGS}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} has no state but got keys {sorted(state)}")

    @staticmethod
    def _buffer(state: dict[str, Any], key: str) -> torch.Tensor | None:
        value = state.get(key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"optimizer state '{key}' must be a tensor, got {type(value).__name__}")
        return value.detach().clone().to(torch.float32)


class OuterSGD(OuterOptimizer):
    """θ ← θ − ε·g (the paper's AdamW+SGD; with lr 1 and one worker it is plain FedAvg)."""

    name = "sgd"

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        _check_vectors(params, pseudo_gradient)
        params.add_(pseudo_gradient, alpha=-self.lr * lr_scale)
        return OuterStepInfo(True, "sgd step")


class MomentumOptimizer(OuterOptimizer):
    """Outer momentum β per update. With ``reference_steps`` H set, an update of h > H local steps decays the momentum
    by β^(h/H) instead (``outer.long_lease_momentum: scaled``, docs/algorithm.md "Outer momentum at long leases"):
    the momentum's memory is kept in local steps, so leases longer than H (``schedule.local_steps: auto``) are not each
    amplified by 1/(1 − β). Updates of at most H steps — every lease of the paper's DyLU — see β unchanged."""

    SETTINGS: tuple[str, ...] = ("lr", "momentum", "reference_steps")

    def __init__(self, lr: float, momentum: float, reference_steps: int | None = None) -> None:
        super().__init__(lr)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum!r}")
        if reference_steps is not None and reference_steps < 1:
            raise ValueError(f"reference_steps must be >= 1 or None, got {reference_steps!r}")
        self.momentum = float(momentum)
        self.reference_steps = reference_steps
        self.momentum_buffer: torch.Tensor | None = None

    def beta(self, steps: float) -> float:
        """The momentum for an update (or a buffer's mean) of ``steps`` local steps."""
        ref = self.reference_steps
        if ref is None or steps <= ref:
            return self.momentum
        return self.momentum ** (steps / ref)

    def _momentum_like(self, params: torch.Tensor) -> torch.Tensor:
        if self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(params)
        return self.momentum_buffer

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffer": self.momentum_buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum_buffer = self._buffer(state, "momentum_buffer")


class OuterSGDMomentum(MomentumOptimizer):
    """Heavy-ball: m ← β·m + g; θ ← θ − ε·m (``torch.optim.SGD(momentum=β)``)."""

    name = "sgd_momentum"

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        _check_vectors(params, pseudo_gradient)
        m = self._momentum_like(params)
        m.mul_(self.beta(steps)).add_(pseudo_gradient)
        params.add_(m, alpha=-self.lr * lr_scale)
        return OuterStepInfo(True, "sgd-momentum step")


class OuterNesterov(MomentumOptimizer):
    """DiLoCo's outer optimizer: m ← β·m + g; θ ← θ − ε·(β·m + g).

    Identical to ``torch.optim.SGD(lr=ε, momentum=β, nesterov=True, dampening=0)``; in the
    asynchronous setting ("Async. DiLoCo") every arrival is one such step.
    """

    name = "nesterov"

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        _check_vectors(params, pseudo_gradient)
        m = self._momentum_like(params)
        beta = self.beta(steps)
        m.mul_(beta).add_(pseudo_gradient)
        params.add_(pseudo_gradient + beta * m, alpha=-self.lr * lr_scale)
        return OuterStepInfo(True, "nesterov step")


class OuterAdam(OuterOptimizer):
    """Outer Adam (bias-corrected, no weight decay), matching ``torch.optim.Adam``."""

    name = "adam"
    SETTINGS: tuple[str, ...] = ("lr", "betas", "eps")

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(lr)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"adam betas must be in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.steps = 0

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        _check_vectors(params, pseudo_gradient)
        if self.exp_avg is None or self.exp_avg_sq is None:
            self.exp_avg = torch.zeros_like(params)
            self.exp_avg_sq = torch.zeros_like(params)
        beta1, beta2 = self.betas
        self.steps += 1
        self.exp_avg.lerp_(pseudo_gradient, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(pseudo_gradient, pseudo_gradient, value=1 - beta2)
        bias1 = 1 - beta1**self.steps
        bias2 = 1 - beta2**self.steps
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        params.addcdiv_(self.exp_avg, denom, value=-self.lr * lr_scale / bias1)
        return OuterStepInfo(True, "adam step")

    def state_dict(self) -> dict[str, Any]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exp_avg = self._buffer(state, "exp_avg")
        self.exp_avg_sq = self._buffer(state, "exp_avg_sq")
        self.steps = int(state.get("steps", 0))


class DelayedNesterov(MomentumOptimizer):
    """Delayed Nesterov, paper Algorithm 3 (buffer size N, momentum activation c ∈ [0, 1/N]).

    ::

        Δ ← Δ + g
        if (t + 1) mod N == 0:
            m ← β·m + Δ/N
            θ ← θ − ε·((1 − c·N + c)·β·m + g/N)
            Δ ← 0
        else:
            θ ← θ − ε·(c·β·m + g/N)           # m unchanged
        t ← t + 1

    The N-th arrival applies only its own g/N plus the momentum term: the buffer Δ feeds m,
    never θ directly (θ already received every g/N as it arrived).
    """

    name = "delayed_nesterov"
    SETTINGS: tuple[str, ...] = ("lr", "momentum", "buffer_size", "activation", "reference_steps")

    def __init__(
        self, lr: float, momentum: float, buffer_size: int, activation: float = 0.0, reference_steps: int | None = None
    ) -> None:
        super().__init__(lr, momentum, reference_steps)
        if buffer_size < 1:
            raise ValueError(f"delayed nesterov buffer_size N must be >= 1, got {buffer_size}")
        if not 0.0 <= activation <= 1.0 / buffer_size + 1e-12:
            raise ValueError(
                f"momentum activation c must be in [0, 1/N] = [0, {1.0 / buffer_size:g}], got {activation}"
            )
        self.buffer_size = int(buffer_size)
        self.activation = float(activation)
        self.buffer: torch.Tensor | None = None
        self.arrivals = 0  # t in Algorithm 3
        self.buffered_steps: float = 0.0  # local steps of the arrivals in Δ (the momentum step's β, ``beta``)

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        _check_vectors(params, pseudo_gradient)
        m = self._momentum_like(params)
        if self.buffer is None:
            self.buffer = torch.zeros_like(params)
        n, c, beta = self.buffer_size, self.activation, self.momentum
        lr = self.lr * lr_scale
        self.buffer.add_(pseudo_gradient)
        self.buffered_steps += steps
        if (self.arrivals + 1) % n == 0:
            beta = self.beta(self.buffered_steps / n)
            self.buffered_steps = 0
            m.mul_(beta).add_(self.buffer, alpha=1.0 / n)
            params.add_(pseudo_gradient, alpha=-lr / n).add_(m, alpha=-lr * (1 - c * n + c) * beta)
            self.buffer.zero_()
            reason = f"delayed-nesterov momentum step (arrival {self.arrivals + 1}, every {n})"
        else:
            params.add_(pseudo_gradient, alpha=-lr / n)
            if c > 0:
                params.add_(m, alpha=-lr * c * beta)
            reason = f"delayed-nesterov gradient step (buffered {(self.arrivals + 1) % n}/{n})"
        self.arrivals += 1
        return OuterStepInfo(True, reason)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffer": self.momentum_buffer, "buffer": self.buffer, "arrivals": self.arrivals,
                "buffered_steps": self.buffered_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer = self._buffer(state, "buffer")
        self.arrivals = int(state.get("arrivals", 0))
        self.buffered_steps = float(state.get("buffered_steps", 0))


class AsyncBuffer(OuterNesterov):
    """Async Buffer / FedBuff (paper §4): average N arrivals FIFO, then one Nesterov step.

    With N = k and a barrier (every worker waits for all, i.e. an infinite grace period) this is
    exactly synchronous DiLoCo, which is how the simulator runs sync DiLoCo.
    """

    name = "async_buffer"
    SETTINGS: tuple[str, ...] = ("lr", "momentum", "buffer_size", "reference_steps")

    def __init__(self, lr: float, momentum: float, buffer_size: int, reference_steps: int | None = None) -> None:
        super().__init__(lr, momentum, reference_steps)
        if buffer_size < 1:
            raise ValueError(f"async buffer size N must be >= 1, got {buffer_size}")
        self.buffer_size = int(buffer_size)
        self.buffer: torch.Tensor | None = None
        self.buffered = 0
        self.buffered_lr_scale = 0.0
        self.buffered_steps: float = 0.0

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, lr_scale: float = 1.0, steps: float = 0
    ) -> OuterStepInfo:
        _check_vectors(params, pseudo_gradient)
        if self.buffer is None:
            self.buffer = torch.zeros_like(params)
        self.buffer.add_(pseudo_gradient)
        self.buffered += 1
        self.buffered_lr_scale += lr_scale
        self.buffered_steps += steps
        if self.buffered < self.buffer_size:
            return OuterStepInfo(False, f"buffered {self.buffered}/{self.buffer_size}")
        return self._step_on_mean(params)

    def flush(self, params: torch.Tensor) -> OuterStepInfo | None:
        """One Nesterov step on the mean of the arrivals buffered so far (fewer than N).

        The coordinator calls this when a sync round ends with some of its leases given back, so
        that the next round's pseudo-gradients are never averaged into this round's step.
        """
        if self.buffered == 0:
            return None
        assert self.buffer is not None  # set by the first step(), and buffered > 0
        _check_vectors(params, self.buffer)
        return self._step_on_mean(params)

    def _step_on_mean(self, params: torch.Tensor) -> OuterStepInfo:
        assert self.buffer is not None and self.buffered > 0
        count = self.buffered
        mean = self.buffer.div_(count)
        scale = self.buffered_lr_scale / count
        super().step(params, mean, lr_scale=scale, steps=self.buffered_steps / count)
        self.buffer.zero_()
        self.buffered = 0
        self.buffered_lr_scale = 0.0
        self.buffered_steps = 0
        return OuterStepInfo(True, f"nesterov step on the mean of {count} buffered pseudo-gradients")

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum_buffer": self.momentum_buffer,
            "buffer": self.buffer,
            "buffered": self.buffered,
            "buffered_lr_scale": self.buffered_lr_scale,
            "buffered_steps": self.buffered_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer = self._buffer(state, "buffer")
        self.buffered = int(state.get("buffered", 0))
        self.buffered_lr_scale = float(state.get("buffered_lr_scale", 0.0))
        self.buffered_steps = float(state.get("buffered_steps", 0))
