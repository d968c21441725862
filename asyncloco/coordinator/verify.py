"""Verification of the work itself (docs/threat-model.md, "Verified work").

The update gate (coordinator/gate.py) judges an update's *shape*; a modified client can shape a poisoned update
like an honest one. The one check it cannot shape its way past is doing the work again: with
``runtime.verify.inner_state: reset`` every lease starts from a fresh inner AdamW state, so a lease is a
deterministic function of θ at its base version, the shard's batches (``start_offset`` .. ``+ steps``), the LR
offset and the run's config — exactly what the coordinator knows. This module:

* :class:`~asyncloco.coordinator.rerun.Rerunner` (asyncloco/coordinator/rerun.py) — trains a lease again with the peers' own inner loop (:class:`~asyncloco.train.inner.InnerTrainer`,
  fresh optimizer state), encodes the result with the run's codec as a peer would, and :func:`~asyncloco.coordinator.rerun.compare` judges it
  against the submitted pseudo-gradient: bitwise by default (CPU re-runs of a CPU peer's lease are bit-identical:
  measured in tests/test_verify.py) for a peer of the verifier's compute class (train/inner.py ``compute_class``),
  within ``runtime.verify.cross_device_tolerance`` (relative L2 error) and ``cross_device_min_cosine`` for a peer of
  another one (a bf16 GPU peer checked on a CPU), whose kernels differ from the verifier's.
* :class:`Verifier` — the coordinator's background worker: a bounded queue of re-runs (``runtime.verify.queue``;
  a full queue skips a check and counts it; first in, first out, except that a check θ waits for goes first:
  :class:`UrgentFirst`), one re-run at a time in a worker thread, so submissions and acks never
  wait for it. Each verdict goes back through the node's decide (coordinator/node.py) as a
  :class:`~asyncloco.coordinator.logic.Verified` event (write-ahead log, journal, status.json). Validator peers
  (asyncloco/coordinator/validators.py, asyncloco/validator.py) take checks off the same queue.
* :func:`~asyncloco.coordinator.repair.repair` (asyncloco/coordinator/repair.py) — the exact remedy after a failed check: the logic expels the peer, and θ (with the outer
  optimizer's state, the gate's statistics, every counter) is rebuilt by replaying the write-ahead log from an
  *anchor* (a snapshot kept for this purpose) with the expelled peers' submissions turned into
  :class:`~asyncloco.coordinator.logic.Discard` events. Honest submissions are replayed as they were (their base
  version renumbered to the replayed lease's). Downloaded leases still active afterwards stay valid (applied as
  stale updates to the repaired θ; one chosen for verification is re-run from the live θ its peer trained from,
  retained for it); the others are given back, and the version jumps past the live one, so no version number ever
  names two different θ.
  Deterministic: a ``--resume`` that meets the same ``Verified`` record in the log repeats the same repair.
* :class:`Anchors` (asyncloco/coordinator/repair.py) — which snapshots a repair may start from: a hard link of ``state.pt`` taken every
  ``runtime.verify.horizon`` applied updates (and the initial one), the newest ``KEEP_ANCHORS`` kept; the log
  segments after the oldest anchor stay in ``wal/archive/`` (the daemon archives instead of deleting while
  verification is on) and older ones are pruned.

Which leases are re-run is the logic's decision (:func:`~asyncloco.coordinator.logic.verify_reason`): HMAC of the
lease id under the run secret below ``fraction``, every update of a peer on probation, ``suspect_fraction`` for a
peer the gate refused recently.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, Optional

import torch

from asyncloco.coordinator.logic import (
    Action,
    CoordinatorState,
    Event,
    Expelled,
    Expired,
    Unverified,
    Verdict,
    Verified,
    Verify,
)

from asyncloco.coordinator.ahead import Ahead, AheadResult, AheadRun
from asyncloco.coordinator.chained import ChainedStates, StateStore
from asyncloco.coordinator.rerun import Comparison, Rerunner
from asyncloco.coordinator.repair import Anchors, RepairResult, log_events, repair
from asyncloco.coordinator.substitute import RepairReruns
from asyncloco.coordinator.validators import ValidatorDesk

if TYPE_CHECKING:
    from asyncloco.config import RunConfig
    from asyncloco.coordinator.journal import Journal
    from asyncloco.coordinator.node import CoordinatorNode
    from asyncloco.models.workload import Workload
    from asyncloco.train.commitments import Buffer

__all__ = ["Verifier", "VerifyStats", "DaemonVerification", "VerificationPort", "fresh_below", "keep_class", "needs_reveal",
           "live_base", "reveal_bound"]

logger = logging.getLogger(__name__)



LOAD_WINDOW_S = 60.0  # the verifiers' load is measured over windows of at least this many seconds
SATURATED = 0.9  # busy this share of a window or more: the verifiers are saturated (a journaled notice, a warning)
RELIEVED = 0.5  # and no longer, once a window's load falls below this


@dataclass
class VerifierLoad:
    """The local verification worker's load — its re-run seconds over wall seconds — per window of at least
    :data:`LOAD_WINDOW_S`, and whether it is saturated. A held update waits for its verdict, so a saturated verifier
    makes checked work stale (docs/guide/organiser.md, "How much verification capacity"): the change is journaled
    (``verification_load``) and logged with what to do about it. Measured, not decided: no coordinator state."""

    started: Optional[float] = None  # the current window's start (perf_counter seconds) and busy seconds then
    busy_then: float = 0.0
    load: Optional[float] = None  # the last whole window's
    saturated: bool = False

    def note(self, now: float, busy_s: float) -> Optional[bool]:
        """Account up to ``now`` with ``busy_s`` re-run seconds so far; True / False when the verifier just became
        saturated / stopped being so, else None."""
        if self.started is None:
            self.started, self.busy_then = now, busy_s
            return None
        if now - self.started < LOAD_WINDOW_S:
            return None
        self.load = min(1.0, max(0.0, (busy_s - self.busy_then) / (now - self.started)))
        self.started, self.busy_then = now, busy_s
        if not self.saturated and self.load >= SATURATED:
            self.saturated = True
            return True
        if self.saturated and self.load < RELIEVED:
            self.saturated = False
            return False
        return None


@dataclass
class VerifyStats:
    """The worker's own measurements (status.json's ``verification``; not checkpointed)."""

    queued: int = 0
    skipped: int = 0  # the queue was full: the check was not done
    moot: int = 0  # dropped unrun: the peer had been expelled meanwhile
    rerun_steps: int = 0  # inner steps re-run
    busy_s: float = 0.0  # seconds spent re-running
    latencies: list[float] = field(default_factory=list)  # seconds from submission to verdict, the last 256

    def as_dict(self) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        median = ordered[len(ordered) // 2] if ordered else None
        return {
            "queued": self.queued, "skipped": self.skipped, "moot": self.moot, "rerun_steps": self.rerun_steps,
            "busy_s": round(self.busy_s, 3), "latency_median_s": median, "latency_max_s": ordered[-1] if ordered else None,
        }


URGENT_RUN = 4  # urgent checks taken ahead of a waiting other one in a row, at most (then the oldest other goes)


class UrgentFirst(asyncio.Queue["tuple[Verify, float, Optional[Buffer]]"]):
    """The verifier's queue of ``(check, offered at, revealed)``: first in, first out, except that the oldest *urgent*
    check — one θ waits for: its update, or an update of its peer's behind it in a chain of carried states
    (coordinator/chained.py), is held for a verdict — goes ahead of the others, at most :data:`URGENT_RUN` times in a
    row while another waits, so that no other check waits for ever.

    Why: a slow uplink's every lease is re-run, each check of a peer waiting for the one before it (its start state),
    so each peer has one check queued and a backlog behind it; taken in turn, a held check — a suspect's, a
    probation's — waited for every peer's backlog, and its update reached θ 20–42 versions stale (docs/wan.md).
    An applied-first check's wait delays only its verdict."""

    def __init__(self, maxsize: int, urgent: Callable[[Verify], bool]) -> None:
        super().__init__(maxsize)
        self.urgent = urgent
        self.run = 0  # urgent checks taken ahead of another in a row

    def _get(self) -> Any:
        items = self._queue  # type: ignore[attr-defined]  # asyncio.Queue's deque (its _get/_put hooks, as PriorityQueue)
        for index, item in enumerate(items):
            if not self.urgent(item[0]):
                continue
            if index == 0:
                break  # the oldest is urgent itself: nothing is passed over
            if self.run < URGENT_RUN:
                self.run += 1
                del items[index]
                return item
            break
        self.run = 0
        return items.popleft()


class Verifier:
    """The coordinator's background verification worker. :meth:`offer` never blocks (a full queue skips the
    check); :meth:`run` re-runs one lease at a time in a worker thread and hands each verdict to ``on_verdict``
    (:class:`DaemonVerification`: a :class:`~asyncloco.coordinator.logic.Verified` event through the node's decide)."""

    def __init__(
        self,
        rerunner: Rerunner,
        on_verdict: Callable[[Verify, Comparison], Awaitable[None]],
        capacity: int = 16,
        clock: Callable[[], float] = time.monotonic,
        moot: Callable[[Verify], bool] = lambda task: False,
        on_skip: Optional[Callable[[Verify, str], Awaitable[None]]] = None,
        ahead: int = 0,
        urgent: Callable[[Verify], bool] = lambda task: False,
    ) -> None:
        self.rerunner = rerunner
        self.on_verdict = on_verdict
        self.on_skip = on_skip  # a check that ends without a verdict (its re-run failed)
        self.moot = moot  # a queued check no longer needed (its peer was expelled meanwhile): dropped unrun
        self.clock = clock
        # (check, when it was offered, the revealed start and end states: None for a reset-state lease re-run from θ alone)
        self.queue: "asyncio.Queue[tuple[Verify, float, Optional[Buffer]]]" = UrgentFirst(capacity, urgent)
        self.stats = VerifyStats()
        self.idle = asyncio.Event()
        self.idle.set()
        # re-runs made ahead of their updates (coordinator/ahead.py), in the worker's spare time: a queued check goes first
        self.ahead = Ahead(ahead)
        self._wake = asyncio.Event()  # something was planned ahead

    def offer(self, task: Verify, revealed: "Optional[Buffer]" = None, offered_at: Optional[float] = None) -> bool:
        """Queue a re-run (``revealed``: the start inner state for a carried-state lease, b"" for a fresh one)."""
        try:
            self.queue.put_nowait((task, self.clock() if offered_at is None else offered_at, revealed))
        except asyncio.QueueFull:
            self.stats.skipped += 1
            logger.warning("verification queue full: lease %s of %s is not re-run", task.lease.lease_id, task.peer[-8:])
            return False
        self.stats.queued += 1
        self.idle.clear()
        return True

    def plan_ahead(self, run: AheadRun) -> None:
        """Re-run ``run`` ahead of its update when the worker has nothing queued (coordinator/ahead.py)."""
        if self.ahead.plan(run):
            self._wake.set()

    async def _run_ahead(self, run: AheadRun) -> None:
        started = time.perf_counter()
        result: Optional[AheadResult] = None
        try:
            result = await asyncio.to_thread(Ahead.run, run, self.rerunner)
        except Exception as error:  # never a verdict: the check re-runs the lease when its update is in
            logger.warning("re-running lease %s ahead failed (%r); it is re-run when its update arrives",
                           run.lease.lease_id, error)
        finally:
            self.ahead.finish(result)
        self.stats.busy_s += time.perf_counter() - started
        self.stats.rerun_steps += run.lease.steps

    async def judge_ahead(self, task: Verify, result: Optional[AheadResult] = None) -> Optional[Comparison]:
        """``task`` judged from its re-run made ahead (``result``, else the finished one :attr:`ahead` holds for it), or
        None: there is none, or it was made for another θ or lease than the one the submission names."""
        result = self.ahead.take(task.lease.lease_id) if result is None else result
        if result is None:
            return None
        comparison = await asyncio.to_thread(self.ahead.judge, task, result, self.rerunner)
        if comparison is None:
            self.ahead.stats.mismatched += 1
        else:
            self.ahead.stats.used += 1
        return comparison

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if self.queue.empty() and self.ahead.planned:
                run = self.ahead.next()
                if run is not None:
                    await self._run_ahead(run)
                continue
            self._wake.clear()
            getter = asyncio.ensure_future(self.queue.get())
            stopper = asyncio.ensure_future(stop.wait())
            waker = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait({getter, stopper, waker}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            waker.cancel()
            if not getter.done():
                getter.cancel()
                await asyncio.gather(getter, return_exceptions=True)
            if getter.cancelled():
                if stop.is_set():
                    break
                continue  # woken for a run ahead
            task, queued_at, revealed = getter.result()
            if self.moot(task):
                self.stats.moot += 1
                self._done()
                continue
            started = time.perf_counter()
            rerun = True
            try:
                if revealed is None:
                    # its re-run ahead may have finished meanwhile (it was running when the update came)
                    comparison = await self.judge_ahead(task)
                    rerun = comparison is None
                    if comparison is None:
                        comparison = await asyncio.to_thread(self.rerunner.check, task)
                else:
                    comparison = await asyncio.to_thread(self.rerunner.check_revealed, task, revealed)
            except Exception as error:  # a bug or a lease the workload cannot serve: no verdict, never an expulsion
                logger.error("re-running lease %s failed (%r); no verdict", task.lease.lease_id, error)
                if self.on_skip is not None:
                    await self.on_skip(task, f"the re-run failed: {error!r}"[:300])
                self._done()
                continue
            self.stats.busy_s += time.perf_counter() - started
            self.stats.rerun_steps += task.lease.steps if rerun else 0
            try:
                await self.on_verdict(task, comparison)
            except Exception as error:  # the daemon failed to decide (it fail-stops on its own); keep the worker alive
                logger.error("the verdict on lease %s could not be decided: %r", task.lease.lease_id, error)
            self.stats.latencies = (self.stats.latencies + [self.clock() - queued_at])[-256:]
            self._done()

    def _done(self) -> None:
        self.queue.task_done()
        if self.queue.empty():
            self.idle.set()


def live_base(live: CoordinatorState) -> Callable[[int], Optional[torch.Tensor]]:
    """θ at a version as the live coordinator holds it (a copy of θ itself when it is the current version, which
    changes in place): what a kept lease chosen for verification is re-run from after a repair."""
    from asyncloco.coordinator.logic import base_theta

    def base(version: int) -> Optional[torch.Tensor]:
        theta = base_theta(live, version)
        return theta.clone() if theta is live.params else theta

    return base


def needs_reveal(actions: Iterable[Action], lease_id: str) -> bool:
    """Does the submission of ``lease_id`` that produced ``actions`` need its inner states revealed (a :class:`Verify`
    of a carried, committed state)? The submit's Ack asks for it. A lease that started fresh too: its end state is
    revealed with the start (train/commitments.py ``pack_parts``) and compared with the re-run's (coordinator/rerun.py).
    Never a lease granted with a fresh start (``Lease.fresh``: its peer's uplink cannot carry a reveal): it is re-run
    from θ and the data, as with ``inner_state: reset``."""
    return any(
        isinstance(a, Verify) and a.lease.lease_id == lease_id and bool(a.state_start) and not a.failed
        and not a.lease.fresh for a in actions
    )


def reveal_bound(cfg: "RunConfig", model: torch.nn.Module) -> int:
    """The most bytes any reveal of this run may carry: a start and an end state in a reveal's layout — Σ (1 + 8 + 8n)
    over the model's parameters for a full AdamW state, with error feedback the residual with each state
    (train/commitments.py pack_reveal), both with their length field (pack_parts)."""
    from asyncloco.train.commitments import revealed_size

    params = list(model.parameters())
    inner = sum(9 + 8 * param.numel() for param in params)
    return revealed_size(inner, sum(param.numel() for param in params), cfg.runtime.uses_error_feedback)


def keeps_end_states(cfg: "RunConfig", model: torch.nn.Module) -> bool:
    """Whether a passed re-run here keeps its end state (the rerunner's ``keep_end``, coordinator/chained.py): inner
    states carried from lease to lease and ``runtime.verify.keep_states_mb`` holding at least one full state (with error
    feedback its residual too, :meth:`DaemonVerification.state_part_size`)."""
    knobs = cfg.runtime.verify
    return knobs.inner_state == "carry" and 0 < (reveal_bound(cfg, model) - 8) // 2 <= knobs.keep_states_mb * 2**20


def keep_class(cfg: "RunConfig", model: torch.nn.Module) -> str:
    """``VerifyPolicy.keep_class`` (logic/leases.py ``carries_checked``): the compute class whose checks this
    coordinator re-runs itself keeping their end states (coordinator/chained.py: no reveal of the end, none of the next
    lease's start), "" when it keeps none — checks lent to validators or not re-run here, or no end state kept
    (:func:`keeps_end_states`, the rerunner's ``keep_end``)."""
    knobs = cfg.runtime.verify
    if not (knobs.enabled and knobs.local and not knobs.validators and keeps_end_states(cfg, model)):
        return ""
    from asyncloco.train.inner import compute_class

    return compute_class(cfg.runtime.eval_device)


def fresh_below(cfg: "RunConfig", model: torch.nn.Module) -> float:
    """``VerifyPolicy.fresh_below`` (bytes/s): the uplink below which a peer's leases start from a fresh inner state
    (coordinator/logic/leases.py ``fresh_reason``) — twice the RPC service's transfer floor (a reveal shares the uplink
    with the next update, and a body slower than the floor is cut off), or one inner state's reveal
    (train/commitments.py ``revealed_size``, one part) over ``runtime.verify.fresh_start_reveal_s``, whichever is
    higher; 0 (never) when that knob is 0."""
    seconds = cfg.runtime.verify.fresh_start_reveal_s
    if seconds <= 0:
        return 0.0
    from asyncloco.train.commitments import revealed_size
    from asyncloco.transport.rpc import ServiceLimits

    sizes = [param.numel() for param in model.parameters()]
    part = revealed_size(sum(9 + 8 * n for n in sizes), sum(sizes), cfg.runtime.uses_error_feedback, ends=False)
    return max(2.0 * ServiceLimits().transfer_min_bytes_per_s, part / seconds)


# ------------------------------------------------------------------------------------ the daemon's side


@dataclass(frozen=True)
class VerificationPort:
    """What verification uses of the coordinator (coordinator/daemon.py builds it), and nothing more.

    State changes go through ``node`` alone — :meth:`decide` (verdicts, checks ended unverified) and
    :meth:`CoordinatorNode.apply_repair` (a repair's rebuilt state, its ``Repaired`` record logged first) — and the
    live state is read from it (``node.state``), as are the lock, the clock and the log's last record."""

    cfg: "RunConfig"
    dir: Path
    workload: "Workload"
    model: torch.nn.Module  # the run's model: its shapes (reveal bounds), a fresh state's parameter groups
    node: "CoordinatorNode"
    journal: Callable[[], "Journal"]  # the journal now (testing/memory.py gives the monitoring one on its clock)
    eval_model: Callable[[], torch.nn.Module]  # the evaluations' model (the repair's validation losses use a copy)
    bookkeep: Callable[[list[Action]], bool]  # the journal, stats and held requests of actions decided off decide
    write_status: Callable[[], None]
    wait_for_snapshot: Callable[[], Awaitable[None]]
    # (codec, version) -> the full encoding of θ a delta download was taken from, while the RPC service holds it
    download_anchor: Callable[[str, int], Optional[bytes]] = lambda codec, version: None

    async def decide(self, event: Event) -> bool:
        """``event`` through the node's decide under its lock; False (nothing decided) once the coordinator stops."""
        async with self.node.lock:
            if self.node.stopping:
                return False
            await self.node.decide(event)
        return True


_INLINE_JOIN = 64 * 2**20
"""A kept start and a revealed end joined larger than this are joined in a worker thread, not on the event loop."""


@dataclass
class _Partial:
    """A check whose peer reveals its end alone: the start the coordinator has (None: coming with the verdict on the
    peer's previous check) and the end once revealed."""

    check: Verify
    start: Optional["Buffer"]
    end: Optional["Buffer"] = None


class DaemonVerification:
    """What the coordinator daemon does for verification, behind four hooks it calls (coordinator/daemon.py):
    :meth:`record` for the actions Verify / Verdict / Expelled (live and in ``--resume`` replay alike, with
    :attr:`replay_seq` set to the record being replayed), :meth:`note_snapshot` after a durable snapshot,
    :meth:`status` for status.json and :meth:`close` at shutdown. It holds a :class:`VerificationPort`, not the
    daemon: verdicts go back through the node's decide (:meth:`VerificationPort.decide`) as
    :class:`~asyncloco.coordinator.logic.Verified` events, and a repair's state through the node's ``apply_repair``."""

    def __init__(self, port: VerificationPort, event_types: Mapping[str, type]) -> None:
        cfg = port.cfg
        self.port = port
        self.knobs = cfg.runtime.verify
        self.event_types = event_types
        self.anchors = Anchors(Path(port.dir), self.knobs.horizon, keep_archive=cfg.runtime.wal_archive)
        self.verifier = Verifier(
            Rerunner(cfg, port.workload, device=cfg.runtime.eval_device), self._verdict, self.knobs.queue,
            moot=lambda task: task.peer in self.port.node.state.verification.expelled,
            on_skip=self._unverified,
            ahead=self.knobs.ahead if self.knobs.inner_state == "reset" and self.knobs.local else 0,
            urgent=self._urgent,
        )
        self.replay_seq: Optional[int] = None  # the log record being replayed (None: live)
        # checks a --resume replay met without their verdict (lease id -> check): queued again by start()
        self.resumed_checks: dict[str, Verify] = {}
        self.repairs: list[dict[str, Any]] = []
        self._stop: Optional[asyncio.Event] = None
        self._task: Optional["asyncio.Task[None]"] = None
        self._decided: set["asyncio.Task[None]"] = set()  # verdicts known without a re-run, being decided
        # carried-state checks waiting for the peer's reveal (lease id -> check, when it was asked, its deadline task)
        self.awaiting: dict[str, tuple[Verify, float, "asyncio.Task[None]"]] = {}
        self._receiving: dict[str, float] = {}  # lease id -> when the reveal body being received must be in (clock)
        self._state_size: Optional[int] = None
        # start states a check needs no reveal for (coordinator/chained.py): fresh ones, and end states of checked leases
        on_disk = self.knobs.keep_states_on == "disk" and self.knobs.inner_state == "carry" and self.knobs.keep_states_mb > 0
        store = StateStore(Path(port.dir) / "kept-states" if on_disk else None)
        self.chained = ChainedStates(self.knobs.keep_states_mb * 2**20, store)
        self.verifier.rerunner.store = store
        # checks whose peer reveals the end alone (Ack reveal_start: false): the start kept, or coming with the verdict
        # of the peer's previous check, and the end once revealed — offered when both are in (coordinator/chained.py)
        self.partial: dict[str, _Partial] = {}
        # a re-run copies out its end state only when one fits the budget (at 150m one is 1.8 GB with error feedback)
        carry = self.knobs.inner_state == "carry"
        self.verifier.rerunner.keep_end = keeps_end_states(cfg, port.model)
        if carry and self.chained.budget and not self.verifier.rerunner.keep_end:
            logger.warning("runtime.verify.keep_states_mb (%d) is less than one inner state of this model (%.0f MB): "
                           "every check asks its peer to reveal its start state; raise it to keep a state per peer",
                           self.knobs.keep_states_mb, self.state_part_size() / 2**20)
        # moot: its peer was expelled; start_only: received without the end state (Ack reveal_end: false, needs_end)
        self.reveals = {"asked": 0, "received": 0, "late": 0, "moot": 0, "refused": 0, "start_only": 0}
        # validator peers (asyncloco/validator.py): the checks lent to them (coordinator/validators.py)
        self.desk = ValidatorDesk(self)
        # the honest re-runs a repair applies in an expelled peer's place (runtime.verify.repair: rerun)
        self.reruns = RepairReruns(cfg, port.workload, Path(port.dir), self.anchors, self.fresh_state, event_types) \
            if self.knobs.repair == "rerun" else None
        self.pending_repairs: list[Expelled] = []  # expulsions whose repair has not been carried out yet
        self._loss_model: Optional[torch.nn.Module] = None  # the repair's validation losses are computed on it
        self._repairing: set["asyncio.Task[None]"] = set()
        self._repair_turn = asyncio.Lock()
        self.load = VerifierLoad()
        # leases whose update is being decided with a verdict judged on arrival (:meth:`judge_on_arrival`): their Verify
        # is decided by the submit itself, right after it (:meth:`decide_on_arrival`), not queued
        self.arriving: set[str] = set()

    # --- hooks

    def record(self, action: Action, journal: Any) -> bool:
        """Carry out one verification action; True when durable state changed."""
        if isinstance(action, Verify):
            if self.replay_seq is not None:  # its verdict may follow in the log; if not, start() queues it again
                self.resumed_checks[action.lease.lease_id] = action
            else:
                self._check(action)
            return False
        if isinstance(action, Verdict):
            self.resumed_checks.pop(action.lease_id, None)
            journal.write("verdict", peer=action.peer, lease_id=action.lease_id, ok=action.ok, detail=action.detail)
            if not action.ok:
                logger.warning("lease %s of %s failed verification: %s", action.lease_id, action.peer[-8:], action.detail)
            return True
        if isinstance(action, Expelled):
            ahead = self.verifier.ahead
            ahead.forget({lease_id for lease_id, run in [*ahead.planned.items()] if run.lease.peer == action.peer} |
                         {lease_id for lease_id, result in ahead.done.items() if result.lease[1] == action.peer})
            for lease_id, (check, _, deadline) in list(self.awaiting.items()):  # its reveals are moot now
                if check.peer == action.peer:
                    deadline.cancel()
                    del self.awaiting[lease_id]
                    self.reveals["moot"] += 1
            self.chained.forget(action.peer)  # and its checks waiting for a start state (moot too)
            for lease_id in [lease_id for lease_id, part in self.partial.items() if part.check.peer == action.peer]:
                del self.partial[lease_id]
            journal.write("expelled", peer=action.peer, lease_id=action.lease_id, reason=action.reason, anchor=action.anchor,
                          repair=action.repair)
            logger.warning("peer %s expelled: %s", action.peer[-8:], action.reason)
            if not action.repair:
                # every update of it that θ holds was checked before it was applied (its held ones are dropped): there
                # is nothing to take out, and no repair runs
                logger.warning("peer %s had no update applied without a check: θ needs no repair", action.peer[-8:])
                return True
            # The peer is out now (everything it sends is refused); θ is repaired once the re-runs that replace its
            # updates are trained, outside the lock (the coordinator serves meanwhile), and the repair's Repaired
            # record marks where: a --resume replay repairs at that record, or at its end if the record never came.
            self.anchors.pin(action.anchor)
            self.pending_repairs.append(action)
            if self.replay_seq is None:
                self._repair_later(action)
            return True
        raise AssertionError(f"not a verification action: {action!r}")

    def start(self) -> None:
        """Once the daemon serves (its event loop runs): queue again the checks a ``--resume`` replay met without a
        verdict — a re-run from θ and the data is queued like a new one; a check that awaited the peer's reveal
        cannot be asked for again (the ack that asked for it is gone) and ends unverified, so it no longer counts
        toward the peer's probation as one on its way."""
        pending = self.port.node.state.verification.pending
        checks = [check for lease_id, check in sorted(self.resumed_checks.items()) if pending.get(lease_id) == check.peer]
        self.resumed_checks.clear()
        queued = 0
        # a check held, or applied first, before the snapshot the resume started from: the replay did not meet it, but
        # its update (with θ at its base version and the commitments) is in the snapshot — rebuilt from it
        found = {check.lease.lease_id for check in checks}
        book = self.port.node.state.verification
        for lease_id, peer in sorted(pending.items()):
            held = book.held.get(lease_id)
            record = held if held is not None else book.applied_first.get(lease_id)
            if lease_id not in found and record is not None and record.lease.peer == peer:
                reason = record.lease.verify if held is not None else f"{record.lease.verify} (applied first: verifier behind)"
                checks.append(Verify(peer, record.lease, record.base, record.update, reason, "",
                                     record.state_start, record.state_end, record.device_class, record.theta_codec,
                                     record.theta_anchor, record.theta_digest, eager=record.eager))
                found.add(lease_id)
        from asyncloco.train.commitments import FRESH_STATE_DIGEST

        for check in checks:
            fresh = check.state_start == FRESH_STATE_DIGEST and not self.needs_end(check.device_class)  # nothing to reveal
            if not check.failed and check.state_start and needs_reveal([check], check.lease.lease_id) and not fresh:
                # the ack that asked for it is gone: the coordinator's loss, not the peer's — a held update is applied
                self._decide_later(self._unverified_id(check.peer, check.lease.lease_id,
                                                       "the coordinator restarted while the check awaited the peer's reveal",
                                                       apply=True))
            else:
                self._check(check)
                queued += 1
        # checks whose update and base θ are not at hand (a snapshot of an older version of the software, or a repair's
        # replay that discarded the update) — ended, counted as unverifiable
        lost = sorted((lease_id, peer) for lease_id, peer in pending.items() if lease_id not in found)
        for lease_id, peer in lost:
            self._decide_later(self._unverified_id(peer, lease_id, "the coordinator restarted before this check ran "
                                                   "(its update and base θ are not in the snapshot it resumed from)"))
        if checks or lost:
            logger.warning("%d verification check(s) found unjudged after the restart: %d queued again, %d ended "
                           "unverified", len(checks) + len(lost), queued, len(checks) + len(lost) - queued)

    def note_snapshot(self, path: Path, wal_seq: int, version: int) -> None:
        if self.anchors.note_snapshot(path, wal_seq, version):
            logger.info("repair anchor at log record %d (version %d)", wal_seq, version)

    def _note_load(self) -> None:
        """Measure the local worker's load (:class:`VerifierLoad`); journal and log a change of saturation."""
        if not self.knobs.local:
            return
        change = self.load.note(time.perf_counter(), self.verifier.stats.busy_s)
        if change is None:
            return
        load = self.load.load or 0.0
        self.port.journal().write("verification_load", load=round(load, 3), saturated=change)
        if change:
            logger.warning("the verification worker was busy %.0f %% of the last %.0f s: checked updates wait for their "
                           "verdicts and are applied stale, and slow uplinks' leases stop being carried on past "
                           "runtime.verify.carry_backlog_mb. Add validators (runtime.verify.validators), lower "
                           "runtime.verify.fraction or slow_uplink_carry, or give the coordinator a faster "
                           "runtime.eval_device "
                           "(docs/guide/organiser.md, \"How much verification capacity\")", 100 * load, LOAD_WINDOW_S)
        else:
            logger.info("the verification worker is keeping up again (busy %.0f %%)", 100 * load)

    def status(self) -> dict[str, Any]:
        self._note_load()
        book = self.port.node.state.verification
        local_updates = max(1, int(self.port.node.state.local_updates))
        return {
            "fraction": self.knobs.fraction,
            "probation_updates": self.knobs.probation_updates,
            "tolerance": self.knobs.tolerance,
            "cross_device_tolerance": self.verifier.rerunner.cross_device_bounds()[0],
            "compute_class": self.verifier.rerunner.compute_class,  # a peer naming it is compared with `tolerance`
            "checked": book.checked,
            "failed": book.failed,
            "passed": sum(book.passed.values()),
            "pending": len(book.pending),
            "held": len(book.held),  # checked updates waiting for their verdict (applied only if it agrees)
            "dropped": book.dropped,  # held updates never applied: their check failed or ended without a verdict
            "sketch_suspects": dict(book.sketch.flagged),
            "unverifiable": book.unverifiable,
            "expelled": dict(book.expelled),
            "repairs": list(self.repairs),
            "repairs_pending": [action.peer for action in self.pending_repairs],  # expelled, θ not repaired yet
            "anchors": self.anchors.seqs(),
            "reveals": {**self.reveals, "awaiting": len(self.awaiting)},
            "chained": self.chained.status(),  # checks re-run without a reveal (coordinator/chained.py)
            "validators": self.desk.status(),
            "ahead": self.verifier.ahead.stats.as_dict(),  # re-runs made while their leases trained (coordinator/ahead.py)
            # the local worker's re-run seconds over wall seconds, last whole window (None: not yet), and whether saturated
            "load": None if self.load.load is None else round(self.load.load, 3), "saturated": self.load.saturated,
            # re-run inner steps ÷ applied inner steps: verification's compute as a fraction of the run's training
            "compute_fraction": self.verifier.stats.rerun_steps / local_updates,
            **self.verifier.stats.as_dict(),
        }

    def _fresh_kept(self, action: Verify) -> bool:
        """Is ``action`` a check of a lease granted fresh whose re-run's end state this coordinator keeps (its own
        compute class, end states kept)? Re-run as a chained one from the empty start, not from θ alone."""
        from asyncloco.train.commitments import FRESH_STATE_DIGEST

        return (action.lease.fresh and action.state_start == FRESH_STATE_DIGEST and not action.failed
                and self.verifier.rerunner.keep_end and not self.needs_end(action.device_class))

    def _cannot_reveal(self, peer: str) -> str:
        """Why ``peer`` cannot reveal an inner state ("" when it can): its reported uplink is below
        ``VerifyPolicy.fresh_below`` (logic/leases.py ``fresh_reason``)."""
        from asyncloco.coordinator.logic import fresh_reason

        state = self.port.node.state
        info = state.peers.get(peer)
        return "" if info is None else fresh_reason(state.policy, info)

    def needs_end(self, device_class: Optional[str]) -> bool:
        """Must a reveal carry the lease's end state too? Not when only this coordinator re-runs checks
        (``runtime.verify.local`` and no validators) and the peer names the verifier's compute class: the re-run's end
        state is then compared with the committed end digest bitwise (Rerunner.check_revealed), and the peer's own end
        state — as large as the start — would travel unused. A validator may be of another class, which needs it."""
        own = bool(device_class) and device_class == self.verifier.rerunner.compute_class
        return not (own and self.knobs.local and not self.knobs.validators)

    @staticmethod
    def _start_only(state: "Buffer") -> bool:
        """A reveal whose end part is empty (train/commitments.py ``pack_parts``; a malformed one is judged by the re-run)."""
        from asyncloco.train.commitments import split_parts

        try:
            return len(split_parts(state)[1]) == 0
        except ValueError:
            return False

    def reveal_limit(self, lease_id: str, peer: str, size: Optional[int] = None) -> int:
        """The most bytes the reveal of ``lease_id`` may carry (the lease's start and end states: twice the model's
        inner-state size, with error feedback plus its residual, and a length field); raises ValueError naming
        the problem when no reveal of it by ``peer`` is awaited (checked before any byte of the body is read).
        ``size``: the body's declared size, about to be received — the check's deadline waits for its transfer
        (:meth:`receiving`, within the RPC service's transfer deadline for it)."""
        waiting = self.awaiting.get(lease_id)
        if waiting is None or waiting[0].peer != peer:
            self.reveals["refused"] += 1
            raise ValueError(f"no reveal of lease {lease_id[:40]} is awaited from this peer (not chosen, already "
                             "revealed, or past its deadline: runtime.verify.reveal_timeout and its transfer)")
        bound = self.reveal_bound()
        if size is not None and 0 <= size <= bound:
            from asyncloco.transport.rpc import ServiceLimits

            self.receiving(lease_id, ServiceLimits().transfer_timeout(size))
        return bound

    def state_part_size(self) -> int:
        """The bytes of one full inner state in a reveal part's layout (with error feedback its residual too): what a
        kept end state takes (coordinator/chained.py)."""
        return (self.reveal_bound() - 8) // 2

    def reveal_bound(self) -> int:
        """The most bytes any reveal of this run may carry (:meth:`reveal_limit` without the check of who reveals)."""
        if self._state_size is None:
            self._state_size = reveal_bound(self.port.cfg, self.port.model)
        return self._state_size

    def reveal(self, lease_id: str, state: "Buffer", peer: str) -> Any:
        """The peer's revealed start and end states of ``lease_id``: queued for the re-run (Rerunner.check_revealed judges
        its digest, the re-run and the end digest)."""
        from asyncloco.transport.wire import RevealReply

        if len(state) > self.reveal_limit(lease_id, peer):
            raise ValueError(f"revealed state of {len(state)} bytes exceeds this model's inner-state size")
        task, asked_at, deadline = self.awaiting.pop(lease_id)
        deadline.cancel()
        self._receiving.pop(lease_id, None)
        self.reveals["received"] += 1
        if self._start_only(state):
            self.reveals["start_only"] += 1
        part = self.partial.get(lease_id)
        if part is not None:  # the end alone was asked for: the start is the coordinator's (coordinator/chained.py)
            from asyncloco.train.commitments import copy_buffer, join_parts, split_parts

            try:
                end = split_parts(state)[1]
            except ValueError:  # malformed: offered as sent, the re-run names what is wrong with it
                del self.partial[lease_id]
            else:
                if part.start is None:
                    part.end = copy_buffer(end)
                    return RevealReply(True, "kept until the check of the lease it starts from is decided")
                del self.partial[lease_id]
                if len(part.start) + len(end) > _INLINE_JOIN:  # joined in a worker thread (_offer_with_start)
                    self.start_worker()
                    self._offer_with_start(task, part.start, end, offered_at=asked_at)
                    return RevealReply(True, "queued for verification")
                state = join_parts(part.start, end)
        self.start_worker()
        if not self.verifier.offer(task, state, offered_at=asked_at):
            self._decide_later(self._unverified(task, "the verification queue was full", overflow=True))
            return RevealReply(False, "the verification queue is full; this check is skipped")
        return RevealReply(True, "queued for verification")

    async def close(self) -> None:
        self.desk.close()
        for _, _, deadline in list(self.awaiting.values()):
            deadline.cancel()
        self.awaiting.clear()
        for task in list(self._decided) + list(self._repairing):
            task.cancel()  # they wait for the node's lock; a stopping coordinator decides nothing more
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.chained.store.clear()  # kept states do not outlive the process (coordinator/chained.py StateStore)

    async def drain(self) -> None:
        """Wait until every queued re-run has its verdict and every expulsion its repair (tests, benchmarks)."""
        while self._decided or self._repairing or not self.verifier.idle.is_set():
            if self._decided:
                await asyncio.gather(*self._decided, return_exceptions=True)
            await self.verifier.idle.wait()
            if self._repairing:
                await asyncio.gather(*self._repairing, return_exceptions=True)

    # --- internals

    def _check(self, action: Verify) -> None:
        """Judge a check from its re-run made ahead (coordinator/ahead.py), else queue its re-run, or wait for its peer's
        reveal first; a full queue ends it unverified."""
        if action.failed:  # a broken commitment chain: nothing to re-run, the verdict is already known
            self._decide_later(self._verdict(action, Comparison(False, False, math.inf, -1.0, action.failed)))
            return
        if action.lease.lease_id in self.arriving:  # judged on arrival: the submit decides its verdict next
            return
        result = self.verifier.ahead.take(action.lease.lease_id)
        if result is not None and not needs_reveal([action], action.lease.lease_id):
            self._decide_later(self._judge_ahead(action, result))
            return
        self._queue_check(action)

    async def _judge_ahead(self, action: Verify, result: AheadResult) -> None:
        """``action`` judged from the re-run made ahead for it: a verdict at once; queued like any check when the
        submission names another θ or lease than the one the re-run was made for."""
        verifier = self.verifier
        offered = verifier.clock()
        try:
            comparison = await verifier.judge_ahead(action, result)
        except Exception as error:  # a bug: no verdict from it, the check re-runs as before
            logger.error("judging lease %s from its re-run ahead failed: %r", action.lease.lease_id, error)
            comparison = None
        if comparison is None:
            self._queue_check(action)
            return
        await self._verdict(action, comparison)
        verifier.stats.latencies = (verifier.stats.latencies + [verifier.clock() - offered])[-256:]

    async def judge_on_arrival(self, peer: str, lease_id: str, base_version: int, update: torch.Tensor,
                               header: Any) -> Optional[Comparison]:
        """Before the submit of ``lease_id`` is decided (outside the node's lock): its verdict from the re-run made
        ahead for it, when there is one and it was made for this lease and the θ the header names; None otherwise (the
        check, if the logic chooses it, is queued as usual). The submit then decides the update and this verdict back
        to back under one hold of the lock (:meth:`decide_on_arrival`): a held update that passes is applied as if it
        had never been held — no other event comes between (another peer's lease from θ without it, in the simulator
        the ≈ 10 % that verdicts a moment later still cost: docs/results/ahead-reruns-2026-11-28.json)."""
        from asyncloco.coordinator.logic import base_theta

        ahead = self.verifier.ahead
        if lease_id not in ahead.done or self.replay_seq is not None:
            return None
        state = self.port.node.state
        lease = state.leases.get(lease_id)
        base = base_theta(state, base_version)
        if lease is None or lease.peer != peer or lease.base_version != base_version or base is None or lease.eager_of:
            return None
        result = ahead.take(lease_id)
        if result is None:
            return None
        if getattr(header, "theta_codec", None):
            base = torch.empty(0)  # the θ it names is matched by its digest (Ahead.judge): θ itself is not read
        elif base is state.params:
            async with self.port.node.lock:  # θ changes in place when an update is applied: copied while it cannot
                live = self.port.node.state
                now_base = base_theta(live, base_version)  # (retained as a copy if θ moved meanwhile)
                if now_base is None:
                    return None
                base = await asyncio.to_thread(now_base.clone) if now_base is live.params else now_base
        task = Verify(peer, copy.copy(lease), base, update, lease.verify, device_class=getattr(header, "device_class", None) or "",
                      theta_codec=getattr(header, "theta_codec", None) or "", theta_anchor=getattr(header, "theta_anchor", None),
                      theta_digest=getattr(header, "theta_digest", None) or "")
        try:
            return await self.verifier.judge_ahead(task, result)
        except Exception as error:  # a bug: no verdict from it, the check (if chosen) re-runs as before
            logger.error("judging lease %s on arrival failed: %r", lease_id, error)
            return None

    async def decide_on_arrival(self, actions: list[Action], lease_id: str, comparison: Comparison) -> list[Action]:
        """Under the node's lock, right after the submit of ``lease_id`` was decided into ``actions``: decide the verdict
        :meth:`judge_on_arrival` found, if the logic chose the update for a check (its Verify is in ``actions``)."""
        from asyncloco.coordinator.logic import Verify as VerifyAction

        task = next((a for a in actions if isinstance(a, VerifyAction) and a.lease.lease_id == lease_id and not a.failed), None)
        if task is None or self.port.node.stopping:
            return []
        anchor = self.anchors.pin_oldest()  # a failed check's repair replays from it
        try:
            decided = await self.port.node.decide(Verified(task.peer, lease_id, comparison.ok, comparison.detail[:300], anchor))
        finally:
            self.anchors.unpin(anchor)
        self.verifier.ahead.stats.on_arrival += 1
        stats = self.verifier.stats
        stats.latencies = (stats.latencies + [0.0])[-256:]
        return decided

    def served(self, peer: str, version: int, codec: str, anchor: Optional[int], unchanged: bool = False) -> None:
        """θ at ``version`` was sent to ``peer`` in ``codec`` (a delta from ``anchor``, or in full; ``unchanged``: the peer
        holds it already, as sent before): plan the re-runs of its chosen leases based on it (coordinator/ahead.py)."""
        ahead = self.verifier.ahead
        if ahead.limit <= 0 or self.replay_seq is not None:
            return
        if unchanged:
            known, anchor = ahead.sent_as(peer, version, codec)
            if not known:
                return
        else:
            ahead.note_sent(peer, version, codec, anchor)
        self._decide_later(self._plan_ahead(peer, version, codec, anchor))

    async def _plan_ahead(self, peer: str, version: int, codec: str, anchor: Optional[int]) -> None:
        from asyncloco.coordinator.logic import PROBATION_WAIT, base_theta

        body = None
        if anchor is not None:
            body = self.port.download_anchor(codec, anchor)
            if body is None:
                return
        node = self.port.node
        async with node.lock:
            state = node.state
            book = state.verification
            if node.stopping or peer in book.expelled:
                return
            leases = [lease for lease in state.leases.values()
                      if lease.peer == peer and lease.base_version == version and lease.verify
                      and not lease.verify.startswith(PROBATION_WAIT) and lease.lease_id not in book.pending
                      and not lease.eager_of]  # an eager start is known once the update it subtracts is in
            theta = base_theta(state, version) if leases else None
            if theta is None:
                return
            if theta is state.params:  # older versions never change; the current one is copied off the event loop, so
                theta = await asyncio.to_thread(theta.clone)  # a download in flight does not stall on a chosen lease
        for lease in sorted(leases, key=lambda lease: lease.lease_id):
            self.verifier.plan_ahead(AheadRun(lease, theta, codec, anchor, body))
        self.start_worker()

    def _queue_check(self, action: Verify) -> None:
        if not action.base.numel():  # θ at its base version is gone (logic/submit.py on_submit): no re-run can be had
            self._decide_later(self._unverified(action, "θ at the lease's base version is no longer held"))
            return
        if action.lease.eager_of and action.eager is None:  # its start is not at hand (lost to a restart or a repair)
            self._decide_later(self._unverified(action, f"the update of {action.lease.eager_of} its eager start "
                                                "subtracted is no longer held"))
            return
        if action.theta_anchor is not None and action.anchor_body is None:
            # a delta download: the re-run starts from the anchor's full encoding plus the delta (rerun.start_theta)
            body = self.port.download_anchor(action.theta_codec, action.theta_anchor)
            if body is None:  # never served, or evicted (runtime download_anchors), or not on disk at a --resume
                self._decide_later(self._unverified(action, f"the download anchor v{action.theta_anchor} "
                                                    f"({action.theta_codec}) the peer's θ was a delta from is no longer held"))
                return
            action = dataclasses.replace(action, anchor_body=body)
        self.start_worker()
        if self._fresh_kept(action):
            # a lease granted fresh (a slow uplink) re-run from the fresh state, its end state compared with the
            # committed digest and kept: the peer's next lease may carry it (logic/leases.py carries_checked)
            how, start = self.chained.start(action)
            assert how == "fresh" and start is not None
            self._offer_with_start(action, start, b"")
            return
        if action.state_start and needs_reveal([action], action.lease.lease_id):
            # maybe its start is at hand (coordinator/chained.py): then a start-only reveal is not asked for at all, a
            # full one (another compute class, validators) for the end alone
            full = self.needs_end(action.device_class)
            how, start = self.chained.start(action, full)
            if how and full:
                self.partial[action.lease.lease_id] = _Partial(action, start)
            elif how == "wait":  # the peer's previous lease's check leaves it (:meth:`_chain_on`)
                return
            elif start is not None:
                self._offer_with_start(action, start, b"")
                return
            slow = self._cannot_reveal(action.peer)
            if slow:  # a lease carried after a check (leases.carries_checked) whose kept start is gone: not the peer's doing
                self._decide_later(self._unverified(action, "its start state is not kept here (a restart, or dropped: "
                                                    f"runtime.verify.keep_states_mb) and a reveal cannot cross its uplink ({slow})"))
                return
            self._await_reveal(action)
            return
        # inner_state reset: θ at the base version and the data suffice
        if not self.verifier.offer(action, None):
            self._decide_later(self._unverified(action, "the verification queue was full", overflow=True))

    def _decide_later(self, decision: Awaitable[None]) -> None:
        task = asyncio.ensure_future(decision)
        self._decided.add(task)
        task.add_done_callback(self._decided.discard)

    async def _unverified(self, task: Verify, reason: str, overflow: bool = False) -> None:
        """End ``task`` without a verdict. ``overflow`` (the queue was full): a sampled check's held update is applied,
        as it was before updates were held — a sample skipped under load; a probation or suspect check's is dropped
        (a flood of new identities must not let its own probation updates through unchecked)."""
        from asyncloco.coordinator.logic import must_check

        await self._unverified_id(task.peer, task.lease.lease_id, reason, apply=overflow and not must_check(task.lease))
        self._chain_on(task, None)

    def _urgent(self, task: Verify) -> bool:
        """Does θ wait for ``task``'s verdict: its update, or one of its peer's (behind it in its chain), is held?"""
        held = self.port.node.state.verification.held
        return task.lease.lease_id in held or any(update.lease.peer == task.peer for update in held.values())

    def asks_start(self, lease_id: str) -> bool:
        """Must the reveal of ``lease_id`` carry its start state (else the Ack's ``reveal_start: false``: the coordinator
        has it, or will at the verdict on the peer's previous lease)?"""
        return lease_id not in self.partial

    def _offer_with_start(self, check: Verify, start: "Buffer", end: "Buffer", offered_at: Optional[float] = None) -> None:
        """Queue ``check``'s re-run from ``start`` (and the revealed ``end``, b"" for none): a reveal in its layout."""
        from asyncloco.train.commitments import join_parts

        if len(start) + len(end) > _INLINE_JOIN:  # a 60m/150m state (0.7–1.8 GB, maybe read back from disk): off the loop
            self._decide_later(self._offer_joined(check, start, end, offered_at))
        elif not self.verifier.offer(check, join_parts(start, end), offered_at=offered_at):
            self._decide_later(self._unverified(check, "the verification queue was full", overflow=True))

    async def _offer_joined(self, check: Verify, start: "Buffer", end: "Buffer", offered_at: Optional[float]) -> None:
        from asyncloco.train.commitments import join_parts

        if not self.verifier.offer(check, await asyncio.to_thread(join_parts, start, end), offered_at=offered_at):
            await self._unverified(check, "the verification queue was full", overflow=True)

    def asks_reveal(self, lease_id: str) -> bool:
        """Does the check of ``lease_id`` wait for its peer's reveal (the submit's Ack asks for it)? Not when it was
        never queued, or its start state is at hand without one (coordinator/chained.py)."""
        return lease_id in self.awaiting

    def _chain_on(self, task: Verify, end_state: Optional["Buffer"]) -> None:
        """``task`` ended (``end_state``: its end state, when it passed with one): keep it for the peer's next lease
        (coordinator/chained.py), and start the check waiting on it — moot once its peer is expelled, unverified
        without a start state."""
        following = self.chained.finished(task, end_state)
        if following is None:
            return
        check, start = following
        lease_id = check.lease.lease_id
        part = self.partial.get(lease_id)
        if check.peer in self.port.node.state.verification.expelled:
            self.chained.counts["moot"] += 1
            self.partial.pop(lease_id, None)
        elif start is None:
            if part is not None:  # its peer was told to leave the start out: the check cannot be had
                del self.partial[lease_id]
                waiting = self.awaiting.pop(lease_id, None)
                if waiting is not None:
                    waiting[2].cancel()
            self._decide_later(self._unverified(check, "the check of the peer's previous lease, whose end state this "
                                                "lease starts from, ended without a verdict", overflow=True))
        elif part is None:
            self._offer_with_start(check, start, b"")
        elif part.end is None:  # its end is still to be revealed
            part.start = start
        else:
            del self.partial[lease_id]
            self._offer_with_start(check, start, part.end)

    async def _unverified_id(self, peer: str, lease_id: str, reason: str, apply: bool = False) -> None:
        """End a check without a verdict: an :class:`~asyncloco.coordinator.logic.Unverified` event through the
        node's decide (:meth:`VerificationPort.decide`), journaled."""
        if not await self.port.decide(Unverified(peer, lease_id, reason, apply)):
            return
        self.port.journal().write("unverified", peer=peer, lease_id=lease_id, reason=reason)
        logger.warning("lease %s of %s is not verified: %s", lease_id, peer[-8:], reason)

    def reveal_window(self, action: Verify) -> tuple[float, float]:
        """(seconds, cap): how long the peer has to reveal ``action``'s states — ``reveal_timeout`` to send them plus
        their transfer at half the upload rate the coordinator measured on the peer's last update (a reveal shares the
        uplink with the next update), never more than at the transfer floor the RPC service enforces on a body
        (transport/rpc.py ``ServiceLimits.transfer_timeout``) — and ``cap``, that floor's window, which a reveal still
        arriving may stretch it to. A fixed 300 s expelled honest peers: a 150m state (1.8 GB) takes 24 min on a
        10 Mbit/s uplink."""
        from asyncloco.transport.rpc import ServiceLimits

        parts = 1 if action.lease.lease_id in self.partial or not self.needs_end(action.device_class) else 2
        size = 8 + parts * self.state_part_size()
        base = float(self.knobs.reveal_timeout)
        cap = base + ServiceLimits().transfer_timeout(size)
        rate = self._upload_rate(action.peer)
        return (cap, cap) if rate is None else (min(cap, base + 2.0 * size / rate), cap)

    def _upload_rate(self, peer: str) -> Optional[float]:
        """Bytes per second of ``peer``'s last update as the coordinator timed it (None: none timed yet)."""
        info = self.port.node.state.peers.get(peer)
        upload_bytes = self.port.node.state.policy.upload_bytes
        if info is None or not info.transfer_s or not upload_bytes:
            return None
        return upload_bytes / info.transfer_s

    def _slow_uplink(self, action: Verify) -> str:
        """Why a reveal may never have arrived: "" unless the peer's last update came in below the RPC service's floor
        for a body (``ServiceLimits.transfer_min_bytes_per_s``), which a reveal cannot cross; then what to change."""
        from asyncloco.transport.rpc import ServiceLimits

        rate, floor = self._upload_rate(action.peer), ServiceLimits().transfer_min_bytes_per_s
        if rate is None or rate >= floor:
            return ""
        return (f"; its last update came at {rate / 1e3:.1f} kB/s, below the {floor / 1e3:.1f} kB/s a reveal needs — "
                "an uplink this slow cannot be verified with runtime.verify.inner_state carry (use reset)")

    def receiving(self, lease_id: str, seconds: float) -> None:
        """A reveal body of ``lease_id`` is being received, for at most ``seconds`` (its transfer deadline): the check's
        deadline waits for it (up to the cap of :meth:`reveal_window`)."""
        self._receiving[lease_id] = self.port.node.clock.monotonic() + seconds

    def _await_reveal(self, action: Verify) -> None:
        """Wait for the peer to reveal ``action``'s states; a failed check when they have not come within the
        :meth:`reveal_window` (a transfer under way stretches it, up to the window's cap)."""
        lease_id = action.lease.lease_id
        clock = self.port.node.clock
        timeout, cap = self.reveal_window(action)
        self.reveals["asked"] += 1

        async def deadline() -> None:
            asked = clock.monotonic()
            await clock.sleep(timeout)
            while True:  # a body still arriving is waited for, until its own transfer deadline or the cap
                until = min(self._receiving.get(lease_id, 0.0), asked + cap)
                if until <= clock.monotonic() or self.awaiting.get(lease_id, (None,))[0] is not action:
                    break
                await clock.sleep(until - clock.monotonic())
            self._receiving.pop(lease_id, None)
            if self.awaiting.get(lease_id, (None,))[0] is not action:
                return
            del self.awaiting[lease_id]
            self.partial.pop(lease_id, None)
            self.reveals["late"] += 1
            detail = (f"the lease's inner states were not revealed within {clock.monotonic() - asked:.0f} s "
                      f"(runtime.verify.reveal_timeout {self.knobs.reveal_timeout:g} s and their transfer)")
            await self._verdict(action, Comparison(False, False, math.inf, -1.0, detail + self._slow_uplink(action)))

        task = asyncio.get_running_loop().create_task(deadline())
        self.awaiting[lease_id] = (action, self.verifier.clock(), task)

    def start_worker(self) -> None:
        """Start the re-run worker (once; again if it ended) when this coordinator re-runs checks itself."""
        if not self.knobs.local:  # only the validator peers take checks off the queue
            return
        if self._task is None or self._task.done():
            self._stop = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self.verifier.run(self._stop))

    async def judged(self, task: Verify, ok: bool, bitwise: bool, rel_error: float, cosine: float, detail: str,
                     revealed: "Optional[Buffer]" = None) -> None:
        """A validator peer's verdict (coordinator/validators.py), decided like the worker's own; ``revealed``: what the
        check was lent with, whose end part a pass leaves for the peer's next check (coordinator/chained.py)."""
        rerunner = self.verifier.rerunner
        end_state = None
        if ok and revealed and rerunner.keep_end:  # copied (and written, on disk) off the event loop
            end_state = await asyncio.to_thread(rerunner.keep_revealed_end, task, revealed)
        await self._verdict(task, Comparison(ok, bitwise, rel_error, cosine, detail, end_state=end_state))

    def unverified_later(self, task: Verify, reason: str) -> None:
        self._decide_later(self._unverified(task, reason))

    async def _verdict(self, task: Verify, comparison: Comparison) -> None:
        anchor = self.anchors.pin_oldest()  # a failed check's repair replays from it
        try:
            await self.port.decide(Verified(task.peer, task.lease.lease_id, comparison.ok, comparison.detail[:300], anchor))
        finally:
            self.anchors.unpin(anchor)
        self._chain_on(task, comparison.end_state if comparison.ok else None)

    def fresh_state(self) -> CoordinatorState:
        """A new coordinator state of this run's shape — θ's size, the run's outer optimizer, staleness transforms,
        policy, shards and seed, nothing decided yet: what a repair loads its anchor snapshot into and replays the log
        onto (tests rebuild a run's states the same way)."""
        from asyncloco.coordinator.logic import new_state
        from asyncloco.coordinator.methods import build_runtime_method
        from asyncloco.models.workload import param_groups

        cfg = self.port.cfg
        _, optimizer, transforms = build_runtime_method(cfg, param_groups(self.port.model))
        live = self.port.node.state
        return new_state(torch.empty_like(live.params), optimizer, transforms, live.policy, [s.size for s in live.shards], cfg.seed)

    def _repair_later(self, action: Expelled) -> None:
        async def run() -> None:
            async with self._repair_turn:  # one repair at a time, in the order of the expulsions
                node = self.port.node
                expelled = node.state.verification.expelled
                trained: Optional[set[str]] = None
                # a snapshot begun before the expulsion moves log segments to the archive when it is written (none
                # begins while a repair is pending): let it finish, so the log stays put while the re-runs read it
                await self.port.wait_for_snapshot()
                while self.reruns is not None and trained != set(expelled):
                    # trained outside the node's lock, the repair reads them back; again if another peer was
                    # expelled meanwhile (the replay's θs, and so the re-runs, change with the set left out)
                    trained = set(expelled)
                    await asyncio.to_thread(self.reruns.prepare, action.anchor, node.wal.last_seq, trained)
                async with node.lock:
                    if node.stopping or action not in self.pending_repairs:
                        return  # a --resume repairs it (the log has its Verified record and no Repaired)
                    self.repair_pending(self.port.journal())
                    self.port.write_status()

        task = asyncio.ensure_future(run())
        self._repairing.add(task)
        task.add_done_callback(self._repairing.discard)

    def repair_pending(self, journal: Any, remedy: str = "") -> None:
        """Carry out the oldest expulsion's repair (live: its deferred turn, with the node's lock held; a
        ``--resume`` replay: when it meets that repair's ``Repaired`` record, with the remedy the record names, or
        after its last record)."""
        if not self.pending_repairs:
            return
        action = self.pending_repairs.pop(0)
        try:
            self._repair(action, journal, remedy)
        finally:
            self.anchors.unpin(action.anchor)

    def _val_loss(self, theta: torch.Tensor) -> float:
        """The validation loss of ``theta`` (the workload's held-out set, on ``runtime.eval_device``)."""
        from asyncloco.models.workload import load_flat_params

        if self._loss_model is None:  # its own copy: an evaluation may be running on the monitoring's in a thread
            self._loss_model = copy.deepcopy(self.port.eval_model())
        model = self._loss_model
        load_flat_params(model, theta.to(next(model.parameters()).device))
        loss = float(self.port.workload.evaluate(model)["loss"])
        return loss if math.isfinite(loss) else math.inf

    def _repair(self, action: Expelled, journal: Any, remedy: str = "") -> None:
        """Rebuild θ without the expelled peer's unchecked updates. Live, both remedies are computed — its updates
        replaced by honest re-runs (``repair: rerun``, when configured) and left out (``discard``) — and the one whose θ
        has the lower validation loss is installed: a repair never leaves θ worse than leaving the attacker out (early
        in a run, replaying hundreds of honest updates onto a θ without the attacker's, with re-runs in their place,
        could diverge). The choice goes into the ``Repaired`` record; a ``--resume`` replay repeats it (``remedy``)."""
        from asyncloco.coordinator.checkpoint import load_snapshot, snapshot_wal_seq

        node = self.port.node
        upto = self.replay_seq if self.replay_seq is not None else node.wal.last_seq
        anchor_dir = self.anchors.path(action.anchor)
        if action.anchor < 0 or not (anchor_dir / "state.pt").is_file():
            logger.critical(
                "peer %s is expelled but θ cannot be repaired: no repair anchor %d in %s; its updates stay in θ",
                action.peer[-8:], action.anchor, self.anchors.dir,
            )
            journal.write("repair_failed", peer=action.peer, anchor=action.anchor, reason="no repair anchor")
            return
        started = time.perf_counter()
        live = node.state
        before_version = live.version
        kinds = [remedy] if remedy else (["rerun", "discard"] if self.reruns is not None else ["discard"])
        results: dict[str, tuple[RepairResult, Any]] = {}
        with self.anchors.lock:  # no anchor rotation or segment pruning while the repair reads them
            snapshot = load_snapshot(anchor_dir)
            after = snapshot_wal_seq(snapshot)
            for kind in kinds:
                state = self.fresh_state()
                state.load_state_dict(snapshot["coordinator"])
                records = log_events(Path(self.port.dir) / "wal", after, upto, self.event_types, live.params.numel())
                substitutes = self.reruns.substitutes(action.anchor) if kind == "rerun" and self.reruns is not None else None
                with self.reruns.lock if substitutes is not None and self.reruns is not None else contextlib.nullcontext():
                    result = repair(state, records, live.verification.expelled, live.version, dict(live.leases),
                                    live.lease_counter, dict(live.verification.chain), live_base(live), substitutes,
                                    dict(live.verification.eager))
                results[kind] = (result, substitutes)
        losses: dict[str, float] = {}
        if not remedy:  # live (or a resume whose log ends before the record): measured, the lower loss installed
            losses = {"live": self._val_loss(live.params)}
            losses.update({kind: self._val_loss(results[kind][0].state.params) for kind in kinds})
        chosen = remedy or min(kinds, key=lambda kind: (losses[kind], kinds.index(kind)))
        result, substitutes = results[chosen]
        repaired = dataclasses.replace(result.repaired, remedy=chosen)
        # The node installs it, with the repair's own decisions (leases given back, the version jump, the remedy) logged
        # first as the record right after the last one it replayed (node.apply_repair). A --resume replay carries out
        # this repair right before it meets that record (durability.py); if the coordinator died before writing it, the
        # repair is carried out after the replay, not replaying, and the record appended then.
        node.apply_repair(result.state, repaired, log=self.replay_seq is None)
        seconds = time.perf_counter() - started
        summary = {
            "peer": action.peer, "anchor": after, "upto": upto, "replayed": result.replayed, "discarded": result.discarded,
            # runtime.verify.repair rerun: its updates replaced by honest re-runs (trained now / stored before)
            "substituted": result.substituted, "rerun_now": substitutes.computed if substitutes else 0,
            "rerun_stored": substitutes.loaded if substitutes else 0, "refused": result.refused, "held": result.held,
            "version_before": before_version, "version_after": result.state.version, "seconds": round(seconds, 3),
            "voided": sum(1 for a in result.voided if isinstance(a, Expired)), "kept": len(result.state.leases),
            # of the kept: live leases the replay never issued, adopted with their peers' work (coordinator/repair.py)
            "adopted": sum(1 for entry in result.repaired.adopted if str(entry[0]) in result.state.leases),
            # the remedy installed, and the validation loss of the θ it replaced and of each candidate (live only)
            "remedy": chosen, "loss_before": losses.get("live"), "loss_after": losses.get(chosen),
            "losses": losses,
        }
        self.repairs.append(summary)
        journal.write("repaired", **summary)
        logger.warning(
            "θ repaired without %s's updates: %d log records replayed from record %d, %d of its submissions replaced by "
            "honest re-runs, %d discarded (%.2f s); %d active leases given back", action.peer[-8:], result.replayed, after,
            result.substituted, result.discarded, seconds,
            sum(1 for a in result.voided if isinstance(a, Expired)),
        )
        self.port.bookkeep(result.voided)
