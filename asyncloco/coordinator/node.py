"""The coordinator's node: the one place an event becomes a decision.

:meth:`CoordinatorNode.decide` runs an event through :func:`~asyncloco.coordinator.logic.handle`, appends it to
the write-ahead log (fsynced before anyone is answered) and only then hands the actions to whoever carries them
out (``carry_out``, wired by coordinator/daemon.py to the bookkeeping, snapshots, held requests, evaluation and
status). Every change of coordinator state — RPCs, the loops, the tick, verification verdicts — goes through it.
The node owns the lock, the state, the log and the clock; it knows nothing of the network or of monitoring.

Besides :meth:`~CoordinatorNode.decide`, the decide path has three doors, each of them here and nowhere else: the
``--resume`` path (:meth:`~CoordinatorNode.load` a snapshot's state, :meth:`~CoordinatorNode.replay` the log's
records, :meth:`~CoordinatorNode.decide_unanswered` the restart) and :meth:`~CoordinatorNode.apply_repair`, which
installs the state a repair after an expulsion rebuilt (coordinator/verify.py computes it, off the state) with its
``Repaired`` record logged first. tests/test_one_way.py fails if coordinator state is assigned, or the log appended
to, anywhere else.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import typing
from pathlib import Path
from typing import Any, Callable, Optional

from asyncloco import __version__
from asyncloco.clock import Clock
from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import Action, CoordinatorState, Event, Repaired, RequestWork, SubmitUpdate
from asyncloco.coordinator.wal import WriteAheadLog, software_stamp

__all__ = ["CoordinatorNode", "EVENT_TYPES", "SOFTWARE_STAMP"]

logger = logging.getLogger(__name__)

# Events of the logic the write-ahead log can hold, by class name (every member of the Event union).
EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Event)}
# Written into every log record and snapshot; --resume refuses a different one (coordinator/wal.py, check_stamp).
SOFTWARE_STAMP = software_stamp(__version__, EVENT_TYPES)


def handle(state: CoordinatorState, event: Event, now: float) -> tuple[CoordinatorState, list[Action]]:
    """:func:`asyncloco.coordinator.logic.handle`, looked up at each call (tests spy on it)."""
    return logic.handle(state, event, now)


class CoordinatorNode:
    """Lock, state, write-ahead log and clock; :meth:`decide` is the one surface that changes the state."""

    def __init__(
        self,
        state: CoordinatorState,
        directory: Path,
        clock: Clock,
        crash_hook: Optional[Callable[[str], None]] = None,
    ) -> None:
        self.state = state
        self.dir = directory
        self.clock = clock
        # --- transport seam: ``crash_hook`` (tests only) is called at each named kill point of decide:
        # "wal_appended" (the event is in the log, not yet fsynced) and "wal_synced" (durable, nobody told yet)
        self.crash_hook = crash_hook
        self.wal: WriteAheadLog  # opened by the daemon (new run) or coordinator/durability.py (--resume)
        self.lock = asyncio.Lock()
        self.stopping = False  # set under the lock at shutdown: no RPC changes state after that
        self.stop_event: Optional[asyncio.Event] = None
        self.carry_out: Callable[[list[Action]], None] = lambda actions: None

    def refuse_if_stopping(self) -> None:
        # Without this, a submit that was still decoding when SIGTERM came could be applied *after* the
        # final snapshot and the journal's close: acknowledged, durable in the next snapshot only by luck,
        # and missing from events.jsonl. The peer sees a RemoteError and resends after the restart.
        if self.stopping:
            raise ConnectionAbortedError("the coordinator is shutting down; resend after it restarts")

    def fail_stop(self) -> None:
        """Accept no more work and end :meth:`CoordinatorDaemon.run` (its stop event)."""
        self.stopping = True
        if self.stop_event is not None:
            self.stop_event.set()

    async def decide(self, event: Event, wire: Any = None) -> list[Action]:
        """Run one event through the logic and carry out its actions. Call with ``self.lock`` held.

        Order (durability): handle in memory → append the event (with ``now``, and for a submission its
        encoded bytes ``wire`` exactly as received) to the write-ahead log → ``fsync`` → only then carry out
        the actions. Events that produce no action and answer no RPC are appended without an ``fsync`` (the
        next ``fsync`` covers them; losing them in a crash loses nothing anyone was told).

        A submission (``wire`` given: θ-sized bytes to checksum, write and fsync) is logged in a worker thread
        *while* ``handle`` validates and applies it here — the log and the state see the same event and
        ``now``, and nothing is carried out before both are done (the ack latency). Should ``handle``
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
                    self.fail_stop()
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
            self.fail_stop()
            raise
        self.carry_out(actions)
        return actions

    async def decide_locked(self, event: Event) -> list[Action]:
        """:meth:`decide` under the lock, refused once the coordinator is shutting down: the entry point for
        events from outside the RPC handlers (e.g. verification verdicts)."""
        async with self.lock:
            self.refuse_if_stopping()
            return await self.decide(event)

    def decide_unanswered(self, event: Event) -> list[Action]:
        """Run ``event`` through the logic and log it, fsynced, answering nobody and carrying nothing out: the
        caller bookkeeps the actions (``--resume``'s ``Restarted``, coordinator/durability.py)."""
        now = self.clock.time()
        _, actions = handle(self.state, event, now)
        self.wal.append_event(event, now)
        self.wal.sync()
        return actions

    def load(self, coordinator: dict[str, Any]) -> None:
        """``--resume``: the state becomes a snapshot's (``state_dict`` of :class:`CoordinatorState`)."""
        self.state.load_state_dict(coordinator)

    def replay(self, event: Event, now: float) -> list[Action]:
        """``--resume``: a logged event, handled again at its logged ``now``; not logged again, nobody answered."""
        _, actions = handle(self.state, event, now)
        return actions

    def apply_repair(self, state: CoordinatorState, repaired: Repaired, log: bool) -> None:
        """Install the state a repair after an expulsion rebuilt (coordinator/verify.py, from coordinator/repair.py's
        replay of the log; the remedy chosen there by validation loss), live with the lock held.

        ``log`` (live): the ``Repaired`` record — the repair's own decisions, its remedy among them — is appended first,
        as the record right after the last one the repair replayed, so that a later repair replaying across this point,
        and a ``--resume``, repeat it (logic.Repaired). A ``--resume`` replay carries out the repair right before it
        meets that record (``log`` False: the record is in the log, and is then handled again, a no-op). Like
        :meth:`decide`, a log that cannot be written stops the coordinator: nothing is installed."""
        if log:
            try:
                self.wal.append_event(repaired, self.clock.time())
            except OSError as error:
                logger.critical("could not write the write-ahead log in %s (%r); stopping before installing a repair. "
                                "Fix the disk, then restart with --resume", self.dir, error)
                self.fail_stop()
                raise
        self.state = state

    def _log_and_sync(self, event: Event, now: float, attachments: Any) -> None:
        """Append ``event`` to the log and fsync it (a worker thread, for a submission: see ``decide``)."""
        self.wal.append_event(event, now, attachments)
        if self.crash_hook is not None:
            self.crash_hook("wal_appended")
        self.wal.sync()
        if self.crash_hook is not None:
            self.crash_hook("wal_synced")
