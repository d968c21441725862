"""The in-memory transport: the real coordinator daemon, its real RPC service and the peers' real
:class:`~asyncloco.transport.rpc_client.CoordinatorClient` in one event loop, under an injectable clock, with
fault injection (the network double sits *below* the real RPC code).

Only libp2p is replaced: the streams are in-memory pipes (asyncloco/testing/memory_p2p.py), so framing, bounds,
error frames, admission at the door and traffic counters are the ones a real run uses. Faults, per call
(``assign`` — hello and lease requests —, ``get_model``, ``submit``, ``reveal``), injected at the stream:

* ``drop_request``: the stream is refused; the daemon never sees the call; the caller gets
  :class:`~asyncloco.transport.errors.PeerUnreachable`;
* ``drop_reply``: the daemon decided (and logged) the call; its answer is dropped on the stream (PeerUnreachable);
* ``delay``: the stream opens ``seconds`` later on the transport's clock;
* ``reset``: the connection resets mid-body — a submission's body is cut (the service reads a truncated body; the
  daemon never sees it), a download's body is cut after the daemon served it;
* a crash of the coordinator at a named point (:class:`KillSwitch`): ``"wal_appended"`` (the event is in the
  log, not yet fsynced), ``"wal_synced"`` (durable, nobody told yet) — both inside the daemon's decision
  path —, and ``"before_reply"`` (a call decided, the process dies before answering). The node is then
  down: its streams are cut and every call fails with PeerUnreachable until :meth:`MemoryTransport.restart`
  resumes it from its directory (snapshot + write-ahead log replay), as ``--resume`` does. An in-process crash
  loses nothing that was written to the log but not fsynced (the page cache survives it); a torn tail record
  is tested on the log itself (tests/test_wal.py).

The DHT's records are replaced too, by :class:`MemoryRecords`: the peers' speed records (written by
:class:`MemorySpeedPublisher`, a peer's publisher) and the coordinator's announcement. Nothing else is: each life of
the daemon runs its real timed loops (asyncloco/coordinator/loops.py: ticks, speed reports, announcement,
revocations — :meth:`~asyncloco.coordinator.daemon.CoordinatorDaemon.loops`) on the transport's clock, as the
actors named in :data:`COORDINATOR_LOOPS`, so a speed record reaches the logic through the real speed loop's filter
and a lease expires at the real tick loop's first tick past its deadline. A crash ends them with the process.

The peer side is :class:`MemoryClient` (the real client on an in-memory node) and :class:`MemorySpeedPublisher`;
the peer runner's own kill point ``"trained"`` takes a :class:`KillSwitch` too. :func:`drive` moves a
:class:`~asyncloco.clock.FakeClock` whenever the task it drives waits on the clock (and the coordinator's loops
sleep on it); a call's handler runs as the calling actor (a held lease request sleeps as the peer that asked). The
client's timeouts are real seconds, as in a real run.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Optional, Tuple, TypeVar, Union

import torch

from asyncloco import __version__
from asyncloco.clock import ACTOR, SYSTEM_CLOCK, Clock, FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.daemon import CoordinatorDaemon
from asyncloco.testing.memory_p2p import CURRENT_PIPES, MemoryNetwork, Pipe
from asyncloco.transport.records import CoordinatorAnnouncement, SpeedRecord
from asyncloco.transport.rpc import RPC_NAMES, CoordinatorService, TrafficCounters
from asyncloco.transport.rpc_client import CoordinatorClient
from asyncloco.transport.wire import Ack, AssignRequest, HelloReply, LeaseReply, RevealHeader, RevealReply, SubmitHeader

__all__ = [
    "COORDINATOR_LOOPS",
    "FAULT_KINDS",
    "KILL_POINTS",
    "Fault",
    "Killed",
    "KillSwitch",
    "MemoryTransport",
    "MemoryClient",
    "MemoryRecords",
    "MemorySpeedPublisher",
    "drive",
    "as_actor",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

FAULT_KINDS = ("drop_request", "drop_reply", "delay", "reset")
RPCS = tuple(RPC_NAMES)
COORDINATOR = "coordinator"  # the coordinator's node name in the in-memory network
KILL_POINTS = ("wal_appended", "wal_synced", "before_reply", "trained")
# the clock actors of the daemon's timed loops (CoordinatorDaemon.loops) under MemoryTransport: drive's background
COORDINATOR_LOOPS = ("coordinator-tick", "coordinator-speed", "coordinator-announce", "coordinator-revocation")
_ACTOR_TASK = "asyncloco-actor:"  # the name of a task as_actor started: this prefix, then the actor
_current_rpc: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("asyncloco_memory_rpc", default=None)


class Killed(BaseException):
    """A process dies at a named point (a BaseException: no ``except Exception`` on the way may survive it)."""

    def __init__(self, point: str) -> None:
        super().__init__(point)
        self.point = point


@dataclass
class Fault:
    """One injected fault. ``rpc``: one of ``assign``, ``get_model``, ``submit``, or ``*``; ``peer``: only
    this caller (None: any); ``times``: how many calls it hits; ``seconds``: the delay (``delay``)."""

    rpc: str
    kind: str
    peer: Optional[str] = None
    times: int = 1
    seconds: float = 0.0
    hits: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is none of {FAULT_KINDS}")
        if self.rpc != "*" and self.rpc not in RPCS:
            raise ValueError(f"fault rpc {self.rpc!r} is none of {RPCS} (or '*' for every call)")
        if self.times < 1 or self.seconds < 0:
            raise ValueError(f"a fault needs times >= 1 and seconds >= 0, got times={self.times} seconds={self.seconds}")

    def matches(self, rpc: str, peer: str) -> bool:
        return self.hits < self.times and self.rpc in ("*", rpc) and self.peer in (None, peer)


class KillSwitch:
    """Kills (raises :class:`Killed`) at the ``nth`` pass through an armed point, optionally only inside
    a given RPC (``rpc``: its events, not the tick's). Pass it as a ``crash_hook``."""

    def __init__(self) -> None:
        self._armed: dict[str, tuple[int, Optional[str]]] = {}
        self.fired: list[str] = []

    def arm(self, point: str, nth: int = 1, rpc: Optional[str] = None) -> None:
        if point not in KILL_POINTS:
            raise ValueError(f"kill point {point!r} is none of {KILL_POINTS}")
        if nth < 1:
            raise ValueError(f"nth must be >= 1, got {nth}")
        self._armed[point] = (nth, rpc)

    def armed(self, point: str) -> bool:
        return point in self._armed

    def __call__(self, point: str) -> None:
        armed = self._armed.get(point)
        if armed is None:
            return
        left, rpc = armed
        if rpc is not None and _current_rpc.get() != rpc:
            return
        if left > 1:
            self._armed[point] = (left - 1, rpc)
            return
        del self._armed[point]
        self.fired.append(point)
        logger.info("killed at %s", point)
        raise Killed(point)


def as_actor(name: str, call: Awaitable[T]) -> "asyncio.Task[T]":
    """Run ``call`` as a task whose sleeps on a FakeClock (and its children's) :func:`drive` follows."""

    async def run() -> T:
        ACTOR.set(name)
        return await call

    task = asyncio.ensure_future(run())
    task.set_name(_ACTOR_TASK + name)
    return task


def _present(names: tuple[str, ...]) -> list[str]:
    """Which of the actors ``names`` have a task (started with :func:`as_actor`) still running in this event loop."""
    running = {task.get_name() for task in asyncio.all_tasks() if not task.done()}
    return [name for name in names if _ACTOR_TASK + name in running]


async def drive(
    clock: FakeClock,
    actors: Mapping[str, "asyncio.Future[Any]"],
    until: Optional[Callable[[], bool]] = None,
    *,
    real_timeout: float,
    max_step: float = 15.0,
    idle_step: Optional[float] = None,
    background: tuple[str, ...] = COORDINATOR_LOOPS,
) -> None:
    """Move ``clock`` while the ``actors`` (tasks started with :func:`as_actor`, by name) wait on it, until
    ``until()`` holds (default: every actor is done).

    Time moves to the earliest wake-up only when every actor still running sleeps on the clock with a
    wake-up at most ``max_step`` seconds ahead — never while one computes (trains in a thread) or waits on
    anything else; a long sleep (a speed report every few minutes) does not count as waiting. With no
    actor running, time moves by ``idle_step`` (None: it does not move). Either way only while every
    ``background`` actor that is running sleeps on the clock too (the coordinator's timed loops: a tick that is
    still writing its log record finishes at the time it started; a crashed coordinator runs none). Raises
    TimeoutError after ``real_timeout`` real seconds (a test's deadline)."""
    deadline = time.monotonic() + real_timeout

    def done() -> bool:
        return until() if until is not None else all(task.done() for task in actors.values())

    while not done():
        remaining = deadline - time.monotonic()
        running = [name for name, task in actors.items() if not task.done()]
        if remaining <= 0:
            raise TimeoutError(
                f"drive: not done after {real_timeout:.0f} s (fake time +{clock.monotonic():.1f} s; running: {running})"
            )
        wakes = [clock.wake_time_of(name) for name in running]
        now = clock.time()
        quiet = all(clock.wake_time_of(name) is not None for name in _present(background))
        if quiet and running and all(wake is not None and wake - now <= max_step for wake in wakes):
            await clock.advance_to(max(now, min(wake for wake in wakes if wake is not None)))
            continue
        if quiet and not running and idle_step is not None:
            # nobody to follow: time moves in idle steps, each once the loops sleep again (the tick loop ticks each second)
            await clock.advance(idle_step)
            continue
        waiter = asyncio.ensure_future(clock.wait_for_sleeper())
        waits: set[asyncio.Future[Any]] = {waiter, *(actors[name] for name in running)}
        await asyncio.wait(waits, timeout=min(remaining, 0.05), return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)


class _FaultyHandler:
    """What the real :class:`~asyncloco.transport.rpc.CoordinatorService` calls: the daemon's handlers, with the
    faults that strike once the daemon has decided a call (a crash before the reply; a reply lost or cut)."""

    def __init__(self, transport: "MemoryTransport", daemon: CoordinatorDaemon) -> None:
        self.transport, self.daemon = transport, daemon

    async def _decided(self, rpc: str, peer: str, call: Awaitable[T]) -> T:
        _current_rpc.set(rpc)  # this stream's handler task: the kill switch's rpc filter reads it
        result = await call
        self.transport.kill("before_reply")  # raises Killed when armed for this rpc: the stream dies unanswered
        fault = self.transport._fault(rpc, peer, ("drop_reply",) + (("reset",) if rpc == "get_model" else ()))
        pipes = CURRENT_PIPES.get()
        if fault is not None and pipes is not None:
            if fault.kind == "drop_reply":
                pipes[1].drop()
            else:
                pipes[1].reset_after(2, 0.5)  # the reply's header frame, then the body is cut
        return result

    async def assign(self, request: AssignRequest, peer_id: str) -> Union[HelloReply, LeaseReply]:
        return await self._decided("assign", peer_id, self.daemon.serving.assign(request, peer_id))

    async def get_model(self, version: Optional[int], peer_id: str) -> Tuple[int, torch.Tensor]:
        return await self._decided("get_model", peer_id, self.daemon.serving.get_model(version, peer_id))

    async def check_admitted(self, peer_id: str) -> None:
        await self.daemon.serving.check_admitted(peer_id)

    def served(self, peer_id: str, version: int, codec: str, anchor: Optional[int], unchanged: bool = False) -> None:
        self.daemon.serving.served(peer_id, version, codec, anchor, unchanged)

    async def submit(self, header: SubmitHeader, pseudo_gradient: Any, peer_id: str, upload_seconds: float = 0.0) -> Ack:
        return await self._decided("submit", peer_id, self.daemon.serving.submit(header, pseudo_gradient, peer_id, upload_seconds))

    async def reveal_limit(self, header: RevealHeader, peer_id: str) -> int:
        limit: int = await self.daemon.serving.reveal_limit(header, peer_id)
        return limit

    async def reveal(self, header: RevealHeader, state: bytes, peer_id: str) -> RevealReply:
        return await self._decided("reveal", peer_id, self.daemon.serving.reveal(header, state, peer_id))


class MemoryTransport:
    """One coordinator daemon (checkpoint directory ``checkpoint_dir``) served in memory by its real RPC service.

    ``await transport.start()`` starts it (``resume=True``: from an existing directory) with its real timed loops
    on ``clock`` over the in-memory records :attr:`records`; ``client(peer)`` and ``publisher(peer)`` are a peer's
    ends; ``faults`` and ``kill`` inject failures; ``restart()`` resumes a crashed (or running) daemon;
    ``close()`` stops it cleanly (a final snapshot, as on SIGTERM)."""

    def __init__(self, cfg: RunConfig, checkpoint_dir: Path, *, clock: Clock = SYSTEM_CLOCK, workload: Any = None) -> None:
        self.cfg, self.dir, self.clock, self.workload = cfg, Path(checkpoint_dir), clock, workload
        self.records = MemoryRecords(clock)  # the DHT's: they outlive the coordinator's lives
        self.faults: list[Fault] = []
        self.kill = KillSwitch()
        self.crashes: list[str] = []  # the points at which the coordinator crashed, in order
        self.lives = 0
        self.daemon: Optional[CoordinatorDaemon] = None
        self.service: Optional[CoordinatorService] = None
        self.numel = 0  # θ's size, known once started
        self.down = True
        self.network = MemoryNetwork(connect_hook=self._connect)
        self.node = self.network.node(COORDINATOR)
        self.node.up = False
        self.node.on_handler_error = self._handler_error
        self._loops: list[asyncio.Task[None]] = []  # the timed loops of the daemon's current life

    # ------------------------------------------------------------------------------------ lifecycle

    async def start(self, resume: bool = False) -> CoordinatorDaemon:
        if not self.down:
            raise RuntimeError("the in-memory coordinator is already running")
        daemon = CoordinatorDaemon(
            self.cfg, checkpoint_dir=self.dir, resume=resume, workload=self.workload, clock=self.clock, crash_hook=self.kill
        )
        if self.workload is None:
            self.workload = daemon.workload
        daemon.node.stop_event = asyncio.Event()
        if not resume:
            await daemon.durability.save()  # what CoordinatorDaemon.run writes at start
        service = daemon.new_service(_FaultyHandler(self, daemon))
        await service.add_p2p_handlers(self.node, namespace=self.cfg.runtime.run_id)
        self.daemon, self.service, self.numel, self.down = daemon, service, daemon.numel, False
        self.node.go_up()
        self.lives += 1
        self._run_loops(daemon)
        return daemon

    def _run_loops(self, daemon: CoordinatorDaemon) -> None:
        """The daemon's own timed loops (:meth:`CoordinatorDaemon.loops`) over the in-memory records, until its stop
        event, each as the actor ``coordinator-<name>`` (:data:`COORDINATOR_LOOPS`); a kill point one of them passes
        crashes the coordinator."""
        stop = daemon.node.stop_event
        assert stop is not None
        loops = daemon.loops(self.records, stop)
        assert tuple(f"coordinator-{name}" for name in loops) == COORDINATOR_LOOPS, sorted(loops)

        async def supervised(loop: Awaitable[None]) -> None:
            try:
                await loop
            except Killed as killed:
                if self.daemon is daemon and not self.down:
                    self._crash(killed.point)

        self._loops = [as_actor(f"coordinator-{name}", supervised(loop)) for name, loop in loops.items()]

    def _stop_loops(self) -> None:
        """End the current life's loops (a crash: at once, wherever they are; :meth:`_end_loops` waits for them)."""
        daemon = self.daemon
        if daemon is not None and daemon.node.stop_event is not None:
            daemon.node.stop_event.set()
        current = asyncio.current_task()
        for task in self._loops:
            if task is not current:
                task.cancel()

    async def _end_loops(self) -> None:
        self._stop_loops()
        loops, self._loops = self._loops, []
        current = asyncio.current_task()
        await asyncio.gather(*(task for task in loops if task is not current), return_exceptions=True)

    async def restart(self) -> CoordinatorDaemon:
        """``--resume``: a running daemon is crashed first (no final snapshot, no log close)."""
        if not self.down:
            self._crash("restart")
        await self._bury()
        return await self.start(resume=True)

    def crash_now(self) -> None:
        """The coordinator dies between calls (e.g. SIGKILL while idle)."""
        if not self.down:
            self._crash("now")

    async def close(self) -> None:
        """Stop: a clean shutdown of a running daemon (final snapshot), or the remains of a crashed one."""
        daemon = self.daemon
        if daemon is not None and not self.down:
            async with daemon.node.lock:  # as CoordinatorDaemon.run winds down: no event after this, the loops end
                daemon.node.stopping = True
            await self._end_loops()
            async with daemon.node.lock:
                await daemon.durability.save()
            self.down = True
            self.node.go_down()
            await self._unserve()
            await self._drain(daemon)
            daemon.monitoring.journal.close()
            daemon.node.wal.close()
            self.daemon = None
        else:
            await self._bury()

    def _crash(self, point: str) -> None:
        self.down = True
        self.crashes.append(point)
        self.node.go_down()  # its connections die with the process
        self._stop_loops()  # and its loops
        if self.daemon is not None:
            # and nothing it still has in flight decides anything more (a verdict of its verifier reached the dead
            # coordinator's log after the crash but not its journal: a process killed by SIGKILL writes neither)
            self.daemon.node.stopping = True

    def _handler_error(self, error: BaseException) -> bool:
        """A stream handler raised: a kill point crashes the coordinator (True: handled)."""
        if isinstance(error, Killed):
            self._crash(error.point)
            return True
        return False

    async def _unserve(self) -> None:
        await self.node.drain()
        if self.service is not None:
            await self.service.remove_p2p_handlers(self.node, namespace=self.cfg.runtime.run_id)
            self.service = None

    async def _bury(self) -> None:
        """What is left of a crashed daemon: let its threads finish (a real crash stops them too), release
        its files without writing anything more."""
        await self._end_loops()
        await self._unserve()
        daemon, self.daemon = self.daemon, None
        if daemon is None:
            return
        await self._drain(daemon)
        daemon.monitoring.journal.close()
        daemon.node.wal.abandon()

    @staticmethod
    async def _drain(daemon: CoordinatorDaemon) -> None:
        await daemon.durability.wait_for_snapshot()
        for task in list(daemon.monitoring.eval_tasks):
            await asyncio.gather(task, return_exceptions=True)
        for waiter in daemon.monitoring.waiters.values():
            waiter.future.cancel()

    # ------------------------------------------------------------------------------------- faults

    def add_fault(self, rpc: str, kind: str, *, peer: Optional[str] = None, times: int = 1, seconds: float = 0.0) -> Fault:
        fault = Fault(rpc, kind, peer, times, seconds)
        self.faults.append(fault)
        return fault

    def _fault(self, rpc: str, peer: str, kinds: tuple[str, ...]) -> Optional[Fault]:
        for fault in self.faults:
            if fault.kind in kinds and fault.matches(rpc, peer):
                fault.hits += 1
                return fault
        return None

    async def _connect(self, caller: str, target: str, handle_name: str) -> Optional[Callable[[Pipe, Pipe], None]]:
        """Before a stream of ``caller`` opens: a delay, a lost request, or a submission to be cut mid-body."""
        rpc = handle_name.rsplit(".", 1)[-1]
        fault = self._fault(rpc, caller, ("drop_request", "delay") + (("reset",) if rpc == "submit" else ()))
        if fault is None:
            return None
        if fault.kind == "delay":
            await self.clock.sleep(fault.seconds)
            return None
        if fault.kind == "drop_request":
            raise ConnectionRefusedError(f"{rpc} from {caller}: request lost (injected)")
        return lambda request, reply: request.reset_after(2, 0.5)  # the header frame, then the body is cut

    def client(self, peer: str, *, counters: Optional[TrafficCounters] = None, download_codec: Optional[str] = None) -> "MemoryClient":
        return MemoryClient(self, peer, counters=counters, download_codec=download_codec or self.cfg.runtime.download_codec)

    def publisher(self, peer: str, signer: Optional[str] = None) -> "MemorySpeedPublisher":
        return MemorySpeedPublisher(self, peer, signer)


class MemoryClient(CoordinatorClient):
    """A peer's real :class:`~asyncloco.transport.rpc_client.CoordinatorClient` on the in-memory node ``peer`` of a
    started :class:`MemoryTransport` (the coordinator's id and θ's size come from it)."""

    def __init__(self, transport: MemoryTransport, peer: str, *, counters: Optional[TrafficCounters] = None,
                 download_codec: str = "none") -> None:
        if transport.numel <= 0:
            raise RuntimeError("start the MemoryTransport before making its clients")
        super().__init__(
            transport.network.node(peer), transport.node.peer_id, transport.numel,
            namespace=transport.cfg.runtime.run_id, counters=counters, download_codec=download_codec,
            assign_timeout=600.0, liveness_period=0.5,
        )
        self.transport, self.peer = transport, peer


class MemoryRecords:
    """The run's DHT records in memory (transport/records.py ``RunRecords`` keeps them in the DHT), as the
    coordinator's loops read and write them (:class:`~asyncloco.coordinator.loops.RunRecordsPort`): each signer's
    latest speed record until it expires, and the coordinator's announcement. Stamped with ``clock``'s time."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.speeds: dict[str, tuple[SpeedRecord, float]] = {}  # by signer: (record, expiry)
        self.announcement: Optional[CoordinatorAnnouncement] = None

    def time(self) -> float:
        return self.clock.time()

    def store_speed(self, signer: str, record: SpeedRecord, ttl_s: float) -> None:
        """Store (or replace) ``signer``'s speed record for ``ttl_s`` seconds, as a DHT store under its key."""
        self.speeds[signer] = (record, self.clock.time() + ttl_s)

    async def read_signed_speeds(self) -> list[tuple[str, SpeedRecord]]:
        now = self.clock.time()
        return [(signer, record) for signer, (record, expiry) in self.speeds.items() if expiry > now]

    async def reach(self, peers: list[str]) -> None:
        """Nothing to do: every record is in reach."""

    async def announce(self, announcement: CoordinatorAnnouncement, ttl_s: float) -> None:
        self.announcement = announcement


class MemorySpeedPublisher:
    """A peer's :class:`~asyncloco.transport.link.SpeedPublisher` in memory: its signed speed record goes into the
    transport's :class:`MemoryRecords` (valid for three report periods, as a DHT store of
    :class:`~asyncloco.transport.link.DhtSpeedPublisher`), where the coordinator's real speed loop reads it.
    ``signer``: the fingerprint of its signing key (None: ``key-<peer>``)."""

    def __init__(self, transport: MemoryTransport, peer: str, signer: Optional[str]) -> None:
        self.transport, self.peer, self._signer = transport, peer, signer if signer is not None else f"key-{peer}"

    @property
    def signer(self) -> Optional[str]:
        return self._signer

    async def publish_speed(self, tokens_per_s: float, link: Any = None) -> None:
        transport = self.transport
        fields = link.fields() if link is not None else {}
        record = SpeedRecord(peer_id=self.peer, tokens_per_s=float(tokens_per_s), device="memory",
                             software_version=__version__, last_seen=transport.records.time(), **fields)
        transport.records.store_speed(self._signer, record, 3 * transport.cfg.runtime.speed_report_period)
