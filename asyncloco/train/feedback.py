"""Error feedback for lossy upload codecs (docs/compression.md).

A lossy codec ``C`` (int8, int4, int2, the sparse ``topk{k}b{b}``/``grp{G}b{b}``, the sign codecs ``sgn{p}of{q}``)
sends ``C(Δ)`` instead of the pseudo-gradient ``Δ``. With error feedback the peer keeps what was dropped, the
residual ``e = (Δ + β·e_prev) − decode(C(Δ + β·e_prev))``, and adds the share β (``runtime.error_feedback_decay``;
1 is classic error feedback) of it to its next pseudo-gradient. With β = 1 everything a peer computed reaches θ,
only later; with β < 1 the old residual fades, which is what made the sign codecs match fp32 uploads with Delayed
Nesterov (docs/compression.md has the measurements).

One :class:`ErrorFeedback` per peer, shared by the runtime (asyncloco/peer/runner.py) and the simulator
(asyncloco/sim/engine.py), so both apply exactly the same arithmetic. What happens to the residual:

* **across leases** it is kept: the residual of round r goes into round r + 1, whatever θ version or
  shard the next lease has (it is a parameter-space direction, like the pseudo-gradient itself);
* **an update the coordinator applied** (accepted, duplicates included) makes the new residual current;
* **an update that was not applied** (refused by the gate or as too stale, lost in transit, its lease
  expired) drops the residual to zero: the coordinator gives that lease's steps back to be trained
  again, and re-sending part of a refused update would only be refused again;
* **a restart or an ``--identity`` rejoin** starts from zero: the residual lives in memory only (one
  θ-sized fp32 tensor), never on disk, so there is nothing stale to resume. At most one round's dropped
  part is lost, the same as one unsent round;
* **with re-run verification** (``runtime.verify``, carried inner state) the residual is committed and revealed
  with the inner state (asyncloco/peer/reveal.py), and the verifier re-runs the feedback's arithmetic with this
  class (asyncloco/coordinator/rerun.py).

With ``enabled=False`` (or the lossless codec ``none``) :meth:`encode` is plain ``codecs.encode``.
"""

from __future__ import annotations

import logging

import torch

from asyncloco.transport.codecs import LOSSLESS, EncodedTensor, decode, encode, wire_bytes

__all__ = ["ErrorFeedback", "upload_bytes"]

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """The residual of one peer for codec ``codec``: ``encode`` → send → ``settle(applied)``."""

    def __init__(self, codec: str, enabled: bool = True, decay: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"error-feedback decay must be in (0, 1], got {decay!r} (runtime.error_feedback_decay)")
        self.codec = codec
        self.enabled = enabled and codec not in LOSSLESS
        self.decay = decay  # the share of the residual carried into the next upload
        self.sign_rotation: int | None = None  # a cross-class verifier's re-encoding with the peer's (coordinator/rerun.py)
        self.residual: torch.Tensor | None = None  # what earlier applied uploads dropped
        self._pending: torch.Tensor | None = None  # the residual once the upload in flight is applied

    def encode_decoded(self, pseudo_gradient: torch.Tensor) -> tuple[EncodedTensor, torch.Tensor | None]:
        """Encode ``pseudo_gradient`` plus the residual; returns the encoding and, with feedback on, what
        the coordinator will decode from it. Raises :class:`~asyncloco.transport.errors.CodecError` (NaN/Inf)
        without touching the residual."""
        if not self.enabled:
            return encode(self.codec, pseudo_gradient, sign_rotation=self.sign_rotation), None
        if self.residual is None:
            corrected = pseudo_gradient
        elif self.decay == 1.0:
            corrected = pseudo_gradient + self.residual
        else:
            corrected = pseudo_gradient + self.decay * self.residual
        encoded = encode(self.codec, corrected, sign_rotation=self.sign_rotation)
        decoded = decode(encoded, corrected.numel())
        self._pending = corrected - decoded
        return encoded, decoded

    def encode(self, pseudo_gradient: torch.Tensor) -> EncodedTensor:
        """The runtime's path: the encoding to submit (call :meth:`settle` with the outcome)."""
        return self.encode_decoded(pseudo_gradient)[0]

    def roundtrip(self, pseudo_gradient: torch.Tensor) -> torch.Tensor:
        """The simulator's path: the update exactly as the coordinator decodes it."""
        encoded, decoded = self.encode_decoded(pseudo_gradient)
        return decoded if decoded is not None else decode(encoded, pseudo_gradient.numel())

    def settle(self, applied: bool) -> None:
        """The outcome of the last upload: applied keeps its residual, anything else drops it (module doc)."""
        if not self.enabled:
            return
        if not applied and (self._pending is not None or self.residual is not None):
            logger.info("update not applied: the error-feedback residual is dropped")
        self.residual = self._pending if applied else None
        self._pending = None

    def drop(self) -> None:
        """Start afresh, with no residual (a lease granted with a fresh start: peer/runner.py)."""
        self.residual = self._pending = None

    @property
    def pending(self) -> torch.Tensor | None:
        """The residual the upload in flight leaves if it is applied (committed as the lease's end state when a
        verified run uses feedback: train/commitments.py ``committed_digest``)."""
        return self._pending

    def residual_norm(self) -> float:
        return 0.0 if self.residual is None else float(self.residual.norm())


def upload_bytes(codec: str, numel: int) -> int:
    """Exact bytes of one upload of a ``numel``-parameter pseudo-gradient (transport.codecs.wire_bytes)."""
    return wire_bytes(codec, numel)
