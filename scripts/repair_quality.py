"""What a repair does to θ's quality (docs/threat-model.md, "The remedy").

A failed check expels a peer and rebuilds the coordinator state by replaying the write-ahead log from a repair anchor
with that peer's submissions discarded (asyncloco/coordinator/repair.py). This script replays a finished run's log
offline and evaluates the validation perplexity of:

* the live θ just before the failing verdict (every record handled as logged);
* the θ of ``repair: discard`` (the expelled peer's submissions left out);
* for comparison, the θ a repair would give if it discarded *another* peer's submissions instead (each peer in turn)
  — how much of the damage comes from removing entangled updates rather than from the attacker's direction;
* the θ of the default repair (``runtime.verify.repair: rerun``): the expelled peer's applied updates replaced by the
  coordinator's honest re-runs of its leases (asyncloco/coordinator/substitute.py); what the live gate refused of it
  stays refused (the replay makes every decision the live run made: asyncloco/coordinator/repair.py).

    python scripts/repair_quality.py runs/bench-slack/hidden_0.005_foreign-gate-on --json out.json

The run directory is a bench_attacks.py run's (``config.yaml`` and ``run/coordinator/``); the first failed verdict
after the oldest repair anchor is the one replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

from asyncloco.config import load_config  # noqa: E402
from asyncloco.coordinator.checkpoint import load_snapshot, snapshot_wal_seq  # noqa: E402
from asyncloco.coordinator.daemon import EVENT_TYPES, CoordinatorDaemon  # noqa: E402
from asyncloco.coordinator.logic import SubmitUpdate, Verified, handle  # noqa: E402
from asyncloco.coordinator.repair import ANCHOR_DIR, log_events, repair  # noqa: E402
from asyncloco.coordinator.rerun import Rerunner  # noqa: E402
from asyncloco.coordinator.substitute import Substitutes  # noqa: E402
from asyncloco.coordinator.wal import WAL_DIR, read_records  # noqa: E402
from asyncloco.models.workload import load_flat_params  # noqa: E402
from asyncloco.workloads import build_workload  # noqa: E402


def measure(run: Path) -> dict[str, Any]:
    cfg = load_config(run / "config.yaml")
    coordinator = run / "run" / "coordinator"
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=Path(tempfile.mkdtemp(prefix="repair-quality-")))
    verification = daemon.verification
    assert verification is not None, "the run's config must have runtime.verify.enabled"
    anchors = sorted((coordinator / ANCHOR_DIR).iterdir())
    anchor = load_snapshot(anchors[0])
    wal = coordinator / WAL_DIR
    last = max(record.seq for directory in (wal / "archive", wal) for record in read_records(directory, 0))
    events = list(log_events(wal, snapshot_wal_seq(anchor), last, EVENT_TYPES, daemon.numel))
    cut = next(i for i, (event, _) in enumerate(events) if isinstance(event, Verified) and not event.ok)
    records = events[: cut + 1]
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)

    def perplexity(theta: Any) -> float:
        load_flat_params(model, theta.float())
        return float(workload.evaluate(model)["perplexity"])

    def fresh() -> Any:
        state = verification.fresh_state()
        state.load_state_dict(anchor["coordinator"])
        return state

    live = fresh()
    for event, now in records:
        handle(live, event, now)
    failed = records[-1][0]
    assert isinstance(failed, Verified)
    expelled = failed.peer
    submissions = Counter(event.peer for event, _ in records if isinstance(event, SubmitUpdate))
    result: dict[str, Any] = {"run": str(run), "anchor": anchors[0].name, "live_version": live.version,
                              "live_perplexity": perplexity(live.params), "expelled": expelled, "discards": []}
    for peer, count in submissions.most_common():
        repaired = repair(fresh(), records, [peer], live.version, dict(live.leases), live.lease_counter,
                          dict(live.verification.chain))
        result["discards"].append({"peer": peer, "expelled": peer == expelled, "updates_discarded": count,
                                   "perplexity": perplexity(repaired.state.params)})
    # the default repair (runtime.verify.repair: rerun): the expelled peer's updates replaced by honest re-runs
    started = time.perf_counter()
    substitutes = Substitutes(Rerunner(cfg, workload), Path(tempfile.mkdtemp(prefix="repair-quality-rerun-")),
                              daemon.numel, carry=cfg.runtime.verify.inner_state == "carry")
    rerun = repair(fresh(), records, [expelled], live.version, dict(live.leases), live.lease_counter,
                   dict(live.verification.chain), substitute=substitutes)
    result["rerun"] = {"updates_replaced": rerun.substituted, "updates_discarded": rerun.discarded,
                       "refused_as_sent": rerun.refused,
                       "inner_steps": substitutes.steps, "seconds": round(time.perf_counter() - started, 2),
                       "perplexity": perplexity(rerun.state.params)}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, nargs="?", help="a bench_attacks.py run directory with a failed verdict")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="first `bench_attacks.py --smoke` (its attacker is caught) "
                        "into a temporary directory, then its attack run (tests run the two in turn)")
    args = parser.parse_args(argv)
    if args.smoke and args.run is None:
        import subprocess

        out = Path(tempfile.mkdtemp(prefix="repair-quality-smoke-"))
        subprocess.run([sys.executable, str(Path(__file__).with_name("bench_attacks.py")), "--smoke", "--out", str(out)],
                       check=True)
        args.run = next(p for p in sorted(out.iterdir()) if p.is_dir() and not p.name.startswith("clean"))
    if args.run is None:
        parser.error("give a run directory (or --smoke)")
    result = measure(args.run)
    print(f"live θ before the verdict: version {result['live_version']}, perplexity {result['live_perplexity']:.1f}")
    for row in result["discards"]:
        who = "the expelled peer" if row["expelled"] else "another peer"
        print(f"discard {who} ({row['peer'][-6:]}, {row['updates_discarded']} updates): perplexity {row['perplexity']:.1f}")
    rerun = result["rerun"]
    print(f"repair: rerun (the default) — {rerun['updates_replaced']} updates replaced by honest re-runs "
          f"({rerun['inner_steps']} inner steps, {rerun['seconds']} s), {rerun['updates_discarded']} discarded, "
          f"{rerun['refused_as_sent']} refused as sent (as the live gate refused them): "
          f"perplexity {rerun['perplexity']:.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
