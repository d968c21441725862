"""What the inner trainer (asyncloco/train/inner.py) needs around a CUDA device: each step's seconds without
draining the device's queue (:class:`StepClock`), and when a pinned host buffer may be reused (:func:`released`).
Both also run on the CPU: the clock without a fence times each step as it returns."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

__all__ = ["StepClock", "released"]


class StepClock:
    """Each step's seconds for ``on_step``. Without ``fence`` (CPU: the step is done when its call returns) the
    step's own duration. With ``fence`` (CUDA: records an event on the stream; the returned marker's
    ``synchronize()`` waits for it) the queue is never drained: after step j is queued, the clock waits for step
    j − 1's marker and reports the time between the two completions, so the device always has the next step
    to run while Python prepares the one after (a stream synchronisation after every step cost 5 % of the
    60m preset's throughput on an H200, docs/gpu.md). The reports lag one step; :meth:`flush` reports the last.
    The first report runs from the clock's creation; all reports together span creation to the last completion."""

    def __init__(self, on_step: Callable[[float], None], fence: Optional[Callable[[], Any]] = None) -> None:
        self.on_step = on_step
        self.fence = fence
        self.pending: Any = None
        self.last = time.perf_counter()

    def step_done(self, step_started: float) -> None:
        """Call after queuing a step's work (``step_started``: when it began)."""
        if self.fence is None:
            self.on_step(time.perf_counter() - step_started)
            return
        marker = self.fence()
        if self.pending is not None:
            self._report(self.pending)
        self.pending = marker

    def flush(self) -> None:
        """Report the step whose completion is still outstanding (after the last step)."""
        if self.pending is not None:
            marker, self.pending = self.pending, None
            self._report(marker)

    def _report(self, marker: Any) -> None:
        marker.synchronize()
        now = time.perf_counter()
        self.on_step(now - self.last)
        self.last = now


def released(buffer: torch.Tensor) -> bool:
    """True when nothing but ``buffer`` itself uses its memory: no view of it (what ``_to_host`` hands out), no
    numpy array over it. (A tensor's storage is counted once per tensor or array on it, and once for the
    storage object asked here.)"""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # not in this torch: never reuse
        return False
    return int(use_count(buffer.untyped_storage()._cdata)) <= 2
