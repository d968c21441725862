"""A volunteer peer: join the DHT, publish its speed, and train leases from the coordinator.

Round trip of one lease (docs/algorithm.md §1):

1. ``assign`` → a lease (the coordinator may hold the answer for its grace period);
2. ``get_model(base_version)`` → θ exactly as the lease's base version;
3. ``steps`` inner AdamW steps on the lease's batches (the optimizer state stays here, across rounds);
4. ``submit`` the pseudo-gradient encoded with the run's codec; on a network failure the *same
   encoded bytes* are resent with exponential backoff until the lease deadline, so a coordinator
   restart loses nothing (the coordinator acknowledges a resend of an applied lease as a duplicate).

Throughput is measured on real rounds (tokens per second of pure training time, smoothed) and
published to the DHT under the run id, signed with the peer's key. It is the steady-state throughput:
the first step of a round is left out (it runs on cold caches after the download; on a small model it
takes 1.5-2x a warm step), otherwise a slow peer's short leases would measure it slower still, give it
still fewer steps, and so on — DyLU would drift away from the true speed ratio. ``slowdown`` > 1 stretches every
round ``slowdown``-fold to emulate a slower device (demos, heterogeneity tests): the steps run back to
back, then the peer pauses for ``slowdown - 1`` times their duration. (Sleeping after each step instead
lets caches go cold between steps, which on a CPU makes every step itself 1.3-1.7x slower: a
``--slowdown 4`` peer then behaved like a device 5-7x slower.)

This module holds :class:`PeerRunner` (the hivemind wiring in :meth:`PeerRunner.run`, the rounds in
:meth:`PeerRunner.serve`, one method per step) and :class:`PeerOptions`. Beside it: peer/joining.py (the DHT start,
run id, config and compatibility check before the first lease; :class:`PeerError`), peer/summary.py (the summary
file, time bookkeeping, the observed speed), peer/upload.py (error feedback, the submit resent until acknowledged),
peer/waits.py (the waits a second Ctrl+C cuts short); train/inner.py trains, peer/reveal.py holds the commitments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, TypeVar

import torch

from asyncloco import __version__
from asyncloco.clock import SYSTEM_CLOCK, Clock
from asyncloco.config import RunConfig
from asyncloco.peer.distributed import (
    OP_MEASURE,
    OP_RESET,
    OP_STOP,
    OP_TRAIN,
    Command,
    broadcast_command,
    broadcast_json,
    leave_group,
)
from asyncloco.train.group import GroupContext, GroupFailed
from asyncloco.train.inner import InnerTrainer, LeaseAborted, probe_speed
from asyncloco.peer.joining import PeerError, RunJoiner, ask_for_lease, coordinator_id_from, refused_admission
from asyncloco.peer.summary import (
    PeerSummary, add_timing, next_speed, observed_speed, time_split, update_idle, write_summary,
)
from asyncloco.peer.reveal import RevealStore, settled
from asyncloco.train.commitments import committed_digest
from asyncloco.peer.upload import error_feedback, submit_with_retry
from asyncloco.peer.waits import Aborted, Leave, pause, race
from asyncloco.refusals import RefusalCode

if TYPE_CHECKING:  # the transport package imports hivemind: run() imports it when the peer joins
    from asyncloco.transport.wire import Ack, LeaseGrant

__all__ = ["PeerOptions", "PeerRunner", "PeerError", "PeerSummary", "coordinator_id_from"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
PEER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # the wire's AssignRequest.name (transport/wire.py)


_Leave = Leave  # the rounds end: the volunteer asked to leave at once (a step of serve() logged what is dropped)


@dataclass
class PeerOptions:
    initial_peers: list[str]
    coordinator_id: Optional[str] = None  # default: the /p2p/<id> of the first initial peer
    run_id: Optional[str] = None  # default: the coordinator's
    host: str = "127.0.0.1"
    slowdown: float = 1.0
    max_rounds: Optional[int] = None
    device: str = "cpu"
    summary_path: Optional[Path] = None
    progress: bool = True
    identity_path: Optional[str] = None
    connect_timeout: float = 30.0  # --join-timeout: how long to wait for an unreachable coordinator, with backoff
    token: Optional[str] = None  # admission token from the organiser (runtime.admission: token)
    prefetch: bool = False  # download the newest θ while asking for the next lease (--prefetch)
    overlap: Optional[bool] = None  # train the next lease while the last update uploads (None: the run's runtime.overlap)
    # --- reach (README "Behind a NAT"): outbound connections only unless asked; a name for the status table
    dht_server: bool = False  # serve the DHT (needs inbound connections); default: a DHT client
    name: Optional[str] = None  # shown in `asyncloco status`; 1-64 of [A-Za-z0-9_.-]
    # --- swarm downloads (transport/swarm.py): θ from other peers, verified chunk by chunk
    swarm: bool = False  # --swarm: download θ from the swarm (the coordinator is the seed and the fallback)
    serve: Optional[bool] = None  # --serve/--no-serve; default: serve only when reachable (--dht-server)
    serve_bandwidth: Optional[float] = None  # --serve-bandwidth, bytes/s of chunks served (None: no cap)


class PeerRunner:
    """``await PeerRunner(options).run()`` joins over hivemind (the steps in peer/joining.py); :meth:`serve` runs the
    rounds over any :class:`~asyncloco.transport.link.CoordinatorLink` (the in-memory one in tests: testing/memory.py).

    :param clock: what deadlines and pauses are measured on (asyncloco/clock.py); a fake one in tests.
    :param crash_hook: tests only: called with the name of each kill point the runner passes (``"trained"``:
        a lease trained, its update not yet sent); raising there ends the peer as a crash would.
    """

    def __init__(
        self,
        options: PeerOptions,
        group: Optional[GroupContext] = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        crash_hook: Optional[Callable[[str], None]] = None,
    ) -> None:
        if group is not None and not group.is_leader:
            raise PeerError("internal: only rank 0 of a group runs the peer (the others run distributed.follow)")
        if not options.initial_peers:
            raise PeerError("give at least one --initial-peers address (the coordinator prints it when it starts)")
        if options.slowdown < 1.0:
            raise PeerError(f"--slowdown must be >= 1 (a factor by which to slow down), got {options.slowdown}")
        if options.name is not None and not PEER_NAME.fullmatch(options.name):
            raise PeerError(
                f"--name {options.name!r} must be 1 to 64 letters, digits, '_', '.' or '-' (it is shown to the organiser)"
            )
        self.options = options
        self.coordinator_id = options.coordinator_id or coordinator_id_from(options.initial_peers[0])
        self.summary = PeerSummary(slowdown=options.slowdown)
        self.speed: Optional[float] = None
        self._speed_samples = 0  # leases whose steps measured the speed (next_speed)
        self._training_since: Optional[float] = None  # perf_counter at the start of the lease in training
        # each step's seconds of the lease in training, as the training thread takes them (peer/pipeline.py reads
        # them to time its ask ahead from this lease's own rate); a fresh list per lease
        self.lease_step_seconds: tuple[str, list[float]] = ("", [])  # (lease id, seconds)
        self.group = group
        self.summary.world_size = group.world_size if group is not None else 1
        self._stop = asyncio.Event()  # first Ctrl+C: finish and submit the current lease, then leave
        self._abort = asyncio.Event()  # second Ctrl+C: leave at once
        self._abort_flag = threading.Event()  # the same, for the training thread
        self._inner_loss: Optional[float] = None  # mean inner loss of the latest round (sent with its update)
        # inner-state commitments of the latest round: digests, or their hashing still running (peer/reveal.py settled)
        self._digests: tuple[Optional["str | Future[str]"], Optional["str | Future[str]"]] = (None, None)
        self._inner_end: Optional["str | Future[str]"] = None  # the inner state's digest at the latest round's end (no residual)
        self.reveals: Any = None  # peer/reveal.py RevealStore: start states of the last leases, revealed on request
        self._cfg: Optional[RunConfig] = None  # the run's config, once fetched
        self._closing = asyncio.Event()
        self._loop_started: Optional[float] = None
        self.clock = clock  # --- transport seam: deadlines, pauses and the summary's wall times on this clock
        self.crash_hook = crash_hook
        self.feedback: Any = None  # train/feedback.py ErrorFeedback: this peer's residual, kept across leases and rejoins
        self._fresh_logged = False
        self._prefetch: Optional[asyncio.Task[Any]] = None  # --prefetch: the newest θ, fetched after an ack
        self._idle_wait = 0.0  # the pause after a "no lease" answer (doubles while quarantined)
        # peer/joining.py: DHT, run id, config, fingerprint (its waits on the same clock)
        self.joiner = RunJoiner(options, self.coordinator_id, self._stop, clock)

    def stop(self) -> None:
        """Finish the current lease (train it, submit it), then leave."""
        if not self._stop.is_set() and self._loop_started is not None:
            # the split up to here: a measured run (scripts/wan.py's budget) ends with a stop whose last upload is
            # not part of the rounds it measures
            training = 0.0 if self._training_since is None else time.perf_counter() - self._training_since
            self.summary.stop_wall_s = self.clock.monotonic() - self._loop_started
            self.summary.stop_train_s = self.summary.timing.get("train", 0.0) + training
            self._update_idle()
            self._write_summary()  # on disk now: a peer killed while it finishes still leaves this split
        self._stop.set()

    def abort(self) -> None:
        """Leave at once: stop training after the current step; what is dropped is logged."""
        self._stop.set()
        self._abort.set()
        self._abort_flag.set()

    # ---------------------------------------------------------------------------------- joining over hivemind

    async def run(self) -> PeerSummary:
        """Join over hivemind (DHT, the coordinator's RPCs), then :meth:`serve` until stopped."""
        from asyncloco.transport.dht import stop_dht
        from asyncloco.transport.link import DhtSpeedPublisher
        from asyncloco.transport.records import RunRecords
        from asyncloco.transport.linkspeed import LinkSpeed
        from asyncloco.transport.rpc import CoordinatorClient, TrafficCounters

        group_phase = "config"  # what the followers wait for: the config, then commands
        dht = None
        p2p = None
        swarm: Any = None
        trainer: Optional[InnerTrainer] = None
        try:
            dht = await self.joiner.join_dht()
            self.summary.peer_id = dht.peer_id.to_base58()
            p2p = await dht.replicate_p2p()
            namespace = self.options.run_id
            if namespace is None:
                raise PeerError("internal: run id unknown")  # set by the CLI from the coordinator or --run-id
            cfg, hello = await self.joiner.fetch_config(p2p, namespace)
            self._cfg = cfg
            if hello.run_id != namespace:
                raise PeerError(f"the coordinator serves run {hello.run_id!r}, not {namespace!r}; check --run-id")
            self._check_can_commit(cfg)
            from asyncloco.workloads import build_workload

            if self.group is not None:
                await asyncio.to_thread(broadcast_json, self.group, cfg.model_dump(mode="json"))
                group_phase = "commands"
            workload = build_workload(cfg)
            device = self.group.device if self.group is not None else self.options.device
            trainer = InnerTrainer.from_config(cfg, workload, device=device, group=self.group)
            numel = hello.model_numel
            if trainer.numel != numel:
                raise PeerError(
                    f"this peer builds a {trainer.numel}-parameter model but the coordinator serves {numel}; "
                    f"upgrade asyncloco (coordinator runs {hello.software_version}, this is {__version__})"
                )
            await self.joiner.check_fingerprint(p2p, cfg, workload, trainer.fingerprint_model)  # FSDP: unsharded class
            codec = hello.codec
            counters = TrafficCounters()
            from asyncloco.timings import hold_timings

            client: Any = CoordinatorClient(  # a held lease request is answered before this times out
                p2p, self.coordinator_id, numel, namespace=namespace, assign_timeout=hold_timings(cfg).client, counters=counters,
                download_codec=hello.download_codec,
                link=LinkSpeed(),  # get_model/submit timeouts from this link's measured speed
            )
            if self.options.swarm:  # θ from other peers (transport/swarm.py; docs/transport.md "Swarm")
                from asyncloco.transport.swarm import SwarmLink

                serve = self.options.dht_server if self.options.serve is None else self.options.serve
                swarm = client = SwarmLink(client, p2p, namespace, serve=serve, bandwidth=self.options.serve_bandwidth)
                await swarm.start()
            records = RunRecords(dht, namespace)
            publisher = DhtSpeedPublisher(
                records, self.coordinator_id, self.summary.peer_id, self.options.device, __version__,
                cfg.runtime.speed_report_period,
            )
            return await self.serve(client, publisher, cfg, workload, trainer, codec, counters)
        finally:
            self._stop.set()
            self._closing.set()
            self._update_idle()
            if swarm is not None:
                self.summary.swarm_downloads, self.summary.swarm_fallbacks = swarm.swarm_downloads, swarm.fallbacks
                if swarm.server is not None:
                    served = swarm.server.counters
                    self.summary.swarm_chunks_served, self.summary.swarm_bytes_served = served.chunks_sent, served.bytes_sent
            self._write_summary()
            if swarm is not None:
                await swarm.close()
            if p2p is not None:
                await p2p.shutdown()
            if dht is not None:
                stop_dht(dht)
            if self.group is not None:
                trainer = None  # its DDP reducer holds the group: freed before the group is left (leave_group)
                await asyncio.to_thread(self._release_group, group_phase)

    def _check_can_commit(self, cfg: RunConfig) -> None:
        """An FSDP group cannot commit to its inner state (spread over the ranks; a DDP group commits to its leader's),
        and a run verifying the carried state refuses updates without commitments (docs/threat-model.md)."""
        verify = cfg.runtime.verify
        if self.group is not None and cfg.inner.parallel == "fsdp" and verify.enabled and verify.inner_state == "carry":
            raise PeerError(f"this run verifies leases from each peer's carried inner state (runtime.verify.inner_state: "
                            f"carry), which a peer of {self.group.world_size} ranks sharding its model (inner.parallel: "
                            "fsdp) cannot commit to (its state is spread over the ranks); join with --nproc-per-node 1, "
                            "or the organiser sets inner.parallel: ddp (a DDP group commits) or inner_state: reset")

    def _reset_inner_state(self, trainer: InnerTrainer) -> None:  # on every rank: DDP ranks keep one state
        if self.group is not None:
            broadcast_command(self.group, Command(OP_RESET))
        trainer.reset_inner_state()

    def _start_fresh(self, trainer: InnerTrainer, lease: LeaseGrant) -> None:
        """A lease granted with a fresh start (its ``fresh``: the coordinator judged this peer's uplink too slow to
        reveal a carried state, coordinator/logic/leases.py ``fresh_reason``): the inner state starts afresh and the
        error-feedback residual is dropped, so that the lease is re-run from θ and the data alone."""
        if not self._fresh_logged:
            logger.info("lease %s starts from a fresh inner state: the coordinator finds this peer's uplink too slow to "
                        "reveal a carried one (runtime.verify.fresh_start_reveal_s)", lease.lease_id)
            self._fresh_logged = True
        self.summary.fresh_starts += 1
        if self.feedback is not None:
            self.feedback.drop()
        self._reset_inner_state(trainer)

    def _release_group(self, phase: str) -> None:
        """Tell the followers to stop (unless the group is broken), then leave it."""
        assert self.group is not None
        try:
            if phase == "config":
                broadcast_json(self.group, None)
            else:
                broadcast_command(self.group, Command(OP_STOP))
        except GroupFailed as error:
            logger.warning("the group is broken (%s); followers exit on their own", error)
        leave_group()

    # ---------------------------------------------------------------------------------- rounds

    async def serve(
        self, client: Any, publisher: Any, cfg: RunConfig, workload: Any, trainer: InnerTrainer, codec: str, counters: Any
    ) -> PeerSummary:
        """The rounds (lease, download, train, submit) until stopped, over any transport: ``client`` is a
        transport.link.CoordinatorLink, ``publisher`` a transport.link.SpeedPublisher, ``counters`` the
        client's transport.rpc.TrafficCounters. The speed is measured first unless :attr:`speed` is set.

        One round is :meth:`_ask`, :meth:`_fetch`, :meth:`_train_round`, :meth:`_upload` and, once acknowledged,
        :meth:`_settle`; a step returns None when the round is given up (the loop asks again) and raises
        :class:`_Leave` when the peer leaves at once."""
        self._cfg = cfg  # the run's config (in-process transports skip joiner.fetch_config): commitments read it
        publishing: Optional[asyncio.Task[None]] = None
        self._prefetch = None
        try:
            if self.speed is None:
                self.speed = await asyncio.to_thread(self._measure, cfg, workload)
            self.summary.tokens_per_s = self.speed
            self.summary.units_per_step = workload.units_per_step
            logger.info("joined run %r as %s: %.0f units/s (slowdown ×%g%s)", self.options.run_id, self.summary.peer_id, self.speed,
                        self.options.slowdown, f", {self.group.world_size} ranks" if self.group is not None else "")
            self._write_summary()  # names this peer (its id) before its first lease, for dashboards and tests
            publishing = asyncio.create_task(self._publish_loop(publisher, cfg.runtime.speed_report_period,
                                                                getattr(client, "link", None)))
            self._loop_started = self.clock.monotonic()
            self._idle_wait = 0.0
            if cfg.runtime.overlap if self.options.overlap is None else self.options.overlap:
                from asyncloco.peer.pipeline import OverlappedRounds  # the rounds overlapped (peer/pipeline.py)

                await OverlappedRounds(self, client, publisher, cfg, workload, trainer, codec, counters).run()
                self._stop.set()  # its rounds are over: the serial loop below does not start
            while not self._stop.is_set():
                if self.options.max_rounds is not None and self.summary.rounds >= self.options.max_rounds:
                    break
                try:
                    lease = await self._ask(client, publisher)
                    if lease is None:
                        continue
                    theta = await self._fetch(client, lease)
                    if theta is None:
                        continue
                    pseudo_gradient = await self._train_round(trainer, theta, lease, cfg, workload)
                    ack = await self._upload(client, trainer, lease, pseudo_gradient, cfg, codec)
                except _Leave:
                    break
                if ack is not None:
                    await self._settle(client, lease, ack, counters)
            return self.summary
        finally:
            self._stop.set()
            self._closing.set()
            if self._prefetch is not None:
                self._prefetch.cancel()
                await asyncio.gather(self._prefetch, return_exceptions=True)
            if publishing is not None:
                await asyncio.gather(publishing, return_exceptions=True)
            self._update_idle()
            # the final counters, also when the peer leaves on a refusal (its last upload was read, then refused)
            self.summary.traffic = counters.as_dict()
            self._write_summary()

    async def _ask(
        self, client: Any, publisher: Any, keep: Optional[str] = None, timing: str = "assign"
    ) -> Optional[LeaseGrant]:
        """A lease, or None after a failed request or a "no lease" answer (paused: 2 s after a failure; 1 s
        after "no lease", doubling up to 30 s while quarantined). ``keep``: the lease this peer still holds (its
        update uploading, or training while it asks ahead); ``timing``: the summary's key for the seconds it took."""
        from asyncloco.transport.errors import TransportError

        asked = self.clock.monotonic()
        try:
            # a first Ctrl+C lets this request finish: a lease handed out meanwhile is trained and
            # submitted like any other (cancelling would leave it to expire at the coordinator)
            reply = await self._unless_aborted(
                ask_for_lease(client, float(self.speed or 0.0), self.options.token, self.options.name, publisher.signer, keep)
            )
        except Aborted:
            logger.warning("leaving at once while asking for a lease; a lease handed out right now is given "
                           "back by the coordinator at its deadline")
            raise _Leave() from None
        except TransportError as error:
            if refused_admission(error):
                raise PeerError(f"the coordinator refused this peer: {error}") from error
            logger.warning("could not get a lease (%s); retrying", error)
            await self._pause(2.0)
            return None
        finally:
            add_timing(self.summary, timing, self.clock.monotonic() - asked)
        lease = reply.lease
        if lease is None:
            # back off while quarantined (1 s, doubling up to 30 s); otherwise ask again after 1 s
            quarantined = reply.code == RefusalCode.QUARANTINED.value
            self._idle_wait = min(30.0, 2 * self._idle_wait) if (self._idle_wait and quarantined) else 1.0
            logger.info("no lease: %s (asking again in %.0f s)", reply.reason, self._idle_wait)
            await self._pause(self._idle_wait)
            return None
        self._idle_wait = 0.0
        if self._stop.is_set():
            logger.info("lease %s arrived as this peer was stopping: training and submitting it first",
                        lease.lease_id)
        return lease

    async def _fetch(self, client: Any, lease: LeaseGrant, timing: str = "download") -> Optional[torch.Tensor]:
        """θ of the lease's base version (the prefetched one if it fits), or None after a failed download."""
        from asyncloco.transport.errors import TransportError

        downloading = self.clock.monotonic()
        try:
            return await self._download(client, lease, self._prefetch)
        except Aborted:
            logger.warning("leaving at once: lease %s dropped before training (the coordinator gives its "
                           "%s steps back)", lease.lease_id, lease.steps)
            raise _Leave() from None
        except TransportError as error:
            logger.warning("could not download θ for %s (%s); asking for a new lease", lease.lease_id, error)
            await self._pause(1.0)
            return None
        finally:
            self._prefetch = None
            add_timing(self.summary, timing, self.clock.monotonic() - downloading)

    async def _train_round(
        self, trainer: InnerTrainer, theta: torch.Tensor, lease: LeaseGrant, cfg: RunConfig, workload: Any
    ) -> torch.Tensor:
        """Train the lease (then pause for the emulated slowdown) and fold the round's speed into :attr:`speed`;
        returns the pseudo-gradient. The summary's ``train`` seconds are the computation's (perf_counter: a thread
        computing, which a fake clock does not see) plus the emulated pause (on the runner's clock)."""
        bar = self._progress_bar(lease)
        self.summary.training = lease.lease_id
        self._training_since = time.perf_counter()
        self._write_summary()
        training = time.perf_counter()  # times a computation (the training thread), not a wait
        computed: Optional[float] = None
        pausing: Optional[float] = None
        if lease.fresh:
            self._start_fresh(trainer, lease)
        try:
            pseudo_gradient, seconds, step_seconds = await asyncio.to_thread(self._train, trainer, theta, lease, bar)
            computed = time.perf_counter() - training
            if self.options.slowdown > 1.0:
                # emulate a slower device: one pause after the steps, so that they ran warm (module doc)
                pausing = self.clock.monotonic()
                await self._pause(seconds * (self.options.slowdown - 1.0))
        except LeaseAborted as aborted:
            logger.warning("leaving at once: lease %s dropped after %d of %d steps (the coordinator gives its "
                           "steps back)", lease.lease_id, aborted.steps_done, aborted.steps)
            raise _Leave() from None
        except GroupFailed as error:
            raise PeerError(
                f"{error}. Lease {lease.lease_id} is dropped (the coordinator gives its steps back at its "
                "deadline or when it sees this peer gone); restart the group to rejoin"
            ) from error
        finally:
            self.summary.training = ""
            self._training_since = None
            computed = time.perf_counter() - training if computed is None else computed
            paused = 0.0 if pausing is None else self.clock.monotonic() - pausing
            add_timing(self.summary, "train", computed + paused)
            if bar is not None:
                bar.close()
        if self._abort.is_set():
            logger.warning("leaving at once: the trained pseudo-gradient of lease %s is dropped, unsent",
                           lease.lease_id)
            raise _Leave()
        if self.crash_hook is not None:  # tests: a peer that dies after training, before its submit
            self.crash_hook("trained")
        observed = observed_speed(step_seconds, workload.units_per_step, self.options.slowdown, self.speed)
        if observed is not None:
            self.speed = next_speed(self.speed, observed, self._speed_samples, cfg.schedule.speed_ema)
            self._speed_samples += 1
        if self.speed is not None:  # always: serve() measured it (or was given it) before the first round
            self.summary.tokens_per_s = self.speed
        return pseudo_gradient

    async def _upload(
        self, client: Any, trainer: InnerTrainer, lease: LeaseGrant, pseudo_gradient: torch.Tensor, cfg: RunConfig,
        codec: str,
    ) -> Optional[Ack]:
        """Encode (with error feedback) and submit the pseudo-gradient, and count the round; returns the ack, or
        None when nothing was sent or nothing acknowledged."""
        uploading = self.clock.monotonic()
        encoded = await self._encode(trainer, lease, pseudo_gradient, cfg, codec)
        if encoded is None:
            return None
        ack = await self._submit(client, trainer, lease, encoded, self._digests, self._inner_loss, uploading)
        applied = ack is not None and ack.accepted
        self.feedback.settle(applied)  # not applied: the residual is dropped
        if self._commits(trainer) and not applied:
            self._reset_inner_state(trainer)  # only applied leases advance the commitment chain (coordinator/logic/submit.py)
        return ack

    async def _encode(
        self, trainer: InnerTrainer, lease: LeaseGrant, pseudo_gradient: torch.Tensor, cfg: RunConfig, codec: str
    ) -> Any:
        """The pseudo-gradient encoded with error feedback (the end commitment takes the residual it leaves), or None
        for a diverged round (nothing to send; the inner state and the residual start afresh)."""
        from asyncloco.transport.errors import CodecError

        try:
            self.feedback = error_feedback(self.feedback, cfg, codec)
            encoded = await asyncio.to_thread(self.feedback.encode, pseudo_gradient)
        except CodecError as error:  # NaN/Inf: a diverged round has nothing to send; its lease expires
            logger.warning("lease %s not submitted: %s", lease.lease_id, error)
            self._reset_inner_state(trainer)  # the commitment chain goes on from the fresh state
            self.feedback.settle(False)  # and from no residual (the fresh state's commitment has none)
            return None
        if self._commits(trainer) and self.feedback.enabled and self._inner_end is not None:
            # with error feedback the lease's end state includes the residual this upload leaves (peer/reveal.py)
            inner_end = await settled(self._inner_end)
            assert inner_end is not None
            self._digests = (self._digests[0], self.reveals.end_residual(lease.lease_id, inner_end, self.feedback.pending))
        return encoded

    async def _submit(
        self, client: Any, trainer: InnerTrainer, lease: LeaseGrant, encoded: Any,
        digests: tuple[Optional["str | Future[str]"], Optional["str | Future[str]"]], inner_loss: Optional[float],
        uploading: float, eager_of: Optional[str] = None,
    ) -> Optional[Ack]:
        """Send ``encoded`` until acknowledged (peer/upload.py) and count the round (``uploading``: when it began); the
        commitments' digests are awaited here if their hashing is still running (off the training's path).
        ``eager_of``: the lease whose update the training's start subtracted (peer/pipeline.py, algo/eager.py)."""
        digests = (await settled(digests[0]), await settled(digests[1]))
        if self._stop.is_set():
            logger.info("submitting lease %s before leaving (Ctrl+C again to leave at once)", lease.lease_id)
        ack = await submit_with_retry(client, lease, encoded, inner_loss=inner_loss, digests=digests,
                                      clock=self.clock, abort=self._abort, summary=self.summary,
                                      device_class=trainer.compute_class, unanswered_for=self.options.connect_timeout,
                                      eager_of=eager_of)
        add_timing(self.summary, "upload", self.clock.monotonic() - uploading)
        self.summary.rounds += 1
        self.summary.steps += lease.steps
        return ack

    async def _settle(
        self, client: Any, lease: LeaseGrant, ack: Ack, counters: Any,
        digests: Optional[tuple[Optional["str | Future[str]"], Optional["str | Future[str]"]]] = None, prefetch: bool = True,
    ) -> None:
        """After an ack: prefetch the newest θ (--prefetch), reveal if asked, count the verdict, write the summary.
        ``digests``: the lease's commitments (default: the latest round's)."""
        if prefetch and self.options.prefetch and not self._stop.is_set():
            # the next lease most likely starts from the newest θ: fetch it while asking for the lease
            self._prefetch = asyncio.ensure_future(client.get_model(None))
        if ack.reveal:  # chosen for verification after the submission: send the lease's start (and end) states
            await self._reveal(client, lease.lease_id, await settled((digests or self._digests)[0]),
                               end=ack.reveal_end is not False, start=ack.reveal_start is not False)
        if ack.accepted:
            self.summary.accepted += 1
            self.summary.duplicates += int(ack.duplicate)
            logger.info("lease %s accepted: version %d%s", lease.lease_id, ack.version, " (duplicate)" if ack.duplicate else "")
        else:
            self.summary.rejected += 1
            logger.warning("lease %s rejected: %s", lease.lease_id, ack.reason)
        self.summary.traffic = counters.as_dict()
        self._update_idle()
        self._write_summary()

    # ---------------------------------------------------------------------------------- what the steps use

    def _train(
        self, trainer: InnerTrainer, theta: torch.Tensor, lease: LeaseGrant, bar: Any
    ) -> tuple[torch.Tensor, float, list[float]]:
        """Train the lease (on the whole group: the leader broadcasts it first); returns (pseudo-gradient,
        seconds of training, each step's seconds), all without the emulated slowdown. Raises
        :class:`LeaseAborted` after a second Ctrl+C, :class:`GroupFailed` when a rank is gone."""
        started = time.perf_counter()  # times the computation (the speed measurement's seconds), not a wait
        step_seconds: list[float] = []
        self.lease_step_seconds = (lease.lease_id, step_seconds)

        def on_step(seconds: float) -> None:
            step_seconds.append(seconds)
            if bar is not None:
                bar.update(1)

        shard, start, steps, lr_offset = lease.shard, lease.start_offset, lease.steps, lease.lr_offset
        if self.group is not None:
            broadcast_command(self.group, Command(OP_TRAIN, shard, start, steps, lr_offset))
        commit = self._commits(trainer)  # runtime.verify with carried inner state: digests before and after
        state_start: Optional["str | Future[str]"] = None
        if commit:
            assert self._cfg is not None
            # error feedback: the residual this lease's upload adds is committed and revealed with the inner state
            feedback = self._cfg.runtime.uses_error_feedback
            residual = self.feedback.residual if feedback and self.feedback is not None else None
            if self.reveals is None:
                self.reveals = RevealStore(self._cfg.runtime.verify.reveal_keep)
            # the start's digest from the bytes kept for the reveal (the last lease's end when nothing changed it),
            # hashed meanwhile in the store's thread: the lease does not wait for it
            inner_start = self.reveals.hold_deferred(lease.lease_id, trainer.optimizer, residual, feedback=feedback)
            commit = inner_start is not None
            if inner_start is not None and residual is None:
                state_start = inner_start  # the commitment is the inner digest itself
            elif inner_start is not None:  # the residual changes as the feedback runs: committed to now
                state_start = committed_digest(inner_start.result(), residual)
        result = trainer.run(theta, shard, start, steps, lr_offset, on_step=on_step, should_stop=self._abort_flag.is_set)
        # the end state is kept to be revealed with the start (peer/reveal.py), its digest taken from the same bytes
        self._inner_end = self.reveals.hold_end_deferred(lease.lease_id, trainer.optimizer) if commit else None
        self._digests = (state_start, self._inner_end)  # with feedback, _upload adds the residual to the end
        loss = float(result.mean_loss)
        self._inner_loss = loss if math.isfinite(loss) and 0.0 <= loss <= 1e6 else None  # the wire's bounds
        return result.pseudo_gradient, time.perf_counter() - started, step_seconds

    async def _reveal(self, client: Any, lease_id: str, digest: Optional[str], end: bool = True, start: bool = True) -> None:
        """Reveal lease ``lease_id``'s (``start``) start and (``end``) end inner states (peer/reveal.py; commitments)."""
        from asyncloco.peer.reveal import send_reveal

        state = self.reveals.reveal_parts(lease_id, end, start) if self.reveals is not None else None
        # a lost reveal fails an honest check at reveal_timeout: resend for up to half of it
        retry_for = self._cfg.runtime.verify.reveal_timeout / 2 if self._cfg is not None else 0.0
        await send_reveal(client, lease_id, state, digest, retry_for=retry_for, wait=self._pause,
                          now=self.clock.monotonic, aborted=self._abort.is_set)

    def _commits(self, trainer: InnerTrainer) -> bool:
        """Does this peer commit to its inner state (docs/threat-model.md, "Commitments")?"""
        if self._cfg is None:
            return False
        verify = self._cfg.runtime.verify
        return verify.enabled and verify.inner_state == "carry" and trainer.can_commit()

    async def _publish_loop(self, publisher: Any, period: float, link: Any = None) -> None:
        """Publish this peer's speed every ``period`` seconds (``publisher``: a transport.link.SpeedPublisher), with its
        link's measured rates (``link``: the client's transport.linkspeed.LinkSpeed) and its time split."""
        from asyncloco.transport.link import LinkReport

        while not self._closing.is_set():
            if self.speed is not None:
                measured = getattr(link, "measured", None) or {}
                wall = self.clock.monotonic() - self._loop_started if self._loop_started is not None else 0.0
                report = LinkReport(measured.get("up"), measured.get("down"), time_split(self.summary, wall))
                try:
                    await publisher.publish_speed(float(self.speed), report)
                except Exception as error:  # retried next period
                    logger.warning("could not publish the speed report: %r", error)
            with contextlib.suppress(Aborted):
                await race(self.clock.sleep(period), self._closing)

    def _measure(self, cfg: RunConfig, workload: Any) -> float:
        """Initial throughput from a few real steps of a throwaway replica (tokens or samples per second of
        the global batch; the whole group measures together)."""
        if self.group is not None:
            broadcast_command(self.group, Command(OP_MEASURE))
        device = self.group.device if self.group is not None else self.options.device
        # an emulated slower device takes `slowdown` times as long for the same steps (see run())
        return probe_speed(cfg, workload, device, group=self.group) / self.options.slowdown

    async def _unless_aborted(self, call: Awaitable[T]) -> T:
        """Await ``call`` unless a second Ctrl+C comes first (then cancel it and raise :class:`Aborted`)."""
        return await race(call, self._abort)

    async def _download(self, client: Any, lease: LeaseGrant, prefetch: Optional["asyncio.Task[Any]"]) -> torch.Tensor:
        """θ of the lease's base version: the prefetched latest θ when it is that version, else a download."""
        base = lease.base_version
        if prefetch is not None:
            try:
                version, theta = await self._unless_aborted(prefetch)
            except Aborted:
                raise
            except Exception as error:  # only a hint; the download below is the real thing
                logger.debug("θ prefetch failed: %r", error)
            else:
                if version == base:
                    self.summary.prefetch_hits += 1
                    return theta
            self.summary.prefetch_misses += 1
        _, theta = await self._unless_aborted(client.get_model(base))
        return theta

    def _update_idle(self) -> None:
        update_idle(self.summary, self._loop_started, self.clock)

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` (emulated device time, backoff) on the runner's clock unless asked to leave at once."""
        await pause(self.clock, seconds, self._abort)

    def _progress_bar(self, lease: LeaseGrant) -> Any:
        if not self.options.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=lease.steps, desc=f"lease {lease.lease_id} shard {lease.shard}", unit="step", leave=False)

    def _write_summary(self) -> None:
        write_summary(self.summary, self.options.summary_path)
