"""Language-model workload: packed token rows, shards, leases → batches, held-out perplexity.

A lease ``(shard, start_offset, steps)`` trains exactly the rows
``lease_row_ids(shard, start_offset, steps)``: batch ``index`` of a shard with ``n`` rows and
``b = n // batch_size`` batches per epoch is ``rows[shard_ids[perm_e[p*B : (p+1)*B]]]`` with
``e = index // b``, ``p = index % b`` and ``perm_e`` the shard's seeded permutation for epoch ``e``.
Two leases with disjoint index ranges inside one epoch therefore never share a row, and (iid or not)
no row belongs to two shards. The ``n - b*B`` rows left over by an epoch's permutation differ from
epoch to epoch, so every row is seen over time.

Usage (simulator / peer)::

    workload = build_lm_workload(cfg.task)          # LMTaskConfig
    model = workload.build_model(seed)              # LlamaForCausalLM, identical on every peer
    loss = workload.loss(model, workload.batch(shard, index))
    metrics = workload.evaluate(model)              # {"loss", "perplexity"}
    workload.export(theta_or_model, "out/final")    # from_pretrained-loadable, with tokenizer
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.data import epoch_permutation, load_packed_rows, split_rows
from asyncloco.models.export import export_causal_lm
from asyncloco.models.presets import build_causal_lm
from asyncloco.models.tokenizer import default_tokenizer, load_tokenizer
from asyncloco.models.workload import Workload, load_flat_params

__all__ = ["LMWorkload", "build_lm_workload", "causal_lm_loss"]

logger = logging.getLogger(__name__)


def causal_lm_loss(model: nn.Module, rows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of ``rows`` ``[B, T+1]``: inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``."""
    device = next(model.parameters()).device
    rows = rows.to(device=device, dtype=torch.long)
    logits = model(input_ids=rows[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction=reduction)


class LMWorkload(Workload):
    name = "lm"

    def __init__(self, cfg: LMTaskConfig, tokenizer: PreTrainedTokenizerBase, rows: torch.Tensor) -> None:
        if rows.dim() != 2 or rows.shape[1] != cfg.seq_len + 1:
            raise ValueError(f"rows must be [N, seq_len+1={cfg.seq_len + 1}], got {tuple(rows.shape)}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.rows = rows
        self.units_per_step = cfg.batch_size * cfg.seq_len
        self.val_ids, self.shard_ids = split_rows(len(rows), cfg.val_sequences, cfg.num_shards, cfg.iid, cfg.seed)
        self._batches = [len(ids) // cfg.batch_size for ids in self.shard_ids]
        if min(self._batches) < 1:
            raise ValueError(f"{len(rows) - cfg.val_sequences} training rows over {cfg.num_shards} shards leave "
                             f"shard(s) without one batch of {cfg.batch_size}; lower task.num_shards, "
                             "task.batch_size or task.seq_len, or raise task.max_train_sequences")
        self._perm_cache: dict[tuple[int, int], torch.Tensor] = {}
        logger.info("lm workload: %d training rows in %d %s shards (%s batches/epoch), %d held out, "
                    "%d tokens/step", len(rows) - len(self.val_ids), cfg.num_shards,
                    "iid" if cfg.iid else "contiguous", self._batches, len(self.val_ids), self.units_per_step)

    # ---------------------------------------------------------------------------------- model
    def build_model(self, seed: int) -> PreTrainedModel:
        return build_causal_lm(
            self.cfg.model,
            vocab_size=len(self.tokenizer),
            seq_len=self.cfg.seq_len,
            seed=seed,
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    # ----------------------------------------------------------------------------------- data
    def shard_sizes(self) -> list[int]:
        return list(self._batches)

    def batch_row_ids(self, shard: int, index: int) -> torch.Tensor:
        """Row ids (into ``self.rows``) of batch ``index`` of ``shard``: ``[batch_size]``."""
        if not 0 <= shard < len(self.shard_ids):
            raise ValueError(f"shard {shard} does not exist; shards are 0..{len(self.shard_ids) - 1}")
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        epoch, position = divmod(index, self._batches[shard])
        key = (shard, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 4 * len(self.shard_ids):  # leases move forward: keep recent epochs
                self._perm_cache.clear()
            self._perm_cache[key] = epoch_permutation(self.cfg.seed, shard, epoch, len(self.shard_ids[shard]))
        size = self.cfg.batch_size
        return self.shard_ids[shard][self._perm_cache[key][position * size : (position + 1) * size]]

    def lease_row_ids(self, shard: int, start_offset: int, steps: int) -> torch.Tensor:
        """Every row a lease trains, ``[steps, batch_size]`` in training order."""
        return torch.stack([self.batch_row_ids(shard, start_offset + j) for j in range(steps)])

    def batch(self, shard: int, index: int) -> torch.Tensor:
        """Token rows ``[batch_size, seq_len + 1]`` (int64, CPU); :meth:`loss` moves them to the model."""
        return self.rows[self.batch_row_ids(shard, index)].long()

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(model, batch)

    # ----------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Token-weighted mean loss and perplexity over all ``val_sequences`` held-out rows."""
        was_training = model.training
        model.eval()
        size = self.cfg.eval_batch_size or self.cfg.batch_size
        total, tokens = 0.0, 0
        for start in range(0, len(self.val_ids), size):
            rows = self.rows[self.val_ids[start : start + size]]
            total += float(causal_lm_loss(model, rows, reduction="sum"))
            tokens += rows.shape[0] * self.cfg.seq_len
        model.train(was_training)
        loss = total / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}

    # --------------------------------------------------------------------------------- export
    def export(self, model_or_params: nn.Module | torch.Tensor, out_dir: str | Path) -> Path:
        """Write a model (or a flat θ) plus the tokenizer as a ``from_pretrained`` directory."""
        model: nn.Module
        if isinstance(model_or_params, torch.Tensor):
            model = self.build_model(seed=0)
            load_flat_params(model, model_or_params.detach().to(torch.float32).cpu())
        else:
            model = model_or_params
        return export_causal_lm(model, self.tokenizer, out_dir)


def build_lm_workload(cfg: LMTaskConfig) -> LMWorkload:
    """Tokenizer + packed rows (cached) + shards for ``cfg``."""
    tokenizer = load_tokenizer(cfg.tokenizer if cfg.tokenizer is not None else default_tokenizer(cfg.model))
    rows = load_packed_rows(cfg, tokenizer)
    return LMWorkload(cfg, tokenizer, rows)
