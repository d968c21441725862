"""Coordinator egress per θ version: everyone from the coordinator (today) vs the swarm, in one run.

A coordinator process part (this process: one p2pd, the real ``CoordinatorService`` serving ``get_model``
beside a ``SwarmSeed`` of asyncloco/transport/swarm.py) and ``max(--clients)`` light download-only clients
spread over ``--processes`` client processes, one p2pd each (several per process, as scripts/load_test.py
does). Nothing is trained: a stand-in publishes one new θ version per round (θ + 0.001·N(0, 1), the size of
``--preset``), then

- **today**: the first N clients download it with ``CoordinatorClient.get_model`` (a full download each:
  a delta from an anchor costs the same bytes);
- **swarm**: the same N clients download it with ``SwarmDownloader`` (manifest from the seed, chunks from
  each other, the seed only for what no holder has), each serving what it holds.

The order of the two alternates per round. Reported per N: bytes out of the coordinator per version over
the encoding's size (``coordinator_egress_per_version_over_encoding``: framed bytes of every stream the
coordinator wrote, get_model or swarm), download seconds per client, and whether every client's θ is
bitwise equal to ``decode(encode(θ_v))``, what the coordinator would have sent (SHA-256 of the body and of
the decoded θ, compared with the coordinator's own).

Usage: ``python scripts/bench_swarm.py --clients 8,16,32 --json out.json`` (heavy: run it under
``flock /tmp/asyncloco-heavy.lock nice -n 5``).

``--wan home:home`` (root; asyncloco/wan/netns.py) puts the coordinator part in a network namespace behind a
``home`` access link (10 Mbit/s up, 50 down: ``tc tbf`` on its veth) and each client process behind its own
(its clients share it), so the coordinator's uplink is the narrow pipe the issue is about; loopback otherwise.

``--train`` replaces the stand-in with a real run: a coordinator daemon and the demo's three training peers
(``asyncloco peer join``, slowed ×1, ×1.5, ×4, with ``--swarm`` in the swarm design) as processes of
asyncloco/local_cluster.py, the demo config with the ``--preset`` model and ``--codec`` downloads; one cluster per
design. Each round waits for a new applied version, then the N clients download the newest θ (a full
``get_model`` today, ``SwarmDownloader.download(None)`` in the swarm); the coordinator's egress over the round
comes from its status document (``traffic.get_model`` + ``swarm.seed_bytes_sent``) and includes what the
training peers downloaded meanwhile. Clients that got the same version must hold the same θ (swarm bodies are
verified chunk by chunk against the signed manifest)::

    python scripts/bench_swarm.py --train --preset 20m --clients 8,16,32 --json out.json   # ~8 min here

``--train --wan home:home`` (root) runs the same with every process behind an emulated access link: the
coordinator daemon in a node with the first profile, each training peer and each client process in its own node
with the second, each listening on its node's address (the processes of asyncloco/local_cluster.py started with
``ip netns exec``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import signal
import statistics
import sys
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

logger = logging.getLogger("bench_swarm")
DOWNLOAD_TIMEOUT = 120.0  # seconds per client download: a stuck one is an error of the round, not a hung benchmark


def sha(data: Any) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def theta_sha(theta: torch.Tensor) -> str:
    return sha(theta.detach().contiguous().numpy().view("u1"))


# ------------------------------------------------------------------------------------------ clients


async def _client_main(first: int, count: int, maddrs: List[str], coordinator_id: str, namespace: str, numel: int, codec: str,
                       commands: Any, results: Any, host: str = "127.0.0.1") -> None:
    from hivemind.p2p import P2P

    from asyncloco.transport.codecs import EncodedTensor, decode
    from asyncloco.transport.rpc import CoordinatorClient
    from asyncloco.transport.swarm import BodyStore, ChunkServer, SwarmDownloader

    nodes: List[Any] = []
    clients: List[Tuple[CoordinatorClient, SwarmDownloader]] = []
    from asyncloco.transport.codecs import encode

    decode(encode(codec, torch.ones(8)), 8)  # import the codec's kernels now, not in the first timed download
    try:
        for _ in range(count):
            p2p = await P2P.create(initial_peers=maddrs, host_maddrs=[f"/ip4/{host}/tcp/0"], startup_timeout=120.0)
            nodes.append(p2p)
            store = BodyStore(numel, keep_versions=2)
            await ChunkServer(store).add_handlers(p2p, namespace)
            visible = [str(m) for m in await p2p.get_visible_maddrs()]
            clients.append((
                CoordinatorClient(p2p, coordinator_id, numel, namespace=namespace, download_codec=codec),
                SwarmDownloader(p2p, coordinator_id, store, namespace=namespace, maddrs=visible),
            ))
        results.put(("ready", first, count))

        async def one(index: int, mode: str, version: int) -> Dict[str, Any]:
            direct, swarm = clients[index - first]
            started = time.perf_counter()
            out: Dict[str, Any] = {"index": index, "mode": mode, "version": version}
            try:
                if mode == "today":
                    direct.held = direct.anchor = None  # a full download, as a peer without this version gets
                    got, theta = await asyncio.wait_for(direct.get_model(version), DOWNLOAD_TIMEOUT)
                    out["seconds"] = time.perf_counter() - started
                    out["body_sha"] = None
                else:
                    result = await asyncio.wait_for(swarm.download(version, codec), DOWNLOAD_TIMEOUT)
                    got = result.manifest.version
                    theta = await asyncio.to_thread(decode, EncodedTensor.from_bytes(codec, numel, result.body), numel)
                    out["seconds"] = time.perf_counter() - started  # both designs: until θ is decoded
                    out["body_sha"] = sha(result.body)
                    out.update(seed_chunks=result.chunks_from_seed, peer_chunks=result.chunks_from_peers,
                               rejected=sum(result.rejected.values()), skipped=len(result.skipped))
                out["theta_sha"] = await asyncio.to_thread(theta_sha, theta)
                out["got"] = got
                out["version_ok"] = version is None or got == version
            except Exception as error:  # counted: the benchmark requires zero
                out["error"] = repr(error)
            return out

        while True:
            command = await asyncio.to_thread(commands.get)
            if command[0] == "stop":
                break
            _, mode, version, active = command  # version None: the newest (--train: what a joining peer asks for)
            mine = [i for i in range(first, first + count) if i < active]
            for out in await asyncio.gather(*(one(i, mode, version) for i in mine)):
                results.put(("result", out))
            results.put(("round", first))
    finally:
        for p2p in nodes:
            await p2p.shutdown()


def client_process(first: int, count: int, maddrs: List[str], coordinator_id: str, namespace: str, numel: int, codec: str,
                   commands: Any, results: Any, node: Optional[Tuple[str, str]] = None) -> None:
    """``node``: (network namespace, address) of this process's emulated access link (--wan), else loopback."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    host = "127.0.0.1"
    if node is not None:
        from asyncloco.wan.netns import enter_namespace

        enter_namespace(node[0])  # before the p2pds start: they inherit it
        host = node[1]
    asyncio.run(_client_main(first, count, maddrs, coordinator_id, namespace, numel, codec, commands, results, host))


# -------------------------------------------------------------------------------------- coordinator


class StandInHandler:
    """The coordinator's ``get_model`` over the published versions (nothing else is used here)."""

    def __init__(self) -> None:
        self.thetas: Dict[int, torch.Tensor] = {}

    async def assign(self, request: Any, peer_id: str) -> Any:
        raise RuntimeError("download-only benchmark")

    async def get_model(self, version: Optional[int], peer_id: str) -> Tuple[int, torch.Tensor]:
        version = max(self.thetas) if version is None else version
        return version, self.thetas[version]

    async def submit(self, header: Any, pseudo_gradient: Any, peer_id: str, upload_seconds: float = 0.0) -> Any:
        raise RuntimeError("download-only benchmark")


def summary(values: List[float]) -> Dict[str, float]:
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p50": ordered[len(ordered) // 2], "max": ordered[-1]}


async def run(args: argparse.Namespace, wan: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``wan``: {"coordinator": (namespace, address), "clients": [(namespace, address) per client process], ...}: this
    process (the coordinator part) already runs in the coordinator's namespace (main())."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.p2p import P2P

    from asyncloco.models.presets import count_parameters, get_preset
    from asyncloco.transport.codecs import EncodedTensor, decode, encode, wire_bytes
    from asyncloco.transport.rpc import CoordinatorService
    from asyncloco.transport.swarm import BodyStore, SwarmSeed

    sizes = sorted({int(n) for n in str(args.clients).split(",")})
    numel = args.numel or count_parameters(get_preset(args.preset))
    codec, encoding = args.codec, wire_bytes(args.codec, numel)
    namespace = f"swarm-{uuid.uuid4().hex[:8]}"
    handler = StandInHandler()
    bodies: Dict[int, bytes] = {}

    async def body_for(version: Optional[int], wanted: str) -> Tuple[int, Any]:
        version = max(bodies) if version is None else version
        return version, bodies[version]

    host = wan["coordinator"][1] if wan else "127.0.0.1"
    p2p = await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/0"], startup_timeout=120.0)
    service = CoordinatorService(handler, numel, model_codecs=(codec,))
    seed = SwarmSeed(BodyStore(numel, keep_versions=2), namespace, Ed25519PrivateKey.generate(), body_for, chunk_bytes=args.chunk_bytes)
    await service.add_p2p_handlers(p2p, namespace=namespace)
    await seed.add_handlers(p2p, namespace)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    context = mp.get_context("spawn")
    results: Any = context.Queue()
    total = max(sizes)
    per = -(-total // args.processes)
    procs, queues = [], []
    for index, first in enumerate(range(0, total, per)):
        commands: Any = context.Queue()
        node = wan["clients"][index] if wan else None
        proc = context.Process(target=client_process, args=(first, min(per, total - first), maddrs, p2p.peer_id.to_base58(),
                                                              namespace, numel, codec, commands, results, node), daemon=True)
        proc.start()
        procs.append(proc)
        queues.append(commands)
    rows: List[Dict[str, Any]] = []
    errors: List[str] = []
    started = time.monotonic()
    try:
        ready = 0
        while ready < len(procs):
            message = await asyncio.to_thread(results.get, True, 600)
            ready += message[0] == "ready"
        logger.info("%d clients up in %.0f s", total, time.monotonic() - started)
        generator = torch.Generator().manual_seed(0)
        theta = torch.randn(numel, generator=generator) * 0.02
        version = 0
        for n in sizes:
            per_mode: Dict[str, Dict[str, Any]] = {m: {"egress": [], "seconds": [], "equal": 0, "downloads": 0, "seed_chunks": 0,
                                                       "peer_chunks": 0, "rejected": 0} for m in ("today", "swarm")}
            for round_index in range(args.versions):
                version += 1
                theta = theta + 0.001 * torch.randn(numel, generator=generator)
                handler.thetas = {version: theta}
                bodies.clear()
                bodies[version] = encode(codec, theta).to_bytes()  # what get_model sends on a full download
                want_body, want_theta = sha(bodies[version]), theta_sha(decode(EncodedTensor.from_bytes(codec, numel, bodies[version]), numel))
                # both designs encode (and the seed hashes) each version once before the clients ask: not timed
                if codec == "none":
                    await service._encoded_model(version, codec, theta)
                else:
                    await asyncio.to_thread(service.downloads.serve, version, codec, theta, None)
                await seed.publish(version, codec)
                for mode in (("today", "swarm") if round_index % 2 == 0 else ("swarm", "today")):
                    before = service.counters.get_model.bytes_sent + seed.counters.stream_bytes_sent
                    for commands in queues:
                        commands.put(("download", mode, version, n))
                    done = 0
                    while done < len(queues):
                        message = await asyncio.to_thread(results.get, True, 600)
                        if message[0] == "round":
                            done += 1
                            continue
                        out = message[1]
                        if "error" in out:
                            errors.append(f"N={n} v{version} {mode} client {out['index']}: {out['error']}")
                            continue
                        stats = per_mode[mode]
                        stats["downloads"] += 1
                        stats["seconds"].append(out["seconds"])
                        stats["equal"] += bool(out["version_ok"] and out["theta_sha"] == want_theta
                                               and out["body_sha"] in (None, want_body))
                        for key in ("seed_chunks", "peer_chunks", "rejected"):
                            stats[key] += out.get(key, 0)
                    egress = service.counters.get_model.bytes_sent + seed.counters.stream_bytes_sent - before
                    per_mode[mode]["egress"].append(egress / encoding)
                    logger.info("N=%d v%d %s: coordinator egress %.2f encodings", n, version, mode, egress / encoding)
            row: Dict[str, Any] = {"clients": n}
            for mode, stats in per_mode.items():
                row[mode] = {
                    "coordinator_egress_per_version_over_encoding": statistics.fmean(stats["egress"]),
                    "egress_per_round": stats["egress"],
                    "download_s": summary(stats["seconds"]) if stats["seconds"] else None,
                    "downloads": stats["downloads"],
                    "bitwise_equal": stats["equal"],
                    "all_bitwise_equal": stats["equal"] == n * args.versions,
                }
                if mode == "swarm":
                    row[mode].update(chunks_from_seed=stats["seed_chunks"], chunks_from_peers=stats["peer_chunks"],
                                     chunks_rejected=stats["rejected"])
            rows.append(row)
    finally:
        for commands in queues:
            commands.put(("stop",))
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        await seed.remove_handlers(p2p, namespace)
        await service.remove_p2p_handlers(p2p, namespace=namespace)
        await p2p.shutdown()
    return {
        "preset": None if args.numel else args.preset,
        "numel": numel,
        "codec": codec,
        "encoding_bytes": encoding,
        "chunk_bytes": args.chunk_bytes,
        "versions_per_size": args.versions,
        "processes": args.processes,
        "training": "stand-in: one new θ version per round (no training peers)",
        "wan": None if not wan else {"coordinator": wan["coordinator_profile"], "client_processes": wan["client_profile"],
                                     "note": "tc tbf bandwidth per access link (no latency: no netem); the clients of one "
                                             "process share its link"},
        "coordinator_egress_per_version_over_encoding": {
            mode: {str(r["clients"]): r[mode]["coordinator_egress_per_version_over_encoding"] for r in rows} for mode in ("today", "swarm")
        },
        "rows": rows,
        "errors": errors,
        "wall_s": time.monotonic() - started,
    }


TRAIN_SLOWDOWNS = (1.0, 1.5, 4.0)  # the demo's three peers


def _train_config(args: argparse.Namespace, workdir: Any, swarm: bool) -> Any:
    """The demo config with the ``--preset`` model, the ``--codec`` downloads and the swarm on or off."""
    from pathlib import Path

    import yaml

    from asyncloco.shipped import resolve_config

    cfg = yaml.safe_load(Path(resolve_config("demo")).read_text())
    cfg["task"]["model"] = args.preset
    cfg["runtime"].update(run_id=f"bench-swarm-{uuid.uuid4().hex[:6]}", download_codec=args.codec, swarm=swarm)
    path = Path(workdir) / f"config-{'swarm' if swarm else 'today'}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _netns_cluster(config: Any, workdir: Any, net: Any, nodes: Dict[str, Any]) -> Any:
    """A :class:`~asyncloco.local_cluster.LocalCluster` whose coordinator and peers run in network-namespace nodes
    of ``net`` (``nodes``: process name → node; asyncloco/wan/netns.py), each listening on its node's address."""
    from asyncloco.local_cluster import LocalCluster

    class NetnsCluster(LocalCluster):
        def command(self, name: str, args: Any) -> List[str]:
            node = nodes[name]
            return ["ip", "netns", "exec", node.namespace, *super().command(name, args), "--host", node.address]

    return NetnsCluster(config, workdir)


def run_with_training(args: argparse.Namespace, wan: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``--train``: the same comparison with the versions made by a real run — a coordinator daemon and the demo's
    three training peers (``asyncloco peer join``, slowed ×1, ×1.5, ×4; ``--swarm`` in the swarm design) as real
    processes (asyncloco/local_cluster.py) — and N light clients that download the newest θ each round, as a
    peer joining then would. One cluster per design (today: the run's swarm off, everyone on ``get_model``;
    swarm: ``runtime.swarm: true``, the peers and clients on the swarm). A round starts when the coordinator's
    version has moved past the last round's; the coordinator's egress (its status: ``traffic.get_model`` plus
    ``swarm.seed_bytes_sent``) over the round, training peers' downloads included, is divided by the encoding."""
    import tempfile
    from pathlib import Path

    from asyncloco.local_cluster import LocalCluster
    from asyncloco.transport.codecs import wire_bytes

    sizes = sorted({int(n) for n in str(args.clients).split(",")})
    codec = args.codec
    numel = encoding = 0  # the run's, from the coordinator's status (the model's size depends on its tokenizer)
    total = max(sizes)
    per = -(-total // args.processes)
    started = time.monotonic()
    rows: Dict[int, Dict[str, Any]] = {n: {"clients": n} for n in sizes}
    errors: List[str] = []
    designs: Dict[str, Dict[str, Any]] = {}
    workroot = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-swarm-train-"))
    for mode in args.designs.split(","):
        workdir = workroot / mode
        workdir.mkdir(parents=True, exist_ok=True)
        config = _train_config(args, workdir, swarm=mode == "swarm")
        cluster_of = LocalCluster(config, workdir) if wan is None else _netns_cluster(config, workdir, wan["net"], wan["nodes"])
        with cluster_of as cluster:
            cluster.start_coordinator(timeout=180.0)
            for index, slowdown in enumerate(TRAIN_SLOWDOWNS):
                cluster.start_peer(f"peer{index}", slowdown, extra=("--swarm",) if mode == "swarm" else ())
            status = cluster.status()
            coordinator_id, namespace = status["peer_id"], status["run_id"]
            numel = int(status["parameters"])
            encoding = wire_bytes(codec, numel)
            context = mp.get_context("spawn")
            results: Any = context.Queue()
            procs: list[Any] = []
            queues: list[Any] = []
            for first in range(0, total, per):
                commands: Any = context.Queue()
                node = wan["clients"][len(procs)] if wan is not None else None
                proc = context.Process(target=client_process, args=(first, min(per, total - first), [cluster.multiaddr],
                                                                      coordinator_id, namespace, numel, codec, commands, results,
                                                                      node),
                                       daemon=True)
                proc.start()
                procs.append(proc)
                queues.append(commands)

            def egress() -> Tuple[int, int]:
                """Bytes the coordinator has sent θ with (get_model + the swarm seed) and its version, from the first
                status document written after this call (the daemon rewrites it every 2 s)."""
                asked = time.time()
                now = cluster.wait_for(lambda: (lambda st: st if st.get("updated", 0) >= asked else None)(cluster.status()),
                                       60.0, "a fresh status document")
                return (int(now["traffic"]["get_model"]["bytes_sent"]) + int((now.get("swarm") or {}).get("seed_bytes_sent", 0)),
                        int(now["version"]))

            try:
                ready = 0
                while ready < len(procs):
                    message = results.get(True, 600)
                    ready += message[0] == "ready"
                cluster.wait_for(lambda: cluster.status().get("version", 0) >= 1, 300.0, "the first applied update")
                for n in sizes:
                    stats: Dict[str, Any] = {"egress": [], "seconds": [], "downloads": 0, "agree": 0, "versions": [],
                                             "applied": [], "seed_chunks": 0, "peer_chunks": 0, "rejected": 0}
                    for _ in range(args.versions):
                        last = cluster.status().get("version", 0)
                        cluster.wait_for(lambda: cluster.status().get("version", 0) > last, 300.0, "a new version")
                        sent0, version0 = egress()
                        for commands in queues:
                            commands.put(("download", "today" if mode == "today" else "swarm", None, n))
                        done, outs = 0, []
                        while done < len(queues):
                            message = results.get(True, 600)
                            if message[0] == "round":
                                done += 1
                            elif "error" in message[1]:
                                errors.append(f"{mode} N={n} client {message[1]['index']}: {message[1]['error']}")
                                logger.warning("%s", errors[-1])
                            else:
                                outs.append(message[1])
                        sent1, version1 = egress()
                        stats["egress"].append((sent1 - sent0) / encoding)
                        stats["applied"].append(version1 - version0)
                        stats["seconds"].extend(o["seconds"] for o in outs)
                        stats["downloads"] += len(outs)
                        by_version: Dict[int, set] = {}
                        for o in outs:
                            by_version.setdefault(o["got"], set()).add(o["theta_sha"])
                            for key in ("seed_chunks", "peer_chunks", "rejected"):
                                stats[key] += o.get(key, 0)
                        stats["agree"] += sum(1 for o in outs if len(by_version[o["got"]]) == 1)
                        stats["versions"].append(sorted(by_version))
                        logger.info("%s N=%d: coordinator egress %.2f encodings (versions %s, %d applied meanwhile)",
                                    mode, n, stats["egress"][-1], sorted(by_version), version1 - version0)
                    rows[n][mode] = {
                        "coordinator_egress_per_version_over_encoding": statistics.fmean(stats["egress"]),
                        "egress_per_round": stats["egress"],
                        "applied_during_round": stats["applied"],
                        "versions_downloaded": stats["versions"],
                        "download_s": summary(stats["seconds"]) if stats["seconds"] else None,
                        "downloads": stats["downloads"],
                        "bitwise_equal": stats["agree"],
                        "all_bitwise_equal": stats["agree"] == n * args.versions,
                    }
                    if mode == "swarm":
                        rows[n][mode].update(chunks_from_seed=stats["seed_chunks"], chunks_from_peers=stats["peer_chunks"],
                                             chunks_rejected=stats["rejected"])
                designs[mode] = {"final_version": cluster.status().get("version"),
                                 "peers_alive": sum(p.poll() is None for p in cluster.peers.values())}
            finally:
                for commands in queues:
                    commands.put(("stop",))
                for proc in procs:
                    proc.join(timeout=60)
                    if proc.is_alive():
                        proc.kill()
    out_rows = [rows[n] for n in sizes]
    return {
        "preset": args.preset,
        "numel": numel,
        "codec": codec,
        "encoding_bytes": encoding,
        "chunk_bytes": None,
        "versions_per_size": args.versions,
        "processes": args.processes,
        "training": f"real: a coordinator daemon and {len(TRAIN_SLOWDOWNS)} training peers (slowed {list(TRAIN_SLOWDOWNS)}), "
                    "the demo config with this preset; egress per round includes the training peers' downloads",
        "bitwise": "clients that downloaded the same version hold the same θ (SHA-256); swarm bodies are checked "
                   "against the coordinator's signed manifest chunk by chunk",
        "designs": designs,
        "wan": None if wan is None else {"coordinator": wan["coordinator_profile"], "peers": wan["peer_profile"],
                                         "client_processes": wan["client_profile"],
                                         "note": "tc tbf bandwidth per access link (no latency: no netem); the clients of "
                                                 "one process share its link; every node reaches every other through a bridge"},
        "coordinator_egress_per_version_over_encoding": {
            mode: {str(r["clients"]): r[mode]["coordinator_egress_per_version_over_encoding"] for r in out_rows}
            for mode in args.designs.split(",")
        },
        "rows": out_rows,
        "errors": errors,
        "wall_s": time.monotonic() - started,
    }


def _wan_plan(args: argparse.Namespace) -> Tuple[Any, Any, int]:
    """``--wan COORD[:OTHERS]``: the two access-link profiles, and how many client processes need a node."""
    from asyncloco.wan.netns import PROFILES

    names = args.wan.split(":")
    for name in (names[0], names[-1]):
        if name not in PROFILES:
            raise SystemExit(f"--wan {args.wan}: unknown profile {name!r}; choose from {sorted(PROFILES)}")
    total = max(int(n) for n in str(args.clients).split(","))
    return PROFILES[names[0]], PROFILES[names[-1]], len(range(0, total, -(-total // args.processes)))


def run_with_training_on_wan(args: argparse.Namespace) -> Dict[str, Any]:
    """:func:`run_with_training` with every process behind an emulated access link: the coordinator daemon in a
    node with the first ``--wan`` profile, each training peer and each client process in its own node with the
    second (asyncloco/wan/netns.py; root)."""
    from asyncloco.wan.netns import WanNetwork

    coordinator_profile, other_profile, processes = _wan_plan(args)
    with WanNetwork() as net:
        nodes = {"coordinator": net.add_node("coord", coordinator_profile)}
        for index in range(len(TRAIN_SLOWDOWNS)):
            nodes[f"peer{index}"] = net.add_node(f"p{index}", other_profile)
        clients = [net.add_node(f"c{i}", other_profile) for i in range(processes)]
        wan = {"net": net, "nodes": nodes, "clients": [(node.namespace, node.address) for node in clients],
               "coordinator_profile": coordinator_profile.describe(),
               "peer_profile": other_profile.describe(), "client_profile": other_profile.describe()}
        return run_with_training(args, wan)


def run_on_wan(args: argparse.Namespace) -> Dict[str, Any]:
    """:func:`run` with every access link shaped by ``tc tbf`` in its own network namespace (asyncloco/wan/netns.py):
    the coordinator part in this process, moved into its node's namespace, the client processes in theirs."""
    from asyncloco.wan.netns import WanNetwork, inside_namespace

    coordinator_profile, client_profile, processes = _wan_plan(args)
    with WanNetwork() as net:
        coordinator = net.add_node("coord", coordinator_profile)
        clients = [net.add_node(f"c{i}", client_profile) for i in range(processes)]
        wan = {"coordinator": (coordinator.namespace, coordinator.address),
               "clients": [(node.namespace, node.address) for node in clients],
               "coordinator_profile": coordinator_profile.describe(),
               "client_profile": client_profile.describe()}
        with inside_namespace(coordinator.namespace):
            return asyncio.run(run(args, wan))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="8,16,32", help="comma-separated numbers of download-only clients (default 8,16,32)")
    parser.add_argument("--processes", type=int, default=4, help="client processes (clients are spread over them)")
    parser.add_argument("--versions", type=int, default=2, help="versions downloaded per N and design")
    parser.add_argument("--preset", default="20m", help="θ of this preset's size (default 20m: 21.2M values)")
    parser.add_argument("--numel", type=int, default=0, help="θ size instead of --preset")
    parser.add_argument("--codec", default="int8", choices=("none", "bf16", "int8"), help="download codec")
    parser.add_argument("--chunk-bytes", type=int, default=256 << 10, help="swarm chunk size")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--train", action="store_true",
                        help="versions from a real run (coordinator daemon + the demo's 3 training peers with the "
                        "--preset model) instead of the stand-in; one cluster per design")
    parser.add_argument("--workdir", help="--train: where the clusters' logs go (default: a temporary directory)")
    parser.add_argument("--designs", default="today,swarm", help="--train: which designs to run (default today,swarm)")
    parser.add_argument("--wan", metavar="COORD[:CLIENTS]",
                        help="emulated access links (asyncloco/wan/netns.py profiles, e.g. home:home): the coordinator "
                        "in a network namespace behind the first, each client process behind the second (root)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: the stand-in, 2 clients in one process, "
                        "one version of 200k values (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.clients, args.processes, args.versions, args.numel, args.chunk_bytes = "2", 1, 1, 200_000, 64 << 10
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    if args.train:
        if not set(args.designs.split(",")) <= {"today", "swarm"}:
            parser.error(f"--designs {args.designs!r}: choose from today, swarm")
        # SIGTERM (a timeout, Ctrl+C from a wrapper) unwinds like Ctrl+C: the clusters' processes are stopped
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        result = run_with_training_on_wan(args) if args.wan else run_with_training(args)
    elif args.wan:
        result = run_on_wan(args)
    else:
        result = asyncio.run(run(args))
    print(f"θ: {result['numel']:,} values, {result['codec']} encoding {result['encoding_bytes']:,} B; "
          f"{result['versions_per_size']} versions per N; chunks {result['chunk_bytes'] or 'the run default'} B; {result['training']}")
    print(f"{'N':>4} | {'today egress':>12} {'swarm egress':>12} {'ratio':>7} | {'today s p50/max':>15} {'swarm s p50/max':>15} | bitwise today/swarm")
    for row in result["rows"]:
        if "today" not in row or "swarm" not in row:
            print(f"{row['clients']:>4} | " + "; ".join(f"{m}: egress {row[m]['coordinator_egress_per_version_over_encoding']:.2f}, "
                                                     f"bitwise {row[m]['bitwise_equal']}/{row[m]['downloads']}"
                                                     for m in ("today", "swarm") if m in row))
            continue
        today, swarm = row["today"], row["swarm"]
        t, s = today["coordinator_egress_per_version_over_encoding"], swarm["coordinator_egress_per_version_over_encoding"]
        td, sd = today["download_s"] or {"p50": 0, "max": 0}, swarm["download_s"] or {"p50": 0, "max": 0}
        print(f"{row['clients']:>4} | {t:>12.2f} {s:>12.2f} {s / t:>7.3f} | {td['p50']:>7.2f}/{td['max']:<7.2f} {sd['p50']:>7.2f}/{sd['max']:<7.2f} | "
              f"{today['bitwise_equal']}/{today['downloads']} {swarm['bitwise_equal']}/{swarm['downloads']}")
    print(f"errors: {len(result['errors'])}; wall {result['wall_s']:.0f} s")
    for line in result["errors"][:10]:
        print("  ", line)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    ok = not result["errors"] and all(r[m]["all_bitwise_equal"] for r in result["rows"] for m in ("today", "swarm") if m in r)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
