"""How much an honest lease moves the gate's probe loss, by the lease's length: the figure behind the probe margin's
scaling with steps (coordinator/gate.py ``_probe_margin``; docs/threat-model.md, "The probe").

The gate's probe (coordinator/probe.py) compares the loss on a fixed held-out batch at θ and at θ − 0.2·Δ. In the
gray zone an established peer's update must lower it by ``probe_margin`` and a rise of more than
``probe_count_factor`` × the margin counts toward quarantine. A short lease moves θ less, so the margin shrinks with
its steps — but by how much? This script trains honest leases of several lengths from one θ (each on its own shard
and offset, the inner AdamW state either carried from a full lease before it, as a peer's is, or fresh) and prints
the distribution of the probe's relative change for each length, with the share of honest leases each margin rule
would reject and count toward quarantine.

    python scripts/probe_noise.py --config configs/demo.yaml --warm-steps 300 --samples 24 --json runs/probe-noise.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

from asyncloco.config import load_config  # noqa: E402
from asyncloco.coordinator.gate import GatePolicy, probe_margin  # noqa: E402
from asyncloco.coordinator.probe import Probe  # noqa: E402
from asyncloco.models.workload import flatten_params  # noqa: E402
from asyncloco.train.inner import InnerTrainer  # noqa: E402
from asyncloco.workloads import build_workload  # noqa: E402

RULES: dict[str, Callable[[float, int, int], float]] = {
    "linear (steps / max_local_steps; the old rule)": lambda m, s, full: m * min(1.0, s / full),
    "square root (the rule now)": lambda m, s, full: probe_margin(GatePolicy(probe_margin=m, full_steps=full), s),
}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)
    full = cfg.schedule.max_local_steps
    probe = Probe(workload, model, cfg.runtime.gate.probe_sequences)
    shards = cfg.task.num_shards
    started = time.perf_counter()
    trainer = InnerTrainer.from_config(cfg, workload)
    theta = flatten_params(model).clone()
    for shard in range(shards):  # θ: a warm model, trained over every shard (the probe is meaningless at θ₀)
        theta = theta - trainer.run(theta, shard, 0, args.warm_steps // shards, 0).pseudo_gradient
    before = probe.losses(0, theta, torch.zeros_like(theta))[0]
    rows: dict[str, dict[str, list[float]]] = {}
    for mode in args.modes:
        rows[mode] = {}
        for steps in args.steps:
            changes = []
            for k in range(args.samples):
                shard, offset = k % shards, 1000 + 97 * k
                trainer = InnerTrainer.from_config(cfg, workload)
                trainer.reset_state = mode == "fresh"
                if mode == "carried":  # the peer's previous lease leaves its AdamW state
                    trainer.run(theta, shard, offset - full, full, offset - full)
                delta = trainer.run(theta, shard, offset, steps, offset).pseudo_gradient
                b, a = probe.losses(0, theta, delta, cfg.runtime.gate.probe_step)
                changes.append(100.0 * (a - b) / b)
            rows[mode][str(steps)] = changes
            print(f"{mode:8s} {steps:3d} steps: probe change % median {quantile(changes, 0.5):+.4f} "
                  f"p95 {quantile(changes, 0.95):+.4f} max {max(changes):+.4f}", flush=True)
    margin = cfg.runtime.gate.probe_margin
    factor = GatePolicy().probe_count_factor
    verdicts: dict[str, Any] = {}
    for rule, fn in RULES.items():
        verdicts[rule] = {}
        for mode, by_steps in rows.items():
            for steps, changes in by_steps.items():
                m = 100.0 * fn(margin, int(steps), full)
                verdicts[rule][f"{mode}/{steps}"] = {
                    "margin_pct": m,
                    "not_lowered_by_margin": sum(c > -m for c in changes) / len(changes),
                    "rise_above_margin": sum(c > m for c in changes) / len(changes),
                    "counted": sum(c > factor * m for c in changes) / len(changes),
                }
    for rule, table in verdicts.items():
        print(f"\n{rule}: share of honest leases (gray zone, established peer)")
        print(f"{'lease':>14} {'margin %':>10} {'not lowered':>12} {'rise > m':>9} {'counted':>8}")
        for key, v in table.items():
            print(f"{key:>14} {v['margin_pct']:10.4f} {v['not_lowered_by_margin']:12.2f} {v['rise_above_margin']:9.2f} "
                  f"{v['counted']:8.2f}")
    return {
        "config": args.config, "warm_steps": args.warm_steps, "samples": args.samples, "probe_loss_at_theta": before,
        "max_local_steps": full, "probe_margin": margin, "probe_count_factor": factor,
        "changes_pct": rows, "verdicts": verdicts, "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--warm-steps", type=int, default=300, help="inner steps (over all shards) that warm θ up first")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 5, 10, 30])
    parser.add_argument("--modes", nargs="+", choices=["carried", "fresh"], default=["carried", "fresh"])
    parser.add_argument("--samples", type=int, default=24, help="leases per length and mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="seconds of work: one lease of 1 and of 30 steps per mode "
                        "after 8 warm steps, 1 thread (tests/test_gate_probe.py)")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.steps, args.warm_steps, args.threads = 1, [1, 30], 8, 1
    result = measure(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(f"\n{result['seconds']:.0f} s" + (f"; wrote {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
