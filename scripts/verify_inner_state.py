"""What runtime.verify.inner_state "reset" costs in quality, in the simulator (it shares the peers' inner loop).

Verification re-runs a lease from θ_base and the data (asyncloco/coordinator/verify.py); that needs every lease
to start from a fresh inner AdamW state ("reset") instead of the state a peer carries across its leases
("carry", the paper). This runs Async DN + DyLU both ways on the same configs and seeds, at the config's
budget of local updates, and prints the final loss (and perplexity for LM tasks) side by side with the ratio
reset ÷ carry.

    python scripts/verify_inner_state.py --configs configs/toy.yaml configs/lm-tiny.yaml --seeds 0 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from asyncloco.config import RunConfig, load_config
from asyncloco.sim.engine import Simulation

logger = logging.getLogger("verify_inner_state")


def run_one(path: str, seed: int, mode: str, method: str, updates: int | None, warmup: int = 0) -> dict[str, Any]:
    raw = load_config(path).model_dump(mode="json")
    raw["seed"] = seed
    raw["sim"]["seed"] = seed
    if updates is not None:
        raw["sim"]["total_local_updates"] = updates
    raw["runtime"]["verify"] = {"inner_state": mode, "lease_warmup": warmup if mode == "reset" else 0}
    cfg = RunConfig.model_validate(raw)
    started = time.perf_counter()
    sim = Simulation(cfg, method)
    result = sim.run()
    final = dict(result.final)
    return {"config": path, "seed": seed, "inner_state": mode, "final": final, "wall_s": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["configs/toy.yaml", "configs/lm-tiny.yaml"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--method", default="async_dn_dylu")
    parser.add_argument("--updates", type=int, default=None, help="sim.total_local_updates (default: the config's)")
    parser.add_argument("--lease-warmup", type=int, default=0, help="runtime.verify.lease_warmup of the reset runs")
    parser.add_argument("--modes", nargs="+", default=["carry", "reset"], choices=["carry", "reset"])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="seconds of work: the toy config, one seed, 100 updates (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        toy = Path(__file__).resolve().parents[1] / "configs" / "toy.yaml"
        args.configs, args.seeds, args.updates = [str(toy)], [0], args.updates or 100
    logging.basicConfig(level=logging.WARNING)
    rows: list[dict[str, Any]] = []
    for path in args.configs:
        for seed in args.seeds:
            for mode in args.modes:  # interleaved per seed
                rows.append(run_one(path, seed, mode, args.method, args.updates, args.lease_warmup))
                if args.json is not None:
                    args.json.write_text(json.dumps(rows, indent=1))
    out = sys.stdout
    if args.modes != ["carry", "reset"]:
        for row in rows:
            out.write(f"{row['config']} seed {row['seed']} {row['inner_state']}: {row['final']}\n")
        return 0
    out.write(f"{'config':<22} {'seed':>4} {'carry loss':>11} {'reset loss':>11} {'reset/carry':>11}  metric\n")
    for path in args.configs:
        ratios = []
        for seed in args.seeds:
            pair = {r["inner_state"]: r for r in rows if r["config"] == path and r["seed"] == seed}
            metric = "perplexity" if "perplexity" in pair["carry"]["final"] else "loss"
            carry, reset = pair["carry"]["final"][metric], pair["reset"]["final"][metric]
            ratios.append(reset / carry)
            out.write(f"{path:<22} {seed:>4} {pair['carry']['final']['loss']:>11.4f} {pair['reset']['final']['loss']:>11.4f} "
                      f"{reset / carry:>11.4f}  {metric}\n")
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        out.write(f"{path:<22} geometric mean reset/carry ({'perplexity' if 'lm' in path else 'loss'}): {geo:.4f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
