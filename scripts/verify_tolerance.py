"""How exactly a lease reproduces: the figure that sets ``runtime.verify.tolerance`` (docs/threat-model.md).

Verified work (asyncloco/coordinator/verify.py) re-runs a sampled lease and compares the pseudo-gradient
with the one submitted: bitwise by default, or within a relative L2 error. This script measures, for one
model on one device, what an honest re-run gives, side by side with what an honest *different* lease gives
(the scale of a real difference):

* ``rerun`` — the same lease (same θ, batches, steps, LR offset, fresh AdamW state) run twice on ``--device``
  in ``--precision``: bitwise equal or not, relative L2 error, cosine;
* ``rerun_deterministic`` — the same with ``torch.use_deterministic_algorithms(True)`` (on CUDA: deterministic
  kernels for the embedding's backward and the like, cuBLAS with a fixed workspace);
* ``other_lease`` — the lease against one on other batches from the same θ: an honest different update;
* ``vs_cpu_fp32`` (``--device cuda`` only) — the device's lease against the same lease on the CPU in fp32:
  what a CPU verifier of a GPU peer would see (``vs_cpu_fp32_end_state``: the lease's end inner state, as
  ``end_state_fresh`` below);
* ``cross_cpu`` (``--cross-cpu``) — the same lease on this CPU in fresh processes with torch's kernels dispatched
  to other instruction sets (``ATEN_CPU_CAPABILITY`` default / avx2 / avx512, i.e. other *compute classes*,
  train/inner.py ``compute_class``) and with 1 or several threads, each against the first: what a CPU verifier
  sees of a CPU peer on another machine (sets ``runtime.verify.cross_device_tolerance`` for fp32 runs). Each row also
  has the lease's *end inner state* against the first's (``end_state_fresh``: the lease from a fresh AdamW state;
  ``end_state_carried``: the next lease, from a carried state the parent process trained, the same bytes for every
  process, as a verifier re-runs it from the revealed start; coordinator/rerun.py ``state_gap``: relative L2 errors of
  m, v and the AdamW step u = m̂/(√v̂+eps); ``precond``: the RMS log-ratio of the step size 1/(√v̂+eps)) and the
  error-feedback residual each codec leaves
  (``residual_after_codec``): what sets ``runtime.verify.cross_device_state_tolerance``.

    python scripts/verify_tolerance.py --model tiny --device cpu --json runs/verify-tolerance-cpu.json
    python scripts/verify_tolerance.py --model 20m --device cuda --precision bf16 --json /tmp/tol.json
    python scripts/verify_tolerance.py --model 20m --steps 30 --cross-cpu --json /tmp/tol-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# cuBLAS reproducibility needs this before CUDA is initialised (torch's "Reproducibility" notes)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_peer
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

from bench_peer import RandomTokens  # noqa: E402

from asyncloco.algo.schedule import ShardSchedule  # noqa: E402
from asyncloco.coordinator.rerun import state_gap, state_moments  # noqa: E402
from asyncloco.coordinator.rerun import compare  # noqa: E402
from asyncloco.models.workload import flatten_params  # noqa: E402
from asyncloco.peer.distributed import validate_device  # noqa: E402
from asyncloco.train.commitments import inner_state_chunks, load_inner_state  # noqa: E402
from asyncloco.train.inner import InnerTrainer, compute_class  # noqa: E402

CROSS_CPU = (("avx2", 1), ("avx2", 2), ("default", 2), ("avx512", 2))  # (ATEN_CPU_CAPABILITY, threads)


def trainer_for(workload: RandomTokens, device: str, precision: str) -> InnerTrainer:
    return InnerTrainer(workload, ShardSchedule(1e-3, 1e-4, 0, 10**6), seed=0, optimizer="adamw",
                        weight_decay=0.1, grad_clip=1.0, device=device, precision=precision)


def lease(workload: RandomTokens, theta: torch.Tensor, device: str, precision: str, steps: int, offset: int) -> torch.Tensor:
    """One lease as a verifier re-runs it: a fresh trainer (fresh AdamW state), θ in, pseudo-gradient out."""
    return trainer_for(workload, device, precision).run(theta, 0, offset, steps, 0).pseudo_gradient.clone()


def judged(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    c = compare(a, b)
    return {"bitwise": c.bitwise, "rel_error": c.rel_error, "cosine": c.cosine,
            "max_abs_diff": float((a - b).abs().max()), "norm": float(a.norm())}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = str(validate_device(args.device))
    workload = RandomTokens(args.model, args.batch_size, args.seq_len, batches=2 * args.steps)
    theta = flatten_params(workload.build_model(seed=0)).detach().clone()
    started = time.perf_counter()
    trainer = trainer_for(workload, device, args.precision)
    first = trainer.run(theta, 0, 0, args.steps, 0).pseudo_gradient.clone()
    first_state = state_moments(trainer.optimizer)
    result: dict[str, Any] = {
        "model": args.model, "parameters": theta.numel(), "device": device, "precision": args.precision,
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "rerun": judged(first, lease(workload, theta, device, args.precision, args.steps, 0)),
        "other_lease": judged(first, lease(workload, theta, device, args.precision, args.steps, args.steps)),
    }
    torch.use_deterministic_algorithms(True)
    try:
        det = lease(workload, theta, device, args.precision, args.steps, 0)
        result["rerun_deterministic"] = judged(det, lease(workload, theta, device, args.precision, args.steps, 0))
        result["deterministic_vs_default"] = judged(first, det)
    finally:
        torch.use_deterministic_algorithms(False)
    if device != "cpu" and args.cpu_reference:
        cpu = trainer_for(workload, "cpu", "fp32")
        result["vs_cpu_fp32"] = judged(cpu.run(theta, 0, 0, args.steps, 0).pseudo_gradient.clone(), first)
        # the lease's end inner state against a CPU verifier's fp32 re-run's (sets the bf16 state tolerance)
        gaps, problem = state_gap(state_moments(cpu.optimizer), first_state)
        result["vs_cpu_fp32_end_state"] = {**{k: v for k, v in gaps.items() if k != "residual"}, "problem": problem}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def emit(args: argparse.Namespace) -> None:
    """One lease on this process's CPU kernels, saved with the process's compute class (for ``--cross-cpu``): from a
    fresh state, and the next lease from the carried state in ``--start`` (the same bytes for every process); each
    with its end inner state."""
    workload = RandomTokens(args.model, args.batch_size, args.seq_len, batches=2 * args.steps)
    theta = flatten_params(workload.build_model(seed=0)).detach().clone()
    trainer = trainer_for(workload, "cpu", args.precision)
    update = trainer.run(theta, 0, 0, args.steps, 0).pseudo_gradient.clone()
    saved: dict[str, Any] = {"update": update, "class": compute_class("cpu"), "threads": torch.get_num_threads(),
                             "end_fresh": state_moments(trainer.optimizer)}
    if args.start:
        start = torch.load(args.start)
        carried = trainer_for(workload, "cpu", args.precision)
        load_inner_state(carried.optimizer, start["state"])
        saved["carried_update"] = carried.run(start["theta"], 0, args.steps, args.steps, args.steps).pseudo_gradient.clone()
        saved["end_carried"] = state_moments(carried.optimizer)
    torch.save(saved, args.emit)


def carried_start(args: argparse.Namespace, path: Path) -> None:
    """The carried state every process's second lease starts from: one lease trained here, θ moved by it."""
    workload = RandomTokens(args.model, args.batch_size, args.seq_len, batches=2 * args.steps)
    theta = flatten_params(workload.build_model(seed=0)).detach().clone()
    trainer = trainer_for(workload, "cpu", args.precision)
    update = trainer.run(theta, 0, 0, args.steps, 0).pseudo_gradient
    torch.save({"theta": theta - update, "state": b"".join(inner_state_chunks(trainer.optimizer) or [])}, path)


def residuals(codec: str, first: torch.Tensor, other: torch.Tensor) -> dict[str, Any]:
    """The error-feedback residual (what the upload drops) of the peer's lease (``first``) and of a verifier's re-run
    of it on other kernels (``other``, re-encoded with the peer's rotation as coordinator/rerun.py does)."""
    peer = coded(codec, first)
    ours, theirs = other - coded(codec, other, peer), first - peer
    gaps, _ = state_gap([], [], ours, theirs)
    scaled, _ = state_gap([], [], ours, theirs, residual_scale=float(other.norm()))
    return {"rel_error": gaps["residual"], "rel_to_upload": scaled["residual"], "norm": float(ours.norm()),
            "upload_norm": float(other.norm())}


CODECS = ("int8", "sgn15of16")


def coded(codec: str, update: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """``update`` as the coordinator sees it after the upload codec; with ``like`` (a decoded upload of a sign
    codec) re-encoded with that upload's rotation, as a cross-class verifier does (coordinator/rerun.py)."""
    from asyncloco.transport.codecs import decode, encode
    from asyncloco.transport.codecs_sign import rotation_in

    rotation = rotation_in(like, codec) if like is not None and codec.startswith("sgn") else None
    return decode(encode(codec, update, sign_rotation=rotation), update.numel())


def cross_cpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same lease in fresh processes on other CPU kernels and thread counts, each against the first."""
    rows: list[dict[str, Any]] = []
    first: torch.Tensor | None = None
    with tempfile.TemporaryDirectory() as scratch:
        start = Path(scratch) / "start.pt"
        carried_start(args, start)
        first_run: dict[str, Any] = {}
        for capability, threads in CROSS_CPU:
            out = Path(scratch) / f"{capability}-{threads}.pt"
            command = [sys.executable, __file__, "--model", args.model, "--precision", args.precision, "--steps",
                       str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                       "--threads", str(threads), "--emit", str(out), "--start", str(start)]
            subprocess.run(command, check=True, env={**os.environ, "ATEN_CPU_CAPABILITY": capability})
            got = torch.load(out)
            row: dict[str, Any] = {"capability": capability, "threads": threads, "class": got["class"]}
            if first is None:
                first = got["update"]
                first_run = got
                row["reference"] = True
            else:
                row.update(judged(first, got["update"]))
                # what the verifier compares: both sides through the run's codec (the peer's upload, the re-run)
                row["after_codec"] = {codec: judged(coded(codec, got["update"], coded(codec, first)), coded(codec, first))
                                      for codec in CODECS}
                # the end inner state (the re-run's against the peer's), from a fresh and from a carried start
                row["carried_update"] = judged(first_run["carried_update"], got["carried_update"])
                for key in ("end_fresh", "end_carried"):
                    gaps, problem = state_gap(got[key], first_run[key])
                    row[key.replace("end_", "end_state_")] = {**{k: v for k, v in gaps.items() if k != "residual"},
                                                              "problem": problem}
                row["residual_after_codec"] = {codec: residuals(codec, first_run["carried_update"], got["carried_update"])
                                               for codec in CODECS}
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="preset (tiny, 20m, 60m, 150m)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=10, help="inner steps per lease")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-cpu-reference", dest="cpu_reference", action="store_false",
                        help="skip the CPU fp32 run of the same lease (slow for the larger presets)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--cross-cpu", action="store_true", help="also run the lease on other CPU kernels / threads")
    parser.add_argument("--cross-cpu-only", action="store_true", help="--cross-cpu without the same-device comparisons")
    parser.add_argument("--emit", help=argparse.SUPPRESS)  # internal: one CPU lease into this file (--cross-cpu)
    parser.add_argument("--start", help=argparse.SUPPRESS)  # internal: the carried start state (--cross-cpu)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: tiny, 2 steps of 2 × 16 tokens, 1 thread (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.batch_size, args.seq_len, args.threads = "tiny", 2, 2, 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.emit:
        emit(args)
        return 0
    result = {k: getattr(args, k) for k in ("model", "precision", "steps", "batch_size", "seq_len")} | {
        "torch": torch.__version__, "device": "cpu"} if args.cross_cpu_only else measure(args)
    if args.cross_cpu or args.cross_cpu_only:
        result["cross_cpu"] = cross_cpu(args)
        for row in result["cross_cpu"]:
            if not row.get("reference"):
                print(f"{row['class']:>34} ×{row['threads']} thr: bitwise {row['bitwise']!s:5}  relative error "
                      f"{row['rel_error']:.3e}  cosine {row['cosine']:.8f}  after " + ", ".join(
                          f"{codec} {r['rel_error']:.3e}" for codec, r in row["after_codec"].items()))
                for key in ("end_state_fresh", "end_state_carried"):
                    g = row[key]
                    print(f"{'':>34}  {key}: m {g.get('m', float('nan')):.3e}  v {g.get('v', float('nan')):.3e}  "
                          f"u {g.get('u', float('nan')):.3e}  step size {g.get('precond', float('nan')):.3e}  {g['problem'] or ''}")
                print(f"{'':>34}  residual (carried lease): " + ", ".join(
                    f"{codec} {r['rel_error']:.3e} (of the upload's norm {r['rel_to_upload']:.3e})"
                    for codec, r in row["residual_after_codec"].items()))
    for key in ("rerun", "rerun_deterministic", "deterministic_vs_default", "other_lease", "vs_cpu_fp32"):
        if key in result:
            r = result[key]
            print(f"{key:>24}: bitwise {r['bitwise']!s:5}  relative error {r['rel_error']:.3e}  cosine {r['cosine']:.8f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
