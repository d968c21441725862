"""Grace-period decisions, paper Algorithms 2, 4 and 5 (docs/algorithm.md §6).

Offline (the simulator's fake time): :func:`next_in_window` is Algorithm 5's ``get_worker``.
Online (the coordinator's real clock): :func:`hold_decision` says whether a peer asking for
its next lease is answered now or held until an update expected within the grace period has
been applied, so that peers finishing together start from the same θ (paper Fig. 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Completion", "next_in_window", "grace_windows", "HoldDecision", "hold_decision"]


@dataclass(frozen=True)
class Completion:
    worker: str
    completed_time: float


def next_in_window(
    unprocessed: Sequence[Completion], grace: float, window_start: float = math.inf
) -> Completion | None:
    """Earliest unprocessed completion if it falls in [window_start, window_start + grace].

    ``window_start`` is τ_sync: ∞ when no window is open, in which case the earliest completion
    always qualifies and opens the window. Ties in time break by worker name, deterministically.
    """
    if grace < 0:
        raise ValueError(f"grace period must be >= 0, got {grace}")
    if not unprocessed:
        return None
    earliest = min(unprocessed, key=lambda c: (c.completed_time, c.worker))
    if math.isinf(window_start) or earliest.completed_time - window_start <= grace:
        return earliest
    return None


def grace_windows(completions: Sequence[Completion], grace: float) -> list[list[Completion]]:
    """Algorithm 2's grouping of completions: the workers that restart together, window by window.

    Each window opens at its earliest completion τ_sync and takes every completion up to
    τ_sync + grace (inclusive); the first completion after that opens the next window. Windows
    never chain: with grace 0.5, completions at 10.0, 10.4 and 10.8 give [[10.0, 10.4], [10.8]]
    (paper Fig. 3: A and B restart from the same θ, C starts its own grace period).
    """
    pending = list(completions)
    windows: list[list[Completion]] = []
    window_start = math.inf
    current: list[Completion] = []
    while pending:
        nxt = next_in_window(pending, grace, window_start)
        if nxt is None:  # Algorithm 2 lines 17-20: everyone completed so far restarts; the window resets
            windows.append(current)
            current, window_start = [], math.inf
            continue
        pending.remove(nxt)
        current.append(nxt)
        window_start = min(window_start, nxt.completed_time)
    if current:
        windows.append(current)
    return windows


@dataclass(frozen=True)
class HoldDecision:
    hold_until: float | None  # None: answer now
    waiting_for: tuple[str, ...]  # leases whose updates the peer waits for
    reason: str


def hold_decision(now: float, expected_finishes: Iterable[tuple[str, float]], grace: float) -> HoldDecision:
    """Whether to hold a lease request at ``now``.

    ``expected_finishes`` lists (lease_id, expected completion time) of the *other* active
    leases. Hold while any of them is expected to finish within ``grace`` from now (or is already
    overdue but not later than ``now + grace``'s window); the runtime re-asks this function when
    one of those updates is applied, and answers at ``hold_until`` at the latest.
    """
    if grace < 0:
        raise ValueError(f"grace period must be >= 0, got {grace}")
    if grace == 0:
        return HoldDecision(None, (), "no grace period configured")
    deadline = now + grace
    soon = sorted((lease for lease, finish in expected_finishes if finish <= deadline))
    if not soon:
        return HoldDecision(None, (), f"no active lease expected to finish within {grace:g}s")
    return HoldDecision(
        deadline,
        tuple(soon),
        f"holding up to {grace:g}s for {len(soon)} lease(s) expected to finish within the grace period",
    )
