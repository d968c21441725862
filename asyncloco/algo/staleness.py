"""Staleness-aware transforms applied to a pseudo-gradient before the outer optimizer sees it.

staleness = v_now − base_version (ElasticDL's definition): how many updates were applied to θ
since the peer downloaded its starting point.

Each transform returns an :class:`Adjustment`: the (possibly rescaled) pseudo-gradient, or
``None`` to drop the update, plus a learning-rate multiplier and a reason. They compose in
order. None of them touches θ.

* :class:`PolyDiscount`: g ← (1 + s)^−a · g (paper §4 "Poly", a = 0.5); with ``max_staleness`` it is
  "PolyThres" (drop updates with s > 10).
* :class:`DelayCompensation`: g ← g + λ·g⊙g⊙(θ_now − θ_base) (Zheng et al. 2017, applied to
  pseudo-gradients as in paper §4). ``groups`` turns it into AsyncLM's parameter-group variant
  (AGC), see the class docstring.
* :class:`StalenessLR`: ElasticDL's ε/s when s > 0.
* :class:`AsyncAwareLR`: AsyncLM's AALR, ε·min(1, τ_thresh/τ̄) with τ̄ the mean staleness of the
  last ``window`` arrivals.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = [
    "Adjustment",
    "StalenessTransform",
    "PolyDiscount",
    "DelayCompensation",
    "StalenessLR",
    "AsyncAwareLR",
    "OuterWarmup",
    "apply_transforms",
]


@dataclass(frozen=True)
class Adjustment:
    pseudo_gradient: torch.Tensor | None  # None: drop this update
    lr_scale: float
    reason: str


class StalenessTransform(ABC):
    name: str = "transform"
    #: the constructor's arguments, kept as attributes of the same names (:meth:`settings`)
    SETTINGS: tuple[str, ...] = ()
    #: True when the transform needs θ at the update's base version (the coordinator then keeps it).
    needs_base_params: bool = False

    @abstractmethod
    def adjust(
        self,
        pseudo_gradient: torch.Tensor,
        staleness: int,
        params_now: torch.Tensor,
        params_base: torch.Tensor | None,
    ) -> Adjustment: ...

    def drops(self, staleness: int) -> bool:
        """Whether :meth:`adjust` drops every update of this staleness (without adjusting anything)."""
        return False

    def settings(self) -> dict[str, Any]:
        """The hyper-parameters, as constructor arguments: ``type(self)(**settings())`` is this transform without its
        state. A coordinator snapshot records them (coordinator/logic/state.py ``decision_record``)."""
        return {name: getattr(self, name) for name in self.SETTINGS}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PolyDiscount(StalenessTransform):
    """g ← (1 + s)^−exponent · g; drop when s > max_staleness (PolyThres) if that is set."""

    name = "poly"
    SETTINGS: tuple[str, ...] = ("exponent", "max_staleness")

    def __init__(self, exponent: float = 0.5, max_staleness: int | None = None) -> None:
        if exponent < 0:
            raise ValueError(f"poly exponent must be >= 0, got {exponent}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"poly max_staleness must be >= 0, got {max_staleness}")
        self.exponent = float(exponent)
        self.max_staleness = max_staleness

    def drops(self, staleness: int) -> bool:
        return self.max_staleness is not None and staleness > self.max_staleness

    def adjust(
        self,
        pseudo_gradient: torch.Tensor,
        staleness: int,
        params_now: torch.Tensor,
        params_base: torch.Tensor | None,
    ) -> Adjustment:
        if self.drops(staleness):
            return Adjustment(None, 1.0, f"dropped: staleness {staleness} > threshold {self.max_staleness}")
        weight = (1.0 + staleness) ** -self.exponent
        return Adjustment(pseudo_gradient * weight, 1.0, f"poly weight {weight:.4g} at staleness {staleness}")


class DelayCompensation(StalenessTransform):
    """g ← g + λ·g⊙g⊙(θ_now − θ_base).

    With ``groups`` (a list of ``(start, stop)`` slices of the flat vector, e.g. one per
    parameter tensor), λ is normalised per group by the running mean of g² in that group
    (EMA with ``ema``), so that each group's correction has the same relative size whatever the
    scale of its pseudo-gradients — our reading of AsyncLM's parameter-group compensation (AGC),
    whose exact estimator the summary does not give.

    ``cap`` bounds each coordinate's correction by ``cap``·|g_i| (None: unbounded). The correction is a
    first-order Taylor term of the gradient around θ_base; one larger than the gradient itself is outside
    the region where that expansion means anything, and with the group normalisation it feeds on its own
    earlier over-corrections until θ diverges (docs/algorithm.md §2). With cap = 1 a corrected coordinate
    stays between 0 and 2·g_i: it never flips the update's sign. Without the normalisation the correction
    is far below |g| and the cap never binds (the result is bit-identical).
    """

    name = "delay_compensation"
    SETTINGS: tuple[str, ...] = ("strength", "groups", "ema", "cap")
    needs_base_params = True

    def __init__(
        self,
        strength: float,
        groups: Sequence[tuple[int, int]] | None = None,
        ema: float = 0.99,
        cap: float | None = 1.0,
    ) -> None:
        if strength < 0:
            raise ValueError(f"delay compensation strength λ must be >= 0, got {strength}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"delay compensation ema must be in [0, 1), got {ema}")
        if cap is not None and not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"delay compensation cap must be a positive number (× |g|) or None, got {cap}")
        self.cap = None if cap is None else float(cap)
        self.strength = float(strength)
        self.groups = [(int(a), int(b)) for a, b in groups] if groups else None
        self.ema = float(ema)
        self.group_sq: list[float] = [0.0] * len(self.groups) if self.groups else []
        self.updates = 0

    def adjust(
        self,
        pseudo_gradient: torch.Tensor,
        staleness: int,
        params_now: torch.Tensor,
        params_base: torch.Tensor | None,
    ) -> Adjustment:
        if staleness == 0:
            return Adjustment(pseudo_gradient, 1.0, "no delay to compensate")
        if params_base is None:
            raise ValueError("delay compensation needs θ at the update's base version")
        drift = params_now - params_base
        correction = pseudo_gradient * pseudo_gradient * drift
        if self.groups is None:
            return Adjustment(
                pseudo_gradient + self._capped(self.strength * correction, pseudo_gradient), 1.0,
                f"delay-compensated, λ={self.strength}",
            )
        out = pseudo_gradient.clone()
        self.updates += 1
        for index, (start, stop) in enumerate(self.groups):
            mean_sq = float(pseudo_gradient[start:stop].square().mean())
            self.group_sq[index] = self.ema * self.group_sq[index] + (1 - self.ema) * mean_sq
            debiased = self.group_sq[index] / (1 - self.ema**self.updates)
            scale = self.strength / debiased if debiased > 0 else 0.0
            out[start:stop].add_(self._capped(correction[start:stop] * scale, pseudo_gradient[start:stop]))
        return Adjustment(out, 1.0, f"group delay-compensated over {len(self.groups)} groups")

    def _capped(self, correction: torch.Tensor, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        if self.cap is None:
            return correction
        bound = pseudo_gradient.abs() * self.cap
        return torch.minimum(torch.maximum(correction, -bound), bound)

    def state_dict(self) -> dict[str, Any]:
        return {"group_sq": list(self.group_sq), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_sq = [float(x) for x in state.get("group_sq", self.group_sq)]
        self.updates = int(state.get("updates", 0))


class StalenessLR(StalenessTransform):
    """ElasticDL's staleness-modulated learning rate: ε/s when s > 0, ε otherwise."""

    name = "staleness_lr"

    def adjust(
        self,
        pseudo_gradient: torch.Tensor,
        staleness: int,
        params_now: torch.Tensor,
        params_base: torch.Tensor | None,
    ) -> Adjustment:
        scale = 1.0 / staleness if staleness > 0 else 1.0
        return Adjustment(pseudo_gradient, scale, f"lr × {scale:.4g} for staleness {staleness}")


class AsyncAwareLR(StalenessTransform):
    """AsyncLM's AALR: ε·min(1, τ_thresh/τ̄), τ̄ = mean staleness of the last ``window`` arrivals."""

    name = "async_aware_lr"
    SETTINGS: tuple[str, ...] = ("threshold", "window")

    def __init__(self, threshold: float, window: int = 16) -> None:
        if threshold <= 0:
            raise ValueError(f"async-aware lr threshold must be > 0, got {threshold}")
        if window < 1:
            raise ValueError(f"async-aware lr window must be >= 1, got {window}")
        self.threshold = float(threshold)
        self.window = int(window)
        self.recent: deque[int] = deque(maxlen=self.window)

    def adjust(
        self,
        pseudo_gradient: torch.Tensor,
        staleness: int,
        params_now: torch.Tensor,
        params_base: torch.Tensor | None,
    ) -> Adjustment:
        self.recent.append(int(staleness))
        mean = sum(self.recent) / len(self.recent)
        scale = 1.0 if mean <= 0 else min(1.0, self.threshold / mean)
        return Adjustment(pseudo_gradient, scale, f"lr × {scale:.4g} (recent mean staleness {mean:.3g})")

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque((int(x) for x in state.get("recent", [])), maxlen=self.window)


class OuterWarmup(StalenessTransform):
    """Outer-lr warm-up (not in the paper; off by default): ε·min(1, a/W) for the a-th arrival (1-based).

    The first outer steps of a run meet a momentum that has not averaged anything yet and pseudo-gradients
    from a model far from any optimum; this ramps the outer lr linearly over the first ``arrivals`` updates.
    Used by the simulator's experiment table (``python -m asyncloco.sim.reproduce --table 5``)."""

    name = "outer_warmup"
    SETTINGS: tuple[str, ...] = ("arrivals",)

    def __init__(self, arrivals: int) -> None:
        if arrivals < 1:
            raise ValueError(f"outer warm-up needs at least 1 arrival, got {arrivals}")
        self.arrivals = int(arrivals)
        self.seen = 0

    def adjust(
        self,
        pseudo_gradient: torch.Tensor,
        staleness: int,
        params_now: torch.Tensor,
        params_base: torch.Tensor | None,
    ) -> Adjustment:
        self.seen += 1
        scale = min(1.0, self.seen / self.arrivals)
        return Adjustment(pseudo_gradient, scale, f"outer warm-up: lr × {scale:.4g} (arrival {self.seen})")

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = int(state.get("seen", 0))


def apply_transforms(
    transforms: Sequence[StalenessTransform],
    pseudo_gradient: torch.Tensor,
    staleness: int,
    params_now: torch.Tensor,
    params_base: torch.Tensor | None,
) -> Adjustment:
    """Run ``transforms`` in order; the lr multipliers multiply, a drop stops the chain."""
    lr_scale = 1.0
    reasons: list[str] = []
    current = pseudo_gradient
    for transform in transforms:
        result = transform.adjust(current, staleness, params_now, params_base)
        reasons.append(result.reason)
        if result.pseudo_gradient is None:
            return Adjustment(None, 0.0, "; ".join(reasons))
        current = result.pseudo_gradient
        lr_scale *= result.lr_scale
    if not math.isfinite(lr_scale):
        raise AssertionError(f"non-finite lr scale {lr_scale}")
    return Adjustment(current, lr_scale, "; ".join(reasons) if reasons else "no staleness transform")
