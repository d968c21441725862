"""Per-call timeouts from the measured speed of the link to the coordinator, not loopback constants.

A 600 MB θ over 10 Mbit/s takes 8 minutes; a fixed 10-minute timeout is right for that link only, while on a
50 Mbit/s one it leaves a dead call hanging 8 minutes too long. :class:`LinkSpeed` learns the throughput of
each direction from the peer's completed bulk calls (``get_model`` = down, ``submit`` = up) and derives

    timeout = min(ceiling, max(floor, factor × bytes / measured bytes-per-second) × backoff ** attempt)

Before any measurement it uses ``assumed_bytes_per_s`` (default 0.1 Mbit/s: slow enough for a home uplink's
first call to finish — at 1 Mbit/s a home link's first 369 kB upload timed out at the 30 s floor, docs/wan.md; a
link that dies is caught sooner by the frames' idle timeouts, so a long first limit costs little; the floor keeps
small models' calls from timing out on latency). A download's time includes one round trip and the coordinator's
work, so that estimate errs low (timeouts err long): the safe side. An upload's sample is the body's arrival as the
coordinator measured it (``Ack.received_s``): its decode, gate and lock wait made a fast peer's first sample look
slow, and the coordinator judges a peer's reported uplink (coordinator/logic/leases.py ``fresh_reason``). A call
is a throughput sample when it carries at least ``min_bytes`` or lasts at least ``min_seconds`` (a small body on a
slow link: the int4 upload of a tiny model, 190 kB, takes 15 s at 0.1 Mbit/s); shorter, smaller calls are
latency-bound and are not used.

:meth:`LinkSpeed.transfer_s` is the peer's estimate of one lease's transfer time (download θ + upload the
pseudo-gradient): what a coordinator needs to add to the lease deadline so that a peer on a slow link is not
expired for the time its bytes spend on the wire (a peer can send it with its lease request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Literal, Optional

__all__ = ["LinkSpeed", "Direction"]

Direction = Literal["up", "down"]
_DIRECTIONS = ("up", "down")


@dataclass
class LinkSpeed:
    factor: float = 3.0
    floor_s: float = 30.0
    ceiling_s: float = 6 * 3600.0
    backoff: float = 2.0
    smoothing: float = 0.3  # weight of a new sample in the exponential moving average
    min_bytes: int = 256 * 1024
    min_seconds: float = 2.0
    assumed_bytes_per_s: float = 1e5 / 8
    measured: Dict[str, Optional[float]] = field(default_factory=lambda: {"up": None, "down": None})
    samples: Dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"factor must be >= 1 (a timeout below the expected transfer time fails every call), got {self.factor}")
        if not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError(f"need 0 < floor_s <= ceiling_s, got floor_s={self.floor_s}, ceiling_s={self.ceiling_s}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.backoff < 1:
            raise ValueError(f"backoff must be >= 1, got {self.backoff}")
        if self.assumed_bytes_per_s <= 0:
            raise ValueError(f"assumed_bytes_per_s must be > 0, got {self.assumed_bytes_per_s}")

    @staticmethod
    def _check(direction: str) -> str:
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        return direction

    def observe(self, direction: Direction, nbytes: int, seconds: float) -> bool:
        """Record a completed transfer; returns whether it counted as a throughput sample."""
        self._check(direction)
        if seconds <= 0 or not math.isfinite(seconds) or nbytes <= 0:
            return False
        if nbytes < self.min_bytes and seconds < self.min_seconds:  # latency-bound: says nothing of the rate
            return False
        sample = nbytes / seconds
        previous = self.measured[direction]
        self.measured[direction] = sample if previous is None else (1 - self.smoothing) * previous + self.smoothing * sample
        self.samples[direction] += 1
        return True

    def bytes_per_s(self, direction: Direction) -> float:
        measured = self.measured[self._check(direction)]
        return measured if measured is not None else self.assumed_bytes_per_s

    def expected_s(self, direction: Direction, nbytes: int) -> float:
        """Seconds ``nbytes`` should take at the measured speed."""
        return nbytes / self.bytes_per_s(direction)

    def timeout(self, direction: Direction, nbytes: int, attempt: int = 0) -> float:
        """The time limit of a call carrying ``nbytes``; ``attempt`` counts earlier failures of the same call."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        base = max(self.floor_s, self.factor * self.expected_s(direction, nbytes))
        return min(self.ceiling_s, base * self.backoff**attempt)

    def transfer_s(self, down_bytes: int, up_bytes: int) -> float:
        """Expected seconds on the wire for one lease: download ``down_bytes``, upload ``up_bytes``."""
        return self.expected_s("down", down_bytes) + self.expected_s("up", up_bytes)

    def as_dict(self) -> Dict[str, object]:
        return {
            "up_bytes_per_s": self.measured["up"],
            "down_bytes_per_s": self.measured["down"],
            "samples": dict(self.samples),
        }
