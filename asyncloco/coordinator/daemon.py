"""The networked coordinator: the pure decision logic driven by a real clock over hivemind.

What it does, in one place (each concern in a module of its own, put together here):

* starts a hivemind DHT node (a persistent identity in the checkpoint directory, so its peer id —
  the one peers pin — survives restarts; the same TCP port on ``--resume``), announces itself under
  the run id, and serves :class:`~asyncloco.transport.rpc.CoordinatorService`, whose calls the handlers
  of :mod:`asyncloco.coordinator.serving` turn into events;
* every event goes through the node (:mod:`asyncloco.coordinator.node`): :func:`~asyncloco.coordinator.logic.handle`,
  then the write-ahead log (:mod:`asyncloco.coordinator.wal`), fsynced before anything is acknowledged,
  then the actions carried out; the timed loops (:mod:`asyncloco.coordinator.loops`) feed it ticks,
  speed reports read from the DHT and revocations;
* snapshots in the background and the ``--resume`` replay (:mod:`asyncloco.coordinator.durability`);
* the journal of every decision, ``status.json``, the dashboard, metrics sinks and periodic validation
  (:mod:`asyncloco.coordinator.monitoring`);
* on SIGINT/SIGTERM: snapshot, stop serving, shut hivemind down (no orphaned p2pd).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Coroutine, Optional

import torch

from asyncloco import __version__
from asyncloco.clock import SYSTEM_CLOCK, Clock
from asyncloco.config import RunConfig
from asyncloco.coordinator.admission import load_or_create_key
from asyncloco.coordinator.checkpoint import child_pids, reap_stale_children, record_children, remove_partial_snapshots
from asyncloco.coordinator.durability import INITIAL_SNAPSHOT, RESUME_GRACE_S, Durability
from asyncloco.coordinator.logic import Action, Applied, new_state
from asyncloco.coordinator.loops import DhtRecords, RunRecordsPort, announce_loop, revocation_loop, speed_loop, tick_loop
from asyncloco.coordinator.methods import build_runtime_method, coordinator_policy
from asyncloco.coordinator.monitoring import JOURNAL_FILE, STATUS_FILE, Monitoring, PeerStats
from asyncloco.coordinator.node import EVENT_TYPES, SOFTWARE_STAMP, CoordinatorNode
from asyncloco.coordinator.serving import Serving, lease_to_wire
from asyncloco.coordinator.verify import DaemonVerification, VerificationPort, fresh_below, keep_class
from asyncloco.coordinator.wal import WAL_DIR, open_log
from asyncloco.fingerprint import run_fingerprint
from asyncloco.models.workload import Workload, flatten_params, param_groups
from asyncloco.workloads import build_workload

__all__ = [
    "CoordinatorDaemon",
    "PeerStats",
    "EVENT_TYPES",
    "SOFTWARE_STAMP",
    "INITIAL_SNAPSHOT",
    "JOURNAL_FILE",
    "RESUME_GRACE_S",
    "STATUS_FILE",
    "lease_to_wire",
]

logger = logging.getLogger(__name__)

ENDPOINT_FILE = "endpoint.json"
IDENTITY_FILE = "identity.key"
# the download service's anchors (transport/delta.py AnchorStore.persist), kept for verification across a --resume
DOWNLOAD_ANCHORS_DIR = "download-anchors"


@dataclasses.dataclass
class _Started:
    """What :meth:`CoordinatorDaemon.run` started on the DHT node, filled in as it starts (None: not started),
    so that its shutdown undoes exactly that."""

    p2p: Any = None
    service: Any = None
    seed: Any = None


class CoordinatorDaemon:
    """``await CoordinatorDaemon(cfg, checkpoint_dir=..., resume=...).run(stop_event)``.

    Put together from a node (decisions: :attr:`node`), durability (snapshots, resume: :attr:`durability`),
    monitoring (journal, stats, status, evaluation: :attr:`monitoring`) and the RPC handlers (:attr:`serving`, the
    handler of the RPC service). Those parts are its public surface: ``daemon.node.state`` is the live state,
    ``daemon.node.decide_locked(event)`` decides an event, ``daemon.serving.assign(...)`` serves a call,
    ``daemon.durability.save()`` writes a snapshot, ``daemon.monitoring.journal`` is the journal; the daemon
    forwards nothing to them."""

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
        # --- transport seam: every decision reads ``clock`` (a fake one in testing/memory.py's
        # tests); ``crash_hook`` (tests only) is called at each named kill point of the node's decide
        self.clock = clock
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
        if not resume and self.dir.is_dir() and any((self.dir / WAL_DIR).glob("*.wal")):
            raise ValueError(
                f"{self.dir} holds a write-ahead log ({WAL_DIR}/) but no snapshot: continue it with --resume if "
                "it has a state.pt elsewhere, or choose a new runtime.checkpoint_dir"
            )
        self.workload = workload if workload is not None else build_workload(cfg)
        self.model = self.workload.build_model(cfg.seed)
        theta = flatten_params(self.model)
        self.numel = theta.numel()
        self.spec, optimizer, transforms = build_runtime_method(cfg, param_groups(self.model))
        policy = coordinator_policy(cfg, self.spec, self.workload.units_per_step, simulated=False, numel=self.numel)
        # --- admission (coordinator/admission.py): the mode and allowlist go to the logic's policy
        policy = dataclasses.replace(policy, admission=cfg.runtime.admission, allowlist=frozenset(cfg.runtime.allowlist))
        # lease deadlines allow for a download + an upload, scaled from the measured upload by their byte ratio
        from asyncloco.transport.codecs import wire_bytes

        ratio = wire_bytes(cfg.runtime.download_codec, self.numel) / wire_bytes(cfg.runtime.codec, self.numel)
        policy = dataclasses.replace(policy, download_upload_ratio=ratio, upload_bytes=wire_bytes(cfg.runtime.codec, self.numel),
                                     download_bytes=wire_bytes(cfg.runtime.download_codec, self.numel))
        if policy.verify is not None and policy.verify.commit:  # leases that start fresh for a slow uplink
            # and a slow uplink carries its state after a lease re-run here, its end state kept (leases.draw_carry)
            policy = dataclasses.replace(policy, verify=dataclasses.replace(
                policy.verify, fresh_below=fresh_below(cfg, self.model), keep_class=keep_class(cfg, self.model)))
        admission_key = load_or_create_key(self.dir).public_key() if cfg.runtime.admission == "token" else None
        # The lease-id secret is part of the state (snapshots, and so --resume) — fresh for a new run.
        state = new_state(
            theta, optimizer, transforms, policy, self.workload.shard_sizes(), cfg.seed, lease_secret=os.urandom(32)
        )
        # --- the parts (each takes what it uses; none holds the daemon)
        self.node = CoordinatorNode(state, self.dir, clock, crash_hook)
        self.node.carry_out = self._carry_out
        self.monitoring = Monitoring(cfg, self.node, self.workload, self.model, self._identity)
        self.durability = Durability(cfg, self.node, self.monitoring, self.numel)
        self.serving = Serving(cfg, self.node, self.monitoring, self.workload, self.model, self.numel, admission_key)
        self.multiaddrs: list[str] = []
        self.peer_id: str = ""
        self.reach_problem: Optional[str] = None  # what the start-up reachability check found (_check_reach)
        self.counters: Any = None  # transport/rpc.py TrafficCounters while serving
        # --- verification of the work (coordinator/verify.py): re-runs, verdicts, repairs after an expulsion
        self.swarm_seed: Any = None  # transport/swarm.py SwarmSeed while serving (run), if runtime.swarm
        self.verification: Optional[DaemonVerification] = None
        if cfg.runtime.verify.enabled:
            monitoring = self.monitoring
            port = VerificationPort(cfg, self.dir, self.workload, self.model, self.node, lambda: monitoring.journal,
                                    monitoring.eval_model, monitoring.bookkeep, monitoring.write_status,
                                    self.durability.wait_for_snapshot, self._download_anchor)
            self.verification = DaemonVerification(port, EVENT_TYPES)
        self.monitoring.verification = self.durability.verification = self.serving.verification = self.verification
        if resume:
            self.durability.load()
        else:
            self.node.wal = open_log(self.dir, 0, archive=self.durability.archive, stamp=SOFTWARE_STAMP)

    # ------------------------------------------------------------------------------ decisions

    def _carry_out(self, actions: list[Action]) -> None:
        """What follows a durable decision (the node calls it): bookkeeping, snapshot counting, held
        requests answered, evaluation and status."""
        changed = self.monitoring.bookkeep(actions)
        self.durability.note(actions, changed)
        self.durability.maybe_snapshot()
        self.monitoring.hand_out(actions)
        if any(isinstance(a, Applied) for a in actions):
            self.monitoring.maybe_evaluate()
        if changed:
            self.monitoring.write_status()

    def _download_anchor(self, codec: str, version: int) -> Optional[bytes]:
        """The full encoding of θ at ``version`` a delta download was taken from, while the RPC service holds it (with
        verification on, also the ones it held before a ``--resume``: :meth:`new_service`)."""
        service = getattr(self.serving, "service", None)
        return None if service is None else service.downloads.anchor_body(codec, version)

    def _identity(self) -> dict[str, Any]:
        """The daemon's own fields of the status document (coordinator/monitoring.py)."""
        return {
            "software_version": __version__,
            "peer_id": self.peer_id,
            "multiaddrs": self.multiaddrs,
            "method": self.spec.name,
            "parameters": self.numel,
            "traffic": self.counters.as_dict() if self.counters is not None else {},
            "swarm": self.swarm_seed.status() if self.swarm_seed is not None else None,
        }

    # -------------------------------------------------------------------------------- main loop

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


    # ------------------------------------------------------------------- reach, swarm seed

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
        self.monitoring.journal.write("reachability", address=announce, port=port, reachable=self.reach_problem is None, problem=self.reach_problem or "")
        if self.reach_problem is None:
            logger.info("reachable at %s:%d (checked with a libp2p dial from this machine)", announce, port)
        else:
            logger.warning("%s", self.reach_problem)

    async def _start_swarm_seed(self, p2p: Any) -> Any:
        """The θ swarm's seed (transport/swarm.py): serves θ's bodies in signed chunks to peers that
        join with ``--swarm`` and lists them as holders for each other, so the coordinator sends each body about
        once per version instead of once per peer. Manifests are signed with the coordinator's Ed25519 key (the
        one admission tokens are signed with); only admitted peers are served; reports of bad or slow sources go
        to the journal. Peers without ``--swarm`` never touch it. ``runtime.swarm: false`` turns it off."""
        if not self.cfg.runtime.swarm:
            return None
        from asyncloco.transport.swarm import start_seed

        async def serve_model(version: Optional[int]) -> tuple[int, torch.Tensor]:
            return await self.serving.get_model(version)  # no peer id: the fetch is recorded when the peer asks (SwarmLink)

        async def admit(peer_id: str) -> None:
            await self.serving.check_admitted(peer_id)

        def on_report(reporter: str, source: str, version: int, reason: str) -> None:
            self.monitoring.journal.write("swarm_report", peer=reporter, source=source, version=version, reason=reason)

        return await start_seed(
            p2p, self.cfg.runtime.run_id, self.numel, load_or_create_key(self.dir), serve_model,
            current=lambda: self.node.state.version, admit=admit, on_report=on_report,
        )

    def new_service(self, handler: Any = None) -> Any:
        """The RPC service (transport/rpc.py :class:`CoordinatorService`) that serves this daemon — ``handler``
        (default: the daemon itself) answers its calls; the in-memory transport (testing/memory.py) passes a
        wrapper that injects faults. It is this daemon's ``serving.service`` from now on."""
        from asyncloco.transport.rpc import CoordinatorService, TrafficCounters

        self.counters = TrafficCounters()
        service = self.serving.service = CoordinatorService(
            self.serving if handler is None else handler,
            self.numel,
            submit_codecs=(self.cfg.runtime.codec,),
            model_codecs=tuple(dict.fromkeys(("none", self.cfg.runtime.download_codec))),
            counters=self.counters,
            # transport-level rejections (malformed or oversized frames, timeouts, over the call limits),
            # at the transport's bounded rate (ServiceLimits.error_log_*)
            on_protocol_error=lambda peer, reason: self.monitoring.journal.write("protocol_error", peer=peer, reason=reason),
        )
        anchors = self.dir / DOWNLOAD_ANCHORS_DIR
        if self.verification is not None:
            # a check of a lease whose θ came as a delta re-runs from the anchor its peer decoded against: the service
            # keeps its anchors on disk, and a --resume takes them back before any check is queued again
            service.downloads.persist(anchors, load=self.resume)
            self.verification.start()  # checks a --resume found unjudged are queued again once the daemon serves
        elif not self.resume and anchors.is_dir():
            shutil.rmtree(anchors, ignore_errors=True)  # another run's: a later --resume with verification must not load them
        return service

    async def run(self, stop: asyncio.Event, ready: Optional[asyncio.Event] = None) -> None:
        """Serve until ``stop`` is set, then shut down; ``ready`` is set once the coordinator serves. The steps:
        start the DHT node (:meth:`_start_dht`), serve on it (:meth:`_serve_on`), check the announced address
        (:meth:`_check_reach`), announce the start (:meth:`_announce_start`), run the timed loops
        (:meth:`_start_loops`) until ``stop``, write the final snapshot (:meth:`_wind_down`) and undo whatever was
        started (:meth:`_shut_down`, also after a failure)."""
        self.node.stop_event = stop
        dht, port = await self._start_dht()
        started = _Started()
        try:
            records, bound = await self._serve_on(dht, port, started)
            await self._check_reach(bound)
            await self._announce_start(ready)
            tasks = self._start_loops(DhtRecords(records, dht), stop)
            await stop.wait()
            await self._wind_down(tasks)
        finally:
            await self._shut_down(dht, started)

    async def _start_dht(self) -> tuple[Any, int]:
        """Reap what a killed predecessor of this directory left, choose the port (the previous one on
        ``--resume``; a free one ahead when an ``--announce-addr`` must carry it) and start the DHT node. Returns the
        node and the port asked for (0: any)."""
        from asyncloco.transport.dht import start_dht

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
        return dht, port

    async def _serve_on(self, dht: Any, port: int, started: _Started) -> tuple[Any, int]:
        """On the started DHT node: record its processes, write the endpoint file, serve the RPC service, the swarm
        seed and the run's info with the compatibility check (transport/discovery.py, fingerprint.py). What it
        starts goes into ``started`` as it starts. Returns the run's DHT records and the bound port."""
        from asyncloco.transport.discovery import RunInfo, serve_run_info
        from asyncloco.transport.records import RunRecords

        if dht.pid is not None:
            record_children(self.dir, [dht.pid, *child_pids(dht.pid)])  # reaped by the next start if orphaned
        records = RunRecords(dht, self.cfg.runtime.run_id)
        self.peer_id = dht.peer_id.to_base58()
        self.multiaddrs = [str(m) for m in dht.get_visible_maddrs()]
        bound = int(str(self.multiaddrs[0]).split("/tcp/")[1].split("/")[0]) if self.multiaddrs else port
        (self.dir / ENDPOINT_FILE).write_text(
            json.dumps({"peer_id": self.peer_id, "multiaddrs": self.multiaddrs, "port": bound}, indent=1)
        )
        started.p2p = await dht.replicate_p2p()
        await self._record_start()  # before the handlers: no decision of this lifetime precedes its start record
        started.service = self.new_service()
        await started.service.add_p2p_handlers(started.p2p, namespace=self.cfg.runtime.run_id)
        started.seed = self.swarm_seed = await self._start_swarm_seed(started.p2p)
        # --- which run this is, and the peers' compatibility check (transport/discovery.py, fingerprint.py)
        self.serving.fingerprint = await asyncio.to_thread(run_fingerprint, self.cfg, self.workload, self.model)
        await serve_run_info(started.p2p, RunInfo(self.cfg.runtime.run_id, __version__), self.serving.check_fingerprint)
        return records, bound

    async def _record_start(self) -> None:
        """The first snapshot of a new run (a replayed state is snapshotted soon) and the ``start`` record with the
        version this lifetime starts from. Called before the RPC handlers serve: peers that kept running through
        a restart resend at once, and their updates must follow the record (and its version) in the journal."""
        if not self.resume:
            await self.durability.save()
        elif self.durability.replayed:
            self.durability.updates_since_snapshot = self.cfg.runtime.snapshot_every  # snapshot the replayed state soon
        self.monitoring.journal.write(
            "start",
            peer_id=self.peer_id,
            multiaddrs=self.multiaddrs,
            version=self.node.state.version,
            method=self.spec.name,
            resumed=self.resume,
            numel=self.numel,
        )

    async def _announce_start(self, ready: Optional[asyncio.Event]) -> None:
        """Once serving: the monitoring started, ``status.json``, a first evaluation, the log lines, then ``ready``."""
        self.monitoring.start()  # sinks + dashboard (status.py); stopped in _shut_down
        self.monitoring.write_status()
        self.monitoring.maybe_evaluate(force=True)
        logger.info("coordinator of run %r (%s) serving a %.1f M-parameter model (%d)", self.cfg.runtime.run_id, self.spec.label,
                    self.numel / 1e6, self.numel)
        for addr in self.multiaddrs:
            logger.info("listening at %s", addr)
        if ready is not None:
            ready.set()

    def loops(self, records: RunRecordsPort, stop: asyncio.Event) -> dict[str, Coroutine[Any, Any, None]]:
        """The timed loops of coordinator/loops.py, by name, not yet started: ticks, speed reports read from
        ``records``, the run's announcement in them, revocations — each on this daemon's clock until ``stop``. A run
        starts them over the DHT (:meth:`_start_loops`); the in-memory double (testing/memory.py) starts the same
        ones over its in-memory records, on its fake clock."""
        return {
            "tick": tick_loop(self.node, stop),
            "speed": speed_loop(self.node, self.monitoring.stats, self.cfg, records, stop),
            "announce": announce_loop(records, stop, self.clock, self.cfg, self.peer_id, self.multiaddrs, self.numel,
                                      lambda: self.node.state.version),
            "revocation": revocation_loop(self.node, stop),  # admission
        }

    def _start_loops(self, records: RunRecordsPort, stop: asyncio.Event) -> list[asyncio.Task[Any]]:
        """The timed loops (:meth:`loops`) and the monitoring's loop, each until ``stop``."""
        tasks = [asyncio.create_task(loop) for loop in self.loops(records, stop).values()]
        return tasks + [asyncio.create_task(self.monitoring.loop(stop))]

    async def _wind_down(self, tasks: list[asyncio.Task[Any]]) -> None:
        """After ``stop``: refuse new events, end the loops, cancel the held requests, let running evaluations
        finish, write the final snapshot and ``status.json``, then the ``stop`` record."""
        async with self.node.lock:
            self.node.stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for waiter in self.monitoring.waiters.values():
            waiter.future.cancel()
        if self.monitoring.eval_tasks:
            await asyncio.gather(*self.monitoring.eval_tasks, return_exceptions=True)
        async with self.node.lock:
            try:
                await self.durability.save()
                self.monitoring.write_status()
                logger.info("checkpoint written at version %d; shutting down", self.node.state.version)
            except OSError as error:  # the last durable snapshot stands; nothing unsaved was acknowledged
                logger.critical("final checkpoint failed (%r); --resume continues from the last good one", error)
        self.monitoring.journal.write("stop", version=self.node.state.version, local_updates=self.node.state.local_updates)

    async def _shut_down(self, dht: Any, started: _Started) -> None:
        """Undo what :meth:`run` started, whether it ended or failed: the monitoring, the handlers, p2p, the DHT
        node (no orphaned p2pd), the verifier; then the write-ahead log and the journal are closed."""
        from asyncloco.transport.dht import stop_dht

        self.monitoring.stop()
        if started.service is not None and started.p2p is not None:
            try:
                await started.service.remove_p2p_handlers(started.p2p, namespace=self.cfg.runtime.run_id)
                if started.seed is not None:
                    await started.seed.remove_handlers(started.p2p, self.cfg.runtime.run_id)
            except Exception as error:  # shutting down anyway
                logger.debug("removing handlers failed: %r", error)
        if started.p2p is not None:
            await started.p2p.shutdown()
        stop_dht(dht)
        if self.verification is not None:
            await self.verification.close()
        self.node.wal.close()
        self.monitoring.journal.close()
