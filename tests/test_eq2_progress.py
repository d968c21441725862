"""Eq. 2 in the coordinator: which n_i the sampler sees ("learned" by default, "assigned" as an option).

docs/algorithm.md §4. The draw u of the n-th lease is np.random.default_rng([seed, n]).random(), so
every choice below is recomputed exactly from the sampler's probabilities.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncloco.algo.outer import OuterSGD
from asyncloco.algo.sampler import sample_shard, shard_probabilities
from asyncloco.coordinator.logic import Assign, CoordinatorPolicy, RequestWork, SpeedReport, SubmitUpdate, handle, new_state

pytestmark = pytest.mark.timeout(30)

SIZES = [10, 30]


def _state(variant: str, seed: int = 0):
    policy = CoordinatorPolicy(max_local_steps=5, dylu=False, units_per_step=1, shard_progress=variant)  # type: ignore[arg-type]
    state = new_state(torch.zeros(2), OuterSGD(1.0), [], policy, SIZES, seed=seed)
    for peer in ("a", "b", "c"):
        handle(state, SpeedReport(peer, 1.0), 0.0)
    return state


def _u(seed: int, counter: int) -> float:
    return float(np.random.default_rng([seed, counter]).random())


def _lease(state, peer: str, now: float):
    (action,) = handle(state, RequestWork(peer), now)[1]
    assert isinstance(action, Assign)
    return action.lease


@pytest.mark.parametrize("seed", range(6))
def test_learned_counts_only_applied_updates(seed: int) -> None:
    state = _state("learned", seed)
    first = _lease(state, "a", 0.0)
    assert first.shard == sample_shard(SIZES, [0, 0], _u(seed, 0))  # no progress yet: p ∝ (10, 30)
    second = _lease(state, "b", 0.0)  # a's 5 steps are in flight, not learned: still p ∝ size
    assert second.shard == sample_shard(SIZES, [0, 0], _u(seed, 1))
    handle(state, SubmitUpdate("a", first.lease_id, first.base_version, torch.ones(2)), 5.0)
    learned = [0, 0]
    learned[first.shard] += 5  # applied: now it counts; b's lease still does not
    third = _lease(state, "a", 5.0)
    assert third.shard == sample_shard(SIZES, learned, _u(seed, 2))
    assert state.shards[first.shard].assigned + state.shards[1 - first.shard].assigned == 15  # lr counters: assigned


@pytest.mark.parametrize("seed", range(6))
def test_assigned_counts_leases_in_flight(seed: int) -> None:
    state = _state("assigned", seed)
    first = _lease(state, "a", 0.0)
    assert first.shard == sample_shard(SIZES, [0, 0], _u(seed, 0))
    progress = [0, 0]
    progress[first.shard] += 5
    second = _lease(state, "b", 0.0)
    assert second.shard == sample_shard(SIZES, progress, _u(seed, 1))


def test_assigned_variant_spreads_concurrent_leases() -> None:
    # after a lease of 5 on the small shard (10 of 40), "assigned" sends the next one to the big shard
    # for sure (p = (0, 1)); "learned" still draws it with p = (1/4, 3/4)
    assert shard_probabilities(SIZES, [5, 0]) == pytest.approx([0.0, 1.0], abs=1e-12)
    assert shard_probabilities(SIZES, [0, 0]) == pytest.approx([0.25, 0.75], abs=1e-12)
    seeds_where_first_is_small = [s for s in range(40) if sample_shard(SIZES, [0, 0], _u(s, 0)) == 0]
    assert seeds_where_first_is_small  # some seed puts the first lease on the small shard
    for seed in seeds_where_first_is_small:
        state = _state("assigned", seed)
        assert _lease(state, "a", 0.0).shard == 0
        assert _lease(state, "b", 0.0).shard == 1
