#!/usr/bin/env python
"""The paper's claim over emulated wide-area links: sync DiLoCo vs async DiLoCo vs async DN + DyLU,
and fp32 vs int8 vs int4 pseudo-gradients — same model (``tiny``), same peers (heterogeneous compute via
``--slowdown`` and heterogeneous links: profile per peer), same wall-time budget from the first lease.

    sudo python scripts/bench_wan.py                      # full: 5 runs x --budget (default 120 s) + start-up
    sudo python scripts/bench_wan.py --budget 60 --quick  # the 3 methods only, int8
    sudo python scripts/bench_wan.py --budget 60 --reuse  # then add the codec runs to those

Prints a table (validation perplexity at the budget and at equal wall time, time to reach sync DiLoCo's
final perplexity, updates applied, leases expired), writes ``<out>/bench_wan.json`` and
``<out>/perplexity_vs_time.png``. Needs root and ``ip netns`` (exits 2 with the reason otherwise).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncloco.wan.netns import namespaces_unavailable  # noqa: E402
from asyncloco.wan.run import parse_peers, run_wan  # noqa: E402

LABELS = {"sync_diloco": "Sync DiLoCo", "async_diloco": "Async DiLoCo", "async_dn_dylu": "Async DN + DyLU"}


def bench_config(method: str, codec: str, peers: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": f"wan-{method}-{codec}",
        "seed": 0,
        "task": {"kind": "lm", "model": "tiny", "source": "embedded", "seq_len": 64, "batch_size": 8,
                 "num_shards": 4, "val_sequences": 64},
        "inner": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 20, "total_steps_per_shard": 10000,
                  "weight_decay": 0.1, "grad_clip": 1.0},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": peers},
        "schedule": {"method": method, "max_local_steps": 30, "min_steps": 2, "grace_period": 1.0},
        "sim": {"workers": peers},
        "runtime": {"run_id": f"wan-{uuid.uuid4().hex[:10]}", "codec": codec, "eval_every": peers,
                    "speed_report_period": 2.0, "lease_timeout_factor": 3.0, "lease_slack": 30.0},
    }  # fmt: skip
    from asyncloco.config import RuntimeConfig

    if "gate" in RuntimeConfig.model_fields:
        config["runtime"]["gate"] = {"enabled": False}  # honest peers only: measure the method, not the filter
    return config


def value_at(evals: list[dict[str, Any]], t: float) -> Optional[float]:
    """Perplexity of the last evaluation at or before ``t``."""
    before = [e for e in evals if e["t"] <= t and e["perplexity"] is not None]
    return before[-1]["perplexity"] if before else None


def time_to(evals: list[dict[str, Any]], target: float) -> Optional[float]:
    return next((e["t"] for e in evals if e["perplexity"] is not None and e["perplexity"] <= target), None)


def plot(results: dict[str, Any], budget: float, peers: str, path: Path) -> None:
    """Validation perplexity vs wall time, from θ0 (its evaluation, before the first lease, drawn at 0 s)
    to the budget (evaluations of the last leases, finished after it, are left out)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results.values():
        points = [(max(0.0, e["t"]), e["perplexity"]) for e in r["evals"] if e["perplexity"] is not None and e["t"] <= budget]
        if points:
            ax.plot(*zip(*points), marker=".", label=f"{LABELS[r['method']]} ({r['codec']})")
    ax.set_yscale("log")
    ax.set_xlabel("wall time since the first lease (s)")
    ax.set_ylabel("validation perplexity")
    ax.set_title(f"tiny LM over emulated links: {peers}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="campus:1,home:1.5,far:4", help="profile:slowdown per peer")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds of training per run")
    parser.add_argument("--out", default="runs/bench-wan")
    parser.add_argument("--quick", action="store_true", help="only the three methods with int8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs already in --out with the same budget and peers (e.g. add the codec runs to a --quick one)")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from <out>/bench_wan.json")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: the reference run alone (sync DiLoCo, "
                        "int8), one campus peer, 8 s (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.peers, args.budget, args.quick = "campus:1", 8.0, True
    if args.plot_only:
        saved = json.loads((Path(args.out) / "bench_wan.json").read_text())
        plot(saved["runs"], saved["budget_s"], saved["peers"], Path(args.out) / "perplexity_vs_time.png")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"bench_wan: network namespaces are unavailable: {reason}", file=sys.stderr)
        return 2
    peers = parse_peers(args.peers)
    out = Path(args.out)
    variants = [("sync_diloco", "int8"), ("async_diloco", "int8"), ("async_dn_dylu", "int8")]
    if not args.quick:
        variants += [("async_dn_dylu", "none"), ("async_dn_dylu", "int4")]
    if args.smoke:
        variants = variants[:1]  # the reference every row is compared with
    results: dict[str, Any] = {}
    for method, codec in variants:
        name = f"{method}-{codec}"
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        previous = directory / "result.json"
        if args.reuse and previous.is_file():
            old = json.loads(previous.read_text())
            if old.get("budget_s") == args.budget and len(old.get("peers", [])) == len(peers):
                print(f"--- {LABELS[method]}, {codec}: reusing {previous}", flush=True)
                results[name] = {"method": method, "codec": codec, **old}
                continue
        config_path = directory / "config.yaml"
        config_path.write_text(yaml.safe_dump(bench_config(method, codec, len(peers)), sort_keys=False))
        print(f"--- {LABELS[method]}, {codec}: {args.budget:.0f} s over {args.peers}", flush=True)
        results[name] = {"method": method, "codec": codec, **run_wan(config_path, peers, args.budget, directory, threads=args.threads)}

    sync = results["sync_diloco-int8"]["evals"]
    sync_final = value_at(sync, args.budget)
    equal_t = min((r["evals"][-1]["t"] for r in results.values() if r["evals"]), default=args.budget)
    equal_t = min(equal_t, args.budget)
    rows = []
    for name, r in results.items():
        evals = r["evals"]
        mb_up = sum(s.get("traffic", {}).get("submit", {}).get("bytes_sent", 0) for s in r["peer_summaries"]) / 1e6
        reach = time_to(evals, sync_final) if sync_final is not None else None
        rows.append({
            "run": name, "method": LABELS[r["method"]], "codec": r["codec"],
            "ppl_at_budget": value_at(evals, args.budget), "ppl_at_equal_time": value_at(evals, equal_t),
            "time_to_sync_final_s": reach, "applied": r["applied"], "expired": r["expired"], "mb_uploaded": mb_up,
        })  # fmt: skip
    parameters = next((r.get("parameters") for r in results.values() if r.get("parameters")), None)
    summary = {"budget_s": args.budget, "peers": args.peers, "parameters": parameters, "equal_time_s": equal_t, "sync_final_ppl": sync_final,
               "rows": rows, "runs": results}  # fmt: skip
    (out / "bench_wan.json").write_text(json.dumps(summary, indent=1))

    def fmt(value: Optional[float], spec: str = ".1f") -> str:
        return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    print(f"\npeers {args.peers}; budget {args.budget:.0f} s; equal time {equal_t:.0f} s; sync final ppl {fmt(sync_final)}")
    header = f"{'method':<18} {'codec':<5} {'ppl@budget':>10} {'ppl@equal t':>11} {'t→sync final':>12} {'applied':>7} {'expired':>7} {'MB up':>7}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['method']:<18} {row['codec']:<5} {fmt(row['ppl_at_budget']):>10} {fmt(row['ppl_at_equal_time']):>11} "
              f"{fmt(row['time_to_sync_final_s'], '.0f') + (' s' if row['time_to_sync_final_s'] is not None else ''):>12} "
              f"{row['applied']:>7} {row['expired']:>7} {row['mb_uploaded']:>7.2f}")  # fmt: skip
    plot(results, args.budget, args.peers, out / "perplexity_vs_time.png")
    print(f"json: {out / 'bench_wan.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
