"""A validator peer at a paper size: what verification costs and how long a verdict takes.

A real run as processes on this machine (asyncloco/local_cluster.py): the coordinator with the demo config's
task and schedule at the ``--preset`` model size, verification on with the carried inner state,
``runtime.verify.local: false`` (the coordinator re-runs nothing itself) and one validator peer
(``asyncloco validator join``, listed under ``runtime.verify.validators``) that re-runs every chosen lease; three
honest peers (slowed ×1, ×1.5, ×4, as the demo). It runs until ``--verdicts`` verdicts are in (or
``--timeout`` s), then reads the journal: leases applied and re-run, the re-run steps as a fraction of the
trained steps, the seconds from a lease's application to its verdict, and that every honest verdict passed.

    python scripts/bench_validator.py --preset 20m --verdicts 8 --json out.json

Heavy (four training processes and a validator on this machine's cores): run it under
``flock /tmp/asyncloco-heavy.lock``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

import yaml

logger = logging.getLogger("bench_validator")
SLOWDOWNS = (1.0, 1.5, 4.0)


def write_config(directory: Path, preset: str, validator_id: str, fraction: float, probation: int) -> Path:
    from asyncloco.shipped import resolve_config

    cfg = yaml.safe_load(Path(resolve_config("demo")).read_text())
    cfg["task"]["model"] = preset
    cfg["runtime"]["run_id"] = f"bench-validator-{uuid.uuid4().hex[:6]}"
    cfg["runtime"]["verify"] = {"enabled": True, "inner_state": "carry", "fraction": fraction,
                                "probation_updates": probation, "local": False, "validators": [validator_id]}
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(args: argparse.Namespace) -> Dict[str, Any]:
    from asyncloco.local_cluster import LocalCluster
    from asyncloco.validator import identity_peer_id

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-validator-"))
    workdir.mkdir(parents=True, exist_ok=True)
    key = workdir / "validator.key"
    validator_id = identity_peer_id(str(key))
    config = write_config(workdir, args.preset, validator_id, args.fraction, args.probation)
    started = time.monotonic()
    with LocalCluster(config, workdir / "run", threads=1) as cluster:
        cluster.start_coordinator(timeout=300.0)
        cluster.start_validator("validator", key)
        for index, slowdown in enumerate(args.slowdowns):
            cluster.start_peer(f"peer{index}", slowdown)
        cluster.wait_for(lambda: len([e for e in cluster.events() if e.get("type") == "verdict"]) >= args.verdicts,
                         args.timeout, f"{args.verdicts} verdicts", poll=1.0)
        status = cluster.status()
    events = cluster.events()
    applied = {e["lease_id"]: e for e in events if e.get("type") == "applied"}
    verdicts = [e for e in events if e.get("type") == "verdict"]
    latency = [v["time"] - applied[v["lease_id"]]["time"] for v in verdicts if v["lease_id"] in applied]
    trained = sum(int(e.get("steps", 0)) for e in applied.values())
    rerun = sum(int(applied[v["lease_id"]].get("steps", 0)) for v in verdicts if v["lease_id"] in applied)
    return {
        "preset": args.preset,
        "parameters": status.get("parameters"),
        "fraction": args.fraction,
        "probation_updates": args.probation,
        "peers": len(args.slowdowns),
        "applied": len(applied),
        "verdicts": len(verdicts),
        "verdicts_failed": sum(not v["ok"] for v in verdicts),
        "all_by_the_validator": all(str(v.get("detail", "")).endswith(f"(validator {validator_id[-8:]})") for v in verdicts),
        "rerun_steps": rerun,
        "trained_steps": trained,
        "rerun_fraction_of_training": rerun / trained if trained else None,
        "verdict_latency_s": {"median": statistics.median(latency), "max": max(latency)} if latency else None,
        "verification_status": status.get("verification"),
        "wall_s": time.monotonic() - started,
        "workdir": str(workdir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="20m", help="model size (default 20m)")
    parser.add_argument("--verdicts", type=int, default=8, help="stop once this many verdicts are in")
    parser.add_argument("--fraction", type=float, default=0.08, help="runtime.verify.fraction (the default 0.08)")
    parser.add_argument("--probation", type=int, default=2, help="runtime.verify.probation_updates (the default 2)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds to wait for the verdicts")
    parser.add_argument("--workdir", help="where the run's logs go (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--slowdowns", default=",".join(f"{s:g}" for s in SLOWDOWNS), help="one honest peer per factor")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny, one peer, its first probation "
                        "verdict (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.verdicts, args.slowdowns, args.timeout = "tiny", 1, "1", 180.0
    args.slowdowns = [float(s) for s in args.slowdowns.split(",") if s]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = run(args)
    lat = out["verdict_latency_s"] or {"median": float("nan"), "max": float("nan")}
    print(f"{out['preset']} ({out['parameters']:,} parameters): {out['verdicts']} verdicts ({out['verdicts_failed']} failed, "
          f"all by the validator: {out['all_by_the_validator']}) over {out['applied']} applied leases; re-run steps "
          f"{out['rerun_steps']} of {out['trained_steps']} trained ({out['rerun_fraction_of_training']:.3f}); "
          f"application -> verdict median {lat['median']:.1f} s, max {lat['max']:.1f} s; wall {out['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["verdicts"] and out["verdicts_failed"] == 0 and out["all_by_the_validator"] else 1


if __name__ == "__main__":
    sys.exit(main())
