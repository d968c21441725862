"""What an organiser sees of a running coordinator: ``status.json``, ``asyncloco status`` and the summary line.

The coordinator daemon writes one status document (``status.json`` in its checkpoint directory, and the
same dictionary at ``/status.json`` of its dashboard when ``--dashboard-port`` is given). This module
holds the pieces of that document that are not the daemon's decisions:

* :class:`RateMeter` — applied updates per second over a sliding window (the "updates/s" figure);
* :class:`History` — a bounded time series of (time, version, local updates, updates/s) for the
  dashboard's charts, its newest point always current (when full, every other sample is dropped and
  the sampling interval doubles, so a run of any length fits in :data:`MAX_HISTORY` points);
* :func:`peer_row` — the per-peer record (raw counters plus derived means);
* :class:`SubmitTimings` — the coordinator's seconds per submission by stage (``submit_timing``; the
  ``submissions`` line of :func:`submit_timing_lines`);
* :func:`summary_line` — the periodic INFO line; :func:`format_status` — the ``asyncloco status`` table;
* :func:`read_status` — a status document from a checkpoint directory or a live dashboard URL.

Peer records keep every raw counter under its old name (``leases``, ``steps_assigned``, ``applied``,
``staleness_sum``, ...) and add the derived ``steps_per_lease`` and ``mean_staleness``, the peer's
``alive`` flag and ``last_seen`` time.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections import deque
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "History",
    "MAX_HISTORY",
    "RateMeter",
    "STATUS_FILE",
    "SubmitTimings",
    "fixed",
    "format_status",
    "last_metric",
    "peer_row",
    "read_status",
    "summary_line",
]

STATUS_FILE = "status.json"
MAX_HISTORY = 600
RATE_WINDOW_S = 60.0


class RateMeter:
    """Events per second over the last ``window`` seconds (or since ``started`` when the run is younger)."""

    def __init__(self, started: float, window: float = RATE_WINDOW_S) -> None:
        if window <= 0:
            raise ValueError(f"the rate window must be positive, got {window}")
        self.started = started
        self.window = window
        self.times: deque[float] = deque()

    def note(self, now: float) -> None:
        self.times.append(now)
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self.times and self.times[0] <= now - self.window:
            self.times.popleft()

    def rate(self, now: float) -> float:
        self._forget(now)
        span = min(self.window, now - self.started)
        if span <= 0:
            return 0.0
        return len(self.times) / span


class History:
    """A bounded series of status samples; ``add`` keeps at most one sample per ``interval`` seconds."""

    def __init__(self, interval: float = 2.0, capacity: int = MAX_HISTORY) -> None:
        if capacity < 2:
            raise ValueError(f"history capacity must be >= 2, got {capacity}")
        self.interval = interval
        self.capacity = capacity
        self.samples: list[dict[str, float]] = []

    def add(self, sample: dict[str, float]) -> bool:
        """Record ``sample`` (which must have a ``time``); True when appended, False when it replaced the newest.

        The newest sample is always the current state; the ones before it are at least ``interval`` apart.
        """
        if len(self.samples) >= 2 and self.samples[-1]["time"] - self.samples[-2]["time"] < self.interval:
            self.samples[-1] = sample
            return False
        self.samples.append(sample)
        if len(self.samples) > self.capacity:
            # thin out: keep every other sample (always the newest) and sample half as often from now on
            self.samples = self.samples[::-1][::2][::-1]
            self.interval *= 2
        return True


class SubmitTimings:
    """Where the coordinator's time per submission goes (the status document's ``submit_timing``): decoding
    the body, waiting for the node's lock, the gate's probe, and ``decide`` (the logic with the write-ahead
    log's append and fsync beside it). Seconds summed over the submissions timed, and the largest of each."""

    STAGES = ("decode", "lock_wait", "probe", "decide")

    def __init__(self) -> None:
        self.count = 0
        self.total = {stage: 0.0 for stage in self.STAGES}
        self.largest = {stage: 0.0 for stage in self.STAGES}

    def add(self, **seconds: float) -> None:
        """One submission's seconds per stage (a stage it skipped: 0)."""
        unknown = set(seconds) - set(self.STAGES)
        if unknown:
            raise ValueError(f"unknown submission stage(s) {sorted(unknown)}; stages are {self.STAGES}")
        self.count += 1
        for stage in self.STAGES:
            value = float(seconds.get(stage, 0.0))
            self.total[stage] += value
            self.largest[stage] = max(self.largest[stage], value)

    def document(self) -> dict[str, Any]:
        mean = {stage: (self.total[stage] / self.count if self.count else 0.0) for stage in self.STAGES}
        return {"count": self.count, "mean_s": mean, "max_s": dict(self.largest), "total_s": dict(self.total)}


def peer_row(stats: dict[str, Any], *, alive: bool, last_seen: float) -> dict[str, Any]:
    """One peer's status record: ``stats`` (a ``PeerStats`` as a dict) plus derived means and liveness."""
    leases = int(stats.get("leases", 0))
    applied = int(stats.get("applied", 0))
    row = dict(stats)
    row["alive"] = alive
    row["last_seen"] = last_seen
    row["steps_per_lease"] = stats.get("steps_assigned", 0) / leases if leases else 0.0
    row["mean_staleness"] = stats.get("staleness_sum", 0) / applied if applied else 0.0
    row["time_split"] = time_split(stats.get("time_s"))
    return row


def time_split(seconds: Any) -> Optional[dict[str, float]]:
    """A peer's time as shares of its wall time, from its speed report's seconds (computing, uploading, downloading,
    wall; peer/summary.py ``time_split``): ``computing``, ``uploading``, ``downloading`` and ``waiting`` (the rest:
    asking for leases, held in a grace window, backing off). With overlapped rounds transfers run while the peer
    computes, so the first three may sum above 1 and waiting is then 0. None before its first report."""
    if not seconds or len(seconds) != 4 or not seconds[3] > 0:
        return None
    compute, up, down, wall = (float(s) for s in seconds)
    return {"computing": compute / wall, "uploading": up / wall, "downloading": down / wall,
            "waiting": max(0.0, 1.0 - (compute + up + down) / wall)}


def split_text(split: Optional[dict[str, float]]) -> str:
    """``93/3/2/2`` — percent computing / uploading / downloading / waiting (``-`` before the first report)."""
    if not split:
        return "-"
    return "/".join(fixed(100 * split[key], 0) for key in ("computing", "uploading", "downloading", "waiting"))


def last_metric(status: dict[str, Any], key: str) -> Optional[float]:
    """The newest evaluation's ``key`` (``perplexity``, ``loss``, ...), or None before the first one."""
    for record in reversed(status.get("evals") or []):
        if key in record:
            return float(record[key])
    return None


def fixed(value: Optional[float], digits: int) -> str:
    """``value`` with ``digits`` decimals, rounded as the dashboard's JavaScript ``toFixed`` does (the exact
    binary value, ties away from zero), so the table and the page show the same figures; "-" for none."""
    if value is None or not math.isfinite(value):
        return "-"
    exact = Decimal(value) if value != 0 else Decimal(0)  # JS prints -0 as "0.00", but -0.001 as "-0.00"
    return str(exact.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _fmt_metric(status: dict[str, Any]) -> str:
    perplexity = last_metric(status, "perplexity")
    if perplexity is not None:
        return f"val ppl {fixed(perplexity, 2)}"
    loss = last_metric(status, "loss")
    return f"val loss {fixed(loss, 4)}" if loss is not None else "val ppl -"


def summary_line(status: dict[str, Any]) -> str:
    """The coordinator's periodic INFO line, from a status document."""
    peers = status.get("peers", {})
    alive = sum(1 for row in peers.values() if row.get("alive"))
    return (
        f"version {status.get('version', 0)}, {fixed(status.get('updates_per_s', 0.0), 2)} updates/s, {_fmt_metric(status)}, "
        f"{alive}/{len(peers)} peers alive, {status.get('active_leases', 0)} leases in flight, "
        f"{status.get('rejections', 0)} rejections"
    )


def _ago(now: float, then: float) -> str:
    if not then:
        return "never"
    seconds = max(0.0, now - then)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def swarm_lines(swarm: Optional[dict[str, Any]]) -> list[str]:
    """Who serves what (transport/swarm.py ``SwarmSeed.status``): one line per version the seed
    holds — its holders (last 10 characters of their ids), the chunks the seed sent per chunk of the
    body — and one per recent report of a bad or slow source."""
    if not swarm:
        return []
    lines = []
    for body in swarm.get("bodies", []):
        holders = body.get("holders", [])
        shown = " ".join(str(h)[-10:] for h in holders[:8]) + (f" +{len(holders) - 8}" if len(holders) > 8 else "")
        chunks = max(1, int(body.get("chunks", 1)))
        lines.append(
            f"swarm v{body.get('version')} {body.get('codec')}: {len(holders)} serving peer(s) {shown or '-'}; "
            f"the coordinator sent {fixed(int(body.get('seed_copies', 0)) / chunks, 2)} × the body"
            + (f"; unlisted after reports: {' '.join(str(p)[-10:] for p in body.get('dropped', []))}" if body.get("dropped") else "")
        )
    for report in swarm.get("reports", [])[-3:]:
        lines.append(
            f"swarm report: {str(report.get('reporter'))[-10:]} says {str(report.get('source'))[-10:]} "
            f"(v{report.get('version')}): {str(report.get('reason'))[:120]}"
        )
    return lines


def submit_timing_lines(timing: Optional[dict[str, Any]]) -> list[str]:
    """The ``asyncloco status`` line of :class:`SubmitTimings`: the coordinator's mean seconds per submission and
    its stages (none before the first submission, or from a coordinator that does not report them)."""
    if not timing or not timing.get("count"):
        return []
    mean = timing.get("mean_s") or {}
    stages = "  ".join(f"{stage.replace('_', ' ')} {float(mean.get(stage, 0.0)):.3f}" for stage in SubmitTimings.STAGES)
    return [f"submissions {int(timing['count'])}: {sum(float(v) for v in mean.values()):.3f} s each ({stages})"]


def format_status(status: dict[str, Any], now: Optional[float] = None) -> str:
    """The human-readable ``asyncloco status`` output: a header and one table row per peer."""
    now = time.time() if now is None else now
    unit = status.get("speed_unit", "units/s")
    perplexity = last_metric(status, "perplexity")
    loss = last_metric(status, "loss")
    evals = status.get("evals") or []
    at = f" (at version {evals[-1].get('version')})" if evals else ""
    metric = fixed(perplexity, 2) if perplexity is not None else (f"loss {fixed(loss, 4)}" if loss is not None else "-")
    lines = [
        f"run {status.get('run_id', '?')} ({status.get('method', '?')}"
        + (f", {status['parameters'] / 1e6:.1f} M parameters" if status.get("parameters") else "")
        + f"), asyncloco {status.get('software_version', '?')}, "
        f"status written {_ago(now, float(status.get('updated', 0)))}",
        f"version {status.get('version', 0)}  local updates {status.get('local_updates', 0)}  "
        f"updates/s {fixed(status.get('updates_per_s', 0.0), 2)}  validation perplexity {metric}{at}",
        f"peers alive {sum(1 for r in status.get('peers', {}).values() if r.get('alive'))}/{len(status.get('peers', {}))}  "
        f"leases in flight {status.get('active_leases', 0)}  rejections {status.get('rejections', 0)}",
    ]
    if status.get("dashboard"):
        lines.append(f"dashboard {status['dashboard']}")
    lines += submit_timing_lines(status.get("submit_timing"))
    lines += swarm_lines(status.get("swarm"))
    header = (
        f"{'name':12s} {'id':10s} {'device':8s} {'speed ' + unit:>16s} {'DyLU steps':>10s} {'leases':>6s} "
        f"{'applied':>7s} {'mean stale':>10s} {'last seen':>10s} {'inner loss':>10s} {'% comp/up/down/wait':>19s}"
    )
    lines += ["", header, "-" * len(header)]
    rows = sorted(status.get("peers", {}).items(), key=lambda kv: (kv[1].get("name") or "", kv[0]))
    for peer_id, row in rows:
        lines.append(
            f"{(row.get('name') or '-')[:12]:12s} {peer_id[-10:]:10s} {(row.get('device') or '-')[:8]:8s} "
            f"{fixed(row.get('speed', 0.0), 0):>16s} {int(row.get('last_steps', 0)):10d} {int(row.get('leases', 0)):6d} "
            f"{int(row.get('applied', 0)):7d} {fixed(row.get('mean_staleness', 0.0), 2):>10s} "
            f"{_ago(now, float(row.get('last_seen', 0.0))):>10s} {fixed(row.get('last_inner_loss'), 4):>10s} "
            f"{split_text(row.get('time_split')):>19s}"
        )
    if not rows:
        lines.append("(no peer has joined yet)")
    return "\n".join(lines)


def read_status(*, checkpoint_dir: Optional[str | Path] = None, url: Optional[str] = None, timeout: float = 10.0) -> dict[str, Any]:
    """A status document from a coordinator's checkpoint directory or its dashboard (``http://host:port``)."""
    if (checkpoint_dir is None) == (url is None):
        raise ValueError("give exactly one of --checkpoint-dir DIR or --url http://HOST:PORT")
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / STATUS_FILE
        if not path.is_file():
            raise ValueError(
                f"{path} does not exist: pass the coordinator's runtime.checkpoint_dir (default runs/coordinator)"
            )
        try:
            document: Any = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}); is it a coordinator's status.json?") from None
    else:
        assert url is not None
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// (the coordinator's dashboard address), got {url!r}")
        endpoint = url if url.rstrip("/").endswith(".json") else url.rstrip("/") + "/status.json"
        try:
            with urllib.request.urlopen(endpoint, timeout=timeout) as response:
                document = json.loads(response.read().decode("utf-8"))
        except (urllib.error.URLError, OSError) as error:
            raise ValueError(
                f"could not read {endpoint} ({error}); is the coordinator running with --dashboard-port, "
                "and is that address reachable from here?"
            ) from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{endpoint} did not return a status document ({error})") from None
    if not isinstance(document, dict) or "version" not in document:
        raise ValueError("that is not a coordinator status document (no 'version' field)")
    return document
