"""Bytes the coordinator process writes to storage per applied update, in a real run.

Starts ``asyncloco coordinator`` with a config (default ``configs/demo.yaml``) and two peers as real
processes on 127.0.0.1 (``asyncloco.local_cluster``), lets them train for ``--duration`` seconds, stops them
gracefully, and reads the coordinator's ``/proc/<pid>/io`` (``write_bytes``: bytes this process caused to
be sent to the storage layer; ``cancelled_write_bytes``: of those, dirty pages dropped before write-back
because their file was deleted or truncated) until it exits. Divides by the applied updates and by θ's
fp32 size. Prints one JSON object.

Usage: ``python scripts/storage_per_update.py [--config configs/demo.yaml] [--duration 120] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import yaml

from asyncloco.coordinator.checkpoint import load_snapshot
from asyncloco.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]


def read_io(pid: int) -> dict[str, int] | None:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return None
    return {key: int(value) for key, value in (line.split(": ") for line in text.splitlines())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--slowdowns", default="1,1.5")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "storage-per-update")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--updates", type=int, default=0, help="end once this many updates are applied (--duration caps it)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: one peer of the demo until 2 updates (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.duration, args.slowdowns, args.updates = 120.0, "1", 2
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    args.workdir.mkdir(parents=True)
    raw = yaml.safe_load(args.config.read_text())
    raw.setdefault("runtime", {})["run_id"] = f"io-{uuid.uuid4().hex[:10]}"
    config = args.workdir / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    with LocalCluster(config, args.workdir / "cluster", threads=1) as cluster:
        cluster.start_coordinator()
        assert cluster.coordinator is not None
        pid = cluster.coordinator.pid
        at_start = read_io(pid)
        for i, slowdown in enumerate(float(s) for s in args.slowdowns.split(",")):
            cluster.start_peer(f"peer{i}", slowdown=slowdown)
        deadline = time.monotonic() + args.duration

        def ended() -> bool:
            applied = int(cluster.status().get("version", 0) or 0)
            return time.monotonic() >= deadline or (args.updates > 0 and applied >= args.updates)

        started = time.monotonic()
        cluster.wait_for(ended, args.duration + 10, "the end of the run", poll=0.5 if args.updates else 1.0)
        args.duration = round(time.monotonic() - started, 1)
        for process in cluster.peers.values():
            cluster.stop(process, timeout=60.0)
        before_stop = read_io(pid)
        last = before_stop
        os.kill(pid, signal.SIGTERM)  # the final snapshot is part of the run's writes
        while cluster.coordinator.poll() is None:
            last = read_io(pid) or last
            time.sleep(0.05)  # sampling /proc until the process is gone
        cluster.stop_coordinator()
        final = load_snapshot(cluster.checkpoint_dir)
    updates = int(final["coordinator"]["version"])
    theta_bytes = 4 * int(final["coordinator"]["params"].numel())
    assert at_start is not None and before_stop is not None and last is not None
    net = last["write_bytes"] - last["cancelled_write_bytes"]
    result = {
        "config": str(args.config),
        "duration_s": args.duration,
        "applied_updates": updates,
        "theta_fp32_bytes": theta_bytes,
        "write_bytes": last["write_bytes"],
        "cancelled_write_bytes": last["cancelled_write_bytes"],
        "write_bytes_startup": at_start["write_bytes"],
        "write_bytes_until_stop": before_stop["write_bytes"],
        "per_update_theta": last["write_bytes"] / max(updates, 1) / theta_bytes,
        "per_update_theta_net_of_cancelled": net / max(updates, 1) / theta_bytes,
        "per_update_theta_during_run": (before_stop["write_bytes"] - at_start["write_bytes"]) / max(updates, 1) / theta_bytes,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
