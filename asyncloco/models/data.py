"""Text → packed token rows → held-out split and shards, with an on-disk cache of the packed rows.

Pipeline (all deterministic):

1. :func:`iter_documents` streams documents from the configured source through ``datasets``
   (``load_dataset(..., streaming=True)``: the embedded corpus and local files take the same path as
   hub datasets such as ``allenai/c4``).
2. :func:`pack_documents` tokenizes them in order, appends eos after every document and cuts the
   token stream into rows of ``seq_len + 1`` tokens (the tail that does not fill a row is dropped),
   stopping once ``max_rows`` rows exist — a streaming source is read no further than needed.
3. :func:`load_packed_rows` prepares step 1-2 once into ``<cache_dir>/lm-<key>/`` through the code path of
   ``asyncloco data prepare`` (:mod:`asyncloco.models.prepared`: a manifest and one shard file of token ids)
   and memory-maps it, where the key hashes the tokenizer's full definition, the source (content hash of
   the embedded corpus; size and mtime of local files; id/config/split of hub datasets), ``seq_len`` and
   the row cap. (A corpus prepared ahead of time and named by its manifest digest, ``task.source:
   prepared``, is read by :class:`asyncloco.models.lm.LMWorkload` shard file by shard file instead.)
4. :func:`split_rows` holds out ``val_sequences`` seeded-random rows and deals the rest into shards.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.corpus import EMBEDDED_CORPUS
from asyncloco.models.prepared import MANIFEST_NAME, PreparedCorpus, prepare_corpus
from asyncloco.models.tokenizer import tokenizer_fingerprint

__all__ = [
    "PACKING_VERSION",
    "default_cache_dir",
    "epoch_permutation",
    "iter_documents",
    "iter_source_documents",
    "load_packed_rows",
    "pack_documents",
    "prepare_source",
    "source_description",
    "split_rows",
]

logger = logging.getLogger(__name__)

PACKING_VERSION = 2  # bump when the packing rule or cache layout changes, so old caches are not reused
_ONE_FILE = 1 << 40  # rows per shard file of a cache: all of them in one file
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


def iter_source_documents(source: str, path: str | list[str] | None, name: str | None = None, split: str = "train",
                          text_field: str = "text") -> Iterator[str]:
    """The document texts of a source (``embedded``, ``text``/``json``/``parquet`` files, or a ``hub`` dataset), in
    the source's order (non-empty ones only). A source that cannot be read raises a ``ValueError`` naming it."""
    from datasets import load_dataset  # heavy import, only when data is actually read

    where = f"the hub dataset {path!r}" if source == "hub" else (
        "the embedded corpus" if source == "embedded" else f"{source} file(s) {path!r}")
    if source == "hub":
        from asyncloco.models.hub import require_hub

        require_hub(str(path), "dataset")  # one line and exit 2 instead of a minute of retries (models/hub.py)
    else:
        files = [str(EMBEDDED_CORPUS)] if source == "embedded" else _local_files(path or [])

    def unreadable(error: Exception) -> ValueError:  # datasets/pyarrow errors: one line naming the source
        detail = (str(error).strip().splitlines() or [""])[0]
        return ValueError(f"cannot read {where} as {source}: {type(error).__name__}: {detail}; check that the source "
                          "type (task.source / --source) matches the files, or the dataset id, configuration (name) "
                          "and split")

    try:
        if source == "hub":
            dataset = load_dataset(str(path), name, split=split, streaming=True)
        else:
            builder = "json" if source == "embedded" else source
            dataset = load_dataset(builder, data_files={split: files}, split=split, streaming=True)
        records = iter(dataset)
    except Exception as error:
        raise unreadable(error) from error
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as error:
            raise unreadable(error) from error
        if text_field not in record:
            raise ValueError(f"records of {path or 'the embedded corpus'} have no field {text_field!r} "
                             f"(fields: {sorted(record)}); set task.text_field")
        text = record[text_field]
        if text:
            yield text


def iter_documents(cfg: LMTaskConfig) -> Iterator[str]:
    """The source's document texts, in the source's order (non-empty ones only)."""
    return iter_source_documents(cfg.source, cfg.path, cfg.name, cfg.split, cfg.text_field)


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


def source_description(source: str, path: str | list[str] | None, name: str | None = None, split: str = "train",
                       text_field: str = "text") -> dict[str, Any]:
    """What a prepared corpus was made from, for its manifest (no machine-specific paths: file names and sizes)."""
    if source == "embedded":
        return {"source": "embedded", "sha256": hashlib.sha256(EMBEDDED_CORPUS.read_bytes()).hexdigest(),
                "text_field": text_field}
    if source == "hub":
        return {"source": "hub", "path": path, "name": name, "split": split, "text_field": text_field}
    files = _local_files(path or [])
    return {"source": source, "files": [[os.path.basename(f), os.stat(f).st_size] for f in files], "split": split,
            "text_field": text_field}


def load_packed_rows(cfg: LMTaskConfig, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Packed rows for ``cfg`` (training cap + held-out rows) as a read-only tensor memory-mapped from the cache.

    On first use the rows are prepared into ``<cache_dir>/lm-<key>/`` by :func:`prepared.prepare_corpus` (the code
    path of ``asyncloco data prepare``: one shard file, no held-out file — :func:`split_rows` holds rows out), then
    read back through :class:`prepared.PreparedCorpus`, which checks the file's sha256 against the manifest.
    """
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
    directory = cache_dir / f"lm-{key}"
    if not (directory / MANIFEST_NAME).is_file():
        partial = cache_dir / f"lm-{key}.{os.getpid()}.tmp"
        source = source_description(cfg.source, cfg.path, cfg.name, cfg.split, cfg.text_field)
        prepare_corpus(iter_documents(cfg), partial, tokenizer=tokenizer, source=source, seq_len=cfg.seq_len,
                       rows_per_shard=max_rows or _ONE_FILE, held_out_rows=0, max_train_rows=max_rows,
                       batch_docs=_TOKENIZE_BATCH, progress=False)
        try:
            os.rename(partial, directory)  # atomic: concurrent peers never read a half-written cache
        except OSError:  # another process finished first: use its (identical) copy
            if not (directory / MANIFEST_NAME).is_file():
                raise
            shutil.rmtree(partial, ignore_errors=True)
        logger.info("packed rows of %s cached at %s", cfg.path or "the embedded corpus", directory)
    corpus = PreparedCorpus(json.loads((directory / MANIFEST_NAME).read_bytes()), directory)
    if len(corpus.files) != 1:
        raise ValueError(f"{directory} is not a packed-rows cache (it has {len(corpus.files)} shard files); delete it")
    with warnings.catch_warnings():  # a read-only memmap: torch warns that it cannot be written, which is the point
        warnings.simplefilter("ignore", UserWarning)
        rows = torch.from_numpy(corpus.shard_file(0))
    logger.info("packed rows from %s: %d x %d (%s, memory-mapped)", directory, rows.shape[0], rows.shape[1],
                corpus.dtype)
    return rows


def prepare_source(
    out_dir: str | Path,
    *,
    source: str,
    path: str | list[str] | None = None,
    name: str | None = None,
    split: str = "train",
    text_field: str = "text",
    tokenizer: str = "embedded-32k",
    seq_len: int = 256,
    max_tokens: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """``asyncloco data prepare``: read ``source`` through ``datasets`` (as a run would, :func:`iter_source_documents`)
    and :func:`prepare_corpus` it into ``out_dir``. ``max_tokens`` caps the training tokens (``rows * seq_len``)."""
    if source == "prepared":
        raise ValueError("--source prepared names an already prepared corpus; prepare from embedded, text, json, "
                         "parquet or hub")
    if source != "embedded" and not path:
        raise ValueError(f"--source {source} needs --path: "
                         + ("a dataset id such as 'HuggingFaceFW/fineweb-edu'" if source == "hub" else "files or globs"))
    if source == "hub":
        from asyncloco.models.hub import HubUnreachable, hub_offline, require_hub

        try:
            require_hub(str(path), "dataset")  # offline: one line naming the fix, before any worker starts
        except HubUnreachable:
            why = "HF_HUB_OFFLINE=1 forbids reaching the hub" if hub_offline() else "the hub cannot be reached from here"
            raise HubUnreachable(f"the hub dataset {path!r} cannot be streamed: {why}; download its files where the hub "
                                 f"is reachable (huggingface-cli download --repo-type dataset {path} --local-dir DIR) and "
                                 "prepare them with --source parquet or json --path 'DIR/...' (docs/data-prepare.md)"
                                 ) from None
    description = source_description(source, path, name, split, text_field)  # a local path matching nothing fails here
    max_rows = None if max_tokens is None else max(1, -(-max_tokens // seq_len))
    documents = iter_source_documents(source, path, name, split, text_field)
    return prepare_corpus(documents, out_dir, tokenizer=tokenizer, source=description, seq_len=seq_len,
                          max_train_rows=max_rows, **options)


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
