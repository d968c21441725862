"""What one coordinator costs per decision, per model size, in-process (no network), with the defaults.

For each size the coordinator daemon is built around a θ of exactly the preset's parameter count (the
paper's 32k vocabulary; the parameter tensors have the preset's shapes, values are random) and driven
through its real durable path (the daemon's ``submit`` handler and its node's ``decide``: ``handle`` →
write-ahead log → fsync → actions) with verification on, as by default: a peer in the same process
(:class:`BenchPeer`) trains every lease with the real inner loop on a cheap synthetic loss (:class:`SizedWorkload`:
the gate takes its updates as independent honest work, not echoes), commits to its inner state before and after
(the chain a real peer's digests form), submits the int8 pseudo-gradient and reveals its states when the ack asks;
the coordinator holds each checked update, re-runs the lease from the revealed state in its verification worker
and applies it once the re-run agrees, bitwise. The peer's own seconds (training, encoding, packing a reveal) are
left out of every figure; the re-runs, the coordinator's work, are in. Each size runs in its own process (peak RSS
per size: the coordinator, its re-run trainer and the benchmark's peer together). Every figure is a median over
repeats, in seconds, measured side by side in the same process with the two yardsticks the targets are stated in:

* ``memcpy_s``: copy of θ (fp32) into a preallocated tensor;
* ``fsync_update_s``: write + fsync of one int8-encoded update's bytes to a new file in the checkpoint dir
  (sampled interleaved with the WAL and ack measurements);
* ``decode_s`` (int8 → fp32 into the reused buffer the daemon decodes into; ``decode_fresh_s``: into a newly
  allocated tensor, page faults included), ``validate_s`` (``logic.validate_update`` + the update gate's scoring, when a
  gate is configured), ``apply_s`` (the outer optimizer's step), ``wal_append_s`` (append + fsync of a
  submission record with its encoded bytes);
* ``ack_latency_s``: the daemon's ``submit`` RPC handler on the received bytes — decode, ``_decide(SubmitUpdate)``
  (validate, apply or hold for its check, log, fsync, bookkeeping) — what a peer waits for after its bytes
  arrived. As a real peer does, each lease's θ is fetched with the daemon's ``get_model`` (a ``Fetched`` event)
  before its update is submitted, so no θ copy is retained for it. The daemon decodes into a reused buffer and writes the submission's log record (checksum,
  write, fsync) in a worker thread while ``handle`` validates and applies it; ``ack_during_snapshot_s``: the same
  while a background snapshot is being written;
* ``lease_latency_s``: ``_decide(RequestWork)`` incl. its fsync; ``lease_bytes_written``: bytes the lease
  wrote to storage (log record only: a lease writes no θ-sized data);
* ``snapshot_copy_s`` (the consistent copy taken under the lock, into the buffers kept from the previous
  snapshot; ``snapshot_copy_first_s``: the first one, which allocates them) and ``snapshot_s`` (writing it in the
  background: temp file, fsync, rename);
* ``updates_per_s``: sustained lease + train + submit cycles for ``--sustain`` seconds of the coordinator's time
  (the peer's left out) with background snapshots every ``snapshot_every`` updates, the checked leases revealed
  and re-run, until every held update is applied; ``verification``: checks, passes, re-run steps and seconds; ``storage_per_update_theta``: bytes written (log + snapshots) per applied
  update, in units of θ's fp32 size; ``peers_at_60s_round``: peers one coordinator serves when each
  submits once per 60 s round (updates_per_s × 60);
* ``peak_rss_mb`` of the process.

Targets (at 150m): ack ≤ 1.5 × fsync_update + 4 × memcpy; lease ≤ 50 ms; validate ≤ 2 × memcpy.

``--codecs int8,topk16b2`` measures only decode + apply per upload codec, interleaved, with the ratio to
int8 (docs/compression.md).

Usage: ``python scripts/bench_coordinator.py --sizes 20m,60m --json out.json`` (≈ 5 min per size on a loaded 2-core
machine; ``--smoke``: tiny, seconds). Prints a table and the ratios; the capacity figures of docs/guide/organiser.md
come from it. Peak RSS was 4.6 GB at 20m, 9.7 GB at 60m and 27.5 GB at 150m (a 32 GB machine, or the GPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from asyncloco.config import load_config
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.daemon import CoordinatorDaemon
from asyncloco.coordinator.logic import (
    Assign, Fetched, Hold, HoldDropped, Lease, RequestWork, SpeedReport, SubmitUpdate, validate_update,
)
from asyncloco.models.workload import Workload
from asyncloco.transport.codecs import decode, encode, wire_bytes
from asyncloco.transport.wire import RevealHeader, SubmitHeader

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("tiny", "20m", "60m", "150m")
COMMON_SHARE = 0.2  # the shared part of the synthetic gradients (SizedWorkload)
KEYS = (
    "numel", "memcpy_s", "fsync_update_s", "decode_s", "decode_fresh_s", "validate_s", "apply_s", "wal_append_s", "ack_latency_s",
    "ack_during_snapshot_s", "lease_latency_s", "lease_bytes_written", "snapshot_copy_s", "snapshot_copy_first_s", "snapshot_s",
    "updates_per_s", "storage_per_update_theta", "peers_at_60s_round", "peak_rss_mb",
)


# ------------------------------------------------------------------------------------ a θ of the size


class _Params(nn.Module):
    def __init__(self, shapes: list[torch.Size], seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.tensors = nn.ParameterList(nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes)


class SizedWorkload(Workload):
    """θ of a model preset's layout (its parameter shapes) with a loss that costs about one pass over θ per step,
    so that the benchmark's peer trains its leases with the real inner loop (train/inner.py ``InnerTrainer``: AdamW,
    clipping, the inner state the commitments hash) and the coordinator re-runs the ones it checks, exactly as
    verification does in a run. The "data": the gradient of step (shard, index) is a copy of a fixed random direction
    rolled by an offset drawn from (shard, index), plus ``COMMON_SHARE`` × that direction — every lease's update
    shares part of its direction with the others' (like honest work on one task, below the gate's echo bar once the
    inner momentum has carried it over several leases) and is its own for the rest; a re-run reproduces it bitwise."""

    units_per_step = 8 * 64

    def __init__(self, preset: str) -> None:
        from transformers import LlamaForCausalLM

        from asyncloco.models.presets import causal_lm_config

        vocab = 4096 if preset == "tiny" else None  # tiny has no paper vocabulary: the project's tokenizer
        with torch.device("meta"):
            model = LlamaForCausalLM(causal_lm_config(preset, vocab))
        self.shapes = [p.shape for p in model.parameters()]
        self._directions: list[torch.Tensor] | None = None

    def build_model(self, seed: int) -> nn.Module:
        return _Params(self.shapes, seed)

    def shard_sizes(self) -> list[int]:
        return [10**6] * 4

    def batch(self, shard: int, index: int) -> Any:
        return (int(shard), int(index))

    def _common(self) -> list[torch.Tensor]:
        if self._directions is None:
            generator = torch.Generator().manual_seed(12345)
            self._directions = [torch.randn(shape, generator=generator).view(-1) for shape in self.shapes]
        return self._directions

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        shard, index = batch
        total = torch.zeros(())
        for i, (param, common) in enumerate(zip(model.parameters(), self._common())):
            shift = (shard * 1_000_003 + index * 7_919 + i * 104_729) % max(1, common.numel())
            gradient = torch.roll(common, shift).add_(common, alpha=COMMON_SHARE)
            total = total + torch.dot(param.view(-1), gradient)
        return total

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}


# ------------------------------------------------------------------------------------------ timing


def median_time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fsync_bytes(directory: Path, parts: list[Any]) -> None:
    path = directory / "fsync-probe.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink()


class BenchPeer:
    """A peer as the coordinator meets it with the defaults (verification on, carried inner state): it trains each
    lease with the real inner loop from θ fetched at the lease's base version, commits to its inner state before and
    after (train/commitments.py, as peer/runner.py does: only an applied lease advances the chain, otherwise it
    starts again from the fresh state), submits the int8 pseudo-gradient through the daemon's ``submit`` handler and
    reveals both states when the ack asks. Its own work (training, encoding, packing a reveal) is what a peer's
    machine does: timed apart (``peer_s``) and left out of the coordinator's figures."""

    def __init__(self, daemon: Any, cfg: Any, name: str) -> None:
        from asyncloco.peer.reveal import RevealStore
        from asyncloco.train.inner import InnerTrainer

        self.daemon, self.name = daemon, name
        self.trainer = InnerTrainer.from_config(cfg, daemon.workload)
        self.reveals = RevealStore(1)  # it reveals right after its ack: one lease's states kept
        self.peer_s = 0.0
        self.revealed = 0
        self.submitted: list[tuple[Any, Any]] = []  # (lease, ack)
        self.last_wait = 0.0  # seconds the last lease() waited for verdicts (see lease)

    async def lease(self) -> Lease:
        """A lease. While its update from the current θ waits for its check (a newcomer's probation), the request is
        held until θ moves (coordinator/logic/leases.py ``held_at_version``): this peer, which has no RPC waiting for
        the answer, drops the held request, waits for the verifier's verdicts and asks again; ``last_wait`` is the
        time that took (not the coordinator's decision: the callers leave it out of the lease latency)."""
        self.last_wait = 0.0
        actions = await self.daemon.node.decide_locked(RequestWork(self.name))
        if any(isinstance(a, Hold) for a in actions):
            began = time.perf_counter()
            await self.daemon.node.decide_locked(HoldDropped(self.name))
            await self.daemon.verification.drain()
            self.last_wait = time.perf_counter() - began
            actions = await self.daemon.node.decide_locked(RequestWork(self.name))
        (assign,) = [a for a in actions if isinstance(a, Assign)]
        return assign.lease

    async def train(self, lease_: Lease) -> tuple[Any, str, str]:
        """θ at the lease's base version (the daemon's ``get_model``, a Fetched event), then the lease trained:
        (encoded update, start digest, end digest)."""
        from asyncloco.train.commitments import committed_digest

        _, theta = await self.daemon.serving.get_model(lease_.base_version, self.name)
        started = time.perf_counter()
        digest = self.trainer.state_digest()
        assert digest is not None, "a plain AdamW trainer's state can be committed to"
        start = committed_digest(digest, None)
        self.reveals.hold(lease_.lease_id, self.trainer.optimizer, None, feedback=False)
        result = self.trainer.run(theta, lease_.shard, lease_.start_offset, lease_.steps, lease_.lr_offset)
        end = self.reveals.hold_end(lease_.lease_id, self.trainer.optimizer)
        assert end is not None
        encoded = encode("int8", result.pseudo_gradient)
        self.peer_s += time.perf_counter() - started
        return encoded, start, end

    async def submit(self, lease_: Lease, encoded: Any, start: str, end: str) -> tuple[Any, float]:
        """The daemon's submit RPC handler on the received bytes, as the transport calls it: (ack, its seconds)."""
        header = SubmitHeader(lease_.lease_id, lease_.base_version, "int8", self.daemon.numel, state_start=start,
                              state_end=end, device_class=self.trainer.compute_class)
        begin = time.perf_counter()
        ack = await self.daemon.serving.submit(header, encoded, self.name)
        seconds = time.perf_counter() - begin
        self.submitted.append((lease_, ack))
        if not ack.accepted or ack.duplicate:
            raise RuntimeError(f"the benchmark's update was not accepted: {ack}")
        if ack.reveal:
            begin = time.perf_counter()
            state = self.reveals.reveal(lease_.lease_id)
            self.peer_s += time.perf_counter() - begin
            reply = await self.daemon.serving.reveal(RevealHeader(lease_.lease_id, len(state or b"")), state or b"", self.name)
            if not reply.accepted:
                raise RuntimeError(f"the benchmark's reveal was refused: {reply}")
            self.revealed += 1
        return ack, seconds

    async def round(self) -> tuple[float, float]:
        """One lease trained and submitted: (lease seconds, ack seconds)."""
        begin = time.perf_counter()
        current = await self.lease()
        lease_s = time.perf_counter() - begin
        encoded, start, end = await self.train(current)
        _, ack_s = await self.submit(current, encoded, start, end)
        return lease_s, ack_s


def bench_size(size: str, repeats: int, sustain_s: float, workdir: Path) -> dict[str, Any]:
    overrides = {
        "schedule.grace_period": 0.0,
        "outer.buffer_size": 4,
        "runtime.codec": "int8", "runtime.error_feedback": False,  # the benchmark peer uploads int8 without feedback
        "runtime.eval_every": 10**9,
        "runtime.snapshot_every": 10**9,
        "runtime.snapshot_every_s": 1e9,
        # the gate's probe is two forward passes on held-out data (coordinator/probe.py), which this θ-only workload
        # has not; above 50M parameters it runs on a peer's first (probation) updates only, off the steady path
        "runtime.gate.probe": False,
        # the benchmark's leases train from the first one at the peak LR (no warm-up ramp): every update has the
        # size of a steady run's, so the gate's norm check compares like with like from the start
        "inner.warmup_steps": 0,
        # short leases: the benchmark's peer trains every lease in this process (left out of the figures); a lease's
        # length changes none of the coordinator's per-submission costs, only the re-runs' compute (scripts/bench_verify.py)
        "schedule.max_local_steps": 4,
    }
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    assert cfg.runtime.verify.enabled and cfg.runtime.verify.inner_state == "carry", "the defaults verify carried state"
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=workdir, workload=SizedWorkload(size))
    verification = daemon.verification
    assert verification is not None, "the benchmark runs with runtime.verify.enabled"
    numel = daemon.numel
    theta_bytes = 4 * numel
    state = daemon.node.state
    out: dict[str, Any] = {"numel": numel, "verify": {"enabled": True, "fraction": cfg.runtime.verify.fraction,
                                                      "probation_updates": cfg.runtime.verify.probation_updates}}
    peer = BenchPeer(daemon, cfg, "bench-peer")

    scratch = torch.empty_like(state.params)
    out["memcpy_s"] = median_time(lambda: scratch.copy_(state.params), repeats)
    del scratch
    fsync_samples: list[float] = []

    async def scenario() -> None:
        daemon.node.stop_event = asyncio.Event()
        await daemon.durability.save()
        # the slowest speed: the shortest lease (min_steps), so the benchmark's peer trains little per update
        await daemon.node.decide_locked(SpeedReport(peer.name, 1.0))

        # one lease trained and submitted: its bytes are the yardsticks' and the micro-benchmarks' update
        current = await peer.lease()
        wire, start, end = await peer.train(current)
        assert wire.nbytes == wire_bytes("int8", numel)

        def probe_fsync() -> None:
            # the yardstick, measured interleaved with what it is compared to (disk speed drifts on a shared machine)
            begin = time.perf_counter()
            fsync_bytes(workdir, [wire.meta, wire.payload])
            fsync_samples.append(time.perf_counter() - begin)

        probe_fsync()
        decoded = torch.empty(numel)
        out["decode_s"] = median_time(lambda: decode(wire, numel, decoded), repeats)
        del decoded
        out["decode_fresh_s"] = median_time(lambda: decode(wire, numel), repeats)
        tensor = decode(wire, numel)
        event = SubmitUpdate(peer.name, current.lease_id, current.base_version, tensor, state_start=start, state_end=end)

        def validate() -> None:
            problem = validate_update(state, event, current)
            assert problem is None, problem
            if state.policy.gate is not None:
                update_gate.score(state.policy.gate, state.gate, tensor, current.steps, peer.name, state.policy.norm_bound_per_step,
                                  sketcher=state.own_sketcher())

        out["validate_s"] = median_time(validate, repeats)
        # the outer step on a copy of the optimizer's state: θ and its momentum stay the daemon's own
        shadow_params = state.params.clone()
        shadow = copy.deepcopy(state.optimizer)
        out["apply_s"] = median_time(lambda: shadow.step(shadow_params, tensor, 1.0), repeats)
        del shadow, shadow_params

        def wal_append() -> None:
            daemon.node.wal.append_event(event, time.time(), {"pseudo_gradient": ("int8", numel, [wire.meta, wire.payload])})
            daemon.node.wal.sync()

        out["wal_append_s"] = median_time(wal_append, repeats, setup=probe_fsync)
        await peer.submit(current, wire, start, end)

        # ack and lease latency, through the daemon's durable path (the first leases are the peer's probation:
        # checked, held until their re-run agrees, as every newcomer's are)
        acks, leases, lease_bytes = [], [], []
        for _ in range(repeats):
            probe_fsync()
            before = daemon.node.wal.bytes_written + daemon.durability.snapshot_bytes
            begin = time.perf_counter()
            current = await peer.lease()
            leases.append(time.perf_counter() - begin - peer.last_wait)
            lease_bytes.append(daemon.node.wal.bytes_written + daemon.durability.snapshot_bytes - before)
            encoded, start, end = await peer.train(current)
            _, ack_s = await peer.submit(current, encoded, start, end)
            acks.append(ack_s)
        out["ack_latency_s"] = statistics.median(acks)
        out["fsync_update_s"] = statistics.median(fsync_samples)
        out["lease_latency_s"] = statistics.median(leases)
        out["lease_bytes_written"] = max(lease_bytes)
        await verification.drain()  # the probation checks' verdicts: the peer is proven from here on

        # a background snapshot: the copy under the lock, the write in a thread; acks go on meanwhile
        async with daemon.node.lock:
            begin = time.perf_counter()
            payload = daemon.durability.snapshot_payload(copy=True, reuse=True)  # as _maybe_snapshot takes it (first: allocates)
            daemon.node.wal.rotate()
            daemon.durability.reset_counters()
            out["snapshot_copy_first_s"] = time.perf_counter() - begin
        # the next lease's update, trained before the snapshot starts (a peer trains while the coordinator writes)
        lease_ = await peer.lease()
        ready = [(lease_, *(await peer.train(lease_)))]
        done = threading.Event()
        written: dict[str, float] = {}

        def write() -> None:
            begin_ = time.perf_counter()
            daemon.durability.write_snapshot(payload)
            written["s"] = time.perf_counter() - begin_
            done.set()

        thread = threading.Thread(target=write)
        thread.start()
        during: list[float] = []
        while not done.is_set() and len(during) < 3:
            if not ready:  # a peer's next lease (a large θ's snapshot outlasts one round)
                lease_ = await peer.lease()
                ready.append((lease_, *(await peer.train(lease_))))
            lease_, encoded, start, end = ready.pop()
            _, ack_s = await peer.submit(lease_, encoded, start, end)
            during.append(ack_s)
        if ready:  # the snapshot was written before the trained update was sent: it goes in now
            await peer.submit(*ready.pop())
        await asyncio.to_thread(thread.join)
        del payload
        out["snapshot_s"] = written["s"]
        # the next snapshots copy into the buffers the first one allocated
        async with daemon.node.lock:
            out["snapshot_copy_s"] = median_time(lambda: daemon.durability.snapshot_payload(copy=True, reuse=True), repeats)
        out["ack_during_snapshot_s"] = statistics.median(during) if during else None
        await verification.drain()

        # sustained: lease + train + submit cycles, background snapshots every `snapshot_every` updates, the checked
        # leases revealed and re-run by the coordinator; the peer's own seconds are left out of the elapsed time
        snapshot_every = max(5, int(sustain_s * 0.5 / max(out["ack_latency_s"] + out["lease_latency_s"], 1e-3)))
        daemon.cfg = daemon.cfg.model_copy(update={"runtime": daemon.cfg.runtime.model_copy(update={"snapshot_every": snapshot_every})})
        updates_before = state.version
        written_before = daemon.node.wal.bytes_written + daemon.durability.snapshot_bytes
        checked_before = state.verification.checked
        peer_before = peer.peer_s
        rounds = 0
        begin = time.perf_counter()
        while time.perf_counter() - begin - (peer.peer_s - peer_before) < sustain_s or rounds < 3:
            await peer.round()
            rounds += 1
        await verification.drain()  # held updates are applied once their re-run agrees
        await daemon.durability.wait_for_snapshot()
        elapsed = time.perf_counter() - begin - (peer.peer_s - peer_before)
        updates = state.version - updates_before
        out["updates_per_s"] = updates / elapsed
        out["sustained_rounds"] = rounds
        out["sustained_updates"] = updates
        out["sustained_checked"] = state.verification.checked - checked_before
        out["sustained_snapshot_every"] = snapshot_every
        out["storage_per_update_theta"] = (daemon.node.wal.bytes_written + daemon.durability.snapshot_bytes - written_before) / max(1, updates) / theta_bytes
        out["peers_at_60s_round"] = int(out["updates_per_s"] * 60)
        status = verification.status()
        out["verification"] = {k: status[k] for k in ("checked", "failed", "passed", "dropped", "unverifiable", "rerun_steps",
                                                      "busy_s", "latency_median_s", "compute_fraction")}
        out["verification"]["reveals"] = peer.revealed
        # checks re-run without a reveal: started fresh, or from the end state kept from the peer's previous check
        out["verification"]["chained"] = {k: status["chained"][k] for k in ("fresh", "kept", "waited")}
        out["verification"]["expelled"] = len(status["expelled"])
        refused = [ack for _, ack in peer.submitted if not ack.accepted]
        out["submitted"], out["refused"] = len(peer.submitted), len(refused)
        out["lease_steps"] = sorted({lease_.steps for lease_, _ in peer.submitted})
        out["peer_s"] = peer.peer_s
        cosines = sorted(state.gate.cosines)  # the applied updates' cosines with the consensus (the echo bar: 0.95)
        out["gate_cosine_median"] = cosines[len(cosines) // 2] if cosines else None
        out["gate_cosine_max"] = cosines[-1] if cosines else None
        await verification.close()

    asyncio.run(scenario())
    daemon.monitoring.journal.close()
    daemon.node.wal.close()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["ack_target_s"] = 1.5 * out["fsync_update_s"] + 4 * out["memcpy_s"]
    if out["verification"]["failed"] or out["verification"]["expelled"] or out["refused"]:
        raise RuntimeError(f"honest work was refused or failed its check: {out['verification']}, refused {out['refused']}")
    return out


# -------------------------------------------------------------------------------------------- main


def bench_codecs(size: str, codecs: list[str], repeats: int, workdir: Path) -> dict[str, Any]:
    """Per upload codec: decode (into the reused buffer where the codec allows, as the daemon does) + apply (the outer
    optimizer's step, averaged over one cycle of buffer_size applies) of one pseudo-gradient per upload codec,
    measured interleaved in one process."""
    from asyncloco.transport.codecs import decodes_into

    overrides = {"schedule.grace_period": 0.0, "outer.buffer_size": 4, "runtime.codec": "int8", "runtime.error_feedback": False, "runtime.eval_every": 10**9,
                 "runtime.snapshot_every": 10**9, "runtime.snapshot_every_s": 1e9, "runtime.gate.probe": False}
    cfg = load_config(ROOT / "configs" / "demo.yaml", overrides)
    daemon = CoordinatorDaemon(cfg, checkpoint_dir=workdir, workload=SizedWorkload(size))
    numel, state = daemon.numel, daemon.node.state
    generator = torch.Generator().manual_seed(1)
    update = torch.randn(numel, generator=generator).mul_(0.05 * cfg.inner.lr * 10)
    wires = {codec: encode(codec, update) for codec in codecs}
    buffer = torch.empty(numel)
    cycle = cfg.outer.buffer_size or cfg.sim.workers  # DN's N (config.py: the number of workers by default)
    samples: dict[str, dict[str, list[float]]] = {c: {"decode": [], "apply": [], "decode_apply": []} for c in codecs}
    scratch = torch.empty_like(state.params)
    memcpy = median_time(lambda: scratch.copy_(state.params), repeats)
    del scratch
    for _ in range(repeats):
        for codec in codecs:  # interleaved: load on a shared machine drifts
            out = buffer if decodes_into(codec) else None
            start = time.perf_counter()
            tensor = decode(wires[codec], numel, out)
            mid = time.perf_counter()
            # a whole cycle of the outer optimizer (Delayed Nesterov's momentum step comes once every buffer_size
            # applies): with one apply per codec, whichever codec is buffer_size-th in the list always paid for it
            for _ in range(cycle):
                state.optimizer.step(state.params, tensor, 1.0)
            apply = (time.perf_counter() - mid) / cycle
            samples[codec]["decode"].append(mid - start)
            samples[codec]["apply"].append(apply)
            samples[codec]["decode_apply"].append(mid - start + apply)
            del tensor
    result: dict[str, Any] = {"numel": numel, "memcpy_s": memcpy, "codecs": {}}
    for codec in codecs:
        result["codecs"][codec] = {
            "wire_bytes": wire_bytes(codec, numel),
            **{f"{k}_s": statistics.median(v) for k, v in samples[codec].items()},
        }
    return result


def codec_report(size: str, r: dict[str, Any]) -> str:
    lines = [f"{size} ({r['numel'] / 1e6:.1f} M parameters): decode + apply per upload codec, medians, interleaved",
             "", "| codec | MB | decode | apply | decode + apply | vs int8 |", "|---|---:|---:|---:|---:|---:|"]
    base = r["codecs"].get("int8", {}).get("decode_apply_s")
    for codec, c in r["codecs"].items():
        ratio = f"{c['decode_apply_s'] / base:.2f}" if base else "-"
        lines.append(f"| {codec} | {c['wire_bytes'] / 1e6:.2f} | {_duration(c['decode_s'])} | {_duration(c['apply_s'])} | "
                     f"{_duration(c['decode_apply_s'])} | {ratio} |")
    return "\n".join(lines)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}"
    return str(value)


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    head = ["size", "θ (M)", "memcpy", "fsync(upd)", "decode", "validate", "apply", "WAL+fsync", "ack", "ack|snap", "lease", "snap copy", "snapshot", "upd/s", "peers@60s", "RSS MB"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for size, r in results.items():
        row = [size, f"{r['numel'] / 1e6:.1f}"] + [
            fmt(r[k]) for k in ("memcpy_s", "fsync_update_s", "decode_s", "validate_s", "apply_s", "wal_append_s", "ack_latency_s",
                                "ack_during_snapshot_s", "lease_latency_s", "snapshot_copy_s", "snapshot_s", "updates_per_s", "peers_at_60s_round", "peak_rss_mb")
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("(seconds, medians; ack|snap: ack latency while a background snapshot is written)")
    lines.append("")
    for size, r in results.items():
        lines.append(
            f"{size}: ack {r['ack_latency_s']:.3g} s = {r['ack_latency_s'] / r['ack_target_s']:.2f} × target "
            f"(1.5 × fsync {r['fsync_update_s']:.3g} + 4 × memcpy {r['memcpy_s']:.3g} = {r['ack_target_s']:.3g} s); "
            f"validate = {r['validate_s'] / r['memcpy_s']:.2f} × memcpy (target ≤ 2); "
            f"apply = {r['apply_s'] / r['memcpy_s']:.2f} × memcpy; decode = {r['decode_s'] / r['memcpy_s']:.2f} × memcpy "
            f"(into a fresh tensor {r['decode_fresh_s'] / r['memcpy_s']:.2f}); "
            f"WAL append = {r['wal_append_s'] / r['fsync_update_s']:.2f} × fsync(update); "
            f"lease {1000 * r['lease_latency_s']:.1f} ms writing {r['lease_bytes_written']} B (target ≤ 50 ms, no θ-sized data); "
            f"storage per update {r['storage_per_update_theta']:.2f} × θ"
        )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3g} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"
    return f"{seconds:.2f} s"


def readme_table(results: dict[str, dict[str, Any]]) -> str:
    """The capacity table (units in each cell) docs/guide/organiser.md quotes, from the same results."""
    head = [
        "size", "θ", "memcpy θ", "fsync of the int8 update", "decode", "validate", "apply (DN)", "log append + fsync",
        "**ack**", "ack during a snapshot", "**lease**", "snapshot copy (under the lock)", "background snapshot",
        "updates/s sustained", "peers at a 60 s round", "peak RSS",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for size, r in results.items():
        during = r.get("ack_during_snapshot_s")
        cells = [size, f"{r['numel'] / 1e6:.1f} M"] + [
            _duration(r[k]) for k in ("memcpy_s", "fsync_update_s", "decode_s", "validate_s", "apply_s", "wal_append_s", "ack_latency_s")
        ] + [
            _duration(during) if during is not None else "-",
            _duration(r["lease_latency_s"]),
            _duration(r["snapshot_copy_s"]),
            _duration(r["snapshot_s"]),
            f"{r['updates_per_s']:.3g}",
            str(r["peers_at_60s_round"]),
            f"{r['peak_rss_mb'] / 1024:.1f} GB",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,20m", help=f"comma-separated, from {','.join(SIZES)} (150m: about 28 GB)")
    parser.add_argument("--repeats", type=int, default=0, help="repeats per figure (default: 7 tiny, 3 otherwise)")
    parser.add_argument("--sustain", type=float, default=0.0, help="seconds of sustained updates (default: 5 tiny, 25 otherwise)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the coordinator's CLI default on this machine)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one size in this process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--codecs", help="only decode + apply per upload codec, side by side (e.g. int8,topk16b2)")
    parser.add_argument("--dir", type=Path, help="where checkpoints are written (default: a temporary dir on the same disk as runs/)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny only, 2 repeats, 1 s sustained (tests)")
    args = parser.parse_args(argv)
    if args.smoke and not args.one:
        args.sizes, args.repeats, args.sustain = "tiny", 2, 1.0
    logging.basicConfig(level=logging.WARNING)

    if args.one:
        torch.set_num_threads(args.threads)
        repeats = args.repeats or (7 if args.one == "tiny" else 3)
        sustain = args.sustain or (5.0 if args.one == "tiny" else 25.0)
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-{args.one}-", dir=args.dir))
        try:
            if args.codecs:
                result = bench_codecs(args.one, [c.strip() for c in args.codecs.split(",") if c.strip()], args.repeats or 5, workdir)
            else:
                result = bench_size(args.one, repeats, sustain, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        assert args.out is not None
        args.out.write_text(json.dumps(result))
        return 0

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {SIZES}")
    base = args.dir or ROOT / "runs"
    base.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    started = time.time()
    for size in sizes:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            command = [sys.executable, __file__, "--one", size, "--out", tmp.name, "--dir", str(base), "--threads", str(args.threads)]
            if args.repeats:
                command += ["--repeats", str(args.repeats)]
            if args.sustain:
                command += ["--sustain", str(args.sustain)]
            if args.codecs:
                command += ["--codecs", args.codecs]
            t0 = time.time()
            subprocess.run(command, check=True)
            results[size] = json.loads(Path(tmp.name).read_text())
            results[size]["wall_s"] = time.time() - t0
        print(f"{size}: done in {results[size]['wall_s']:.0f} s", file=sys.stderr)
    if args.codecs:
        for size, result in results.items():
            print(codec_report(size, result) + "\n")
    else:
        print(report(results))
        print("\ncapacity table (docs/guide/organiser.md):\n" + readme_table(results))
    print(f"\ntotal {time.time() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
