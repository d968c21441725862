"""Attack benchmark (issue 7): final validation perplexity of the demo run under each attack, gate on and off.

Every run is the demo config (``configs/demo.yaml``: tiny Llama, embedded corpus, async DN + DyLU, int8)
with three honest peers at slowdowns 1, 1.5 and 4 as real processes on 127.0.0.1, plus for each attack
one extra peer — :mod:`asyncloco.testing.hostile`, admitted (the demo's admission is ``open``: an
insider, so admission is no defence here) — for the same wall time (``--duration`` seconds from the
moment the three honest peers have joined; the extra peer is started then). The clean run (the three honest peers alone) is measured in the same
invocation, with the gate on and with it off (``runtime.gate.enabled``), as the reference. After each
run the coordinator is stopped (its final snapshot) and θ is evaluated here on the run's validation
set, so "final perplexity" is exactly the model the run ended with.

Rows (the table of issue 7): ``clean``, ``honest`` (a 4th honest peer), ``huge`` (one update ×1e30,
then honest work), ``signflip`` (×1000), ``signflip-honest`` (at its honest norm), ``random`` (random
direction at its honest norm), ``ghost`` (only a DHT speed record claiming 1e12 tokens/s); ``--attacks``
adds others of the hostile peer (``nan``, ``replay``, ``other-lease``, ``ghost-forge``).

Usage::

    python scripts/bench_attacks.py                                  # the whole table, ~35 min
    nice -n 10 python scripts/bench_attacks.py --duration 30 --attacks signflip --gate on   # a quick check
    python scripts/bench_attacks.py --json runs/bench-attacks.json

Prints per run: final perplexity, its ratio to the clean run of the same gate setting, and the
coordinator's verdicts (applied / rejected / clipped updates of the hostile and of the honest peers).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncloco.local_cluster import LocalCluster  # noqa: E402

logger = logging.getLogger("bench_attacks")

TABLE = ["honest", "huge", "signflip", "signflip-honest", "random", "ghost"]
SLOWDOWNS = (1.0, 1.5, 4.0)


@dataclass
class Result:
    attack: str
    gate: bool
    duration_s: float
    perplexity: float
    version: int
    local_updates: int
    hostile: dict[str, int] = field(default_factory=dict)  # applied / rejected / clipped of the extra peer
    honest: dict[str, int] = field(default_factory=dict)  # the same, summed over the honest peers
    ratio: Optional[float] = None  # perplexity / the clean run's with the same gate setting
    max_abs_theta: float = 0.0


def write_config(base: Path, directory: Path, gate: bool) -> Path:
    config = yaml.safe_load(base.read_text())
    runtime = config.setdefault("runtime", {})
    runtime["run_id"] = f"bench-{uuid.uuid4().hex[:10]}"
    runtime.setdefault("gate", {})["enabled"] = gate
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def verdicts(events: list[dict[str, Any]], peers: set[str]) -> dict[str, int]:
    out = {"applied": 0, "rejected": 0, "clipped": 0}
    for event in events:
        if event.get("peer") not in peers:
            continue
        if event.get("type") == "applied":
            out["applied"] += 1
            out["clipped"] += int("clipped" in str(event.get("gate", "")) or "clipped" in str(event.get("reason", "")))
        elif event.get("type") == "rejected" and event.get("lease_id"):
            out["rejected"] += 1
    return out


def final_perplexity(config: Path, checkpoint_dir: Path) -> tuple[float, float]:
    import torch

    from asyncloco.config import load_config
    from asyncloco.coordinator.checkpoint import load_snapshot
    from asyncloco.models.workload import load_flat_params
    from asyncloco.workloads import build_workload

    cfg = load_config(config)
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)
    theta = load_snapshot(checkpoint_dir)["coordinator"]["params"]
    max_abs = float(theta.abs().max()) if bool(torch.isfinite(theta).all()) else math.inf
    load_flat_params(model, theta)
    return float(workload.evaluate(model).get("perplexity", math.nan)), max_abs


def run_one(base: Path, out: Path, attack: str, gate: bool, duration: float, threads: int) -> Result:
    name = f"{attack}-gate-{'on' if gate else 'off'}"
    workdir = out / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config = write_config(base, workdir, gate)
    cluster = LocalCluster(config, workdir / "run", threads=threads)
    honest_names = [f"peer{i}" for i in range(len(SLOWDOWNS))]
    hostile_id = ""
    try:
        cluster.start_coordinator()
        for peer, slowdown in zip(honest_names, SLOWDOWNS):
            cluster.start_peer(peer, slowdown)
        # the clock starts when the honest peers have joined (start-up time varies with the machine's load)
        cluster.wait_for(lambda: all(cluster.peer_summary(p).get("peer_id") for p in honest_names), 600, "the honest peers")
        started = time.monotonic()
        if attack == "honest":
            cluster.start_peer("extra", 1.0)
        elif attack != "clean":
            summary = workdir / "run" / "hostile.json"
            log = (workdir / "run" / "hostile.log").open("ab")
            process = subprocess.Popen(
                [sys.executable, "-m", "asyncloco.testing.hostile", "--initial-peers", str(cluster.multiaddr),
                 "--run-id", str(cluster.run_id), "--attack", attack, "--summary", str(summary), "--threads", str(threads),
                 "--spy-journal", str(cluster.checkpoint_dir / "events.jsonl"), "--config", str(config)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=cluster.env, start_new_session=True,
            )
            log.close()
            cluster.spawned.append(process)
        # equal wall time for every run: the benchmark's clock, not a synchronisation
        time.sleep(max(0.0, duration - (time.monotonic() - started)))
        if attack == "honest":
            hostile_id = cluster.peer_summary("extra").get("peer_id", "")
        elif attack != "clean":
            hostile_id = json.loads((workdir / "run" / "hostile.json").read_text()).get("peer_id", "")
        honest_ids = {cluster.peer_summary(peer).get("peer_id", "") for peer in honest_names}
    finally:
        cluster.close()
    events = cluster.events()
    status = cluster.status()
    perplexity, max_abs = final_perplexity(config, cluster.checkpoint_dir)
    return Result(
        attack=attack,
        gate=gate,
        duration_s=duration,
        perplexity=perplexity,
        version=int(status.get("version", 0)),
        local_updates=int(status.get("local_updates", 0)),
        hostile=verdicts(events, {hostile_id}) if hostile_id else {},
        honest=verdicts(events, honest_ids),
        max_abs_theta=max_abs,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| extra peer | gate | final perplexity | × clean | updates | hostile applied/rejected/clipped | honest rejected |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in results:
        hostile = "/".join(str(r.hostile.get(k, 0)) for k in ("applied", "rejected", "clipped")) if r.hostile else "—"
        honest = f"{r.honest.get('rejected', 0)} of {r.honest.get('applied', 0) + r.honest.get('rejected', 0)}"
        ratio = f"{r.ratio:.3g}" if r.ratio is not None and math.isfinite(r.ratio) else "—"
        lines.append(f"| {r.attack} | {'on' if r.gate else 'off'} | {r.perplexity:.4g} | {ratio} | {r.version} | {hostile} | {honest} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--duration", type=float, default=120.0, help="wall seconds of every run, from when the honest peers have joined")
    parser.add_argument("--attacks", nargs="*", default=TABLE, help=f"rows besides clean (default {TABLE})")
    parser.add_argument("--gate", choices=["on", "off", "both"], default="both")
    parser.add_argument("--out", default="runs/bench-attacks", help="work directory (logs, journals, checkpoints)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    gates = {"on": [True], "off": [False], "both": [True, False]}[args.gate]
    out = Path(args.out)
    results: list[Result] = []
    for gate in gates:
        clean: Optional[Result] = None
        for attack in ["clean", *args.attacks]:
            logger.info("run %s, gate %s, %.0f s", attack, "on" if gate else "off", args.duration)
            result = run_one(Path(args.config), out, attack, gate, args.duration, args.threads)
            if attack == "clean":
                clean = result
            if clean is not None and clean.perplexity > 0:
                result.ratio = result.perplexity / clean.perplexity
            results.append(result)
            logger.info("%s gate %s: perplexity %.4g (× clean %s)", attack, "on" if gate else "off", result.perplexity,
                        f"{result.ratio:.3g}" if result.ratio is not None else "—")
    print(table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
