"""One command that runs every CUDA path of asyncloco on a GPU machine and writes what it saw (docs/gpu.md).

    python scripts/gpu_check.py --out /tmp/out --wheels .whl-gpu      # a CUDA machine: ≤ 9 min in all
    python scripts/gpu_check.py --out runs/gpu-check-tiny --tiny       # CPU, tiny model, short runs (~2 min)

Parts, each under its own time limit, the JSON rewritten after each, so a part that fails or runs out of
time leaves the others' results (its own "status" says "failed" or "timeout" and why):

1. ``install`` — with ``--wheels DIR``: ``pip install --no-index --no-deps --target`` of the wheels that
   scripts/gpu_wheels.sh downloaded (hivemind, pydantic, datasets, cryptography, bitsandbytes, ...), for
   this process and every process it starts;
2. ``tests`` — ``pytest -m gpu tests/test_gpu.py``: a peer on ``--device cuda`` against a coordinator on the
   CPU that evaluates on CUDA, bf16 autocast, pinned copies, 8-bit AdamW training the 20m preset, evaluation
   on CUDA, one-GPU NCCL groups under DDP and FSDP (all skipped, with the reason, without CUDA);
3. ``verify`` — scripts/verify_tolerance.py: the same lease run twice on the device (as verified work re-runs
   it), in bf16 and fp32, with and without deterministic algorithms, against an honest different lease and
   against the CPU's fp32 run: the figures behind ``runtime.verify.tolerance`` for GPU peers;
4. ``bench`` — scripts/bench_peer.py (the peer's inner loop vs a plain transformers + torch loop on the same
   batches, leases of H = 50 steps) for 20m, 60m and 150m in bf16: tokens/s, their ratio, what the inner-state
   commitments add to a lease (``--commitments``), and model FLOPs utilisation computed here
   from the parameter count (6 N + 12 L·d_attn·T FLOPs per token, N without the input-embedding lookup)
   and the GPU's dense bf16 peak (``--peak-tflops``, or known from the device's name);
5. ``run`` — the paper's claim in the real runtime: a coordinator and 4 peer processes on this machine (the
   GPU shared, peers slowed ×1, ×1.5, ×2, ×4 as in ``asyncloco demo``), the 20m preset on the embedded
   corpus (the presets' sign-coded uploads, leases sized to the link, and ``runtime.verify.serial_probation``:
   the verifier re-runs on the GPU the peers share), Async DN + DyLU and then sync DiLoCo for the same wall
   time each: validation perplexity against time, updates applied, each peer's idle fraction; perplexity at
   equal wall time and the time DN + DyLU takes to reach sync DiLoCo's final perplexity.

``--out DIR`` receives four files: ``gpu_check.json``, ``gpu_check.log``, ``perplexity.png`` and
``logs.tar.gz`` (every process's log, pytest's junit XML, bench_peer's JSON); working files stay in
``--work`` (default: a temporary directory). ``--tiny`` runs the same parts on the CPU with the ``tiny``
preset and short durations, so that tests/test_gpu_check.py keeps the script working between GPU loans.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1
METHODS = ("async_dn_dylu", "sync_diloco")  # asyncloco/coordinator/methods.py
STOP_RESERVE = 25.0  # seconds of a real run's limit kept for its peers and coordinator to stop
WANTED_PACKAGES = ("torch", "transformers", "tokenizers", "hivemind", "bitsandbytes", "pydantic", "datasets",
                   "cryptography", "numpy", "msgpack")
# dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0),
                    ("L40S", 362.1), ("L4", 121.0), ("A10", 125.0))

logger = logging.getLogger("gpu_check")


# ---------------------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    """What each part runs and how long it may take (seconds)."""

    tiny: bool
    device: str
    precision: str
    bench_models: list[str]
    bench_args: list[str]
    bench_limit: float
    tests_limit: float
    verify_runs: dict[str, list[str]]  # name -> scripts/verify_tolerance.py arguments
    run_sizes: list[str]
    slowdowns: list[float]
    run_seconds: float
    run_overhead: float  # start-up (coordinator, peers joining) + stop, per run
    threads: int
    task: dict[str, Any] = field(default_factory=dict)
    schedule: dict[str, Any] = field(default_factory=dict)
    inner: dict[str, Any] = field(default_factory=dict)
    eval_every: int = 4
    # evaluations after the start a run waits for past its planned seconds (up to its limit): a loaded machine can
    # apply its first updates late, and one evaluation says nothing about whether the run trained
    min_evals: int = 2
    eval_device: str = "cpu"  # the coordinator's runtime.eval_device in the real runs (evaluations, gate probe)
    methods: tuple[str, ...] = METHODS  # the real runs' schedule.method, each for the same wall time
    sets: dict[str, Any] = field(default_factory=dict)  # --set KEY.PATH=VALUE on every real run's config


def make_plan(args: argparse.Namespace) -> Plan:
    cores = os.cpu_count() or 1
    if args.tiny:
        plan = Plan(
            tiny=True, device="cpu", precision="fp32", bench_models=["tiny"],
            bench_args=["--batch-size", "4", "--seq-len", "32", "--steps", "3", "--repeats", "3", "--warmup", "1",
                        "--threads", "1", "--commitments"],
            bench_limit=60.0, tests_limit=90.0,
            verify_runs={"tiny-cpu-fp32": ["--model", "tiny", "--device", "cpu", "--steps", "5", "--threads", "1"]},
            run_sizes=["tiny"], slowdowns=[1.0, 2.0], run_seconds=10.0,
            run_overhead=80.0, threads=1,  # start-up under load: a suite run beside another test took 45 s
            task={"seq_len": 64, "batch_size": 8, "num_shards": 2, "val_sequences": 16, "max_train_sequences": 2000},
            schedule={"max_local_steps": 10, "min_steps": 1, "grace_period": 0.5},
            inner={"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 5},
            eval_every=2,
        )
    else:
        plan = Plan(
            tiny=False, device="cuda", precision="bf16", bench_models=["20m", "60m", "150m"],
            # the paper's sequence length; batch 64 x 256 = 16k tokens per step; leases of the paper's H = 50 steps
            bench_args=["--batch-size", "64", "--seq-len", "256", "--steps", "50", "--repeats", "3", "--warmup", "1",
                        "--untimed", "--commitments"],
            bench_limit=90.0, tests_limit=180.0,
            # the 20m preset as peers run it (bf16), with the CPU fp32 run of the same lease; and in fp32
            verify_runs={
                "20m-cuda-bf16": ["--model", "20m", "--device", "cuda", "--precision", "bf16", "--steps", "10",
                                  "--batch-size", "8", "--seq-len", "256"],
                "20m-cuda-fp32": ["--model", "20m", "--device", "cuda", "--precision", "fp32", "--steps", "10",
                                  "--batch-size", "8", "--seq-len", "256", "--no-cpu-reference"],
            },
            run_sizes=["20m"], slowdowns=[1.0, 1.5, 2.0, 4.0],
            run_seconds=90.0, run_overhead=75.0, threads=max(1, min(4, cores // 5)),
            task={"seq_len": 256, "batch_size": 32, "num_shards": 4, "val_sequences": 64},
            # H = 50 as in the paper; leases sized to the link as the presets do (configs/lm-*.yaml)
            schedule={"max_local_steps": 50, "min_steps": 5, "grace_period": 1.0, "local_steps": "auto",
                      "transfer_cover": 1.3},
            inner={"lr": 1.0e-3, "min_lr": 1.0e-4, "warmup_steps": 50, "precision": "bf16"},
            eval_every=4,
        )
    if args.bench_models:
        plan.bench_models = args.bench_models.split(",")
    if args.sets:
        from asyncloco.overrides import parse_sets

        plan.sets = parse_sets(args.sets)
    if args.sizes:
        plan.run_sizes = args.sizes.split(",")
    if args.slowdowns:
        plan.slowdowns = [float(s) for s in args.slowdowns.split(",")]
    if args.run_seconds is not None:
        plan.run_seconds = args.run_seconds
    if args.device:
        plan.device = args.device
    if args.methods:
        plan.methods = tuple(args.methods.split(","))
    plan.eval_device = args.eval_device or ("cpu" if plan.tiny else plan.device)
    return plan


# ----------------------------------------------------------------------------------------- recording


class Report:
    """The JSON document, rewritten to disk after every change (a killed run keeps what was done)."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, data
        self.save()

    def part(self, name: str) -> dict[str, Any]:
        part: dict[str, Any] = self.data["parts"].setdefault(name, {})
        return part

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str, allow_nan=True))
        os.replace(tmp, self.path)


class PartTimeout(Exception):
    pass


def run_part(report: Report, name: str, limit: float, body: Callable[[dict[str, Any], float], None]) -> None:
    """Run one part with a deadline: ``body(part, deadline)`` fills ``part``; failures are recorded, not raised."""
    part = report.part(name)
    part.update({"status": "running", "limit_s": round(limit, 1)})
    report.save()
    started = time.monotonic()
    logger.info("== part %s (limit %.0f s)", name, limit)
    try:
        body(part, started + limit)
        part["status"] = part.get("status") if part.get("status") not in (None, "running") else "ok"
    except PartTimeout as error:
        part.update({"status": "timeout", "error": str(error)})
        logger.error("part %s ran out of time: %s", name, error)
    except Exception as error:  # a part's failure must not lose the other parts
        part.update({"status": "failed", "error": f"{type(error).__name__}: {error}"})
        logger.exception("part %s failed", name)
    part["seconds"] = round(time.monotonic() - started, 1)
    logger.info("== part %s: %s in %.0f s", name, part["status"], part["seconds"])
    report.save()


def run_command(command: list[str], log: Path, deadline: float, env: Optional[dict[str, str]] = None) -> int:
    """Run ``command`` with its output in ``log``; kill its whole process group at the deadline."""
    with log.open("ab") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO, env=env or os.environ.copy(), start_new_session=True)
        try:
            return process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise PartTimeout(f"{' '.join(command[:4])} ... killed at its limit; see {log.name}") from None


# -------------------------------------------------------------------------------------- environment


def package_versions() -> dict[str, Optional[str]]:
    from importlib import metadata

    versions: dict[str, Optional[str]] = {}
    for name in WANTED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": package_versions(),
    }
    if torch.cuda.is_available():
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_multiprocessors"] = props.multi_processor_count
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            info["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                                                 "--format=csv,noheader"], capture_output=True, text=True,
                                                timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as error:
            info["nvidia_smi"] = f"failed: {error}"
    return info


def install_wheels(part: dict[str, Any], deadline: float, wheels: Path, site: Path, work: Path) -> None:
    """pip-install the carried wheels into ``site`` and put it on this process's and its children's path."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise FileNotFoundError(f"no wheels in {wheels}; run `bash scripts/gpu_wheels.sh` first (docs/gpu.md)")
    part["wheels"] = [w.name for w in found]
    missing_before = [name for name, version in package_versions().items() if version is None]
    part["missing_before"] = missing_before
    site.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, found)]
    rc = run_command(command, work / "pip-install.log", deadline)
    if rc != 0:
        raise RuntimeError(f"pip install exited with {rc}; see pip-install.log")
    p2pd = site / "hivemind" / "hivemind_cli" / "p2pd"
    if p2pd.is_file():
        p2pd.chmod(0o755)
    add_to_path(site)
    import importlib

    importlib.invalidate_caches()
    part["missing_after"] = [name for name, version in package_versions().items() if version is None]


def add_to_path(directory: Path) -> None:
    sys.path.insert(0, str(directory))
    parts = [str(directory)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


# -------------------------------------------------------------------------------------------- tests


def run_tests(part: dict[str, Any], deadline: float, work: Path) -> None:
    junit = work / "junit-gpu.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-rA", "--timeout=100"]  # a hung test fails alone; the others still run
    part["command"] = " ".join(command[1:])
    rc = run_command(command, work / "pytest-gpu.log", deadline)
    part["exit_code"] = rc
    part.update(parse_junit(junit))
    if rc not in (0, 5) or part.get("failed", 0) or part.get("errors", 0):
        part["status"] = "failed"


def parse_junit(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"tests": [], "passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "")[:500]
        tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message})
    counts = {key: sum(1 for t in tests if t["outcome"] == key) for key in ("passed", "failed", "skipped", "errors")}
    return {"tests": tests, **counts}


# -------------------------------------------------------------------------------------------- bench


def peak_tflops(override: Optional[float]) -> tuple[Optional[float], str]:
    if override is not None:
        return override, "--peak-tflops"
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU: no peak to compare with"
    name = torch.cuda.get_device_name(0)
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value, f"dense bf16 peak of {key} (datasheet)"
    return None, f"unknown peak for {name!r}: pass --peak-tflops"


def flops_per_token(model: str, vocab: int, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token: 6 × (parameters that multiply) + 12 × layers × attention width × sequence."""
    import torch

    from asyncloco.models.presets import build_causal_lm, get_preset

    with torch.device("meta"):
        lm = build_causal_lm(model, vocab_size=vocab, seq_len=seq_len)
    parameters = sum(p.numel() for p in lm.parameters())
    shape = get_preset(model)
    lookup = 0 if shape.tie_embeddings else vocab * shape.hidden_size  # the untied input table is a gather
    attention = 12 * shape.num_layers * shape.num_heads * shape.head_dim * seq_len
    return {"parameters": parameters, "matmul_parameters": parameters - lookup,
            "flops_per_token": 6 * (parameters - lookup) + attention}


def run_bench(part: dict[str, Any], deadline: float, plan: Plan, work: Path, report: Report,
              peak_override: Optional[float]) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_peer  # scripts/bench_peer.py, helper D's: imported for its vocabulary, run as a subprocess

    peak, peak_source = peak_tflops(peak_override)
    part.update({"peak_tflops": peak, "peak_source": peak_source, "args": plan.bench_args, "results": {}})
    models = plan.bench_models
    for index, model in enumerate(models):
        left = deadline - time.monotonic()
        limit = min(plan.bench_limit, left / (len(models) - index))
        entry: dict[str, Any] = {"status": "running"}
        part["results"][model] = entry
        if limit < 5:
            entry["status"] = "skipped: no time left"
            continue
        out = work / f"bench-{model}.json"
        command = [sys.executable, "scripts/bench_peer.py", "--model", model, "--device", plan.device,
                   "--precision", plan.precision, *plan.bench_args, "--json", str(out)]
        entry["command"] = " ".join(["python", *command[1:]])
        try:
            rc = run_command(command, work / f"bench-{model}.log", time.monotonic() + limit)
        except PartTimeout as error:
            entry.update({"status": "timeout", "error": str(error)})
            report.save()
            continue
        if rc != 0 or not out.is_file():
            entry.update({"status": "failed", "error": f"exit code {rc}; see bench-{model}.log"})
            report.save()
            continue
        result = json.loads(out.read_text())
        entry.update(result)
        flops = flops_per_token(model, bench_peer.vocab_for(model), int(result["seq_len"]))
        entry.update(flops)
        for loop in ("peer", "plain"):
            achieved = entry[f"{loop}_tokens_per_s"] * flops["flops_per_token"]
            entry[f"{loop}_tflops"] = achieved / 1e12
            entry[f"{loop}_mfu"] = achieved / (peak * 1e12) if peak else None
        entry["status"] = "ok"
        logger.info("bench %s: peer %.0f tok/s, plain %.0f tok/s, ratio %.3f (without the per-step callback: %s), "
                    "MFU %s", model, entry["peer_tokens_per_s"], entry["plain_tokens_per_s"], entry["ratio"],
                    f"{entry['untimed_ratio']:.3f}" if entry.get("untimed_ratio") is not None else "not timed",
                    f"{entry['peer_mfu']:.3f}" if entry["peer_mfu"] is not None else "n/a")
        if entry.get("commit_path_s") is not None:
            logger.info("bench %s: the inner-state commitments add %.3f s a lease on the training's path (%.3f s with "
                        "the hash), %.1f %% of a lease", model, entry["commit_path_s"], entry["commit_s"],
                        100 * entry["commit_lease_fraction"])
        report.save()
    if any(e.get("status") != "ok" for e in part["results"].values()):
        part["status"] = "partial" if any(e.get("status") == "ok" for e in part["results"].values()) else "failed"


# ---------------------------------------------------------------------------------------- verify tolerance


def run_verify(part: dict[str, Any], deadline: float, plan: Plan, work: Path, report: Report) -> None:
    """scripts/verify_tolerance.py per variant: how exactly an honest re-run of a lease reproduces it."""
    part["results"] = {}
    for name, arguments in plan.verify_runs.items():
        out = work / f"verify-{name}.json"
        command = [sys.executable, "scripts/verify_tolerance.py", *arguments, "--json", str(out)]
        entry: dict[str, Any] = {"command": " ".join(["python", *command[1:]])}
        part["results"][name] = entry
        try:
            rc = run_command(command, work / f"verify-{name}.log", deadline)
        except PartTimeout as error:
            entry.update({"status": "timeout", "error": str(error)})
            report.save()
            break
        if rc != 0 or not out.is_file():
            entry.update({"status": "failed", "error": f"exit code {rc}; see verify-{name}.log"})
        else:
            entry.update({"status": "ok", **json.loads(out.read_text())})
            logger.info("verify %s: re-run bitwise %s, relative error %.3g", name, entry["rerun"]["bitwise"],
                        entry["rerun"]["rel_error"])
        report.save()
    if any(e.get("status") != "ok" for e in part["results"].values()):
        part["status"] = "failed"


# ---------------------------------------------------------------------------------------- real runs


def run_config(plan: Plan, size: str, method: str, work: Path) -> Path:
    import yaml

    peers = len(plan.slowdowns)
    config: dict[str, Any] = {
        "name": f"gpu-check-{size}-{method}",
        "seed": 0,
        "task": {"kind": "lm", "model": size, "source": "embedded", **plan.task},
        "inner": {"optimizer": "adamw", "weight_decay": 0.1, "grad_clip": 1.0, "total_steps_per_shard": 100_000,
                  **plan.inner},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": peers, "activation": 0.0},
        "schedule": {"method": method, **plan.schedule},
        "sim": {"workers": peers},
        "runtime": {
            "run_id": f"gpu-check-{size}-{method.replace('_', '-')}-{os.getpid()}",
            # the presets' upload codec (configs/lm-*.yaml): signs with error feedback, 33× fewer bytes than fp32
            "codec": "sgn15of16",
            "error_feedback": True,
            "error_feedback_decay": 0.5,
            "eval_every": plan.eval_every,
            "speed_report_period": 2.0,
            "lease_timeout_factor": 3.0,
            "lease_slack": 20.0,
            "eval_device": plan.eval_device,
        },
    }
    if not plan.tiny:
        # the verifier re-runs on the GPU the peers share, slower than they train: without this a newcomer's held
        # probation updates reached θ four at a time, 11-22 versions stale, and the 60m/150m runs diverged (docs/gpu.md)
        config["runtime"]["verify"] = {"serial_probation": True}
    if plan.sets:
        from asyncloco.config import apply_overrides

        apply_overrides(config, plan.sets, "gpu_check's run config (--set)")
    path = work / f"{size}-{method}" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def one_run(plan: Plan, size: str, method: str, work: Path, duration: float, deadline: float,
            result: dict[str, Any], save: Callable[[], None]) -> None:
    """A coordinator and one peer per slowdown; ``duration`` seconds of training once every peer has joined."""
    from asyncloco.local_cluster import LocalCluster

    config = run_config(plan, size, method, work)
    names = [f"peer{i}" for i in range(len(plan.slowdowns))]
    slowdowns = dict(zip(names, plan.slowdowns))
    result.update({"status": "running", "method": method, "duration_s": round(duration, 1), "slowdowns": slowdowns})
    save()
    cluster = LocalCluster(config, work / f"{size}-{method}" / "cluster", threads=plan.threads)
    launched = time.monotonic()
    try:
        cluster.start_coordinator(timeout=max(5.0, min(120.0, deadline - time.monotonic())))
        extra = ("--device", plan.device)
        for name in names:
            cluster.start_peer(name, slowdown=slowdowns[name], extra=extra)

        def joined() -> bool:
            for name, process in cluster.peers.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with {process.returncode} before joining; see {name}.log")
            return all(cluster.peer_summary(name).get("peer_id") for name in names)

        cluster.wait_for(joined, max(5.0, min(180.0, deadline - time.monotonic() - duration)), "every peer to join")
        started = time.time()
        result["startup_s"] = round(time.monotonic() - launched, 1)
        result["updates_before_start"] = cluster.status().get("version", 0)  # by the peers that joined first
        logger.info("%s %s: %d peers joined after %.0f s; training %.0f s", size, method, len(names),
                    result["startup_s"], duration)
        end = time.monotonic() + duration
        # past ``end`` only while fewer than plan.min_evals evaluations followed the start, leaving time to stop
        latest = max(end, deadline - STOP_RESERVE)
        while True:
            now = time.monotonic()
            if now >= latest or (now >= end and _evals_after(cluster.status(), started) >= plan.min_evals):
                break
            for name, process in cluster.peers.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited early ({process.returncode}); see {name}.log")
            time.sleep(min(2.0 if now < end else 0.5, max(0.05, (end if now < end else latest) - now)))  # poll interval
        trained = round(time.time() - started, 2)
        result["trained_s"] = trained
        at_stop = cluster.status()
    finally:
        for process in cluster.peers.values():  # all at once: each finishes its step and leaves
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
        stop_deadline = max(time.monotonic() + 20.0, deadline)
        for process in cluster.peers.values():
            try:  # one SIGTERM only: a second one would make the peer drop its lease and leave at once
                process.wait(timeout=max(1.0, stop_deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("peer %d still running at the part's limit; killing it", process.pid)
            cluster.stop(process, timeout=1.0)  # SIGKILLs what is left of its process group (p2pd)
        if cluster.coordinator is not None:
            cluster.stop_coordinator(timeout=max(5.0, stop_deadline - time.monotonic()))
        cluster.close()
    status = cluster.status()
    peers = {name: cluster.peer_summary(name) for name in names}
    by_id = {summary.get("peer_id"): name for name, summary in peers.items()}
    evals = [e for e in status.get("evals", []) if round(e["time"] - started, 2) <= trained]
    result["evals"] = [{"t": round(e["time"] - started, 2), "version": e["version"],
                        "local_updates": e.get("local_updates"), "loss": e.get("loss"),
                        "perplexity": e.get("perplexity")} for e in evals]
    result["updates_applied"] = at_stop.get("version", 0)  # at the end of the equal wall time
    result["local_updates"] = at_stop.get("local_updates", 0)
    result["updates_applied_total"] = status.get("version", 0)  # including the leases finished while stopping
    result["submit_timing"] = status.get("submit_timing")  # the coordinator's seconds per submission, by stage
    result["verification"] = status.get("verification")  # checks passed/failed with the defaults (verification on)
    result["rejections"] = status.get("rejections")  # updates the gate refused
    result["traffic"] = status.get("traffic")  # bytes each way: compressed downloads and uploads
    result["peers"] = {}
    for peer_id, stats in status.get("peers", {}).items():
        name = by_id.get(peer_id, peer_id[-8:])
        summary = peers.get(name, {})
        result["peers"][name] = {
            "slowdown": slowdowns.get(name), "device": stats.get("device"), "speed": stats.get("speed"),
            "leases": stats.get("leases"), "steps_assigned": stats.get("steps_assigned"),
            "applied": stats.get("applied"), "expired": stats.get("expired"),
            "idle_fraction": summary.get("idle_fraction"), "timing_s": summary.get("timing"),
            "rounds": summary.get("rounds"),
        }
    perplexities = [e["perplexity"] for e in result["evals"] if e["perplexity"] is not None]
    result["first_perplexity"] = perplexities[0] if perplexities else None
    result["final_perplexity"] = perplexities[-1] if perplexities else None
    result["status"] = "ok" if perplexities else "failed"
    if not perplexities:
        result["error"] = "no evaluation within the run's wall time"


def _evals_after(status: dict[str, Any], started: float) -> int:
    return sum(1 for e in status.get("evals", []) if e["time"] > started and e.get("perplexity") is not None)


def _last_by(run: dict[str, Any], wall: float) -> Optional[dict[str, Any]]:
    """The run's last evaluation at or before ``wall`` seconds of training."""
    return next((e for e in reversed(run["evals"]) if e["t"] <= wall and e["perplexity"] is not None), None)


def compare(methods: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Perplexity at equal wall time (the shorter run's), and when Async DN + DyLU first reached sync DiLoCo's
    perplexity at that time."""
    dn, sync = methods.get("async_dn_dylu", {}), methods.get("sync_diloco", {})
    if dn.get("status") != "ok" or sync.get("status") != "ok":
        return {"status": "incomplete: both runs are needed"}
    wall = min(dn["trained_s"], sync["trained_s"])
    dn_last, sync_last = _last_by(dn, wall), _last_by(sync, wall)
    if dn_last is None or sync_last is None:
        return {"status": f"incomplete: a run has no evaluation within the common {wall:.1f} s"}
    target = sync_last["perplexity"]
    sync_time = sync_last["t"]
    reached = next((e["t"] for e in dn["evals"] if e["perplexity"] is not None and e["perplexity"] <= target), None)
    return {
        "status": "ok",
        "wall_time_s": wall,
        "perplexity_dn_dylu": dn_last["perplexity"],
        "perplexity_sync": target,
        "perplexity_ratio_dn_over_sync": dn_last["perplexity"] / target,
        "sync_final_eval_s": sync_time,
        "dn_dylu_time_to_sync_final_s": reached,
        "speedup_to_sync_final": (sync_time / reached) if reached else None,
        "updates_applied": {"async_dn_dylu": dn["updates_applied"], "sync_diloco": sync["updates_applied"]},
        "mean_idle_fraction": {
            name: _mean([p["idle_fraction"] for p in run["peers"].values() if p.get("idle_fraction") is not None])
            for name, run in (("async_dn_dylu", dn), ("sync_diloco", sync))
        },
    }


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def run_real(part: dict[str, Any], deadline: float, plan: Plan, work: Path, report: Report) -> None:
    part.update({"sizes": {}, "peers": len(plan.slowdowns), "slowdowns": plan.slowdowns, "device": plan.device,
                 "corpus": "embedded", "task": plan.task, "schedule": plan.schedule, "inner": plan.inner})
    runs = [(size, method) for size in plan.run_sizes for method in plan.methods]
    # one duration for both methods of a size (the comparison is at equal wall time), fitted to the time left
    left = deadline - time.monotonic()
    duration = min(plan.run_seconds, left / len(runs) - plan.run_overhead)
    if duration < 5:
        raise PartTimeout(f"{left:.0f} s left for {len(runs)} runs: not enough for {plan.run_overhead:.0f} s of "
                          "start-up and stop each plus training")
    part["duration_s"] = round(duration, 1)
    for size in plan.run_sizes:
        entry = part["sizes"].setdefault(size, {"methods": {}})
        for method in plan.methods:
            result: dict[str, Any] = {}
            entry["methods"][method] = result
            run_deadline = time.monotonic() + duration + plan.run_overhead
            try:
                one_run(plan, size, method, work, duration, min(deadline, run_deadline), result, report.save)
            except Exception as error:
                result.update({"status": "failed", "error": f"{type(error).__name__}: {error}"})
                logger.exception("run %s %s failed", size, method)
            report.save()
        entry["comparison"] = compare(entry["methods"])
        report.save()
    statuses = [m.get("status") for s in part["sizes"].values() for m in s["methods"].values()]
    if any(s != "ok" for s in statuses):
        part["status"] = "partial" if "ok" in statuses else "failed"


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = data["parts"].get("run", {}).get("sizes", {})
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"async_dn_dylu": "Async DN + DyLU", "sync_diloco": "sync DiLoCo"}
    for size, entry in sizes.items():
        for method, run in entry.get("methods", {}).items():
            points = [(e["t"], e["perplexity"]) for e in run.get("evals", []) if e.get("perplexity") is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", ms=3, label=f"{size}: {labels.get(method, method)}")
    device = data.get("environment", {}).get("gpu") or "CPU"
    ax.set_title(f"gpu_check ({'tiny, ' if data.get('mode') == 'tiny' else ''}{device}): validation perplexity")
    ax.set_xlabel("wall-clock time since every peer joined (s)")
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no evaluation recorded (see gpu_check.json)", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for gpu_check.json, .log, perplexity.png, logs.tar.gz")
    parser.add_argument("--work", help="working directory (processes' files; default: a temporary one, removed)")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny preset, short runs: the suite's smoke mode")
    parser.add_argument("--wheels", help="install the wheels in this directory first (scripts/gpu_wheels.sh)")
    parser.add_argument("--site", default="/tmp/asyncloco-gpu-site", help="where --wheels are installed")
    parser.add_argument("--budget", type=float, help="seconds for everything (default 520 on a GPU, 300 with --tiny)")
    parser.add_argument("--parts", default="tests,verify,bench,run",
                        help="comma-separated subset of tests,verify,bench,run")
    parser.add_argument("--bench-models", help="presets for bench_peer (default 20m,60m,150m; tiny with --tiny)")
    parser.add_argument("--sizes", help="presets for the real runs (default 20m; e.g. 20m,60m with more time)")
    parser.add_argument("--slowdowns", help="one peer per factor (default 1,1.5,2,4; 1,2 with --tiny)")
    parser.add_argument("--methods", help="the real runs' methods (default async_dn_dylu,sync_diloco: the comparison "
                        "at equal wall time; async_dn_dylu alone: the defaults' utilisation and checks)")
    parser.add_argument("--run-seconds", type=float, help="training seconds per method (default 90; 10 with --tiny)")
    parser.add_argument("--device", help="peers' and bench's device (default cuda; cpu with --tiny)")
    parser.add_argument("--eval-device", help="the real runs' coordinator runtime.eval_device (default: --device; cpu "
                        "with --tiny)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a key of every real run's config (repeatable), e.g. --set "
                        "runtime.verify.inner_state=reset")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU (default: by name)")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - {"tests", "verify", "bench", "run"}
    if unknown:
        parser.error(f"--parts: unknown part(s) {sorted(unknown)}; choose from tests, verify, bench, run")
    if args.methods and set(args.methods.split(",")) - set(METHODS):
        parser.error(f"--methods: unknown method(s) {sorted(set(args.methods.split(',')) - set(METHODS))}; "
                     f"choose from {', '.join(METHODS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    budget = args.budget if args.budget is not None else (300.0 if args.tiny else 520.0)
    deadline = began + budget
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(out / "gpu_check.log", "w")])
    add_to_path(REPO)  # the checkout's asyncloco for every process started here, installed or not
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    plan = make_plan(args)
    report = Report(out / "gpu_check.json", {
        "schema": SCHEMA, "mode": "tiny" if plan.tiny else "gpu",
        "command": " ".join(["python", "scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "budget_s": budget, "parts": {},
    })
    try:
        if args.wheels:
            run_part(report, "install", min(120.0, deadline - time.monotonic()),
                     lambda part, until: install_wheels(part, until, Path(args.wheels).resolve(), Path(args.site), work))
        report.data["environment"] = environment()
        report.data["plan"] = {k: v for k, v in vars(plan).items()}
        report.save()
        if not plan.tiny and not report.data["environment"]["cuda_available"]:
            logger.warning("no CUDA device is visible: the GPU parts will fail; use --tiny for the CPU smoke mode")
        parts = args.parts.split(",")
        if "tests" in parts:
            limit = min(plan.tests_limit, deadline - time.monotonic())
            run_part(report, "tests", limit, lambda part, until: run_tests(part, until, work))
        if "verify" in parts:
            run_part(report, "verify", min(90.0, deadline - time.monotonic()),
                     lambda part, until: run_verify(part, until, plan, work, report))
        if "bench" in parts:
            # leave the real runs their share: two runs' start-up and at least 45 s of training each (a shorter
            # comparison says little at 20m; the --tiny runs train 10 s)
            reserve = 2 * len(plan.run_sizes) * (plan.run_overhead + min(plan.run_seconds, 45.0)) if "run" in parts else 0
            limit = min(plan.bench_limit * len(plan.bench_models), deadline - time.monotonic() - reserve)
            run_part(report, "bench", max(limit, 1.0),
                     lambda part, until: run_bench(part, until, plan, work, report, args.peak_tflops))
        if "run" in parts:
            run_part(report, "run", deadline - time.monotonic(), lambda part, until: run_real(part, until, plan, work, report))
    finally:
        report.data["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        report.data["elapsed_s"] = round(time.monotonic() - began, 1)
        report.data["ok"] = all(p.get("status") == "ok" for p in report.data["parts"].values())
        report.save()
        try:
            plot(report.data, out / "perplexity.png")
        except Exception:
            logger.exception("the plot failed")
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            for path in sorted(work.rglob("*")):
                if path.is_file() and path.suffix in (".log", ".json", ".xml", ".yaml", ".jsonl"):
                    tar.add(path, arcname=str(path.relative_to(work)))
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
        logger.info("wrote %s (%s)", out / "gpu_check.json", "every part ok" if report.data["ok"] else
                    ", ".join(f"{k}: {v.get('status')}" for k, v in report.data["parts"].items()))
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
