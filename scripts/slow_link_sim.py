"""The simulator over a slow link: what an upload's time does to Async DN + DyLU at link-covering leases.

Over ``home150`` (docs/wan.md) real runs with leases of 150-1,000 steps diverged at mean staleness 4.5, with no
verdict wait left to blame. This script asks the simulator, which shares the coordinator's logic, why: the tiny LM,
three workers at 1, 1.5 and 4 s per step, overlapped rounds (``sim.overlap``), the fastest worker's lease
``--steps`` long (DyLU sizes the others), inner state reset per lease (``runtime.verify.inner_state: reset``, what
the link-tuned runs use), and each variant side by side on the same data:

* ``instant``: uploads take no time (``sim.upload_s`` 0) — the reference;
* ``upload``: each update arrives ``--upload-fraction`` of a lease after its lease ended (``sim.upload_s``), the next
  lease training meanwhile from θ without it, int4 uploads (the link-tuned codec);
* ``upload_fp32``: the same with fp32 uploads — is it the codec?;
* ``upload_poly``: the same with each update weighted (1 + staleness)^-0.5 (the paper's "Poly", on top of DN);
* ``upload_momentum_0.8``: the same with the outer momentum at 0.8 instead of 0.9;
* ``upload_momentum_0.7``, ``upload_momentum_0.75``, ``upload_lr_0.35``: less outer momentum, half the outer lr;
  ``instant_momentum_0.7``: the reference with less momentum (is it the uploads, or the momentum at long leases?);
  ``upload_momentum_0.5``, ``instant_momentum_0.5``, ``upload_momentum_0.2``, ``upload_momentum_0.05``: less still;
* ``upload_scaled_30``, ``instant_scaled_30``: β 0.9 with ``outer.long_lease_momentum: scaled`` as if H were 30 (the
  demo's, leases lengthened by ``local_steps: auto``): each momentum step decays by 0.9^(h/30), h the buffer's mean;
* ``upload_scaled_30_sign``: the scaled rule with the demo's sign codec (``sgn15of16``) and no residual — what a
  home150 peer's fresh leases send; ``upload_scaled_30_sign_ef_carry``: the same with the inner state and the
  error-feedback residual carried from lease to lease (what it would send could it reveal them);
  ``instant_sign_ef_carry``: the demo's loopback setting (carried state, sign + feedback; run it with ``--steps 30``);
  ``upload_scaled_30_sign_ef_reset``: AdamW restarted each lease, the residual carried (what a verifier that could
  re-run every lease's predecessor would allow; verification off in the config: it refuses feedback with ``reset``);
  ``upload_scaled_30_sign_ef_pairs``: the same with the residual dropped at every other upload (``Pairs`` below: a
  check then needs at most the lease before it re-run); ``upload_scaled_30_sign_ef_segments_4``: inner state and
  residual carried across 4 leases, then a fresh start (``Segments`` below, a what-if);
  ``upload_scaled_30_sign_ef_after_check_0.75``: state and residual carried into a lease only after one drawn to be
  carried on (each with probability 0.75), else a fresh start (``AfterCheck`` below: what
  ``runtime.verify.slow_uplink_carry`` at 0.75 gives a slow uplink); ``upload_scaled_30_sign_ef_carry_batch_4``: carried
  throughout with 4 × the rows a step in a quarter of the steps — the same tokens and compute per lease, leases 4 ×
  shorter on the same link (a what-if: compare at equal rows, each evaluation's ``rows``);
* ``upload_buffer_5``: Delayed Nesterov's N at 5 × 2 = 10 arrivals (overlapped runs double it) instead of 6;
* ``upload_eager``: the same with each worker starting its next lease from θ minus the share of its in-flight
  update that the coordinator applies at once (outer lr / N): the engine's eager start (``schedule.eager_start``,
  algo/eager.py) at that share; ``upload_eager_lr``: the outer lr (the runtime's choice); ``upload_eager_whole``: all of
  it; ``upload_scaled_30_sign_ef_carry_eager``, ``..._eager_lr`` and ``..._eager_whole``: the three on the
  carried-throughout setting (is the upload's delay the peer's own update missing from the θ its next lease starts
  from?); ``upload_scaled_30_sign_ef_after_check_0.75_eager_lr``: the runtime's slow-uplink setting with it.

Prints, per variant, the perplexity (the toy's loss) at each evaluation, the mean staleness and the final value × the
instant run's, and writes them as JSON.

    python scripts/slow_link_sim.py --json docs/results/slow-link-sim-<date>.json      # ≈ 7 min a variant, 2 cores
    python scripts/slow_link_sim.py --variants instant,upload --updates 8000
    python scripts/slow_link_sim.py --smoke --json out.json                              # the toy task, seconds
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

import torch  # noqa: E402

from asyncloco.algo.outer import MomentumOptimizer  # noqa: E402
from asyncloco.algo.staleness import PolyDiscount  # noqa: E402
from asyncloco.config import RunConfig  # noqa: E402
from asyncloco.sim.engine import Simulation  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "instant": {"upload": False},
    "upload": {},
    "upload_fp32": {"codec": "none"},
    "upload_poly": {"poly": 0.5},
    "upload_momentum_0.8": {"momentum": 0.8},
    "upload_momentum_0.7": {"momentum": 0.7},
    "upload_momentum_0.75": {"momentum": 0.75},
    "instant_momentum_0.7": {"upload": False, "momentum": 0.7},
    "upload_momentum_0.5": {"momentum": 0.5},
    "instant_momentum_0.5": {"upload": False, "momentum": 0.5},
    "upload_momentum_0.2": {"momentum": 0.2},
    "upload_momentum_0.05": {"momentum": 0.05},
    "upload_scaled_30": {"reference": 30},
    "instant_scaled_30": {"upload": False, "reference": 30},
    "upload_lr_0.35": {"lr": 0.35},
    "upload_buffer_5": {"buffer": 5},
    "upload_scaled_30_sign": {"reference": 30, "codec": "sgn15of16", "ef": False},
    "upload_scaled_30_sign_ef_carry": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry"},
    "instant_sign_ef_carry": {"upload": False, "codec": "sgn15of16", "ef": True, "state": "carry"},
    "upload_scaled_30_sign_ef_reset": {"reference": 30, "codec": "sgn15of16", "ef": True, "verify": False},
    "upload_scaled_30_sign_ef_pairs": {"reference": 30, "codec": "sgn15of16", "ef": True, "verify": False, "pairs": True},
    "upload_scaled_30_sign_ef_segments_4": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry",
                                            "segments": 4},
    "upload_scaled_30_sign_ef_after_check_0.75": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry",
                                                  "after_check": 0.75},
    "upload_scaled_30_sign_ef_carry_batch_4": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry",
                                               "batch": 4},
    "upload_eager": {"eager": True},
    "upload_eager_lr": {"eager": "lr"},
    "upload_eager_whole": {"eager": "whole"},
    "upload_scaled_30_sign_ef_carry_eager": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry",
                                             "eager": True},
    "upload_scaled_30_sign_ef_carry_eager_lr": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry",
                                                "eager": "lr"},
    "upload_scaled_30_sign_ef_carry_eager_whole": {"reference": 30, "codec": "sgn15of16", "ef": True, "state": "carry",
                                                   "eager": "whole"},
    "upload_scaled_30_sign_ef_carry_eager_lr_ahead": {"reference": 30, "codec": "sgn15of16", "ef": True,
                                                      "state": "carry", "eager": "lr", "ahead": True},
    "upload_scaled_30_sign_ef_after_check_0.75_eager_lr": {"reference": 30, "codec": "sgn15of16", "ef": True,
                                                           "state": "carry", "after_check": 0.75, "eager": "lr"},
}


class Pairs(Simulation):
    """Each worker's residual is dropped at every other upload (its 2nd, 4th, ...): a residual lives across one lease
    boundary, so the encoding of any upload depends on at most the lease before it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uploads: dict[str, int] = {}  # per worker: uploads started

    def _upload(self, name: str, now: float) -> None:
        self.uploads[name] = self.uploads.get(name, 0) + 1
        feedback = self.workers[name].feedback
        if feedback is not None and self.uploads[name] % 2 == 0:
            feedback.drop()
        super()._upload(name, now)


class Segments(Simulation):
    """Each worker carries its inner state and residual across ``every`` leases, then starts fresh (its 1st, 1 +
    every-th, ... lease): a what-if for a peer whose uplink cannot carry a reveal — a check would re-run at most the
    segment's leases before it (the runtime does not do this; it carries on draws: ``AfterCheck``)."""

    every = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leases: dict[str, int] = {}  # per worker: leases started

    def _start(self, action: Any, now: float, theta: Any = None, asked: float | None = None) -> None:
        name = action.peer
        if self.workers[name].lease_id is not None:  # asked for ahead: it starts once the lease in training ends
            super()._start(action, now, theta, asked)
            return
        if self.leases.get(name, 0) % self.every == 0:
            worker = self.workers[name]
            worker.inner_state, worker.fast_state = {}, None
            if worker.feedback is not None:
                worker.feedback.drop()
        self.leases[name] = self.leases.get(name, 0) + 1
        super()._start(action, now, theta, asked)


class AfterCheck(Simulation):
    """Each worker carries its inner state and residual into a lease only when its previous lease was drawn to be
    carried on (each with probability ``fraction``), else starts fresh: what a peer whose uplink cannot carry a reveal
    gets from a coordinator that keeps the end states of its own re-runs (``runtime.verify.slow_uplink_carry``;
    coordinator/logic/leases.py ``draw_carry``) — the start of every carried lease is then at hand without a reveal."""

    fraction = 0.45

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drawn: dict[str, bool] = {}  # per worker: was its last lease drawn
        self.rng = random.Random(self.cfg.seed)

    def _start(self, action: Any, now: float, theta: Any = None, asked: float | None = None) -> None:
        name = action.peer
        if self.workers[name].lease_id is not None:  # asked for ahead: it starts once the lease in training ends
            super()._start(action, now, theta, asked)
            return
        if not self.drawn.get(name, False):
            worker = self.workers[name]
            worker.inner_state, worker.fast_state = {}, None
            if worker.feedback is not None:
                worker.feedback.drop()
        self.drawn[name] = self.rng.random() < self.fraction
        super()._start(action, now, theta, asked)


def config(args: argparse.Namespace, variant: dict[str, Any]) -> RunConfig:
    smoke = args.smoke
    task: dict[str, Any] = (
        {"kind": "toy", "dim": 16, "hidden": 16, "points": 2048, "eval_points": 256, "batch_size": 32, "num_shards": 4}
        if smoke else
        {"kind": "lm", "model": "tiny", "source": "embedded", "seq_len": 64, "batch_size": 8, "num_shards": 4,
         "val_sequences": 64}
    )
    steps = 10 if smoke else args.steps
    upload_s = 0.0 if variant.get("upload") is False else args.upload_fraction * steps  # the fastest: 1 s a step
    # batch k: k times the rows a step (each step k times as long), 1/k of the steps, the same upload time: the same
    # tokens and compute per lease in leases k times shorter (the inner schedule per token kept)
    k = variant.get("batch", 1)
    task["batch_size"] *= k
    return RunConfig.model_validate({
        "name": "slow-link-sim", "seed": args.seed, "task": task,
        "inner": {"lr": 1e-2 if smoke else 3e-3, "min_lr": 1e-3 if smoke else 3e-4,
                  "warmup_steps": max(1, (2 if smoke else 20) // k),
                  "total_steps_per_shard": 10_000 // k, "weight_decay": 0.1, "grad_clip": 1.0},
        "outer": {"lr": variant.get("lr", 0.7), "momentum": variant.get("momentum", 0.9),
                  "buffer_size": variant.get("buffer", 3)},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": max(2, steps // k), "min_steps": 2,
                     "grace_period": 1.0, "eager_start": eager_share(variant)},
        "sim": {"workers": 3, "profile": [1.0 * k, 1.5 * k, 4.0 * k],
                "total_local_updates": (200 if smoke else args.updates) // k,
                "eval_every": (50 if smoke else args.eval_every) // k, "overlap": True, "upload_s": upload_s,
                "ask_ahead_s": args.ask_ahead_fraction * steps if variant.get("ahead") and upload_s > 0 else 0.0,
                "methods": ["async_dn_dylu"], "seed": args.seed},
        "runtime": {"codec": variant.get("codec", "int4"), "error_feedback": variant.get("ef", False),
                    "error_feedback_decay": 0.5,
                    "verify": {"enabled": variant.get("verify", True), "inner_state": variant.get("state", "reset")}},
    })


def eager_share(variant: dict[str, Any]) -> float:
    """``schedule.eager_start`` of a variant (algo/eager.py): ``"lr"`` the outer lr, ``"whole"`` 1, ``True`` the
    outer lr / N (the part Delayed Nesterov applies at once), absent 0 (off)."""
    eager = variant.get("eager", False)
    lr = variant.get("lr", 0.7)
    return {"lr": lr, "whole": 1.0}.get(eager, lr / variant.get("buffer", 3)) if eager else 0.0


def run_variant(args: argparse.Namespace, name: str) -> dict[str, Any]:
    variant = VARIANTS[name]
    cfg = config(args, variant)
    kind = (Pairs if variant.get("pairs") else Segments if variant.get("segments")
            else AfterCheck if variant.get("after_check") else Simulation)
    simulation = kind(cfg, "async_dn_dylu")
    if isinstance(simulation, Segments):
        simulation.every = variant["segments"]
    if isinstance(simulation, AfterCheck):
        simulation.fraction = variant["after_check"]
    if "poly" in variant:
        simulation.state.transforms.append(PolyDiscount(variant["poly"]))
    if "reference" in variant:  # outer.long_lease_momentum: scaled as if H were this (leases sized by local_steps auto)
        assert isinstance(simulation.state.optimizer, MomentumOptimizer)
        simulation.state.optimizer.reference_steps = variant["reference"]
    started = time.perf_counter()
    result = simulation.run()
    staleness = result.staleness
    metric = "perplexity" if "perplexity" in result.final else "loss"  # the toy task (--smoke) has a loss only
    return {
        "upload_s": cfg.sim.upload_s, "codec": cfg.runtime.codec, "error_feedback": cfg.runtime.uses_error_feedback,
        "inner_state": cfg.runtime.verify.inner_state, "residual_pairs": bool(variant.get("pairs")),
        "carry_segment": variant.get("segments"), "carry_after_check": variant.get("after_check"),
        "momentum": cfg.outer.momentum, "ask_ahead_s": cfg.sim.ask_ahead_s,
        "outer_lr": cfg.outer.lr, "buffer_size": cfg.outer.buffer_size,
        "poly": variant.get("poly"), "momentum_reference_steps": variant.get("reference"), "eager": variant.get("eager", False), "metric": metric,
        "batch_multiple": variant.get("batch", 1),
        # rows trained (local steps × rows a step): equal tokens across variants whatever their batch
        "evals": [{"version": int(e["version"]), "local_updates": int(e["local_updates"]),
                   "rows": int(e["local_updates"]) * cfg.task.batch_size,
                   metric: round(float(e[metric]), 4)} for e in result.evals],
        "final": round(float(result.final[metric]), 4),
        "max": round(max(float(e[metric]) for e in result.evals[1:]), 4),
        "mean_staleness": round(sum(staleness) / len(staleness), 3) if staleness else None,
        "applied": result.applied, "wall_s": round(time.perf_counter() - started, 1),
    }


def arguments() -> argparse.ArgumentParser:
    """The script's command line (also read by scripts/gate_own_update.py ``--sim`` for a variant's settings)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=860, help="the fastest worker's lease (home150's: 820-940 steps)")
    parser.add_argument("--upload-fraction", type=float, default=0.5,
                        help="an upload's time in leases (home150: ≈ 15 s up, ≈ 30-40 s leases)")
    parser.add_argument("--ask-ahead-fraction", type=float, default=0.8,
                        help="the ..._ahead variants: a worker asks for its next lease (taking its θ) this share of the "
                             "fastest lease before its lease ends (home150: 1.5 × a download ≈ 0.8 of a lease)")
    parser.add_argument("--updates", type=int, default=14_000, help="local steps in all (sim.total_local_updates)")
    parser.add_argument("--eval-every", type=int, default=1_500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--smoke", action="store_true", help="the toy task, 10-step leases, seconds of work")
    parser.add_argument("--json", help="write the result here")
    return parser


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    runs: dict[str, Any] = {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    for name in names:
        runs[name] = run_variant(args, name)
        r = runs[name]
        print(f"{name:22s} staleness {r['mean_staleness']}  final {r['metric']} {r['final']:>12,.2f}  max {r['max']:>12,.2f}"
              f"  ({r['wall_s']:.0f} s)", flush=True)
        print("    " + "  ".join(f"v{e['version']}:{e[r['metric']]:,.2f}" for e in r["evals"]), flush=True)
        if "instant" in runs:
            for other in runs.values():
                other["final_vs_instant"] = round(other["final"] / runs["instant"]["final"], 3)
        out = {"script": "scripts/slow_link_sim.py", "argv": sys.argv[1:], "commit": commit,
               "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
               "date": time.strftime("%Y-%m-%d"), "runs": runs, "finished": list(runs) == names}
        if args.json:  # after every variant: a run stopped part-way keeps the variants it finished
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
