"""Text → packed token rows → held-out split and shards, with an on-disk cache of the packed rows.

Pipeline (all deterministic):

1. :func:`iter_documents` streams documents from the configured source through ``datasets``
   (``load_dataset(..., streaming=True)``: the embedded corpus and local files take the same path as
   hub datasets such as ``allenai/c4``).
2. :func:`pack_documents` tokenizes them in order, appends eos after every document and cuts the
   token stream into rows of ``seq_len + 1`` tokens (the tail that does not fill a row is dropped),
   stopping once ``max_rows`` rows exist — a streaming source is read no further than needed.
3. :func:`load_packed_rows` caches step 1-2 as ``<cache_dir>/lm-<key>.pt`` where the key hashes the
   tokenizer's full definition, the source (content hash of the embedded corpus; size and mtime of
   local files; id/config/split of hub datasets), ``seq_len`` and the row cap.
4. :func:`split_rows` holds out ``val_sequences`` seeded-random rows and deals the rest into shards.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.corpus import EMBEDDED_CORPUS
from asyncloco.models.tokenizer import tokenizer_fingerprint

__all__ = [
    "PACKING_VERSION",
    "default_cache_dir",
    "epoch_permutation",
    "iter_documents",
    "load_packed_rows",
    "pack_documents",
    "split_rows",
]

logger = logging.getLogger(__name__)

PACKING_VERSION = 1  # bump when the packing rule changes, so old caches are not reused
_TOKENIZE_BATCH = 32  # documents per tokenizer call (small, so a row cap stops reading early)


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "asyncloco"


def _local_files(path: str | list[str]) -> list[str]:
    patterns = [path] if isinstance(path, str) else list(path)
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern)))
        if not matched:
            raise ValueError(f"task.path {pattern!r} matches no file; give an existing file or glob")
        files.extend(os.path.abspath(f) for f in matched)
    return files


def iter_documents(cfg: LMTaskConfig) -> Iterator[str]:
    """The source's document texts, in the source's order (non-empty ones only)."""
    from datasets import load_dataset  # heavy import, only when data is actually read

    if cfg.source == "hub":
        from asyncloco.models.hub import require_hub

        require_hub(str(cfg.path), "dataset")  # one line and exit 2 instead of a minute of retries (models/hub.py)
        dataset = load_dataset(str(cfg.path), cfg.name, split=cfg.split, streaming=True)
    else:
        builder = "json" if cfg.source == "embedded" else cfg.source
        files = [str(EMBEDDED_CORPUS)] if cfg.source == "embedded" else _local_files(cfg.path or [])
        dataset = load_dataset(builder, data_files={cfg.split: files}, split=cfg.split, streaming=True)
    for record in dataset:
        if cfg.text_field not in record:
            raise ValueError(f"records of {cfg.path or 'the embedded corpus'} have no field {cfg.text_field!r} "
                             f"(fields: {sorted(record)}); set task.text_field")
        text = record[cfg.text_field]
        if text:
            yield text


def pack_documents(
    texts: Iterable[str], tokenizer: PreTrainedTokenizerBase, seq_len: int, max_rows: int | None = None
) -> torch.Tensor:
    """Rows of ``seq_len + 1`` consecutive tokens of ``doc_0 eos doc_1 eos ...``: int32 ``[rows, seq_len+1]``."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos token to separate documents; use load_tokenizer()")
    row_len = seq_len + 1
    chunks: list[np.ndarray] = []
    n_tokens = 0

    def tokenize(batch: list[str]) -> None:
        nonlocal n_tokens
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            chunks.append(np.asarray(ids + [eos], dtype=np.int32))
            n_tokens += len(ids) + 1

    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == _TOKENIZE_BATCH:
            tokenize(batch)
            batch = []
            if max_rows is not None and n_tokens >= max_rows * row_len:
                break
    else:
        if batch:
            tokenize(batch)
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    rows = len(stream) // row_len if max_rows is None else min(len(stream) // row_len, max_rows)
    return torch.from_numpy(stream[: rows * row_len].reshape(rows, row_len).copy())


def _source_fingerprint(cfg: LMTaskConfig) -> dict[str, object]:
    if cfg.source == "embedded":
        return {"embedded": hashlib.sha256(EMBEDDED_CORPUS.read_bytes()).hexdigest()}
    if cfg.source == "hub":
        return {"hub": cfg.path, "name": cfg.name, "split": cfg.split}
    files = _local_files(cfg.path or [])
    return {cfg.source: [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files], "split": cfg.split}


def load_packed_rows(cfg: LMTaskConfig, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Packed rows for ``cfg`` (training cap + held-out rows), from the cache when possible."""
    max_rows = None if cfg.max_train_sequences is None else cfg.max_train_sequences + cfg.val_sequences
    key_fields = {
        "version": PACKING_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": _source_fingerprint(cfg),
        "text_field": cfg.text_field,
        "seq_len": cfg.seq_len,
        "max_rows": max_rows,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    cache_dir = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    cache_file = cache_dir / f"lm-{key}.pt"
    if cache_file.is_file():
        rows: torch.Tensor = torch.load(cache_file, weights_only=True)["rows"]
        logger.info("packed rows from cache %s: %d x %d", cache_file, rows.shape[0], rows.shape[1])
        return rows
    rows = pack_documents(iter_documents(cfg), tokenizer, cfg.seq_len, max_rows)
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cache_file.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"rows": rows, "key": key_fields}, partial)
    os.replace(partial, cache_file)  # atomic: concurrent peers never read a half-written cache
    logger.info("packed %d rows of %d tokens from %s; cached at %s", rows.shape[0], rows.shape[1],
                cfg.path or "the embedded corpus", cache_file)
    return rows


def _generator(*parts: int | str) -> torch.Generator:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def split_rows(
    n_rows: int, val_rows: int, num_shards: int, iid: bool, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(held-out row ids, per-shard row ids). Every row is in exactly one of them.

    Held-out rows are a seeded random subset (sorted). The remaining rows, in document order, are
    dealt out by a seeded permutation (``iid``) or cut into contiguous runs (non-iid); shard sizes
    differ by at most one row.
    """
    if n_rows <= val_rows:
        raise ValueError(f"only {n_rows} packed rows, not more than val_sequences={val_rows}; lower "
                         "task.val_sequences or task.seq_len, or use a larger source")
    held_out = torch.zeros(n_rows, dtype=torch.bool)
    held_out[torch.randperm(n_rows, generator=_generator(seed, "val"))[:val_rows]] = True
    val_ids = torch.nonzero(held_out).flatten()
    train_ids = torch.nonzero(~held_out).flatten()
    if iid:
        train_ids = train_ids[torch.randperm(len(train_ids), generator=_generator(seed, "shards"))]
    return val_ids, [part.clone() for part in torch.tensor_split(train_ids, num_shards)]


def epoch_permutation(seed: int, shard: int, epoch: int, n: int) -> torch.Tensor:
    """The order in which ``shard``'s ``n`` rows are visited during ``epoch`` (fresh per epoch)."""
    return torch.randperm(n, generator=_generator(seed, shard, epoch))
