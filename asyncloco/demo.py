"""``asyncloco demo``: a coordinator and heterogeneous peers as real processes on this machine.

Starts the coordinator (ports chosen by the OS), one peer per ``slowdowns`` entry (a peer with
slowdown 4 emulates a device 4× slower), prints live progress, stops everything after
``duration`` seconds of training — counted from when every peer has joined, so a large model's start-up
(tokenizer, data, building it in each process) does not eat the demo (SIGTERM: the coordinator snapshots, every p2pd exits), then prints a summary
table and writes a plot of validation perplexity against wall-clock time.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from asyncloco.local_cluster import ClusterError, LocalCluster

__all__ = ["DemoOptions", "run_demo", "summary_table", "wait_for_peers"]

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT = 600.0  # seconds the demo waits for its peers to join before it starts counting --duration


@dataclass
class DemoOptions:
    config: str
    duration: float
    slowdowns: list[float]
    out: Path
    overrides: dict[str, Any] = field(default_factory=dict)  # --model / --set (asyncloco/overrides.py)
    swarm: bool = False  # --swarm: peers fetch θ from each other and serve what they hold (transport/swarm.py)


def _resolve(path: str) -> Path:
    from asyncloco.shipped import resolve_config

    return resolve_config(path)


class _Process(Protocol):
    returncode: int | None

    def poll(self) -> int | None: ...


def wait_for_peers(
    status: Callable[[], dict[str, Any]], processes: Mapping[str, _Process], out: Path, timeout: float,
    poll: float = 1.0,
) -> bool:
    """Wait until status.json counts as many live peers as ``processes`` has (each loads its data and builds
    the model first: ~1 min for 60m with three peers on two cores). True when they all joined, False at
    ``timeout`` (the demo then trains for its duration anyway); a peer that exits meanwhile is a
    :class:`ClusterError` naming its log."""
    deadline = time.monotonic() + timeout
    while True:
        for name, process in processes.items():
            if process.poll() is not None:
                raise ClusterError(f"{name} exited early ({process.returncode}); see {out / (name + '.log')}")
        peers = status().get("peers", {})
        if sum(1 for row in peers.values() if row.get("alive")) >= len(processes):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)  # status.json is rewritten every few seconds by the coordinator


def summary_table(status: dict[str, Any], peers: dict[str, dict[str, Any]], slowdowns: dict[str, float]) -> str:
    by_id = {summary.get("peer_id"): name for name, summary in peers.items()}
    lines = [
        f"{'peer':6s} {'slowdown':>8s} {'speed tok/s':>11s} {'leases':>6s} {'steps/lease':>11s} {'applied':>7s} "
        f"{'mean stale':>10s} {'expired':>7s} {'MB sent':>8s} {'MB recv':>8s} {'idle':>5s}",
    ]
    lines.append("-" * len(lines[0]))
    for peer_id, stats in sorted(status.get("peers", {}).items(), key=lambda kv: by_id.get(kv[0], kv[0])):
        name = by_id.get(peer_id, peer_id[-6:])
        summary = peers.get(name, {})
        traffic = summary.get("traffic", {})
        sent = sum(t.get("bytes_sent", 0) for t in traffic.values()) / 1e6
        received = sum(t.get("bytes_received", 0) for t in traffic.values()) / 1e6
        per_lease = stats["steps_assigned"] / stats["leases"] if stats["leases"] else 0.0
        stale = stats["staleness_sum"] / stats["applied"] if stats["applied"] else 0.0
        # time not training / wall time since the peer's first lease request (peer/summary.py)
        idle = f"{100 * summary['idle_fraction']:4.0f}%" if "idle_fraction" in summary else "    -"
        lines.append(
            f"{name:6s} {slowdowns.get(name, 1.0):8.1f} {stats['speed']:11.0f} {stats['leases']:6d} {per_lease:11.1f} "
            f"{stats['applied']:7d} {stale:10.2f} {stats['expired']:7d} {sent:8.2f} {received:8.2f} {idle:>5s}"
        )
    evals = status.get("evals", [])
    if evals:
        first, last = evals[0], evals[-1]
        lines.append(
            f"\nupdates applied: {status.get('version')} ({status.get('local_updates')} local steps); validation "
            f"perplexity {first.get('perplexity', float('nan')):.1f} → {last.get('perplexity', float('nan')):.1f}"
        )
    swarm = swarm_line(status, peers)
    if swarm:
        lines.append(swarm)
    return "\n".join(lines)


def swarm_line(status: dict[str, Any], peers: dict[str, dict[str, Any]]) -> str:
    """θ through the swarm, when the peers used it: downloads through the swarm and fallbacks to the
    coordinator (the peers' summaries), and what the coordinator's seed sent itself (status.json)."""
    downloads = sum(int(summary.get("swarm_downloads", 0)) for summary in peers.values())
    fallbacks = sum(int(summary.get("swarm_fallbacks", 0)) for summary in peers.values())
    if not downloads and not fallbacks:
        return ""
    seed = (status.get("swarm") or {}).get("seed_bytes_sent", 0) / 1e6
    served = sum(int(summary.get("swarm_bytes_served", 0)) for summary in peers.values()) / 1e6
    return (f"θ swarm: {downloads} downloads through the swarm, {fallbacks} fell back to the coordinator; "
            f"the peers served {served:.2f} MB of chunks to each other, the coordinator's seed {seed:.2f} MB")


def _plot(evals: list[dict[str, Any]], started: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [e["time"] - started for e in evals]
    ys = [e.get("perplexity", e["loss"]) for e in evals]
    ax.plot(xs, ys, marker="o", ms=3)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title("asyncloco demo: Async DN + DyLU, heterogeneous peers")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(options: DemoOptions) -> int:
    if not options.slowdowns or any(s < 1 for s in options.slowdowns):
        raise ValueError("--slowdowns needs one factor >= 1 per peer, e.g. 1,1.5,4")
    if options.duration <= 0:
        raise ValueError("--duration must be positive")
    config = _resolve(options.config)
    raw = None
    if options.overrides:  # validated here, before anything starts; the processes load the effective config
        from asyncloco.config import load_raw_config

        raw = load_raw_config(config, options.overrides)
    if options.out.exists():
        shutil.rmtree(options.out)  # a demo always starts fresh
    options.out.mkdir(parents=True)
    if raw is not None:
        import yaml

        effective = options.out / f"{config.stem}.yaml"
        effective.write_text(yaml.safe_dump(raw, sort_keys=False))
        config = effective
    names = [f"peer{i}" for i in range(len(options.slowdowns))]
    slowdowns = dict(zip(names, options.slowdowns))
    with LocalCluster(config, options.out) as cluster:
        print(f"starting the coordinator ({config.name}) ...", flush=True)
        # the live dashboard, on 127.0.0.1 only, at a port the OS picks (coordinator/dashboard.py)
        address = cluster.start_coordinator(extra=("--dashboard-port", "0"))
        started = time.time()
        print(f"coordinator at {address}", flush=True)
        dashboard = cluster.status().get("dashboard")
        if dashboard:
            print(f"live dashboard: {dashboard}  (or: asyncloco status --url {dashboard})", flush=True)
        swarm = ("--swarm", "--serve") if options.swarm else ()  # on 127.0.0.1 every peer is reachable: all serve
        for name in names:
            cluster.start_peer(name, slowdown=slowdowns[name], extra=swarm)
            print(f"started {name} (slowdown ×{slowdowns[name]:g}{', θ through the swarm' if swarm else ''})", flush=True)
        print(f"waiting for the {len(names)} peers to join (each loads the data and builds the model) ...", flush=True)
        if wait_for_peers(cluster.status, {name: cluster.peers[name] for name in names}, options.out, _JOIN_TIMEOUT):
            print(f"[{time.time() - started:5.0f}s] all peers joined; training for {options.duration:g} s", flush=True)
        else:
            print(f"not every peer joined within {_JOIN_TIMEOUT:g} s; training for {options.duration:g} s anyway", flush=True)
        end = time.monotonic() + options.duration
        last_line = ""
        while time.monotonic() < end:
            status = cluster.status()
            evals = status.get("evals", [])
            ppl = f"{evals[-1].get('perplexity', float('nan')):.1f}" if evals else "-"
            line = (
                f"[{time.time() - started:5.0f}s] version {status.get('version', 0):4d}  local steps "
                f"{status.get('local_updates', 0):6d}  active leases {status.get('active_leases', 0)}  val ppl {ppl}"
            )
            if line != last_line:
                print(line, flush=True)
                last_line = line
            for name, process in cluster.peers.items():
                if process.poll() is not None:
                    raise ClusterError(f"{name} exited early ({process.returncode}); see {options.out / (name + '.log')}")
            time.sleep(max(0.0, min(5.0, end - time.monotonic())))  # progress display interval
        print("stopping peers and coordinator ...", flush=True)
        for name in names:
            cluster.stop(cluster.peers[name])
        cluster.stop_coordinator()
        status = cluster.status()
        peers = {name: cluster.peer_summary(name) for name in names}
    table = summary_table(status, peers, slowdowns)
    print("\n" + table)
    evals = status.get("evals", [])
    if evals:
        _plot(evals, started, options.out / "perplexity.png")
        print(f"\nplot: {options.out / 'perplexity.png'}; coordinator journal: {cluster.checkpoint_dir / 'events.jsonl'}")
    (options.out / "summary.json").write_text(json.dumps({"status": status, "peers": peers}, indent=1))
    return 0
