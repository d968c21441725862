"""The paper's Tables 1-4 in the simulator: ``asyncloco reproduce --table 1|2|3|4|all``.

* Table 1 — async methods vs sync DiLoCo at the four heterogeneity levels (or one list of speeds);
* Table 2 — k = 4, 8, 16 workers ("very" profile, interpolated geometrically for k ≠ 4);
* Table 3 — the outer optimizer and DN's momentum activation c ∈ {0, 0.1};
* Table 4 — DyLU on/off × grace period on/off for Async DN.

Every cell is a mean ± standard deviation over seeds (seed s sets the model init and the shard
sampling; the data set stays the same). For each (speeds, workers, seed) sync DiLoCo runs first:
its final loss is the target every other row is timed against, its simulated time the reference
of the "× sync's time" column (docs/algorithm.md §8). Runs shared by several tables run once.
The result is a Markdown document (docs/reproduction.md) and a figure.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Sequence

from asyncloco.config import HETEROGENEITY_PROFILES, RunConfig, load_config

__all__ = ["Row", "Setting", "Outcome", "plan", "run_plan", "render_markdown", "plot_tables", "parse_speeds", "reproduce"]

logger = logging.getLogger(__name__)

LEVELS = ("none", "slight", "moderate", "very")
TABLES = ("1", "2", "3", "4")  # the paper's (``--table all``)
EXTRA_TABLES = ("5",)  # beyond the paper: ``python -m asyncloco.sim.reproduce --table 5``
WARMUP_ARRIVALS = 20  # Table 5's outer-lr warm-up length, fixed before any run (≈ 5 rounds of 4 workers)


@dataclass(frozen=True)
class Setting:
    """Worker speeds (seconds per step) — the things sync DiLoCo's reference depends on."""

    name: str  # "very", "moderate", "k=8", "custom"...
    speeds: tuple[float, ...]


@dataclass(frozen=True)
class Row:
    """One method variant in one setting."""

    table: str
    setting: Setting
    label: str
    method: str
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def run_key(self) -> tuple[Setting, str, tuple[tuple[str, Any], ...]]:
        return (self.setting, self.method, self.overrides)


@dataclass
class Outcome:
    """One run: its final loss, simulated times, and the wall-clock seconds it took."""

    loss: float
    local_updates: float
    time_at_budget: float
    time_to_sync: float | None
    sync_loss: float
    sync_time: float
    wall: float
    cpu: float = 0.0  # CPU seconds of the process that ran it


@dataclass
class Plan:
    rows: list[Row] = field(default_factory=list)

    def runs(self) -> dict[Setting, list[tuple[str, tuple[tuple[str, Any], ...]]]]:
        """Distinct (method, overrides) per setting, sync DiLoCo first."""
        out: dict[Setting, list[tuple[str, tuple[tuple[str, Any], ...]]]] = {}
        for row in self.rows:
            todo = out.setdefault(row.setting, [("sync_diloco", ())])
            if (row.method, row.overrides) not in todo:
                todo.append((row.method, row.overrides))
        return out


def interpolate(speeds: Sequence[float], workers: int) -> tuple[float, ...]:
    """``workers`` speeds spread geometrically between the fastest and slowest of ``speeds``."""
    if workers == len(speeds):
        return tuple(speeds)
    lo, hi = min(speeds), max(speeds)
    if workers == 1:
        return (lo,)
    return tuple(lo * (hi / lo) ** (i / (workers - 1)) for i in range(workers))


def parse_speeds(text: str) -> tuple[float, ...]:
    """Seconds per step from ``0.5,1.2,3`` or from a file holding such numbers (commas or whitespace)."""
    source = text
    path = Path(text)
    if path.is_file():
        source = path.read_text()
    try:
        speeds = tuple(float(x) for x in source.replace(",", " ").split())
    except ValueError:
        raise ValueError(
            f"--speeds {text!r}: give seconds per step as numbers separated by commas (0.58,0.75,1.51,3.33) "
            "or the path of a file that holds them"
        ) from None
    if not speeds or not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"--speeds {text!r}: need at least one positive, finite seconds-per-step value")
    return speeds


def plan(tables: Sequence[str], speeds: Sequence[float] | None = None) -> Plan:
    """The rows of the requested tables. ``speeds`` replaces the four named levels by one custom profile."""
    levels = [Setting("custom", tuple(speeds))] if speeds else [Setting(n, HETEROGENEITY_PROFILES[n]) for n in LEVELS]
    main = levels[-1]  # "very" (or the custom profile): where Tables 2-4 are measured
    rows: list[Row] = []
    if "1" in tables:
        for level in levels:
            rows += [
                Row("1", level, "Sync DiLoCo", "sync_diloco"),
                Row("1", level, "Async DiLoCo", "async_diloco"),
                Row("1", level, "Async DN", "async_dn"),
                Row("1", level, "Async DN + DyLU", "async_dn_dylu"),
            ]
    if "2" in tables:
        for k in (4, 8, 16):
            setting = main if k == len(main.speeds) else Setting(f"k={k}", interpolate(main.speeds, k))
            rows += [
                Row("2", setting, "Sync DiLoCo", "sync_diloco"),
                Row("2", setting, "Async DiLoCo", "async_diloco"),
                Row("2", setting, "Async DN + DyLU", "async_dn_dylu"),
            ]
    if "3" in tables:
        c = min(0.1, 1.0 / len(main.speeds))  # the paper's c = 0.1, within Algorithm 3's bound c <= 1/N
        rows += [
            Row("3", main, "Sync DiLoCo", "sync_diloco"),
            Row("3", main, "Async SGD (outer)", "async_sgd"),
            Row("3", main, "Async SGD-momentum (outer)", "async_sgd_momentum"),
            Row("3", main, "Async Adam (outer)", "async_adam"),
            Row("3", main, "Async Nesterov (Async DiLoCo)", "async_diloco"),
            Row("3", main, "Async DN + DyLU, c = 0", "async_dn_dylu"),
            Row("3", main, f"Async DN + DyLU, c = {c:g}", "async_dn_dylu", (("outer.activation", c),)),
        ]
    if "5" in tables:
        # beyond the paper: outer-lr warm-up over the first arrivals, at the two most heterogeneous levels
        warmup = (("outer.warmup_arrivals", WARMUP_ARRIVALS),)
        for level in levels[-2:]:
            rows += [
                Row("5", level, "Sync DiLoCo", "sync_diloco"),
                Row("5", level, "Async DN + DyLU", "async_dn_dylu"),
                Row("5", level, f"Async DN + DyLU + outer warm-up ({WARMUP_ARRIVALS} arrivals)", "async_dn_dylu", warmup),
            ]
    if "4" in tables:
        no_grace = (("schedule.grace_period", 0.0),)
        rows += [
            Row("4", main, "Sync DiLoCo", "sync_diloco"),
            Row("4", main, "DN, no DyLU, no grace", "async_dn", no_grace),
            Row("4", main, "DN, no DyLU, grace", "async_dn"),
            Row("4", main, "DN + DyLU, no grace", "async_dn_dylu", no_grace),
            Row("4", main, "DN + DyLU, grace", "async_dn_dylu"),
        ]
    return Plan(rows)


# ------------------------------------------------------------------------------------ running


def _config(base: Path, setting: Setting, seed: int, budget: int | None, extra: Sequence[tuple[str, Any]]) -> RunConfig:
    overrides: dict[str, Any] = {
        "seed": seed,
        "sim.seed": seed,
        "sim.workers": len(setting.speeds),
        "sim.profile": list(setting.speeds),
    }
    if budget is not None:
        overrides["sim.total_local_updates"] = budget
        overrides["sim.eval_every"] = max(1, min(budget // 20, 200))
    overrides.update(dict(extra))
    return load_config(base, overrides)


_Key = tuple[Setting, str, tuple[tuple[str, Any], ...]]
_CACHE: dict[tuple[Any, ...], Any] = {}  # per process: the workload and θ0 of a config, built once for all its runs


def _workload_and_start(cfg: RunConfig) -> tuple[Any, Any]:
    """The task's workload and pretrained θ0, built once per process (the toy data set takes seconds)."""
    from asyncloco.sim.engine import build_workload, pretrain

    task = cfg.task.model_dump_json()
    if ("workload", task) not in _CACHE:
        _CACHE[("workload", task)] = build_workload(cfg)
    workload = _CACHE[("workload", task)]
    start_key = ("start", task, cfg.inner.model_dump_json(), cfg.sim.pretrain_steps, cfg.sim.pretrain_lr, cfg.seed)
    if start_key not in _CACHE:
        _CACHE[start_key] = pretrain(cfg, workload)  # the same θ0 for every method of this seed
    return workload, _CACHE[start_key]


def _run_one(
    base: Path,
    setting: Setting,
    seed: int,
    method: str,
    extra: tuple[tuple[str, Any], ...],
    budget: int | None,
    reference: tuple[float, float] | None,
) -> tuple[_Key, int, Outcome]:
    """One run (one pool task). ``reference`` is sync DiLoCo's (final loss, simulated time) for this setting
    and seed; None for the sync run itself, which then sets it."""
    import torch

    from asyncloco.sim.engine import Simulation

    torch.set_num_threads(1)
    started, cpu_started = time.monotonic(), time.process_time()
    cfg = _config(base, setting, seed, budget, tuple(extra))
    workload, initial = _workload_and_start(cfg)
    target, sync_time = reference if reference is not None else (None, math.inf)
    result = Simulation(
        cfg, method, workload, target_loss=target, time_limit=sync_time, initial_params=initial
    ).run()
    final = result.final
    sync_loss = target if target is not None else final["loss"]
    if reference is None:
        sync_time = final["time"]
    outcome = Outcome(
        loss=final["loss"],
        local_updates=final["local_updates"],
        time_at_budget=final["time"],
        time_to_sync=result.time_to_reach(sync_loss) if math.isfinite(sync_loss) else None,
        sync_loss=sync_loss,
        sync_time=sync_time,
        wall=time.monotonic() - started,
        cpu=time.process_time() - cpu_started,
    )
    logger.info("%s seed %d %s%s: loss %.4f (%.1fs)", setting.name, seed, method, dict(extra) or "", outcome.loss, outcome.wall)
    return (setting, method, extra), seed, outcome


def default_jobs() -> int:
    """One process per core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_plan(
    the_plan: Plan, base_config: Path, seeds: int, budget: int | None = None, jobs: int = 1
) -> dict[tuple[_Key, int], Outcome]:
    """Run every distinct run of the plan for seeds 0..seeds-1 in ``jobs`` processes (≤ 0: one per core).

    Sync DiLoCo's run of each (setting, seed) goes first; as soon as it is done, the other runs of that
    setting and seed (which are timed against it) are queued, so the pool stays busy to the end."""
    if jobs <= 0:
        jobs = default_jobs()
    outcomes: dict[tuple[_Key, int], Outcome] = {}
    pending: dict[tuple[Setting, int], list[tuple[str, tuple[tuple[str, Any], ...]]]] = {}
    syncs: list[tuple[Setting, int]] = []
    for setting, runs in the_plan.runs().items():
        for seed in range(seeds):
            syncs.append((setting, seed))
            pending[(setting, seed)] = [r for r in runs if r != ("sync_diloco", ())]

    def followers(setting: Setting, seed: int, sync: Outcome) -> list[tuple[Any, ...]]:
        reference = (sync.loss, sync.sync_time)
        return [(base_config, setting, seed, m, extra, budget, reference) for m, extra in pending[(setting, seed)]]

    if jobs == 1:
        for setting, seed in syncs:
            key, _, sync = _run_one(base_config, setting, seed, "sync_diloco", (), budget, None)
            outcomes[(key, seed)] = sync
            for args in followers(setting, seed, sync):
                key, _, outcome = _run_one(*args)
                outcomes[(key, seed)] = outcome
        return outcomes
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        waiting: set[Future[tuple[_Key, int, Outcome]]] = {
            pool.submit(_run_one, base_config, setting, seed, "sync_diloco", (), budget, None) for setting, seed in syncs
        }
        while waiting:
            done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            for future in done:
                key, seed, outcome = future.result()
                outcomes[(key, seed)] = outcome
                if key[1:] == ("sync_diloco", ()):
                    waiting |= {pool.submit(_run_one, *args) for args in followers(key[0], seed, outcome)}
    return outcomes


# ------------------------------------------------------------------------------------ reporting


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def _cells(row: Row, outcomes: dict[Any, Outcome], seeds: int) -> dict[str, Any]:
    runs = [outcomes[(row.run_key, s)] for s in range(seeds)]
    loss = _mean_std([r.loss for r in runs])
    ratio = _mean_std([r.loss / r.sync_loss for r in runs])
    # a budget smaller than one sync round leaves sync at θ0 and time 0: no time ratio then
    reached = [r.time_to_sync / r.sync_time for r in runs if r.time_to_sync is not None and r.sync_time > 0]
    return {
        "loss": loss,
        "ratio": ratio,
        "time_ratio": _mean_std(reached) if len(reached) == len(runs) else None,
        "reached": len(reached),
        "time_at_budget": statistics.fmean(r.time_at_budget for r in runs),
        "local_updates": statistics.fmean(r.local_updates for r in runs),
        "wall": sum(r.wall for r in runs),
    }


def _fmt(pair: tuple[float, float], digits: int) -> str:
    mean, std = pair
    if not math.isfinite(mean) or abs(mean) >= 1e4:
        return f"{mean:.2e} (diverged)"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


TITLES = {
    "1": "Table 1 — async methods vs sync DiLoCo at each heterogeneity level",
    "2": "Table 2 — number of workers k",
    "3": "Table 3 — outer optimizer and DN's momentum activation c",
    "4": "Table 4 — DyLU and the grace period (Async DN)",
    "5": "Table 5 (beyond the paper) — outer-lr warm-up on Async DN + DyLU",
}


def render_markdown(the_plan: Plan, outcomes: dict[Any, Outcome], seeds: int, header: str = "") -> str:
    lines = [header] if header else []
    for table in TABLES + EXTRA_TABLES:
        rows = [r for r in the_plan.rows if r.table == table]
        if not rows:
            continue
        lines += [f"## {TITLES[table]}", ""]
        lines += [
            "| setting | method | final loss | × sync | sim. time at budget | time to sync's final loss (× sync) | wall s |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            cell = _cells(row, outcomes, seeds)
            reach = (
                _fmt(cell["time_ratio"], 2) if cell["time_ratio"] is not None
                else f"never ({seeds - cell['reached']}/{seeds} seeds)"
            )
            lines.append(
                f"| {_setting_label(row)} | {row.label} | {_fmt(cell['loss'], 4)} | {_fmt(cell['ratio'], 4)} | "
                f"{cell['time_at_budget']:.0f} s | {reach} | {cell['wall']:.0f} |"
            )
        lines.append("")
    lines += acceptance_lines(the_plan, outcomes, seeds)
    lines += warmup_lines(the_plan, outcomes, seeds)
    return "\n".join(lines) + "\n"


def _setting_label(row: Row) -> str:
    return f"k={len(row.setting.speeds)}" if row.table == "2" else row.setting.name


def acceptance_lines(the_plan: Plan, outcomes: dict[Any, Outcome], seeds: int) -> list[str]:
    """The reproduction's acceptance on Table 1: DN + DyLU ≤ sync × 1.005 and < Async DiLoCo at every level."""
    table1 = [r for r in the_plan.rows if r.table == "1"]
    if not table1:
        return []
    out = ["## Check (Table 1, mean over seeds)", ""]
    for setting in dict.fromkeys(r.setting for r in table1):
        by_method = {r.method: _cells(r, outcomes, seeds) for r in table1 if r.setting == setting}
        dn, nesterov = by_method["async_dn_dylu"], by_method["async_diloco"]
        ok_sync = dn["ratio"][0] <= 1.005
        ok_async = dn["loss"][0] < nesterov["loss"][0]
        verdict = "PASS" if ok_sync and ok_async else "FAIL"
        out.append(
            f"- {setting.name}: DN + DyLU / sync = {dn['ratio'][0]:.4f} (≤ 1.005: {'yes' if ok_sync else 'no'}); "
            f"DN + DyLU {dn['loss'][0]:.4f} vs Async DiLoCo {nesterov['loss'][0]:.4f} "
            f"(lower: {'yes' if ok_async else 'no'}) — {verdict}"
        )
    out.append("")
    return out


def warmup_lines(the_plan: Plan, outcomes: dict[Any, Outcome], seeds: int) -> list[str]:
    """Table 5's verdict: does the warm-up beat plain DN + DyLU (final loss, and time to sync's loss)?"""
    rows = [r for r in the_plan.rows if r.table == "5"]
    if not rows:
        return []
    out = ["## Verdict (Table 5, mean over seeds)", ""]
    for setting in dict.fromkeys(r.setting for r in rows):
        plain = _cells(next(r for r in rows if r.setting == setting and r.method == "async_dn_dylu" and not r.overrides), outcomes, seeds)
        warm = _cells(next(r for r in rows if r.setting == setting and r.overrides), outcomes, seeds)
        lower = warm["loss"][0] < plain["loss"][0]
        faster = (
            warm["time_ratio"] is not None and plain["time_ratio"] is not None
            and warm["time_ratio"][0] < plain["time_ratio"][0]
        )
        per_seed = sum(
            outcomes[(next(r for r in rows if r.setting == setting and r.overrides).run_key, s)].loss
            < outcomes[(next(r for r in rows if r.setting == setting and r.method == "async_dn_dylu" and not r.overrides).run_key, s)].loss
            for s in range(seeds)
        )
        out.append(
            f"- {setting.name}: final loss {warm['loss'][0]:.4f} with warm-up vs {plain['loss'][0]:.4f} without "
            f"(lower: {'yes' if lower else 'no'}, in {per_seed}/{seeds} seeds); time to sync's final loss "
            + (
                f"{warm['time_ratio'][0]:.2f} vs {plain['time_ratio'][0]:.2f} × sync (sooner: {'yes' if faster else 'no'})"
                if warm["time_ratio"] is not None and plain["time_ratio"] is not None
                else "not reached by every seed"
            )
            + f" — {'WINS' if lower and faster else 'does not win'}"
        )
    out.append("")
    return out


def plot_tables(the_plan: Plan, outcomes: dict[Any, Outcome], seeds: int, path: Path) -> None:
    """One panel per table: final loss relative to sync DiLoCo (mean ± std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [t for t in TABLES + EXTRA_TABLES if any(r.table == t for r in the_plan.rows)]
    fig, axes = plt.subplots(1, len(tables), figsize=(5.2 * len(tables), 4.2), squeeze=False)
    for ax, table in zip(axes[0], tables):
        rows = [r for r in the_plan.rows if r.table == table]
        if table in ("1", "2"):
            settings = list(dict.fromkeys(r.setting for r in rows))
            for label in dict.fromkeys(r.label for r in rows):
                ys, errs = [], []
                for setting in settings:
                    row = next(r for r in rows if r.label == label and r.setting == setting)
                    mean, std = _cells(row, outcomes, seeds)["ratio"]
                    ys.append(mean)
                    errs.append(std)
                style = "--" if label == "Sync DiLoCo" else "-o"
                names = [f"k={len(s.speeds)}" if table == "2" else s.name for s in settings]
                ax.errorbar(names, ys, yerr=errs, fmt=style, capsize=3, label=label)
            ax.set_xlabel("heterogeneity" if table == "1" else "workers")
            ax.legend(fontsize=7)
        else:
            labels = [r.label for r in rows]
            cells = [_cells(r, outcomes, seeds)["ratio"] for r in rows]
            ax.barh(range(len(rows)), [c[0] for c in cells], xerr=[c[1] for c in cells], capsize=3)
            ax.set_yticks(range(len(rows)), labels, fontsize=7)
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
            finite = [c[0] for c in cells if math.isfinite(c[0]) and c[0] < 10]
            if finite:
                ax.set_xlim(min(finite) * 0.98, max(finite) * 1.02)
        ax.set_title(TITLES[table].split(" — ")[0] + ": final loss / sync DiLoCo", fontsize=9)
        ax.grid(alpha=0.3)
        if table in ("1", "2"):
            finite = [line.get_ydata() for line in ax.get_lines()]
            values = [float(v) for ys in finite for v in ys if math.isfinite(float(v)) and float(v) < 10]
            if values:
                ax.set_ylim(min(values) - 0.01, max(values) + 0.01)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproduce(
    tables: Sequence[str],
    base_config: Path,
    seeds: int,
    out: Path,
    figure: Path,
    speeds: Sequence[float] | None = None,
    budget: int | None = None,
    jobs: int = 1,
    command: str = "",
) -> str:
    """Run the tables, write ``out`` (Markdown) and ``figure`` (PNG); return the Markdown."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    unknown = [t for t in tables if t not in TABLES + EXTRA_TABLES]
    if unknown:
        raise ValueError(f"unknown table(s) {unknown}; choose from 1, 2, 3, 4, all (or 5, beyond the paper)")
    the_plan = plan(tables, speeds)
    jobs = jobs if jobs > 0 else default_jobs()
    started = time.monotonic()
    outcomes = run_plan(the_plan, base_config, seeds, budget, jobs)
    wall = time.monotonic() - started
    cpu = sum(o.cpu for o in outcomes.values())
    cfg = load_config(base_config)
    runs = sum(len(v) for v in the_plan.runs().values()) * seeds
    header = "\n".join(
        [
            "# Reproducing the paper's tables in the simulator",
            "",
            f"Produced by `{command or 'asyncloco reproduce'}` ({runs} simulated runs, {wall / 60:.1f} min wall "
            f"on this machine, {jobs} process(es), {cpu / 60:.1f} CPU-min in the runs). Config `{base_config.name}`: task {cfg.task.kind}, "
            f"H = {cfg.schedule.max_local_steps}, grace {cfg.schedule.grace_period:g} s, budget "
            f"{budget or cfg.sim.total_local_updates} local updates, seeds 0-{seeds - 1}.",
            "",
            "Each cell: mean ± standard deviation over seeds. *Final loss* is that of θ after the last update "
            "within the budget (docs/algorithm.md §8); *× sync* is the per-seed ratio to sync DiLoCo's final loss; "
            "*time to sync's final loss* is the simulated time at which the method first evaluates at or below "
            "sync DiLoCo's final loss, as a fraction of sync's simulated time (a method may train up to "
            f"{cfg.sim.reach_budget_factor:g}× the budget, and no longer than sync took, to get there). "
            "Worker speeds in seconds per step: "
            + "; ".join(f"{s.name} {', '.join(f'{x:.3g}' for x in s.speeds)}" for s in the_plan.runs())
            + ".",
            "",
            f"![reproduction]({_relative(figure, out.parent)})",
            "",
        ]
    )
    text = render_markdown(the_plan, outcomes, seeds, header)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    plot_tables(the_plan, outcomes, seeds, figure)
    return text


def _relative(path: Path, start: Path) -> str:
    try:
        return str(path.resolve().relative_to(start.resolve()))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncloco.sim.reproduce --table 5``: the tables beyond the paper (the paper's: ``asyncloco reproduce``)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m asyncloco.sim.reproduce", description=main.__doc__)
    parser.add_argument("--table", default="5", choices=list(TABLES + EXTRA_TABLES))
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs" / "toy.yaml"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--speeds", help="seconds per step of each worker (replaces the named levels)")
    parser.add_argument("--total-local-updates", type=int)
    parser.add_argument("--jobs", type=int, default=0, help="worker processes (default: one per core)")
    parser.add_argument("--out", default="docs/reproduction-warmup.md")
    parser.add_argument("--figure", default="docs/figures/reproduction-warmup.png")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    command = "python -m asyncloco.sim.reproduce " + " ".join(sys.argv[1:] if argv is None else argv)
    text = reproduce(
        [args.table], Path(args.config), args.seeds, Path(args.out), Path(args.figure),
        speeds=parse_speeds(args.speeds) if args.speeds else None, budget=args.total_local_updates,
        jobs=args.jobs, command=command.strip(),
    )
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
