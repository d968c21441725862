"""The networked coordinator: the pure decision logic driven by a real clock over hivemind.

What it does, in one place:

* starts a hivemind DHT node (a persistent identity in the checkpoint directory, so its peer id —
  the one peers pin — survives restarts; the same TCP port on ``--resume``), announces itself under
  the run id, and serves :class:`~asyncloco.transport.rpc.CoordinatorService`;
* feeds :func:`~asyncloco.coordinator.logic.handle` with events: speed reports read from the DHT
  (signed, schema-checked), lease requests (held for the grace period when the logic says so),
  submissions (decoded only after the transport checked their exact size), a 1-second tick that
  expires leases and closes grace windows, and departures of peers whose reports went stale;
* serves θ at each lease's base version (snapshots are kept only for versions that active leases
  still reference);
* appends every event it hands to the logic to a write-ahead log and fsyncs it before acknowledging
  anything (:mod:`asyncloco.coordinator.wal`), writes full snapshots in the background every
  ``runtime.snapshot_every`` updates / ``snapshot_every_s`` seconds (:mod:`asyncloco.coordinator.checkpoint`),
  and on ``--resume`` replays the log after the newest snapshot; also a JSON-lines journal of every
  decision, periodic validation metrics and a ``status.json`` for dashboards and the demo;
* on SIGINT/SIGTERM: snapshot, stop serving, shut hivemind down (no orphaned p2pd).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
import os
import shutil
import time
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from asyncloco import __version__
from asyncloco.clock import SYSTEM_CLOCK, Clock
from asyncloco.config import RunConfig
from asyncloco.coordinator.checkpoint import (
    SNAPSHOT_NAME,
    child_pids,
    load_snapshot,
    reap_stale_children,
    record_children,
    remove_partial_snapshots,
    save_snapshot,
    snapshot_wal_seq,
)
from asyncloco.coordinator.admission import REVOKED_FILE, AdmissionError, load_or_create_key, read_revoked, verify_token
from asyncloco.coordinator.journal import Journal
from asyncloco.fingerprint import mismatch_reason, run_fingerprint
from asyncloco.coordinator.logic import (
    Admit,
    Admitted,
    Refused,
    Revoke,
    Revoked,
    admission_problem,
    is_admitted,
    Action,
    Applied,
    Assign,
    CoordinatorState,
    Duplicate,
    Event,
    Expired,
    Hold,
    Lease,
    Fetched,
    Hello,
    HoldDropped,
    Left,
    Notice,
    PeerLeft,
    Quarantined,
    Released,
    Rejected,
    RequestWork,
    Restarted,
    SpeedReport,
    SubmitUpdate,
    Tick,
    Verdict,
    Verify,
    Expelled,
    handle,
    base_theta,
    new_state,
)
from asyncloco.coordinator.methods import build_method, coordinator_policy
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.probe import Probe
from asyncloco.coordinator.verify import DaemonVerification
from asyncloco.coordinator.wal import (
    WAL_DIR,
    WalRecord,
    WriteAheadLog,
    check_stamp,
    decode_event,
    open_log,
    read_records,
    software_stamp,
)
from asyncloco.coordinator.dashboard import DashboardServer
from asyncloco.coordinator.sinks import MetricsSink, build_sinks
from asyncloco.coordinator.status import History, RateMeter, peer_row, summary_line
from asyncloco.workloads import build_workload
from asyncloco.models.workload import Workload, flatten_params, load_flat_params, param_groups

__all__ = ["CoordinatorDaemon", "PeerStats"]

logger = logging.getLogger(__name__)

ENDPOINT_FILE = "endpoint.json"
IDENTITY_FILE = "identity.key"
STATUS_FILE = "status.json"
JOURNAL_FILE = "events.jsonl"
INITIAL_SNAPSHOT = "initial-state.pt"  # in wal/archive/ when runtime.wal_archive is on
RESUME_GRACE_S = 10.0  # after --resume, peers known from the checkpoint get this long to call again
# Events of the logic the write-ahead log can hold, by class name (every member of the Event union).
EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Event)}
# Written into every log record and snapshot; --resume refuses a different one (coordinator/wal.py, check_stamp).
SOFTWARE_STAMP = software_stamp(__version__, EVENT_TYPES)


async def _ping_peers(peer_ids: list[str], _dht: Any, node: Any) -> int:
    """Runs inside the DHT process (``dht.run_coroutine``): ping peers by id, so each side puts the other
    back in its routing table. Needed after a restart: the coordinator is the run's bootstrap node, comes
    back with an empty routing table under a new DHT node id, and the peers dropped the old one while it
    was down — so neither side's store/get reached the other and no speed report was seen again. The
    peers' p2p daemons are reachable by id alone once they have called an RPC (an open connection)."""
    from hivemind.p2p import PeerID

    found = await asyncio.gather(*(node.protocol.call_ping(PeerID.from_base58(peer)) for peer in peer_ids))
    return sum(node_id is not None for node_id in found)


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


class _RefusalLog:
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

    def note(self, journal: Journal, peer: str, reason: str, token_id: str = "", lease_id: str = "", now: float | None = None) -> None:
        now = time.time() if now is None else now
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
class _Waiter:
    future: "asyncio.Future[Optional[Lease]]"  # None: released without a lease (ask again)
    since: float


@dataclass
class _Stats:
    peers: dict[str, PeerStats] = field(default_factory=dict)
    evals: list[dict[str, float]] = field(default_factory=list)
    # --- monitoring (status.json, dashboard, summary line, metrics sinks); not checkpointed ---
    updates: RateMeter = field(default_factory=lambda: RateMeter(time.time()))
    history: History = field(default_factory=History)
    evals_logged: int = 0  # evaluations already sent to the metrics sinks
    dashboard_url: str = ""
    document: dict[str, Any] = field(default_factory=dict)  # the latest status document
    document_json: bytes = b"{}"  # the same, as written to status.json (the dashboard serves these bytes)
    sinks: list[MetricsSink] = field(default_factory=list)
    dashboard: Optional[DashboardServer] = None

    def peer(self, name: str) -> PeerStats:
        return self.peers.setdefault(name, PeerStats())


def lease_to_wire(lease: Lease, batch_size: int) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "base_version": lease.base_version,
        "shard": lease.shard,
        "start_offset": lease.start_offset,
        "steps": lease.steps,
        "lr_offset": lease.lr_offset,
        "batch_size": batch_size,
        "issued_at": lease.issued_at,
        "deadline": lease.deadline,
    }


class CoordinatorDaemon:
    """``await CoordinatorDaemon(cfg, checkpoint_dir=..., resume=...).run(stop_event)``."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        checkpoint_dir: Path | None = None,
        resume: bool = False,
        initial_peers: tuple[str, ...] = (),
        workload: Workload | None = None,
        clock: Clock = SYSTEM_CLOCK,
        crash_hook: Optional[Callable[[str], None]] = None,
    ) -> None:
        # --- transport seam (issue 8): every decision reads ``clock`` (a fake one in transport/memory.py's
        # tests); ``crash_hook`` (tests only) is called at each named kill point of _decide: "wal_appended"
        # (the event is in the log, not yet fsynced) and "wal_synced" (durable, nobody told yet)
        self.clock = clock
        self.crash_hook = crash_hook
        self.cfg = cfg
        self.dir = Path(checkpoint_dir or cfg.runtime.checkpoint_dir)
        self.resume = resume
        self.initial_peers = tuple(initial_peers)
        if not resume and (self.dir / "state.pt").exists():
            raise ValueError(
                f"{self.dir} already holds a run; continue it with --resume, or choose a new runtime.checkpoint_dir"
            )
        if self.dir.is_dir():
            remove_partial_snapshots(self.dir)
        self.workload = workload if workload is not None else build_workload(cfg)
        self.model = self.workload.build_model(cfg.seed)
        theta = flatten_params(self.model)
        self.numel = theta.numel()
        workers = cfg.outer.buffer_size or cfg.sim.workers
        self.spec, optimizer, transforms = build_method(cfg.schedule.method, cfg.outer, workers, param_groups(self.model))
        policy = coordinator_policy(cfg, self.spec, self.workload.units_per_step, simulated=False, numel=self.numel)
        # --- admission (coordinator/admission.py): the mode and allowlist go to the logic's policy
        policy = dataclasses.replace(policy, admission=cfg.runtime.admission, allowlist=frozenset(cfg.runtime.allowlist))
        # lease deadlines allow for a download + an upload, scaled from the measured upload by their byte ratio
        from asyncloco.transport.codecs import wire_bytes

        ratio = wire_bytes(cfg.runtime.download_codec, self.numel) / wire_bytes(cfg.runtime.codec, self.numel)
        policy = dataclasses.replace(policy, download_upload_ratio=ratio)
        self._admission_key = load_or_create_key(self.dir).public_key() if cfg.runtime.admission == "token" else None
        self._refusals = _RefusalLog()
        # The lease-id secret is part of the state (snapshots, and so --resume) — fresh for a new run.
        self.state: CoordinatorState = new_state(
            theta, optimizer, transforms, policy, self.workload.shard_sizes(), cfg.seed, lease_secret=os.urandom(32)
        )
        self.stats = _Stats()
        self._service: Any = None  # the transport service, once serving (upload times per submission)
        self._request_refusals: dict[str, tuple[str, float]] = {}  # peer -> (reason, when): journal repeats once a minute
        self._decode_buffers: list[torch.Tensor] = []  # at most one idle θ-sized int8 decode buffer (submit)
        self._snapshot_buffers: dict[str, torch.Tensor] = {}  # the background snapshot's copies, reused
        # --- durability (write-ahead log + background snapshots; see _decide and coordinator/wal.py)
        self.replayed = 0  # log records replayed at --resume
        self.snapshot_bytes = 0  # bytes of snapshots written by this process (benchmarks)
        self.snapshots_written = 0
        self._snapshot_task: Optional[asyncio.Task[None]] = None
        self._snapshot_seq = 0  # the log record the newest durable snapshot covers
        self._updates_since_snapshot = 0
        self._changed_since_snapshot = False
        self._last_snapshot_at = time.monotonic()
        # --- verification of the work (issue 16; coordinator/verify.py): re-runs, verdicts, repairs after an expulsion
        self.swarm_seed: Any = None  # transport/swarm.py SwarmSeed while serving (run), if runtime.swarm
        self.verification: Optional[DaemonVerification] = (
            DaemonVerification(self, EVENT_TYPES) if cfg.runtime.verify.enabled else None
        )
        archive = cfg.runtime.wal_archive or cfg.runtime.verify.enabled  # a repair replays from its anchor's log
        if resume:
            self._load()
        else:
            if self.dir.is_dir() and any((self.dir / WAL_DIR).glob("*.wal")):
                raise ValueError(
                    f"{self.dir} holds a write-ahead log ({WAL_DIR}/) but no snapshot: continue it with --resume if "
                    "it has a state.pt elsewhere, or choose a new runtime.checkpoint_dir"
                )
            self.wal = open_log(self.dir, 0, archive=archive, stamp=SOFTWARE_STAMP)
        self.journal = Journal(self.dir / JOURNAL_FILE)
        self.lock = asyncio.Lock()
        self.waiters: dict[str, _Waiter] = {}
        self.multiaddrs: list[str] = []
        self.peer_id: str = ""
        self._eval_tasks: set[asyncio.Task[None]] = set()
        self._last_eval_version = -1
        self._stopping = False  # set under the lock at shutdown: no RPC changes state after that
        self._stop_event: Optional[asyncio.Event] = None
        self._fingerprint_refusals: dict[str, str] = {}  # peer id → why its fingerprint was refused
        self.reach_problem: Optional[str] = None  # what the start-up reachability check found (_check_reach)
        self.fingerprint: dict[str, str] = {}  # this run's (asyncloco/fingerprint.py), computed at start-up

    # ----------------------------------------------------------------------------- persistence

    def _load(self) -> None:
        """--resume: the newest snapshot, then every later record of the write-ahead log replayed through
        ``handle`` and the same bookkeeping (nobody is answered), then a ``Resumed`` mark."""
        snapshot = load_snapshot(self.dir)
        check_stamp(snapshot.get("stamp"), SOFTWARE_STAMP, f"the snapshot {self.dir / SNAPSHOT_NAME}")
        self.state.load_state_dict(snapshot["coordinator"])
        known = set(PeerStats.__dataclass_fields__)
        for name, values in snapshot.get("peer_stats", {}).items():
            self.stats.peers[name] = PeerStats(**{k: v for k, v in values.items() if k in known})
        self.stats.evals = list(snapshot.get("evals", []))
        self._snapshot_seq = snapshot_wal_seq(snapshot)
        archive = self.cfg.runtime.wal_archive or self.cfg.runtime.verify.enabled
        self.wal = open_log(self.dir, self._snapshot_seq, archive=archive, stamp=SOFTWARE_STAMP)
        self.replayed = self.replay(read_records(self.dir / WAL_DIR, self._snapshot_seq))
        # The restart itself is an event of the logic (held requests died with their RPCs; the downtime is not
        # the peers' silence: they get RESUME_GRACE_S to call again), logged like every other.
        now = self.clock.time()
        restarted = Restarted(RESUME_GRACE_S)
        _, actions = handle(self.state, restarted, now)
        self.wal.append_event(restarted, now)
        self.wal.sync()
        self._bookkeep(actions)
        self._changed_since_snapshot = self.replayed > 0
        logger.info(
            "resumed from %s: snapshot at log record %d + %d replayed: version %d, %d local updates, %d active leases",
            self.dir,
            self._snapshot_seq,
            self.replayed,
            self.state.version,
            self.state.local_updates,
            len(self.state.leases),
        )

    def replay(self, records: typing.Iterable[WalRecord]) -> int:
        """Feed logged records through ``handle`` and the daemon's bookkeeping, answering nobody."""
        from asyncloco.transport.codecs import EncodedTensor, decode

        def decode_blob(codec: str, numel: int, data: memoryview) -> torch.Tensor:
            return decode(EncodedTensor.from_bytes(codec, numel, data), self.numel)

        journal = getattr(self, "journal", None)
        self.journal = Journal(self.dir / JOURNAL_FILE)
        self.journal.close()  # replayed decisions are in the journal already
        count = 0
        try:
            for record in records:
                check_stamp(record.stamp, SOFTWARE_STAMP, f"log record {record.seq} in {self.dir / WAL_DIR}")
                if record.kind == "event":
                    event = decode_event(record, EVENT_TYPES, decode_blob)
                    _, actions = handle(self.state, event, record.now)
                    if self.verification is not None:
                        self.verification.replay_seq = record.seq  # a repair replays up to this record
                    self._bookkeep(actions)
                else:  # e.g. the "HoldDropped" marks of older logs, which stamps refuse before this point
                    raise ValueError(f"log record {record.seq}: unknown mark {record.type!r}")
                count += 1
        finally:
            if self.verification is not None:
                self.verification.replay_seq = None
            if journal is not None:
                self.journal = journal
        return count

    def _snapshot_payload(self, copy: bool, reuse: bool = False) -> dict[str, Any]:
        """Everything a snapshot holds. ``copy``: θ and the optimizer's tensors cloned (they change in place);
        the θ the logic keeps per base version (``base_params``) never changes, so it is shared. ``reuse`` (the
        background snapshots, one at a time): the copies go into buffers kept from the previous snapshot — a
        fresh θ-sized allocation costs ≈ 7 memcpy in page faults, and this copy is taken under the lock."""
        buffers: dict[str, torch.Tensor] = {}

        def clone(value: Any, key: str) -> Any:
            if isinstance(value, torch.Tensor):
                if not reuse:
                    return value.clone()
                buffer = self._snapshot_buffers.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = torch.empty_like(value)
                buffers[key] = buffer
                return buffer.copy_(value)
            if isinstance(value, dict):
                return {k: clone(v, f"{key}/{k}") for k, v in value.items()}
            if isinstance(value, list):
                return [clone(v, f"{key}/{i}") for i, v in enumerate(value)]
            if isinstance(value, tuple):
                return tuple(clone(v, f"{key}/{i}") for i, v in enumerate(value))
            return value

        coordinator = self.state.state_dict()
        if copy:
            coordinator = {k: (v if k == "base_params" else clone(v, k)) for k, v in coordinator.items()}
            if reuse:
                self._snapshot_buffers = buffers
        return {
            "coordinator": coordinator,
            "stamp": SOFTWARE_STAMP,
            "peer_stats": {name: dict(stats.__dict__) for name, stats in self.stats.peers.items()},
            "evals": list(self.stats.evals),
            "config": self.cfg.model_dump(mode="json"),
            "wal_seq": self.wal.last_seq,
        }

    def _write_snapshot(self, payload: dict[str, Any]) -> None:
        """In a worker thread: write the snapshot durably, then delete the log segments it covers."""
        path = save_snapshot(self.dir, payload)
        self.snapshot_bytes += path.stat().st_size
        if self.wal.archive_dir is not None and int(payload["wal_seq"]) == 0:
            # with wal_archive, the initial snapshot + every segment replay the whole run (tests, audits)
            self.wal.archive_dir.mkdir(exist_ok=True)
            shutil.copyfile(path, self.wal.archive_dir / INITIAL_SNAPSHOT)
        self.snapshots_written += 1
        if self.verification is not None:  # repair anchors (coordinator/verify.py)
            self.verification.note_snapshot(path, int(payload["wal_seq"]), int(payload["coordinator"]["version"]))
        self._snapshot_seq = int(payload["wal_seq"])
        self.wal.drop_covered(self._snapshot_seq)

    async def _save(self) -> None:
        """A snapshot now, waited for (start-up, shutdown). Call with ``self.lock`` held or before serving."""
        await self._wait_for_snapshot()
        self.wal.rotate()
        await asyncio.to_thread(self._write_snapshot, self._snapshot_payload(copy=False))
        self._reset_snapshot_counters()

    def _reset_snapshot_counters(self) -> None:
        self._updates_since_snapshot = 0
        self._changed_since_snapshot = False
        self._last_snapshot_at = time.monotonic()

    async def _wait_for_snapshot(self) -> None:
        task = self._snapshot_task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def _maybe_snapshot(self) -> None:
        """Start a background snapshot when ``runtime.snapshot_every`` updates or ``snapshot_every_s`` seconds
        have passed. The copy is taken here, under the lock (consistent); writing it never blocks decisions."""
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return
        due = self._updates_since_snapshot >= self.cfg.runtime.snapshot_every or (
            self._changed_since_snapshot and time.monotonic() - self._last_snapshot_at >= self.cfg.runtime.snapshot_every_s
        )
        if not due:
            return
        payload = self._snapshot_payload(copy=True, reuse=True)  # the previous snapshot is written: its buffers are free
        self.wal.rotate()  # the segments up to here are exactly what this snapshot covers
        self._reset_snapshot_counters()

        async def write() -> None:
            try:
                await asyncio.to_thread(self._write_snapshot, payload)
            except OSError as error:  # the log still holds everything; the next snapshot retries
                logger.error("background snapshot to %s failed (%r); the write-ahead log keeps every event", self.dir, error)
                self._changed_since_snapshot = True

        self._snapshot_task = asyncio.get_running_loop().create_task(write())

    def _status_document(self, now: float) -> dict[str, Any]:
        """Everything ``asyncloco status`` and the dashboard show (field meanings: coordinator/status.py)."""
        peers: dict[str, Any] = {}
        for peer_id, stats in self.stats.peers.items():
            info = self.state.peers.get(peer_id)
            row = dict(stats.__dict__)
            if info is not None:
                row["speed"] = info.speed
            seen = max(stats.last_seen, min(info.last_seen, now)) if info is not None else stats.last_seen
            peers[peer_id] = peer_row(row, alive=info is not None and info.alive, last_seen=seen)
        updates_per_s = self.stats.updates.rate(now)
        self.stats.history.add(
            {"time": now, "version": self.state.version, "local_updates": self.state.local_updates, "updates_per_s": updates_per_s}
        )
        return {
            "run_id": self.cfg.runtime.run_id,
            "software_version": __version__,
            "peer_id": self.peer_id,
            "multiaddrs": self.multiaddrs,
            "method": self.spec.name,
            "parameters": self.numel,  # θ's size: the model's parameter count (issue 22)
            "speed_unit": "tok/s" if self.cfg.task.kind == "lm" else "samples/s",
            "version": self.state.version,
            "local_updates": self.state.local_updates,
            "active_leases": len(self.state.leases),
            "updates_per_s": updates_per_s,
            "rejections": sum(stats.rejected for stats in self.stats.peers.values()),
            "started": self.stats.updates.started,  # when this coordinator process started
            "dashboard": self.stats.dashboard_url or None,
            "peers": peers,
            "evals": list(self.stats.evals),
            "history": list(self.stats.history.samples),
            "traffic": self.counters.as_dict() if hasattr(self, "counters") else {},
            "verification": self.verification.status() if self.verification is not None else None,
            "swarm": self.swarm_seed.status() if self.swarm_seed is not None else None,
            "updated": now,
        }

    def _write_status(self) -> None:
        now = self.clock.time()
        status = self._status_document(now)
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

    # ------------------------------------------------------------------------------- decisions

    async def _decide(self, event: Event, wire: Any = None) -> list[Action]:
        """Run one event through the logic and carry out its actions. Call with ``self.lock`` held.

        Order (durability): handle in memory → append the event (with ``now``, and for a submission its
        encoded bytes ``wire`` exactly as received) to the write-ahead log → ``fsync`` → only then carry out
        the actions. Events that produce no action and answer no RPC are appended without an ``fsync`` (the
        next ``fsync`` covers them; losing them in a crash loses nothing anyone was told).

        A submission (``wire`` given: θ-sized bytes to checksum, write and fsync) is logged in a worker thread
        *while* ``handle`` validates and applies it here — the log and the state see the same event and
        ``now``, and nothing is carried out before both are done (issue 8's ack latency). Should ``handle``
        raise meanwhile, the daemon fail-stops: the event is in the log, so a resume meets the same error."""
        now = self.clock.time()
        attachments = None
        if wire is not None:
            attachments = {"pseudo_gradient": (wire.codec, wire.numel, [wire.meta, wire.payload])}
        try:
            if wire is not None:
                context = contextvars.copy_context()  # the crash hook of tests reads the current RPC from it
                logged = asyncio.get_running_loop().run_in_executor(
                    None, context.run, self._log_and_sync, event, now, attachments
                )
                try:
                    _, actions = handle(self.state, event, now)
                except BaseException:
                    await asyncio.gather(logged, return_exceptions=True)
                    logger.critical("the logic failed on %s, which is logged: stopping; report this bug", type(event).__name__)
                    self._stopping = True
                    if self._stop_event is not None:
                        self._stop_event.set()
                    raise
                await logged
            else:
                _, actions = handle(self.state, event, now)
                self.wal.append_event(event, now, attachments)
                if self.crash_hook is not None:
                    self.crash_hook("wal_appended")
                if actions or isinstance(event, (RequestWork, SubmitUpdate)):
                    await asyncio.to_thread(self.wal.sync)
                    if self.crash_hook is not None:
                        self.crash_hook("wal_synced")
        except OSError as error:
            # Fail-stop: the decision is in memory but not durable, so nobody may be told about it.
            # The caller's RPC fails (the peer keeps its update and resends after a restart, which
            # continues from the last durable log record) and the daemon stops accepting work.
            logger.critical(
                "could not write the write-ahead log in %s (%r); stopping without acknowledging. Fix the disk, "
                "then restart with --resume",
                self.dir,
                error,
            )
            self._stopping = True
            if self._stop_event is not None:
                self._stop_event.set()
            raise
        changed = self._bookkeep(actions)
        if changed:
            self._changed_since_snapshot = True
            self._updates_since_snapshot += sum(isinstance(a, Applied) for a in actions)
        self._maybe_snapshot()
        for action in actions:
            if isinstance(action, Assign):
                waiter = self.waiters.pop(action.peer, None)
                if waiter is not None and not waiter.future.done():
                    waiter.future.set_result(action.lease)
        if any(isinstance(a, Applied) for a in actions):
            self._maybe_evaluate()
        if changed:
            self._write_status()
        return actions

    def _log_and_sync(self, event: Event, now: float, attachments: Any) -> None:
        """Append ``event`` to the log and fsync it (a worker thread, for a submission: see ``_decide``)."""
        self.wal.append_event(event, now, attachments)
        if self.crash_hook is not None:
            self.crash_hook("wal_appended")
        self.wal.sync()
        if self.crash_hook is not None:
            self.crash_hook("wal_synced")

    def _record(self, action: Action) -> bool:
        """Journal and count one action; True when it changed durable state."""
        if isinstance(action, Assign):
            lease = action.lease
            stats = self.stats.peer(action.peer)
            stats.leases += 1
            stats.steps_assigned += lease.steps
            info = self.state.peers.get(action.peer)
            stats.speed = info.speed if info is not None else 0.0
            stats.last_steps = lease.steps
            stats.last_seen = self.clock.time()
            self.journal.write("assign", reason=action.reason, **lease.to_dict())
            logger.debug("lease %s → %s: %d steps on shard %d (%s)", lease.lease_id, action.peer[-8:], lease.steps, lease.shard, action.reason)
            return True
        if isinstance(action, Hold):
            self.journal.write("hold", peer=action.peer, until=action.until, waiting_for=list(action.waiting_for), reason=action.reason)
            return False
        if isinstance(action, Applied):
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
                local_updates=self.state.local_updates,
                reason=action.reason,
                gate=action.gate,
            )
            logger.debug("applied %s from %s: version %d, staleness %d", action.lease_id, action.peer[-8:], action.version, action.staleness)
            return True
        if isinstance(action, Expired):
            self.stats.peer(action.peer).expired += 1
            self.journal.write("expired", peer=action.peer, lease_id=action.lease_id, shard=action.shard, steps=action.steps, reason=action.reason)
            logger.warning("lease %s of %s given back: %s", action.lease_id, action.peer[-8:], action.reason)
            return True
        if isinstance(action, Duplicate):
            self.stats.peer(action.peer).duplicates += 1
            self.stats.peer(action.peer).last_seen = self.clock.time()
            self.journal.write("duplicate", peer=action.peer, lease_id=action.lease_id, version=action.version, reason=action.reason)
            return False
        if isinstance(action, Rejected):
            if not action.lease_id and self._repeated_refusal(action.peer, action.reason):
                return False  # the same refused request again (e.g. a quarantined peer polling): counted once a minute
            self.stats.peer(action.peer).rejected += 1
            self.stats.peer(action.peer).last_seen = self.clock.time()
            self.journal.write("rejected", peer=action.peer, lease_id=action.lease_id, reason=action.reason)
            logger.warning("rejected %s from %s: %s", action.lease_id or "request", action.peer[-8:], action.reason)
            # a dropped-by-policy update consumed its lease: durable state changed
            return action.lease_id in self.state.applied
        # --- admission (coordinator/admission.py)
        if isinstance(action, Admitted):
            if action.new:
                self.journal.write("admitted", peer=action.peer, token_id=action.token_id, name=action.name, reason=action.reason)
                logger.info("admitted %s as %r (token %s)", action.peer[-8:], action.name, action.token_id)
            return action.new
        if isinstance(action, Refused):
            self._refusals.note(self.journal, action.peer, action.reason, action.token_id, action.lease_id)
            return False
        if isinstance(action, Revoked):
            self.journal.write("revoked", token_id=action.token_id, peer=action.peer, reason=action.reason)
            logger.warning("token %s revoked%s", action.token_id, f" (peer {action.peer[-8:]})" if action.peer else "")
            return True
        if isinstance(action, Quarantined):
            self.stats.peer(action.peer).quarantined_until = action.until
            self.journal.write("quarantined", peer=action.peer, until=action.until, reason=action.reason)
            logger.warning("peer %s quarantined until %.0f: %s", action.peer[-8:], action.until, action.reason)
            return True
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

    def _repeated_refusal(self, peer: str, reason: str, every_s: float = 60.0) -> bool:
        """True when ``peer``'s request was refused for the same reason less than ``every_s`` ago."""
        now = time.monotonic()
        last = self._request_refusals.get(peer)
        if last is not None and last[0] == reason and now - last[1] < every_s:
            return True
        self._request_refusals[peer] = (reason, now)
        return False

    def _bookkeep(self, actions: list[Action]) -> bool:
        """The daemon's own state for these actions (journal, per-peer stats, θ per base version); live and
        in replay alike. True when durable state changed."""
        changed = False
        for action in actions:
            changed |= self._record(action)
        return changed

    # ------------------------------------------------------------------------------ evaluation

    def _maybe_evaluate(self, force: bool = False) -> None:
        version = self.state.version
        if version == self._last_eval_version:
            return
        if not force and version % self.cfg.runtime.eval_every != 0:
            return
        self._last_eval_version = version
        theta = self.state.params.clone()
        local_updates = self.state.local_updates
        task = asyncio.get_running_loop().create_task(self._evaluate(version, local_updates, theta))
        self._eval_tasks.add(task)
        task.add_done_callback(self._eval_tasks.discard)

    async def _evaluate(self, version: int, local_updates: int, theta: torch.Tensor) -> None:
        def run() -> dict[str, float]:
            model = self._model_for_eval()  # runtime.eval_device (issue 12)
            load_flat_params(model, theta.to(next(model.parameters()).device))
            return self.workload.evaluate(model)

        metrics = await asyncio.to_thread(run)
        record = {"time": time.time(), "version": version, "local_updates": local_updates, **metrics}
        self.stats.evals.append(record)
        self.journal.write("eval", **record)
        logger.info("eval at version %d: %s", version, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self._write_status()

    def _model_for_eval(self) -> torch.nn.Module:
        """The model evaluation runs on: ``self.model`` on CPU, else a copy kept on ``runtime.eval_device``."""
        device = torch.device(self.cfg.runtime.eval_device)
        if device.type == "cpu":
            return self.model
        cached: Optional[torch.nn.Module] = self.__dict__.get("_eval_model")
        if cached is None:
            if not torch.cuda.is_available():
                raise ValueError(f"runtime.eval_device is {device} but torch sees no CUDA device; set it to cpu")
            import copy

            cached = copy.deepcopy(self.model).to(device)
            self.__dict__["_eval_model"] = cached
        return cached

    # --------------------------------------------------------------------------- RPC handlers

    # --- admission (coordinator/admission.py): nothing is served to a peer the logic does not admit

    async def check_admitted(self, peer_id: str, token: Any = None) -> None:
        """Raise :class:`PermissionError` ("not admitted: ...") unless ``peer_id`` may be served now.

        A token (``runtime.admission: token``) is verified here (signature, format: crypto, not the
        logic's business) and becomes an :class:`Admit` event; the logic decides (expiry, revocation,
        binding to the first peer id that used it). Refusals are journaled at a bounded rate and a
        refused peer's further attempts within a few seconds are answered from a cache, so a flood of
        unadmitted calls writes neither the write-ahead log nor unbounded log lines."""
        now = self.clock.time()
        if is_admitted(self.state, peer_id, now):
            return
        if self._admission_key is None or token is None:
            raise PermissionError("not admitted: " + self._refusals.refuse(self.journal, peer_id, admission_problem(self.state, peer_id, now), now))
        cached = self._refusals.cached(peer_id, token, now)
        if cached is not None:
            raise PermissionError("not admitted: " + cached)
        try:
            claims = verify_token(self._admission_key, token)
        except AdmissionError as error:
            raise PermissionError("not admitted: " + self._refusals.refuse(self.journal, peer_id, str(error), now, token)) from None
        async with self.lock:
            self._refuse_if_stopping()
            actions = await self._decide(Admit(peer_id, claims.token_id, claims.name, claims.expires_at))
        if is_admitted(self.state, peer_id, self.clock.time()):
            return
        reason = next((a.reason for a in actions if isinstance(a, Refused)), admission_problem(self.state, peer_id, now))
        self._refusals.remember(peer_id, token, reason, now)
        raise PermissionError("not admitted: " + reason)

    async def assign(self, request: Any, peer_id: str) -> Any:
        """The ``assign`` RPC: ``request`` is a transport.wire.AssignRequest; returns a HelloReply (kind
        "config") or a LeaseReply."""
        from asyncloco.transport.wire import HelloReply, Lease, LeaseReply

        if peer_id in self._fingerprint_refusals:  # failed the compatibility check (_check_fingerprint)
            raise PermissionError(f"not admitted: {self._fingerprint_refusals[peer_id]}")
        await self.check_admitted(peer_id, request.get("token") if isinstance(request, dict) else getattr(request, "token", None))
        if request.kind == "config":
            return HelloReply(
                config=json.dumps(self.cfg.model_dump(mode="json")),
                model_numel=self.numel,
                codec=self.cfg.runtime.codec,
                download_codec=self.cfg.runtime.download_codec,
                run_id=self.cfg.runtime.run_id,
                software_version=__version__,
            )
        speed = request.tokens_per_s  # a finite float ≥ 0 or None (checked by the transport)
        signer = request.signer if request.signer is not None and 0 < len(request.signer) <= 64 else None
        name = request.name or ""
        async with self.lock:
            self._refuse_if_stopping()
            if name:  # the volunteer's --name (validated by the transport), for the status table
                self.stats.peer(peer_id).name = name[:64]
            info = self.state.peers.get(peer_id)
            if info is None or not info.alive or (signer is not None and info.signer != signer) or (name and info.name != name):
                # The authenticated hello: registers the peer with the speed from its request (before the
                # DHT read loop saw its record) and binds its DHT signing key and name to this peer id.
                await self._decide(Hello(peer_id, signer, name[:64], speed))
                if name:
                    self.stats.peer(peer_id).name = name[:64]
            previous = self.waiters.pop(peer_id, None)
            if previous is not None and not previous.future.done():
                previous.future.cancel()
            loop = asyncio.get_running_loop()
            waiter = _Waiter(loop.create_future(), self.clock.time())
            self.waiters[peer_id] = waiter
            actions = await self._decide(RequestWork(peer_id))
            for action in actions:
                if isinstance(action, Rejected) and action.peer == peer_id:
                    self.waiters.pop(peer_id, None)
                    return LeaseReply(None, action.reason)
        try:
            lease = await asyncio.wait_for(asyncio.shield(waiter.future), timeout=self._hold_limit())
            if lease is None:  # the logic released the held request (hold limit)
                return LeaseReply(None, "held too long; ask again")
        except asyncio.TimeoutError:
            async with self.lock:
                if self.waiters.get(peer_id) is waiter:
                    del self.waiters[peer_id]
                if not self._stopping:  # an event of the logic, logged like every other (replay drops it too)
                    await self._decide(HoldDropped(peer_id))
            return LeaseReply(None, "held too long; ask again")
        except asyncio.CancelledError:
            return LeaseReply(None, "superseded by a newer request")
        return LeaseReply(Lease.from_wire(lease_to_wire(lease, getattr(self.cfg.task, "batch_size", 1))))

    def _refuse_if_stopping(self) -> None:
        # Without this, a submit that was still decoding when SIGTERM came could be applied *after* the
        # final snapshot and the journal's close: acknowledged, durable in the next snapshot only by luck,
        # and missing from events.jsonl. The peer sees a RemoteError and resends after the restart.
        if self._stopping:
            raise ConnectionAbortedError("the coordinator is shutting down; resend after it restarts")

    def _hold_limit(self) -> float:
        """How long an RPC waits on a held request: a little past the logic's hold limit, which answers it."""
        return self.state.policy.hold_limit + 5.0

    async def get_model(self, version: Optional[int], peer_id: Optional[str] = None) -> tuple[int, torch.Tensor]:
        if peer_id is not None:
            await self.check_admitted(peer_id)
        async with self.lock:
            if version is None:
                version = self.state.version
            theta = base_theta(self.state, version)
            if theta is None:
                raise ValueError(f"version {version} is no longer served (current {self.state.version}); ask for a new lease")
            theta = theta.clone() if version == self.state.version else theta  # older versions never change
            if peer_id is not None and not self._stopping:
                # θ at this version is on its way to the peer: the logic may stop retaining it
                await self._decide(Fetched(peer_id, version))
        return version, theta

    # --- the update gate's probe (issue 7; coordinator/probe.py) ------------------------------------------
    _probe: Optional[Probe] = None  # built on first use (its own model copy)

    async def _gate_probe(
        self, peer_id: str, lease_id: str, base_version: int, update: torch.Tensor
    ) -> tuple[Optional[float], Optional[float]]:
        """The probe-batch losses at θ and θ − s·Δ for an update the gate may need them for (``gate.wants_probe``),
        else (None, None). Call with ``self.lock`` held: θ must not change until ``handle`` has judged it. Only a
        live lease of this peer at its base version is probed (junk costs no forward pass)."""
        gate = self.state.policy.gate
        lease = self.state.leases.get(lease_id)
        if gate is None or lease is None or lease.peer != peer_id or lease.base_version != base_version:
            return None, None
        if not update_gate.wants_probe(gate, self.state.gate, peer_id, self.numel):
            return None, None
        if self._probe is None:
            self._probe = Probe(self.workload, self.model, self.cfg.runtime.gate.probe_sequences, self.cfg.runtime.eval_device)
        started = time.perf_counter()
        before, after = await asyncio.to_thread(
            self._probe.losses, self.state.version, self.state.params, update, gate.probe_step
        )
        logger.debug("probe of %s: %.4f -> %.4f in %.3f s", lease_id, before, after, time.perf_counter() - started)
        return before, after

    async def submit(self, header: Any, pseudo_gradient: Any, peer_id: str) -> Any:
        """The ``submit`` RPC: ``header`` is a transport.wire.SubmitHeader (``lease_id``, ``base_version``,
        optional ``inner_loss``); returns a transport.wire.Ack."""
        from asyncloco.transport.codecs import decode
        from asyncloco.transport.wire import MAX_REASON_CHARS, Ack

        lease_id, base_version = header.lease_id, header.base_version

        await self.check_admitted(peer_id)  # before decoding anything an outsider sent
        upload_s = self._service.upload_seconds.get(peer_id, 0.0) if self._service is not None else 0.0
        # --- int8 is decoded into a reused θ-sized buffer (a fresh one costs ≈ 7 memcpy of page faults;
        # issue 8's ack-latency target). The logic keeps no reference to the update after handle.
        reuse = getattr(pseudo_gradient, "codec", None) == "int8"
        buffer = self._decode_buffers.pop() if reuse and self._decode_buffers else None
        update = await asyncio.to_thread(decode, pseudo_gradient, self.numel, buffer)
        try:
            async with self.lock:
                self._refuse_if_stopping()
                probe = await self._gate_probe(peer_id, lease_id, base_version, update)  # the gate's gray-zone tie-breaker
                event = SubmitUpdate(peer_id, lease_id, base_version, update, transfer_s=round(upload_s, 6),
                                     probe_before=probe[0], probe_after=probe[1],
                                     state_start=getattr(header, "state_start", None), state_end=getattr(header, "state_end", None))
                actions = await self._decide(event, wire=pseudo_gradient)
        finally:
            if reuse and not self._decode_buffers:
                self._decode_buffers.append(update)
        if header.inner_loss is not None and any(isinstance(a, Applied) and a.lease_id == lease_id for a in actions):
            self.stats.peer(peer_id).last_inner_loss = float(header.inner_loss)
        for action in actions:
            if isinstance(action, Applied) and action.lease_id == lease_id:
                return Ack(True, action.version, action.reason[:MAX_REASON_CHARS], False)
            if isinstance(action, Duplicate) and action.lease_id == lease_id:
                return Ack(True, action.version, action.reason[:MAX_REASON_CHARS], True)
            if isinstance(action, Rejected) and action.lease_id == lease_id:
                return Ack(False, self.state.version, action.reason[:MAX_REASON_CHARS], False)
        raise AssertionError(f"submit of {lease_id} produced no verdict: {actions}")

    # -------------------------------------------------------------------------------- main loop

    async def _revocation_loop(self, stop: asyncio.Event, period: float = 1.0) -> None:
        """Feed revocations written by ``asyncloco coordinator token revoke`` (revoked.json) to the logic."""
        seen_mtime = -1.0
        while not stop.is_set():
            try:
                mtime = (self.dir / REVOKED_FILE).stat().st_mtime
            except FileNotFoundError:
                mtime = -1.0
            if mtime != seen_mtime:
                try:
                    revoked = read_revoked(self.dir)
                    seen_mtime = mtime
                except ValueError as error:  # a half-edited file: try again next period
                    logger.warning("%s", error)
                    revoked = {}
                fresh = sorted((t, when) for t, when in revoked.items() if t not in self.state.revoked)
                if fresh:
                    async with self.lock:
                        if not self._stopping:
                            for token_id, when in fresh:
                                await self._decide(Revoke(token_id, when))
            try:
                await asyncio.wait_for(stop.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass

    async def _tick_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            async with self.lock:
                await self._decide(Tick())
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    async def _speed_loop(self, records: Any, stop: asyncio.Event, dht: Any = None) -> None:
        from hivemind.utils import get_dht_time

        period = self.cfg.runtime.speed_report_period
        while not stop.is_set():
            try:
                signed = await asyncio.to_thread(records.read_signed_speeds)
            except Exception as error:  # a DHT hiccup must not stop the coordinator; it retries next period
                logger.warning("could not read speed reports from the DHT: %r", error)
                signed = []
            now_dht = get_dht_time()
            fresh = {report.peer_id for _, report in signed if now_dht - report.last_seen <= 3 * period}
            unseen = sorted(peer for peer, info in self.state.peers.items() if info.alive and peer not in fresh)
            if unseen and dht is not None:
                try:
                    await asyncio.wait_for(asyncio.to_thread(dht.run_coroutine, partial(_ping_peers, unseen)), timeout=period * 2)
                except Exception as error:  # best effort; the peer may really be gone
                    logger.debug("pinging %d silent peer(s) failed: %r", len(unseen), error)
            async with self.lock:
                # The logic takes a record only when it is signed by the key its claimed peer bound over its
                # authenticated hello, new (not a re-read), and not from the future; silence is judged on
                # Tick (policy.peer_timeout).
                for signer, report in sorted(signed, key=lambda item: (item[1].peer_id, item[0])):
                    info = self.state.peers.get(report.peer_id)
                    if info is None or info.signer != signer or (info.reported_at or -1.0) >= report.last_seen:
                        continue  # nothing for the logic to take: skip the log record
                    await self._decide(SpeedReport(report.peer_id, report.tokens_per_s, report.last_seen, signer))
                    self.stats.peer(report.peer_id).device = report.device[:32]
            try:
                await asyncio.wait_for(stop.wait(), timeout=max(0.5, period / 2))
            except asyncio.TimeoutError:
                pass

    async def _announce_loop(self, records: Any, stop: asyncio.Event) -> None:
        from asyncloco.transport.records import CoordinatorAnnouncement
        from hivemind.utils import get_dht_time

        while not stop.is_set():
            announcement = CoordinatorAnnouncement(
                peer_id=self.peer_id,
                multiaddrs=tuple(self.multiaddrs),
                run_id=self.cfg.runtime.run_id,
                model_numel=self.numel,
                codec=self.cfg.runtime.codec,
                version=self.state.version,
                timestamp=get_dht_time(),
            )
            try:
                await asyncio.to_thread(records.announce_coordinator, announcement, 90.0)
            except Exception as error:  # retried next period
                logger.warning("could not announce the coordinator in the DHT: %r", error)
            try:
                await asyncio.wait_for(stop.wait(), timeout=30.0)
            except asyncio.TimeoutError:
                pass

    def _endpoint_port(self) -> int:
        if self.cfg.runtime.port:
            return self.cfg.runtime.port
        endpoint = self.dir / ENDPOINT_FILE
        if self.resume and endpoint.is_file():
            try:
                return int(json.loads(endpoint.read_text())["port"])
            except (ValueError, KeyError, TypeError):
                logger.warning("unreadable %s; choosing a new port", endpoint)
        return 0

    # ------------------------------------------------------------------- watching (status.py)

    def _start_monitoring(self) -> None:
        """Metrics sinks and the dashboard, as ``runtime.log_to`` / ``runtime.dashboard_port`` ask."""
        runtime = self.cfg.runtime
        self.stats.sinks = build_sinks(runtime.log_to, self.dir, runtime.run_id, self.cfg.model_dump(mode="json"))
        self.stats.evals_logged = len(self.stats.evals)  # a resumed run logged its earlier evaluations already
        if runtime.dashboard_port is not None:
            self.stats.dashboard = DashboardServer(lambda: self.stats.document_json, runtime.dashboard_host, runtime.dashboard_port)
            self.stats.dashboard_url = self.stats.dashboard.start()

    def _stop_monitoring(self) -> None:
        if self.stats.dashboard is not None:
            self.stats.dashboard.stop()
            self.stats.dashboard = None
        for sink in self.stats.sinks:
            try:
                sink.close()
            except Exception as error:  # a sink's own trouble must not mask the shutdown
                logger.warning("closing a metrics sink failed: %r", error)
        self.stats.sinks = []

    async def _monitor_loop(self, stop: asyncio.Event) -> None:
        """Refresh status.json every 2 s (the dashboard polls it); a summary line every runtime.summary_every s."""
        next_summary = time.monotonic() + self.cfg.runtime.summary_every
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=2.0)
            except asyncio.TimeoutError:
                pass
            self._write_status()
            if time.monotonic() >= next_summary:
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

    async def _check_fingerprint(self, peer_id: str, fingerprint: dict[str, str], software_version: str) -> Optional[str]:
        """The reason to refuse a peer whose model/tokenizer/data/codec differ from this run's (None: it fits).
        A refused peer's lease requests are refused too (see :meth:`assign`)."""
        reason = mismatch_reason(self.fingerprint, fingerprint, __version__, software_version[:64])
        if reason is None:
            self._fingerprint_refusals.pop(peer_id, None)
            return None
        differing = [name for name in self.fingerprint if self.fingerprint[name] != fingerprint.get(name)]
        if peer_id not in self._fingerprint_refusals:
            self.journal.write("incompatible", peer=peer_id, differing=differing, peer_version=software_version[:64], reason=reason)
            logger.warning("refused %s: %s differ (peer runs asyncloco %s)", peer_id[-8:], ", ".join(differing), software_version[:64])
        self._fingerprint_refusals[peer_id] = reason
        return reason

    async def _check_reach(self, port: int) -> None:
        """Start-up reachability check of the announced address (transport/reach.py); the problem, if any, is
        logged, journaled and kept in ``self.reach_problem`` for the CLI to print under the join line."""
        from asyncloco.transport.reach import reachability_problem

        announce, host = self.cfg.runtime.announce_addr, self.cfg.runtime.host
        if announce is None:
            if host in ("0.0.0.0", "::"):
                self.reach_problem = (
                    f"listening on all interfaces but announcing this machine's own addresses ({', '.join(self.multiaddrs)}); "
                    "if volunteers dial a public IP or DNS name, pass it with --announce-addr so the join line carries it"
                )
                logger.warning("%s", self.reach_problem)
            return
        self.reach_problem = await reachability_problem(announce, port, self.peer_id, host)
        self.journal.write("reachability", address=announce, port=port, reachable=self.reach_problem is None, problem=self.reach_problem or "")
        if self.reach_problem is None:
            logger.info("reachable at %s:%d (checked with a libp2p dial from this machine)", announce, port)
        else:
            logger.warning("%s", self.reach_problem)

    async def _start_swarm_seed(self, p2p: Any) -> Any:
        """The θ swarm's seed (transport/swarm.py; issue 19): serves θ's bodies in signed chunks to peers that
        join with ``--swarm`` and lists them as holders for each other, so the coordinator sends each body about
        once per version instead of once per peer. Manifests are signed with the coordinator's Ed25519 key (the
        one admission tokens are signed with); only admitted peers are served; reports of bad or slow sources go
        to the journal. Peers without ``--swarm`` never touch it. ``runtime.swarm: false`` turns it off."""
        if not self.cfg.runtime.swarm:
            return None
        from asyncloco.transport.swarm import start_seed

        async def serve_model(version: Optional[int]) -> tuple[int, torch.Tensor]:
            return await self.get_model(version)  # no peer id: the fetch is recorded when the peer asks (SwarmLink)

        async def admit(peer_id: str) -> None:
            await self.check_admitted(peer_id)

        def on_report(reporter: str, source: str, version: int, reason: str) -> None:
            self.journal.write("swarm_report", peer=reporter, source=source, version=version, reason=reason)

        return await start_seed(
            p2p, self.cfg.runtime.run_id, self.numel, load_or_create_key(self.dir), serve_model,
            current=lambda: self.state.version, admit=admit, on_report=on_report,
        )

    async def run(self, stop: asyncio.Event, ready: Optional[asyncio.Event] = None) -> None:
        self._stop_event = stop
        from asyncloco.transport.dht import start_dht, stop_dht
        from asyncloco.transport.discovery import RunInfo, serve_run_info
        from asyncloco.transport.records import RunRecords
        from asyncloco.transport.rpc import CoordinatorService, TrafficCounters

        self.dir.mkdir(parents=True, exist_ok=True)
        # a previous coordinator of this directory killed alone (OOM killer, SIGKILL of its main process) left
        # its DHT process and p2pd holding the port: end them before starting new ones
        await asyncio.to_thread(reap_stale_children, self.dir)
        port = self._endpoint_port()
        # --- reach (transport/reach.py): the address volunteers dial, when it is not one this host listens on
        announce = self.cfg.runtime.announce_addr
        reach: dict[str, Any] = {}
        if announce is not None:
            from asyncloco.transport.reach import announce_multiaddr, free_port

            if port == 0:
                port = free_port(self.cfg.runtime.host)  # p2pd needs the announced port before it binds it
            reach["announce_maddrs"] = [announce_multiaddr(announce, port)]
        dht = start_dht(
            initial_peers=list(self.initial_peers),
            host_maddrs=[f"/ip4/{self.cfg.runtime.host}/tcp/{port}"],
            identity_path=str(self.dir / IDENTITY_FILE),
            **reach,
        )
        p2p = None
        service = None
        seed = None
        try:
            if dht.pid is not None:
                record_children(self.dir, [dht.pid, *child_pids(dht.pid)])  # reaped by the next start if orphaned
            records = RunRecords(dht, self.cfg.runtime.run_id)
            self.peer_id = dht.peer_id.to_base58()
            self.multiaddrs = [str(m) for m in dht.get_visible_maddrs()]
            bound = int(str(self.multiaddrs[0]).split("/tcp/")[1].split("/")[0]) if self.multiaddrs else port
            (self.dir / ENDPOINT_FILE).write_text(
                json.dumps({"peer_id": self.peer_id, "multiaddrs": self.multiaddrs, "port": bound}, indent=1)
            )
            p2p = await dht.replicate_p2p()
            self.counters = TrafficCounters()
            service = self._service = CoordinatorService(
                self,
                self.numel,
                submit_codecs=(self.cfg.runtime.codec,),
                model_codecs=tuple(dict.fromkeys(("none", self.cfg.runtime.download_codec))),
                counters=self.counters,
                # transport-level rejections (malformed or oversized frames, timeouts, over the call limits),
                # at the transport's bounded rate (ServiceLimits.error_log_*)
                on_protocol_error=lambda peer, reason: self.journal.write("protocol_error", peer=peer, reason=reason),
            )
            await service.add_p2p_handlers(p2p, namespace=self.cfg.runtime.run_id)
            seed = self.swarm_seed = await self._start_swarm_seed(p2p)
            # --- which run this is, and the peers' compatibility check (transport/discovery.py, fingerprint.py)
            self.fingerprint = await asyncio.to_thread(run_fingerprint, self.cfg, self.workload, self.model)
            await serve_run_info(p2p, RunInfo(self.cfg.runtime.run_id, __version__), self._check_fingerprint)
            await self._check_reach(bound)
            if not self.resume:
                await self._save()
            elif self.replayed:
                self._updates_since_snapshot = self.cfg.runtime.snapshot_every  # snapshot the replayed state soon
            self._start_monitoring()  # sinks + dashboard (status.py); stopped in the finally below
            self.journal.write(
                "start",
                peer_id=self.peer_id,
                multiaddrs=self.multiaddrs,
                version=self.state.version,
                method=self.spec.name,
                resumed=self.resume,
                numel=self.numel,
            )
            self._write_status()
            self._maybe_evaluate(force=True)
            logger.info("coordinator of run %r (%s) serving a %.1f M-parameter model (%d)", self.cfg.runtime.run_id, self.spec.label,
                        self.numel / 1e6, self.numel)
            for addr in self.multiaddrs:
                logger.info("listening at %s", addr)
            if ready is not None:
                ready.set()
            tasks = [
                asyncio.create_task(self._tick_loop(stop)),
                asyncio.create_task(self._speed_loop(records, stop, dht)),
                asyncio.create_task(self._announce_loop(records, stop)),
                asyncio.create_task(self._revocation_loop(stop)),  # admission
                asyncio.create_task(self._monitor_loop(stop)),
            ]
            await stop.wait()
            async with self.lock:
                self._stopping = True
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for waiter in self.waiters.values():
                waiter.future.cancel()
            if self._eval_tasks:
                await asyncio.gather(*self._eval_tasks, return_exceptions=True)
            async with self.lock:
                try:
                    await self._save()
                    self._write_status()
                    logger.info("checkpoint written at version %d; shutting down", self.state.version)
                except OSError as error:  # the last durable snapshot stands; nothing unsaved was acknowledged
                    logger.critical("final checkpoint failed (%r); --resume continues from the last good one", error)
            self.journal.write("stop", version=self.state.version, local_updates=self.state.local_updates)
        finally:
            self._stop_monitoring()
            if service is not None and p2p is not None:
                try:
                    await service.remove_p2p_handlers(p2p, namespace=self.cfg.runtime.run_id)
                    if seed is not None:
                        await seed.remove_handlers(p2p, self.cfg.runtime.run_id)
                except Exception as error:  # shutting down anyway
                    logger.debug("removing handlers failed: %r", error)
            if p2p is not None:
                await p2p.shutdown()
            stop_dht(dht)
            if self.verification is not None:
                await self.verification.close()
            self.wal.close()
            self.journal.close()
