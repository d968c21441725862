"""Language-model workload: packed token rows, shards, leases → batches, held-out perplexity.

A lease ``(shard, start_offset, steps)`` trains exactly the rows
``lease_row_ids(shard, start_offset, steps)``: batch ``index`` of a shard with ``n`` rows and
``b = n // batch_size`` batches per epoch is ``rows[shard_ids[perm_e[p*B : (p+1)*B]]]`` with
``e = index // b``, ``p = index % b`` and ``perm_e`` the shard's seeded permutation for epoch ``e``.
Two leases with disjoint index ranges inside one epoch therefore never share a row, and (iid or not)
no row belongs to two shards. The ``n - b*B`` rows left over by an epoch's permutation differ from
epoch to epoch, so every row is seen over time.

A prepared corpus (``task.source: prepared``, :mod:`asyncloco.models.prepared`) is read per lease instead of
held in memory: its shard *files* are dealt to the run's shards (a seeded permutation of the files dealt
round-robin when ``iid``, contiguous runs of files otherwise), and epoch ``e`` of a shard visits its files in a
seeded order, each file's rows in a seeded order of their own. Batch ``index`` is the ``B`` positions from
``p*B`` of that sequence, read from the memory-mapped files; a lease touches a file or two, so a peer fetches
(and verifies) only those. Memory stays independent of the corpus size: nothing scales with the rows but the
files' row counts. Evaluation reads the manifest's held-out rows.

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
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.data import _generator, default_cache_dir, epoch_permutation, load_packed_rows, split_rows
from asyncloco.models.export import export_causal_lm
from asyncloco.models.prepared import PreparedCorpus
from asyncloco.models.presets import build_causal_lm
from asyncloco.models.tokenizer import default_tokenizer, load_tokenizer, tokenizer_fingerprint
from asyncloco.models.workload import Workload, load_flat_params

__all__ = ["LMWorkload", "build_lm_workload", "causal_lm_loss"]

logger = logging.getLogger(__name__)


def causal_lm_loss(model: nn.Module, rows: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of ``rows`` ``[B, T+1]``: inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``."""
    device = next(model.parameters()).device
    rows = rows.to(dtype=torch.long).to(device)  # widen first: memory-mapped rows are uint16 (models/prepared.py)
    logits = model(input_ids=rows[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction=reduction)


class LMWorkload(Workload):
    name = "lm"

    def __init__(self, cfg: LMTaskConfig, tokenizer: PreTrainedTokenizerBase, rows: torch.Tensor | None = None,
                 corpus: PreparedCorpus | None = None) -> None:
        """From packed ``rows`` (held out and dealt by :func:`split_rows`), or from a prepared ``corpus`` (then
        ``rows`` are its held-out rows, ``val_ids`` the first ``val_sequences`` of them, and training batches are
        read from its shard files)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.corpus = corpus
        self.units_per_step = cfg.batch_size * cfg.seq_len
        self._perm_cache: dict[tuple[int, ...], torch.Tensor] = {}
        if corpus is not None:
            self._init_prepared(corpus)
            return
        if rows is None:
            raise ValueError("LMWorkload needs packed rows or a prepared corpus")
        if rows.dim() != 2 or rows.shape[1] != cfg.seq_len + 1:
            raise ValueError(f"rows must be [N, seq_len+1={cfg.seq_len + 1}], got {tuple(rows.shape)}")
        self.rows = rows
        self.val_ids, self.shard_ids = split_rows(len(rows), cfg.val_sequences, cfg.num_shards, cfg.iid, cfg.seed)
        self._batches = [len(ids) // cfg.batch_size for ids in self.shard_ids]
        if min(self._batches) < 1:
            raise ValueError(f"{len(rows) - cfg.val_sequences} training rows over {cfg.num_shards} shards leave "
                             f"shard(s) without one batch of {cfg.batch_size}; lower task.num_shards, "
                             "task.batch_size or task.seq_len, or raise task.max_train_sequences")
        logger.info("lm workload: %d training rows in %d %s shards (%s batches/epoch), %d held out, "
                    "%d tokens/step", len(rows) - len(self.val_ids), cfg.num_shards,
                    "iid" if cfg.iid else "contiguous", self._batches, len(self.val_ids), self.units_per_step)

    def _init_prepared(self, corpus: PreparedCorpus) -> None:
        cfg = self.cfg
        corpus.check(tokenizer_fingerprint(self.tokenizer), cfg.seq_len)
        held = corpus.held_out()
        if len(held) < cfg.val_sequences:
            raise ValueError(f"the prepared corpus {corpus.digest[:16]} holds {len(held)} held-out rows, fewer than "
                             f"task.val_sequences={cfg.val_sequences}; lower task.val_sequences or prepare the corpus "
                             "with more --held-out-rows")
        with warnings.catch_warnings():  # a read-only memmap: torch warns that it cannot be written, which is the point
            warnings.simplefilter("ignore", UserWarning)
            self.rows = torch.from_numpy(held)
        self.val_ids = torch.arange(cfg.val_sequences)
        n_files = len(corpus.files)
        if n_files < cfg.num_shards:
            raise ValueError(f"the prepared corpus {corpus.digest[:16]} has {n_files} shard files, fewer than "
                             f"task.num_shards={cfg.num_shards}; lower task.num_shards or prepare it with smaller "
                             "files (--shard-mb)")
        order = torch.randperm(n_files, generator=_generator(cfg.seed, "files")) if cfg.iid else torch.arange(n_files)
        if cfg.iid:
            self.shard_files = [order[s::cfg.num_shards].sort().values for s in range(cfg.num_shards)]
        else:
            self.shard_files = [part.clone() for part in torch.tensor_split(order, cfg.num_shards)]
        self.shard_ids = []  # no per-row id lists: rows are found through shard_files (memory independent of size)
        file_rows = torch.tensor(corpus.file_rows, dtype=torch.int64)
        self._file_rows = file_rows
        self._batches = [int(file_rows[files].sum()) // cfg.batch_size for files in self.shard_files]
        if min(self._batches) < 1:
            raise ValueError(f"a shard of the prepared corpus {corpus.digest[:16]} holds less than one batch of "
                             f"{cfg.batch_size} rows; lower task.num_shards or task.batch_size")
        logger.info("lm workload: prepared corpus %s, %d training rows in %d files over %d %s shards (%s "
                    "batches/epoch), %d held-out rows evaluated, %d tokens/step", corpus.digest[:16],
                    corpus.train_rows, n_files, cfg.num_shards, "iid" if cfg.iid else "contiguous", self._batches,
                    cfg.val_sequences, self.units_per_step)

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
        """Row ids of batch ``index`` of ``shard``: ``[batch_size]``, into ``self.rows`` (packed rows) or, for a
        prepared corpus, global training-row ids ``file * rows_per_shard + row``."""
        if not 0 <= shard < len(self._batches):
            raise ValueError(f"shard {shard} does not exist; shards are 0..{len(self._batches) - 1}")
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        epoch, position = divmod(index, self._batches[shard])
        if len(self._perm_cache) > 8 * len(self._batches) + 64:  # leases move forward: keep recent epochs
            self._perm_cache.clear()
        size = self.cfg.batch_size
        if self.corpus is not None:
            return self._prepared_row_ids(shard, epoch, position * size, size)
        key = (shard, epoch)
        if key not in self._perm_cache:
            self._perm_cache[key] = epoch_permutation(self.cfg.seed, shard, epoch, len(self.shard_ids[shard]))
        return self.shard_ids[shard][self._perm_cache[key][position * size : (position + 1) * size]]

    def _perm(self, key: tuple[int, ...], n: int) -> torch.Tensor:
        if key not in self._perm_cache:
            self._perm_cache[key] = torch.randperm(n, generator=_generator(self.cfg.seed, *key))
        return self._perm_cache[key]

    def _prepared_row_ids(self, shard: int, epoch: int, start: int, count: int) -> torch.Tensor:
        """Positions ``start .. start+count`` of epoch ``epoch``'s order of ``shard``: its files in a seeded order,
        each file's rows in a seeded order (keys ``(shard, epoch, -1)`` and ``(shard, epoch, file)``)."""
        assert self.corpus is not None
        files = self.shard_files[shard][self._perm((shard, epoch, -1), len(self.shard_files[shard]))]
        ends = torch.cumsum(self._file_rows[files], 0)
        positions = torch.arange(start, start + count)
        which = torch.searchsorted(ends, positions, right=True)
        ids = torch.empty(count, dtype=torch.int64)
        for k in torch.unique(which).tolist():
            file = int(files[k])
            begin = int(ends[k]) - int(self._file_rows[file])
            mask = which == k
            rows = self._perm((shard, epoch, file), int(self._file_rows[file]))[positions[mask] - begin]
            ids[mask] = file * self.corpus.rows_per_shard + rows
        return ids

    def lease_row_ids(self, shard: int, start_offset: int, steps: int) -> torch.Tensor:
        """Every row a lease trains, ``[steps, batch_size]`` in training order."""
        return torch.stack([self.batch_row_ids(shard, start_offset + j) for j in range(steps)])

    def batch(self, shard: int, index: int) -> torch.Tensor:
        """Token rows ``[batch_size, seq_len + 1]`` (int64, CPU); :meth:`loss` moves them to the model."""
        ids = self.batch_row_ids(shard, index)
        if self.corpus is not None:
            return torch.from_numpy(self.corpus.read_rows(ids.numpy())).long()
        return self.rows[ids].long()

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
    """Tokenizer + packed rows (cached) + shards for ``cfg``; a prepared corpus is opened, not loaded."""
    tokenizer = load_tokenizer(cfg.tokenizer if cfg.tokenizer is not None else default_tokenizer(cfg.model))
    if cfg.source == "prepared":
        assert cfg.manifest_digest is not None and cfg.shards_from is not None  # LMTaskConfig checks it
        cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        corpus = PreparedCorpus.open(cfg.manifest_digest.lower(), cfg.shards_from, cache_dir)
        return LMWorkload(cfg, tokenizer, corpus=corpus)
    rows = load_packed_rows(cfg, tokenizer)
    return LMWorkload(cfg, tokenizer, rows)
