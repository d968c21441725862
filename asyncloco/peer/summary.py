"""What a volunteer peer counts about itself: its summary, where its time went, and its measured speed.

:class:`PeerSummary` is what ``asyncloco peer join --summary`` writes (as JSON, replaced atomically after every
round; dashboards, demo.py and the tests read it): rounds, steps, verdicts, resends, traffic, the wall seconds
split by what the peer waited for (``assign``, ``download``, ``train``, ``upload``) and the idle fraction
``1 - train / wall``. :func:`observed_speed` turns one round's step times into the steady-state throughput the
peer publishes (peer/runner.py's module doc says why the first step is left out). The rounds are peer/runner.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from asyncloco.algo.dylu import ema
from asyncloco.clock import Clock

__all__ = ["PeerSummary", "add_timing", "observed_speed", "time_split", "update_idle", "write_summary"]


@dataclass
class PeerSummary:
    peer_id: str = ""
    rounds: int = 0
    steps: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    resends: int = 0
    tokens_per_s: float = 0.0
    slowdown: float = 1.0
    traffic: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1  # ranks of this peer's torch.distributed group
    units_per_step: int = 0  # tokens (samples) of the global batch
    # wall seconds from the first lease request on, split by what the peer waited for; idle = 1 - train / wall
    timing: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    # at the first stop request (Ctrl+C, a measured run's end): wall seconds since the first lease request and the
    # training seconds by then, the lease in training included (None: not stopped)
    stop_wall_s: Optional[float] = None
    stop_train_s: Optional[float] = None
    idle_fraction: float = 0.0
    prefetch_hits: int = 0
    swarm_downloads: int = 0  # --swarm: θ bodies taken from the swarm (transport/swarm.py)
    swarm_fallbacks: int = 0  # --swarm: downloads the coordinator served after the swarm failed
    swarm_chunks_served: int = 0  # --swarm --serve: θ chunks this peer served to others (transport/swarm_serve.py)
    swarm_bytes_served: int = 0  # their payload bytes
    prefetch_misses: int = 0
    fresh_starts: int = 0  # leases granted with a fresh inner state (the coordinator's answer to a slow uplink)
    discarded: int = 0  # overlapped rounds: leases trained from an update then not applied, so not submitted
    training: str = ""  # the lease being trained right now (its emulated slowdown included); "" between leases


def write_summary(summary: PeerSummary, path: Optional[Path]) -> None:
    """Replace ``path`` (if any) with ``summary`` as JSON, atomically (a reader never sees half a file)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary.__dict__, indent=1))
    tmp.replace(path)


def add_timing(summary: PeerSummary, key: str, seconds: float) -> None:
    """Count ``seconds`` spent on ``key`` (``assign``, ``download``, ``train``, ``upload``)."""
    summary.timing[key] = summary.timing.get(key, 0.0) + seconds


def time_split(summary: PeerSummary, wall: float) -> Optional[tuple[float, float, float, float]]:
    """What the speed report carries of this peer's time (transport/link.py ``LinkReport``): seconds computing
    (``train``), uploading, downloading (a θ downloaded while the previous lease trained, asked for ahead, included:
    as an upload overlapped with training is), and ``wall`` — the seconds since its first lease request; None before."""
    if not wall > 0:
        return None
    timing = summary.timing
    downloading = timing.get("download", 0.0) + timing.get("download_ahead", 0.0)
    return (timing.get("train", 0.0), timing.get("upload", 0.0), downloading, wall)


def update_idle(summary: PeerSummary, loop_started: Optional[float], clock: Clock) -> None:
    """The wall seconds since ``loop_started`` (the first lease request; ``clock.monotonic()``) and the idle fraction."""
    if loop_started is None:
        return
    wall = clock.monotonic() - loop_started
    busy = summary.timing.get("train", 0.0)
    summary.wall_seconds = wall
    summary.idle_fraction = max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0


def next_speed(speed: Optional[float], observed: float, samples: int, decay: float) -> float:
    """The peer's speed after a lease measured ``observed``: the first lease's replaces the estimate it joined with (a
    few steps timed while the peer started up — on `home150` 7,086 units/s against 12,000 in its leases, and the
    leases sized to the link came out short for four rounds while the average climbed), later ones are averaged in
    (``schedule.speed_ema``: one slow lease does not halve the next lease)."""
    return observed if samples == 0 or speed is None else ema(speed, observed, decay)


def observed_speed(
    step_seconds: list[float], units_per_step: int, slowdown: float, speed: Optional[float]
) -> Optional[float]:
    """This round's steady-state throughput of the (emulated) device, or None for no new sample; ``speed`` is
    the current estimate, ``slowdown`` the emulated slowdown (``--slowdown``).

    The first step is left out (peer/runner.py's module doc). A 1-step round has only that cold step: it is used
    only when it is faster than the current estimate — it then proves the estimate too low (a peer measured
    during a busy start-up must be able to climb out of 1-step leases), and it can never drag it down.
    In a group ``units_per_step`` is the global batch's and the step times are the leader's (they
    include DDP's all-reduce): the group reports one combined speed."""
    warm = step_seconds[1:]
    if warm and sum(warm) > 0:
        return len(warm) * units_per_step / (sum(warm) * slowdown)
    if step_seconds and step_seconds[0] > 0:
        cold = units_per_step / (step_seconds[0] * slowdown)
        if speed is None or cold > speed:
            return cold
    return None
