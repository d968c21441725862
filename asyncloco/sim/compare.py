"""Run several methods on one config and report them side by side (table + PNG + traces).

Sync DiLoCo runs first when it is among the methods: its final loss becomes the target every
other method is timed against ("simulated time to reach sync DiLoCo's final loss"), and its
simulated duration the time limit.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Sequence

from asyncloco.config import RunConfig
from asyncloco.sim.engine import SimResult, Simulation, build_workload, pretrain

__all__ = ["compare", "format_table", "plot_results"]

logger = logging.getLogger(__name__)


def compare(cfg: RunConfig, methods: Sequence[str], out_dir: Path | None = None) -> list[SimResult]:
    workload = build_workload(cfg)
    initial = pretrain(cfg, workload)  # the same θ0 for every method
    ordered = sorted(methods, key=lambda m: m != "sync_diloco")
    results: list[SimResult] = []
    target: float | None = None
    limit = math.inf
    for method in ordered:
        started = time.monotonic()
        trace_path = out_dir / f"trace-{method}.jsonl" if out_dir is not None else None
        simulation = Simulation(cfg, method, workload, target_loss=target, time_limit=limit, initial_params=initial)
        if trace_path is not None:
            trace_path.parent.mkdir(parents=True, exist_ok=True)
            with trace_path.open("w") as fh:
                result = simulation.run(trace=fh)
        else:
            result = simulation.run()
        if method == "sync_diloco":
            target, limit = result.final["loss"], result.sim_time
        logger.info(
            "%s: loss %.4f at %d local updates, simulated %.0fs (%.1fs wall)",
            method,
            result.final["loss"],
            result.final["local_updates"],
            result.final["time"],
            time.monotonic() - started,
        )
        results.append(result)
    if out_dir is not None:
        summary = [summary_row(r, target) for r in results]
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_results(results, out_dir / "comparison.png", metric=_metric(cfg))
    return results


def _metric(cfg: RunConfig) -> str:
    return "perplexity" if cfg.task.kind == "lm" else "loss"


def summary_row(result: SimResult, target: float | None) -> dict[str, object]:
    final = result.final
    return {
        "method": result.method,
        "label": result.label,
        "final": final,
        "sim_time_at_budget": final["time"],
        "time_to_sync_final": result.time_to_reach(target) if target is not None else None,
        "mean_staleness": sum(result.staleness) / len(result.staleness) if result.staleness else 0.0,
        "applied": result.applied,
    }


def format_table(results: Sequence[SimResult]) -> str:
    sync = next((r for r in results if r.method == "sync_diloco"), None)
    target = sync.final["loss"] if sync is not None else None
    has_ppl = "perplexity" in results[0].final
    metric = "final ppl" if has_ppl else "final loss"
    header = f"{'method':44s} {metric:>11s} {'vs sync':>8s} {'sim time':>9s} {'t→sync':>9s} {'t/sync':>7s} {'stale':>6s}"
    lines = [header, "-" * len(header)]
    for r in results:
        final = r.final
        value = final["perplexity"] if has_ppl else final["loss"]
        ref = (sync.final["perplexity"] if has_ppl else sync.final["loss"]) if sync is not None else None
        ratio = (f"{value / ref:8.4f}" if value / ref < 1e3 else f"{value / ref:8.1e}") if ref else f"{'':8s}"
        reach = r.time_to_reach(target) if target is not None else None
        reach_s = f"{reach:9.0f}" if reach is not None else f"{'never':>9s}"
        frac = f"{reach / sync.final['time']:7.2f}" if reach is not None and sync is not None else f"{'-':>7s}"
        stale = sum(r.staleness) / len(r.staleness) if r.staleness else 0.0
        lines.append(
            f"{r.label + ' [' + r.method + ']':44s} {_fixed(value, 11)} {ratio} {final['time']:9.0f} {reach_s} {frac} {stale:6.2f}"
        )
    lines.append(
        "final = at equal total local updates; t→sync = simulated time to first reach sync DiLoCo's final loss"
    )
    return "\n".join(lines)


def _fixed(value: float, width: int) -> str:
    """4 decimals while that fits, scientific for diverged runs."""
    return f"{value:{width}.4f}" if abs(value) < 1e5 else f"{value:{width}.3e}"


def plot_results(results: Sequence[SimResult], path: Path, metric: str = "loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        xs_updates = [e["local_updates"] for e in r.evals]
        xs_time = [e["time"] for e in r.evals]
        ys = [e[metric] for e in r.evals]
        style = "--" if r.method == "sync_diloco" else "-"
        left.plot(xs_updates, ys, style, label=r.label)
        right.plot(xs_time, ys, style, label=r.label)
    for ax, xlabel in ((left, "total local updates"), (right, "simulated time (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"eval {metric}")
        ax.grid(alpha=0.3)
    # Every method starts from the same θ0: show from that value down, so a diverging method leaves
    # the chart instead of squashing the others; perplexity spans decades, so it gets a log axis.
    start = results[0].evals[0][metric] if results and results[0].evals else None
    finals = [r.evals[-1][metric] for r in results if r.evals]
    if start is not None and finals:
        low = min(min(e[metric] for e in r.evals) for r in results if r.evals)
        for ax in (left, right):
            if metric == "perplexity":
                ax.set_yscale("log")
                ax.set_ylim(low * 0.95, start * 1.1)
            else:
                ax.set_ylim(low - 0.05 * (start - low), start + 0.02 * (start - low))
    left.set_title(f"{metric} vs local updates")
    right.set_title(f"{metric} vs time")
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
