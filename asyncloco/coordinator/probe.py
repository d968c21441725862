"""The update gate's probe: the loss on a small fixed batch held by the coordinator, at θ and at θ − s·Δ.

The daemon evaluates it before ``handle`` for the updates :func:`asyncloco.coordinator.gate.wants_probe`
names, and passes the two losses in the ``SubmitUpdate`` event (so they are in the write-ahead log and
the logic stays pure); :func:`asyncloco.coordinator.gate.score` uses them to decide the gray zone. See
``docs/threat-model.md`` for what it is for and what it costs.

θ − s·Δ is θ moved a short step ``s`` (``runtime.gate.probe_step``) along the candidate's local progress
(Δ = θ_base − θ_local, the peer's pseudo-gradient): an honest update lowers the loss on data no peer trains
on, a sign-flipped one raises it, a random one barely changes it.

The probe batch is the last ``sequences`` rows of the held-out validation set when the workload has one
(the LM workload), else the workload's first training batch. The evaluation runs on the probe's own copy
of the model, on ``runtime.eval_device`` (the daemon's periodic evaluation runs concurrently on its model).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
from torch import nn

from asyncloco.models.workload import Workload, load_flat_params

__all__ = ["Probe", "probe_batch"]

logger = logging.getLogger(__name__)


def probe_batch(workload: Workload, sequences: int) -> Any:
    """The fixed probe batch of ``workload``: held-out rows where it has them, else its first training batch."""
    if sequences < 1:
        raise ValueError(f"runtime.gate.probe_sequences must be >= 1, got {sequences}")
    rows = getattr(workload, "rows", None)
    val_ids = getattr(workload, "val_ids", None)
    if isinstance(rows, torch.Tensor) and isinstance(val_ids, torch.Tensor) and len(val_ids) > 0:
        return rows[val_ids[-sequences:]]
    return workload.batch(0, 0)


class Probe:
    """Loss on the probe batch at θ and at θ − s·Δ. Deterministic for a given θ and Δ on one machine; the
    daemon records its outcome in the event, so a replay never needs to recompute it."""

    def __init__(self, workload: Workload, model: nn.Module, sequences: int, device: str | torch.device = "cpu") -> None:
        self.workload = workload
        self.model = copy.deepcopy(model).to(torch.device(device))
        self.model.eval()
        self.batch = probe_batch(workload, sequences)
        self._at: tuple[int, float] | None = None  # (version, loss at θ of that version)

    def _loss(self, flat: torch.Tensor) -> float:
        load_flat_params(self.model, flat)
        with torch.no_grad():
            return float(self.workload.loss(self.model, self.batch))

    def losses(self, version: int, theta: torch.Tensor, update: torch.Tensor, step: float = 1.0) -> tuple[float, float]:
        """(loss at θ, loss at θ − ``step`` × ``update``); the first is cached per ``version``. ``theta`` and
        ``update`` are not modified."""
        if self._at is None or self._at[0] != version:
            self._at = (version, self._loss(theta))
        before = self._at[1]
        moved = torch.sub(theta, update, alpha=step)
        after = self._loss(moved)
        del moved
        return before, (after if math.isfinite(after) else math.inf)
