"""One typed config tree, loaded from YAML (``configs/*.yaml``).

Unknown keys are errors, cross-field rules fail at load time with a message that says how to fix
them. Sections:

* ``task``      — what is trained: the toy Gaussian-mixture classifier or a language model;
* ``inner``     — the peers' inner AdamW and the per-shard LR schedule (paper Eq. 3);
* ``outer``     — the coordinator's outer optimizer hyper-parameters (the *method* picks which);
* ``schedule``  — DyLU (H, min steps), grace period, default method;
* ``sim``       — the fake-time simulator: worker speeds, budget, evaluation cadence, methods to compare;
* ``runtime``   — the networked coordinator and peers (leases, checkpoints, codec, ports).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from asyncloco.algo.schedule import ShardSchedule
from asyncloco.config_base import StrictModel
from asyncloco.models.config import LMTaskConfig, ToyTaskConfig  # pydantic only: no torch/transformers

# The schedule.method / sim.methods names a config may use. The methods themselves (coordinator/methods.py) live a
# layer above the config and assert at import that their registry is exactly this set, so the two cannot drift and
# the config never imports the coordinator.
METHOD_NAMES: tuple[str, ...] = (
    "sync_diloco", "async_diloco", "async_dn", "async_dn_dylu", "async_diloco_dylu", "async_buffer", "poly",
    "poly_thres", "delay_comp", "elasticdl_lr", "asynclm", "async_sgd", "async_sgd_momentum", "async_adam",
)  # fmt: skip
BARRIER_METHODS: frozenset[str] = frozenset({"sync_diloco"})  # the methods that hold every lease to a round's end

__all__ = [
    "METHOD_NAMES",
    "BARRIER_METHODS",
    "InnerConfig",
    "OuterConfig",
    "ScheduleConfig",
    "SimConfig",
    "RuntimeConfig",
    "RunConfig",
    "load_config",
    "HETEROGENEITY_PROFILES",
    "worker_seconds_per_step",
]

# Seconds per local step of each worker for the paper's heterogeneity levels (Table 1). The paper does
# not print them; "very" is the reference notebook's 4 devices, the others spread the same mean
# speed less. For k != 4 workers the profile is interpolated geometrically between its extremes.
HETEROGENEITY_PROFILES: dict[str, tuple[float, ...]] = {
    "none": (1.0, 1.0, 1.0, 1.0),
    "slight": (0.9, 1.0, 1.1, 1.25),
    "moderate": (0.7, 0.9, 1.4, 2.0),
    "very": (0.58, 0.75, 1.51, 3.33),
}


def worker_seconds_per_step(profile: str | list[float], workers: int) -> list[float]:
    """Seconds per step of each of ``workers`` workers for a named profile or an explicit list."""
    if isinstance(profile, list):
        if len(profile) != workers:
            raise ValueError(f"sim.profile lists {len(profile)} speeds but sim.workers is {workers}")
        return [float(x) for x in profile]
    base = HETEROGENEITY_PROFILES[profile]
    if workers == len(base):
        return list(base)
    if workers == 1:
        return [base[0]]
    lo, hi = base[0], base[-1]
    return [lo * (hi / lo) ** (i / (workers - 1)) for i in range(workers)]


TaskConfig = Annotated[Union[ToyTaskConfig, LMTaskConfig], Field(discriminator="kind")]


class InnerConfig(StrictModel):
    """Inner AdamW on the peers, and the per-shard schedule of paper Eq. 3."""

    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    lr: float = Field(2e-4, gt=0)
    min_lr: float = Field(2e-5, gt=0, description="η_min > 0 so shards past T still learn (paper §3)")
    warmup_steps: int = Field(0, ge=0)
    total_steps_per_shard: int = Field(10_000, ge=1, description="T in Eq. 3, per shard")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(None, gt=0)
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forward and loss under torch.autocast (bf16) on the peer's device; weights stay fp32"
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="inside a multi-rank peer (--nproc-per-node): ddp replicates the model on every rank, fsdp "
        "shards parameters, gradients and AdamW state across the ranks (FSDP2) for models that do not fit one device",
    )

    def schedule(self) -> ShardSchedule:
        """The per-shard learning-rate schedule of paper Eq. 3."""
        return ShardSchedule(self.lr, self.min_lr, self.warmup_steps, self.total_steps_per_shard)

    @model_validator(mode="after")
    def _check(self) -> "InnerConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"inner.min_lr ({self.min_lr}) must be <= inner.lr ({self.lr})")
        if self.total_steps_per_shard <= self.warmup_steps:
            raise ValueError("inner.total_steps_per_shard must exceed inner.warmup_steps")
        if self.parallel == "fsdp" and self.optimizer == "adamw8bit":
            raise ValueError(
                "inner.optimizer 'adamw8bit' does not combine with inner.parallel 'fsdp' (bitsandbytes' 8-bit state "
                "does not support FSDP's sharded parameters); use inner.optimizer 'adamw' with fsdp"
            )
        return self


class OuterConfig(StrictModel):
    """Hyper-parameters of the coordinator's outer optimizers (which one runs is the *method*)."""

    lr: float = Field(0.7, gt=0, description="ε: the sync-DiLoCo outer lr (DN uses it unchanged)")
    momentum: float = Field(0.9, ge=0, lt=1)
    long_lease_momentum: Literal["scaled", "fixed"] = Field(
        "scaled", description="scaled: an update of h > schedule.max_local_steps (H) local steps — a lease sized by "
        "local_steps auto — decays the outer momentum by β^(h/H), not β (its memory kept in local steps); fixed: β per "
        "update whatever its length (docs/algorithm.md)"
    )
    buffer_size: int | None = Field(None, ge=1, description="N for DN / Async Buffer; default: number of workers")
    warmup_arrivals: int = Field(
        0, ge=0, description="outer-lr warm-up (not in the paper): ε × min(1, a/W) for the a-th applied update, W this "
        "many; 0: off. Damps a cold start whose first momentum steps meet long, stale leases (docs/wan.md)"
    )
    activation: float = Field(0.0, ge=0, description="DN momentum activation c in [0, 1/N]")
    sgd_lr: float | None = Field(None, gt=0, description="outer lr of plain SGD; default: lr / (1 + momentum)")
    adam_lr: float = Field(1e-3, gt=0)
    poly_exponent: float = Field(0.5, ge=0)
    poly_max_staleness: int = Field(10, ge=0)
    delay_compensation: float = Field(1.0, ge=0, description="λ of delay compensation")
    aalr_threshold: float = Field(2.0, gt=0, description="τ_thresh of AsyncLM's lr regulator")
    aalr_window: int = Field(16, ge=1)
    max_staleness: int | None = Field(None, ge=0, description="reject updates staler than this (runtime)")


class ScheduleConfig(StrictModel):
    method: str = "async_dn_dylu"
    max_local_steps: int = Field(20, ge=1, description="H: local steps of the fastest peer")
    min_steps: int = Field(1, ge=1, description="DyLU floor for slow peers")
    grace_period: float = Field(0.5, ge=0, description="seconds (fake seconds in the simulator)")
    speed_ema: float = Field(0.5, ge=0, lt=1, description="smoothing of reported throughputs")
    local_steps: Literal["fixed", "auto"] = Field(
        "fixed", description="fixed: the method's steps (DyLU's, up to max_local_steps); auto: at least enough that a "
        "peer's compute covers its transfers, H = min(max_auto_steps, max(H_dylu, ceil(transfer_cover × (t_up + 1.5 × "
        "t_down) / t_step))) from its measured link: the previous upload and the next lease's ask-ahead lead (docs/algorithm.md)"
    )
    transfer_cover: float = Field(1.0, gt=0, le=100, description="local_steps auto: k, compute time ≥ k × transfer time")
    max_auto_steps: int | None = Field(
        None, ge=1, description="local_steps auto: H_max, the most steps a lease gets (None: 10 × max_local_steps)"
    )
    eager_start: float | Literal["outer_lr"] = Field(
        "outer_lr", description="s of the eager start: a lease granted while the peer's previous update is on its way "
        "starts from θ − s × that update as the coordinator decodes it; outer_lr (the default): outer.lr, the step the "
        "update will take; a number in [0, 2]; 0: off (algo/eager.py, docs/algorithm.md)"
    )

    def eager_share(self, outer_lr: float) -> float:
        """``eager_start`` as a number (``outer_lr`` resolved)."""
        return float(outer_lr) if self.eager_start == "outer_lr" else float(self.eager_start)

    @property
    def auto_steps_cap(self) -> int:
        """H_max of ``local_steps: auto``."""
        return self.max_auto_steps if self.max_auto_steps is not None else 10 * self.max_local_steps

    @model_validator(mode="after")
    def _check(self) -> "ScheduleConfig":
        if self.max_auto_steps is not None and self.max_auto_steps < self.max_local_steps:
            raise ValueError(f"schedule.max_auto_steps ({self.max_auto_steps}) must be >= schedule.max_local_steps "
                             f"({self.max_local_steps}): auto only lengthens leases")
        if not isinstance(self.eager_start, str) and not 0.0 <= self.eager_start <= 2.0:
            raise ValueError(f"schedule.eager_start ({self.eager_start}) must be outer_lr or a number in [0, 2] (0: off)")
        if self.min_steps > self.max_local_steps:
            raise ValueError(
                f"schedule.min_steps ({self.min_steps}) must be <= schedule.max_local_steps ({self.max_local_steps})"
            )
        if self.method not in METHOD_NAMES:
            raise ValueError(f"unknown schedule.method {self.method!r}; choose one of {sorted(METHOD_NAMES)}")
        return self


class SimConfig(StrictModel):
    workers: int = Field(4, ge=1)
    profile: Union[Literal["none", "slight", "moderate", "very"], list[float]] = "very"
    total_local_updates: int = Field(4_000, ge=1, description="stop once the applied updates sum to this")
    eval_every: int = Field(200, ge=1, description="evaluate every this many applied local updates")
    pretrain_steps: int = Field(
        0, ge=0, description="plain AdamW steps before Local-SGD starts (the paper fine-tunes a pretrained model)"
    )
    pretrain_lr: float | None = Field(None, gt=0, description="peak lr of the pretraining phase; default inner.lr")
    reach_budget_factor: float = Field(
        2.0, ge=1.0, description="methods chase sync DiLoCo's final loss for at most this × the budget"
    )
    methods: list[str] = Field(
        default_factory=lambda: ["sync_diloco", "async_diloco", "async_dn", "async_dn_dylu", "async_buffer", "poly"]
    )
    seed: int = 0
    checks: bool = Field(
        False, description="model verification's held checks: a lease runtime.verify chooses (probation, its fraction) has "
        "its update held until one verifier has re-run it (rerun_seconds_per_step × its steps, one check at a time), then "
        "applied; off: nothing is held (the paper's setting)",
    )
    overlap: bool = Field(
        False, description="runtime.overlap's order with instantaneous transfers: a worker asks for its next lease before "
        "its update is submitted (so it starts from θ without its own last update), and DN's N counts two updates per "
        "worker on the way, as a real overlapped run's; off: the paper's serial rounds",
    )
    upload_s: float = Field(
        0.0, ge=0, description="with sim.overlap: simulated seconds from a lease's end to its update's arrival (its "
        "upload; the next lease trains meanwhile, from θ without it), as a slow link's peer sees it; 0: instantaneous",
    )
    ask_ahead_s: float = Field(
        0.0, ge=0, description="with sim.upload_s: a worker asks for its next lease (and takes its θ) this many simulated "
        "seconds before its lease in training ends, once its previous update is in (peer/pipeline.py's asking ahead, "
        "which a slow download link needs: the next lease starts from a θ that old); 0: it asks as its upload starts",
    )
    rerun_seconds_per_step: float | None = Field(
        None, gt=0, description="the verifier's seconds per local step when sim.checks is on; default the fastest worker's"
    )

    @field_validator("profile")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, list) and not all(isinstance(x, (int, float)) and x > 0 and math.isfinite(x) for x in value):
            raise ValueError("sim.profile speeds are seconds per step and must be positive")
        return value

    @model_validator(mode="after")
    def _check(self) -> "SimConfig":
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown:
            raise ValueError(f"unknown sim.methods {unknown}; choose from {sorted(METHOD_NAMES)}")
        worker_seconds_per_step(self.profile, self.workers)  # raises on a length mismatch
        if self.upload_s > 0 and not self.overlap:
            raise ValueError("sim.upload_s needs sim.overlap: true (in serial rounds a worker waits for its upload; "
                             "set sim.overlap: true, or sim.upload_s: 0)")
        if self.ask_ahead_s > 0 and not self.upload_s > 0:
            raise ValueError("sim.ask_ahead_s models a slow link's asking ahead and needs sim.upload_s > 0; set both, or "
                             "sim.ask_ahead_s: 0")
        return self


class GateConfig(StrictModel):
    """The robust update gate (coordinator/gate.py, docs/threat-model.md): on by default in real runs."""

    enabled: bool = True
    clip_factor: float = Field(4.0, ge=1, description="clip per-step norms above this × the recent median")
    reject_factor: float = Field(20.0, ge=1, description="reject per-step norms above this × the recent median")
    cosine_mads: float = Field(6.0, gt=0, description="reject directions this many MADs below the recent cosines")
    cosine_cap: float = Field(0.05, le=1, description="never demand a higher cosine with the consensus than this")
    flip_margin: float = Field(0.25, ge=0, description="never accept a cosine below −this × the recent median")
    echo_cosine: float = Field(0.95, gt=0, le=1, description="refuse (counted) an update agreeing with the consensus "
                               "at least this closely, unless the recent median does too: an echo of others' work")
    reference_share: float = Field(0.5, gt=0, le=1, description="the most of the consensus one peer's updates may hold "
                                   "while other peers are present (then they join it at a quarter of the weight)")
    window: int = Field(32, ge=3, description="accepted updates the statistics look back over")
    warmup: int = Field(6, ge=1, description="accepted updates before the direction and clip checks start")
    probation_updates: int = Field(3, ge=0, description="a new peer's first accepted updates are judged more strictly")
    quarantine_after: int = Field(3, ge=1, description="rejections among the last quarantine_window that quarantine a peer")
    quarantine_window: int = Field(6, ge=1)
    quarantine_s: float = Field(600.0, gt=0, description="first quarantine's length; doubles each time")
    # --- the probe (coordinator/probe.py): loss on a fixed held-out batch at θ and θ − Δ decides the gray zone
    probe: bool = Field(True, description="evaluate the probe-batch loss to decide gray-zone updates")
    probe_sequences: int = Field(16, ge=1, description="rows of the probe batch (the last held-out rows)")
    probe_step: float = Field(0.2, gt=0, le=1, description="the probe evaluates the loss at θ − probe_step × Δ")
    probe_margin: float = Field(
        0.0005, ge=0, description="a gray-zone update raising the probe loss by more (relative; × √(steps ÷ max_local_steps) for a shorter lease) is rejected, lowering it by more accepted"
    )
    probe_below: float = Field(0.5, ge=0, description="gray zone: cosine below this × the median of recent cosines, or probation")
    probe_all_below_params: int = Field(
        25_000_000, ge=0, description="models up to this size probe every update; larger ones a peer's probation updates only"
    )
    probe_max_params: int = Field(
        50_000_000, ge=0, description="no probe above this size (it runs under the coordinator's lock; raise it with a GPU eval_device)"
    )

    @model_validator(mode="after")
    def _check(self) -> "GateConfig":
        if self.clip_factor > self.reject_factor:
            raise ValueError("runtime.gate.clip_factor must be <= runtime.gate.reject_factor")
        if self.quarantine_window < self.quarantine_after:
            raise ValueError("runtime.gate.quarantine_window must be >= runtime.gate.quarantine_after")
        return self


# runtime.verify.cross_device_tolerance / _min_cosine when not set (docs/threat-model.md, "Which tolerance"): (max
# relative L2 error, min cosine) of a lease from another compute class than the verifier's, by (inner.precision,
# whether the upload codec *selects* what it keeps: the sign codecs, topk, grp). Measured at 20m, 30 steps, on other
# CPU kernels, after the codec: fp32 8.8e-4 (int8) / 5.2e-3 (sgn15of16); bf16 0.046 / 0.15 (a bf16 GPU lease vs the
# CPU's fp32 run, before the codec: 0.05-0.06); an honest different lease 1.4
CROSS_DEVICE_BOUNDS: dict[tuple[str, bool], tuple[float, float]] = {
    ("fp32", False): (0.01, 0.9999), ("fp32", True): (0.03, 0.9995),
    ("bf16", False): (0.1, 0.99), ("bf16", True): (0.4, 0.9),
}
SELECTING_CODECS = ("sgn", "topk", "grp")  # codecs whose kept positions a last-bit difference can move
# the end inner state's bound by inner.precision (runtime.verify.cross_device_state_tolerance). Measured on
# other CPU kernels (docs/results/verify-tolerance-end-state-cross-cpu-20m-fp32-2026-11-27.json, 20m, 20 steps): m and v
# ≤ 7e-5, the AdamW step m̂/(√v̂+eps) ≤ 3.8e-4, its step size (RMS log-ratio) ≤ 6.4e-4 (a lease from a fresh state; from
# a carried one ≤ 4.6e-5); fp32 allows 15× the largest, as the update's 0.01 allows 11× its own. bf16 (a GPU peer, a
# CPU verifier in fp32), measured on an H200 (docs/results/gpu/h200-2026-11-28-a.json, verify, 20m, 10 steps from a
# fresh state): m 0.026, v 0.036, the AdamW step 0.057, its size 0.087; 0.2 allows 2.3× the largest
CROSS_DEVICE_STATE_TOLERANCE: dict[str, float] = {"fp32": 0.01, "bf16": 0.2}


class VerifyConfig(StrictModel):
    """Verification of the work itself (coordinator/verify.py, docs/threat-model.md): the coordinator re-runs a
    sample of leases and expels a peer whose pseudo-gradient differs from the re-run."""

    enabled: bool = Field(True, description="re-run a sample of leases and expel peers whose work does not reproduce")
    inner_state: Literal["carry", "reset"] = Field(
        "carry", description="reset: fresh inner AdamW state every lease (a re-run needs only θ_base + data); verification needs it"
    )
    # a proven peer's leases are drawn independently (a peer that sees which were checked learns nothing about the next
    # one, and waiting out a decaying rate buys nothing): one that tampers with every lease from some point on is caught
    # within k of them with probability 1 − (1 − fraction)^k — 0.95 within 5 at 0.45. Re-runs cost ≈ fraction +
    # probation_updates / (leases per peer) of the training compute (docs/threat-model.md, "Sleepers")
    fraction: float = Field(0.45, ge=0, le=1, description="share of a proven peer's leases re-run (HMAC of the lease id; "
                            "caught within k tampered leases with probability 1 − (1 − fraction)^k)")
    probation_updates: int = Field(2, ge=0, description="a peer's first N leases are all re-run (probation)")
    suspect_fraction: float = Field(0.5, ge=0, le=1, description="share re-run for a peer the gate refused recently")
    # a sleeper (honest through probation, then a hidden direction in every update) shows as a persistent residual:
    # coordinator/sketch.py scores each update by the cosine of its residual against the consensus with the peer's
    # previous one. Off by default: in the demo honest peers score 0.1-0.97 too (the carried AdamW state and DyLU's
    # per-peer lease lengths give each honest peer a persistent residual of its own; docs/threat-model.md, "Sleepers")
    sketch_threshold: float = Field(
        1.0, ge=0, le=1, description="a peer whose consecutive updates share a residual direction beyond this cosine "
        "becomes a suspect: its next sketch_checks leases are all re-run (1: never, the default)"
    )
    sketch_checks: int = Field(2, ge=0, description="leases re-run after a peer's sketch score passed sketch_threshold")
    # 0 by default: in the simulator holding drawn checks cost 661-863 vs 173-187 perplexity with a verifier as fast as
    # the fastest peer (the held update of the fastest peer misses every lockstep round); in the demo 94/110 vs 89/111
    # (docs/threat-model.md, "Checked work waits for its verdict"; results/sim-held-checks-decomposition-2026-11-29.json)
    hold_backlog: int = Field(
        0, ge=0, description="a drawn check holds its update until its verdict only while fewer checks than this await "
        "theirs; otherwise the update is applied at once and checked later (a failed check repairs θ). 0, the default: "
        "drawn checks are applied first; probation and suspects' checks are always held"
    )
    # off by default: a peer kept waiting for its own verdict is denied leases a replay without its submissions would
    # give it, so θ no longer equals that replay bitwise (tests/test_verify_runtime.py); on the home150 profile each
    # newcomer waited once, 16-19 s (docs/results/wan-home150-held-untrusted-2026-11-30.json)
    serial_probation: bool = Field(
        False, description="a peer whose probation or suspect update is held for its verdict gets no further lease until "
        "that verdict (at most two of its updates wait at once). For a verifier slower than the peers (one sharing "
        "their GPU): without it a newcomer's held updates reached θ four at a time, 11-22 versions stale, and 60m/150m "
        "runs diverged (docs/gpu.md)"
    )
    # the updates of one peer that reach θ at one verdict (its last probation check's and those that waited for it)
    # were each trained without the others in θ: parallel work, combined as synchronous DiLoCo combines workers
    average_released: bool = Field(
        True, description="a peer's held updates released together at one verdict (its probation's last and those that "
        "waited for it) each take 1/k of an outer step, moving θ by their mean; false: k full steps (the simulator's "
        "cold-start spike twice as high, docs/threat-model.md)"
    )
    tolerance: float = Field(
        0.0, ge=0, description="max relative L2 error ‖Δ_sub − Δ_rerun‖/‖Δ_rerun‖ for a peer of the verifier's own compute "
        "class (0: bitwise, which the same class reproduces; other classes: cross_device_tolerance)"
    )
    min_cosine: float = Field(-1.0, ge=-1, le=1, description="also require this cosine with the re-run (with a tolerance > 0)")
    # a peer that names another compute class than the verifier's (train/inner.py compute_class: device, GPU model or
    # CPU instruction set, torch version) cannot be re-run bitwise. Measured (docs/threat-model.md, "Which
    # tolerance"): a bf16 GPU lease re-run in fp32 on a CPU is 0.05-0.06 away, an honest different lease 1.4
    # (docs/gpu.md); fp32 leases on other CPU kernels: scripts/verify_tolerance.py --cross-cpu
    cross_device_tolerance: float | None = Field(
        None, ge=0, description="max relative L2 error for a lease from another compute class than the verifier's "
        "(default by inner.precision and codec: 0.01 fp32, 0.1 bf16; with a sign/topk/grp codec 0.03 fp32, 0.4 bf16; "
        "0: bitwise for every peer — then only peers of the verifier's class can pass a check)"
    )
    cross_device_min_cosine: float | None = Field(
        None, ge=-1, le=1, description="and the cosine it needs with the re-run (default: 0.9999 / 0.99 in fp32 / bf16; "
        "with a sign/topk/grp codec 0.9995 / 0.9)"
    )
    # the revealed end inner state of a lease from another compute class against the re-run's (coordinator/rerun.py
    # state_gap: relative L2 errors of m, v and the AdamW step m̂/(√v̂+eps), the RMS log-ratio of its step size; step
    # counts exactly; the error-feedback residual, a part of the upload, within cross_device_tolerance of its norm)
    cross_device_state_tolerance: float | None = Field(
        None, ge=0, description="max relative error of the end inner state (m, v, the AdamW step and its size) a peer "
        "of another compute class reveals from the re-run's (default by inner.precision: 0.01 fp32, measured ≤ 6.4e-4 on "
        "other CPU kernels at 20m: results/verify-tolerance-end-state-cross-cpu-20m-fp32-2026-11-27.json, tiny: results/"
        "verify-tolerance-end-state-cross-cpu-tiny-fp32-2026-11-27.json; 0.2 bf16, measured ≤ 0.087 for an H200's bf16 "
        "lease against the CPU's fp32 re-run at 20m: results/gpu/h200-2026-11-28-a.json)"
    )
    lease_warmup: int = Field(
        0, ge=0, description="with inner_state reset: ramp the LR linearly over each lease's first N steps (a fresh AdamW's first steps are large)"
    )
    queue: int = Field(16, ge=1, description="re-runs waiting at most; beyond it a check is skipped and counted")
    # a reset-state lease is a function of θ as its peer decoded it and the data: the coordinator knows both once it has
    # sent the lease's θ, so its re-run can start then, while the peer trains, and the update's verdict is ready when
    # it arrives (coordinator/verify.py "Re-runs ahead"); with inner_state carry the start state comes with the reveal
    ahead: int = Field(
        4, ge=0, description="inner_state reset: re-runs of chosen leases started when the coordinator sends their θ, "
        "before their update arrives (kept at most; each keeps a θ-sized result); 0: re-run only once the update is in"
    )
    horizon: int = Field(200, ge=1, description="applied updates between repair anchors: an expulsion undoes at least this far back")
    repair: Literal["rerun", "discard"] = Field(
        "rerun", description="what a repair applies in place of an expelled peer's updates: rerun = the coordinator's honest "
        "re-run of each of its leases (its compute, once per expulsion); discard = nothing (cheaper, but the honest updates "
        "trained on top of the removed ones no longer fit: measured 173 -> 1.1e6 perplexity for 85 removed)"
    )
    reveal_timeout: float = Field(
        300.0, gt=0, description="inner_state carry: seconds a peer has to reveal a checked lease's states, plus their "
        "transfer at half the upload rate measured on its last update (at most at the RPC floor, 64 KiB/s); then the "
        "check fails"
    )
    reveal_keep: int = Field(2, ge=1, description="inner_state carry: start and end states of its last N leases a peer keeps to reveal")
    # an uplink that cannot carry a reveal is not let off its checks: its leases start from a state the coordinator
    # knows without one (coordinator/logic/leases.py fresh_reason)
    fresh_start_reveal_s: float = Field(
        300.0, ge=0, description="inner_state carry: a peer whose reported uplink would take longer than this to reveal "
        "one inner state, or is below twice the RPC floor (128 KiB/s), gets leases that start from a fresh inner state "
        "and no error-feedback residual: nothing to reveal, its checks re-run from θ and the data (0: never)"
    )
    slow_uplink_carry: float = Field(
        1.0, ge=0, le=1, description="the share of a slow-uplink peer's leases (fresh_start_reveal_s) that carry its "
        "inner state and residual all the same, drawn per lease: its previous lease is then re-run here and its end "
        "state kept, the start of the new one, so no reveal is needed (coordinator/logic/leases.py carries_checked; "
        "needs verification local, no validators, keep_states_mb ≥ one state). Costs re-runs: that previous lease is "
        "checked too: at 1 every lease of such a peer is re-run (on home150: 1.17-1.23 x loopback's perplexity against 1.28-1.29 x "
        "at 0.75, docs/wan.md). Lower it for a verifier that cannot keep up; 0: every such lease starts fresh"
    )
    # back-pressure: a carried-on lease's check waits for the one before it, outside the verifier's queue, each with its
    # update and base θ kept (logic/state.py applied_first) — a verifier slower than the re-runs asked of it would grow
    # that chain for the whole run (home150, 2 shared cores: 14-18 checks per peer awaiting at 600 s, growing)
    carry_backlog_mb: int = Field(
        4096, ge=0, description="slow_uplink_carry sheds load: a slow-uplink peer's lease is carried on (re-run so that "
        "the next one carries its state) only while the update and base θ kept for each of that peer's checks awaiting "
        "their verdicts (8 bytes a weight) total less than this; otherwise the next lease starts fresh and this one is "
        "checked at the usual fraction, never less (coordinator/logic/leases.py draw_carry). At 150m: up to 3 checks "
        "awaiting; at tiny it never binds (docs/results/wan-home150-carry-backlog-2026-11-30.json)"
    )
    # the eager start (schedule.eager_start): a checked lease that starts from θ minus its peer's previous update needs
    # that update (fp32) kept from its arrival until the lease's own submission
    eager_keep_mb: int = Field(
        4096, ge=0, description="schedule.eager_start with verification: while the updates kept for checked leases' "
        "eager starts (4 bytes a weight each, one per such lease in training) total this much, new leases get no eager "
        "start, checked or not (coordinator/logic/leases.py eager_of). At 150m: about 6 such leases at once"
    )
    # a passed check leaves the coordinator the lease's end state, which the peer's next lease starts from: kept, that
    # lease is re-run from it if drawn, and its peer reveals nothing, or its end alone (coordinator/chained.py); a
    # state is 3 × θ's fp32 bytes with error feedback, 2 × without
    keep_states_mb: int = Field(
        8192, ge=0, description="inner_state carry: the MB of end states of checked leases the coordinator keeps, one per "
        "peer, so that the peer's next lease, if drawn, needs no reveal (0: every check asks its peer)"
    )
    keep_states_on: Literal["disk", "memory"] = Field(
        "disk", description="where kept end states live: disk = files under the checkpoint directory's kept-states/, "
        "mapped (the page cache holds what memory allows); memory = the coordinator's memory"
    )
    # --- validator peers (asyncloco/validator.py): organiser-run machines that take checks over the verify_task RPC
    validators: list[str] = Field(
        default_factory=list, description="libp2p peer ids of the organiser's validator peers (`asyncloco validator join` "
        "prints its id); they are trusted: their verdicts expel peers"
    )
    local: bool = Field(True, description="the coordinator re-runs checks itself too (false: only its validators do)")
    validator_timeout: float = Field(
        600.0, gt=0, description="seconds a validator has for a check it took; then the check goes back to the queue"
    )

    @field_validator("validators")
    @classmethod
    def _peer_ids(cls, value: list[str]) -> list[str]:
        for peer in value:
            if not re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{20,128}", peer):
                raise ValueError(f"runtime.verify.validators: {peer[:80]!r} is not a libp2p peer id (base58, as "
                                 "`asyncloco validator join` prints it)")
        return value

    @model_validator(mode="after")
    def _someone_verifies(self) -> "VerifyConfig":
        if self.enabled and not self.local and not self.validators:
            raise ValueError("runtime.verify.local is false but runtime.verify.validators is empty: nobody would re-run "
                             "the checks; list the validator peers' ids or set local: true")
        return self


# transport.codecs.CODECS as a pattern (this module imports no torch); tests/test_feedback.py checks they agree
UPLOAD_CODEC_PATTERN = (
    r"none|fp16|bf16|int8|int4|int2|topk(1|2|4|8|16|32|64)b(2|4)|grp(4|8|16|32)b(1|2)|sgn(1of1|15of16|7of8|3of4|5of8|1of2)"
)


class RuntimeConfig(StrictModel):
    """The networked coordinator and peers."""

    run_id: str = Field("asyncloco-demo", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # --- pseudo-gradient uploads (transport/codecs.py, docs/compression.md); the names are transport.codecs.CODECS
    codec: str = Field(
        "none", description="codec of pseudo-gradient uploads: none, fp16, bf16, int8, int4, int2, topk{k}b{bits}, grp{G}b{bits}, sgn{p}of{q}"
    )
    error_feedback: bool | None = Field(
        None, description="carry what the codec dropped into the next upload (train/feedback.py); None: off (docs/compression.md)"
    )
    error_feedback_decay: float = Field(
        1.0, gt=0, le=1, description="the share of the residual carried into the next upload (1: classic error feedback; "
        "0.5 with the sgn codecs, measured in docs/compression.md)"
    )
    # --- θ downloads (transport, docs/transport.md): none = fp32; int8 ≈ 0.25 × fp32 (a delta from the peer's anchor); no
    # body when the peer holds the version. Verification re-runs a lease from the θ the peer decoded (docs/design.md)
    download_codec: Literal["none", "bf16", "int8"] = Field(
        "int8", description="codec of θ downloads (none = fp32; int8: 0.25 × fp32, a check re-runs from the θ the peer decoded)"
    )
    overlap: bool = Field(
        True, description="overlapped rounds: a peer trains its next lease while its last update uploads (with its reveal, "
        "if asked) and the next θ downloads (peer/pipeline.py); false: ask, download, train, upload in turn"
    )
    lease_timeout_factor: float = Field(3.0, gt=1, description="lease deadline = expected duration × this + slack")
    lease_slack: float = Field(30.0, ge=0, description="seconds added to every lease deadline")
    checkpoint_dir: str = "runs/coordinator"
    # --- durability (coordinator/wal.py): every event is in the write-ahead log; full snapshots in the background
    snapshot_every: int = Field(100, ge=1, description="applied updates between background snapshots")
    snapshot_every_s: float = Field(120.0, gt=0, description="seconds between background snapshots (if anything changed)")
    swarm: bool = Field(
        True,
        description="serve θ to peers that join with --swarm through the chunk swarm (transport/swarm.py): signed "
        "manifests, peers serve each other; peers without --swarm are unaffected",
    )
    wal_archive: bool = Field(False, description="keep log segments a snapshot covers in wal/archive/ (audits, replay tests)")
    eval_every: int = Field(10, ge=1, description="applied updates between validation evaluations")
    host: str = "127.0.0.1"
    announce_addr: str | None = Field(
        None, pattern=r"^[A-Za-z0-9.:-]{1,253}$",
        description="public IP or DNS name peers dial (coordinator); the join line uses it (transport/reach.py)",
    )
    port: int = Field(0, ge=0, le=65535)
    speed_report_period: float = Field(10.0, gt=0)
    max_update_norm: float | None = Field(None, gt=0, description="reject pseudo-gradients with a larger L2 norm")
    gate: GateConfig = Field(default_factory=GateConfig)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    max_lease_s: float = Field(3600.0, gt=0, description="cap on any lease's deadline (a 'slow' peer cannot hold one for years)")
    transfer_allowance_s: float = Field(
        60.0, ge=0, description="added to a lease's deadline for θ down + Δ up until the peer's transfer time is measured"
    )
    eval_device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="torch device of the coordinator's evaluation")
    # --- watching a run (coordinator/status.py, dashboard.py, sinks.py)
    dashboard_port: int | None = Field(None, ge=0, le=65535, description="serve the web dashboard here (0: any port)")
    dashboard_host: str = Field("127.0.0.1", description="dashboard address; a public one only on purpose")
    log_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list, description="optional metrics sinks")
    summary_every: float = Field(30.0, gt=0, description="seconds between the coordinator's INFO summary lines")
    # --- admission (coordinator/admission.py)
    admission: Literal["open", "token", "allowlist"] = Field(
        "open", description="open: anyone with the address; token: signed tokens; allowlist: runtime.allowlist"
    )
    allowlist: list[str] = Field(default_factory=list, description="libp2p peer ids admitted in allowlist mode")

    @field_validator("codec")
    @classmethod
    def _check_codec(cls, value: str) -> str:
        if not re.fullmatch(UPLOAD_CODEC_PATTERN, value):
            raise ValueError(
                f"unknown codec {value!r}: use none, fp16, bf16, int8, int4, int2 or topk{{k}}b{{bits}} with k in "
                "1, 2, 4, 8, 16, 32, 64 (values kept per 256) and bits 2 or 4, or grp{G}b{bits} with G in 4, 8, 16, 32 and "
                "bits 1 or 2, or sgn{p}of{q} for p/q in 1of1, 15of16, 7of8, 3of4, 5of8, 1of2, e.g. topk8b2, "
                "grp8b1 or sgn3of4 (docs/compression.md)"
            )
        return value

    @property
    def uses_error_feedback(self) -> bool:
        """Error feedback is on only when asked for (``runtime.error_feedback: true``) with a lossy codec. Off by
        default, measured: in the simulator (docs/compression.md, 3 seeds) it made every sparse codec worse on the
        toy task and on ``lm-tiny`` (e.g. grp8b2 +16.1 % → +27.5 % perplexity) and int2 no better on the toy task.
        With verification the residual is committed and revealed with the carried inner state (peer/reveal.py)."""
        return bool(self.error_feedback) and self.codec != "none"

    @model_validator(mode="after")
    def _check_feedback(self) -> "RuntimeConfig":
        if self.uses_error_feedback and self.verify.enabled and self.verify.inner_state != "carry":
            raise ValueError(
                "runtime.error_feedback: true with runtime.verify.enabled needs runtime.verify.inner_state: carry (the "
                "default): the peer's error-feedback residual is committed and revealed with its carried inner state, "
                "and with inner_state: reset nothing is revealed, so every check would fail (docs/compression.md)"
            )
        return self

    @model_validator(mode="after")
    def _check_admission(self) -> "RuntimeConfig":
        bad = [p for p in self.allowlist if not (isinstance(p, str) and 1 <= len(p) <= 128 and p.isalnum())]
        if bad:
            raise ValueError(f"runtime.allowlist entries must be libp2p peer ids (Qm... or 12D3...), got {bad[:3]}")
        if self.admission == "allowlist" and not self.allowlist:
            raise ValueError("runtime.admission is 'allowlist' but runtime.allowlist is empty: list the peer ids to admit")
        if self.admission != "allowlist" and self.allowlist:
            raise ValueError(
                f"runtime.allowlist is set but runtime.admission is {self.admission!r}; set runtime.admission: allowlist"
            )
        return self


class RunConfig(StrictModel):
    name: str = "run"
    seed: int = 0
    task: TaskConfig = Field(default_factory=ToyTaskConfig)
    inner: InnerConfig = Field(default_factory=InnerConfig)
    outer: OuterConfig = Field(default_factory=OuterConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    sim: SimConfig = Field(default_factory=SimConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)

    @field_validator("task", mode="before")
    @classmethod
    def _default_kind(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": "toy", **value}
        return value

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        n = self.outer.buffer_size or self.sim.workers
        if self.outer.activation > 1.0 / n + 1e-12:
            raise ValueError(f"outer.activation c={self.outer.activation} must be <= 1/N = {1.0 / n:g}")
        verify = self.runtime.verify
        if verify.enabled and verify.inner_state == "carry" and self.inner.optimizer != "adamw":
            raise ValueError(
                f"runtime.verify.inner_state 'carry' needs inner.optimizer 'adamw': a peer commits to its inner state "
                f"byte for byte, and {self.inner.optimizer!r}'s quantized state has no such layout; use inner.optimizer "
                "'adamw', or runtime.verify.inner_state 'reset' (1.78 × perplexity on lm-tiny), or runtime.verify.enabled: false"
            )
        return self


def _format_errors(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = list(item["loc"])
        if len(loc) > 1 and loc[0] == "task" and loc[1] in ("toy", "lm"):
            del loc[1]  # pydantic names the union member; the user wrote task.<key>
        where = ".".join(str(p) for p in loc) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key — check its spelling or remove it")
        else:
            lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)


def _yaml_error_line(path: Path, error: yaml.YAMLError) -> str:
    """One line, ``file:line:column: what`` (1-based, like compilers), for a YAML syntax error."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    context_mark = getattr(error, "context_mark", None)
    if context and context_mark is not None and mark is not None and context_mark.line != mark.line:
        context = f"{context} that starts at line {context_mark.line + 1}"
    detail = f"{problem} ({context})" if context else problem
    return f"{where}: YAML syntax error: {detail}; fix the file at that line (indentation, a missing ':' or quote)"


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any], path: str | Path = "the config") -> None:
    """Set each dotted key of ``overrides`` in the raw YAML mapping ``raw`` (validation comes after)."""
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for depth, key in enumerate(parents):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                section = ".".join(parents[: depth + 1])
                raise ValueError(f"cannot set {dotted}: {section} in {path} is a value ({child!r}), not a section")
            node = child
        node[leaf] = value


def load_raw_config(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The YAML mapping of a run config with ``overrides`` applied, validated (raises ``ValueError`` like
    :func:`load_config`); for writing the effective config a subprocess loads (the demo)."""
    load_config(path, overrides)
    raw = yaml.safe_load(Path(path).read_text()) or {}
    apply_overrides(raw, overrides or {}, path)
    return dict(raw)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load and validate a YAML run config; raises ``ValueError`` naming every bad key."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist; see the configs/ directory for examples")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(_yaml_error_line(path, error)) from None
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must be a YAML mapping at the top level")
    apply_overrides(raw, overrides or {}, path)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise ValueError(f"invalid config {path}:\n{_format_errors(error)}") from None
