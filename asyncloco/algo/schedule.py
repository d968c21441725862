"""Per-shard inner learning-rate schedule, paper Eq. 3 and §3.

Each shard has its own step counter t (= local updates already done on that shard). Linear
warmup η_t = t·η_max/t_warmup for t < t_warmup (so η_0 = 0, exactly as the paper writes it), then
cosine from η_max down to η_min over ``total_steps − warmup_steps``. The cosine progress is clamped
into [0, 1] and η_min > 0 is required, so a shard that runs past T keeps learning at η_min
(paper §3). See docs/algorithm.md §5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ShardSchedule"]


@dataclass(frozen=True)
class ShardSchedule:
    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if not self.peak_lr > 0:
            raise ValueError(f"peak inner lr must be > 0, got {self.peak_lr}")
        if not 0 < self.min_lr <= self.peak_lr:
            raise ValueError(
                f"min inner lr must be in (0, peak_lr={self.peak_lr}], got {self.min_lr}; "
                "it must stay > 0 so shards that run past total_steps still learn"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )

    def lr(self, step: int) -> float:
        """Learning rate of the shard's ``step``-th local update (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return self.min_lr + 0.5 * (self.peak_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
