"""Named training methods: which outer optimizer, which staleness transforms, DyLU or not, barrier or not.

A *method* is what the paper compares in its tables and figures. Everything else (data, model,
inner optimizer, worker speeds) stays fixed, so a comparison changes exactly one thing.

``barrier=True`` is synchronous DiLoCo: every peer waits until all active leases are in, the k
pseudo-gradients are averaged (Async Buffer with N = k) and one Nesterov step is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from asyncloco.algo.outer import (
    AsyncBuffer,
    DelayedNesterov,
    MomentumOptimizer,
    OuterAdam,
    OuterNesterov,
    OuterOptimizer,
    OuterSGD,
    OuterSGDMomentum,
)
from asyncloco.algo.staleness import (
    AsyncAwareLR,
    DelayCompensation,
    OuterWarmup,
    PolyDiscount,
    StalenessLR,
    StalenessTransform,
)

from asyncloco.coordinator.gate import GatePolicy, adamw_norm_bound
from asyncloco.coordinator.logic import CoordinatorPolicy, VerifyPolicy

from asyncloco.config import BARRIER_METHODS, METHOD_NAMES
from asyncloco.timings import hold_timings

if TYPE_CHECKING:
    from asyncloco.config import OuterConfig, RunConfig

__all__ = ["MethodSpec", "METHODS", "build_method", "coordinator_policy", "updates_in_flight", "build_runtime_method"]

Groups = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    label: str
    dylu: bool
    barrier: bool
    outer: Callable[["OuterConfig", int], OuterOptimizer]
    transforms: Callable[["OuterConfig", Groups], list[StalenessTransform]] = lambda cfg, groups: []


def _n(cfg: "OuterConfig", workers: int) -> int:
    return cfg.buffer_size or workers


def _nesterov(cfg: "OuterConfig", workers: int) -> OuterOptimizer:
    return OuterNesterov(cfg.lr, cfg.momentum)


def _dn(cfg: "OuterConfig", workers: int) -> OuterOptimizer:
    return DelayedNesterov(cfg.lr, cfg.momentum, _n(cfg, workers), cfg.activation)


def _buffer(cfg: "OuterConfig", workers: int) -> OuterOptimizer:
    return AsyncBuffer(cfg.lr, cfg.momentum, _n(cfg, workers))


def _sync(cfg: "OuterConfig", workers: int) -> OuterOptimizer:
    return AsyncBuffer(cfg.lr, cfg.momentum, workers)


def _sgd(cfg: "OuterConfig", workers: int) -> OuterOptimizer:
    return OuterSGD(cfg.sgd_lr or cfg.lr / (1.0 + cfg.momentum))


_SPECS = [
    MethodSpec("sync_diloco", "Sync DiLoCo", dylu=False, barrier=True, outer=_sync),
    MethodSpec("async_diloco", "Async DiLoCo (Nesterov)", dylu=False, barrier=False, outer=_nesterov),
    MethodSpec("async_dn", "Async DN", dylu=False, barrier=False, outer=_dn),
    MethodSpec("async_dn_dylu", "Async DN + DyLU", dylu=True, barrier=False, outer=_dn),
    MethodSpec("async_diloco_dylu", "Async DiLoCo + DyLU", dylu=True, barrier=False, outer=_nesterov),
    MethodSpec("async_buffer", "Async Buffer (FedBuff)", dylu=False, barrier=False, outer=_buffer),
    MethodSpec(
        "poly",
        "Async DiLoCo + Poly",
        dylu=False,
        barrier=False,
        outer=_nesterov,
        transforms=lambda cfg, groups: [PolyDiscount(cfg.poly_exponent)],
    ),
    MethodSpec(
        "poly_thres",
        "Async DiLoCo + PolyThres",
        dylu=False,
        barrier=False,
        outer=_nesterov,
        transforms=lambda cfg, groups: [PolyDiscount(cfg.poly_exponent, cfg.poly_max_staleness)],
    ),
    MethodSpec(
        "delay_comp",
        "Async DiLoCo + Delay Comp.",
        dylu=False,
        barrier=False,
        outer=_nesterov,
        transforms=lambda cfg, groups: [DelayCompensation(cfg.delay_compensation)],
    ),
    MethodSpec(
        "elasticdl_lr",
        "Async DiLoCo + staleness lr (ElasticDL)",
        dylu=False,
        barrier=False,
        outer=_nesterov,
        transforms=lambda cfg, groups: [StalenessLR()],
    ),
    MethodSpec(
        "asynclm",
        "Async DiLoCo + AsyncLM (group comp. + AALR)",
        dylu=False,
        barrier=False,
        outer=_nesterov,
        transforms=lambda cfg, groups: [
            DelayCompensation(cfg.delay_compensation, groups=list(groups) or None),
            AsyncAwareLR(cfg.aalr_threshold, cfg.aalr_window),
        ],
    ),
    MethodSpec("async_sgd", "Async SGD (outer)", dylu=False, barrier=False, outer=_sgd),
    MethodSpec(
        "async_sgd_momentum",
        "Async SGD-momentum (outer)",
        dylu=False,
        barrier=False,
        outer=lambda cfg, workers: OuterSGDMomentum(cfg.lr / (1.0 + cfg.momentum), cfg.momentum),
    ),
    MethodSpec(
        "async_adam",
        "Async Adam (outer)",
        dylu=False,
        barrier=False,
        outer=lambda cfg, workers: OuterAdam(cfg.adam_lr),
    ),
]

METHODS: dict[str, MethodSpec] = {spec.name: spec for spec in _SPECS}
if set(METHODS) != set(METHOD_NAMES) or len(METHODS) != len(_SPECS):  # config.py lists the names a config may use
    raise ImportError(f"coordinator/methods.py and config.METHOD_NAMES disagree: {sorted(set(METHODS) ^ set(METHOD_NAMES))}")
if {name for name, spec in METHODS.items() if spec.barrier} != BARRIER_METHODS:  # timings.py holds these to a round
    raise ImportError("coordinator/methods.py's barrier methods and config.BARRIER_METHODS disagree")


def build_method(
    name: str, cfg: "OuterConfig", workers: int, groups: Groups = (), in_flight: int = 1,
    reference_steps: int | None = None,
) -> tuple[MethodSpec, OuterOptimizer, list[StalenessTransform]]:
    """The spec, a fresh outer optimizer and fresh transforms for method ``name``.

    ``in_flight``: the updates each peer has on the way at once — 1 in the paper (and the simulator), 2 with
    overlapped rounds (runtime.overlap: a peer trains its next lease while its last update uploads, so both start
    from θ without the other). The buffered methods' N counts arrivals that start from about the same θ, so it is
    ``buffer_size × in_flight`` there (a barrier method's round holds one lease per peer and is left as it is);
    with N = the peers alone, two same-θ updates per peer would each take a full 1/N share — twice the outer
    step, which with momentum 0.9 diverges at a cold start (docs/algorithm.md, "Overlapped rounds and N").

    ``reference_steps``: H of the run (``schedule.max_local_steps``); with ``outer.long_lease_momentum: scaled`` a
    momentum method decays its momentum by β^(h/H) for updates of h > H local steps (``MomentumOptimizer.beta``).
    ``outer.warmup_arrivals`` > 0 appends the outer-lr warm-up (``OuterWarmup``) to the method's transforms."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}")
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}")
    spec = METHODS[name]
    if in_flight > 1 and not spec.barrier and spec.outer in (_dn, _buffer):
        cfg = cfg.model_copy(update={"buffer_size": (cfg.buffer_size or workers) * in_flight,
                                     "activation": cfg.activation / in_flight})  # c·N unchanged
    optimizer = spec.outer(cfg, workers)
    if reference_steps is not None and cfg.long_lease_momentum == "scaled" and isinstance(optimizer, MomentumOptimizer):
        optimizer.reference_steps = reference_steps
    transforms = spec.transforms(cfg, groups)
    if cfg.warmup_arrivals > 0:  # after the method's own: its lr multiplier multiplies theirs
        transforms.append(OuterWarmup(cfg.warmup_arrivals))
    return spec, optimizer, transforms


def updates_in_flight(cfg: "RunConfig") -> int:
    """Updates a peer of this real run has on the way at once (``build_method``'s ``in_flight``)."""
    return 2 if cfg.runtime.overlap else 1


def build_runtime_method(
    cfg: "RunConfig", groups: Groups = ()
) -> tuple[MethodSpec, OuterOptimizer, list[StalenessTransform]]:
    """``build_method`` for a real run of ``cfg``: N from ``outer.buffer_size`` (else the configured workers) and
    each peer's updates in flight (the daemon and a repair's fresh state build the same optimizer)."""
    return build_method(cfg.schedule.method, cfg.outer, cfg.outer.buffer_size or cfg.sim.workers, groups,
                        updates_in_flight(cfg), cfg.schedule.max_local_steps)


def coordinator_policy(
    cfg: "RunConfig", spec: MethodSpec, units_per_step: int, *, simulated: bool, numel: int | None = None
) -> CoordinatorPolicy:
    """The decision knobs of a run. In the simulator (fake time, nobody crashes, nobody lies) leases never
    expire, no update is refused for staleness or size, speeds are taken as reported and the update gate is
    off, so every method sees the same updates. A real run (``numel`` given) gets the gate, speeds bound to
    the reporting peer and capped by what it delivers, liveness and hold limits, and capped lease deadlines."""
    runtime = cfg.runtime
    real = not simulated
    gate = None
    if real and runtime.gate.enabled:
        knobs = runtime.gate
        gate = GatePolicy(
            clip_factor=knobs.clip_factor,
            reject_factor=knobs.reject_factor,
            cosine_mads=knobs.cosine_mads,
            cosine_cap=knobs.cosine_cap,
            echo_cosine=knobs.echo_cosine,
            flip_margin=knobs.flip_margin,
            reference_share=knobs.reference_share,
            window=knobs.window,
            warmup=knobs.warmup,
            probation_updates=knobs.probation_updates,
            quarantine_after=knobs.quarantine_after,
            quarantine_window=knobs.quarantine_window,
            quarantine_s=knobs.quarantine_s,
            probe=knobs.probe,
            probe_step=knobs.probe_step,
            probe_margin=knobs.probe_margin,
            probe_below=knobs.probe_below,
            probe_all_below_params=knobs.probe_all_below_params,
            probe_max_params=knobs.probe_max_params,
            full_steps=cfg.schedule.max_local_steps,
        )
    bound = None
    if gate is not None and numel is not None and cfg.inner.optimizer in ("adamw", "adamw8bit"):
        bound = adamw_norm_bound(cfg.inner.lr, numel, cfg.inner.weight_decay, cfg.inner.betas)
    hold_limit = hold_timings(cfg).logic
    verify = None
    if runtime.verify.enabled and (real or cfg.sim.checks):  # verification of the work (coordinator/verify.py); the
        # simulator holds the chosen leases' updates for a modelled re-run (sim/engine.py)
        knobs_v = runtime.verify
        verify = VerifyPolicy(knobs_v.fraction, knobs_v.probation_updates, knobs_v.suspect_fraction,
                              commit=knobs_v.inner_state == "carry", sketch_threshold=knobs_v.sketch_threshold,
                              sketch_checks=knobs_v.sketch_checks, hold_backlog=knobs_v.hold_backlog,
                              serial_probation=knobs_v.serial_probation,
                              average_released=knobs_v.average_released, slow_carry=knobs_v.slow_uplink_carry,
                              carry_backlog_bytes=knobs_v.carry_backlog_mb << 20,
                              eager_keep_bytes=knobs_v.eager_keep_mb << 20)
    return CoordinatorPolicy(
        gate=gate,
        verify=verify,
        norm_bound_per_step=bound,
        trust_speeds=simulated,
        peer_timeout=3 * runtime.speed_report_period if real else math.inf,
        hold_limit=hold_limit if real else math.inf,
        max_lease_s=runtime.max_lease_s if real else math.inf,
        transfer_allowance_s=runtime.transfer_allowance_s if real else 0.0,
        buffer_size=(cfg.outer.buffer_size or cfg.sim.workers) if real and spec.outer in (_dn, _buffer, _sync) else None,
        max_local_steps=cfg.schedule.max_local_steps,
        min_steps=cfg.schedule.min_steps,
        dylu=spec.dylu,
        barrier=spec.barrier,
        grace_period=cfg.schedule.grace_period,
        units_per_step=units_per_step,
        speed_ema=cfg.schedule.speed_ema,
        lease_timeout_factor=math.inf if simulated else cfg.runtime.lease_timeout_factor,
        lease_slack=0.0 if simulated else cfg.runtime.lease_slack,
        max_staleness=None if simulated else cfg.outer.max_staleness,
        max_update_norm=None if simulated else cfg.runtime.max_update_norm,
        link_steps=cfg.schedule.local_steps == "auto",
        transfer_cover=cfg.schedule.transfer_cover,
        max_auto_steps=cfg.schedule.auto_steps_cap,
        eager_share=0.0 if spec.barrier else min(2.0, cfg.schedule.eager_share(cfg.outer.lr)),
    )
