"""Upload codecs + error feedback in the simulator: bytes vs quality (docs/compression.md).

For each task (``configs/toy.yaml``, ``configs/lm-tiny.yaml``) and seed, one θ0 is pretrained and shared by
every run. Sync DiLoCo with fp32 uploads sets the target (its final loss) and the time limit (its simulated
time); then Async DN + DyLU runs once per upload codec (``runtime.codec``, error feedback on for lossy codecs:
asyncloco/train/feedback.py, applied by asyncloco/sim/engine.py exactly as a peer applies it). Each run stops
at ``sim.total_local_updates`` local updates for its final loss (the same count for every codec) and goes on
until it reaches sync's final loss or sync's simulated time, for the time-to-target column.

The table gives, per codec: the upload bytes relative to fp32 (exact, transport/codecs.wire_bytes), the
final loss (toy) and perplexity (lm-tiny) as the mean over seeds, their change vs fp32 uploads (mean of the
per-seed ratios), and the simulated time to sync DiLoCo's final loss (mean over the seeds that reach it).

    flock /tmp/asyncloco-heavy.lock nice -n 5 python scripts/compression_study.py --seeds 3 \\
        --out docs/compression-study.md --plot docs/figures/compression.png --json runs/compression.json

``--toy-updates`` / ``--lm-updates`` shorten the budgets (the configs' own budgets by default).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from asyncloco.config import load_config
from asyncloco.sim.engine import Simulation, build_workload, pretrain
from asyncloco.transport.codecs import LOSSLESS, wire_bytes
from asyncloco.transport.errors import CodecError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CODECS = "none,int8,int2,grp4b2,grp4b1,grp8b2,topk16b2,topk8b2,topk4b2"
logger = logging.getLogger("compression_study")


def label(codec: str, ef: bool, decay: float = 1.0) -> str:
    """A run's name in the tables: the codec, with ``+ef`` when error feedback was on for a lossy codec (``+ef0.5``
    when it carried half the residual: ``runtime.error_feedback_decay``)."""
    if not ef or codec in LOSSLESS:
        return codec
    return f"{codec}+ef" if decay == 1.0 else f"{codec}+ef{decay:g}"


def feedback_modes(codec: str, feedback: str) -> list[bool]:
    """Error feedback off and/or on for this codec: 'both' runs a lossy codec below 8 bits twice, fp32/int8 once
    (feedback off, their default: nothing or ≤ 1.3 % is dropped)."""
    if feedback != "both":
        return [feedback == "on"]
    return [False] if codec in LOSSLESS or codec == "int8" else [False, True]


def run_task(task: str, seeds: list[int], codecs: list[str], updates: int | None, feedback: str,
             results: list[dict[str, Any]], save: Any, decay: float = 1.0) -> None:
    for seed in seeds:
        # an override replaces a whole section: start from the config's own sim section
        own = load_config(ROOT / "configs" / f"{task}.yaml")
        sim_section, runtime_section = own.sim.model_dump(), own.runtime.model_dump()
        overrides: dict[str, Any] = {"seed": seed, "sim": {**sim_section, "seed": seed}}
        if updates:
            overrides["sim"]["total_local_updates"] = updates
        base = load_config(ROOT / "configs" / f"{task}.yaml", overrides)
        workload = build_workload(base)
        started = time.monotonic()
        theta0 = pretrain(base, workload)
        sync = Simulation(base, "sync_diloco", workload, initial_params=theta0).run()
        target, limit = sync.final["loss"], sync.sim_time
        results.append({"task": task, "seed": seed, "method": "sync_diloco", "codec": "none", "loss": target,
                        "time": sync.final["time"], "wall_s": time.monotonic() - started})
        logger.info("%s seed %d sync: loss %.4f at t=%.0f (%.0f s wall)", task, seed, target, sync.final["time"],
                    time.monotonic() - started)
        numel = theta0.numel()
        for codec, ef in [(c, ef) for c in codecs for ef in feedback_modes(c, feedback)]:
            started = time.monotonic()
            cfg = load_config(ROOT / "configs" / f"{task}.yaml",
                              {**overrides, "runtime": {**runtime_section, "codec": codec, "error_feedback": ef,
                                                         "error_feedback_decay": decay}})
            sim = Simulation(cfg, "async_dn_dylu", workload, target_loss=target, time_limit=limit, initial_params=theta0)
            try:
                result = sim.run()
                loss, local, reached = result.final["loss"], result.final["local_updates"], result.time_to_reach(target)
            except CodecError as error:  # a pseudo-gradient became NaN/Inf: the run diverged (recorded, not fatal)
                logger.warning("%s seed %d %s diverged: %s", task, seed, label(codec, ef, decay), error)
                loss, local, reached = math.inf, sim.state.local_updates, None
            row = {"task": task, "seed": seed, "method": "async_dn_dylu", "codec": codec, "error_feedback": ef,
                   "error_feedback_decay": decay if ef else None, "label": label(codec, ef, decay),
                   "loss": loss, "local_updates": local,
                   "time_to_sync": reached, "sync_time": sync.final["time"],
                   "x_fewer": 4 * numel / wire_bytes(codec, numel), "parameters": numel,
                   "wall_s": time.monotonic() - started}
            results.append(row)
            logger.info("%s seed %d %s: loss %.4f (×%.1f fewer bytes) to sync's loss at %s (%.0f s wall)", task, seed, row["label"],
                        row["loss"], row["x_fewer"], reached, row["wall_s"])
            save()


def _label_of(row: dict[str, Any]) -> str:
    # rows written before labels existed: the row's error_feedback is what the run had (int8 included)
    return str(row.get("label") or label(row["codec"], bool(row.get("error_feedback", True))))


def summarise(results: list[dict[str, Any]], codecs: list[str], tasks: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for task in tasks:
        rows = [r for r in results if r["task"] == task]
        fp32 = {r["seed"]: r["loss"] for r in rows if r["method"] == "async_dn_dylu" and r["codec"] == "none"}
        sync = [r for r in rows if r["method"] == "sync_diloco"]
        table[task] = {}
        for codec in codecs:
            mine = [r for r in rows if r["method"] == "async_dn_dylu" and _label_of(r) == codec]
            if not mine:
                continue
            metric = [math.exp(r["loss"]) if task != "toy" else r["loss"] for r in mine]
            base = [math.exp(fp32[r["seed"]]) if task != "toy" else fp32[r["seed"]] for r in mine if r["seed"] in fp32]
            change = [100 * (m / b - 1) for m, b in zip(metric, base)] if len(base) == len(metric) else []
            times = [r["time_to_sync"] for r in mine if r["time_to_sync"] is not None]
            table[task][codec] = {
                "x_fewer": mine[0]["x_fewer"], "metric": statistics.mean(metric),
                "metric_sd": statistics.stdev(metric) if len(metric) > 1 else 0.0,
                "change_pct": statistics.mean(change) if change else None, "seeds": len(mine),
                "reached": len(times), "time_to_sync": statistics.mean(times) if times else None,
                "sync_time": statistics.mean(r["time"] for r in sync) if sync else None,
            }
    return table


def markdown(table: dict[str, dict[str, dict[str, Any]]], codecs: list[str], tasks: list[str]) -> str:
    lines = []
    for task in tasks:
        if not table.get(task):
            continue
        metric = "final loss" if task == "toy" else "final perplexity"
        sync_time = next(iter(table[task].values()))["sync_time"]
        lines += [f"**{task}** ({metric}, mean ± sd over {next(iter(table[task].values()))['seeds']} seeds; sync DiLoCo "
                  f"reaches its final loss at t = {sync_time:.0f} s simulated)", "",
                  f"| upload codec | × fewer bytes than fp32 | {metric} | vs fp32 uploads | time to sync's final loss (seeds reaching it) |",
                  "|---|---:|---:|---:|---:|"]
        for codec in codecs:
            row = table[task].get(codec)
            if row is None:
                continue
            change = "-" if row["change_pct"] is None else f"{row['change_pct']:+.2f} %"
            reach = "-" if row["time_to_sync"] is None else f"{row['time_to_sync']:.0f} s ({row['reached']}/{row['seeds']})"
            lines.append(f"| {codec} | {row['x_fewer']:.1f} | {row['metric']:.4f} ± {row['metric_sd']:.4f} | {change} | {reach} |")
        lines.append("")
    return "\n".join(lines)


def plot(table: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for task, rows in table.items():
        for ef in (False, True):
            points = sorted((r["x_fewer"], r["change_pct"], codec) for codec, r in rows.items()
                            if r["change_pct"] is not None and codec.endswith("+ef") == ef)
            if ef and len(points) < 2:
                continue
            if ef:
                points = [(1.0, 0.0, "none")] + points
            metric = "loss" if task == "toy" else "perplexity"
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-" if not ef else "s--",
                    label=f"{task} ({metric}){', error feedback on' if ef else ''}")
            for x, y, codec in points:
                ax.annotate(codec, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.axvline(32, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("upload bytes: × fewer than fp32")
    ax.set_ylabel("final metric vs fp32 uploads (%)")
    ax.set_title("Async DN + DyLU: upload bytes vs quality (codec+ef: error feedback on)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="toy,lm-tiny")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help="'none' (fp32) first: the reference")
    parser.add_argument("--toy-updates", type=int, default=None)
    parser.add_argument("--lm-updates", type=int, default=None)
    parser.add_argument("--no-error-feedback", action="store_true", help="same as --feedback off")
    parser.add_argument("--feedback", choices=("on", "off", "both"), default="on",
                        help="error feedback for the lossy codecs; 'both' runs each codec below 8 bits with and without "
                             "it (rows 'codec+ef' and 'codec'), sharing θ0 and the sync run")
    parser.add_argument("--feedback-decay", type=float, default=1.0,
                        help="runtime.error_feedback_decay of the runs with feedback on (1: classic; rows 'codec+ef0.5')")
    parser.add_argument("--seed-list", default=None, help="comma-separated seeds instead of 0..--seeds-1 (split a study)")
    parser.add_argument("--out", type=Path, default=None, help="markdown table")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="raw per-run results (written after every run)")
    parser.add_argument("--from-json", type=Path, nargs="+", default=None,
                        help="only tabulate/plot earlier results (several files: merged, a run repeated in two files "
                             "counted once: the first file wins)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: the toy task, one seed, fp32 and int8 (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.tasks, args.seeds, args.codecs, args.toy_updates = "toy", 1, "none,int8", args.toy_updates or 300
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    tasks = [t for t in args.tasks.split(",") if t]
    codecs = [c for c in args.codecs.split(",") if c]
    results: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for path in args.from_json or []:
        for row in json.loads(path.read_text())["runs"]:
            key = (row["task"], row["seed"], row["method"], _label_of(row))
            if key not in seen:
                seen.add(key)
                results.append(row)

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "out": str(args.out),
                                                                   "plot": str(args.plot), "from_json": None},
                                             "runs": results}, indent=1, default=str))

    started = time.monotonic()
    if not args.from_json:
        for task in tasks:
            updates = args.toy_updates if task == "toy" else args.lm_updates
            seeds = [int(s) for s in args.seed_list.split(",")] if args.seed_list else list(range(args.seeds))
            run_task(task, seeds, codecs, updates, "off" if args.no_error_feedback else args.feedback, results, save,
                     args.feedback_decay)
    # tabulate every variant of each codec the results hold (with and without feedback, each decay), in run order
    codecs = [lab for c in codecs for lab in dict.fromkeys(_label_of(r) for r in results if r["codec"] == c)]
    table = summarise(results, codecs, tasks)
    text = markdown(table, codecs, tasks)
    print(text)
    print(f"total {time.monotonic() - started:.0f} s wall")
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(table, args.plot)


if __name__ == "__main__":
    main()
