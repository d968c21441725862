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

logger = logging.getLogger(__name__)

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


# --- asyncloco reproduce (sim/reproduce.py) ---
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


# --- asyncloco data prepare (models/prepared.py) ---
def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Tokenize a source into a prepared corpus (shard files + manifest) that runs name by its digest."""
    import os

    from asyncloco.models.data import prepare_source
    from asyncloco.models.prepared import manifest_digest

    fields = {"source": args.source, "path": args.path, "name": args.name, "split": args.split,
              "text_field": args.text_field, "tokenizer": args.tokenizer, "seq_len": args.seq_len}
    if args.config:
        from asyncloco.config import load_config

        task = load_config(resolve_config(args.config)).task
        if task.kind != "lm":
            raise ValueError(f"--config {args.config} is not a language-model run (task.kind {task.kind!r})")
        from asyncloco.models.tokenizer import default_tokenizer

        taken = {"source": task.source, "path": task.path, "name": task.name, "split": task.split,
                 "text_field": task.text_field, "seq_len": task.seq_len,
                 "tokenizer": task.tokenizer if task.tokenizer is not None else default_tokenizer(task.model)}
        fields = {key: taken[key] if value is None else value for key, value in fields.items()}
    defaults = {"source": "embedded", "split": "train", "text_field": "text", "tokenizer": "embedded-32k", "seq_len": 256}
    fields = {key: defaults.get(key) if value is None else value for key, value in fields.items()}
    path = fields["path"]
    if isinstance(path, list) and len(path) == 1:
        path = path[0]
    manifest = prepare_source(
        args.out, source=fields["source"], path=path, name=fields["name"], split=fields["split"],
        text_field=fields["text_field"], tokenizer=fields["tokenizer"], seq_len=fields["seq_len"],
        max_tokens=args.max_tokens, shard_mb=args.shard_mb, held_out_rows=args.held_out_rows,
        held_out_every=args.held_out_every, workers=args.workers or os.cpu_count() or 1, progress=not args.quiet,
    )
    digest = manifest_digest(manifest)
    size = sum(entry["bytes"] for entry in manifest["shards"])
    print(f"prepared {manifest['train_tokens']:,} training tokens ({manifest['train_rows']:,} rows of "
          f"{manifest['row_tokens']}) in {len(manifest['shards'])} shard files ({size / 1e6:,.1f} MB, "
          f"{manifest['dtype']}) and {manifest['held_out']['rows']} held-out rows under {args.out}")
    print(f"manifest digest {digest}\nrun it with:\n  task:\n    kind: lm\n    source: prepared\n"
          f"    manifest_digest: {digest}\n    shards_from: {Path(args.out).resolve()}   # or a URL serving it\n"
          f"    tokenizer: {manifest['tokenizer']['name']}\n    seq_len: {manifest['seq_len']}")
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

    # --- asyncloco data prepare (models/prepared.py) ---
    data = sub.add_parser("data", help="prepared corpora: `data prepare` tokenizes a dataset into shard files + manifest")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenize a dataset (hub or local files) into a prepared, sharded corpus "
                               "(docs/data-prepare.md)")
    prep.add_argument("--out", required=True, help="directory to write (manifest.json, train-*.bin, heldout.bin); "
                      "rerun with the same arguments to resume an interrupted preparation")
    prep.add_argument("--config", help="take source, path, name, split, text_field, tokenizer and seq_len from a run "
                      "config's task section (flags given here override it)")
    prep.add_argument("--source", choices=["embedded", "text", "json", "parquet", "hub"], help="default embedded")
    prep.add_argument("--path", nargs="+", help="files/globs (text/json/parquet) or a hub dataset id (hub)")
    prep.add_argument("--name", help="hub dataset configuration, e.g. sample-10BT or en")
    prep.add_argument("--split", help="default train")
    prep.add_argument("--text-field", help="the records' text column (default text)")
    prep.add_argument("--tokenizer", help="the run's tokenizer: embedded, embedded-32k (default) or a name/path")
    prep.add_argument("--seq-len", type=int, help="tokens per training sequence (default 256); rows hold seq_len + 1")
    prep.add_argument("--max-tokens", type=int, help="stop after this many training tokens (rows x seq_len)")
    prep.add_argument("--workers", type=int, help="tokenizer processes (default: one per core)")
    prep.add_argument("--shard-mb", type=float, default=16.0, help="size of a shard file in MiB (default 16)")
    prep.add_argument("--held-out-rows", type=int, default=2048, help="held-out rows for evaluation (default 2048)")
    prep.add_argument("--held-out-every", type=int, default=100,
                      help="hold out rows 0, N, 2N, ... of the packed stream (default 100)")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(func=cmd_data_prepare)

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
