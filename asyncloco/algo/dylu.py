"""Dynamic Local Updates (DyLU), paper Eq. 6.

H_w = floor(v(w) / max_{w' alive} v(w') · H), clamped to at least ``min_steps``.

Speeds are throughputs in tokens (or samples) per second — not steps per second — so peers with
different batch sizes compare correctly. The max runs over the peers alive *now*: a departed
fastest peer no longer sets the scale.
"""

from __future__ import annotations

import math
from typing import Mapping

__all__ = ["dylu_steps", "ema"]

# Guards against float noise turning an exact ratio like 0.5 * 100 = 49.999999 into 49.
_FLOOR_EPS = 1e-9


def dylu_steps(speeds: Mapping[str, float], peer: str, max_steps: int, min_steps: int = 1) -> int:
    """Local steps for ``peer`` given every alive peer's throughput.

    Operating advice: ``max_steps`` is H, the steps of the fastest peer (the paper uses 50-150 for
    LMs); ``min_steps`` keeps very slow peers useful (the reference notebook used 5).
    """
    if max_steps < 1:
        raise ValueError(f"H (max_steps) must be >= 1, got {max_steps}")
    if min_steps < 1 or min_steps > max_steps:
        raise ValueError(f"min_steps must be in [1, H={max_steps}], got {min_steps}")
    if peer not in speeds:
        raise ValueError(f"no speed known for peer {peer!r}; it must report its throughput first")
    for name, speed in speeds.items():
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed of peer {name!r} must be a positive finite number, got {speed!r}")
    fastest = max(speeds.values())
    steps = math.floor(speeds[peer] / fastest * max_steps + _FLOOR_EPS)
    return max(min_steps, min(max_steps, steps))


def ema(previous: float | None, sample: float, decay: float) -> float:
    """Exponential moving average used to smooth reported speeds (decay in [0, 1))."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema decay must be in [0, 1), got {decay}")
    return sample if previous is None else decay * previous + (1.0 - decay) * sample
