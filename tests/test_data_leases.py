"""Leases → exact training rows: deterministic, disjoint within an epoch, never shared across shards."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.lm import LMWorkload, build_lm_workload

SHARDS, BATCH, TRAIN_ROWS = 3, 4, 3 * 4 * 5 + 2  # 5 batches per shard, 2 rows left over per epoch


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("lm-cache"))


def _workload(cache_dir: str, **overrides) -> LMWorkload:
    fields = dict(seq_len=16, batch_size=BATCH, num_shards=SHARDS, max_train_sequences=TRAIN_ROWS,
                  val_sequences=6, seed=3, cache_dir=cache_dir)
    fields.update(overrides)
    return build_lm_workload(LMTaskConfig(**fields))


def test_shard_sizes_and_units(cache_dir) -> None:
    workload = _workload(cache_dir)
    assert workload.rows.shape == (TRAIN_ROWS + 6, 17)
    assert [len(ids) for ids in workload.shard_ids] == [21, 21, 20]
    assert workload.shard_sizes() == [5, 5, 5]
    assert workload.units_per_step == BATCH * 16
    assert workload.batch(1, 7).shape == (BATCH, 17) and workload.batch(1, 7).dtype == torch.int64


def test_batch_is_exactly_the_rows_named_by_the_lease(cache_dir) -> None:
    workload = _workload(cache_dir)
    ids = workload.lease_row_ids(shard=2, start_offset=1, steps=3)
    assert ids.shape == (3, BATCH)
    for j in range(3):
        assert torch.equal(workload.batch(2, 1 + j), workload.rows[ids[j]].long())
    rebuilt = _workload(cache_dir)  # another process / peer: same config → same rows
    assert torch.equal(rebuilt.lease_row_ids(2, 1, 3), ids)
    assert torch.equal(rebuilt.batch(2, 3), workload.batch(2, 3))


def test_leases_within_one_epoch_are_disjoint_and_stay_in_their_shard(cache_dir) -> None:
    workload = _workload(cache_dir)
    for shard in range(SHARDS):
        first = workload.lease_row_ids(shard, 0, 2).flatten()
        second = workload.lease_row_ids(shard, 2, 3).flatten()  # indices 2..4: the rest of epoch 0
        epoch = torch.cat([first, second])
        assert len(set(epoch.tolist())) == 5 * BATCH  # no row twice within the epoch
        assert set(epoch.tolist()) <= set(workload.shard_ids[shard].tolist())
    all_shards = [set(workload.lease_row_ids(s, 0, 5).flatten().tolist()) for s in range(SHARDS)]
    assert sum(len(s) for s in all_shards) == len(set.union(*all_shards)) == SHARDS * 5 * BATCH
    held_out = set(workload.val_ids.tolist())
    assert not held_out & set.union(*all_shards)


def test_indices_past_the_epoch_wrap_to_a_fresh_permutation(cache_dir) -> None:
    workload = _workload(cache_dir)
    epoch0 = workload.lease_row_ids(0, 0, 5).flatten()
    epoch1 = workload.lease_row_ids(0, 5, 5).flatten()
    assert len(set(epoch1.tolist())) == 5 * BATCH
    assert set(epoch1.tolist()) <= set(workload.shard_ids[0].tolist())
    assert not torch.equal(epoch0, epoch1)  # a new order, not a replay
    assert torch.equal(workload.lease_row_ids(0, 12, 1), workload.lease_row_ids(0, 12, 1))


def test_non_iid_shards_are_contiguous_runs_in_document_order(cache_dir) -> None:
    workload = _workload(cache_dir, iid=False)
    iid = _workload(cache_dir)
    assert torch.equal(workload.val_ids, iid.val_ids)
    train = torch.cat(workload.shard_ids)
    assert torch.equal(train, train.sort().values)
    assert max(workload.shard_ids[0]) < min(workload.shard_ids[1])


def test_bad_lease_arguments_are_explained(cache_dir) -> None:
    workload = _workload(cache_dir)
    with pytest.raises(ValueError, match="shards are 0..2"):
        workload.batch(3, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        workload.batch(0, -1)
