"""SIGKILL the coordinator's main process at random moments of a real run, resume it each time, and check
the durability contract.

A coordinator and peers run as real processes on 127.0.0.1 (``asyncloco.local_cluster``). ``--kills`` times,
at a random moment (uniform in ``--min-gap``..``--max-gap`` seconds after the resumed coordinator applied its
first update), the coordinator's *Python process alone* gets SIGKILL — what the OOM killer does. Checked
every time: its DHT process dies with it (parent-death signal), the orphaned p2pd is reaped by
``--resume``, and updates are applied again (the seconds from the restart to the first applied update are
reported, apart from the restart itself: process start-up, replay, DHT). At the end (peers and coordinator stopped gracefully):

* every update a peer saw acknowledged (its log) is in the final state, at the version it was told, once;
* versions 1..V were each produced by exactly one lease;
* the final state equals a replay of the whole log from the initial snapshot (``runtime.wal_archive``): θ and
  the optimizer state bitwise, leases, shard progress, counters;
* the same peer processes ran from start to end.

Usage: ``python scripts/crash_test.py --config configs/demo.yaml --kills 20 [--peers 3] [--json out.json]``
(≈ 50 s per kill on a 2-core machine shared with other jobs, mostly the restart itself). ``tests/test_crash_replay.py`` runs it
with one kill (what only real processes can show: the DHT child dies with its owner, the orphaned p2pd is
reaped, the same peer processes carry on); crashes at every point of the decision path are tested in-process
(tests/test_inprocess_runtime.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import yaml

from asyncloco.config import RunConfig, load_config
from asyncloco.coordinator.checkpoint import CHILDREN_FILE, load_snapshot
from asyncloco.coordinator.daemon import INITIAL_SNAPSHOT, CoordinatorDaemon
from asyncloco.coordinator.wal import ARCHIVE_DIR, WAL_DIR
from asyncloco.local_cluster import LocalCluster

logger = logging.getLogger("crash_test")

ACK = re.compile(r"lease (L[0-9A-Za-z]+) accepted: version (\d+)( \(duplicate\))?")
RESTART_KEYS = ("held", "window_end")  # (and peers' last_seen): what a Restarted event changes


class CrashTestFailure(AssertionError):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise CrashTestFailure(what)


# ------------------------------------------------------------------------------------------ replay


def replay_whole_log(cfg: RunConfig, checkpoint_dir: Path, out: Path) -> CoordinatorDaemon:
    """A coordinator rebuilt from the run's initial snapshot and every log record (needs ``runtime.wal_archive``)."""
    wal = out / WAL_DIR
    wal.mkdir(parents=True)
    archive = checkpoint_dir / WAL_DIR / ARCHIVE_DIR
    shutil.copyfile(archive / INITIAL_SNAPSHOT, out / "state.pt")
    for segment in sorted(archive.glob("*.wal")) + sorted((checkpoint_dir / WAL_DIR).glob("*.wal")):
        shutil.copyfile(segment, wal / segment.name)
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=out, resume=True)
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    return daemon


def state_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two coordinator states differ: every entry of the logic's state dict — θ and the optimizer's
    tensors bitwise — except what the replaying coordinator's own restart changes afterwards (held requests,
    the grace window, peers' last-seen times, lease deadlines)."""
    out: list[str] = []
    if a.keys() != b.keys():
        out.append(f"state keys {sorted(a.keys() ^ b.keys())}")
    for key in sorted(a.keys() & b.keys()):
        if key in RESTART_KEYS:
            continue
        x, y = a[key], b[key]
        if key == "peers":
            x = {peer: {k: v for k, v in info.items() if k != "last_seen"} for peer, info in x.items()}
            y = {peer: {k: v for k, v in info.items() if k != "last_seen"} for peer, info in y.items()}
        if key == "leases":  # a restart gives a lease whose θ was not downloaded its time again (logic/peers.py)
            x = {i: {k: v for k, v in lease.items() if k not in ("deadline", "expected_finish")} for i, lease in x.items()}
            y = {i: {k: v for k, v in lease.items() if k not in ("deadline", "expected_finish")} for i, lease in y.items()}
        _diff(x, y, key, out)
    return out


def _diff(x: Any, y: Any, where: str, out: list[str]) -> None:
    if isinstance(x, torch.Tensor):
        if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
            out.append(where)
    elif isinstance(x, dict):
        if not isinstance(y, dict) or x.keys() != y.keys():
            out.append(f"{where} (keys)")
            return
        for k in x:
            _diff(x[k], y[k], f"{where}.{k}", out)
    elif isinstance(x, (list, tuple)):
        if not isinstance(y, (list, tuple)) or len(x) != len(y):
            out.append(f"{where} (length)")
            return
        for i, (u, v) in enumerate(zip(x, y)):
            _diff(u, v, f"{where}[{i}]", out)
    elif x != y:
        out.append(f"{where}: {x!r} != {y!r}")


# ---------------------------------------------------------------------------------------- processes


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def acks(cluster: LocalCluster, name: str) -> list[tuple[str, int, bool]]:
    path = cluster.workdir / f"{name}.log"
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [(m[1], int(m[2]), bool(m[3])) for m in ACK.finditer(text)]


def applied_after(cluster: LocalCluster, after: float) -> int:
    return sum(1 for e in cluster.events() if e.get("type") == "applied" and e.get("time", 0) > after)


# --smoke: the toy task (process start-up, not training, is what a kill waits for), one kill, one update each side
SMOKE_CONFIG = """
name: crash-toy
task: {kind: toy, dim: 32, hidden: 16, points: 4096, eval_points: 256, batch_size: 16, num_shards: 2}
outer: {buffer_size: 2}
schedule: {method: async_dn_dylu, max_local_steps: 10, grace_period: 0.0}
sim: {workers: 2}
runtime: {codec: int8, eval_every: 1000, speed_report_period: 2.0, lease_slack: 10.0}
"""
SMOKE = {"kills": 1, "slowdowns": (1.0, 1.5), "seed": 1, "snapshot_every": 4, "updates_before": 1, "updates_after": 1}


def prepare_config(config: Path, workdir: Path, snapshot_every: int, gate: bool) -> Path:
    raw = yaml.safe_load(config.read_text())
    runtime = raw.setdefault("runtime", {})
    if not gate:
        # the update gate judges directions against a consensus of the last updates; it is not what this
        # test checks, and a rejection it makes would count against nothing here but stall the run
        runtime.setdefault("gate", {})["enabled"] = False
    runtime["run_id"] = f"crash-{uuid.uuid4().hex[:10]}"
    runtime["wal_archive"] = True
    runtime["snapshot_every"] = snapshot_every
    runtime["snapshot_every_s"] = 20.0
    # leases outlive a restart (~10 s on a loaded machine), so peers' resends are applied, not rejected
    runtime["lease_slack"] = max(float(runtime.get("lease_slack", 0.0)), 60.0)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_crash_test(
    config: Path,
    workdir: Path,
    *,
    kills: int,
    slowdowns: tuple[float, ...] = (1.0, 1.5),
    seed: int = 0,
    min_gap: float = 0.2,
    max_gap: float = 4.0,
    snapshot_every: int = 5,
    gate: bool = False,
    recover_timeout: float = 90.0,
    env: dict[str, str] | None = None,
    updates_before: int = 2,
    updates_after: int = 2,
) -> dict[str, Any]:
    """Run the whole check; raise :class:`CrashTestFailure` on a violation; return the figures.
    ``updates_before``/``updates_after``: applied updates to wait for before the first kill and after the last."""
    rng = random.Random(seed)
    config_path = prepare_config(config, workdir, snapshot_every, gate)
    cfg = load_config(config_path)
    names = [f"peer{i}" for i in range(len(slowdowns))]
    recover_s: list[float] = []  # from serving again to the first applied update
    restart_s: list[float] = []  # from the --resume spawn to serving (process start, replay, DHT)
    gaps: list[float] = []
    reaped = 0
    with LocalCluster(config_path, workdir / "cluster", threads=1, env=env) as cluster:
        cluster.start_coordinator()
        for name, slowdown in zip(names, slowdowns):
            cluster.start_peer(name, slowdown=slowdown)
        started = time.time()
        cluster.wait_for(lambda: applied_after(cluster, started) >= updates_before, 180, f"the first {updates_before} applied updates")
        # every peer has joined (an acknowledged update each) before the first kill: a peer still joining when
        # the coordinator dies gives up (its compatibility check fails), which is not what this test is about
        cluster.wait_for(lambda: all(acks(cluster, name) for name in names), 180, "an acknowledged update per peer")
        pids = {name: p.pid for name, p in cluster.peers.items()}
        for kill in range(kills):
            gap = rng.uniform(min_gap, max_gap)
            gaps.append(gap)
            kill_at = time.monotonic() + gap
            cluster.wait_for(lambda: time.monotonic() >= kill_at, gap + 5, "the random kill moment", poll=0.02)
            assert cluster.coordinator is not None
            children = json.loads((cluster.checkpoint_dir / CHILDREN_FILE).read_text())
            os.kill(cluster.coordinator.pid, signal.SIGKILL)  # the main process only, as the OOM killer does
            cluster.coordinator.wait(timeout=30)
            dht_pid = children[0]["pid"]
            cluster.wait_for(lambda: not _alive(dht_pid), 15, f"the DHT process {dht_pid} to die with its owner")
            orphans = [c["pid"] for c in children[1:] if _alive(c["pid"])]
            restarted = time.time()
            cluster.start_coordinator(resume=True)
            serving = time.time()
            restart_s.append(serving - restarted)
            check(not [pid for pid in orphans if _alive(pid)], f"kill {kill}: orphans {orphans} survived --resume")
            reaped += len(orphans)
            cluster.wait_for(
                lambda: applied_after(cluster, restarted) >= 1, recover_timeout, f"an applied update after restart {kill + 1}"
            )
            first_applied = min(e["time"] for e in cluster.events() if e.get("type") == "applied" and e["time"] > restarted)
            recover_s.append(max(0.0, first_applied - serving))
            for name, process in cluster.peers.items():
                check(process.poll() is None and process.pid == pids[name], f"peer {name} died or was restarted")
            logger.info(
                "kill %d/%d after %.2fs: serving again after %.1fs, first update applied %.1fs later",
                kill + 1, kills, gap, restart_s[-1], recover_s[-1],
            )
        ended = time.time()
        cluster.wait_for(lambda: applied_after(cluster, ended) >= updates_after, recover_timeout, f"{updates_after} more applied updates")
        for name, process in cluster.peers.items():
            check(cluster.stop(process, timeout=60.0) == 0, f"peer {name} did not exit cleanly")
        check(cluster.stop_coordinator(timeout=60.0) == 0, "the coordinator did not exit cleanly")
        every_ack = [ack for name in names for ack in acks(cluster, name)]
        # leases chosen for a check are acknowledged when held and applied once their check agrees (at a later version);
        # one whose ack was lost to a kill is resent and acknowledged as the duplicate it is, at the version it got
        held = {e["lease_id"] for e in cluster.events() if e.get("type") == "held"}
        summaries = {name: cluster.peer_summary(name) for name in names}
        checkpoint_dir = cluster.checkpoint_dir

    final = load_snapshot(checkpoint_dir)["coordinator"]
    applied: dict[str, int] = {k: int(v) for k, v in final["applied"].items()}
    version = int(final["version"])
    check(sorted(applied.values()) == list(range(1, version + 1)), "versions 1..V not each produced by one lease")
    lease_ids = [lease_id for lease_id, _, _ in every_ack]
    check(len(set(lease_ids)) == len(lease_ids), "a lease was acknowledged twice")
    wrong = [(lid, v, applied.get(lid)) for lid, v, duplicate in every_ack
             if (applied.get(lid, -1) <= v and not (duplicate and applied.get(lid) == v) if lid in held
                 else applied.get(lid) != v)]
    check(not wrong, f"acknowledged updates missing or at another version: {wrong[:5]}")
    replayed = replay_whole_log(cfg, checkpoint_dir, workdir / "replay")
    differences = state_differences(replayed.node.state.state_dict(), final)
    check(not differences, f"final state differs from a replay of the log: {differences[:5]}")
    return {
        "kills": kills,
        "seed": seed,
        "kill_gaps_s": gaps,
        "recover_s": recover_s,
        "recover_s_max": max(recover_s) if recover_s else None,
        "restart_s": restart_s,
        "restart_s_max": max(restart_s) if restart_s else None,
        "orphans_reaped": reaped,
        "version": version,
        "acknowledged": len(every_ack),
        "duplicate_acks": sum(dup for _, _, dup in every_ack),
        "resends": sum(int(s.get("resends", 0)) for s in summaries.values()),
        "rejected": sum(int(s.get("rejected", 0)) for s in summaries.values()),
        "replayed_records": replayed.durability.replayed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--slowdowns", default="1,1.5,4", help="one peer per factor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("runs/crash-test"))
    parser.add_argument("--gate", action="store_true", help="keep the update gate on (off by default here)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="one kill of a toy run, one update before and after "
                        "(what tests/test_crash_replay.py runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    t0 = time.time()
    options: dict[str, Any] = {"kills": args.kills, "slowdowns": tuple(float(s) for s in args.slowdowns.split(",")),
                               "seed": args.seed, "snapshot_every": args.snapshot_every}
    if args.smoke:
        args.workdir.mkdir(parents=True)
        args.config = args.workdir / "toy.yaml"
        args.config.write_text(SMOKE_CONFIG)
        options = dict(SMOKE)
    try:
        result = run_crash_test(args.config, args.workdir, gate=args.gate, **options)
    except CrashTestFailure as failure:
        print(f"FAILED: {failure} (logs in {args.workdir})", file=sys.stderr)
        return 1
    result["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("kill_gaps_s", "recover_s", "restart_s")}, indent=1))
    print(f"restart: spawn to serving (s): {' '.join(f'{r:.1f}' for r in result['restart_s'])}")
    print(f"serving to the first applied update (s): {' '.join(f'{r:.1f}' for r in result['recover_s'])}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
