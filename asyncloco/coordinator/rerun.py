"""Re-running a lease and judging the submitted pseudo-gradient against the re-run (docs/threat-model.md,
"Verified work"): :class:`Rerunner` and :func:`compare`, used by the coordinator's own verification worker
(coordinator/verify.py) and by validator peers (asyncloco/validator.py) alike."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Optional

import torch

from asyncloco.coordinator.chained import StateStore

if TYPE_CHECKING:
    from asyncloco.config import RunConfig
    from asyncloco.coordinator.logic import Lease, Verify
    from asyncloco.models.workload import Workload
    from asyncloco.train.inner import InnerTrainer
    from asyncloco.train.commitments import Buffer
    from asyncloco.transport.codec_format import EncodedTensor

__all__ = ["Comparison", "compare", "implausible_state", "moment_bound", "Rerunner", "start_theta", "state_moments", "state_gap"]


# ------------------------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Comparison:
    ok: bool
    bitwise: bool
    rel_error: float  # ‖submitted − rerun‖ / ‖rerun‖
    cosine: float
    detail: str
    # a passed carried-state check (with Rerunner.keep_end): the lease's end state whose digest is the committed one — the
    # re-run's for the verifier's own compute class, the peer's revealed end for another — in a reveal part's layout
    # (train/commitments.py ``pack_reveal``; the inner layout alone without error feedback): where the peer's next lease
    # starts (coordinator/chained.py)
    end_state: Optional["Buffer"] = field(default=None, repr=False, compare=False)


def compare(rerun: torch.Tensor, submitted: torch.Tensor, tolerance: float = 0.0, min_cosine: float = -1.0) -> Comparison:
    """Judge a submitted pseudo-gradient against the verifier's re-run. ``tolerance`` 0: bitwise equality;
    otherwise relative L2 error ≤ ``tolerance`` and cosine ≥ ``min_cosine``."""
    if rerun.shape != submitted.shape:
        return Comparison(False, False, math.inf, -1.0, f"shape {tuple(submitted.shape)} ≠ re-run {tuple(rerun.shape)}")
    bitwise = bool(torch.equal(rerun, submitted))
    if bitwise:
        return Comparison(True, True, 0.0, 1.0, "bitwise equal to the re-run")
    a, b = rerun.double(), submitted.double()
    norm = float(a.norm())
    diff = float((b - a).norm())
    rel = diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)
    denominator = norm * float(b.norm())
    cosine = float(torch.dot(a, b)) / denominator if denominator > 0 else 0.0
    if not (math.isfinite(rel) and math.isfinite(cosine)):
        return Comparison(False, False, math.inf, -1.0, "non-finite difference from the re-run")
    ok = tolerance > 0 and rel <= tolerance and cosine >= min_cosine
    bound = "bitwise equality" if tolerance == 0 else f"≤ {tolerance:g}" + (f", cosine ≥ {min_cosine:g}" if min_cosine > -1 else "")
    return Comparison(ok, False, rel, cosine, f"relative error {rel:.3g} (cosine {cosine:.6f}) vs the re-run; allowed: {bound}")


def start_theta(task: "Verify") -> tuple[Optional[torch.Tensor], str]:
    """The θ a checked lease is re-run from: the one its peer says it decoded (``theta_codec``, ``theta_anchor``; a
    compressed download, docs/design.md "Compressed downloads and verification"), rebuilt bit for bit from θ at the
    base version (``task.base``) and the anchor's full encoding (``task.anchor_body``) with the coordinator's own
    encoding (transport/delta.py ``decoded_theta``), once it hashes to the peer's ``theta_digest``; θ itself for a
    submission without them. None and why when the peer's digest is not that θ's: it trained from another θ than the
    one it names (or names one it was never sent), a failed check. With an eager start (``task.lease.eager_of``,
    algo/eager.py) the re-run starts where the peer did: that θ minus ``eager_share`` × the update it names
    (``task.eager``; the daemon ends a check without it unverified before it gets here)."""
    theta, why = _decoded_start(task)
    if theta is None or not task.lease.eager_of:
        return theta, why
    if task.eager is None:
        raise RuntimeError(f"the update lease {task.lease.lease_id}'s eager start subtracted is not at hand")
    from asyncloco.algo.eager import eager_start

    return eager_start(theta, task.eager, task.lease.eager_share), ""


def _decoded_start(task: "Verify") -> tuple[Optional[torch.Tensor], str]:
    """The θ the peer decoded (:func:`start_theta` before its eager start)."""
    if not task.theta_codec:
        return task.base, ""
    from asyncloco.transport.delta import decoded_theta, theta_digest

    try:
        theta = decoded_theta(task.theta_codec, task.base, task.anchor_body if task.theta_anchor is not None else None)
    except Exception as error:  # a malformed anchor: the coordinator's own bytes, never the peer's fault
        raise RuntimeError(f"rebuilding the peer's θ failed: {error!r}") from error
    if theta_digest(theta) != task.theta_digest:
        source = f"a delta from v{task.theta_anchor}" if task.theta_anchor is not None else "in full"
        return None, (f"the θ the peer committed to (sha256 {task.theta_digest[:16]}…) is not θ v{task.lease.base_version} "
                      f"as the coordinator sent it in {task.theta_codec}, {source}")
    return theta, ""


# ------------------------------------------------------------------------------- a revealed state's plausibility


def moment_bound(beta1: float, beta2: float, step: float) -> float:
    """The most ``|exp_avg| / sqrt(exp_avg_sq)`` can be in an AdamW state after ``step`` steps from zero moments, for
    any gradients: with m_t = (1−β1) Σ_k β1^k g_{t−k} and v_t = (1−β2) Σ_k β2^k g²_{t−k} (k < t), Cauchy–Schwarz gives
    |m_t| ≤ (1−β1)/√(1−β2) · √(Σ_k (β1²/β2)^k) · √v_t, with equality for gradients ∝ (β1/β2)^k (at the default
    betas: 3.16 after one step, 7.27 in the limit). Weight decay and clipping do not enter the moments (AdamW)."""
    if step < 1:
        return 0.0
    ratio = beta1 * beta1 / beta2
    if ratio >= 1.0:
        return math.inf  # no bound below β2 = β1²
    series = (1.0 - ratio ** step) / (1.0 - ratio)
    return (1.0 - beta1) / math.sqrt(1.0 - beta2) * math.sqrt(series)


def implausible_state(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why the loaded AdamW state is one no honest run reaches (None: it may be): non-finite or negative moments,
    or, for any element, ``|exp_avg| > moment_bound(β1, β2, step) · sqrt(exp_avg_sq)`` (a relative slack of 1e-3 for
    float32 rounding, and 1e-12 absolute for gradients whose square underflows). A crafted state — a second moment
    shrunk to amplify chosen coordinates, or a step count set low to inflate the bias correction — breaks it; one
    that keeps inside it steers no coordinate further than honest gradients could (docs/threat-model.md, "What a
    peer can still do")."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for index, param in enumerate(group["params"]):
            state = optimizer.state.get(param)
            if not state:
                continue
            m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
            step = float(state["step"])
            if not (bool(torch.isfinite(m).all()) and bool(torch.isfinite(v).all())) or bool((v < 0).any()):
                return f"parameter {index}: non-finite or negative moments"
            if not math.isfinite(step) or step < 1 or step != int(step):
                return f"parameter {index}: step count {step:g} is not a positive whole number"
            bound = moment_bound(beta1, beta2, step)
            excess = m.abs() - (bound * (1.0 + 1e-3) * v.sqrt() + 1e-12)
            bad = int((excess > 0).sum())
            if bad:
                ratio = float((m.abs() / v.sqrt().clamp_min(1e-30)).max())
                return (f"parameter {index}: {bad} element(s) with |exp_avg| above {bound:.3f} × sqrt(exp_avg_sq), "
                        f"the most AdamW reaches in {int(step)} steps (largest ratio {ratio:.3g})")
    return None


# ----------------------------------------------------------------- a revealed end state against the re-run's

# per parameter (in param_groups order): None without state, else (step, exp_avg, exp_avg_sq, β1, β2, eps), fp32 on CPU
StateMoments = list[Optional[tuple[float, torch.Tensor, torch.Tensor, float, float, float]]]


def state_moments(optimizer: torch.optim.Optimizer) -> StateMoments:
    """A copy of an AdamW state's moments and step counts (what :func:`state_gap` compares)."""
    moments: StateMoments = []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                moments.append(None)
                continue
            moments.append((float(state["step"]), state["exp_avg"].detach().float().cpu().clone(),
                            state["exp_avg_sq"].detach().float().cpu().clone(), float(beta1), float(beta2), float(group["eps"])))
    return moments


def _relative(sums: tuple[float, float]) -> float:
    diff, norm = sums
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else (0.0 if diff == 0 else math.inf)


def state_gap(rerun: StateMoments, revealed: StateMoments, rerun_residual: Optional[torch.Tensor] = None,
              revealed_residual: Optional[torch.Tensor] = None, residual_scale: Optional[float] = None
              ) -> tuple[dict[str, float], Optional[str]]:
    """How far a revealed inner state is from the re-run's, as relative L2 errors over the whole model (the re-run's
    norm below): ``m`` (exp_avg), ``v`` (exp_avg_sq), ``u`` — the step AdamW takes from them, m̂ / (√v̂ + eps) with
    the bias corrections, per element: what a forged state steers (a small moment forged where the second moment is
    small too moves its coordinates at full step, which m's and v's norms hardly see) —, ``precond`` — the root mean
    square over the elements of log((√v̂' + eps) / (√v̂ + eps)), the per-coordinate step size's relative change: a
    second moment shrunk (with m, leaving u as it was) where it is smallest amplifies the next steps there, which
    the L2 norms of v and u hardly see — and ``residual`` (error
    feedback; 0 without), relative to ``residual_scale`` when given (the norm of the upload the residual was cut from:
    a codec that keeps most of it, int8, leaves a residual so small that a flipped rounding is a large part of it). Also what differs structurally (None: nothing): a parameter with state on one side only,
    a step count, a residual on one side only. The step counts must be equal exactly."""
    sums = {key: [0.0, 0.0] for key in ("m", "v", "u", "precond", "residual")}
    if len(rerun) != len(revealed):
        return {}, f"{len(revealed)} parameters in the revealed state, {len(rerun)} in the re-run's"
    for index, (ours, theirs) in enumerate(zip(rerun, revealed)):
        if ours is None or theirs is None:
            if ours is not theirs:
                return {}, f"parameter {index} has state on one side only"
            continue
        if ours[0] != theirs[0]:
            return {}, f"parameter {index}: step count {theirs[0]:g}, the re-run's {ours[0]:g}"
        step, beta1, beta2, eps = ours[0], ours[3], ours[4], ours[5]
        pairs = {"m": (ours[1].double(), theirs[1].double()), "v": (ours[2].double(), theirs[2].double())}
        correction1, correction2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
        sizes = [(v.clamp_min(0) / correction2).sqrt() + eps for v in pairs["v"]]  # 1 / the step size, per element
        pairs["u"] = ((pairs["m"][0] / correction1) / sizes[0], (pairs["m"][1] / correction1) / sizes[1])
        sums["precond"][0] += float((sizes[1] / sizes[0]).log().square().sum())
        sums["precond"][1] += float(sizes[0].numel())  # a mean over the elements, not relative to a norm
        for key, (a, b) in pairs.items():
            sums[key][0] += float((b - a).square().sum())
            sums[key][1] += float(a.square().sum())
    if (rerun_residual is None) != (revealed_residual is None):
        return {}, "a residual on one side only"
    if rerun_residual is not None and revealed_residual is not None:
        a, b = rerun_residual.double(), revealed_residual.double()
        sums["residual"] = [float((b - a).square().sum()), float(a.square().sum()) if residual_scale is None else residual_scale ** 2]
    gaps = {key: _relative((diff, norm)) for key, (diff, norm) in sums.items()}
    if not all(math.isfinite(gap) for gap in gaps.values()):
        return gaps, "non-finite difference from the re-run's state"
    return gaps, None


# -------------------------------------------------------------------------------------------- re-running


class Rerunner:
    """Re-runs leases with the peers' own inner loop. One model replica, built on first use, reused for every
    lease (its optimizer state is cleared before each: ``inner_state: reset``)."""

    def __init__(self, cfg: "RunConfig", workload: "Workload", device: str = "cpu") -> None:
        import torch._dynamo  # noqa: F401  (the optimizers import it lazily on their first step; two threads doing
        # that at once — the re-run's worker and the event loop's first step — left it half-initialised and every
        # later re-run failed with "partially initialized module 'torch._dynamo'": imported here, on the caller's thread)

        from asyncloco.train.inner import compute_class

        self.cfg = cfg
        self.workload = workload
        self.device = device
        self.compute_class = compute_class(device)
        self._trainer: Optional["InnerTrainer"] = None
        # a passed carried-state check returns the lease's end state (Comparison.end_state; coordinator/chained.py),
        # put in this store (the coordinator's: on disk by default, runtime.verify.keep_states_on)
        self.keep_end = False
        self.store = StateStore(None)

    def bounds(self, task: "Verify") -> tuple[float, float]:
        """(tolerance, min_cosine) for ``task``: ``runtime.verify.tolerance`` / ``min_cosine`` (bitwise by default) when
        the peer named this verifier's compute class, ``cross_device_tolerance`` / ``cross_device_min_cosine`` when it
        named another or none (docs/threat-model.md, "Which tolerance")."""
        knobs = self.cfg.runtime.verify
        if task.device_class == self.compute_class:
            return knobs.tolerance, knobs.min_cosine
        return self.cross_device_bounds()

    def cross_device_bounds(self) -> tuple[float, float]:
        """(tolerance, min_cosine) for a lease of another compute class: the config's, else the default for the run's
        ``inner.precision`` and upload codec (config.py ``CROSS_DEVICE_BOUNDS``)."""
        from asyncloco.config import CROSS_DEVICE_BOUNDS, SELECTING_CODECS

        knobs = self.cfg.runtime.verify
        selecting = self.cfg.runtime.codec.startswith(SELECTING_CODECS)
        tolerance, min_cosine = CROSS_DEVICE_BOUNDS[(self.cfg.inner.precision, selecting)]
        return (tolerance if knobs.cross_device_tolerance is None else knobs.cross_device_tolerance,
                min_cosine if knobs.cross_device_min_cosine is None else knobs.cross_device_min_cosine)

    @property
    def trainer(self) -> "InnerTrainer":
        if self._trainer is None:
            from asyncloco.train.inner import InnerTrainer

            self._trainer = InnerTrainer.from_config(self.cfg, self.workload, device=self.device)
            self._trainer.reset_state = True
        return self._trainer

    def rerun(self, lease: Lease, base: torch.Tensor, sign_rotation: Optional[int] = None) -> torch.Tensor:
        """The pseudo-gradient an honest peer submits for ``lease`` from θ = ``base``, as the coordinator decodes it."""
        return self._rerun(lease, base, None, sign_rotation)[0]

    def _sign_rotation(self, task: "Verify") -> Optional[int]:
        """A sign codec's rotation hashes every bit of the data, so a re-run from another compute class would keep
        other positions than the peer did: re-encode it with the peer's (read off the submitted update). Within the
        verifier's class the re-run encodes as the peer does — a bitwise check needs no help."""
        codec = self.cfg.runtime.codec
        if not codec.startswith("sgn") or task.device_class == self.compute_class:
            return None
        from asyncloco.transport.codecs_sign import rotation_in

        return rotation_in(task.update, codec)

    def _rerun(self, lease: Lease, base: torch.Tensor, residual: Optional[torch.Tensor],
               sign_rotation: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`rerun` with error feedback from the peer's residual ``residual``: also the residual the upload leaves
        (None without feedback)."""
        update, left, _ = self._rerun_encoded(lease, base, residual, sign_rotation)
        return update, left

    def _rerun_encoded(self, lease: Lease, base: torch.Tensor, residual: Optional[torch.Tensor],
                       sign_rotation: Optional[int] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional["EncodedTensor"]]:
        """:meth:`_rerun`, and the upload's encoding (None without a codec)."""
        return self._encoded(self.trained(lease, base), residual, sign_rotation)

    def trained(self, lease: "Lease", base: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradient an honest run of ``lease`` from θ = ``base`` trains, before the upload's codec (with the
        trainer's inner state as it is: fresh unless a caller loaded one)."""
        return self.trainer.run(base, lease.shard, lease.start_offset, lease.steps, lease.lr_offset).pseudo_gradient

    def _encoded(self, pseudo_gradient: torch.Tensor, residual: Optional[torch.Tensor], sign_rotation: Optional[int] = None
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional["EncodedTensor"]]:
        """``pseudo_gradient`` through the run's upload codec as a peer encodes it (the update as the coordinator decodes
        it, the residual left, the encoding; None for both without a codec)."""
        from asyncloco.train.feedback import ErrorFeedback
        from asyncloco.transport.codecs import decode

        runtime = self.cfg.runtime
        if runtime.codec == "none":
            return pseudo_gradient, None, None
        # the peer's own arithmetic (train/feedback.py), so that an honest upload reproduces bit for bit
        feedback = ErrorFeedback(runtime.codec, runtime.uses_error_feedback, runtime.error_feedback_decay)
        feedback.residual = residual
        feedback.sign_rotation = sign_rotation
        encoded, decoded = feedback.encode_decoded(pseudo_gradient)
        update = decoded if decoded is not None else decode(encoded, pseudo_gradient.numel())
        return update, feedback.pending, encoded

    def rerun_carried(self, lease: Lease, base: torch.Tensor, state: bytes, residual: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, bytes, Optional[torch.Tensor], Optional["EncodedTensor"]]:
        """An honest run of ``lease`` from θ = ``base`` and the inner state ``state`` (train/commitments.py's canonical
        layout; b"": fresh) with the error-feedback ``residual``: the update as the coordinator decodes it, the inner
        state at its end (same layout), the residual it leaves and its encoding (None without a codec). What a
        repair applies in place of an expelled peer's update (coordinator/substitute.py)."""
        from asyncloco.train.commitments import inner_state_chunks, load_inner_state

        trainer = self.trainer
        load_inner_state(trainer.optimizer, state)
        trainer.reset_state = False
        try:
            update, left, encoded = self._rerun_encoded(lease, base, residual)
            chunks = inner_state_chunks(trainer.optimizer)
        finally:
            trainer.reset_state = True
            trainer.reset_inner_state()
        return update, b"".join(chunks or []), left, encoded

    def check(self, task: Verify) -> Comparison:
        base, why = start_theta(task)
        if base is None:
            return Comparison(False, False, math.inf, -1.0, why)
        return compare(self.rerun(task.lease, base, self._sign_rotation(task)), task.update, *self.bounds(task))

    def check_trained(self, task: Verify, pseudo_gradient: torch.Tensor) -> Comparison:
        """:meth:`check` of a reset-state lease whose honest run ``pseudo_gradient`` (:meth:`trained`) was made ahead, from
        the θ its peer decoded (coordinator/verify.py ``Ahead``, which matched it to ``task``): only the codec and the
        comparison are left."""
        update = self._encoded(pseudo_gradient, None, self._sign_rotation(task))[0]
        return compare(update, task.update, *self.bounds(task))

    def state_tolerance(self) -> float:
        """The bound on a foreign-class peer's revealed end state (:func:`state_gap`'s m, v and AdamW step; the residual
        is held to :meth:`cross_device_bounds`): the config's, else the default for the run's ``inner.precision``
        (config.py ``CROSS_DEVICE_STATE_TOLERANCE``)."""
        from asyncloco.config import CROSS_DEVICE_STATE_TOLERANCE

        knob = self.cfg.runtime.verify.cross_device_state_tolerance
        return CROSS_DEVICE_STATE_TOLERANCE[self.cfg.inner.precision] if knob is None else knob

    def _parts(self, task: Verify, revealed: "Buffer") -> tuple[Optional[tuple["Buffer", Optional[torch.Tensor], "Buffer",
                                                                             Optional[torch.Tensor]]], str]:
        """The revealed start and end states (train/commitments.py ``pack_parts``), each an inner layout and a residual, once
        each hashes to its commitment; else None and why. An empty end part (the Ack's ``reveal_end: false``) is taken
        from a peer of the verifier's compute class: its re-run's end is compared with the committed digest instead."""
        from asyncloco.train.commitments import committed_digest, revealed_digest, split_parts, unpack_reveal

        try:
            start, end = split_parts(revealed)
            parts = []
            for part in (start, end):
                parts.append(unpack_reveal(part, self.trainer.numel) if self.cfg.runtime.uses_error_feedback else (part, None))
        except ValueError as error:
            return None, f"the revealed inner state is malformed: {error}"
        (start_inner, start_residual), (end_inner, end_residual) = parts
        if committed_digest(revealed_digest(start_inner), start_residual) != task.state_start:
            return None, "the revealed inner state does not match its commitment"
        if len(end) == 0:
            if task.device_class == self.compute_class:
                return (start_inner, start_residual, end_inner, end_residual), ""  # the re-run's end digest decides
            return None, ("the reveal has no end state, which a peer of another compute class than the verifier's "
                          "must send (it is compared within the state tolerance)")
        if committed_digest(revealed_digest(end_inner), end_residual) != task.state_end:
            return None, "the revealed end state does not match its commitment"
        return (start_inner, start_residual, end_inner, end_residual), ""

    def check_revealed(self, task: Verify, revealed: "Buffer") -> Comparison:
        """Commitments (``inner_state: carry``): ``revealed`` is the peer's inner state at the lease's start and at its
        end (train/commitments.py ``pack_parts``; each in the canonical layout of train/commitments.py ``inner_state_chunks``, with
        error feedback followed by the residual, ``pack_reveal``). Each must hash to its commitment (``state_start``,
        ``state_end``); the lease re-run from the start must give the submitted pseudo-gradient, and end at the committed
        end: bitwise (the digest) for a peer of the verifier's compute class, within :meth:`state_tolerance` of the
        revealed end (:func:`state_gap`) for another class."""
        from asyncloco.train.commitments import committed_digest, inner_state_digest, load_inner_state

        parts, why = self._parts(task, revealed)
        base, why_base = start_theta(task) if parts is not None else (None, "")
        if parts is None or base is None:
            return Comparison(False, False, math.inf, -1.0, why or why_base)
        start, residual, end_inner, end_residual = parts
        trainer = self.trainer
        try:
            load_inner_state(trainer.optimizer, start)
        except ValueError as error:
            return Comparison(False, False, math.inf, -1.0, f"the revealed inner state is malformed: {error}")
        implausible = implausible_state(trainer.optimizer)
        if implausible is not None:
            trainer.reset_inner_state()
            return Comparison(False, False, math.inf, -1.0, f"the revealed inner state is not one AdamW reaches: {implausible}")
        trainer.reset_state = False
        try:
            rerun, left = self._rerun(task.lease, base, residual, self._sign_rotation(task))
        finally:
            trainer.reset_state = True
        own_class = task.device_class == self.compute_class
        inner_end = inner_state_digest(trainer.optimizer)
        end = None if inner_end is None else committed_digest(inner_end, left)
        ours = None if own_class else state_moments(trainer.optimizer)
        comparison = compare(rerun, task.update, *self.bounds(task))
        # kept (written to the store) only for a check that passes: a failed one leaves no file behind
        keep = comparison.ok and own_class and self.keep_end and end == task.state_end
        kept = self._end_state(task, left) if keep else None
        trainer.reset_inner_state()
        if not comparison.ok:
            return comparison
        if own_class:
            if end != task.state_end:
                return Comparison(False, comparison.bitwise, comparison.rel_error, comparison.cosine,
                                  "the re-run's inner state at the lease's end differs from the committed one")
            return comparison if kept is None else replace(comparison, end_state=kept)
        assert ours is not None
        # another compute class: the re-run's end state differs from the peer's in the last bits, so its digest cannot
        # be compared; the revealed end (which hashes to the committed one) must be within the state tolerance of it
        scale = None if left is None else float((rerun + left).norm())  # the upload the residual was cut from
        failed = self._end_state_failure(ours, end_inner, left, end_residual, scale)
        if failed:
            return Comparison(False, comparison.bitwise, comparison.rel_error, comparison.cosine, failed)
        # its revealed end (which hashes to the committed one) is where its next lease starts (coordinator/chained.py)
        kept = self.keep_revealed_end(task, revealed) if self.keep_end else None
        return Comparison(True, comparison.bitwise, comparison.rel_error, comparison.cosine,
                          comparison.detail + f" (peer's compute class {task.device_class or 'unknown'!r}, the "
                          f"verifier's {self.compute_class!r}: its end state within {self.state_tolerance():g} of the re-run's)",
                          end_state=kept)

    def _end_state(self, task: Verify, residual: Optional[torch.Tensor]) -> Optional["Buffer"]:
        """The trainer's inner state (and the residual ``residual``, with error feedback) in the single-state layout a
        reveal's part has (train/commitments.py ``pack_reveal``, built without a GIL-held copy): the end state of the
        lease just re-run, put in :attr:`store`."""
        from asyncloco.train.commitments import inner_state_buffer, pack_reveal_buffer

        inner = inner_state_buffer(self.trainer.optimizer)  # its own buffer, laid out by numpy
        if inner is None:
            return None
        return self.keep(task, pack_reveal_buffer(inner, residual) if self.cfg.runtime.uses_error_feedback else inner)

    def keep(self, task: Verify, state: Optional["Buffer"]) -> Optional["Buffer"]:
        """``task``'s end state put in :attr:`store` under its lease id (coordinator/chained.py ``StateStore``; None: none)."""
        return None if state is None else self.store.put(task.lease.lease_id, state)

    def keep_revealed_end(self, task: Verify, revealed: "Buffer") -> Optional["Buffer"]:
        """The end part of ``revealed`` (train/commitments.py ``pack_parts``) kept as :meth:`keep` keeps it: on disk
        written to its file straight from the reveal's bytes (one pass over 1.8 GB at 150m), in memory a copy (a view
        would hold the whole reveal). None when it has no end part or is malformed."""
        from asyncloco.train.commitments import revealed_end, split_parts

        if self.store.directory is None:
            return self.keep(task, revealed_end(revealed))
        try:
            part = split_parts(revealed)[1]
        except ValueError:
            return None
        return self.keep(task, part) if len(part) else None

    def _end_state_failure(self, ours: StateMoments, end_inner: "Buffer", left: Optional[torch.Tensor],
                           end_residual: Optional[torch.Tensor], scale: Optional[float]) -> str:
        """Why a foreign-class peer's revealed end state is not the re-run's within :meth:`state_tolerance` ("": it is)."""
        from asyncloco.train.commitments import load_inner_state

        trainer = self.trainer
        try:
            load_inner_state(trainer.optimizer, end_inner)
            implausible = implausible_state(trainer.optimizer)
            theirs = state_moments(trainer.optimizer)
        except ValueError as error:
            return f"the revealed end state is malformed: {error}"
        finally:
            trainer.reset_inner_state()
        if implausible is not None:
            return f"the revealed end state is not one AdamW reaches: {implausible}"
        gaps, problem = state_gap(ours, theirs, left, end_residual, scale)
        if problem is not None:
            return f"the revealed end state differs from the re-run's: {problem}"
        tolerance = self.state_tolerance()
        names = {"m": "first moment (exp_avg)", "v": "second moment (exp_avg_sq)", "u": "AdamW step m̂/(√v̂+eps)",
                 "precond": "step size 1/(√v̂+eps), RMS log-ratio"}
        over = [f"{names[key]} {gaps[key]:.3g}" for key in names if gaps[key] > tolerance]
        if over:
            return (f"the revealed end state differs from the re-run's beyond the state tolerance {tolerance:g} "
                    f"(relative L2 error): " + ", ".join(over))
        # the residual is the part of the upload its codec dropped: the upload's own bound, of the upload's norm
        # (measured on other CPU kernels: 1.4e-4 int8, 2.0e-3 sgn15of16; config.py CROSS_DEVICE_STATE_TOLERANCE's file)
        bound = self.cross_device_bounds()[0]
        if gaps["residual"] > bound:
            return (f"the revealed end state's error-feedback residual differs from the re-run's by {gaps['residual']:.3g} "
                    f"of the upload's norm, beyond the upload's cross-device tolerance {bound:g}")
        return ""
