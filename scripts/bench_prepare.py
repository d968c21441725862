"""Prepared corpora: `asyncloco data prepare` throughput, and a peer's memory on a 1x vs 10x corpus.

Two measurements (a benchmark, not a timed test):

1. **prepare throughput** at the 32k tokenizer (``embedded-32k``): a local JSON Lines corpus made of the embedded
   corpus's documents (real English), repeated to ``--prepare-mb`` MB, prepared with 1 worker and with
   ``--workers`` workers (each a process; the 1-worker run uses one core: ``TOKENIZERS_PARALLELISM=false``).
   Reports tokens/s and tokens/s per core (per worker process), reading the source and packing included.
2. **peer peak RSS, 1x vs 10x**: two test-made prepared corpora of ``--tokens`` and 10x ``--tokens`` training tokens
   (default 2e9 and 2e10 at ``seq_len`` 256, 16 MiB shard files). Their shard files are hard links to one block of
   random token ids, so the 10x corpus costs no extra disk: the manifest lists every file (its size and sha256), and
   a peer only ever fetches the files its leases touch. A fresh process per corpus builds the workload as a peer
   does (``task.source: prepared``, fetching from the corpus directory into its own cache), then reads the batches of
   ``--leases`` leases of ``--steps`` steps over the shards; it reports its peak RSS (``ru_maxrss``), the seconds
   from its start to its first lease's batches, and what holding the rows in memory (the old path, int32) would take.

    python scripts/bench_prepare.py                 # the full sizes (2e9 / 2e10 tokens; a few minutes)
    python scripts/bench_prepare.py --smoke         # tiny sizes, seconds (tests/test_data_prepared.py runs it)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # 1 worker = 1 core (else the Rust tokenizer uses every core)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_text_corpus(path: Path, megabytes: float) -> int:
    """The embedded corpus's documents, repeated until ``megabytes`` MB of JSON Lines: the documents written."""
    from asyncloco.models.corpus import iter_corpus_texts

    texts = list(iter_corpus_texts())
    written, count = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < megabytes * 1e6:
            for text in texts:
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line)
                count += 1
                if written >= megabytes * 1e6:
                    break
    return count


def bench_prepare(work: Path, megabytes: float, workers: list[int]) -> list[dict[str, float]]:
    from asyncloco.models.data import prepare_source

    source = work / "text.jsonl"
    docs = make_text_corpus(source, megabytes)
    results = []
    for n in workers:
        out = work / f"prepared-w{n}"
        started = time.perf_counter()
        manifest = prepare_source(out, source="json", path=str(source), tokenizer="embedded-32k", seq_len=256,
                                  workers=n, progress=False, held_out_rows=64)
        seconds = time.perf_counter() - started
        tokens = (manifest["train_rows"] + manifest["held_out"]["rows"]) * manifest["row_tokens"]  # all tokenized
        results.append({"workers": n, "docs": docs, "tokens": tokens, "seconds": seconds,
                        "tokens_per_s": tokens / seconds, "tokens_per_s_per_core": tokens / seconds / n})
    return results


def make_synthetic_corpus(out: Path, tokens: float, seq_len: int, shard_mb: float, held_out: int) -> dict:
    """A prepared corpus of ``tokens`` training tokens whose shard files are hard links to one random block."""
    from asyncloco.models.prepared import FORMAT, FORMAT_VERSION, canonical_json, rows_for_size
    from asyncloco.models.tokenizer import load_tokenizer, tokenizer_fingerprint

    tokenizer = load_tokenizer("embedded-32k")
    row_len = seq_len + 1
    rows_per_file = rows_for_size(shard_mb, seq_len, "uint16")
    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    block = rng.integers(0, len(tokenizer), size=(rows_per_file, row_len), dtype=np.uint16).tobytes()
    (out / "block.bin").write_bytes(block)
    held = rng.integers(0, len(tokenizer), size=(held_out, row_len), dtype=np.uint16).tobytes()
    (out / "heldout.bin").write_bytes(held)
    sha = hashlib.sha256(block).hexdigest()
    n_files = max(1, int(round(tokens / (rows_per_file * seq_len))))
    shards = []
    for index in range(n_files):
        name = f"train-{index:05d}.bin"
        if not (out / name).exists():
            os.link(out / "block.bin", out / name)
        shards.append({"file": name, "rows": rows_per_file, "bytes": len(block), "sha256": sha})
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "tokenizer": {"name": "embedded-32k", "digest": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id},
        "source": {"source": "synthetic", "seed": 0}, "seq_len": seq_len, "row_tokens": row_len, "dtype": "uint16",
        "rows_per_shard": rows_per_file, "held_out_rule": {"rows": held_out, "every": 1}, "max_train_rows": None,
        "train_rows": n_files * rows_per_file, "train_tokens": n_files * rows_per_file * seq_len, "shards": shards,
        "held_out": {"file": "heldout.bin", "rows": held_out, "bytes": len(held), "sha256": hashlib.sha256(held).hexdigest()},
    }
    (out / "manifest.json").write_bytes(canonical_json(manifest))
    return manifest


def peer_child(spec: dict) -> None:
    """One peer's data path on a prepared corpus: build the workload, read ``leases`` leases' batches."""
    started = time.perf_counter()
    from asyncloco.config import RunConfig
    from asyncloco.workloads import build_workload

    cfg = RunConfig.model_validate({"task": spec["task"]})
    workload = build_workload(cfg)
    first = None
    shards = len(workload.shard_sizes())
    for lease in range(spec["leases"]):
        shard = lease % shards
        start = (lease // shards) * spec["steps"]
        for j in range(spec["steps"]):
            batch = workload.batch(shard, start + j)
            assert batch.shape == (cfg.task.batch_size, cfg.task.seq_len + 1)  # type: ignore[union-attr]
        if first is None:
            first = time.perf_counter() - started
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rss_mb": rss_mb, "first_lease_s": first, "total_s": time.perf_counter() - started}))


def bench_peer(work: Path, corpus: Path, manifest: dict, label: str, args: argparse.Namespace) -> dict:
    from asyncloco.models.prepared import manifest_digest

    task = {"kind": "lm", "model": "tiny", "tokenizer": "embedded-32k", "source": "prepared",
            "manifest_digest": manifest_digest(manifest), "shards_from": str(corpus), "seq_len": manifest["seq_len"],
            "batch_size": args.batch_size, "num_shards": args.num_shards, "val_sequences": 64,
            "cache_dir": str(work / f"peer-cache-{label}")}
    spec = {"task": task, "leases": args.leases, "steps": args.steps}
    proc = subprocess.run([sys.executable, __file__, "--peer-child", json.dumps(spec)], capture_output=True, text=True,
                          cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"peer child failed:\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update({"label": label, "tokens": manifest["train_tokens"], "files": len(manifest["shards"]),
                   "in_memory_int32_mb": manifest["train_rows"] * manifest["row_tokens"] * 4 / 2**20})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: runs in seconds")
    parser.add_argument("--tokens", type=float, default=2e9, help="training tokens of the 1x corpus (default 2e9)")
    parser.add_argument("--prepare-mb", type=float, default=20.0, help="MB of text to prepare (default 20)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers of the parallel prepare")
    parser.add_argument("--leases", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-shards", type=int, default=16)
    parser.add_argument("--out", help="work directory (default: a temporary one)")
    parser.add_argument("--peer-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peer_child:
        peer_child(json.loads(args.peer_child))
        return 0
    if args.smoke:
        args.tokens, args.prepare_mb, args.leases, args.steps, args.batch_size, args.num_shards = 2e6, 0.3, 2, 5, 8, 2
    work = Path(args.out or tempfile.mkdtemp(prefix="bench-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    workers = [1] if args.smoke or args.workers <= 1 else [1, args.workers]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (a loaded machine measures low)")
    for row in bench_prepare(work, args.prepare_mb, workers):
        print(f"prepare: {row['workers']} worker(s), {row['docs']:,} documents, {row['tokens']:,} tokens in "
              f"{row['seconds']:.1f} s: {row['tokens_per_s']:,.0f} tokens/s, "
              f"{row['tokens_per_s_per_core']:,.0f} tokens/s per core (embedded-32k)")
    shard_mb = 0.5 if args.smoke else 16.0
    for label, tokens in (("1x", args.tokens), ("10x", 10 * args.tokens)):
        corpus = work / f"corpus-{label}"
        manifest = make_synthetic_corpus(corpus, tokens, 256, shard_mb, 64)
        row = bench_peer(work, corpus, manifest, label, args)
        print(f"peer {label}: {row['tokens']:,} tokens in {row['files']:,} shard files: peak RSS {row['rss_mb']:.0f} MB, "
              f"first lease's batches after {row['first_lease_s']:.1f} s ({args.leases} leases x {args.steps} steps "
              f"in {row['total_s']:.1f} s); rows in memory (int32, the old path) would be "
              f"{row['in_memory_int32_mb']:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
