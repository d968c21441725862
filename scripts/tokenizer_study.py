#!/usr/bin/env python
"""The two shipped tokenizers at one model size, like for like: validation bits per byte at equal training text.

Per-token perplexity cannot compare a 4,096-entry vocabulary with a 32,000-entry one (a 32k token covers more text),
so this trains the same preset (same seed, same AdamW, batch and sequence length) once with each shipped tokenizer
(asyncloco/models/tokenizer.py: ``embedded``, ``embedded-32k``) on the embedded corpus, each for the number of steps
that feeds it ``--train-bytes`` of text, and reports bits per byte on its held-out rows (the loss in nats summed over
the rows' tokens, / ln 2, / the UTF-8 bytes those tokens decode to), the parameter count and the wall time. One
process, plain torch loop: it measures the vocabulary, not the runtime.

    python scripts/tokenizer_study.py --model 20m --train-bytes 500000 --json runs/tokenizer-study.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

from asyncloco.models.config import LMTaskConfig
from asyncloco.models.lm import build_lm_workload, causal_lm_loss
from asyncloco.models.presets import PRESETS


def bytes_of(tokenizer: Any, rows: torch.Tensor) -> int:
    """UTF-8 bytes the predicted tokens (each row's last seq_len) decode to."""
    return sum(len(tokenizer.decode(row[1:].tolist()).encode("utf-8")) for row in rows)


def run_one(args: argparse.Namespace, tokenizer_name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = LMTaskConfig(model=args.model, tokenizer=tokenizer_name, seq_len=args.seq_len, batch_size=args.batch_size,
                       num_shards=1, val_sequences=args.val_sequences, seed=0)
    workload = build_lm_workload(cfg)
    model = workload.build_model(seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    train_rows = workload.rows[workload.shard_ids[0][: args.batch_size * 16]]
    bytes_per_token = bytes_of(workload.tokenizer, train_rows) / (train_rows.shape[0] * args.seq_len)
    steps = max(1, math.ceil(args.train_bytes / (bytes_per_token * args.batch_size * args.seq_len)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, steps // 10)))
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        loss = causal_lm_loss(model, workload.batch(0, step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    seconds = time.perf_counter() - started
    model.eval()
    val = workload.rows[workload.val_ids]
    with torch.no_grad():
        nats = float(causal_lm_loss(model, val, reduction="sum"))
    val_bytes = bytes_of(workload.tokenizer, val)
    tokens = val.shape[0] * args.seq_len
    return {
        "tokenizer": tokenizer_name, "vocab_size": len(workload.tokenizer), "parameters": parameters,
        "bytes_per_token": bytes_per_token, "steps": steps, "train_seconds": seconds,
        "val_loss_per_token": nats / tokens, "val_perplexity": math.exp(min(nats / tokens, 700.0)),
        "val_bits_per_byte": nats / math.log(2) / val_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="20m")
    parser.add_argument("--train-bytes", type=int, default=500_000, help="training text per tokenizer, in UTF-8 bytes")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--val-sequences", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny, 4 kB of text, 4 validation rows (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.train_bytes, args.seq_len, args.batch_size, args.val_sequences = "tiny", 4_000, 32, 2, 4
    torch.set_num_threads(args.threads)
    results = [run_one(args, name) for name in ("embedded", "embedded-32k")]
    print(f"model {args.model}, {args.train_bytes:,} bytes of training text each, batch {args.batch_size} × {args.seq_len}")
    print(f"{'tokenizer':14s} {'vocab':>6s} {'parameters':>11s} {'bytes/token':>11s} {'steps':>6s} {'train s':>8s} "
          f"{'val ppl':>9s} {'val bits/byte':>13s}")
    for r in results:
        print(f"{r['tokenizer']:14s} {r['vocab_size']:6d} {r['parameters']:11,d} {r['bytes_per_token']:11.2f} {r['steps']:6d} "
              f"{r['train_seconds']:8.1f} {r['val_perplexity']:9.1f} {r['val_bits_per_byte']:13.3f}")
    ratio = results[1]["val_bits_per_byte"] / results[0]["val_bits_per_byte"]
    print(f"bits per byte, 32k / 4k: {ratio:.3f}; train time, 32k / 4k: "
          f"{results[1]['train_seconds'] / results[0]['train_seconds']:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "bits_per_byte_ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
