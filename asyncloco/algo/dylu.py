"""Dynamic Local Updates (DyLU), paper Eq. 6.

H_w = floor(v(w) / max_{w' alive} v(w') · H), clamped to at least ``min_steps``.

Speeds are throughputs in tokens (or samples) per second — not steps per second — so peers with
different batch sizes compare correctly. The max runs over the peers alive *now*: a departed
fastest peer no longer sets the scale.
"""

from __future__ import annotations

import math
from typing import Mapping

__all__ = ["dylu_steps", "ema", "link_steps"]

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


ASK_AHEAD_MARGIN = 1.5
"""An overlapped peer asks for its next lease this many expected θ downloads before its training ends
(peer/pipeline.py ``ask_ahead_s``), and only once its previous update's ack is in (two leases at most): the lease in
training must cover the previous upload *and* that lead — t_up + ASK_AHEAD_MARGIN · t_down (:func:`pipeline_seconds`)."""


def pipeline_seconds(up_s: float, down_s: float) -> float:
    """What a lease's training must last for an overlapped peer never to wait: the previous update's upload, which
    starts with it, plus the lead of the next lease's request and θ download (:data:`ASK_AHEAD_MARGIN` downloads)."""
    return up_s + ASK_AHEAD_MARGIN * down_s


def link_steps(base_steps: int, transfer_s: float, step_s: float, cover: float, max_steps: int) -> int:
    """Lease steps sized to a peer's link (``schedule.local_steps: auto``, docs/algorithm.md):

        H = min(H_max, max(H_dylu, ceil(k · (t_up + m · t_down) / t_step)))

    ``base_steps`` (H_dylu) is what the method gives without links (DyLU's Eq. 6, or H), ``transfer_s`` the seconds
    the lease must cover per round (t_up + m · t_down, :func:`pipeline_seconds`, m = :data:`ASK_AHEAD_MARGIN`, from the
    peer's measured rates), ``step_s`` its seconds per local step
    (t_step = units per step / its speed), ``cover`` k (≥ 1: its computing lasts at least k × that) and
    ``max_steps`` H_max. Where transfers are negligible (k · transfer_s ≤ H_dylu · t_step) it is H_dylu: the paper's
    rule unchanged; otherwise long enough that the peer's compute covers its transfers, at most H_max, never fewer
    than H_dylu."""
    if base_steps < 1 or max_steps < 1:
        raise ValueError(f"steps must be >= 1, got base {base_steps}, max {max_steps}")
    if not (math.isfinite(transfer_s) and transfer_s >= 0 and math.isfinite(step_s) and step_s > 0 and cover > 0):
        return base_steps
    needed = math.ceil(cover * transfer_s / step_s - _FLOOR_EPS)
    return max(base_steps, min(max_steps, needed))


def ema(previous: float | None, sample: float, decay: float) -> float:
    """Exponential moving average used to smooth reported speeds (decay in [0, 1))."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema decay must be in [0, 1), got {decay}")
    return sample if previous is None else decay * previous + (1.0 - decay) * sample
