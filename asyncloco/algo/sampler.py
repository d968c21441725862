"""Shard sampling, paper Eq. 2 (docs/algorithm.md §4).

p_i ∝ max(|D_i|/Σ|D_j| − n_i/Σn_j, 0), with n_i the local updates counted on shard i — *learned*
(applied) updates by default, as the paper counts them; the coordinator can count updates
*assigned* instead (``CoordinatorPolicy.shard_progress``).

Edge cases the paper leaves open, decided here (and pinned by tests):

* Σn_j = 0 (no progress yet): p_i ∝ |D_i|, the formula's natural limit (treat n_i/Σn_j as 0).
* Every p_i = 0 (progress exactly proportional to size, up to 1e-12): p_i ∝ |D_i| again.
* Shards of size 0 are never sampled; at least one shard must be non-empty.
* Randomness is received, never drawn: the caller passes ``u`` uniform in [0, 1), so the
  coordinator's choice is a pure function of (sizes, progress, u).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["shard_probabilities", "sample_shard"]


def shard_probabilities(sizes: Sequence[int], progress: Sequence[int]) -> list[float]:
    if len(sizes) == 0:
        raise ValueError("there must be at least one data shard")
    if len(sizes) != len(progress):
        raise ValueError(f"{len(sizes)} shard sizes but {len(progress)} progress counters")
    if any(s < 0 for s in sizes) or any(n < 0 for n in progress):
        raise ValueError("shard sizes and progress counters must be >= 0")
    total_size = sum(sizes)
    if total_size == 0:
        raise ValueError("every shard is empty; give the run some data")
    total_progress = sum(progress)
    weights = [0.0] * len(sizes)
    if total_progress > 0:
        weights = [
            max(size / total_size - n / total_progress, 0.0) if size > 0 else 0.0
            for size, n in zip(sizes, progress)
        ]
    norm = sum(weights)
    if norm <= 1e-12:
        return [size / total_size for size in sizes]
    return [w / norm for w in weights]


def sample_shard(sizes: Sequence[int], progress: Sequence[int], u: float) -> int:
    """Inverse-CDF draw of a shard index with ``u`` uniform in [0, 1)."""
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u must be in [0, 1), got {u}")
    probabilities = shard_probabilities(sizes, progress)
    cumulative = 0.0
    last_positive = 0
    for index, p in enumerate(probabilities):
        if p <= 0:
            continue
        last_positive = index
        cumulative += p
        if u < cumulative:
            return index
    return last_positive  # u within float error of 1
