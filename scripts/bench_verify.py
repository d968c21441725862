"""Verification's determinism and cost (asyncloco/coordinator/verify.py).

Part 1, ``--sizes``: for each model preset, a peer with ``runtime.verify.inner_state: reset`` trains two leases
(so its inner AdamW state has history), then a lease of ``--steps`` steps; the coordinator's re-run (a separate
replica, fresh state, the run's codec) is compared with it — bitwise on CPU — and the seconds per step of the peer
and of the re-run are printed side by side. A re-run costs what the peer's lease cost on the same hardware, so
verification's compute is (leases re-run) ÷ (leases applied) of the run's training compute.

Part 2, ``--runtime``: the real coordinator daemon and peer runners over the in-memory transport (toy task), honest
peers only, verification on at ``--fraction`` with a probation of ``--probation``, ``--inner-state carry`` (the
default: chosen leases are re-run from the start states the peers reveal) or ``reset``: how many leases were re-run, the
re-runs' compute as a fraction of the peers' training compute (inner steps and measured seconds), the latency from
submission to verdict, and that every honest verdict matched (none flagged).

    python scripts/bench_verify.py --sizes tiny 20m --steps 2 --runtime --json runs/bench-verify.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncloco.config import RunConfig
from asyncloco.coordinator.logic import Lease
from asyncloco.coordinator.rerun import Rerunner, compare
from asyncloco.train.inner import InnerTrainer
from asyncloco.workloads import build_workload

logger = logging.getLogger("bench_verify")


def lm_config(preset: str, batch: int, seq_len: int, codec: str, inner_state: str = "reset") -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "lm", "model": preset, "source": "embedded", "seq_len": seq_len, "batch_size": batch,
                 "num_shards": 4, "val_sequences": 16},
        "inner": {"lr": 4e-4, "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 1.0},
        "runtime": {"codec": codec, "verify": {"enabled": True, "inner_state": inner_state}},
    })


def bench_size(preset: str, steps: int, batch: int, seq_len: int, codec: str) -> dict[str, Any]:
    cfg = lm_config(preset, batch, seq_len, codec)
    workload = build_workload(cfg)
    peer = InnerTrainer.from_config(cfg, workload)
    theta = peer.full_params()
    peer.run(theta, 0, 0, 1, 0)
    peer.run(theta, 2, 0, 1, 0)
    started = time.perf_counter()
    submitted = peer.run(theta, 1, 3, steps, 3).pseudo_gradient
    peer_s = time.perf_counter() - started
    if codec != "none":
        from asyncloco.transport.codecs import decode, encode

        submitted = decode(encode(codec, submitted), submitted.numel())
    lease = Lease("L1", "p", 1, 3, steps, 3, 0, 0.0, 0.0, 0.0)
    rerunner = Rerunner(cfg, workload)
    rerunner.rerun(Lease("L0", "p", 0, 0, 1, 0, 0, 0.0, 0.0, 0.0), theta)  # warm, as the verifier's kept replica is
    started = time.perf_counter()
    rerun = rerunner.rerun(lease, theta)
    rerun_s = time.perf_counter() - started
    verdict = compare(rerun, submitted)
    carried = bench_carried(preset, steps, batch, seq_len, codec, workload)
    return {"preset": preset, "params": int(theta.numel()), "steps": steps, "batch": batch, "seq_len": seq_len,
            "codec": codec, "bitwise": verdict.bitwise, "rel_error": verdict.rel_error,
            "peer_s_per_step": peer_s / steps, "rerun_s_per_step": rerun_s / steps, **carried}


def bench_carried(preset: str, steps: int, batch: int, seq_len: int, codec: str, workload: Any) -> dict[str, Any]:
    """``inner_state: carry``: the peer's lease from a carried state, and the verifier's re-run from the revealed
    start and end states (digest checks, load, re-run, end digest: Rerunner.check_revealed) — its seconds and verdict."""
    from asyncloco.coordinator.logic import Verify
    from asyncloco.train.commitments import inner_state_chunks, pack_parts

    cfg = lm_config(preset, batch, seq_len, codec, "carry")
    peer = InnerTrainer.from_config(cfg, workload)
    theta = peer.full_params()
    peer.run(theta, 0, 0, 1, 0)
    peer.run(theta, 2, 0, 1, 0)
    revealed = b"".join(inner_state_chunks(peer.optimizer) or [])
    start = peer.state_digest()
    started = time.perf_counter()
    submitted = peer.run(theta, 1, 3, steps, 3).pseudo_gradient
    peer_s = time.perf_counter() - started
    end = peer.state_digest()
    revealed = pack_parts(revealed, b"".join(inner_state_chunks(peer.optimizer) or []))  # start and end (peer/reveal.py)
    if codec != "none":
        from asyncloco.transport.codecs import decode, encode

        submitted = decode(encode(codec, submitted), submitted.numel())
    rerunner = Rerunner(cfg, workload)
    rerunner.rerun(Lease("L0", "p", 0, 0, 1, 0, 0, 0.0, 0.0, 0.0), theta)  # warm
    lease = Lease("L1", "p", 1, 3, steps, 3, 0, 0.0, 0.0, 0.0)
    started = time.perf_counter()
    verdict = rerunner.check_revealed(Verify("p", lease, theta, submitted, "bench", "", start or "", end or ""), revealed)
    check_s = time.perf_counter() - started
    return {"carry_bitwise": verdict.bitwise and verdict.ok, "carry_peer_s_per_step": peer_s / steps,
            "carry_check_s_per_step": check_s / steps, "revealed_bytes": len(revealed)}


def toy_runtime_config(fraction: float, probation: int, inner_state: str = "carry") -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 64, "hidden": 32, "points": 4096, "eval_points": 64, "num_shards": 4, "batch_size": 32},
        "inner": {"lr": 1e-2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 10, "grace_period": 0.0},
        "outer": {"buffer_size": 3},
        "sim": {"workers": 3},
        "runtime": {
            "gate": {"enabled": False},  # measured alone: the gate's refusals are another question (bench_attacks.py)
            "snapshot_every": 20, "eval_every": 100000, "lease_slack": 30.0, "speed_report_period": 600.0,
            "verify": {"enabled": True, "inner_state": inner_state, "fraction": fraction, "probation_updates": probation,
                       "queue": 64},
        },
    })


async def _runtime(cfg: RunConfig, peers: int, rounds: int, directory: Path) -> dict[str, Any]:
    from asyncloco.clock import FakeClock
    from asyncloco.peer.runner import PeerOptions, PeerRunner
    from asyncloco.testing.memory import MemoryClient, MemoryTransport, as_actor, drive
    from asyncloco.transport.rpc import TrafficCounters

    clock = FakeClock()
    transport = MemoryTransport(cfg, directory, clock=clock)
    await transport.start()
    runners = {}
    tasks = {}
    try:
        for index in range(peers):
            name = f"h{index}"
            options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                                  progress=False, max_rounds=rounds)
            runner = PeerRunner(options, clock=clock)
            runner.summary.peer_id = name
            runner.speed = 1000.0
            counters = TrafficCounters()
            trainer = InnerTrainer.from_config(cfg, transport.workload)
            tasks[name] = as_actor(name, runner.serve(MemoryClient(transport, name, counters=counters), transport.publisher(name, f"k{name}"),
                                                      cfg, transport.workload, trainer, cfg.runtime.codec, counters))
            runners[name] = runner
        await drive(clock, tasks, real_timeout=600.0)
        daemon = transport.daemon
        assert daemon is not None and daemon.verification is not None
        await asyncio.wait_for(daemon.verification.drain(), timeout=600.0)
        status = daemon.verification.status()
        train_s = sum(r.summary.timing.get("train", 0.0) for r in runners.values())
        peer_steps = sum(r.summary.steps for r in runners.values())
        return {"peers": peers, "rounds": rounds, "fraction": cfg.runtime.verify.fraction, "inner_state": cfg.runtime.verify.inner_state,
                "probation": cfg.runtime.verify.probation_updates, "leases": sum(r.summary.rounds for r in runners.values()),
                "applied_steps": daemon.node.state.local_updates, "peer_steps": peer_steps, "peer_train_s": train_s,
                "verification": status, "compute_fraction_seconds": status["busy_s"] / train_s if train_s else None}
    finally:
        if transport.daemon is not None and transport.daemon.verification is not None:
            await transport.daemon.verification.close()
        await transport.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=[], help="model presets for part 1 (tiny, 20m, 60m, 150m)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--codec", default="none")
    parser.add_argument("--runtime", action="store_true", help="part 2: the in-memory runtime with honest peers")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--fraction", type=float, default=0.08, help="runtime.verify.fraction (its default)")
    parser.add_argument("--probation", type=int, default=2, help="runtime.verify.probation_updates (its default)")
    parser.add_argument("--inner-state", choices=("carry", "reset"), default="carry",
                        help="part 2: carry (the default: leases re-run from revealed start states) or reset")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny, 2 steps of 16 tokens, and the runtime "
                        "with 2 peers × 6 leases (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.steps, args.batch, args.seq_len = ["tiny"], 2, 1, 16
        args.runtime, args.peers, args.rounds = True, 2, 6
    logging.basicConfig(level=logging.ERROR)
    torch.manual_seed(0)
    out: dict[str, Any] = {"sizes": [], "runtime": None, "threads": torch.get_num_threads()}
    write = sys.stdout.write
    if args.sizes:
        write(f"{'preset':<7} {'params':>11} {'steps':>5} {'codec':>5} {'bitwise':>7} {'rel err':>8} "
              f"{'peer s/step':>11} {'re-run s/step':>13} {'re-run/peer':>11} {'carry: bitwise':>14} "
              f"{'check/peer':>10} {'revealed MB':>11}\n")
    for preset in args.sizes:
        row = bench_size(preset, args.steps, args.batch, args.seq_len, args.codec)
        out["sizes"].append(row)
        write(f"{row['preset']:<7} {row['params']:>11,} {row['steps']:>5} {row['codec']:>5} {str(row['bitwise']):>7} "
              f"{row['rel_error']:>8.2g} {row['peer_s_per_step']:>11.3f} {row['rerun_s_per_step']:>13.3f} "
              f"{row['rerun_s_per_step'] / row['peer_s_per_step']:>11.2f} {str(row['carry_bitwise']):>14} "
              f"{row['carry_check_s_per_step'] / row['carry_peer_s_per_step']:>10.2f} {row['revealed_bytes'] / 1e6:>11.1f}\n")
    if args.runtime:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = toy_runtime_config(args.fraction, args.probation, args.inner_state)
            row = asyncio.run(_runtime(cfg, args.peers, args.rounds, Path(tmp) / "run"))
        out["runtime"] = row
        v = row["verification"]
        write(f"\nruntime (toy, {row['peers']} honest peers × {row['rounds']} leases, fraction {row['fraction']}, "
              f"probation {row['probation']}, inner state {row['inner_state']}):\n")
        write(f"  leases {row['leases']}, re-run {v['checked']} (skipped {v['skipped']}), failed {v['failed']}, "
              f"expelled {len(v['expelled'])}; reveals {v['reveals']}\n")
        write(f"  compute: re-run steps ÷ applied steps {v['compute_fraction']:.3f}; re-run seconds ÷ peers' training "
              f"seconds {row['compute_fraction_seconds']:.3f}\n")
        write(f"  latency submission → verdict: median {v['latency_median_s']:.3f} s, max {v['latency_max_s']:.3f} s "
              f"(real seconds, in-memory transport)\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
