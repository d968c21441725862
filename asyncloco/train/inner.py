"""The inner loop of one round (docs/algorithm.md §1), shared by simulated workers and real peers.

Start from θ(v0) exactly as received, run ``steps`` inner AdamW steps on the lease's batches with the
shard's learning-rate schedule, and return the pseudo-gradient g = θ_start − θ_end. The inner
optimizer state persists across rounds on the same trainer and is never sent (paper §10.1), unless
``runtime.verify.inner_state`` is ``reset``: then every lease starts from a fresh state, so the lease is a
deterministic function of θ_base, the shard's batches and the LR offset, which a verifier re-runs
(asyncloco/coordinator/verify.py).

On a GPU: ``precision="bf16"`` runs forward and loss under ``torch.autocast`` (bf16; weights, gradients
and the optimizer stay fp32), θ goes host → device and the pseudo-gradient device → host through
pinned buffers, the per-step loss stays on the device, and the per-step timing waits on the previous
step's CUDA event (asyncloco/train/device_io.py: the queue never drains). With a
:class:`~asyncloco.train.group.GroupContext` the trainer is one rank of a peer's torch.distributed
group: the model is wrapped in DDP (``parallel="ddp"``, every rank holds the whole model) or sharded with
FSDP2 (``parallel="fsdp"``, :func:`torch.distributed.fsdp.fully_shard`: each rank holds 1/N of the
parameters, gradients and AdamW state, for models that do not fit one device), θ comes from rank 0, each
step trains this rank's block of the global batch and the pseudo-gradient is reduced (DDP) or gathered
(FSDP) to rank 0 (:mod:`asyncloco.peer.distributed`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from asyncloco.algo.schedule import ShardSchedule
from asyncloco.models.workload import Workload, flatten_params, load_flat_params
from asyncloco.train.commitments import inner_state_digest
from asyncloco.train.device_io import StepClock, released

if TYPE_CHECKING:
    from asyncloco.config import RunConfig
    from asyncloco.train.group import GroupContext

__all__ = [
    "InnerTrainer", "RoundResult", "LeaseAborted", "build_inner_optimizer", "probe_speed", "PRECISIONS", "PARALLELS",
    "compute_class",
]

PRECISIONS = ("fp32", "bf16")
PARALLELS = ("ddp", "fsdp")

logger = logging.getLogger(__name__)

# what a compute class may not contain on the wire (transport/wire.py COMPUTE_CLASS_PATTERN: its complement, ≤ 96
# characters; tests/test_verify_commit.py checks that what this machine names passes it)
_NOT_IN_CLASS = re.compile(r"[^A-Za-z0-9 ._+/:()@-]")


def compute_class(device: "str | torch.device", ranks: int = 1) -> str:
    """The *compute class* of a device: what decides whether two runs of the same lease are bit-identical — torch's
    version, the device type and, on a GPU, its model and CUDA version; on a CPU, the vector instruction set torch's
    kernels dispatch to. Peers name theirs in each submission; a verifier of the same class compares bitwise, any
    other within ``runtime.verify.cross_device_tolerance`` (asyncloco/coordinator/rerun.py; docs/threat-model.md,
    "Which tolerance"). Measured: the same lease on the same GPU model and software is bit-identical, even in bf16
    (docs/gpu.md). ``ranks``: a DDP group of that many ranks (its own class)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        detail = f"{torch.cuda.get_device_name(index)} cuda {torch.version.cuda}"
    elif dev.type == "cpu":
        detail = str(torch.backends.cpu.get_cpu_capability())
    else:
        detail = ""
    text = f"{dev.type}/{detail}/torch {torch.__version__}"
    if ranks > 1:  # a DDP group sums its ranks' gradients in another order than one process: not bit-identical
        text = f"ddp{ranks}/{text}"
    return _NOT_IN_CLASS.sub("_", text)[:96]


class LeaseAborted(RuntimeError):
    """Training stopped before the lease's last step because ``should_stop`` said so."""

    def __init__(self, steps_done: int, steps: int) -> None:
        super().__init__(f"stopped after {steps_done} of {steps} steps")
        self.steps_done = steps_done
        self.steps = steps


@dataclass(frozen=True)
class RoundResult:
    pseudo_gradient: torch.Tensor
    steps: int
    mean_loss: float


def build_inner_optimizer(
    kind: str, params: list[torch.nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if kind == "adamw8bit":
        if not all(p.is_cuda for p in params):
            raise ValueError("inner.optimizer 'adamw8bit' (bitsandbytes) needs a CUDA device; use 'adamw' on CPU")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown inner optimizer {kind!r}; use 'adamw' or 'adamw8bit'")


class InnerTrainer:
    """One worker's model replica plus its persistent inner optimizer (one rank of a group, with ``group``)."""

    def __init__(
        self,
        workload: Workload,
        schedule: ShardSchedule,
        seed: int,
        optimizer: str = "adamw",
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
        device: str | torch.device = "cpu",
        precision: str = "fp32",
        group: Optional["GroupContext"] = None,
        parallel: str = "ddp",
        reset_state: bool = False,
        lease_warmup: int = 0,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown inner.precision {precision!r}; use one of {list(PRECISIONS)}")
        if parallel not in PARALLELS:
            raise ValueError(f"unknown inner.parallel {parallel!r}; use one of {list(PARALLELS)}")
        if parallel == "fsdp" and optimizer == "adamw8bit":
            raise ValueError(
                "inner.optimizer 'adamw8bit' does not combine with inner.parallel 'fsdp' (bitsandbytes' 8-bit state "
                "does not support FSDP's sharded DTensor parameters); use inner.optimizer 'adamw' with FSDP, or "
                "inner.parallel 'ddp' with 'adamw8bit'"
            )
        self.workload = workload
        self.schedule = schedule
        self.device = torch.device(device)
        self.precision = precision
        self.group = group
        self.seed = seed
        self.model = workload.build_model(seed).to(self.device)
        self.grad_clip = grad_clip
        # runtime.verify.inner_state "reset": every lease starts from a fresh inner optimizer state, so a verifier
        # re-runs it from θ_base and the data alone (coordinator/verify.py)
        self.reset_state = reset_state
        self.lease_warmup = lease_warmup  # with reset_state: LR × (j + 1) / lease_warmup on a lease's first steps
        # FSDP only means something on a group of 2 or more ranks; a single process trains the plain model
        self.sharded = group is not None and parallel == "fsdp"
        # named in each submission (verification's tolerance); a DDP group is a class of its own
        self.compute_class = compute_class(self.device, group.world_size if group is not None else 1)
        if self.sharded:
            _shard_model(self.model)  # before the optimizer: it must hold the sharded (DTensor) parameters
            assert group is not None
            local = sum(_local(p).numel() for p in self.model.parameters())
            logger.info("rank %d: FSDP2 holds %d of the model's %d parameters", group.rank, local, self.numel)
        self.optimizer = build_inner_optimizer(
            optimizer, list(self.model.parameters()), schedule.peak_lr, betas, weight_decay
        )
        self.forward_model: torch.nn.Module = self.model
        if group is not None and not self.sharded:
            from torch.nn.parallel import DistributedDataParallel

            # params are loaded from θ before every round, buffers are deterministic: no re-broadcast per step
            # (torch >= 2.13 names the option forward_sync_buffers; older versions broadcast_buffers)
            no_buffer_sync: dict[str, Any] = (
                {"forward_sync_buffers": False}
                if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                else {"broadcast_buffers": False}
            )
            self.forward_model = DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                gradient_as_bucket_view=True,
                **no_buffer_sync,
            )
        self._pinned: Optional[torch.Tensor] = None  # θ's way in (pinned host memory, reused every lease)
        self._pinned_out: Optional[torch.Tensor] = None  # the pseudo-gradient's way out (reused when released)

    @classmethod
    def from_config(
        cls,
        cfg: "RunConfig",
        workload: Workload,
        device: str | torch.device = "cpu",
        group: Optional["GroupContext"] = None,
    ) -> "InnerTrainer":
        """The trainer a run config describes (inner optimizer, schedule, clipping, precision, model seed)."""
        return cls(
            workload,
            cfg.inner.schedule(),
            seed=cfg.seed,
            optimizer=cfg.inner.optimizer,
            betas=cfg.inner.betas,
            weight_decay=cfg.inner.weight_decay,
            grad_clip=cfg.inner.grad_clip,
            device=device,
            precision=cfg.inner.precision,
            group=group,
            parallel=cfg.inner.parallel,
            reset_state=cfg.runtime.verify.inner_state == "reset",
            lease_warmup=cfg.runtime.verify.lease_warmup if cfg.runtime.verify.inner_state == "reset" else 0,
        )

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # a sharded DTensor counts its global size

    @property
    def fingerprint_model(self) -> torch.nn.Module:
        """The model as the coordinator builds it, for asyncloco/fingerprint.py. FSDP2 changes the sharded
        model's class (``FSDPLlamaForCausalLM``); then an unsharded copy is built on the meta device (no
        memory): same class, config, parameter names and shapes."""
        if not self.sharded:
            return self.model
        with torch.device("meta"):
            return self.workload.build_model(self.seed)

    def full_params(self) -> torch.Tensor:
        """θ of this trainer's model as one flat fp32 CPU vector. With FSDP every rank must call it (each
        parameter is all-gathered); only the leader needs the result."""
        if not self.sharded:
            return flatten_params(self.model).cpu()
        return torch.cat([_full(p).reshape(-1).to(torch.float32).cpu() for p in self.model.parameters()])

    # --------------------------------------------------------------------------------- helpers

    def _autocast(self) -> ContextManager[Any]:
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, batch: Any) -> Any:
        if self.device.type == "cpu":
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, (tuple, list)):
            return type(batch)(self._to_device(part) for part in batch)
        return batch

    def _theta_to_device(self, theta: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return theta
        if self._pinned is None or self._pinned.numel() != theta.numel():
            self._pinned = torch.empty(theta.numel(), dtype=torch.float32, pin_memory=True)
        self._pinned.copy_(theta)
        return self._pinned.to(self.device, non_blocking=True)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor
        host = self._pinned_out
        if host is None or host.numel() != tensor.numel() or not released(host):
            # pinning a fresh θ-sized buffer costs more than the copy itself (cudaHostAlloc of 605 MB at 150m):
            # a new one only while the caller still holds the last pseudo-gradient (encoding or uploading it)
            host = torch.empty(tensor.numel(), dtype=torch.float32, pin_memory=True)
            self._pinned_out = host
        host.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream(tensor.device).synchronize()
        return host.view(-1)  # a view: while the caller keeps it (or a view or array of it), the buffer is not reused

    def _stop_requested(self, should_stop: Callable[[], bool] | None) -> bool:
        """Every rank agrees: the leader's answer is broadcast (one tiny collective per step in a group)."""
        wanted = bool(should_stop()) if should_stop is not None else False
        if self.group is None:
            return wanted
        flag = torch.tensor([int(wanted)], dtype=torch.int64, device=self._collective_device())
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _collective_device(self) -> torch.device:
        return self.device if self.group is not None and self.group.backend == "nccl" else torch.device("cpu")

    def state_digest(self) -> Optional[str]:
        """The commitment to this trainer's inner optimizer state (:func:`inner_state_digest`); None when it cannot
        be committed to (8-bit or FSDP-sharded optimizer). A DDP group's ranks hold the same whole state (they apply
        the same averaged gradients; a reset goes to every rank, peer/distributed.py ``OP_RESET``): the leader's."""
        if self.sharded:
            return None
        return inner_state_digest(self.optimizer)

    def can_commit(self) -> bool:
        """Can this trainer's inner state be committed to (:meth:`state_digest` not None), without reading it?"""
        from asyncloco.train.commitments import committable

        return not self.sharded and committable(self.optimizer)

    def reset_inner_state(self) -> None:
        """Back to a fresh inner optimizer state (step 0, no moments): its digest is :data:`FRESH_STATE_DIGEST`."""
        self.optimizer.state.clear()

    # ------------------------------------------------------------------------------------ run

    def run(
        self,
        params: Optional[torch.Tensor],
        shard: int,
        start_offset: int,
        steps: int,
        lr_offset: int,
        on_step: Callable[[float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> RoundResult:
        """Train ``steps`` steps from θ = ``params`` and return θ_start − θ_end (fp32, on CPU).

        ``on_step(seconds)`` is called after every step with that step's duration (progress bars,
        emulated slow devices). ``should_stop()`` is asked after every step but the last; when it says
        yes the round ends with :class:`LeaseAborted`. In a group, followers pass ``params=None`` (θ comes
        from the leader), every rank gets the leader's ``should_stop`` answer, and only the leader's
        result is meaningful (the pseudo-gradient is reduced to it)."""
        if steps < 1:
            raise ValueError(f"a round needs at least one step, got {steps}")
        if params is None and (self.group is None or self.group.is_leader):
            raise ValueError("params (θ) are required, except on a follower rank of a group")
        if self.reset_state:
            self.optimizer.state.clear()  # a fresh AdamW state (step 0, zero moments), exactly as a new optimizer
        try:
            pseudo_gradient = self._load_sharded(params) if self.sharded else self._load(params)
            total = self._train_steps(shard, start_offset, steps, lr_offset, on_step, should_stop)
            return RoundResult(pseudo_gradient(), steps, self._mean_loss(total, steps))
        except (LeaseAborted, ValueError, TypeError):
            raise
        except (RuntimeError, dist.DistBackendError) as error:  # in a group: a collective failed, a rank is gone
            if self.group is None:
                raise
            from asyncloco.train.group import GroupFailed

            raise GroupFailed(f"training on the peer's group failed: {error}") from error

    def _load(self, params: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Load θ (rank 0's, broadcast in a group) into the whole model; returns what computes
        θ_start − θ_end on the host once the steps are done (under DDP: reduced to rank 0)."""
        group = self.group
        if params is None:
            theta_start = torch.empty(self.numel, dtype=torch.float32, device=self._collective_device())
        else:
            theta_start = self._theta_to_device(params.detach().to(torch.float32).cpu())
        if group is not None:
            theta_start = theta_start.to(self._collective_device())
            dist.broadcast(theta_start, src=0)
            theta_start = theta_start.to(self.device)
        load_flat_params(self.model, theta_start)

        def pseudo_gradient() -> torch.Tensor:
            delta = theta_start - flatten_params(self.model)
            if group is not None:
                # replicas are identical under DDP; the mean over ranks is the pseudo-gradient, reduced to rank 0
                reduced = delta.to(self._collective_device())
                dist.reduce(reduced, dst=0, op=dist.ReduceOp.SUM)
                delta = reduced.to(self.device) / group.world_size
            return self._to_host(delta)

        return pseudo_gradient

    def _load_sharded(self, params: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
        """FSDP: rank 0's θ is scattered parameter by parameter (each rank receives only its shard; nothing
        θ-sized lands on a device); returns what gathers each parameter's θ_start − θ_end (``full_tensor``)
        into the pseudo-gradient on the host once the steps are done."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        theta = params.detach().to(torch.float32).cpu() if params is not None else None
        if theta is not None and theta.numel() != self.numel:
            raise ValueError(f"flat parameter vector has {theta.numel()} values, model needs {self.numel}")
        starts: list[DTensor] = []
        offset = 0
        with torch.no_grad():
            for p in self.model.parameters():
                assert isinstance(p, DTensor)
                n = p.numel()
                full = (
                    theta[offset : offset + n].view(p.shape).to(self.device)
                    if theta is not None
                    else torch.empty(p.shape, dtype=torch.float32, device=self.device)  # ignored: rank 0 sends
                )
                start = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0)
                p.to_local().copy_(start.to_local())
                starts.append(start)
                offset += n

        def pseudo_gradient() -> torch.Tensor:
            with torch.no_grad():
                return torch.cat([
                    _full(start - p.detach()).reshape(-1).cpu() for start, p in zip(starts, self.model.parameters())
                ])

        return pseudo_gradient

    def _mean_loss(self, total: torch.Tensor, steps: int) -> float:
        """The round's mean loss; in a group the mean over ranks of their blocks' losses (reduced to rank 0)."""
        if self.group is not None:
            losses = total.reshape(1).to(self._collective_device())
            dist.reduce(losses, dst=0, op=dist.ReduceOp.SUM)
            total = losses[0] / self.group.world_size
        return float(total) / steps

    def _train_steps(
        self,
        shard: int,
        start_offset: int,
        steps: int,
        lr_offset: int,
        on_step: Callable[[float], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> torch.Tensor:
        """The lease's inner steps from the loaded θ; returns the sum of the step losses (fp64, on the device)."""
        group = self.group
        self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # as a Python float sum would
        clock = StepClock(on_step, self._fence() if self.device.type == "cuda" else None) if on_step is not None else None
        for j in range(steps):
            step_started = time.perf_counter()
            lr = self.schedule.lr(lr_offset + j)
            if self.lease_warmup > j:
                lr *= (j + 1) / self.lease_warmup
            for param_group in self.optimizer.param_groups:
                param_group["lr"] = lr
            batch = self.workload.batch(shard, start_offset + j)
            if group is not None:
                from asyncloco.train.group import split_batch

                batch = split_batch(batch, group.rank, group.world_size)
            batch = self._to_device(batch)
            with self._autocast():
                loss = self.workload.loss(self.forward_model, batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            total += loss.detach().double()
            if clock is not None:
                clock.step_done(step_started)
            if j + 1 < steps and self._stop_requested(should_stop):
                raise LeaseAborted(j + 1, steps)
        if clock is not None:
            clock.flush()
        return total

    def _fence(self) -> Callable[[], Any]:
        """A marker of the work queued so far on this device's current stream (StepClock's ``fence``)."""
        stream = torch.cuda.current_stream(self.device)

        def fence() -> Any:
            event = torch.cuda.Event()
            event.record(stream)
            return event

        return fence


def _shard_model(model: torch.nn.Module) -> None:
    """FSDP2 in place: every block of every ``nn.ModuleList`` (a transformer's layers) is its own shard
    group, gathered only around its own forward and backward; the rest (embeddings, tied head, final norm)
    is the root group."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block)
    fully_shard(model)


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def probe_speed(
    cfg: "RunConfig",
    workload: Workload,
    device: str | torch.device,
    group: Optional["GroupContext"] = None,
    steps: int = 3,
) -> float:
    """Throughput (tokens or samples per second of the global batch) from a few real steps of a throwaway
    replica, so the real inner optimizer state is untouched. In a group every rank calls it together."""
    probe = InnerTrainer.from_config(cfg, workload, device=device, group=group)
    full = probe.full_params()  # collective under FSDP: every rank gathers, the leader keeps it
    theta = full if group is None or group.is_leader else None
    probe.run(theta, 0, 0, 1, 0)  # warm-up (allocations, kernels)
    started = time.perf_counter()
    probe.run(theta, 0, 0, steps, 0)
    return steps * workload.units_per_step / (time.perf_counter() - started)
