"""Does serving slow a peer's own training? One training peer, alone vs serving N downloaders, in one run.

This process is the training peer as asyncloco/peer/runner.py runs it: the asyncio loop (its ``hivemind.P2P``
and a :class:`~asyncloco.transport.swarm.ChunkServer` holding one version's int8 body of the model's θ) on the
main thread, the inner steps in a worker thread (``asyncio.to_thread``, as the runner trains). A second
process runs ``--downloaders`` light download-only clients (one p2pd), each fetching the whole body from this
peer in chunks with the real :class:`~asyncloco.transport.swarm.SwarmDownloader` (every chunk checked against
the manifest), one version after another, as long as a phase lasts.

Phases, ``--repeats`` times, the order alternating: **alone** (downloaders paused) and **serving** for each
``--serve-bandwidth`` value (Mbit/s; ``none`` = no cap). Each phase times ``--steps`` AdamW steps of the
``--model`` preset on random tokens. Reported: median steps/s per phase, the ratio serving / alone, the
MB/s this peer served during the phase, and this process's CPU seconds per step.

``--pin`` puts the training peer (and its p2pd) on the first ``--peer-cores`` cores (default 1) and the
downloaders on the others, so a phase measures what serving costs the peer and not the downloaders' own load on
shared cores (a real peer's downloaders are other machines). ``--device cuda --precision bf16`` trains on the GPU
as a GPU peer does (serving then competes only for the peer's CPU: the event loop, chunk copies, p2pd).

Every download of a version is a fresh one (a new version number sharing the same body bytes), so the server's
"already sent to this caller" memory never turns a request away.

    flock /tmp/asyncloco-heavy.lock nice -n 5 python scripts/bench_swarm_serving.py --model tiny --downloaders 8 \\
        --serve-bandwidth none,50 --json runs/bench/swarm-serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

logger = logging.getLogger("bench_swarm_serving")
VERSIONS = 4096  # version numbers sharing one body (a downloader cycles through them)


# ------------------------------------------------------------------------------------------ downloaders


async def _downloaders_main(count: int, maddrs: List[str], server_id: str, namespace: str, manifest_bytes: bytes,
                            commands: Any, results: Any) -> None:
    from hivemind.p2p import P2P

    from asyncloco.transport.swarm import BodyStore, Manifest, SwarmDownloader

    base = Manifest.from_bytes(manifest_bytes)
    nodes: List[Any] = []
    active = asyncio.Event()
    stopping = False
    downloaded = [0]
    errors: List[str] = []
    try:
        for _ in range(count):
            nodes.append(await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0))

        async def loop(index: int, p2p: Any) -> None:
            version = index  # spread over the version numbers
            while not stopping:
                await active.wait()
                if stopping:
                    return
                version = (version + 1) % VERSIONS
                manifest = dataclasses.replace(base, version=version)
                store = BodyStore(manifest.numel, keep_versions=1)  # a fresh holder each time: everything comes from the peer
                downloader = SwarmDownloader(p2p, server_id, store, namespace=namespace, serve=False, timeout=300.0)
                entry = store.open(manifest)
                try:
                    result = await downloader._fetch(manifest, entry, [], time.monotonic())
                    downloaded[0] += len(result.body)
                except Exception as error:  # counted; the benchmark reports them
                    errors.append(repr(error))

        tasks = [asyncio.ensure_future(loop(i, p2p)) for i, p2p in enumerate(nodes)]
        results.put(("ready", 0))
        while True:
            command = await asyncio.to_thread(commands.get)
            if command == "go":
                active.set()
            elif command == "pause":
                active.clear()
                results.put(("paused", downloaded[0], list(errors)))
            else:
                stopping = True
                active.set()
                await asyncio.wait(tasks, timeout=60.0)
                break
    finally:
        for p2p in nodes:
            await p2p.shutdown()


def downloaders_process(count: int, maddrs: List[str], server_id: str, namespace: str, manifest_bytes: bytes,
                        commands: Any, results: Any, cpus: Optional[List[int]] = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    if cpus:  # --pin: the downloaders (and the p2pd they start) on their own cores, off the training peer's
        os.sched_setaffinity(0, set(cpus))
    torch.set_num_threads(1)
    asyncio.run(_downloaders_main(count, maddrs, server_id, namespace, manifest_bytes, commands, results))


# ---------------------------------------------------------------------------------------- training peer


class Training:
    """``--steps`` AdamW steps of a preset on fixed random tokens (the data pipeline is not what is measured), on
    ``device`` (``cuda``: the model and batches on the GPU, ``precision`` bf16 under autocast, as the peer trains)."""

    def __init__(self, preset: str, batch_size: int, seq_len: int, device: str = "cpu", precision: str = "fp32") -> None:
        from asyncloco.models.presets import PRESETS, build_causal_lm

        self.device = torch.device(device)
        self.precision = precision
        self.vocab = PRESETS[preset].vocab_size or 4096
        model: Any = build_causal_lm(preset, vocab_size=self.vocab, seq_len=seq_len, seed=0)
        self.model = model.to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1)
        rows = torch.randint(0, self.vocab, (8, batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.rows = rows.to(self.device)

    def run(self, steps: int) -> float:
        from asyncloco.models.lm import causal_lm_loss

        autocast = self.precision == "bf16"
        started = time.perf_counter()
        for step in range(steps):
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = causal_lm_loss(self.model, self.rows[step % len(self.rows)])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the phase's steps have run, not only been queued
        return time.perf_counter() - started


def parse_bandwidths(text: str) -> List[Optional[float]]:
    out: List[Optional[float]] = []
    for item in text.split(","):
        item = item.strip().lower()
        if item == "none":
            out.append(None)
        else:
            value = float(item)
            if not value > 0:
                raise SystemExit(f"--serve-bandwidth: {item!r} is not a positive Mbit/s (or 'none')")
            out.append(value)
    return out


def label(bandwidth: Optional[float]) -> str:
    return "serving (no cap)" if bandwidth is None else f"serving ({bandwidth:g} Mbit/s cap)"


async def run(args: argparse.Namespace) -> Dict[str, Any]:
    from hivemind.p2p import P2P

    from asyncloco.models.workload import flatten_params
    from asyncloco.transport.codecs import encode
    from asyncloco.transport.swarm import BodyStore, ChunkServer, Manifest, ServeLimits, _Body, _TokenBucket

    pinned: Optional[List[int]] = None
    if args.pin:
        # the training peer and its p2pd (started below, inheriting this) on the first core, the downloaders on the
        # others: the phases then measure what serving costs the peer, not the downloaders' load on shared cores
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) <= args.peer_cores:
            raise SystemExit(f"--pin needs more than --peer-cores ({args.peer_cores}) cores; this process has {len(cores)}")
        os.sched_setaffinity(0, set(cores[:args.peer_cores]))
        pinned = cores[args.peer_cores:]
        torch.set_num_threads(args.peer_cores)
    if args.threads:
        torch.set_num_threads(args.threads)
    training = Training(args.model, args.batch_size, args.seq_len, args.device, args.precision)
    theta = flatten_params(training.model).detach().cpu().float().contiguous()
    numel = theta.numel()
    body = encode("int8", theta).to_bytes()
    base = Manifest.build("bench-swarm-serving", 0, "int8", numel, body)
    store = BodyStore(numel, keep_versions=VERSIONS)
    shared = bytearray(body)
    for version in range(VERSIONS):  # one body's bytes under every version number (no copies)
        manifest = dataclasses.replace(base, version=version)
        store._bodies[manifest.key] = _Body(manifest, shared, bytearray(b"\x01" * manifest.chunks))
    namespace = uuid.uuid4().hex[:8]
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0)
    server = ChunkServer(store)
    await server.add_handlers(p2p, namespace)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=downloaders_process, args=(args.downloaders, maddrs, str(p2p.peer_id.to_base58()), namespace,
                                                           base.to_bytes(), commands, results, pinned), daemon=True)
    worker.start()
    bandwidths = parse_bandwidths(args.serve_bandwidth)
    rates: Dict[str, List[float]] = {"alone": [], **{label(b): [] for b in bandwidths}}
    cpu: Dict[str, List[float]] = {k: [] for k in rates}
    served: Dict[str, List[float]] = {k: [] for k in rates}
    errors: List[str] = []
    try:
        message = await asyncio.to_thread(results.get, True, 600.0)
        assert message[0] == "ready", message
        await asyncio.to_thread(training.run, args.warmup)
        for repeat in range(args.repeats):
            phases: List[Optional[float] | str] = ["alone", *bandwidths]
            if repeat % 2:
                phases.reverse()
            for phase in phases:
                name = "alone" if phase == "alone" else label(phase)  # type: ignore[arg-type]
                if phase != "alone":
                    bandwidth = None if phase is None else float(phase) * 125_000.0
                    server.limits = ServeLimits(bandwidth=bandwidth)
                    server._bucket = _TokenBucket(bandwidth)
                    commands.put("go")
                    await asyncio.sleep(0.5)  # the downloads under way before the clock starts
                sent0, cpu0 = server.counters.bytes_sent, time.process_time()
                wall = await asyncio.to_thread(training.run, args.steps)
                sent, used = server.counters.bytes_sent - sent0, time.process_time() - cpu0
                if phase != "alone":
                    commands.put("pause")
                    message = await asyncio.to_thread(results.get, True, 600.0)
                    errors = message[2]
                    while True:  # let the downloads in flight finish: the next phase starts quiet
                        before = server.counters.bytes_sent
                        await asyncio.sleep(1.0)
                        if server.counters.bytes_sent == before:
                            break
                rates[name].append(args.steps / wall)
                cpu[name].append(used / args.steps)
                served[name].append(sent / wall / 1e6)
                print(f"  repeat {repeat} {name:28s} {args.steps / wall:7.3f} steps/s  served {sent / wall / 1e6:7.2f} MB/s"
                      f"  cpu {used / args.steps:6.3f} s/step", flush=True)
    finally:
        commands.put("stop")
        await asyncio.to_thread(worker.join, 90.0)
        if worker.is_alive():
            worker.kill()
        await server.remove_handlers(p2p, namespace)
        await p2p.shutdown()
    alone = statistics.median(rates["alone"])
    phases_out = {}
    for name in rates:
        phases_out[name] = {
            "steps_per_s": statistics.median(rates[name]),
            "ratio_to_alone": statistics.median(rates[name]) / alone,
            "served_mb_per_s": statistics.median(served[name]),
            "cpu_s_per_step": statistics.median(cpu[name]),
            "steps_per_s_all": rates[name],
        }
    return {
        "parameters": {
            "model": args.model, "numel": numel, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "steps": args.steps, "repeats": args.repeats, "downloaders": args.downloaders, "codec": "int8",
            "body_bytes": len(body), "chunk_bytes": base.chunk_bytes, "serve_bandwidth_mbit": args.serve_bandwidth,
            "torch_threads": torch.get_num_threads(), "pinned": bool(args.pin),
            "peer_cores": args.peer_cores if args.pin else None, "device": args.device, "precision": args.precision,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        },
        "phases": phases_out,
        "download_errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="preset (tiny, small, 20m, 60m, 150m)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="AdamW steps timed per phase")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--downloaders", type=int, default=8)
    parser.add_argument("--serve-bandwidth", default="none,50", help="comma list of Mbit/s caps to measure, 'none' = no cap")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--pin", action="store_true",
                        help="training peer (and its p2pd) on the first core, the downloaders on the others")
    parser.add_argument("--peer-cores", type=int, default=1, help="with --pin: cores for the training peer (default 1)")
    parser.add_argument("--device", default="cpu", help="where the peer trains: cpu (default) or cuda")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast, as a GPU peer trains")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny, 3 steps of 2 × 16 tokens, one "
                        "repeat, 2 downloaders, no cap (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.batch_size, args.seq_len, args.steps, args.warmup, args.repeats = "tiny", 2, 16, 3, 1, 1
        args.downloaders, args.serve_bandwidth, args.threads = 2, "none", 1
    if args.peer_cores < 1:
        parser.error("--peer-cores must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here (torch {torch.__version__})")
    logging.basicConfig(level=logging.WARNING)
    out = asyncio.run(run(args))
    print(f"\n{args.model} ({out['parameters']['numel']:,} parameters, int8 body {out['parameters']['body_bytes'] / 1e6:.1f} MB), "
          f"{args.downloaders} downloaders, median of {args.repeats}:")
    for name, row in out["phases"].items():
        print(f"  {name:28s} {row['steps_per_s']:7.3f} steps/s  x{row['ratio_to_alone']:.3f} of alone  "
              f"served {row['served_mb_per_s']:7.2f} MB/s  cpu {row['cpu_s_per_step']:.3f} s/step")
    if out["download_errors"]:
        print(f"  download errors: {len(out['download_errors'])}, first: {out['download_errors'][0]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
