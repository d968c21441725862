"""DyLU (Eq. 6, §7.4), shard sampling (Eq. 2, §4) and the per-shard LR schedule (Eq. 3, §5)."""

from __future__ import annotations

import math

import pytest

from asyncloco.algo.dylu import dylu_steps, ema
from asyncloco.algo.sampler import sample_shard, shard_probabilities
from asyncloco.algo.schedule import ShardSchedule

pytestmark = pytest.mark.timeout(30)


# ------------------------------------------------------------------------------ DyLU


def test_dylu_paper_example() -> None:
    speeds = {"a": 1.0, "b": 0.5, "c": 0.25}
    assert [dylu_steps(speeds, p, 100) for p in "abc"] == [100, 50, 25]


def test_dylu_is_in_throughput_units_and_floors() -> None:
    # tokens/s: 3000, 2000, 1000 → 20·(2/3) = 13.33 → 13, 20·(1/3) = 6.67 → 6
    speeds = {"a": 3000.0, "b": 2000.0, "c": 1000.0}
    assert [dylu_steps(speeds, p, 20) for p in "abc"] == [20, 13, 6]
    # exact ratios must not lose a step to float noise: 0.7/1.0·10 = 6.9999999… in binary
    assert dylu_steps({"a": 1.0, "b": 0.7}, "b", 10) == 7
    assert dylu_steps({"a": 3.0, "b": 0.3}, "b", 100) == 10


def test_dylu_min_steps_floor() -> None:
    speeds = {"fast": 100.0, "slow": 1.0}
    assert dylu_steps(speeds, "slow", 20) == 1  # floor(0.2) = 0 → default min 1
    assert dylu_steps(speeds, "slow", 20, min_steps=5) == 5
    assert dylu_steps(speeds, "fast", 20, min_steps=5) == 20


def test_dylu_max_is_over_the_given_peers_only() -> None:
    speeds = {"a": 1.0, "b": 0.5, "c": 0.25}
    without_a = {k: v for k, v in speeds.items() if k != "a"}
    assert [dylu_steps(without_a, p, 100) for p in "bc"] == [100, 50]


def test_dylu_errors() -> None:
    with pytest.raises(ValueError, match="no speed known"):
        dylu_steps({"a": 1.0}, "ghost", 10)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive finite"):
            dylu_steps({"a": 1.0, "b": bad}, "a", 10)
    with pytest.raises(ValueError, match="max_steps"):
        dylu_steps({"a": 1.0}, "a", 0)
    with pytest.raises(ValueError, match="min_steps"):
        dylu_steps({"a": 1.0}, "a", 10, min_steps=11)
    with pytest.raises(ValueError, match="min_steps"):
        dylu_steps({"a": 1.0}, "a", 10, min_steps=0)


def test_ema() -> None:
    assert ema(None, 7.0, 0.9) == 7.0
    assert ema(10.0, 20.0, 0.75) == pytest.approx(12.5, rel=1e-15)
    with pytest.raises(ValueError):
        ema(1.0, 2.0, 1.0)


# ------------------------------------------------------------------------------ sampler (Eq. 2)


def test_shard_probabilities_hand_case() -> None:
    # sizes (1, 1, 2) → fractions (.25, .25, .5); progress (1, 0, 1) → (.5, 0, .5)
    # raw p = (max(-.25, 0), .25, 0) → all mass on shard 1
    assert shard_probabilities([1, 1, 2], [1, 0, 1]) == pytest.approx([0.0, 1.0, 0.0], abs=1e-12)
    # sizes (2, 1, 1) → (.5, .25, .25); progress (0, 1, 3) → (0, .25, .75): p = (.5, 0, 0)
    assert shard_probabilities([2, 1, 1], [0, 1, 3]) == pytest.approx([1.0, 0.0, 0.0], abs=1e-12)
    # sizes (1, 1, 1, 1); progress (2, 1, 1, 0): fractions .25 − (.5, .25, .25, 0) → (0, 0, 0, .25)
    assert shard_probabilities([1, 1, 1, 1], [2, 1, 1, 0]) == pytest.approx([0, 0, 0, 1], abs=1e-12)
    # sizes (3, 1); progress (1, 1): (.75 − .5, .25 − .5) = (.25, 0)
    assert shard_probabilities([3, 1], [1, 1]) == pytest.approx([1.0, 0.0], abs=1e-12)
    # two positive terms: sizes (2, 1, 1), progress (1, 0, 3): (.5 − .25, .25 − 0, .25 − .75) = (.25, .25, 0)
    assert shard_probabilities([2, 1, 1], [1, 0, 3]) == pytest.approx([0.5, 0.5, 0.0], abs=1e-12)
    # unequal mix: sizes (5, 3, 2), progress (1, 1, 8): (.5 − .1, .3 − .1, .2 − .8) = (.4, .2, 0) → (2/3, 1/3, 0)
    assert shard_probabilities([5, 3, 2], [1, 1, 8]) == pytest.approx([2 / 3, 1 / 3, 0.0], abs=1e-12)


def test_no_progress_targets_the_size_share() -> None:
    """Σn = 0: the formula's limit p_i = |D_i|/Σ|D| (the paper's target share), not uniform."""
    assert shard_probabilities([10, 20, 30], [0, 0, 0]) == pytest.approx([1 / 6, 1 / 3, 1 / 2], abs=1e-12)
    assert shard_probabilities([7, 7], [0, 0]) == pytest.approx([0.5, 0.5], abs=1e-12)
    # inverse CDF over (1/6, 1/3, 1/2): boundaries at 1/6 and 1/2
    assert [sample_shard([10, 20, 30], [0, 0, 0], u) for u in (0.0, 0.16, 0.17, 0.49, 0.5, 0.99)] == [0, 0, 1, 1, 2, 2]


def test_perfect_balance_targets_the_size_share() -> None:
    # progress exactly proportional to size: every p_i = 0 → the size share again
    assert shard_probabilities([10, 20, 30], [1, 2, 3]) == pytest.approx([1 / 6, 1 / 3, 1 / 2], abs=1e-12)
    # Σn = 0 with an empty shard: the empty one gets nothing
    assert shard_probabilities([10, 0, 30], [0, 0, 0]) == pytest.approx([0.25, 0.0, 0.75], abs=1e-12)


def test_zero_size_shard_is_never_sampled() -> None:
    sizes, progress = [4, 0, 4], [3, 0, 1]
    probabilities = shard_probabilities(sizes, progress)
    assert probabilities == pytest.approx([0.0, 0.0, 1.0], abs=1e-12)
    grid = [i / 1000 for i in range(1000)]
    assert {sample_shard(sizes, [0, 0, 0], u) for u in grid} == {0, 2}
    assert {sample_shard(sizes, progress, u) for u in grid} == {2}


def test_sample_shard_is_inverse_cdf() -> None:
    sizes, progress = [5, 3, 2], [1, 1, 8]  # probabilities (2/3, 1/3, 0)
    assert sample_shard(sizes, progress, 0.0) == 0
    assert sample_shard(sizes, progress, 0.66) == 0
    assert sample_shard(sizes, progress, 0.67) == 1
    assert sample_shard(sizes, progress, math.nextafter(1.0, 0.0)) == 1  # never the zero-probability shard
    uniform = [1, 1, 1, 1]
    assert [sample_shard(uniform, [0, 0, 0, 0], u) for u in (0.0, 0.24, 0.25, 0.5, 0.74, 0.99)] == [0, 0, 1, 2, 2, 3]


def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match="u must be"):
        sample_shard([1, 1], [0, 0], 1.0)
    with pytest.raises(ValueError, match="u must be"):
        sample_shard([1, 1], [0, 0], -0.1)
    with pytest.raises(ValueError, match="at least one"):
        shard_probabilities([], [])
    with pytest.raises(ValueError, match="progress counters"):
        shard_probabilities([1, 2], [0])
    with pytest.raises(ValueError, match=">= 0"):
        shard_probabilities([1, -2], [0, 0])
    with pytest.raises(ValueError, match="empty"):
        shard_probabilities([0, 0], [0, 0])


# ------------------------------------------------------------------------------ schedule (Eq. 3)


def test_warmup_is_eq3_exactly() -> None:
    """Eq. 3: η_t = t·η_max/t_warmup for t < t_warmup — η_0 = 0, η at warmup−1 below the peak."""
    schedule = ShardSchedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=4, total_steps=14)
    assert schedule.lr(0) == 0.0
    assert schedule.lr(1) == pytest.approx(2.5e-4, rel=1e-12)
    assert [schedule.lr(t) for t in range(4)] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4], rel=1e-12, abs=0)
    assert schedule.lr(3) == pytest.approx(1e-3 * 3 / 4, rel=1e-12)  # t = warmup − 1
    assert schedule.lr(4) == 1e-3  # t = warmup: the cosine starts exactly at the peak
    long = ShardSchedule(peak_lr=0.5, min_lr=0.05, warmup_steps=1000, total_steps=5000)
    assert (long.lr(0), long.lr(1), long.lr(999), long.lr(1000)) == (0.0, 0.5 / 1000, 0.5 * 999 / 1000, 0.5)


def test_cosine_midpoint_end_and_clamp() -> None:
    schedule = ShardSchedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=4, total_steps=14)
    assert schedule.lr(9) == pytest.approx((1e-3 + 1e-4) / 2, rel=1e-12)  # halfway through 10 cosine steps
    # a quarter of the way: η_min + (η_max − η_min)·(1 + cos(π/4))/2 — the cosine shape, not a line
    quarter = ShardSchedule(peak_lr=1.0, min_lr=0.2, warmup_steps=0, total_steps=8)
    assert quarter.lr(2) == pytest.approx(0.2 + 0.8 * (1 + math.sqrt(0.5)) / 2, rel=1e-12)
    assert schedule.lr(14) == pytest.approx(1e-4, rel=1e-12)
    for past in (15, 100, 10_000):
        assert schedule.lr(past) == pytest.approx(1e-4, rel=1e-12)
        assert schedule.lr(past) > 0


def test_no_warmup_starts_at_peak() -> None:
    schedule = ShardSchedule(peak_lr=2.0, min_lr=1.0, warmup_steps=0, total_steps=2)
    assert [schedule.lr(t) for t in range(4)] == pytest.approx([2.0, 1.5, 1.0, 1.0], rel=1e-12)


def test_schedule_errors() -> None:
    with pytest.raises(ValueError, match="stay > 0"):
        ShardSchedule(peak_lr=1e-3, min_lr=0.0, warmup_steps=0, total_steps=10)
    with pytest.raises(ValueError, match="min inner lr"):
        ShardSchedule(peak_lr=1e-3, min_lr=2e-3, warmup_steps=0, total_steps=10)
    with pytest.raises(ValueError, match="peak"):
        ShardSchedule(peak_lr=0.0, min_lr=1e-4, warmup_steps=0, total_steps=10)
    with pytest.raises(ValueError, match="must exceed warmup"):
        ShardSchedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="warmup_steps"):
        ShardSchedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=-1, total_steps=10)
    with pytest.raises(ValueError, match="step must be"):
        ShardSchedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=0, total_steps=10).lr(-1)
