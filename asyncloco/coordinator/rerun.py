"""Re-running a lease and judging the submitted pseudo-gradient against the re-run (issue 16; docs/threat-model.md,
"Verified work"): :class:`Rerunner` and :func:`compare`, used by the coordinator's own verification worker
(coordinator/verify.py) and by validator peers (asyncloco/validator.py) alike."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from asyncloco.config import RunConfig
    from asyncloco.coordinator.logic import Lease, Verify
    from asyncloco.models.workload import Workload
    from asyncloco.peer.inner import InnerTrainer
    from asyncloco.transport.codec_format import EncodedTensor

__all__ = ["Comparison", "compare", "implausible_state", "moment_bound", "Rerunner"]


# ------------------------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Comparison:
    ok: bool
    bitwise: bool
    rel_error: float  # ‖submitted − rerun‖ / ‖rerun‖
    cosine: float
    detail: str


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


# -------------------------------------------------------------------------------------------- re-running


class Rerunner:
    """Re-runs leases with the peers' own inner loop. One model replica, built on first use, reused for every
    lease (its optimizer state is cleared before each: ``inner_state: reset``)."""

    def __init__(self, cfg: "RunConfig", workload: "Workload", device: str = "cpu") -> None:
        from asyncloco.peer.inner import compute_class

        self.cfg = cfg
        self.workload = workload
        self.device = device
        self.compute_class = compute_class(device)
        self._trainer: Optional["InnerTrainer"] = None

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
            from asyncloco.peer.inner import InnerTrainer

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
        from asyncloco.peer.feedback import ErrorFeedback
        from asyncloco.transport.codecs import decode

        result = self.trainer.run(base, lease.shard, lease.start_offset, lease.steps, lease.lr_offset)
        runtime = self.cfg.runtime
        if runtime.codec == "none":
            return result.pseudo_gradient, None, None
        # the peer's own arithmetic (peer/feedback.py), so that an honest upload reproduces bit for bit
        feedback = ErrorFeedback(runtime.codec, runtime.uses_error_feedback, runtime.error_feedback_decay)
        feedback.residual = residual
        feedback.sign_rotation = sign_rotation
        encoded, decoded = feedback.encode_decoded(result.pseudo_gradient)
        update = decoded if decoded is not None else decode(encoded, result.pseudo_gradient.numel())
        return update, feedback.pending, encoded

    def rerun_carried(self, lease: Lease, base: torch.Tensor, state: bytes, residual: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, bytes, Optional[torch.Tensor], Optional["EncodedTensor"]]:
        """An honest run of ``lease`` from θ = ``base`` and the inner state ``state`` (peer/inner.py's canonical
        layout; b"": fresh) with the error-feedback ``residual``: the update as the coordinator decodes it, the inner
        state at its end (same layout), the residual it leaves and its encoding (None without a codec). What a
        repair applies in place of an expelled peer's update (coordinator/substitute.py)."""
        from asyncloco.peer.inner import inner_state_chunks, load_inner_state

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
        return compare(self.rerun(task.lease, task.base, self._sign_rotation(task)), task.update, *self.bounds(task))

    def check_revealed(self, task: Verify, revealed: bytes) -> Comparison:
        """Commitments (``inner_state: carry``): ``revealed`` is the peer's inner state at the lease's start in the
        canonical layout (peer/inner.py ``inner_state_chunks``; with error feedback followed by the residual,
        peer/reveal.py ``pack_reveal``). It must hash to the committed ``state_start``; the lease re-run from it must
        give the submitted pseudo-gradient and end at the committed ``state_end``."""
        from asyncloco.peer.inner import inner_state_digest, load_inner_state, revealed_digest
        from asyncloco.peer.reveal import committed_digest, unpack_reveal

        trainer = self.trainer
        residual = None
        if self.cfg.runtime.uses_error_feedback:  # the residual is revealed with the inner state (peer/reveal.py)
            try:
                revealed, residual = unpack_reveal(revealed, trainer.numel)
            except ValueError as error:
                return Comparison(False, False, math.inf, -1.0, f"the revealed inner state is malformed: {error}")
        if committed_digest(revealed_digest(revealed), residual) != task.state_start:
            return Comparison(False, False, math.inf, -1.0, "the revealed inner state does not match its commitment")
        try:
            load_inner_state(trainer.optimizer, revealed)
        except ValueError as error:
            return Comparison(False, False, math.inf, -1.0, f"the revealed inner state is malformed: {error}")
        implausible = implausible_state(trainer.optimizer)
        if implausible is not None:
            trainer.reset_inner_state()
            return Comparison(False, False, math.inf, -1.0, f"the revealed inner state is not one AdamW reaches: {implausible}")
        trainer.reset_state = False
        try:
            rerun, left = self._rerun(task.lease, task.base, residual, self._sign_rotation(task))
        finally:
            trainer.reset_state = True
        inner_end = inner_state_digest(trainer.optimizer)
        end = None if inner_end is None else committed_digest(inner_end, left)
        trainer.reset_inner_state()
        comparison = compare(rerun, task.update, *self.bounds(task))
        if not comparison.ok:
            return comparison
        if task.device_class == self.compute_class:
            if end != task.state_end:
                return Comparison(False, comparison.bitwise, comparison.rel_error, comparison.cosine,
                                  "the re-run's inner state at the lease's end differs from the committed one")
            return comparison
        # another compute class: the re-run's inner state differs from the peer's in the last bits (even where the
        # codec made the uploads agree), so its digest cannot be compared; the next lease starts from the committed
        # end (the chain), unchecked here
        return Comparison(True, comparison.bitwise, comparison.rel_error, comparison.cosine,
                          comparison.detail + f" (peer's compute class {task.device_class or 'unknown'!r}, the "
                          f"verifier's {self.compute_class!r}: the end state is not compared)")
