"""The paper's toy task (§6, reference notebook): a mixture of mixtures of Gaussians.

``classes`` classes, each a mixture of ``clusters_per_class`` Gaussian clusters in ``dim``
dimensions with isotropic noise; a one-hidden-layer MLP classifies the points. Everything is
generated from the seed with a private ``torch.Generator``, so the data set is bit-identical
across runs and machines with the same torch build.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncloco.models.config import ToyTaskConfig
from asyncloco.models.workload import Workload

__all__ = ["ToyWorkload"]


class ToyWorkload(Workload):
    name = "toy"

    def __init__(self, cfg: ToyTaskConfig) -> None:
        self.cfg = cfg
        self.units_per_step = cfg.batch_size
        gen = torch.Generator().manual_seed(cfg.seed)
        # Unit-norm cluster centres: with noise 0.5 per dimension the classes overlap, so the task
        # is learnable but not trivially separable (it keeps improving over thousands of steps).
        centers = torch.randn(cfg.classes, cfg.clusters_per_class, cfg.dim, generator=gen)
        centers = centers / centers.norm(dim=-1, keepdim=True)
        total = cfg.points + cfg.eval_points
        labels = torch.randint(0, cfg.classes, (total,), generator=gen)
        clusters = torch.randint(0, cfg.clusters_per_class, (total,), generator=gen)
        points = centers[labels, clusters] + cfg.noise * torch.randn(total, cfg.dim, generator=gen)
        self.train_x, self.train_y = points[: cfg.points], labels[: cfg.points]
        self.eval_x, self.eval_y = points[cfg.points :], labels[cfg.points :]
        order = torch.randperm(cfg.points, generator=gen) if cfg.iid else torch.argsort(self.train_y, stable=True)
        per_shard = cfg.points // cfg.num_shards
        self.shards = [order[i * per_shard : (i + 1) * per_shard] for i in range(cfg.num_shards)]
        self.batches_per_shard = per_shard // cfg.batch_size
        if self.batches_per_shard < 1:
            raise ValueError(
                f"task.points={cfg.points} gives {per_shard} points per shard, fewer than one batch of "
                f"{cfg.batch_size}; raise points or lower num_shards/batch_size"
            )
        self._epoch_perm: dict[tuple[int, int], torch.Tensor] = {}

    def build_model(self, seed: int) -> nn.Module:
        # nn.Linear's init draws from the global generator: fork it so building is side-effect free.
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = nn.Sequential(
                nn.Linear(self.cfg.dim, self.cfg.hidden), nn.ReLU(), nn.Linear(self.cfg.hidden, self.cfg.classes)
            )
        return model

    def shard_sizes(self) -> list[int]:
        return [self.batches_per_shard] * self.cfg.num_shards

    def _permutation(self, shard: int, epoch: int) -> torch.Tensor:
        key = (shard, epoch)
        if key not in self._epoch_perm:
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + shard * 10_007 + epoch)
            self._epoch_perm[key] = torch.randperm(len(self.shards[shard]), generator=gen)
        return self._epoch_perm[key]

    def batch_rows(self, shard: int, index: int) -> torch.Tensor:
        """Row indices into the training set of batch ``index`` of ``shard`` (epochs reshuffle the shard)."""
        if not 0 <= shard < len(self.shards):
            raise ValueError(f"shard {shard} out of range [0, {len(self.shards)})")
        epoch, within = divmod(index, self.batches_per_shard)
        b = self.cfg.batch_size
        return self.shards[shard][self._permutation(shard, epoch)[within * b : (within + 1) * b]]

    def batch(self, shard: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.batch_rows(shard, index)
        return self.train_x[rows], self.train_y[rows]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        model.eval()
        logits = model(self.eval_x)
        loss = float(nn.functional.cross_entropy(logits, self.eval_y))
        accuracy = float((logits.argmax(-1) == self.eval_y).float().mean())
        return {"loss": loss, "accuracy": accuracy}
