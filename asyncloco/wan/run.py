"""A coordinator and peers over emulated wide-area links (network namespaces; root required).

Topology (:class:`~asyncloco.wan.netns.WanNetwork`): the coordinator in namespace ``coord`` (unshaped,
listening on its namespace's 127.0.0.1 — unreachable from any peer except through a proxy), and for each
peer ``i``:

* namespace ``peer<i>`` with its access link's upload/download caps (``tc tbf``, both veth ends);
* a :mod:`asyncloco.wan.proxy` process in ``coord``'s namespace on ``<coord address>:<7100 + i>`` adding the
  profile's one-way latency each way and its loss (as stalls), forwarding to the coordinator;
* the peer process, told ``/ip4/<coord address>/tcp/<7100 + i>/p2p/<coordinator id>`` — its only way in.

:func:`run_wan` runs this for a wall-time budget counted from the first lease the coordinator issues and
returns the journal's evaluations (time since that first lease, perplexity) and per-peer summaries.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncloco.wan.netns import PROFILES, NetnsError, Profile, WanNetwork, wait_for_port_file

__all__ = ["PeerSpec", "parse_peers", "run_wan", "read_journal", "COORDINATOR_PORT"]

logger = logging.getLogger(__name__)

COORDINATOR_PORT = 4100
PROXY_BASE_PORT = 7100


@dataclass(frozen=True)
class PeerSpec:
    profile: Profile
    slowdown: float = 1.0


def parse_peers(text: str) -> list[PeerSpec]:
    """``"home:1,far:4,campus:1.5"`` → one peer per item: a profile name and its compute slowdown."""
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, slowdown = item.partition(":")
        if name not in PROFILES:
            raise ValueError(f"unknown link profile {name!r} in {text!r}; choose from {sorted(PROFILES)}")
        try:
            factor = float(slowdown) if slowdown else 1.0
        except ValueError:
            raise ValueError(f"slowdown {slowdown!r} of {name!r} is not a number (write e.g. home:1.5)") from None
        if factor < 1:
            raise ValueError(f"slowdown must be >= 1, got {factor} for {name!r}")
        specs.append(PeerSpec(PROFILES[name], factor))
    if not specs:
        raise ValueError(f"no peers in {text!r}; write e.g. home:1,far:4")
    return specs


def _rate_args(profile: Profile) -> list[str]:
    """The proxy paces at the link's rates too, so that loss stalls add to the transmission time instead of
    hiding in the gaps of a tbf-paced stream (tbf still shapes the kernel's traffic)."""
    args = []
    if profile.up_mbit:
        args += ["--up-mbit", str(profile.up_mbit)]
    if profile.down_mbit:
        args += ["--down-mbit", str(profile.down_mbit)]
    return args


def read_journal(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _perplexity(event: dict[str, Any]) -> Optional[float]:
    for key in ("perplexity", "val_perplexity", "ppl"):
        if key in event:
            return float(event[key])
    for key in ("loss", "val_loss"):
        if key in event:
            return float(math.exp(min(float(event[key]), 50.0)))
    return None


def _wait(condition: Any, timeout: float, what: str, processes: Sequence[Any] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        for process in processes:
            if process.poll() is not None:
                raise NetnsError(f"a process exited ({process.args[-8:]} → {process.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise NetnsError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def run_wan(
    config: Path,
    peers: Sequence[PeerSpec],
    budget_s: float,
    out: Path,
    *,
    threads: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``config`` over the links of ``peers`` for ``budget_s`` seconds of training; results in ``out``.

    The steps: the coordinator started in its namespace (:func:`_start_coordinator`), each peer behind its proxy
    (:func:`_start_peer`), training for the budget counted from the first lease (:func:`_train_for`), everything
    stopped (:func:`_stop_all`), the results read from the journal and the peers' summaries (:func:`_results`)."""
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = out / "coordinator"
    logs: list[Any] = []
    peer_processes: list[Any] = []
    parameters: Optional[int] = None
    with tempfile.TemporaryDirectory(prefix="asyncloco-wan-") as scratch, WanNetwork() as net:
        try:
            coord = net.add_node("coord")
            nodes = [net.add_node(f"peer{i}", spec.profile) for i, spec in enumerate(peers)]
            log = (out / "coordinator.log").open("ab")
            logs.append(log)
            coordinator = _start_coordinator(net, coord, config, checkpoint_dir, threads, log)
            status_path = checkpoint_dir / "status.json"
            peer_id = _wait(lambda: _coordinator_id(status_path), 300, "the coordinator to start", [coordinator])
            started_status = json.loads(status_path.read_text())
            run_id = started_status.get("run_id")
            parameters = started_status.get("parameters")
            for i, (spec, node) in enumerate(zip(peers, nodes)):
                peer = _start_peer(net, coord, node, i, spec, peer_id, run_id, Path(scratch), out,
                                   seed=seed, threads=threads, log=log, logs=logs)
                peer_processes.append(peer)
            t0 = _train_for(coordinator, checkpoint_dir / "events.jsonl", budget_s, out)
            _stop_all(net, coordinator, peer_processes)
        finally:
            for handle in logs:
                handle.close()
    return _results(out, checkpoint_dir, peers, budget_s, parameters, t0)


def _start_coordinator(net: WanNetwork, coord: Any, config: Path, checkpoint_dir: Path, threads: int, log: Any) -> Any:
    """The coordinator process in namespace ``coord``, on :data:`COORDINATOR_PORT`, logging to ``log``."""
    return net.spawn(
        coord,
        [sys.executable, "-m", "asyncloco.cli", "coordinator", "--config", str(config), "--checkpoint-dir",
         str(checkpoint_dir), "--port", str(COORDINATOR_PORT), "--threads", str(threads)],
        log=log,
    )  # fmt: skip


def _coordinator_id(status_path: Path) -> Optional[str]:
    """The coordinator's peer id from its ``status.json`` once it lists an address, else None."""
    try:
        status = json.loads(status_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    addresses = status.get("multiaddrs") or []
    return str(addresses[0]).rsplit("/p2p/", 1)[1] if addresses else None


def _start_peer(
    net: WanNetwork, coord: Any, node: Any, i: int, spec: PeerSpec, peer_id: str, run_id: Any, scratch: Path, out: Path,
    *, seed: int, threads: int, log: Any, logs: list[Any],
) -> Any:
    """Peer ``i``: its proxy in ``coord``'s namespace (the profile's latency, loss and rates; logging to the
    coordinator's ``log``), waited for until it listens, then the peer process in ``node`` dialling the coordinator
    through it. The peer's log file is added to ``logs`` (closed by the caller). Returns the peer process."""
    python = sys.executable
    port_file = str(scratch / f"proxy{i}.port")
    profile = spec.profile
    net.spawn(
        coord,
        [python, "-m", "asyncloco.wan.proxy", "--listen", f"{coord.address}:{PROXY_BASE_PORT + i}",
         "--target", f"127.0.0.1:{COORDINATOR_PORT}", "--latency-ms", str(profile.latency_ms),
         "--loss", str(profile.loss * 100), "--seed", str(seed * 1000 + i), "--port-file", port_file,
         *_rate_args(profile)],
        log=log,
    )  # fmt: skip
    wait_for_port_file(port_file)
    peer_log = (out / f"peer{i}.log").open("ab")
    logs.append(peer_log)
    return net.spawn(
        node,
        [python, "-m", "asyncloco.cli", "peer", "join", "--initial-peers",
         f"/ip4/{coord.address}/tcp/{PROXY_BASE_PORT + i}/p2p/{peer_id}", "--run-id", str(run_id),
         "--slowdown", str(spec.slowdown), "--threads", str(threads), "--no-progress",
         "--summary", str(out / f"peer{i}.json")],
        log=peer_log,
    )  # fmt: skip


def _train_for(coordinator: Any, journal: Path, budget_s: float, out: Path) -> float:
    """Wait for the first lease in the coordinator's ``journal``, then for ``budget_s`` seconds from it (failing
    if the coordinator exits). Returns the first lease's time."""
    first = _wait(
        lambda: next((e for e in read_journal(journal) if e["type"] == "assign"), None),
        600, "the first lease", [coordinator],
    )  # fmt: skip
    t0 = float(first["time"])
    logger.info("training started; running for %.0f s", budget_s)
    while time.time() < t0 + budget_s:
        if coordinator.poll() is not None:
            raise NetnsError(f"the coordinator exited with {coordinator.returncode}; see {out / 'coordinator.log'}")
        time.sleep(1.0)
    return t0


def _stop_all(net: WanNetwork, coordinator: Any, peer_processes: list[Any]) -> None:
    """The budget is spent: stop every peer at once (a peer finishes its lease on the first signal; the
    measurement is over, so the stragglers are killed after a short grace), then the coordinator."""
    for process in peer_processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    grace = time.monotonic() + 15.0
    while any(p.poll() is None for p in peer_processes) and time.monotonic() < grace:
        time.sleep(0.2)
    for process in peer_processes:
        net.stop(process, timeout=1)
    net.stop(coordinator, timeout=60)


def utilisation(summary: dict[str, Any]) -> dict[str, Optional[float]]:
    """A peer's share of its wall time spent training: over its whole run (from its first lease request to its exit)
    and up to the stop that ended the measured budget (its last lease's upload and the exit are not rounds of the
    run; None without a stop or a summary)."""
    train, wall = summary.get("timing", {}).get("train"), summary.get("wall_seconds")
    stop_train, stop_wall = summary.get("stop_train_s"), summary.get("stop_wall_s")
    return {
        "computing": round(train / wall, 4) if train is not None and wall else None,
        "computing_to_stop": round(stop_train / stop_wall, 4) if stop_train is not None and stop_wall else None,
    }


def _results(
    out: Path, checkpoint_dir: Path, peers: Sequence[PeerSpec], budget_s: float, parameters: Optional[int], t0: float
) -> dict[str, Any]:
    """The run's result, also written to ``out/result.json``: the evaluations (seconds since the first lease,
    perplexity), the applied and expired counts from the journal, and each peer's summary ({} when unreadable)."""
    events = read_journal(checkpoint_dir / "events.jsonl")
    evals = [
        {"t": float(e["time"]) - t0, "version": e.get("version"), "perplexity": _perplexity(e)}
        for e in events
        if e["type"] == "eval"
    ]
    summaries = []
    for i in range(len(peers)):
        try:
            summaries.append(json.loads((out / f"peer{i}.json").read_text()))
        except (OSError, json.JSONDecodeError):
            summaries.append({})
    result = {
        "budget_s": budget_s,
        "parameters": parameters,  # θ's size, from the coordinator's status.json
        "peers": [{"profile": s.profile.describe(), "slowdown": s.slowdown} for s in peers],
        "evals": evals,
        "applied": sum(1 for e in events if e["type"] == "applied"),
        "expired": sum(1 for e in events if e["type"] == "expired"),
        "peer_summaries": summaries,
        "utilisation": [utilisation(s) for s in summaries],
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result
