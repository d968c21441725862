"""θ download bytes per round with verification on: fp32 (what verification forced before) vs the default int8.

Runs the real coordinator daemon and peer runners over the in-memory transport (asyncloco/testing/memory.py) on a
config (default: lm-tiny, H = 5), every lease checked (``runtime.verify.fraction: 1``), once per download codec, and
counts what the peers' clients received for θ (the bodies' bytes: an "unchanged" answer sends none) against θ's fp32
bytes, with the verdicts of the checks: a compressed download passes its bitwise check when the verifier re-runs
from the θ the peer decoded (docs/design.md, "Compressed downloads and verification").

Usage::

    python scripts/download_verify.py --json docs/results/download-verify-bytes-2026-11-28.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's asyncloco, installed or not


def run_once(config: Path, codec: str, peers: int, rounds: int, steps: int) -> dict[str, Any]:
    from asyncloco.clock import FakeClock
    from asyncloco.config import load_config
    from asyncloco.peer.runner import InnerTrainer, PeerOptions, PeerRunner  # (train/inner.py)
    from asyncloco.testing.memory import MemoryClient, MemoryTransport, as_actor, drive
    from asyncloco.transport.codecs import wire_bytes
    from asyncloco.transport.rpc import TrafficCounters

    cfg = load_config(config, {
        "schedule.max_local_steps": steps, "schedule.grace_period": 0.0, "outer.buffer_size": peers, "sim.workers": peers,
        "runtime.download_codec": codec, "runtime.eval_every": 100000, "runtime.speed_report_period": 600.0,
        "runtime.gate.enabled": False,  # the gate's verdicts are not what this measures
        "runtime.verify.enabled": True, "runtime.verify.fraction": 1.0, "runtime.verify.queue": 1024,
        "runtime.verify.sketch_threshold": 1.0,
    })
    clock = FakeClock()

    async def scenario(run_dir: Path) -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        await transport.start()
        counters: dict[str, Any] = {}
        try:
            tasks = {}
            for index in range(peers):
                name = f"p{index}"
                options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                                      progress=False, max_rounds=rounds)
                runner = PeerRunner(options, clock=transport.clock)
                runner.summary.peer_id = name
                runner.speed = 1000.0 * (1 + index)
                counters[name] = TrafficCounters()
                client = MemoryClient(transport, name, counters=counters[name], download_codec=codec)
                trainer = InnerTrainer.from_config(cfg, transport.workload)
                tasks[name] = as_actor(name, runner.serve(client, transport.publisher(name, signer=f"key-{name}"), cfg,
                                                          transport.workload, trainer, cfg.runtime.codec, counters[name]))
            await drive(clock, tasks, real_timeout=1500.0)
            daemon = transport.daemon
            assert daemon is not None and daemon.verification is not None
            await asyncio.wait_for(daemon.verification.drain(), timeout=600.0)
            numel = daemon.numel
            status = daemon.verification.status()
            downloads = daemon.serving.service.downloads
            summaries = [task.result() for task in tasks.values()]
            received = sum(c.get_model.payload_bytes_received for c in counters.values())
            total_rounds = sum(s.rounds for s in summaries)
            fp32 = wire_bytes("none", numel)
            return {
                "download_codec": codec, "numel": numel, "theta_fp32_bytes": fp32, "peers": peers,
                "rounds": total_rounds, "get_model_calls": sum(c.get_model.calls for c in counters.values()),
                "download_bytes": received, "download_bytes_per_round": received / total_rounds,
                "per_round_vs_fp32": received / total_rounds / fp32,
                "bodies": received // wire_bytes(codec, numel), "per_body_vs_fp32": wire_bytes(codec, numel) / fp32,
                "full_sent": downloads.full_sent if codec != "none" else None,
                "deltas_sent": downloads.deltas_sent if codec != "none" else None,
                "checks_passed": status["passed"], "checks_failed": status["failed"], "unverifiable": status["unverifiable"],
                "version": daemon.node.state.version,
            }
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(scenario(Path(tmp) / "run"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "asyncloco" / "configs" / "lm-tiny.yaml")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6, help="leases per peer")
    parser.add_argument("--steps", type=int, default=5, help="schedule.max_local_steps (H)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: 2 peers × 2 leases of 2 steps (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.peers, args.rounds, args.steps = 2, 2, 2
    started = time.time()
    runs = [run_once(args.config, codec, args.peers, args.rounds, args.steps) for codec in ("none", "int8")]
    for run in runs:
        print(json.dumps(run))
    out = {
        "what": "θ download bytes per round with verification on (every lease re-run): fp32 vs the default int8 "
                "(deltas from each peer's anchor; the verifier re-runs from the θ the peer decoded)",
        "script": "scripts/download_verify.py", "config": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else str(args.config),
        "peers": args.peers, "rounds_per_peer": args.rounds, "local_steps": args.steps,
        "runs": runs, "seconds": round(time.time() - started, 1),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
