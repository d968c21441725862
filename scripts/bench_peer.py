"""Throughput of the peer's inner loop vs a plain transformers + torch training loop, side by side.

Both train the same Llama preset (same initial weights, same random token batches, same AdamW
hyper-parameters and gradient clipping) on the same device. "peer" is
:class:`asyncloco.train.inner.InnerTrainer` exactly as a peer runs a lease (θ load, per-step LR
schedule, batches from a workload, on-step timing callback, pseudo-gradient at the end); "plain" is the
loop anyone would write: ``model(input_ids=..., labels=...)``, ``backward``, clip, ``step``. The two are
timed alternately, ``--repeats`` times each, and the median tokens/s of each is compared, so a busy
machine slows both alike.

    python scripts/bench_peer.py --model tiny            # ratio printed; goal: peer within 5 % of plain
    python scripts/bench_peer.py --model 20m --device cuda --precision bf16 --json runs/bench/peer-20m.json
    python scripts/bench_peer.py --model 60m --commitments --steps 2 --repeats 3   # what a lease's commitments cost

``--commitments`` also times what the inner-state commitments (``runtime.verify`` with ``inner_state: carry``, the
default) add to every lease, as the peer runs them (peer/reveal.py ``RevealStore``: the start's digest, the lease's
end state laid out and hashed), beside a memcpy of θ and the lease's own training time; ``commit_path_s`` is the part
on the training's path (the layouts; the peer hashes in a thread while its next lease trains).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

from asyncloco.algo.schedule import ShardSchedule
from asyncloco.models.lm import causal_lm_loss
from asyncloco.models.presets import PRESETS, build_causal_lm
from asyncloco.models.workload import Workload, flatten_params
from asyncloco.peer.distributed import validate_device
from asyncloco.train.inner import InnerTrainer

VOCAB = 4096  # the 4,096-entry embedded tokenizer's size (tiny, small)


def vocab_for(preset: str) -> int:
    """The vocabulary a preset trains with by default: the paper's 32,000 for 20m/60m/150m (the shipped
    ``embedded-32k`` tokenizer, asyncloco/models/tokenizer.py), else ``VOCAB`` — so the parameter counts are the
    paper's (21.2 M / 59.3 M / 151.2 M)."""
    return PRESETS[preset].vocab_size or VOCAB


class RandomTokens(Workload):
    """Fixed random token rows: the data pipeline is not what is measured."""

    name = "random-tokens"

    def __init__(self, preset: str, batch_size: int, seq_len: int, batches: int, seed: int = 0) -> None:
        self.preset, self.seq_len, self.vocab = preset, seq_len, vocab_for(preset)
        self.units_per_step = batch_size * seq_len
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, self.vocab, (batches, batch_size, seq_len + 1), generator=generator)

    def build_model(self, seed: int) -> nn.Module:
        return build_causal_lm(self.preset, vocab_size=self.vocab, seq_len=self.seq_len, seed=seed)

    def shard_sizes(self) -> list[int]:
        return [len(self.rows)]

    def batch(self, shard: int, index: int) -> torch.Tensor:
        return self.rows[index % len(self.rows)]

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(model, batch)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": float("nan")}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_peer(trainer: InnerTrainer, theta: torch.Tensor, steps: int, offset: int, timed: bool = True) -> tuple[float, float]:
    """(wall, CPU) seconds for one lease of ``steps`` steps, as a peer runs it (θ in, pseudo-gradient out);
    ``timed``: with the per-step callback a peer always passes (on a GPU: a wait on the previous step's CUDA event
    per step, train/device_io.py; a stream synchronisation per step before that)."""
    seconds: list[float] = []
    _sync(trainer.device)
    started, cpu = time.perf_counter(), time.process_time()
    trainer.run(theta, 0, offset, steps, offset, on_step=seconds.append if timed else None)
    _sync(trainer.device)
    return time.perf_counter() - started, time.process_time() - cpu


def time_plain(
    model: nn.Module, optimizer: torch.optim.Optimizer, workload: RandomTokens, device: torch.device,
    steps: int, offset: int, precision: str, grad_clip: float,
) -> tuple[float, float]:
    """(wall, CPU) seconds for ``steps`` steps of the textbook transformers + torch loop."""
    model.train()
    _sync(device)
    started, cpu = time.perf_counter(), time.process_time()
    for j in range(steps):
        rows = workload.batch(0, offset + j).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(input_ids=rows[:, :-1]).logits
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    _sync(device)
    return time.perf_counter() - started, time.process_time() - cpu


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = validate_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    workload = RandomTokens(args.model, args.batch_size, args.seq_len, batches=args.steps * 2)
    lr, betas, weight_decay, grad_clip = 1e-3, (0.9, 0.999), 0.1, 1.0
    # constant lr (warmup 0, min = max): both loops step with the same lr
    trainer = InnerTrainer(workload, ShardSchedule(lr, lr, 0, 10**9), seed=0, optimizer="adamw", betas=betas,
                           weight_decay=weight_decay, grad_clip=grad_clip, device=device, precision=args.precision)
    theta = flatten_params(trainer.model).cpu()
    plain_model = workload.build_model(seed=0).to(device)
    plain_optimizer = torch.optim.AdamW(plain_model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    numel = sum(p.numel() for p in plain_model.parameters())
    tokens = args.steps * workload.units_per_step

    for _ in range(args.warmup):  # allocator, kernels, caches
        time_peer(trainer, theta, args.steps, 0)
        time_plain(plain_model, plain_optimizer, workload, device, args.steps, 0, args.precision, grad_clip)
    peer_rates, plain_rates, peer_cpu, plain_cpu, untimed_rates = [], [], [], [], []
    for repeat in range(args.repeats):
        # alternate which goes first, so a slow phase of a shared machine hits both alike
        order: tuple[str, ...] = ("peer", "plain") if repeat % 2 == 0 else ("plain", "peer")
        if args.untimed:
            order = (*order, "untimed") if repeat % 2 == 0 else ("untimed", *order)
        for which in order:
            if which == "untimed":
                wall, _ = time_peer(trainer, theta, args.steps, repeat, timed=False)
                untimed_rates.append(tokens / wall)
            elif which == "peer":
                wall, cpu = time_peer(trainer, theta, args.steps, repeat)
                peer_rates.append(tokens / wall)
                peer_cpu.append(tokens / cpu)
            else:
                wall, cpu = time_plain(plain_model, plain_optimizer, workload, device, args.steps, repeat,
                                       args.precision, grad_clip)
                plain_rates.append(tokens / wall)
                plain_cpu.append(tokens / cpu)
    peer, plain = statistics.median(peer_rates), statistics.median(plain_rates)
    commitments = time_commitments(trainer, theta, device, args.repeats, tokens / peer) if args.commitments else {}
    untimed = {}
    if untimed_rates:  # the per-step callback's cost: the peer's loop without it
        untimed = {"peer_untimed_tokens_per_s": statistics.median(untimed_rates),
                   "untimed_ratio": statistics.median(untimed_rates) / plain, "untimed_samples": untimed_rates}
    return {
        "model": args.model,
        "parameters": numel,
        "vocab_size": workload.vocab,
        "device": str(device),
        "precision": args.precision,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "peer_tokens_per_s": peer,
        "plain_tokens_per_s": plain,
        "ratio": peer / plain,
        # tokens per CPU-second of this process: on a machine shared with other jobs, less noisy than wall
        "peer_tokens_per_cpu_s": statistics.median(peer_cpu),
        "plain_tokens_per_cpu_s": statistics.median(plain_cpu),
        "cpu_ratio": statistics.median(peer_cpu) / statistics.median(plain_cpu),
        "peer_samples": peer_rates,
        "plain_samples": plain_rates,
        **untimed,
        **commitments,
    }


def time_commitments(trainer: InnerTrainer, theta: torch.Tensor, device: torch.device, repeats: int,
                     lease_s: float) -> dict[str, Any]:
    """Per lease, what the peer's commitments add (peer/runner.py ``_train``): ``hold`` of the start state before the
    training and ``hold_end`` after it, a step of training between them (it changes the state, as a lease does);
    side by side with a host memcpy of θ."""
    from asyncloco.peer.reveal import RevealStore

    store = RevealStore(keep=2)
    scratch = torch.empty_like(theta)
    costs, paths, copies = [], [], []
    for repeat in range(repeats + 1):
        lease_id = f"lease-{repeat}"
        _sync(device)
        began = time.perf_counter()
        start = store.hold_deferred(lease_id, trainer.optimizer)
        held = time.perf_counter()
        trainer.run(theta, 0, 0, 1, 0)
        _sync(device)
        trained = time.perf_counter()
        end = store.hold_end_deferred(lease_id, trainer.optimizer)
        _sync(device)
        laid = time.perf_counter()
        assert start is not None and end is not None
        start.result(), end.result()  # the hashing, which the runner leaves to run beside the next lease
        if repeat:  # the first lease starts from a fresh state: not the steady case
            paths.append((held - began) + (laid - trained))
            costs.append((held - began) + (time.perf_counter() - trained))
        copy_began = time.perf_counter()
        scratch.copy_(theta)
        copies.append(time.perf_counter() - copy_began)
    commit, memcpy = statistics.median(costs), statistics.median(copies)
    return {"commit_s": commit, "memcpy_theta_s": memcpy, "commit_memcpy_ratio": commit / memcpy,
            "lease_s": lease_s, "commit_lease_fraction": commit / (commit + lease_s), "commit_samples": costs,
            "commit_path_s": statistics.median(paths), "commit_path_samples": paths, "commit_layouts": store.laid_out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed lease")
    parser.add_argument("--repeats", type=int, default=9, help="timed leases per loop (median taken)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed leases per loop first")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine two threads spread the samples "
                        "by 10x; 0 = torch's default)")
    parser.add_argument("--untimed", action="store_true",
                        help="also time the peer's loop without the per-step callback (what per-step timing costs it)")
    parser.add_argument("--commitments", action="store_true",
                        help="also time the inner-state commitments a lease adds (verification's default, carry)")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny, 2 timed leases of 2 steps of 4 × 16 "
                        "tokens, 1 thread (tests/test_bench_peer.py)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.repeats, args.warmup, args.batch_size, args.seq_len, args.threads = "tiny", 2, 2, 1, 4, 16, 1
    for name in ("batch_size", "seq_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        result = run(args)
    except ValueError as error:
        print(f"bench_peer: error: {error}", file=sys.stderr)
        return 2
    print(f"model {result['model']} ({result['parameters'] / 1e6:.2f} M parameters, vocabulary {result['vocab_size']}), {result['device']}, "
          f"{result['precision']}, batch {result['batch_size']} × {result['seq_len']} tokens, "
          f"{result['repeats']} × {result['steps_per_repeat']} steps each, {result['threads']} threads")
    print(f"{'loop':8s} {'tokens/s (median)':>18s} {'tokens/CPU-s':>13s}")
    for loop in ("peer", "plain"):
        print(f"{loop:8s} {result[loop + '_tokens_per_s']:18.0f} {result[loop + '_tokens_per_cpu_s']:13.0f}")
    print(f"ratio peer / plain: {result['ratio']:.3f}  (goal: >= 0.95); per CPU-second: {result['cpu_ratio']:.3f}")
    if "untimed_ratio" in result:
        print(f"peer without the per-step callback: {result['peer_untimed_tokens_per_s']:.0f} tokens/s, "
              f"ratio {result['untimed_ratio']:.3f}")
    if "commit_s" in result:
        print(f"commitments per lease: {result['commit_s']:.3f} s = {result['commit_memcpy_ratio']:.1f} x a memcpy of θ "
              f"({result['memcpy_theta_s'] * 1000:.1f} ms), {100 * result['commit_lease_fraction']:.1f} % of a lease of "
              f"{result['steps_per_repeat']} steps ({result['lease_s']:.3f} s of training); on the training's path (the "
              f"hash left to its thread): {result['commit_path_s']:.3f} s")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
