"""The coordinator's durability: snapshots written in the background (coordinator/checkpoint.py) and, on
``--resume``, the newest snapshot loaded and the write-ahead log after it (coordinator/wal.py) replayed
through the logic and the same bookkeeping (coordinator/monitoring.py), answering nobody. The node
(coordinator/node.py) appends every event to the log before anyone is answered; this module decides when
the log is covered by a snapshot and may be dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import typing
from typing import Any, Optional

import torch

from asyncloco.config import RunConfig
from asyncloco.coordinator import node as node_module
from asyncloco.coordinator.checkpoint import SNAPSHOT_NAME, load_snapshot, save_snapshot, snapshot_wal_seq
from asyncloco.coordinator.logic import Applied, Action, Reconfigured, Repaired, Restarted, decision_record
from asyncloco.coordinator.monitoring import Monitoring, PeerStats
from asyncloco.coordinator.node import EVENT_TYPES, CoordinatorNode
from asyncloco.coordinator.verify import DaemonVerification
from asyncloco.coordinator.wal import WAL_DIR, WalRecord, check_stamp, decode_event, open_log, read_records

__all__ = ["Durability", "INITIAL_SNAPSHOT", "RESUME_GRACE_S", "SOFTWARE_STAMP"]

logger = logging.getLogger(__name__)

INITIAL_SNAPSHOT = "initial-state.pt"  # in wal/archive/ when runtime.wal_archive is on
RESUME_GRACE_S = 10.0  # after --resume, peers known from the checkpoint get this long to call again
# a snapshot's copy shares these tensors (snapshot_payload): a checked update's, kept unchanged until its verdict
SHARED_PREFIX = ("verification/held/", "verification/applied_first/")
SOFTWARE_STAMP = node_module.SOFTWARE_STAMP  # what --resume accepts (tests replace it here)


class Durability:
    """Snapshots (when, what, written off the lock) and the resume path (load + replay)."""

    def __init__(self, cfg: RunConfig, node: CoordinatorNode, monitoring: Monitoring, numel: int) -> None:
        self.cfg = cfg
        self.node = node
        self.dir = node.dir
        self.monitoring = monitoring
        self.numel = numel
        self.verification: Optional[DaemonVerification] = None  # repair anchors and replay marks (coordinator/verify.py)
        self.replayed = 0  # log records replayed at --resume
        self.snapshot_bytes = 0  # bytes of snapshots written by this process (benchmarks)
        self.snapshots_written = 0
        self.snapshot_task: Optional[asyncio.Task[None]] = None
        self.snapshot_seq = 0  # the log record the newest durable snapshot covers
        self.updates_since_snapshot = 0
        self.changed_since_snapshot = False
        self._last_snapshot_at = self.node.clock.monotonic()
        self._snapshot_buffers: dict[str, torch.Tensor] = {}  # the background snapshot's copies, reused

    @property
    def archive(self) -> bool:
        """Keep the log's segments (a repair replays from its anchor's log; runtime.wal_archive)."""
        return bool(self.cfg.runtime.wal_archive or self.cfg.runtime.verify.enabled)

    # ------------------------------------------------------------------------------------ resume

    def load(self) -> None:
        """--resume: the newest snapshot, then every later record of the write-ahead log replayed through
        ``handle`` and the same bookkeeping (nobody is answered), then a ``Restarted`` event."""
        stats = self.monitoring.stats
        snapshot = load_snapshot(self.dir)
        check_stamp(snapshot.get("stamp"), SOFTWARE_STAMP, f"the snapshot {self.dir / SNAPSHOT_NAME}")
        wanted = decision_record(self.node.state)  # this config's; the log is replayed with what decided it
        self.node.load(snapshot["coordinator"])
        known = set(PeerStats.__dataclass_fields__)
        for name, values in snapshot.get("peer_stats", {}).items():
            stats.peers[name] = PeerStats(**{k: v for k, v in values.items() if k in known})
        stats.evals = list(snapshot.get("evals", []))
        self.snapshot_seq = snapshot_wal_seq(snapshot)
        self.node.wal = open_log(self.dir, self.snapshot_seq, archive=self.archive, stamp=SOFTWARE_STAMP)
        self.replayed = self.replay(read_records(self.dir / WAL_DIR, self.snapshot_seq))
        while self.verification is not None and self.verification.pending_repairs:
            # expelled, but the coordinator stopped before the repair: carried out now, its Repaired record logged
            self.verification.repair_pending(self.monitoring.journal)
        self.reconfigure(wanted)
        # The restart itself is an event of the logic (held requests died with their RPCs; the downtime is not
        # the peers' silence: they get RESUME_GRACE_S to call again), logged like every other.
        actions = self.node.decide_unanswered(Restarted(RESUME_GRACE_S))
        with self.monitoring.silenced():  # as before the split: its actions are not journaled
            self.monitoring.bookkeep(actions)
        self.changed_since_snapshot = self.replayed > 0
        state = self.node.state
        logger.info(
            "resumed from %s: snapshot at log record %d + %d replayed: version %d, %d local updates, %d active leases",
            self.dir,
            self.snapshot_seq,
            self.replayed,
            state.version,
            state.local_updates,
            len(state.leases),
        )

    def reconfigure(self, wanted: dict[str, Any]) -> None:
        """After the replay: when this config decides differently from the run so far (its policy, the outer optimizer's
        or the staleness transforms' hyper-parameters), a logged ``Reconfigured`` event makes it decide from here on."""
        if decision_record(self.node.state) == wanted:
            return
        actions = self.node.decide_unanswered(Reconfigured(json.dumps(wanted)))
        self.monitoring.bookkeep(actions)  # its Notice names what changed (journal "notice", the log)

    def replay(self, records: typing.Iterable[WalRecord]) -> int:
        """Feed logged records through ``handle`` and the daemon's bookkeeping, answering nobody."""
        from asyncloco.transport.codecs import EncodedTensor, decode

        def decode_blob(codec: str, numel: int, data: memoryview) -> torch.Tensor:
            return decode(EncodedTensor.from_bytes(codec, numel, data), self.numel)

        count = 0
        with self.monitoring.silenced():  # replayed decisions are in the journal already
            try:
                for record in records:
                    check_stamp(record.stamp, SOFTWARE_STAMP, f"log record {record.seq} in {self.dir / WAL_DIR}")
                    if record.kind == "event":
                        event = decode_event(record, EVENT_TYPES, decode_blob)
                        if isinstance(event, Repaired) and self.verification is not None:
                            # the live coordinator repaired θ right before this record (verify.py: after an
                            # expulsion, once the re-runs were trained): so does the replay, up to the record before
                            self.verification.repair_pending(self.monitoring.journal, event.remedy)
                        actions = self.node.replay(event, record.now)
                        if self.verification is not None:
                            self.verification.replay_seq = record.seq  # a repair replays up to this record
                        self.monitoring.bookkeep(actions)
                    else:  # e.g. the "HoldDropped" marks of older logs, which stamps refuse before this point
                        raise ValueError(f"log record {record.seq}: unknown mark {record.type!r}")
                    count += 1
            finally:
                if self.verification is not None:
                    self.verification.replay_seq = None
        return count

    # --------------------------------------------------------------------------------- snapshots

    def note(self, actions: list[Action], changed: bool) -> None:
        """Count what the node just decided toward the next snapshot."""
        if changed:
            self.changed_since_snapshot = True
            self.updates_since_snapshot += sum(isinstance(a, Applied) for a in actions)

    def snapshot_payload(self, copy: bool, reuse: bool = False) -> dict[str, Any]:
        """Everything a snapshot holds. ``copy``: θ and the optimizer's tensors cloned (they change in place);
        the θ the logic keeps per base version (``base_params``) and a held update's tensors (its pseudo-gradient and
        θ at its base: logic/state.py ``HeldUpdate``, read-only until it is applied or dropped) never change, so they
        are shared — two θ-sized copies per held update saved under the lock and in the kept buffers. ``reuse`` (the
        background snapshots, one at a time): the copies go into buffers kept from the previous snapshot — a
        fresh θ-sized allocation costs ≈ 7 memcpy in page faults, and this copy is taken under the lock."""
        buffers: dict[str, torch.Tensor] = {}

        def clone(value: Any, key: str) -> Any:
            if key.startswith(SHARED_PREFIX):
                return value
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

        coordinator = self.node.state.state_dict()
        if copy:
            coordinator = {k: (v if k == "base_params" else clone(v, k)) for k, v in coordinator.items()}
            if reuse:
                self._snapshot_buffers = buffers
        stats = self.monitoring.stats
        return {
            "coordinator": coordinator,
            "stamp": SOFTWARE_STAMP,
            "peer_stats": {name: dict(peer.__dict__) for name, peer in stats.peers.items()},
            "evals": list(stats.evals),
            "config": self.cfg.model_dump(mode="json"),
            "wal_seq": self.node.wal.last_seq,
        }

    def write_snapshot(self, payload: dict[str, Any]) -> None:
        """In a worker thread: write the snapshot durably, then delete the log segments it covers."""
        wal = self.node.wal
        path = save_snapshot(self.dir, payload)
        self.snapshot_bytes += path.stat().st_size
        if wal.archive_dir is not None and int(payload["wal_seq"]) == 0:
            # with wal_archive, the initial snapshot + every segment replay the whole run (tests, audits)
            wal.archive_dir.mkdir(exist_ok=True)
            shutil.copyfile(path, wal.archive_dir / INITIAL_SNAPSHOT)
        self.snapshots_written += 1
        if self.verification is not None:  # repair anchors (coordinator/verify.py)
            self.verification.note_snapshot(path, int(payload["wal_seq"]), int(payload["coordinator"]["version"]))
        self.snapshot_seq = int(payload["wal_seq"])
        wal.drop_covered(self.snapshot_seq)

    async def save(self) -> None:
        """A snapshot now, waited for (start-up, shutdown). Call with the node's lock held or before serving."""
        await self.wait_for_snapshot()
        if self.repair_pending():
            logger.warning("no snapshot while an expelled peer's repair is pending: --resume replays it from the log")
            return
        self.node.wal.rotate()
        await asyncio.to_thread(self.write_snapshot, self.snapshot_payload(copy=False))
        self.reset_counters()

    def reset_counters(self) -> None:
        self.updates_since_snapshot = 0
        self.changed_since_snapshot = False
        self._last_snapshot_at = self.node.clock.monotonic()

    async def wait_for_snapshot(self) -> None:
        task = self.snapshot_task
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def repair_pending(self) -> bool:
        """An expulsion whose repair is still to come: no snapshot may fall between its Verified record and its
        Repaired one (a --resume from it would never repair θ) — the log keeps everything meanwhile."""
        return self.verification is not None and bool(self.verification.pending_repairs)

    def maybe_snapshot(self) -> None:
        """Start a background snapshot when ``runtime.snapshot_every`` updates or ``snapshot_every_s`` seconds
        have passed. The copy is taken here, under the lock (consistent); writing it never blocks decisions."""
        if self.snapshot_task is not None and not self.snapshot_task.done() or self.repair_pending():
            return
        due = self.updates_since_snapshot >= self.cfg.runtime.snapshot_every or (
            self.changed_since_snapshot and self.node.clock.monotonic() - self._last_snapshot_at >= self.cfg.runtime.snapshot_every_s
        )
        if not due:
            return
        payload = self.snapshot_payload(copy=True, reuse=True)  # the previous snapshot is written: its buffers are free
        self.node.wal.rotate()  # the segments up to here are exactly what this snapshot covers
        self.reset_counters()

        async def write() -> None:
            try:
                await asyncio.to_thread(self.write_snapshot, payload)
            except OSError as error:  # the log still holds everything; the next snapshot retries
                logger.error("background snapshot to %s failed (%r); the write-ahead log keeps every event", self.dir, error)
                self.changed_since_snapshot = True

        self.snapshot_task = asyncio.get_running_loop().create_task(write())
