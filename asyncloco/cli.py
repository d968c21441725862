"""``asyncloco`` command line: thin entry points (parse → load config → build → run → close)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from asyncloco import __version__
from asyncloco.shipped import resolve_config
from asyncloco.shipped import shipped_configs as shipped_configs  # re-exported (tests, older callers)

__all__ = ["main"]

logger = logging.getLogger("asyncloco")

DEFAULT_TOY_CONFIG = "toy"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "matplotlib", "PIL", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


# The shipped configs' lookup lives in asyncloco/shipped.py (shared with runtime_cli and demo, no import circle).
_resolve_config = resolve_config


def cmd_simulate(args: argparse.Namespace) -> int:
    from asyncloco.config import load_config
    from asyncloco.sim.compare import compare, format_table

    overrides = {}
    if args.total_local_updates is not None:
        overrides["sim.total_local_updates"] = args.total_local_updates
    if args.profile is not None:
        overrides["sim.profile"] = args.profile
    if args.workers is not None:
        overrides["sim.workers"] = args.workers
    from asyncloco.overrides import overrides_from_args

    overrides.update(overrides_from_args(args))
    cfg = load_config(resolve_config(args.config), overrides)
    methods = args.method or list(cfg.sim.methods)
    out_dir = Path(args.out) / cfg.name
    started = time.monotonic()
    results = compare(cfg, methods, out_dir)
    table = format_table(results)
    print(table)
    print(f"\ntraces, summary.json and comparison.png in {out_dir}/  ({time.monotonic() - started:.0f}s wall)")
    return 0


# --- asyncloco reproduce (sim/reproduce.py, issue 9) ---
def cmd_reproduce(args: argparse.Namespace) -> int:
    """The paper's Tables 1-4 in the simulator, written to docs/reproduction.md with a figure."""
    from asyncloco.sim.reproduce import TABLES, parse_speeds, reproduce

    tables = list(TABLES) if args.table == "all" else [args.table]
    config = args.config or {"toy": "toy", "lm": "lm-tiny"}[args.task]
    speeds = parse_speeds(args.speeds) if args.speeds else None
    command = "asyncloco reproduce " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["reproduce"] else "asyncloco reproduce"
    text = reproduce(
        tables, resolve_config(config), args.seeds, Path(args.out), Path(args.figure),
        speeds=speeds, budget=args.total_local_updates, jobs=args.jobs, command=command,
    )
    print(text)
    print(f"written to {args.out} and {args.figure}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write the coordinator's current θ (from its checkpoint) as a transformers model directory."""
    from asyncloco.config import RunConfig
    from asyncloco.coordinator.checkpoint import load_snapshot
    from asyncloco.workloads import build_workload

    snapshot = load_snapshot(Path(args.checkpoint_dir))
    cfg = RunConfig.model_validate(snapshot["config"])  # the config the run was started with
    if cfg.task.kind != "lm":
        raise ValueError(f"only language-model runs can be exported; this run's task is {cfg.task.kind!r}")
    workload = build_workload(cfg)
    from asyncloco.models.lm import LMWorkload

    assert isinstance(workload, LMWorkload)  # task.kind == "lm"
    theta = snapshot["coordinator"]["params"]
    out = workload.export(theta, args.out)
    version = snapshot["coordinator"]["version"]
    print(f"exported version {version} of run '{cfg.runtime.run_id}' to {out}; load it with "
          f"AutoModelForCausalLM.from_pretrained('{out}') and AutoTokenizer.from_pretrained('{out}')")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print a run's status (``--json``: the whole status document) from its checkpoint dir or dashboard."""
    import json

    from asyncloco.coordinator.status import format_status, read_status

    document = read_status(checkpoint_dir=args.checkpoint_dir, url=args.url)
    print(json.dumps(document, indent=1) if args.json else format_status(document))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from asyncloco.overrides import add_override_arguments

    parser = argparse.ArgumentParser(prog="asyncloco", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"asyncloco {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="deterministic fake-time simulation of one or more methods")
    sim.add_argument("--config", default=DEFAULT_TOY_CONFIG, help=f"run config: a YAML path or a shipped config's name (default {DEFAULT_TOY_CONFIG})")
    sim.add_argument(
        "--method",
        action="append",
        help="method to run (repeatable); default: the config's sim.methods. "
        "See asyncloco.coordinator.methods.METHODS for the list",
    )
    sim.add_argument("--out", default="runs/sim", help="output directory (traces, summary.json, comparison.png)")
    sim.add_argument("--total-local-updates", type=int, help="override sim.total_local_updates")
    sim.add_argument("--profile", choices=["none", "slight", "moderate", "very"], help="override sim.profile")
    sim.add_argument("--workers", type=int, help="override sim.workers")
    add_override_arguments(sim)
    sim.set_defaults(func=cmd_simulate)

    # --- asyncloco reproduce (sim/reproduce.py) ---
    rep = sub.add_parser("reproduce", help="the paper's Tables 1-4 in the simulator (mean ± std over seeds) → docs/reproduction.md")
    rep.add_argument("--table", default="all", choices=["1", "2", "3", "4", "all"], help="which table (default all)")
    rep.add_argument("--task", default="toy", choices=["toy", "lm"], help="toy (configs/toy.yaml) or lm (configs/lm-tiny.yaml)")
    rep.add_argument("--config", help="a run config instead of the task's default")
    rep.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per cell (default 3)")
    rep.add_argument("--speeds", help="seconds per step of each worker, 0.5,1.2,... or a file of them: replaces the four named levels")
    rep.add_argument("--total-local-updates", type=int, help="override the budget (sim.total_local_updates)")
    rep.add_argument("--jobs", type=int, default=0, help="worker processes (default 0: one per core)")
    rep.add_argument("--out", default="docs/reproduction.md", help="Markdown output (default docs/reproduction.md)")
    rep.add_argument("--figure", default="docs/figures/reproduction.png", help="figure output")
    rep.set_defaults(func=cmd_reproduce)

    export = sub.add_parser("export", help="write a run's current model + tokenizer as a from_pretrained directory")
    export.add_argument("--checkpoint-dir", required=True, help="the coordinator's runtime.checkpoint_dir")
    export.add_argument("--out", required=True, help="directory to write (config, weights, tokenizer)")
    export.set_defaults(func=cmd_export)

    # --- asyncloco status (coordinator/status.py) ---
    status = sub.add_parser("status", help="a run's version, updates/s, perplexity and peers (from status.json or a dashboard)")
    where = status.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint-dir", help="the coordinator's runtime.checkpoint_dir (reads its status.json)")
    where.add_argument("--url", help="a live coordinator's dashboard, e.g. http://127.0.0.1:8080")
    status.add_argument("--json", action="store_true", help="print the status document as JSON")
    status.set_defaults(func=cmd_status)

    _add_runtime_commands(sub)
    return parser


def _add_runtime_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Networked commands (coordinator, peer, demo) live in asyncloco.runtime_cli when installed."""
    try:
        from asyncloco.runtime_cli import add_commands
    except ImportError:
        return
    add_commands(sub)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ValueError as error:
        print(f"asyncloco: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("asyncloco: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
