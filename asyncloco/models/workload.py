"""The seam between "what is trained" and "how it is scheduled".

A :class:`Workload` owns a model architecture, its data (split into shards) and its evaluation.
The simulator, the peers and the coordinator only see flat parameter vectors, shard sizes and
``(shard, start_offset, steps)`` leases; the workload turns those into real batches.

Contract:

* ``build_model(seed)`` is deterministic: same seed → bit-identical parameters.
* ``shard_sizes()`` counts *batches* (local steps) available in each shard per epoch.
* ``batch(shard, index)`` returns the ``index``-th batch of the shard, deterministically; indices
  past the shard size wrap to the next epoch (a fresh, seeded permutation per epoch) so a lease
  identifies exactly which examples are trained and two leases of disjoint index ranges within
  one epoch never share an example.
* ``loss(model, batch)`` is the training loss; ``evaluate(model)`` returns held-out metrics, at
  least ``{"loss": ...}`` (LM workloads add ``"perplexity"``, classification adds ``"accuracy"``).
* ``units_per_step`` is how many tokens (LM) or samples (classification) one step consumes, the
  unit in which peers report their throughput for DyLU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

__all__ = ["Workload", "flatten_params", "load_flat_params", "param_groups"]


class Workload(ABC):
    name: str = "workload"
    units_per_step: int = 1

    @abstractmethod
    def build_model(self, seed: int) -> nn.Module: ...

    @abstractmethod
    def shard_sizes(self) -> list[int]: ...

    @abstractmethod
    def batch(self, shard: int, index: int) -> Any: ...

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]: ...


def flatten_params(model: nn.Module) -> torch.Tensor:
    """θ as one flat fp32 vector, in ``parameters()`` order (a copy)."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])


def load_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters (in place, no graph)."""
    expected = sum(p.numel() for p in model.parameters())
    if flat.dim() != 1 or flat.numel() != expected:
        raise ValueError(f"flat parameter vector has {flat.numel()} values, model needs {expected}")
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def param_groups(model: nn.Module) -> list[tuple[int, int]]:
    """(start, stop) of every parameter tensor inside the flat vector."""
    groups: list[tuple[int, int]] = []
    offset = 0
    for p in model.parameters():
        groups.append((offset, offset + p.numel()))
        offset += p.numel()
    return groups
