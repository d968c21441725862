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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, TypeVar

import torch

from asyncloco import __version__
from asyncloco.algo.dylu import ema
from asyncloco.clock import SYSTEM_CLOCK, Clock
from asyncloco.config import RunConfig
from asyncloco.peer.distributed import (
    OP_MEASURE,
    OP_STOP,
    OP_TRAIN,
    Command,
    GroupContext,
    GroupFailed,
    broadcast_command,
    broadcast_json,
)
from asyncloco.peer.inner import InnerTrainer, LeaseAborted, probe_speed
from asyncloco.refusals import FATAL, RefusalCode

__all__ = ["PeerOptions", "PeerRunner", "PeerError"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
PEER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # the wire's AssignRequest.name (transport/wire.py)


class _Aborted(Exception):
    """A wait ended because the volunteer asked to leave."""


def _as_dict(message: Any) -> dict[str, Any]:
    """A wire message as a map: RPC replies are maps or (typed transport messages) dataclasses."""
    if message is None:
        return {}
    if isinstance(message, dict):
        return message
    if dataclasses.is_dataclass(message):
        return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    raise TypeError(f"unexpected reply {message!r}")


async def _ask_for_lease(
    client: Any, tokens_per_s: float, token: Optional[str] = None, name: Optional[str] = None, signer: Optional[str] = None
) -> Any:
    """``assign`` with this peer's speed, its admission token and ``--name`` (if it has them), and the
    fingerprint of its DHT signing key: the coordinator binds it to this peer id, so only this peer's own
    speed records count for it."""
    return await client.assign(tokens_per_s, token=token, name=name, signer=signer)


def _refused_admission(error: Exception) -> bool:
    """The coordinator refused this peer (admission, expelled, incompatible: a FATAL code of
    asyncloco/refusals.py): retrying cannot help; the message says what to do."""
    return getattr(error, "code", None) in FATAL


class PeerError(RuntimeError):
    """A condition the volunteer must fix (the message says how)."""


def _reap_p2pd_zombies() -> None:
    """Collect exited p2pd children (a failed DHT start leaves its daemon unreaped): retries must not pile up
    zombies. Only this process's own exited ``p2pd`` children are touched."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if name == "p2pd" and fields[0] == "Z" and int(fields[1]) == os.getpid():
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(int(entry.name), os.WNOHANG)


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
    # --- reach (README "Behind a NAT"): outbound connections only unless asked; a name for the status table
    dht_server: bool = False  # serve the DHT (needs inbound connections); default: a DHT client
    name: Optional[str] = None  # shown in `asyncloco status`; 1-64 of [A-Za-z0-9_.-]
    # --- swarm downloads (issue 19, transport/swarm.py): θ from other peers, verified chunk by chunk
    swarm: bool = False  # --swarm: download θ from the swarm (the coordinator is the seed and the fallback)
    serve: Optional[bool] = None  # --serve/--no-serve; default: serve only when reachable (--dht-server)
    serve_bandwidth: Optional[float] = None  # --serve-bandwidth, bytes/s of chunks served (None: no cap)


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
    idle_fraction: float = 0.0
    prefetch_hits: int = 0
    swarm_downloads: int = 0  # --swarm: θ bodies taken from the swarm (transport/swarm.py)
    swarm_fallbacks: int = 0  # --swarm: downloads the coordinator served after the swarm failed
    prefetch_misses: int = 0


def coordinator_id_from(multiaddr: str) -> str:
    if "/p2p/" not in multiaddr:
        raise PeerError(
            f"initial peer {multiaddr!r} has no /p2p/<peer id> part; copy the full address the coordinator "
            "printed (it ends with /p2p/Qm... or /p2p/12D3...)"
        )
    return multiaddr.rsplit("/p2p/", 1)[1].split("/")[0]


class PeerRunner:
    """``await PeerRunner(options).run()`` joins over hivemind; :meth:`serve` runs the rounds over any
    :class:`~asyncloco.transport.link.CoordinatorLink` (the in-memory one in tests: testing/memory.py).

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
        self.group = group
        self.summary.world_size = group.world_size if group is not None else 1
        self._stop = asyncio.Event()  # first Ctrl+C: finish and submit the current lease, then leave
        self._abort = asyncio.Event()  # second Ctrl+C: leave at once
        self._abort_flag = threading.Event()  # the same, for the training thread
        self._inner_loss: Optional[float] = None  # mean inner loss of the latest round (sent with its update)
        self._digests: tuple[Optional[str], Optional[str]] = (None, None)  # inner-state commitments of the latest round
        self.reveals: Any = None  # peer/reveal.py RevealStore: start states of the last leases, revealed on request
        self._cfg: Optional[RunConfig] = None  # the run's config, once fetched
        self._closing = asyncio.Event()
        self._loop_started: Optional[float] = None
        self.clock = clock  # --- transport seam (issue 8): deadlines and pauses on this clock
        self.crash_hook = crash_hook
        self.feedback: Any = None  # peer/feedback.py ErrorFeedback: this peer's residual, kept across leases and rejoins

    def stop(self) -> None:
        """Finish the current lease (train it, submit it), then leave."""
        self._stop.set()

    def abort(self) -> None:
        """Leave at once: stop training after the current step; what is dropped is logged."""
        self._stop.set()
        self._abort.set()
        self._abort_flag.set()

    # ---------------------------------------------------------------------------------- setup

    def _start_dht(self) -> Any:
        from asyncloco.transport.dht import start_dht

        try:
            if self.options.identity_path is not None:  # hivemind creates the key file, not its folder
                Path(self.options.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            # A DHT client by default: it dials out only and answers no DHT requests, so a volunteer behind a
            # home NAT or firewall takes part (its stores and lookups go through DHT servers such as the
            # coordinator). Relays on: should someone have to dial this peer, libp2p can go through a relay.
            return start_dht(
                initial_peers=self.options.initial_peers,
                host_maddrs=[f"/ip4/{self.options.host}/tcp/0"],
                identity_path=self.options.identity_path,
                client_mode=not self.options.dht_server,
                use_relay=True,
                use_auto_relay=not self.options.dht_server,
            )
        except Exception as error:  # hivemind raises several types when bootstrap fails
            raise PeerError(
                f"could not join the DHT through {self.options.initial_peers}: {error}. Check that the coordinator "
                "is running, that the address is the one it printed (including /p2p/...), and that its port is "
                "reachable from this machine"
            ) from error

    async def _join_dht(self) -> Any:
        """:meth:`_start_dht`, retried with backoff (1, 2, 4 ... 15 s) until ``connect_timeout`` (``--join-timeout``):
        a coordinator that is restarting, or not up yet, is waited for, saying so; Ctrl+C stops the wait."""
        deadline = time.monotonic() + self.options.connect_timeout
        delay, attempt = 1.0, 0
        while True:
            attempt += 1
            try:
                return self._start_dht()
            except PeerError as error:
                _reap_p2pd_zombies()  # the failed attempt's p2pd
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise PeerError(f"{error} (gave up after {attempt} attempts in {self.options.connect_timeout:.0f} s, "
                                    "--join-timeout)") from None
                wait = min(delay, left)
                logger.warning("waiting for the coordinator at %s: not reachable yet (attempt %d; next in %.0f s, "
                               "giving up in %.0f s: --join-timeout)", " ".join(self.options.initial_peers), attempt, wait, left)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=wait)
                if self._stop.is_set():
                    raise PeerError("stopped while waiting for the coordinator") from None
                delay = min(2 * delay, 15.0)

    async def _check_run_id(self, p2p: Any, namespace: str, deadline: float) -> None:
        """Ask the coordinator which run it serves (asyncloco/transport/discovery.py): a wrong ``--run-id``
        fails at once, naming the right one, instead of waiting out the connect timeout."""
        from asyncloco.transport.discovery import ask_run_info
        from asyncloco.transport.errors import TransportError

        while True:
            try:
                info = await ask_run_info(p2p, self.coordinator_id, timeout=10.0)
                break
            except TransportError as error:
                if "protocols not supported" in str(error):
                    return  # a coordinator without run info (older version): the config request will tell
                if time.monotonic() > deadline:
                    raise PeerError(
                        f"the coordinator {self.coordinator_id} did not answer within {self.options.connect_timeout:.0f}s "
                        f"({error}); is it running, is its address the one it printed, and is its port reachable?"
                    ) from error
                await asyncio.sleep(1.0)
        if info.run_id != namespace:
            raise PeerError(
                f"the coordinator {self.coordinator_id} serves run {info.run_id!r}, not {namespace!r}: "
                f"join with --run-id {info.run_id}"
            )

    async def _check_fingerprint(self, p2p: Any, cfg: RunConfig, workload: Any, model: Any) -> None:
        """Send this peer's model/tokenizer/data/codec fingerprint (asyncloco/fingerprint.py); the coordinator
        compares it with its own and refuses a peer whose updates would not fit its model."""
        from asyncloco.fingerprint import run_fingerprint
        from asyncloco.transport.discovery import ask_run_info
        from asyncloco.transport.errors import TransportError

        fingerprint = await asyncio.to_thread(run_fingerprint, cfg, workload, model)
        deadline = time.monotonic() + self.options.connect_timeout
        while True:  # a coordinator restarting meanwhile is waited for (--join-timeout), like at the first contact
            try:
                info = await ask_run_info(
                    p2p, self.coordinator_id, timeout=30.0, fingerprint=fingerprint, software_version=__version__
                )
                break
            except TransportError as error:
                if "protocols not supported" in str(error):
                    return  # an older coordinator: it does not check fingerprints
                if time.monotonic() > deadline or self._stop.is_set():
                    raise PeerError(f"the coordinator did not answer the compatibility check: {error}") from error
                logger.warning("waiting for the coordinator's compatibility check: %s", error)
                await asyncio.sleep(2.0)
        if info.refused:
            raise PeerError(f"the coordinator refused this peer: {info.refused}")

    async def _fetch_config(self, p2p: Any, namespace: str) -> tuple[RunConfig, dict[str, Any]]:
        from asyncloco.transport.errors import TransportError
        from asyncloco.transport.rpc import CoordinatorClient

        probe = CoordinatorClient(p2p, self.coordinator_id, 1, namespace=namespace)
        deadline = time.monotonic() + self.options.connect_timeout
        await self._check_run_id(p2p, namespace, deadline)
        while True:
            try:
                reply = _as_dict(await probe.hello(name=self.options.name, token=self.options.token, timeout=10.0))
                break
            except TransportError as error:
                if _refused_admission(error):
                    raise PeerError(f"the coordinator refused this peer: {error}") from error
                if time.monotonic() > deadline:
                    raise PeerError(
                        f"the coordinator {self.coordinator_id} did not answer within {self.options.connect_timeout:.0f}s "
                        f"({error}); is it running, and is this the run's coordinator id?"
                    ) from error
                await asyncio.sleep(1.0)
        try:
            cfg = RunConfig.model_validate(json.loads(reply["config"]))
        except (KeyError, ValueError) as error:
            raise PeerError(f"the coordinator sent a config this version ({__version__}) cannot read: {error}") from error
        return cfg, reply

    # ---------------------------------------------------------------------------------- rounds

    def _train(
        self, trainer: InnerTrainer, theta: torch.Tensor, lease: dict[str, Any], bar: Any
    ) -> tuple[torch.Tensor, float, list[float]]:
        """Train the lease (on the whole group: the leader broadcasts it first); returns (pseudo-gradient,
        seconds of training, each step's seconds), all without the emulated slowdown. Raises
        :class:`LeaseAborted` after a second Ctrl+C, :class:`GroupFailed` when a rank is gone."""
        started = time.perf_counter()
        step_seconds: list[float] = []

        def on_step(seconds: float) -> None:
            step_seconds.append(seconds)
            if bar is not None:
                bar.update(1)

        shard, start, steps, lr_offset = (int(lease[k]) for k in ("shard", "start_offset", "steps", "lr_offset"))
        if self.group is not None:
            broadcast_command(self.group, Command(OP_TRAIN, shard, start, steps, lr_offset))
        commit = self._commits(trainer)  # runtime.verify with carried inner state: digests before and after
        state_start = trainer.state_digest() if commit else None
        if commit:
            from asyncloco.peer.reveal import RevealStore

            if self.reveals is None and self._cfg is not None:
                self.reveals = RevealStore(self._cfg.runtime.verify.reveal_keep)
            self.reveals.hold(str(lease["lease_id"]), trainer.optimizer)
        result = trainer.run(theta, shard, start, steps, lr_offset, on_step=on_step, should_stop=self._abort_flag.is_set)
        self._digests = (state_start, trainer.state_digest() if commit else None)
        loss = float(result.mean_loss)
        self._inner_loss = loss if math.isfinite(loss) and 0.0 <= loss <= 1e6 else None  # the wire's bounds
        return result.pseudo_gradient, time.perf_counter() - started, step_seconds

    async def _reveal(self, client: Any, lease_id: str, digest: Optional[str]) -> None:
        """Reveal lease ``lease_id``'s start inner state (peer/reveal.py; issue 16 commitments)."""
        from asyncloco.peer.reveal import send_reveal

        state = self.reveals.get(lease_id) if self.reveals is not None else None
        await send_reveal(client, lease_id, state, digest)

    def _commits(self, trainer: InnerTrainer) -> bool:
        """Does this peer commit to its inner state (docs/threat-model.md, "Commitments")?"""
        if self._cfg is None:
            return False
        verify = self._cfg.runtime.verify
        return verify.enabled and verify.inner_state == "carry" and trainer.state_digest() is not None

    async def _submit_with_retry(self, client: Any, lease: dict[str, Any], encoded: Any) -> Optional[dict[str, Any]]:
        """Send the same encoded bytes until acknowledged or the lease's deadline passes. A first Ctrl+C
        does not stop this (the lease is being finished); a second one does (None)."""
        from asyncloco.transport.errors import TransportError

        delay = 0.5
        deadline = float(lease["deadline"])
        while not self._abort.is_set():
            try:
                return await self._unless_aborted(client.submit(
                    lease["lease_id"], int(lease["base_version"]), encoded, inner_loss=self._inner_loss,
                    state_start=self._digests[0], state_end=self._digests[1]))
            except _Aborted:
                break
            except TransportError as error:
                if self.clock.time() > deadline:
                    logger.warning("giving up on lease %s: deadline passed (%s)", lease["lease_id"], error)
                    return None
                self.summary.resends += 1
                logger.warning("submit of %s failed (%s); resending in %.1fs", lease["lease_id"], error, delay)
                await self._pause(delay)
                delay = min(delay * 2, 10.0)
        logger.warning("leaving at once: the trained pseudo-gradient of lease %s (%s steps) is dropped, unsent",
                       lease["lease_id"], lease["steps"])
        return None

    def _observed_speed(self, step_seconds: list[float], units_per_step: int) -> Optional[float]:
        """This round's steady-state throughput of the (emulated) device, or None for no new sample.

        The first step is left out (module doc). A 1-step round has only that cold step: it is used only
        when it is faster than the current estimate — it then proves the estimate too low (a peer measured
        during a busy start-up must be able to climb out of 1-step leases), and it can never drag it down.
        In a group ``units_per_step`` is the global batch's and the step times are the leader's (they
        include DDP's all-reduce): the group reports one combined speed."""
        warm = step_seconds[1:]
        if warm and sum(warm) > 0:
            return len(warm) * units_per_step / (sum(warm) * self.options.slowdown)
        if step_seconds and step_seconds[0] > 0:
            cold = units_per_step / (step_seconds[0] * self.options.slowdown)
            if self.speed is None or cold > self.speed:
                return cold
        return None

    async def _publish_loop(self, publisher: Any, period: float) -> None:
        """Publish this peer's speed every ``period`` seconds (``publisher``: a transport.link.SpeedPublisher)."""
        while not self._closing.is_set():
            if self.speed is not None:
                try:
                    await publisher.publish_speed(float(self.speed))
                except Exception as error:  # retried next period
                    logger.warning("could not publish the speed report: %r", error)
            with contextlib.suppress(_Aborted):
                await self._race(self.clock.sleep(period), self._closing)

    def _measure(self, cfg: RunConfig, workload: Any) -> float:
        """Initial throughput from a few real steps of a throwaway replica (tokens or samples per second of
        the global batch; the whole group measures together)."""
        if self.group is not None:
            broadcast_command(self.group, Command(OP_MEASURE))
        device = self.group.device if self.group is not None else self.options.device
        # an emulated slower device takes `slowdown` times as long for the same steps (see run())
        return probe_speed(cfg, workload, device, group=self.group) / self.options.slowdown

    async def _unless_aborted(self, call: Awaitable[T]) -> T:
        """Await ``call`` unless a second Ctrl+C comes first (then cancel it and raise :class:`_Aborted`)."""
        return await self._race(call, self._abort)

    @staticmethod
    async def _race(call: Awaitable[T], event: asyncio.Event) -> T:
        task = asyncio.ensure_future(call)
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            raise _Aborted()
        finally:
            for pending in (task, waiter):
                if not pending.done():
                    pending.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await pending

    async def _download(self, client: Any, lease: dict[str, Any], prefetch: Optional["asyncio.Task[Any]"]) -> torch.Tensor:
        """θ of the lease's base version: the prefetched latest θ when it is that version, else a download."""
        base = int(lease["base_version"])
        if prefetch is not None:
            try:
                version, theta = await self._unless_aborted(prefetch)
            except _Aborted:
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

    def _update_timing(self, key: str, seconds: float) -> None:
        self.summary.timing[key] = self.summary.timing.get(key, 0.0) + seconds

    def _update_idle(self) -> None:
        if self._loop_started is None:
            return
        wall = time.monotonic() - self._loop_started
        busy = self.summary.timing.get("train", 0.0)
        self.summary.wall_seconds = wall
        self.summary.idle_fraction = max(0.0, 1.0 - busy / wall) if wall > 0 else 0.0

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
        try:
            dht = await self._join_dht()
            self.summary.peer_id = dht.peer_id.to_base58()
            p2p = await dht.replicate_p2p()
            namespace = self.options.run_id
            if namespace is None:
                raise PeerError("internal: run id unknown")  # set by the CLI from the coordinator or --run-id
            cfg, hello = await self._fetch_config(p2p, namespace)
            self._cfg = cfg
            if hello.get("run_id") != namespace:
                raise PeerError(f"the coordinator serves run {hello.get('run_id')!r}, not {namespace!r}; check --run-id")
            from asyncloco.workloads import build_workload

            if self.group is not None:
                await asyncio.to_thread(broadcast_json, self.group, cfg.model_dump(mode="json"))
                group_phase = "commands"
            workload = build_workload(cfg)
            device = self.group.device if self.group is not None else self.options.device
            trainer = InnerTrainer.from_config(cfg, workload, device=device, group=self.group)
            numel = int(hello["model_numel"])
            if trainer.numel != numel:
                raise PeerError(
                    f"this peer builds a {trainer.numel}-parameter model but the coordinator serves {numel}; "
                    f"upgrade asyncloco (coordinator runs {hello.get('software_version')}, this is {__version__})"
                )
            await self._check_fingerprint(p2p, cfg, workload, trainer.fingerprint_model)  # FSDP: unsharded class
            codec = str(hello["codec"])
            counters = TrafficCounters()
            hold = 630.0 if cfg.schedule.method == "sync_diloco" else cfg.schedule.grace_period + 60.0
            client: Any = CoordinatorClient(
                p2p, self.coordinator_id, numel, namespace=namespace, assign_timeout=hold, counters=counters,
                download_codec=str(hello.get("download_codec", "none")),
                link=LinkSpeed(),  # issue 11: get_model/submit timeouts from this link's measured speed
            )
            if self.options.swarm:  # issue 19: θ from other peers (transport/swarm.py; docs/transport.md "Swarm")
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
            self._write_summary()
            if swarm is not None:
                await swarm.close()
            if p2p is not None:
                await p2p.shutdown()
            if dht is not None:
                stop_dht(dht)
            if self.group is not None:
                await asyncio.to_thread(self._release_group, group_phase)

    async def serve(
        self, client: Any, publisher: Any, cfg: RunConfig, workload: Any, trainer: InnerTrainer, codec: str, counters: Any
    ) -> PeerSummary:
        """The rounds (lease, download, train, submit) until stopped, over any transport: ``client`` is a
        transport.link.CoordinatorLink, ``publisher`` a transport.link.SpeedPublisher, ``counters`` the
        client's transport.rpc.TrafficCounters. The speed is measured first unless :attr:`speed` is set."""
        from asyncloco.transport.errors import CodecError, TransportError

        self._cfg = cfg  # the run's config (in-process transports skip _fetch_config): commitments read it
        publishing: Optional[asyncio.Task[None]] = None
        prefetch: Optional[asyncio.Task[Any]] = None
        try:
            if self.speed is None:
                self.speed = await asyncio.to_thread(self._measure, cfg, workload)
            self.summary.tokens_per_s = self.speed
            self.summary.units_per_step = workload.units_per_step
            logger.info("joined run %r as %s: %.0f units/s (slowdown ×%g%s)", self.options.run_id, self.summary.peer_id, self.speed,
                        self.options.slowdown, f", {self.group.world_size} ranks" if self.group is not None else "")
            self._write_summary()  # names this peer (its id) before its first lease, for dashboards and tests
            publishing = asyncio.create_task(self._publish_loop(publisher, cfg.runtime.speed_report_period))
            self._loop_started = time.monotonic()
            idle_wait = 0.0
            while not self._stop.is_set():
                if self.options.max_rounds is not None and self.summary.rounds >= self.options.max_rounds:
                    break
                asked = time.monotonic()
                try:
                    # a first Ctrl+C lets this request finish: a lease handed out meanwhile is trained and
                    # submitted like any other (cancelling would leave it to expire at the coordinator)
                    reply = _as_dict(await self._unless_aborted(_ask_for_lease(client, float(self.speed), self.options.token, self.options.name, publisher.signer)))
                except _Aborted:
                    logger.warning("leaving at once while asking for a lease; a lease handed out right now is given "
                                   "back by the coordinator at its deadline")
                    break
                except TransportError as error:
                    if _refused_admission(error):
                        raise PeerError(f"the coordinator refused this peer: {error}") from error
                    logger.warning("could not get a lease (%s); retrying", error)
                    await self._pause(2.0)
                    continue
                finally:
                    self._update_timing("assign", time.monotonic() - asked)
                if reply.get("lease") is None:
                    # back off while quarantined (1 s, doubling up to 30 s); otherwise ask again after 1 s
                    quarantined = reply.get("code") == RefusalCode.QUARANTINED.value
                    idle_wait = min(30.0, 2 * idle_wait) if (idle_wait and quarantined) else 1.0
                    logger.info("no lease: %s (asking again in %.0f s)", reply.get("reason"), idle_wait)
                    await self._pause(idle_wait)
                    continue
                idle_wait = 0.0
                lease = _as_dict(reply["lease"])
                if self._stop.is_set():
                    logger.info("lease %s arrived as this peer was stopping: training and submitting it first",
                                lease["lease_id"])
                downloading = time.monotonic()
                try:
                    theta = await self._download(client, lease, prefetch)
                except _Aborted:
                    logger.warning("leaving at once: lease %s dropped before training (the coordinator gives its "
                                   "%s steps back)", lease["lease_id"], lease["steps"])
                    break
                except TransportError as error:
                    logger.warning("could not download θ for %s (%s); asking for a new lease", lease["lease_id"], error)
                    await self._pause(1.0)
                    continue
                finally:
                    prefetch = None
                    self._update_timing("download", time.monotonic() - downloading)
                bar = self._progress_bar(lease)
                training = time.monotonic()
                try:
                    pseudo_gradient, seconds, step_seconds = await asyncio.to_thread(self._train, trainer, theta, lease, bar)
                    if self.options.slowdown > 1.0:
                        # emulate a slower device: one pause after the steps, so that they ran warm (module doc)
                        await self._pause(seconds * (self.options.slowdown - 1.0))
                except LeaseAborted as aborted:
                    logger.warning("leaving at once: lease %s dropped after %d of %d steps (the coordinator gives its "
                                   "steps back)", lease["lease_id"], aborted.steps_done, aborted.steps)
                    break
                except GroupFailed as error:
                    raise PeerError(
                        f"{error}. Lease {lease['lease_id']} is dropped (the coordinator gives its steps back at its "
                        "deadline or when it sees this peer gone); restart the group to rejoin"
                    ) from error
                finally:
                    self._update_timing("train", time.monotonic() - training)
                    if bar is not None:
                        bar.close()
                if self._abort.is_set():
                    logger.warning("leaving at once: the trained pseudo-gradient of lease %s is dropped, unsent",
                                   lease["lease_id"])
                    break
                if self.crash_hook is not None:  # tests: a peer that dies after training, before its submit
                    self.crash_hook("trained")
                observed = self._observed_speed(step_seconds, workload.units_per_step)
                if observed is not None:
                    self.speed = ema(self.speed, observed, cfg.schedule.speed_ema)
                self.summary.tokens_per_s = self.speed
                uploading = time.monotonic()
                try:
                    encoded = await asyncio.to_thread(self._error_feedback(cfg, codec).encode, pseudo_gradient)
                except CodecError as error:  # NaN/Inf: a diverged round has nothing to send; its lease expires
                    logger.warning("lease %s not submitted: %s", lease["lease_id"], error)
                    trainer.reset_inner_state()  # the commitment chain goes on from the fresh state
                    continue
                if self._stop.is_set():
                    logger.info("submitting lease %s before leaving (Ctrl+C again to leave at once)", lease["lease_id"])
                ack = _as_dict(await self._submit_with_retry(client, lease, encoded))
                self._update_timing("upload", time.monotonic() - uploading)
                self.summary.rounds += 1
                self.summary.steps += int(lease["steps"])
                self.feedback.settle(bool(ack and ack["accepted"]))  # not applied: the residual is dropped
                if self._commits(trainer) and not (ack and ack["accepted"]):
                    trainer.reset_inner_state()  # only applied leases advance the commitment chain (logic._broken_chain)
                if not ack:
                    continue
                if self.options.prefetch and not self._stop.is_set():
                    # the next lease most likely starts from the newest θ: fetch it while asking for the lease
                    prefetch = asyncio.ensure_future(client.get_model(None))
                if ack.get("reveal"):  # chosen for verification after the submission: send the lease's start state
                    await self._reveal(client, str(lease["lease_id"]), self._digests[0])
                if ack["accepted"]:
                    self.summary.accepted += 1
                    self.summary.duplicates += int(bool(ack["duplicate"]))
                    logger.info("lease %s accepted: version %d%s", lease["lease_id"], ack["version"], " (duplicate)" if ack["duplicate"] else "")
                else:
                    self.summary.rejected += 1
                    logger.warning("lease %s rejected: %s", lease["lease_id"], ack["reason"])
                self.summary.traffic = counters.as_dict()
                self._update_idle()
                self._write_summary()
            self.summary.traffic = counters.as_dict()
            return self.summary
        finally:
            self._stop.set()
            self._closing.set()
            if prefetch is not None:
                prefetch.cancel()
                await asyncio.gather(prefetch, return_exceptions=True)
            if publishing is not None:
                await asyncio.gather(publishing, return_exceptions=True)
            self._update_idle()
            self._write_summary()

    def _error_feedback(self, cfg: RunConfig, codec: str) -> Any:
        """This peer's error feedback (peer/feedback.py), made anew only when the run's codec changes."""
        from asyncloco.peer.feedback import ErrorFeedback

        enabled = cfg.runtime.uses_error_feedback
        if self.feedback is None or self.feedback.codec != codec or self.feedback.enabled != (enabled and codec != "none"):
            self.feedback = ErrorFeedback(codec, enabled)
        return self.feedback

    def _release_group(self, phase: str) -> None:
        """Tell the followers to stop (unless the group is broken), then leave it."""
        import torch.distributed as dist

        assert self.group is not None
        try:
            if phase == "config":
                broadcast_json(self.group, None)
            else:
                broadcast_command(self.group, Command(OP_STOP))
        except GroupFailed as error:
            logger.warning("the group is broken (%s); followers exit on their own", error)
        if dist.is_initialized():
            dist.destroy_process_group()

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` (emulated device time, backoff) on the runner's clock unless asked to leave at once."""
        with contextlib.suppress(_Aborted):
            await self._race(self.clock.sleep(seconds), self._abort)

    def _progress_bar(self, lease: dict[str, Any]) -> Any:
        if not self.options.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=int(lease["steps"]), desc=f"lease {lease['lease_id']} shard {lease['shard']}", unit="step", leave=False)

    def _write_summary(self) -> None:
        if self.options.summary_path is None:
            return
        path = self.options.summary_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.summary.__dict__, indent=1))
        tmp.replace(path)
