"""A peer bigger than one device: a torch.distributed group (torchrun) that acts as one peer.

``torchrun --nproc-per-node N -m asyncloco peer join ...`` (or ``asyncloco peer join --nproc-per-node N``,
which launches torchrun) starts N ranks. Only rank 0, the *leader*, joins the DHT and talks to the
coordinator: one peer id, one lease at a time, one speed report for the whole group. The other ranks,
*followers*, run :func:`follow`: they receive the run config, then loop on commands from the leader.

One lease on the group (:meth:`asyncloco.train.inner.InnerTrainer.run` with a group):

1. the leader broadcasts the lease (:class:`Command`, a small int64 tensor — nothing is pickled) and θ;
2. every rank trains the lease's steps under DDP (``inner.parallel: ddp``, the default) or FSDP2
   (``inner.parallel: fsdp``: parameters, gradients and AdamW state sharded across the ranks, θ scattered
   per parameter); step ``j``'s batch is the lease's global batch ``j`` split into N equal row blocks
   (rank ``r`` takes block ``r``), so the gradient average is the gradient of the same global batch a
   single process would train on;
3. the pseudo-gradient (identical on every rank under DDP) is reduced to the leader, or under FSDP
   gathered parameter by parameter; the leader encodes and submits it.

Backend: gloo on CPU, NCCL on CUDA (rank ``r`` uses ``cuda:LOCAL_RANK``). A rank that dies breaks the
group's next collective; every rank then fails with :class:`GroupFailed`, the leader leaves the run and
the coordinator gives the lease's steps back (at its deadline, or when the peer is seen gone).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from asyncloco.train.group import GroupContext, GroupFailed

__all__ = [
    "leave_group",
    "Command",
    "OP_RESET",
    "OP_STOP",
    "OP_TRAIN",
    "OP_MEASURE",
    "init_group",
    "validate_device",
    "broadcast_json",
    "broadcast_command",
    "follow",
    "GROUP_TIMEOUT",
    "LEADER_PIDFILE_ENV",
    "launch_torchrun",
    "torchrun_command",
    "write_leader_pidfile",
]

logger = logging.getLogger(__name__)

# Followers wait in a broadcast for the leader's next command while it waits for a lease (grace holds,
# a coordinator restart): the collective timeout must cover that. A dead rank is noticed at once anyway
# (its connections close), the timeout only bounds a rank that hangs.
GROUP_TIMEOUT = timedelta(hours=1)
LEADER_PIDFILE_ENV = "ASYNCLOCO_LEADER_PIDFILE"  # set by `asyncloco peer join --nproc-per-node` (signals)

OP_STOP, OP_TRAIN, OP_MEASURE, OP_RESET = 0, 1, 2, 3  # OP_RESET: back to a fresh inner state (the leader's chain)


@dataclass(frozen=True)
class Command:
    """What the leader asks the group to do next (broadcast as 5 int64 values)."""

    op: int
    shard: int = 0
    start_offset: int = 0
    steps: int = 0
    lr_offset: int = 0

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.op, self.shard, self.start_offset, self.steps, self.lr_offset], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "Command":
        op, shard, start_offset, steps, lr_offset = (int(x) for x in tensor.tolist())
        return cls(op, shard, start_offset, steps, lr_offset)


def validate_device(device: str, nproc_per_node: int = 1) -> torch.device:
    """Check ``--device`` before anything slow; raise ``ValueError`` saying what to use instead."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device {device!r} is not a torch device ({error}); use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ValueError(f"--device {device!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + (" (a CPU-only build)" if torch.version.cuda is None else "")
        raise ValueError(
            f"--device {device}: no CUDA device is visible to {build}; use --device cpu, or install a CUDA "
            "build of torch on a machine with an NVIDIA GPU and driver"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    if nproc_per_node > count:
        raise ValueError(
            f"--nproc-per-node {nproc_per_node} with --device cuda needs one GPU per rank; this machine has {count}"
        )
    return parsed


def init_group(device: str) -> Optional[GroupContext]:
    """Join the torch.distributed group torchrun set up (``WORLD_SIZE`` > 1), or None for a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    requested = torch.device(device)
    if requested.type == "cuda":
        resolved = torch.device("cuda", local_rank)
        torch.cuda.set_device(resolved)
        backend = "nccl"
    else:
        resolved = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=GROUP_TIMEOUT)
    logger.info("rank %d of %d (%s on %s)", rank, world_size, backend, resolved)
    return GroupContext(rank, world_size, local_rank, backend, resolved)


def _collective_device(group: GroupContext) -> torch.device:
    return group.device if group.backend == "nccl" else torch.device("cpu")


def broadcast_command(group: GroupContext, command: Optional[Command]) -> Command:
    """The leader passes its command, followers None; everyone returns the leader's command."""
    tensor = (command.to_tensor() if command is not None else torch.zeros(5, dtype=torch.int64)).to(
        _collective_device(group)
    )
    try:
        dist.broadcast(tensor, src=0)
    except (RuntimeError, dist.DistBackendError) as error:
        raise GroupFailed(f"the peer's group broke while waiting for a command: {error}") from error
    return Command.from_tensor(tensor.cpu())


def broadcast_json(group: GroupContext, value: Optional[Any]) -> Any:
    """Send a JSON-able value from the leader to every rank (length, then UTF-8 bytes)."""
    device = _collective_device(group)
    payload = json.dumps(value).encode() if group.is_leader else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    try:
        dist.broadcast(length, src=0)
        size = int(length.item())
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
            if group.is_leader
            else torch.empty(size, dtype=torch.uint8, device=device)
        )
        if size:
            dist.broadcast(data, src=0)
    except (RuntimeError, dist.DistBackendError) as error:
        raise GroupFailed(f"the peer's group broke during a broadcast: {error}") from error
    return json.loads(bytes(data.cpu().tolist()).decode()) if size else None


def follow(group: GroupContext, device: str, release: bool = True) -> int:
    """A follower rank's whole life: receive the run config, build the trainer, execute commands until
    the leader says stop. Returns a process exit code (0: the leader stopped the group). ``release``:
    leave the process group on return (False: the caller follows another run on the same group)."""
    try:
        return _follow(group)
    except GroupFailed as error:
        logger.error("rank %d: %s; leaving (the leader's lease is given back by the coordinator)", group.rank, error)
        return 1
    finally:
        if release:
            leave_group()  # the trainer went with _follow's frame


def _follow(group: GroupContext) -> int:
    from asyncloco.config import RunConfig
    from asyncloco.train.inner import InnerTrainer, LeaseAborted, probe_speed
    from asyncloco.workloads import build_workload

    raw = broadcast_json(group, None)
    if raw is None:
        logger.info("rank %d: the leader left before the run started", group.rank)
        return 0
    cfg = RunConfig.model_validate(raw)
    workload = build_workload(cfg)
    trainer = InnerTrainer.from_config(cfg, workload, device=group.device, group=group)
    while True:
        command = broadcast_command(group, None)
        if command.op == OP_STOP:
            logger.info("rank %d: the leader stopped the group", group.rank)
            return 0
        if command.op == OP_MEASURE:
            probe_speed(cfg, workload, group.device, group=group)
        elif command.op == OP_RESET:  # every rank holds the same AdamW state under DDP: reset with the leader's
            trainer.reset_inner_state()
        elif command.op == OP_TRAIN:
            try:
                trainer.run(None, command.shard, command.start_offset, command.steps, command.lr_offset)
            except LeaseAborted as aborted:  # the leader is leaving at once; its stop command follows
                logger.info("rank %d: lease stopped after %d of %d steps", group.rank, aborted.steps_done, aborted.steps)
        else:
            raise GroupFailed(f"unknown command {command}")


def leave_group() -> None:
    """Leave the process group, after a garbage collection: a DDP reducer (in a reference cycle of the trainer's
    modules) must free its reference to the group while the group is alive. One freed after
    ``destroy_process_group`` aborted a rank at exit ("terminate called without an active exception") and hung a
    one-rank test in the group's destructor."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ launcher


def torchrun_command(nproc_per_node: int, argv: list[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node N -m asyncloco <argv without --nproc-per-node>``."""
    rest: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--nproc-per-node":
            skip = True
            continue
        if token.startswith("--nproc-per-node="):
            continue
        rest.append(token)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
            "-m", "asyncloco", *rest]


def write_leader_pidfile() -> None:
    """Rank 0 tells the launcher where to send Ctrl+C (see :func:`launch_torchrun`)."""
    path = os.environ.get(LEADER_PIDFILE_ENV)
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(tmp, path)


def _own_group_dying_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    os.setpgid(0, 0)  # its own process group: a terminal's Ctrl+C reaches only the launcher
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launch_torchrun(nproc_per_node: int, argv: list[str], threads: Optional[int] = None) -> int:
    """Run this ``peer join`` as a torchrun group and wait for it; returns its exit code.

    torchrun answers SIGINT/SIGTERM by terminating every rank, which would drop the lease in flight. So
    torchrun runs in its own process group (a terminal's Ctrl+C reaches only this launcher) and dies
    with it, and this launcher forwards the first and second Ctrl+C/SIGTERM to rank 0 as SIGINT (finish
    and submit the lease, then leave; leave at once), a third to torchrun."""
    import tempfile

    command = torchrun_command(nproc_per_node, argv)
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    with tempfile.TemporaryDirectory(prefix="asyncloco-group-") as tmp:
        pidfile = os.path.join(tmp, "leader.pid")
        env[LEADER_PIDFILE_ENV] = pidfile
        logger.info("starting a %d-rank group: %s", nproc_per_node, " ".join(command))
        process = subprocess.Popen(command, env=env, preexec_fn=_own_group_dying_with_parent)
        signals = 0

        def forward(signum: int, frame: Any) -> None:
            nonlocal signals
            signals += 1
            leader: Optional[int] = None
            try:
                with open(pidfile) as handle:
                    leader = int(handle.read().strip())
            except (OSError, ValueError):
                pass
            try:
                if leader is not None and signals <= 2:
                    os.kill(leader, signal.SIGINT)
                else:
                    os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return process.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if process.poll() is None:
                with_suppressed_lookup(lambda: os.killpg(process.pid, signal.SIGTERM))
                try:
                    process.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    with_suppressed_lookup(lambda: os.killpg(process.pid, signal.SIGKILL))
                    process.wait()


def with_suppressed_lookup(action: Any) -> None:
    try:
        action()
    except ProcessLookupError:
        pass
