"""What a peer's torch.distributed group is, without running one: the rank's context, the group's failure, and how
a global batch splits over the ranks. The group's collectives live in peer/distributed.py; the inner trainer
(train/inner.py) needs only these, so both import this module and not each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GroupContext", "GroupFailed", "split_batch"]


class GroupFailed(RuntimeError):
    """A collective of the peer's group failed: a rank died or hung. The group cannot go on."""


@dataclass(frozen=True)
class GroupContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def split_batch(batch: Any, rank: int, world_size: int) -> Any:
    """Rank ``rank``'s equal block of rows of a batch (a tensor, or a tuple/list of tensors sharing dim 0)."""
    if isinstance(batch, torch.Tensor):
        rows = batch.shape[0]
        if rows % world_size:
            raise ValueError(
                f"the global batch of {rows} rows cannot be split evenly over {world_size} ranks; choose "
                f"--nproc-per-node dividing task.batch_size ({rows})"
            )
        size = rows // world_size
        return batch[rank * size : (rank + 1) * size]
    if isinstance(batch, (tuple, list)):
        return type(batch)(split_batch(part, rank, world_size) for part in batch)
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} across ranks")
