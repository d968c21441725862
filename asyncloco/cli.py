"""``asyncloco`` command line: thin entry points (parse → load config → build → run → close)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["main"]

logger = logging.getLogger("asyncloco")

DEFAULT_TOY_CONFIG = "configs/toy.yaml"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "matplotlib", "PIL", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _resolve_config(path: str) -> Path:
    """A config path as given, or relative to the installed package's repository."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    repo_relative = Path(__file__).resolve().parent.parent / path
    if repo_relative.is_file():
        return repo_relative
    raise ValueError(f"config file {path!r} not found (looked in the current directory and {repo_relative.parent})")


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
    cfg = load_config(_resolve_config(args.config), overrides)
    methods = args.method or list(cfg.sim.methods)
    out_dir = Path(args.out) / cfg.name
    started = time.monotonic()
    results = compare(cfg, methods, out_dir)
    table = format_table(results)
    print(table)
    print(f"\ntraces, summary.json and comparison.png in {out_dir}/  ({time.monotonic() - started:.0f}s wall)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncloco", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sim = sub.add_parser("simulate", help="deterministic fake-time simulation of one or more methods")
    sim.add_argument("--config", default=DEFAULT_TOY_CONFIG, help=f"run config YAML (default {DEFAULT_TOY_CONFIG})")
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
    sim.set_defaults(func=cmd_simulate)

    export = sub.add_parser("export", help="write a run's current model + tokenizer as a from_pretrained directory")
    export.add_argument("--checkpoint-dir", required=True, help="the coordinator's runtime.checkpoint_dir")
    export.add_argument("--out", required=True, help="directory to write (config, weights, tokenizer)")
    export.set_defaults(func=cmd_export)

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
