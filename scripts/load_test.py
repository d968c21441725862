"""Load test: many concurrent real transport clients against one coordinator.

A real coordinator process (``asyncloco coordinator``, tiny model, int8 uploads) and ``--clients``
lightweight clients spread over ``--processes`` client processes, several hivemind P2P nodes per process.
Each client is a real libp2p peer speaking the coordinator's RPCs (``CoordinatorClient``): hello, then in a
loop lease → fetch θ at the lease's base version → "train" for a random 0..``--think`` seconds → submit a
random well-formed int8 pseudo-gradient. Nothing is trained; the coordinator does all its real work (DyLU,
decode, validation, Delayed Nesterov, write-ahead log + fsync before every answer).

Checked at the end (clients stopped after their current round, the coordinator stopped gracefully):
zero errors; every acknowledged update is in the coordinator's final state at the version it was
acknowledged with, exactly once, and the versions 1..V are exactly the acknowledged updates.
Reported: p50 / p99 of ack latency (submit call) and lease latency (assign call), fetch latency, updates/s.

Usage: ``python scripts/load_test.py --clients 32 --processes 4 --duration 90 [--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("load_test")


def write_config(workdir: Path, clients: int) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    raw["outer"]["buffer_size"] = clients
    raw["sim"]["workers"] = clients
    raw["schedule"]["grace_period"] = 0.0  # leases are answered at once: the latency measured is the coordinator's
    raw["runtime"].update(
        {
            "run_id": f"load-{uuid.uuid4().hex[:10]}",
            "eval_every": 10**6,
            "speed_report_period": 30.0,
            "lease_slack": 120.0,
        }
    )
    # the clients train nothing: no lease of theirs could be re-run, so verification (on by default) is off here; what
    # it costs the coordinator per submission (commitments, held updates, reveals, re-runs) is scripts/bench_coordinator.py's
    raw["runtime"]["verify"] = {**raw["runtime"].get("verify", {}), "enabled": False}
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------ clients


async def client_loop(index: int, p2p: Any, coordinator_id: str, namespace: str, stop_at: float, think: float, out: dict[str, Any]) -> None:
    from asyncloco.transport.codecs import encode
    from asyncloco.transport.rpc import CoordinatorClient

    rng = random.Random(index)
    generator = torch.Generator().manual_seed(index)
    try:
        probe = CoordinatorClient(p2p, coordinator_id, 1, namespace=namespace)
        hello = await probe.hello(name=f"load{index}", timeout=60.0)
        numel = int(hello.model_numel)
        codec = str(hello.codec)
        lr = float(json.loads(hello.config)["inner"]["lr"])
        client = CoordinatorClient(
            p2p, coordinator_id, numel, namespace=namespace, assign_timeout=120.0,
            download_codec=str(getattr(hello, "download_codec", "none") or "none"),
        )
        speed = 5000.0 * (1 + index % 4)
        out["ready_at"].append(time.time())
        while time.time() < stop_at:
            try:
                start = time.perf_counter()
                reply = await client.assign(speed, name=f"load{index}")
                out["lease_s"].append(time.perf_counter() - start)
                lease = reply.lease
                if lease is None:
                    out["no_lease"].append(str(reply.reason))
                    continue
                start = time.perf_counter()
                await client.get_model(lease.base_version)
                out["fetch_s"].append(time.perf_counter() - start)
                await asyncio.sleep(rng.uniform(0, think))  # "training"
                start = time.perf_counter()
                update = torch.randn(numel, generator=generator).mul_(0.05 * lr * lease.steps)
                encoded = await asyncio.to_thread(encode, codec, update)
                out["encode_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                ack = await client.submit(lease.lease_id, lease.base_version, encoded)
                out["ack_s"].append(time.perf_counter() - start)
                if ack.accepted:
                    out["acks"].append([lease.lease_id, int(ack.version), bool(ack.duplicate)])
                else:
                    out["refused"].append([lease.lease_id, str(ack.reason)])
            except Exception as error:  # counted: the load test requires zero
                out["errors"].append(f"client {index}: {error!r}")
                await asyncio.sleep(1.0)
    except Exception as error:  # hello failed
        out["errors"].append(f"client {index} (joining): {error!r}")
    finally:
        await p2p.shutdown()


async def client_process(first: int, count: int, maddr: str, coordinator_id: str, namespace: str, duration: float, think: float) -> dict[str, Any]:
    from hivemind.p2p import P2P

    out: dict[str, Any] = {k: [] for k in ("lease_s", "fetch_s", "encode_s", "ack_s", "acks", "refused", "no_lease", "errors", "ready_at")}
    nodes = []
    for _ in range(count):  # one p2pd each, started one after the other (a loaded machine starts them slowly)
        nodes.append(await P2P.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0))
    stop_at = time.time() + duration  # the load lasts `duration` from when this process's clients are up
    await asyncio.gather(*(client_loop(first + i, nodes[i], coordinator_id, namespace, stop_at, think, out) for i in range(count)))
    return out


# --------------------------------------------------------------------------------------------- main


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load")
    parser.add_argument("--think", type=float, default=2.0, help="max seconds a client 'trains' between fetch and submit")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "load-test")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="seconds of work: 2 clients in one process for 5 s (tests)")
    args = parser.parse_args(argv)
    if args.smoke and not args.worker:
        args.clients, args.processes, args.duration, args.think = 2, 1, 5.0, 0.2
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    if args.worker:
        first, count, maddr, coordinator_id, namespace, duration, out = args.worker
        result = asyncio.run(client_process(int(first), int(count), maddr, coordinator_id, namespace, float(duration), args.think))
        Path(out).write_text(json.dumps(result))
        return 0

    from asyncloco.coordinator.checkpoint import load_snapshot
    from asyncloco.local_cluster import LocalCluster

    if args.workdir.exists():
        shutil.rmtree(args.workdir)
    config = write_config(args.workdir, args.clients)
    per_process = [args.clients // args.processes + (1 if i < args.clients % args.processes else 0) for i in range(args.processes)]
    with LocalCluster(config, args.workdir / "cluster", threads=1) as cluster:
        maddr = cluster.start_coordinator()
        status = cluster.status()
        coordinator_id, namespace = status["peer_id"], status["run_id"]
        started = time.time()
        workers = []
        first = 0
        for i, count in enumerate(per_process):
            out = args.workdir / f"clients-{i}.json"
            command = [sys.executable, __file__, "--think", str(args.think), "--worker", str(first), str(count), maddr, coordinator_id, namespace, str(args.duration), str(out)]
            log = (args.workdir / f"clients-{i}.log").open("wb")
            workers.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), out, log))
            first += count
        for process, _, log in workers:
            process.wait(timeout=args.duration + 400)
            log.close()
        elapsed = time.time() - started
        merged: dict[str, list[Any]] = {k: [] for k in ("lease_s", "fetch_s", "encode_s", "ack_s", "acks", "refused", "no_lease", "errors", "ready_at")}
        for process, out, _ in workers:
            if process.returncode != 0 or not out.is_file():
                merged["errors"].append(f"client process exited with {process.returncode}; see {out.with_suffix('.log')}")
                continue
            for key, values in json.loads(out.read_text()).items():
                merged[key].extend(values)
        final_status = cluster.status()
        cluster.stop_coordinator(timeout=120.0)
        final = load_snapshot(cluster.checkpoint_dir)["coordinator"]

    applied = {k: int(v) for k, v in final["applied"].items()}
    version = int(final["version"])
    acked = {lease_id: v for lease_id, v, _ in merged["acks"]}
    problems = []
    if len(acked) != len(merged["acks"]):
        problems.append("a lease was acknowledged twice")
    wrong = [(lid, v, applied.get(lid)) for lid, v in acked.items() if applied.get(lid) != v]
    if wrong:
        problems.append(f"{len(wrong)} acknowledged updates missing or at another version: {wrong[:3]}")
    if sorted(applied.values()) != list(range(1, version + 1)):
        problems.append("versions 1..V are not each produced by exactly one update")
    if set(applied) != set(acked):
        problems.append(f"{len(set(applied) - set(acked))} applied updates were never acknowledged to a client")
    result = {
        "clients": args.clients,
        "processes": args.processes,
        "duration_s": round(elapsed, 1),
        "applied_updates": version,
        "acknowledged": len(merged["acks"]),
        "updates_per_s": round(version / args.duration, 2),
        "clients_ready_spread_s": round(max(merged["ready_at"]) - min(merged["ready_at"]), 1) if merged["ready_at"] else None,
        "encode_p50_s": percentile(merged["encode_s"], 0.5),
        "errors": len(merged["errors"]),
        "refused": len(merged["refused"]),
        "no_lease": len(merged["no_lease"]),
        "ack_p50_s": percentile(merged["ack_s"], 0.5),
        "ack_p99_s": percentile(merged["ack_s"], 0.99),
        "lease_p50_s": percentile(merged["lease_s"], 0.5),
        "lease_p99_s": percentile(merged["lease_s"], 0.99),
        "fetch_p50_s": percentile(merged["fetch_s"], 0.5),
        "fetch_p99_s": percentile(merged["fetch_s"], 0.99),
        "coordinator_active_leases_at_end": final_status.get("active_leases"),
        "problems": problems,
        "error_samples": merged["errors"][:5],
        "refused_samples": merged["refused"][:5],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if not problems and not merged["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
