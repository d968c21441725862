"""A prepared corpus: packed token rows in fixed-size shard files plus a manifest, read per lease by memory-mapping.

``asyncloco data prepare`` (:func:`prepare_corpus`) streams a source's documents (the same
``datasets`` code path as :func:`asyncloco.models.data.iter_documents`), tokenizes them in worker processes
with the run's tokenizer, joins them with eos and cuts the stream into rows of ``seq_len + 1`` tokens exactly
as :func:`asyncloco.models.data.pack_documents` does. Rows go to:

* the held-out file ``heldout.bin``: rows ``0, every, 2*every, ...`` of the packed stream, at most
  ``held_out_rows`` of them (a pure function of the row's index, so a resumed preparation picks the same ones);
* training shard files ``train-00000.bin``, ``train-00001.bin``, ...: every other row in stream order,
  ``rows_per_shard`` rows per file (the last file may hold fewer).

Files are raw row-major token ids (``uint16`` when the vocabulary fits, else ``uint32``), so
``np.memmap(file, dtype, mode="r").reshape(-1, seq_len + 1)`` reads them. The manifest (``manifest.json``, canonical
JSON) records the format version, the tokenizer (name, :func:`~asyncloco.models.tokenizer.tokenizer_fingerprint`,
vocabulary size), the source, ``seq_len``, the dtype, ``rows_per_shard``, each file's rows, bytes and sha256, and
the held-out file. A run names the corpus by :func:`manifest_digest` (sha256 of the canonical manifest JSON).

Resuming: after every completed shard file the preparation records its state (files written, documents consumed,
the tokens not yet in a written row, the held-out rows so far) in ``prepare-state.json``; a restart with the same
arguments skips the consumed documents and continues, producing byte-identical files.

Reading (:class:`PreparedCorpus`): a peer keeps verified copies under ``<cache_dir>/prepared/<digest>/``, fetching a
shard file (a copy from a directory, or a download from an http(s) URL) only when a batch first touches it, and
checking its sha256 against the manifest before the first read: a mismatch is refused with an error that names the
file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CorruptShard",
    "PreparedCorpus",
    "canonical_json",
    "hub_url",
    "manifest_digest",
    "prepare_corpus",
    "rows_for_size",
    "token_dtype",
]

logger = logging.getLogger(__name__)

FORMAT = "asyncloco-prepared"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = "prepare-state.json"
HELDOUT_NAME = "heldout.bin"
_HASH_CHUNK = 1 << 22


class CorruptShard(ValueError):
    """A shard file's bytes differ from its manifest entry (the CLI prints it as one line and exits 2)."""


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The name a run gives a prepared corpus: sha256 of the manifest's canonical JSON."""
    return hashlib.sha256(canonical_json(manifest)).hexdigest()


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def rows_for_size(shard_mb: float, seq_len: int, dtype: str) -> int:
    """Rows per shard file for files of about ``shard_mb`` MiB."""
    return max(1, int(shard_mb * (1 << 20)) // ((seq_len + 1) * np.dtype(dtype).itemsize))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as out:
        out.write(data)
    os.replace(partial, path)


# ------------------------------------------------------------------------------------------------ tokenizing

_WORKER_TOKENIZER: Any = None


def _worker_init(tokenizer_name: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    from asyncloco.models.tokenizer import load_tokenizer

    _WORKER_TOKENIZER = load_tokenizer(tokenizer_name)


def _encode(tokenizer: Any, texts: list[str]) -> np.ndarray:
    """``doc_0 eos doc_1 eos ...`` for ``texts``, as uint32 (what :func:`pack_documents` concatenates)."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    if not ids:
        return np.zeros(0, dtype=np.uint32)
    return np.concatenate([np.asarray(list(doc) + [eos], dtype=np.uint32) for doc in ids])


def _worker_encode(texts: list[str]) -> np.ndarray:
    return _encode(_WORKER_TOKENIZER, texts)


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in documents:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _tokenized(documents: Iterator[str], tokenizer: Any, tokenizer_name: str, workers: int, batch_docs: int
               ) -> Iterator[tuple[int, np.ndarray]]:
    """(documents, their tokens) per batch, in source order; ``workers`` > 1 tokenizes in a process pool (each
    worker loads ``tokenizer_name``), else ``tokenizer`` tokenizes here."""
    if workers <= 1:
        for batch in _batches(documents, batch_docs):
            yield len(batch), _encode(tokenizer, batch)
        return
    context = multiprocessing.get_context("spawn")  # no forked Rust/torch thread pools
    pool = context.Pool(workers, initializer=_worker_init, initargs=(tokenizer_name,))
    window: deque[tuple[int, Any]] = deque()  # bounded, so a huge source is never queued whole
    try:
        for batch in _batches(documents, batch_docs):
            window.append((len(batch), pool.apply_async(_worker_encode, (batch,))))
            if len(window) >= 4 * workers:
                size, result = window.popleft()
                yield size, result.get()
        while window:
            size, result = window.popleft()
            yield size, result.get()
    finally:
        pool.terminate()
        pool.join()


class _Progress:
    """tqdm when installed, else a log line every 10 s."""

    def __init__(self, total: int | None, initial: int, enabled: bool) -> None:
        self.bar: Any = None
        self.count = initial
        self.last = time.monotonic()
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, unit="tok", unit_scale=True, desc="prepare")

    def update(self, tokens: int) -> None:
        self.count += tokens
        if self.bar is not None:
            self.bar.update(tokens)
        elif self.enabled and time.monotonic() - self.last >= 10.0:
            self.last = time.monotonic()
            logger.info("prepare: %d training tokens packed", self.count)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------- preparing


class _Packer:
    """One preparation's packing state: rows of the token stream → the held-out list or the shard file being filled,
    a checkpoint after every batch in which a shard file was completed."""

    def __init__(self, out: Path, params: dict[str, Any], max_train_rows: int | None) -> None:
        self.out, self.params = out, params
        self.dtype = np.dtype(params["dtype"])
        self.row_len: int = params["row_tokens"]
        self.rows_per_shard: int = params["rows_per_shard"]
        self.held_rows: int = params["held_out_rule"]["rows"]
        self.held_every: int = params["held_out_rule"]["every"]
        self.max_train_rows = max_train_rows
        self.shards: list[dict[str, Any]] = []
        self.docs = 0  # source documents consumed
        self.next_row = 0  # index (in the packed stream) of the row that self.tokens starts
        self.tokens = np.zeros(0, dtype=np.uint32)
        self.held: list[tuple[int, np.ndarray]] = []
        self.current: list[np.ndarray] = []
        self.current_rows = 0
        self.train_done = 0
        self.checkpoints = 0
        self.state_path = out / STATE_NAME

    @property
    def capped(self) -> bool:
        return self.max_train_rows is not None and self.train_done >= self.max_train_rows

    def resume(self) -> None:
        """Continue from the last checkpoint of an interrupted preparation with the same params, if there is one."""
        if not self.state_path.is_file():
            return
        state = json.loads(self.state_path.read_text(encoding="utf-8"))
        if state.get("params") != self.params:
            raise ValueError(f"{self.out} holds an interrupted preparation with other arguments ({self.state_path}); "
                             "rerun it with the same arguments to resume, or give another --out")
        for entry in state["shards"]:
            path = self.out / entry["file"]
            if not path.is_file() or path.stat().st_size != entry["bytes"]:
                raise ValueError(f"{path} recorded as complete in {self.state_path} is missing or truncated; "
                                 f"delete {self.out} and prepare again")
        self.shards, self.docs, self.next_row = state["shards"], state["docs"], state["next_row"]
        self.checkpoints = len(self.shards)
        self.tokens = np.fromfile(self.out / state["pending"], dtype=np.uint32)
        held_rows = np.fromfile(self.out / state["held"], dtype=self.dtype).reshape(-1, self.row_len)
        self.held = [(row_id, row) for row_id, row in zip(state["held_ids"], held_rows)]
        self.train_done = sum(entry["rows"] for entry in self.shards)
        logger.info("resuming %s: %d shard files done, skipping %d documents", self.out, len(self.shards), self.docs)

    def _held_block(self, count: int) -> np.ndarray:
        rows = [row for _, row in self.held[:count]]
        return (np.stack(rows) if rows else np.zeros((0, self.row_len))).astype(self.dtype)

    def _write_shard(self) -> None:
        data = np.concatenate(self.current).astype(self.dtype).tobytes()
        name = f"train-{len(self.shards):05d}.bin"
        _write_atomic(self.out / name, data)
        self.shards.append({"file": name, "rows": self.current_rows, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
        self.train_done += self.current_rows
        self.current, self.current_rows = [], 0

    def _checkpoint(self, row: int, n_held: int, pending: np.ndarray) -> None:
        self.checkpoints += 1
        pending_name, held_name = f"prepare-pending-{self.checkpoints}.bin", f"prepare-held-{self.checkpoints}.bin"
        _write_atomic(self.out / pending_name, pending.astype(np.uint32).tobytes())
        _write_atomic(self.out / held_name, self._held_block(n_held).tobytes())
        state = {"params": self.params, "shards": self.shards, "docs": self.docs, "next_row": row,
                 "pending": pending_name, "held": held_name, "held_ids": [i for i, _ in self.held[:n_held]]}
        _write_atomic(self.state_path, json.dumps(state, indent=1).encode("utf-8"))
        for stale in self.out.glob("prepare-*-*.bin"):
            if stale.name not in (pending_name, held_name):
                stale.unlink()

    def feed(self, docs: int, new: np.ndarray) -> int:
        """Pack one batch's tokens; returns the training rows completed into shard files."""
        self.docs += docs
        if len(new) and int(new.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(new.max())} does not fit {self.dtype}")
        tokens = np.concatenate([self.tokens, new]) if len(self.tokens) else new
        row_len, n_full, pos, before = self.row_len, len(tokens) // self.row_len, 0, self.train_done
        flushed: tuple[int, int] | None = None  # (row index, held-out rows) right after the last file written
        while pos < n_full and not self.capped:
            ids = np.arange(self.next_row + pos, self.next_row + n_full, dtype=np.int64)
            is_held = (ids % self.held_every == 0) & (ids // self.held_every < self.held_rows)
            need = self.rows_per_shard - self.current_rows
            if self.max_train_rows is not None:
                need = min(need, self.max_train_rows - self.train_done - self.current_rows)
            train_count = np.cumsum(~is_held)
            stop = int(np.searchsorted(train_count, need)) + 1 if train_count[-1] >= need else len(ids)
            block, held = tokens[pos * row_len:(pos + stop) * row_len].reshape(stop, row_len), is_held[:stop]
            self.held.extend((int(i), row.copy()) for i, row in zip(ids[:stop][held], block[held]))
            if (~held).any():
                self.current.append(block[~held].copy())
                self.current_rows += int((~held).sum())
            pos += stop
            if self.current_rows == self.rows_per_shard or (
                    self.max_train_rows is not None and self.train_done + self.current_rows >= self.max_train_rows):
                self._write_shard()
                flushed = (self.next_row + pos, len(self.held))
        if flushed is not None and not self.capped:
            row, n_held = flushed
            self._checkpoint(row, n_held, tokens[(row - self.next_row) * row_len:])
        self.tokens = tokens[pos * row_len:]
        self.next_row += pos
        return self.train_done - before

    def finish(self) -> dict[str, Any]:
        """Write the last (short) shard file, the held-out file and the manifest; drop the resume state."""
        if self.current_rows:
            self._write_shard()
        if not self.shards:
            raise ValueError(f"the source gave no full row of {self.row_len} tokens ({self.docs} documents); "
                             "check the source and task.text_field, or lower --seq-len")
        held_bytes = self._held_block(len(self.held)).tobytes()
        if self.held:
            _write_atomic(self.out / HELDOUT_NAME, held_bytes)
        manifest = dict(self.params)
        manifest.update({
            "train_rows": self.train_done,
            "train_tokens": self.train_done * (self.row_len - 1),  # tokens trained on: rows x seq_len
            "shards": self.shards,
            "held_out": {"file": HELDOUT_NAME if self.held else None, "rows": len(self.held),
                         "bytes": len(held_bytes), "sha256": hashlib.sha256(held_bytes).hexdigest()},
        })
        _write_atomic(self.out / MANIFEST_NAME, canonical_json(manifest))
        self.state_path.unlink(missing_ok=True)
        for stale in [*self.out.glob("prepare-*-*.bin"), *self.out.glob("*.partial")]:  # incl. an interrupted write's
            stale.unlink()
        return manifest


def prepare_corpus(
    documents: Iterable[str],
    out_dir: str | Path,
    *,
    tokenizer: Any,
    source: dict[str, Any],
    seq_len: int,
    rows_per_shard: int | None = None,
    shard_mb: float = 16.0,
    held_out_rows: int = 2048,
    held_out_every: int = 100,
    max_train_rows: int | None = None,
    workers: int = 1,
    batch_docs: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Pack ``documents`` into ``out_dir`` (shard files + held-out file + ``manifest.json``); returns the manifest.

    ``tokenizer`` is a name or path :func:`~asyncloco.models.tokenizer.load_tokenizer` accepts (each worker loads
    it), or with ``workers=1`` a loaded tokenizer. ``source`` describes the documents for the manifest. A directory
    holding an interrupted preparation with the same arguments is resumed; a finished one is returned as it is.
    ``batch_docs`` (documents per tokenizer call; default 64, 256 per task with workers) never changes the output.
    """
    from asyncloco.models.tokenizer import load_tokenizer, tokenizer_fingerprint

    if seq_len < 2 or held_out_rows < 0 or held_out_every < 1 or (max_train_rows is not None and max_train_rows < 1):
        raise ValueError("prepare needs seq_len >= 2, held_out_rows >= 0, held_out_every >= 1, max_train_rows >= 1")
    out = Path(out_dir).expanduser()
    if isinstance(tokenizer, (str, Path)):
        tok, tokenizer_name = load_tokenizer(tokenizer), str(tokenizer)
    elif workers > 1:
        raise ValueError("tokenizing in worker processes needs the tokenizer's name or path, not a loaded tokenizer")
    else:
        tok, tokenizer_name = tokenizer, str(getattr(tokenizer, "name_or_path", ""))
    dtype = token_dtype(len(tok))
    params: dict[str, Any] = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "tokenizer": {"name": tokenizer_name, "digest": tokenizer_fingerprint(tok), "vocab_size": len(tok),
                      "eos_token_id": tok.eos_token_id},
        "source": source, "seq_len": seq_len, "row_tokens": seq_len + 1, "dtype": dtype,
        "rows_per_shard": rows_per_shard or rows_for_size(shard_mb, seq_len, dtype),
        "held_out_rule": {"rows": held_out_rows, "every": held_out_every}, "max_train_rows": max_train_rows,
    }
    if (out / MANIFEST_NAME).is_file():
        manifest: dict[str, Any] = json.loads((out / MANIFEST_NAME).read_bytes())
        if {k: manifest.get(k) for k in params} == params:
            logger.info("%s is already prepared (manifest %s)", out, manifest_digest(manifest)[:16])
            return manifest
        raise ValueError(f"{out} already holds a different prepared corpus ({out / MANIFEST_NAME}); "
                         "give another --out or delete that directory")
    out.mkdir(parents=True, exist_ok=True)
    packer = _Packer(out, params, max_train_rows)
    packer.resume()
    skip = packer.docs
    remaining = (text for index, text in enumerate(documents) if index >= skip)
    bar = _Progress(None if max_train_rows is None else max_train_rows * (seq_len + 1),
                    packer.train_done * (seq_len + 1), progress)
    started, before = time.monotonic(), packer.train_done
    try:
        if not packer.capped:
            batch = batch_docs or (64 if workers <= 1 else 256)
            for n_docs, new in _tokenized(remaining, tok, tokenizer_name, workers, batch):
                bar.update(packer.feed(n_docs, new) * (seq_len + 1))
                if packer.capped:
                    break
    finally:
        bar.close()
    manifest = packer.finish()
    elapsed = time.monotonic() - started
    logger.info("prepared %s: %d training rows in %d shard files, %d held out; manifest %s (%.0f tokens/s)",
                out, packer.train_done, len(packer.shards), len(packer.held), manifest_digest(manifest),
                (packer.train_done - before) * (seq_len + 1) / max(elapsed, 1e-9))
    return manifest


# -------------------------------------------------------------------------------------------------- reading


def _is_url(where: str) -> bool:
    return where.startswith(("http://", "https://", "file://"))


def hub_url(source: str) -> str:
    """``hf://datasets/<owner>/<repo>[/<folder>]`` (prepared files in a hub dataset repo) as the URL of its files."""
    from asyncloco.models.hub import hub_endpoint

    parts = source[len("hf://"):].strip("/").split("/")
    if len(parts) < 3 or parts[0] != "datasets":
        raise ValueError(f"task.shards_from {source!r}: write a hub dataset repo as hf://datasets/<owner>/<repo>[/<folder>]")
    folder = "/".join(parts[3:])
    return f"{hub_endpoint()}/datasets/{parts[1]}/{parts[2]}/resolve/main" + (f"/{folder}" if folder else "")


def _fetch(source: str, name: str, dest: Path) -> None:
    """Copy ``name`` from a directory, an http(s)/file URL or a hub dataset repo (``hf://datasets/...``) to ``dest``
    (atomically)."""
    partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.startswith("hf://"):
        from asyncloco.models.hub import HubUnreachable, hub_offline, require_hub

        url = hub_url(source)
        try:
            require_hub(source, "dataset")  # offline: one line naming the fix instead of a minute of retries
        except HubUnreachable:
            repo = "/".join(source[len("hf://"):].strip("/").split("/")[1:3])
            why = "HF_HUB_OFFLINE=1 forbids reaching" if hub_offline() else "cannot be reached from here"
            raise HubUnreachable(f"the prepared corpus {source} is on the hub, which {why}; download it where the hub "
                                 f"is reachable (huggingface-cli download --repo-type dataset {repo} --local-dir DIR) "
                                 "and set task.shards_from to the folder of DIR that holds manifest.json") from None
        source = url
    try:
        if _is_url(source):
            url = f"{source.rstrip('/')}/{name}"
            try:
                with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
                    shutil.copyfileobj(response, out, _HASH_CHUNK)
            except (urllib.error.URLError, OSError) as error:
                raise ValueError(f"cannot download {url}: {error}; check task.shards_from") from None
        else:
            path = Path(source).expanduser() / name
            if not path.is_file():
                raise ValueError(f"{path} does not exist; task.shards_from must name the directory that holds the "
                                 f"prepared corpus's {MANIFEST_NAME} and shard files")
            shutil.copyfile(path, partial)
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)


class PreparedCorpus:
    """A prepared corpus as a peer reads it: verified, cached shard files, each memory-mapped on first touch."""

    def __init__(self, manifest: dict[str, Any], root: str | Path, shards_from: str | None = None) -> None:
        if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
            raise ValueError(f"{root}: not an {FORMAT} v{FORMAT_VERSION} manifest "
                             f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}); "
                             "prepare the corpus again with this version's `asyncloco data prepare`")
        self.manifest = manifest
        self.digest = manifest_digest(manifest)
        self.root = Path(root)
        self.shards_from = shards_from
        self.seq_len: int = manifest["seq_len"]
        self.row_len = self.seq_len + 1
        self.dtype = np.dtype(manifest["dtype"])
        self.rows_per_shard: int = manifest["rows_per_shard"]
        self.files: list[dict[str, Any]] = manifest["shards"]
        self.file_rows = [int(entry["rows"]) for entry in self.files]
        self._maps: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, digest: str, shards_from: str, cache_dir: str | Path) -> "PreparedCorpus":
        """The corpus named by ``digest``, its manifest fetched from ``shards_from`` unless cached."""
        root = Path(cache_dir).expanduser() / "prepared" / digest
        cached = root / MANIFEST_NAME
        found = ""
        for _ in range(2):  # a damaged cached copy is fetched again once
            if not cached.is_file():
                _fetch(shards_from, MANIFEST_NAME, cached)
            try:
                manifest = json.loads(cached.read_bytes())
                found = manifest_digest(manifest)
            except ValueError:
                found = "(not JSON)"
            if found == digest:
                return cls(manifest, root, shards_from)
            cached.unlink()
        raise CorruptShard(f"the {MANIFEST_NAME} at {shards_from} has digest {found}, not task.manifest_digest "
                           f"{digest}: task.shards_from holds another prepared corpus; point it at the one the "
                           "run names, or set task.manifest_digest to the digest `asyncloco data prepare` printed")

    @property
    def train_rows(self) -> int:
        return sum(self.file_rows)

    def check(self, tokenizer_digest: str, seq_len: int) -> None:
        tokenizer = self.manifest["tokenizer"]
        if tokenizer["digest"] != tokenizer_digest:
            raise ValueError(f"the prepared corpus {self.digest[:16]} was tokenized with {tokenizer['name']!r} "
                             f"(digest {tokenizer['digest']}), not the run's tokenizer (digest {tokenizer_digest}); "
                             f"set task.tokenizer to {tokenizer['name']!r} or prepare the corpus with the run's")
        if self.seq_len != seq_len:
            raise ValueError(f"the prepared corpus {self.digest[:16]} has seq_len {self.seq_len}, the run "
                             f"task.seq_len {seq_len}; set task.seq_len: {self.seq_len} or prepare it again")

    def _verified(self, name: str, size: int, sha256: str) -> Path:
        local = self.root / name
        if local.is_file() and local.stat().st_size == size and _file_sha256(local) == sha256:
            return local
        if local.exists():
            logger.warning("cached %s differs from manifest %s; fetching it again", local, self.digest[:16])
            local.unlink()
        if self.shards_from is None:
            raise CorruptShard(f"shard file {local} is missing or its bytes differ from manifest {self.digest[:16]} "
                               f"(sha256 expected {sha256}); delete {self.root} and prepare the corpus again")
        _fetch(self.shards_from, name, local)
        found = _file_sha256(local)
        if local.stat().st_size != size or found != sha256:
            local.unlink()
            raise CorruptShard(f"shard file {name} from {self.shards_from} does not match manifest {self.digest[:16]} "
                               f"(sha256 {found}, manifest {sha256}): the copy there is damaged or from another "
                               f"preparation; copy {name} again from the machine that prepared the corpus, "
                               "or run `asyncloco data prepare` again")
        logger.info("fetched and verified %s (%d bytes) from %s", name, size, self.shards_from)
        return local

    def _map(self, name: str, size: int, sha256: str, rows: int) -> np.ndarray:
        array = self._maps.get(name)
        if array is None:
            path = self._verified(name, size, sha256)
            array = np.memmap(path, dtype=self.dtype, mode="r", shape=(rows, self.row_len))
            self._maps[name] = array
        return array

    def shard_file(self, index: int) -> np.ndarray:
        """Shard file ``index`` as a read-only ``[rows, seq_len + 1]`` memmap (fetched and verified first)."""
        entry = self.files[index]
        return self._map(entry["file"], entry["bytes"], entry["sha256"], entry["rows"])

    def held_out(self) -> np.ndarray:
        """The held-out rows ``[rows, seq_len + 1]`` (memmap; an empty array when the manifest holds none)."""
        entry = self.manifest["held_out"]
        if not entry["rows"]:
            return np.zeros((0, self.row_len), dtype=self.dtype)
        return self._map(entry["file"], entry["bytes"], entry["sha256"], entry["rows"])

    def read_rows(self, ids: np.ndarray) -> np.ndarray:
        """Training rows by global id (``file * rows_per_shard + row``), in the order given: a fresh array."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), self.row_len), dtype=self.dtype)
        files, rows = np.divmod(ids, self.rows_per_shard)
        for file in np.unique(files):
            where = files == file
            out[where] = self.shard_file(int(file))[rows[where]]
        return out

    def __getstate__(self) -> dict[str, Any]:  # memmaps are reopened (and re-verified) in another process
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state
