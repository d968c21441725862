"""Structured JSON-lines log of every coordinator decision (one object per line, flushed at once).

Each record has ``time`` (unix seconds), ``type`` (assign, hold, applied, duplicate, rejected,
expired, eval, start, stop, ...) and a ``reason`` where a decision was made, so a real run can be
read side by side with a simulator trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from asyncloco.clock import SYSTEM_CLOCK, Clock

__all__ = ["Journal"]


class Journal:
    """Appends one JSON object per decision to ``path``, stamped with ``clock``'s wall time (the coordinator's
    clock: a fake one in the in-process tests, so the journal reads in the run's own time)."""

    def __init__(self, path: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.clock = path, clock
        self._fh: TextIO | None = path.open("a", buffering=1)

    def write(self, kind: str, **fields: Any) -> None:
        if self._fh is None:
            return
        record = {"time": round(self.clock.time(), 3), "type": kind, **fields}
        self._fh.write(json.dumps(record, sort_keys=True, default=str) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
