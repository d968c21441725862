"""What the coordinator tells its operator: the journal line and per-peer counters of every action
(:meth:`Monitoring.bookkeep`, live and in replay alike), status.json and the dashboard
(coordinator/status.py, coordinator/dashboard.py), periodic evaluation and the metrics sinks
(coordinator/sinks.py). Reads the node's state (coordinator/node.py); never changes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from asyncloco.clock import Clock, pause
from asyncloco.config import RunConfig
from asyncloco.coordinator.dashboard import DashboardServer
from asyncloco.coordinator.journal import Journal
from asyncloco.coordinator.logic import (
    Action,
    awaiting_verdicts,
    fresh_reason,
    Admitted,
    Applied,
    Assign,
    Duplicate,
    Held,
    Expelled,
    Expired,
    Hold,
    Lease,
    Left,
    Notice,
    Quarantined,
    Incompatible,
    Refused,
    Rejected,
    Released,
    Revoked,
    Verdict,
    Verify,
)
from asyncloco.coordinator.node import CoordinatorNode
from asyncloco.coordinator.sinks import MetricsSink, build_sinks
from asyncloco.coordinator.status import History, RateMeter, SubmitTimings, peer_row, summary_line
from asyncloco.coordinator.verify import DaemonVerification
from asyncloco.models.workload import Workload, load_flat_params

__all__ = ["Monitoring", "PeerStats", "RefusalLog", "Waiter", "STATUS_FILE", "JOURNAL_FILE"]

logger = logging.getLogger(__name__)

STATUS_FILE = "status.json"
JOURNAL_FILE = "events.jsonl"


@dataclass
class PeerStats:
    speed: float = 0.0
    leases: int = 0
    steps_assigned: int = 0
    applied: int = 0
    steps_applied: int = 0
    staleness_sum: int = 0
    expired: int = 0
    rejected: int = 0
    duplicates: int = 0
    # --- for `asyncloco status` and the dashboard (see asyncloco/coordinator/status.py) ---
    name: str = ""  # the name the peer gave at join (empty until the peer sends one)
    device: str = ""  # the peer's training device, as it reported it
    last_seen: float = 0.0  # wall time of the last lease, submission or verdict involving this peer
    last_steps: int = 0  # DyLU steps of the peer's latest lease
    last_inner_loss: Optional[float] = None  # mean inner training loss of the latest applied submission
    quarantined_until: float = 0.0  # the update gate quarantined the peer until then (wall time)


class RefusalLog:
    """Bounded record of admission refusals: journal lines at most ``burst`` per ``window`` seconds (then
    one line counting the suppressed ones), and a short per-peer cache of the last refusal so a peer that
    keeps retrying a bad token is answered without verifying or logging it again."""

    def __init__(self, burst: int = 20, window: float = 10.0, cache_s: float = 5.0, max_cached: int = 4096) -> None:
        self.burst, self.window, self.cache_s, self.max_cached = burst, window, cache_s, max_cached
        self._window_start = 0.0
        self._in_window = 0
        self.suppressed = 0
        self.total = 0
        self._cache: dict[str, tuple[Any, str, float]] = {}

    def note(self, journal: Journal, peer: str, reason: str, token_id: str = "", lease_id: str = "", *, now: float) -> None:
        self.total += 1
        if now - self._window_start >= self.window:
            if self.suppressed:
                journal.write("refused_suppressed", count=self.suppressed, window_s=self.window)
                logger.warning("%d more admission refusals in the last %.0fs not logged", self.suppressed, self.window)
            self._window_start, self._in_window, self.suppressed = now, 0, 0
        if self._in_window >= self.burst:
            self.suppressed += 1
            return
        self._in_window += 1
        journal.write("refused", peer=peer, token_id=token_id, lease_id=lease_id, reason=reason)
        logger.warning("refused %s: %s", peer[-8:], reason)

    def refuse(self, journal: Journal, peer: str, reason: str, now: float, token: Any = None) -> str:
        self.note(journal, peer, reason, now=now)
        if token is not None:
            self.remember(peer, token, reason, now)
        return reason

    def remember(self, peer: str, token: Any, reason: str, now: float) -> None:
        if len(self._cache) >= self.max_cached:
            self._cache.clear()
        self._cache[peer] = (token, reason, now + self.cache_s)

    def cached(self, peer: str, token: Any, now: float) -> str | None:
        hit = self._cache.get(peer)
        if hit is None or hit[0] != token or hit[2] < now:
            return None
        self.total += 1
        return hit[1]


@dataclass
class Waiter:
    future: "asyncio.Future[Optional[Lease]]"  # None: released without a lease (ask again)
    since: float


@dataclass
class Stats:
    peers: dict[str, PeerStats] = field(default_factory=dict)
    evals: list[dict[str, float]] = field(default_factory=list)
    # --- monitoring (status.json, dashboard, summary line, metrics sinks); not checkpointed ---
    updates: RateMeter = field(default_factory=lambda: RateMeter(time.time()))
    history: History = field(default_factory=History)
    submit_timing: SubmitTimings = field(default_factory=SubmitTimings)
    evals_logged: int = 0  # evaluations already sent to the metrics sinks
    dashboard_url: str = ""
    document: dict[str, Any] = field(default_factory=dict)  # the latest status document
    document_json: bytes = b"{}"  # the same, as written to status.json (the dashboard serves these bytes)
    sinks: list[MetricsSink] = field(default_factory=list)
    dashboard: Optional[DashboardServer] = None

    def peer(self, name: str) -> PeerStats:
        return self.peers.setdefault(name, PeerStats())


class Monitoring:
    """Journal, per-peer stats, held requests' futures, status.json, evaluation, dashboard and sinks."""

    def __init__(
        self,
        cfg: RunConfig,
        node: CoordinatorNode,
        workload: Workload,
        model: torch.nn.Module,
        identity: Callable[[], dict[str, Any]],
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.dir = node.dir
        self.clock: Clock = node.clock
        self.workload = workload
        self.model = model
        self.identity = identity  # the daemon's fields of the status document (peer id, addresses, method ...)
        self.stats = Stats(updates=RateMeter(self.clock.time()))
        self.journal = Journal(self.dir / JOURNAL_FILE, self.clock)
        self.refusals = RefusalLog()
        self.waiters: dict[str, Waiter] = {}  # held lease requests by peer (coordinator/serving.py)
        self.verification: Optional[DaemonVerification] = None  # set by the daemon (coordinator/verify.py)
        self.eval_tasks: set[asyncio.Task[None]] = set()
        # one evaluation at a time, in the order they were started (asyncio.Lock wakes its waiters first in, first
        # out): they share one model, and status.json's evals are listed by version
        self._eval_lock = asyncio.Lock()
        self._last_eval_version = -1
        self._eval_model: Optional[torch.nn.Module] = None
        self._request_refusals: dict[str, tuple[str, float]] = {}  # peer -> (reason, when): journal repeats once a minute

    @contextlib.contextmanager
    def silenced(self) -> Iterator[None]:
        """Replay: the bookkeeping runs, the journal (which holds these decisions already) is not written."""
        journal = self.journal
        self.journal = Journal(self.dir / JOURNAL_FILE, self.clock)
        self.journal.close()
        try:
            yield
        finally:
            self.journal = journal

    # ------------------------------------------------------------------------------- bookkeeping

    def bookkeep(self, actions: list[Action]) -> bool:
        """The daemon's own state for these actions (journal, per-peer stats, held requests); live and in
        replay alike. True when durable state changed."""
        changed = False
        for action in actions:
            changed |= self.record(action)
        return changed

    def record(self, action: Action) -> bool:
        """Journal and count one action; True when it changed durable state."""
        if isinstance(action, Assign):
            return self._record_assign(action)
        if isinstance(action, Hold):
            self.journal.write("hold", peer=action.peer, until=action.until, waiting_for=list(action.waiting_for), reason=action.reason)
            return False
        if isinstance(action, Applied):
            return self._record_applied(action)
        if isinstance(action, Expired):
            self.stats.peer(action.peer).expired += 1
            self.journal.write("expired", peer=action.peer, lease_id=action.lease_id, shard=action.shard, steps=action.steps, reason=action.reason)
            logger.warning("lease %s of %s given back: %s", action.lease_id, action.peer[-8:], action.reason)
            return True
        if isinstance(action, Held):
            self.stats.peer(action.peer).last_seen = self.clock.time()
            self.journal.write("held", peer=action.peer, lease_id=action.lease_id, version=action.version, reason=action.reason,
                               sketch=action.sketch)
            return True
        if isinstance(action, Duplicate):
            self.stats.peer(action.peer).duplicates += 1
            self.stats.peer(action.peer).last_seen = self.clock.time()
            self.journal.write("duplicate", peer=action.peer, lease_id=action.lease_id, version=action.version, reason=action.reason)
            return False
        if isinstance(action, Rejected):
            return self._record_rejected(action)
        if isinstance(action, (Admitted, Refused, Incompatible, Revoked, Quarantined)):
            return self._record_admission(action)
        if isinstance(action, Released):
            waiter = self.waiters.pop(action.peer, None)
            if waiter is not None and not waiter.future.done():
                waiter.future.set_result(None)
            self.journal.write("released", peer=action.peer, reason=action.reason)
            return True
        if isinstance(action, Left):
            self.journal.write("peer_left", peer=action.peer, reason=action.reason)
            logger.warning("peer %s left: %s", action.peer[-8:], action.reason)
            return True
        if isinstance(action, (Verify, Verdict, Expelled)):  # verification (coordinator/verify.py)
            return self.verification.record(action, self.journal) if self.verification is not None else False
        if isinstance(action, Notice):
            self.journal.write("notice", reason=action.reason)
            logger.warning("%s", action.reason)
            return False
        raise AssertionError(f"unhandled action {action!r}")

    def _record_assign(self, action: Assign) -> bool:
        """A lease handed out: the peer's lease and step counts, its speed as the logic knows it, the journal."""
        lease = action.lease
        stats = self.stats.peer(action.peer)
        stats.leases += 1
        stats.steps_assigned += lease.steps
        info = self.node.state.peers.get(action.peer)
        stats.speed = info.speed if info is not None else 0.0
        stats.last_steps = lease.steps
        stats.last_seen = self.clock.time()
        self.journal.write("assign", reason=action.reason, **lease.to_dict())
        logger.debug("lease %s → %s: %d steps on shard %d (%s)", lease.lease_id, action.peer[-8:], lease.steps, lease.shard, action.reason)
        return True

    def _record_applied(self, action: Applied) -> bool:
        """An update applied to θ: the peer's applied counts and staleness, the update rate, the journal."""
        stats = self.stats.peer(action.peer)
        stats.applied += 1
        stats.steps_applied += action.steps
        stats.staleness_sum += action.staleness
        stats.last_seen = self.clock.time()
        self.stats.updates.note(stats.last_seen)
        self.journal.write(
            "applied",
            peer=action.peer,
            lease_id=action.lease_id,
            version=action.version,
            staleness=action.staleness,
            steps=action.steps,
            shard=action.shard,
            local_updates=self.node.state.local_updates,
            reason=action.reason,
            gate=action.gate,
            sketch=action.sketch,
        )
        logger.debug("applied %s from %s: version %d, staleness %d", action.lease_id, action.peer[-8:], action.version, action.staleness)
        return True

    def _record_rejected(self, action: Rejected) -> bool:
        """A refused request or update: counted and journaled (a request refused again for the same reason within
        a minute is not); durable state changed only when a dropped-by-policy update consumed its lease."""
        if not action.lease_id and self._repeated_refusal(action.peer, action.reason):
            return False  # the same refused request again (e.g. a quarantined peer polling): counted once a minute
        self.stats.peer(action.peer).rejected += 1
        self.stats.peer(action.peer).last_seen = self.clock.time()
        self.journal.write("rejected", peer=action.peer, lease_id=action.lease_id, reason=action.reason)
        logger.warning("rejected %s from %s: %s", action.lease_id or "request", action.peer[-8:], action.reason)
        # a dropped-by-policy update consumed its lease: durable state changed
        return action.lease_id in self.node.state.applied

    def _record_admission(self, action: Admitted | Refused | Incompatible | Revoked | Quarantined) -> bool:
        """Admission (coordinator/admission.py), the compatibility check (asyncloco/fingerprint.py) and quarantine:
        journaled and logged; True when durable state changed."""
        if isinstance(action, Admitted):
            if action.new:
                self.journal.write("admitted", peer=action.peer, token_id=action.token_id, name=action.name, reason=action.reason)
                logger.info("admitted %s as %r (token %s)", action.peer[-8:], action.name, action.token_id)
            return action.new
        if isinstance(action, Refused):
            self.refusals.note(self.journal, action.peer, action.reason, action.token_id, action.lease_id, now=self.clock.time())
            return False
        if isinstance(action, Incompatible):  # the compatibility check refused this peer (asyncloco/fingerprint.py)
            self.journal.write("incompatible", peer=action.peer, differing=list(action.differing),
                               peer_version=action.peer_version, reason=action.reason)
            logger.warning("refused %s: %s differ (peer runs asyncloco %s)", action.peer[-8:], ", ".join(action.differing), action.peer_version)
            return True
        if isinstance(action, Revoked):
            self.journal.write("revoked", token_id=action.token_id, peer=action.peer, reason=action.reason)
            logger.warning("token %s revoked%s", action.token_id, f" (peer {action.peer[-8:]})" if action.peer else "")
            return True
        self.stats.peer(action.peer).quarantined_until = action.until
        self.journal.write("quarantined", peer=action.peer, until=action.until, reason=action.reason)
        logger.warning("peer %s quarantined until %.0f: %s", action.peer[-8:], action.until, action.reason)
        return True

    def _repeated_refusal(self, peer: str, reason: str, every_s: float = 60.0) -> bool:
        """True when ``peer``'s request was refused for the same reason less than ``every_s`` ago."""
        now = self.clock.monotonic()
        last = self._request_refusals.get(peer)
        if last is not None and last[0] == reason and now - last[1] < every_s:
            return True
        self._request_refusals[peer] = (reason, now)
        return False

    def hand_out(self, actions: list[Action]) -> None:
        """Answer the held requests the actions assigned a lease to."""
        for action in actions:
            if isinstance(action, Assign):
                waiter = self.waiters.pop(action.peer, None)
                if waiter is not None and not waiter.future.done():
                    waiter.future.set_result(action.lease)

    # ------------------------------------------------------------------------------------ status

    def status_document(self, now: float) -> dict[str, Any]:
        """Everything ``asyncloco status`` and the dashboard show (field meanings: coordinator/status.py)."""
        state = self.node.state
        peers: dict[str, Any] = {}
        for peer_id, stats in self.stats.peers.items():
            info = state.peers.get(peer_id)
            row = dict(stats.__dict__)
            if info is not None:
                row["speed"] = info.speed
                # its link as measured on its real transfers (bytes/s) and its time split (status.time_split)
                row["link_up"], row["link_down"], row["time_s"] = info.link_up, info.link_down, info.time_split
                # its leases start from a fresh inner state (an uplink that cannot carry a reveal): "" when they carry it
                row["fresh_start"] = fresh_reason(state.policy, info)
                keep = state.policy.verify.keep_class if state.policy.verify is not None else ""
                if row["fresh_start"] and keep and info.device_class in ("", keep):  # leases.carries_checked
                    row["fresh_start"] += "; carried after a lease re-run here (its end state kept: no reveal)"
                # its checks awaiting their verdicts (applied first or held): what runtime.verify.carry_backlog_mb bounds
                row["checks_awaiting"] = awaiting_verdicts(state, peer_id)
            seen = max(stats.last_seen, min(info.last_seen, now)) if info is not None else stats.last_seen
            peers[peer_id] = peer_row(row, alive=info is not None and info.alive, last_seen=seen)
        updates_per_s = self.stats.updates.rate(now)
        self.stats.history.add(
            {"time": now, "version": state.version, "local_updates": state.local_updates, "updates_per_s": updates_per_s}
        )
        identity = self.identity()
        return {
            "run_id": self.cfg.runtime.run_id,
            "software_version": identity["software_version"],
            "peer_id": identity["peer_id"],
            "multiaddrs": identity["multiaddrs"],
            "method": identity["method"],
            "parameters": identity["parameters"],  # θ's size: the model's parameter count
            "speed_unit": "tok/s" if self.cfg.task.kind == "lm" else "samples/s",
            "version": state.version,
            "local_updates": state.local_updates,
            "active_leases": len(state.leases),
            "updates_per_s": updates_per_s,
            "rejections": sum(stats.rejected for stats in self.stats.peers.values()),
            "started": self.stats.updates.started,  # when this coordinator process started
            "dashboard": self.stats.dashboard_url or None,
            "peers": peers,
            "evals": list(self.stats.evals),
            "history": list(self.stats.history.samples),
            "traffic": identity["traffic"],
            "submit_timing": self.stats.submit_timing.document(),
            "verification": self.verification.status() if self.verification is not None else None,
            "swarm": identity["swarm"],
            "updated": now,
        }

    def write_status(self) -> None:
        now = self.clock.time()
        status = self.status_document(now)
        text = json.dumps(status, indent=1)
        self.stats.document = status
        self.stats.document_json = text.encode("utf-8")  # what the dashboard serves, byte for byte
        tmp = self.dir / (STATUS_FILE + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.dir / STATUS_FILE)
        new_evals = self.stats.evals[self.stats.evals_logged :]
        self.stats.evals_logged = len(self.stats.evals)
        for sink in self.stats.sinks:
            for record in new_evals:
                sink.log_eval(record)

    # -------------------------------------------------------------------------------- evaluation

    def maybe_evaluate(self, force: bool = False) -> None:
        state = self.node.state
        version = state.version
        if version == self._last_eval_version:
            return
        if not force and version % self.cfg.runtime.eval_every != 0:
            return
        self._last_eval_version = version
        theta = state.params.clone()
        local_updates = state.local_updates
        task = asyncio.get_running_loop().create_task(self.evaluate(version, local_updates, theta))
        self.eval_tasks.add(task)
        task.add_done_callback(self.eval_tasks.discard)

    async def evaluate(self, version: int, local_updates: int, theta: torch.Tensor) -> None:
        def run() -> dict[str, float]:
            model = self._model_for_eval()  # runtime.eval_device
            load_flat_params(model, theta.to(next(model.parameters()).device))
            return self.workload.evaluate(model)

        async with self._eval_lock:
            metrics = await asyncio.to_thread(run)
            record = {"time": self.clock.time(), "version": version, "local_updates": local_updates, **metrics}
            self.stats.evals.append(record)
            self.journal.write("eval", **record)
        logger.info("eval at version %d: %s", version, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.write_status()

    def eval_model(self) -> torch.nn.Module:
        """The model evaluations run on (``runtime.eval_device``); the repair's validation losses use a copy of it."""
        return self._model_for_eval()

    def _model_for_eval(self) -> torch.nn.Module:
        """The model evaluation runs on: ``self.model`` on CPU, else a copy kept on ``runtime.eval_device``."""
        device = torch.device(self.cfg.runtime.eval_device)
        if device.type == "cpu":
            return self.model
        if self._eval_model is None:
            if not torch.cuda.is_available():
                raise ValueError(f"runtime.eval_device is {device} but torch sees no CUDA device; set it to cpu")
            import copy

            self._eval_model = copy.deepcopy(self.model).to(device)
        return self._eval_model

    # --------------------------------------------------------------------------- sinks, dashboard

    def start(self) -> None:
        """Metrics sinks and the dashboard, as ``runtime.log_to`` / ``runtime.dashboard_port`` ask."""
        runtime = self.cfg.runtime
        self.stats.sinks = build_sinks(runtime.log_to, self.dir, runtime.run_id, self.cfg.model_dump(mode="json"))
        self.stats.evals_logged = len(self.stats.evals)  # a resumed run logged its earlier evaluations already
        if runtime.dashboard_port is not None:
            self.stats.dashboard = DashboardServer(lambda: self.stats.document_json, runtime.dashboard_host, runtime.dashboard_port)
            self.stats.dashboard_url = self.stats.dashboard.start()

    def stop(self) -> None:
        if self.stats.dashboard is not None:
            self.stats.dashboard.stop()
            self.stats.dashboard = None
        for sink in self.stats.sinks:
            try:
                sink.close()
            except Exception as error:  # a sink's own trouble must not mask the shutdown
                logger.warning("closing a metrics sink failed: %r", error)
        self.stats.sinks = []

    async def loop(self, stop: asyncio.Event) -> None:
        """Refresh status.json every 2 s (the dashboard polls it); a summary line every runtime.summary_every s."""
        next_summary = self.clock.monotonic() + self.cfg.runtime.summary_every
        while not stop.is_set():
            await pause(self.clock, stop, 2.0)
            self.write_status()
            if self.clock.monotonic() >= next_summary:
                next_summary += self.cfg.runtime.summary_every
                status = self.stats.document
                logger.info("%s", summary_line(status))
                scalars = {
                    "updates_per_s": float(status["updates_per_s"]),
                    "peers_alive": float(sum(1 for row in status["peers"].values() if row["alive"])),
                    "active_leases": float(status["active_leases"]),
                    "rejections": float(status["rejections"]),
                    "local_updates": float(status["local_updates"]),
                }
                for sink in self.stats.sinks:
                    sink.log_run(scalars, step=int(status["version"]), wall_time=float(status["updated"]))


def journal_path(directory: Path) -> Path:
    return directory / JOURNAL_FILE
