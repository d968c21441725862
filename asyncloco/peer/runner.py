"""A volunteer peer: join the DHT, publish its speed, and train leases from the coordinator.

Round trip of one lease (algorithm.md §1):

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
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from asyncloco import __version__
from asyncloco.algo.dylu import ema
from asyncloco.config import RunConfig
from asyncloco.peer.inner import InnerTrainer

__all__ = ["PeerOptions", "PeerRunner", "PeerError"]

logger = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A condition the volunteer must fix (the message says how)."""


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
    connect_timeout: float = 30.0


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


def coordinator_id_from(multiaddr: str) -> str:
    if "/p2p/" not in multiaddr:
        raise PeerError(
            f"initial peer {multiaddr!r} has no /p2p/<peer id> part; copy the full address the coordinator "
            "printed (it ends with /p2p/Qm... or /p2p/12D3...)"
        )
    return multiaddr.rsplit("/p2p/", 1)[1].split("/")[0]


class PeerRunner:
    def __init__(self, options: PeerOptions) -> None:
        if not options.initial_peers:
            raise PeerError("give at least one --initial-peers address (the coordinator prints it when it starts)")
        if options.slowdown < 1.0:
            raise PeerError(f"--slowdown must be >= 1 (a factor by which to slow down), got {options.slowdown}")
        self.options = options
        self.coordinator_id = options.coordinator_id or coordinator_id_from(options.initial_peers[0])
        self.summary = PeerSummary(slowdown=options.slowdown)
        self.speed: Optional[float] = None
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------------------------- setup

    def _start_dht(self) -> Any:
        from asyncloco.transport.dht import start_dht

        try:
            return start_dht(
                initial_peers=self.options.initial_peers,
                host_maddrs=[f"/ip4/{self.options.host}/tcp/0"],
                identity_path=self.options.identity_path,
            )
        except Exception as error:  # hivemind raises several types when bootstrap fails
            raise PeerError(
                f"could not join the DHT through {self.options.initial_peers}: {error}. Check that the coordinator "
                "is running, that the address is the one it printed (including /p2p/...), and that its port is "
                "reachable from this machine"
            ) from error

    async def _fetch_config(self, p2p: Any, namespace: str) -> tuple[RunConfig, dict[str, Any]]:
        from asyncloco.transport.errors import TransportError
        from asyncloco.transport.rpc import CoordinatorClient

        probe = CoordinatorClient(p2p, self.coordinator_id, 1, namespace=namespace)
        deadline = time.monotonic() + self.options.connect_timeout
        while True:
            try:
                reply = await probe.assign({"kind": "config"}, timeout=10.0)
                break
            except TransportError as error:
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
        """Train the lease; returns (pseudo-gradient, seconds of training, each step's seconds), all without
        the emulated slowdown."""
        started = time.perf_counter()
        step_seconds: list[float] = []

        def on_step(seconds: float) -> None:
            step_seconds.append(seconds)
            if bar is not None:
                bar.update(1)

        result = trainer.run(
            theta,
            int(lease["shard"]),
            int(lease["start_offset"]),
            int(lease["steps"]),
            int(lease["lr_offset"]),
            on_step=on_step,
        )
        return result.pseudo_gradient, time.perf_counter() - started, step_seconds

    async def _submit_with_retry(self, client: Any, lease: dict[str, Any], encoded: Any) -> Optional[dict[str, Any]]:
        from asyncloco.transport.errors import TransportError

        delay = 0.5
        attempt = 0
        deadline = float(lease["deadline"])
        while not self._stop.is_set():
            attempt += 1
            try:
                return await client.submit(lease["lease_id"], int(lease["base_version"]), encoded)
            except TransportError as error:
                if time.time() > deadline:
                    logger.warning("giving up on lease %s: deadline passed (%s)", lease["lease_id"], error)
                    return None
                self.summary.resends += 1
                logger.warning("submit of %s failed (%s); resending in %.1fs", lease["lease_id"], error, delay)
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, 10.0)
        return None

    def _observed_speed(self, step_seconds: list[float], units_per_step: int) -> Optional[float]:
        """This round's steady-state throughput of the (emulated) device, or None for no new sample.

        The first step is left out (module doc). A 1-step round has only that cold step: it is used only
        when it is faster than the current estimate — it then proves the estimate too low (a peer measured
        during a busy start-up must be able to climb out of 1-step leases), and it can never drag it down."""
        warm = step_seconds[1:]
        if warm and sum(warm) > 0:
            return len(warm) * units_per_step / (sum(warm) * self.options.slowdown)
        if step_seconds and step_seconds[0] > 0:
            cold = units_per_step / (step_seconds[0] * self.options.slowdown)
            if self.speed is None or cold > self.speed:
                return cold
        return None

    async def _publish_loop(self, records: Any, period: float) -> None:
        from asyncloco.transport.records import SpeedReport
        from hivemind.utils import get_dht_time

        while not self._stop.is_set():
            if self.speed is not None:
                report = SpeedReport(
                    peer_id=self.summary.peer_id,
                    tokens_per_s=float(self.speed),
                    device=self.options.device,
                    software_version=__version__,
                    last_seen=get_dht_time(),
                )
                try:
                    await asyncio.to_thread(records.publish_speed, report, 3 * period)
                except Exception as error:  # retried next period
                    logger.warning("could not publish the speed report: %r", error)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass

    def _measure(self, cfg: RunConfig, workload: Any, steps: int = 3) -> float:
        """Initial throughput from a few real steps of a throwaway replica (tokens or samples per second).

        A separate trainer keeps the real inner optimizer state untouched by the probe."""
        probe = InnerTrainer.from_config(cfg, workload, device=self.options.device)
        theta = torch.cat([p.detach().reshape(-1) for p in probe.model.parameters()]).cpu()
        probe.run(theta, 0, 0, 1, 0)  # warm-up (allocations, kernels)
        started = time.perf_counter()
        probe.run(theta, 0, 0, steps, 0)
        # an emulated slower device takes `slowdown` times as long for the same steps (see run())
        return steps * workload.units_per_step / ((time.perf_counter() - started) * self.options.slowdown)

    async def run(self) -> PeerSummary:
        from asyncloco.transport.codecs import encode
        from asyncloco.transport.dht import stop_dht
        from asyncloco.transport.errors import TransportError
        from asyncloco.transport.records import RunRecords
        from asyncloco.transport.rpc import CoordinatorClient, TrafficCounters

        dht = self._start_dht()
        p2p = None
        publisher: Optional[asyncio.Task[None]] = None
        try:
            self.summary.peer_id = dht.peer_id.to_base58()
            p2p = await dht.replicate_p2p()
            namespace = self.options.run_id
            if namespace is None:
                raise PeerError("internal: run id unknown")  # set by the CLI from the coordinator or --run-id
            cfg, hello = await self._fetch_config(p2p, namespace)
            if hello.get("run_id") != namespace:
                raise PeerError(f"the coordinator serves run {hello.get('run_id')!r}, not {namespace!r}; check --run-id")
            from asyncloco.workloads import build_workload

            workload = build_workload(cfg)
            trainer = InnerTrainer.from_config(cfg, workload, device=self.options.device)
            numel = int(hello["model_numel"])
            if trainer.numel != numel:
                raise PeerError(
                    f"this peer builds a {trainer.numel}-parameter model but the coordinator serves {numel}; "
                    f"upgrade asyncloco (coordinator runs {hello.get('software_version')}, this is {__version__})"
                )
            codec = str(hello["codec"])
            counters = TrafficCounters()
            hold = 630.0 if cfg.schedule.method == "sync_diloco" else cfg.schedule.grace_period + 60.0
            client = CoordinatorClient(
                p2p, self.coordinator_id, numel, namespace=namespace, assign_timeout=hold, counters=counters
            )
            records = RunRecords(dht, namespace)
            self.speed = await asyncio.to_thread(self._measure, cfg, workload)
            self.summary.tokens_per_s = self.speed
            logger.info("joined run %r as %s: %.0f units/s (slowdown ×%g)", namespace, self.summary.peer_id, self.speed, self.options.slowdown)
            self._write_summary()  # names this peer (its id) before its first lease, for dashboards and tests
            publisher = asyncio.create_task(self._publish_loop(records, cfg.runtime.speed_report_period))
            while not self._stop.is_set():
                if self.options.max_rounds is not None and self.summary.rounds >= self.options.max_rounds:
                    break
                try:
                    reply = await client.assign({"tokens_per_s": float(self.speed)})
                except TransportError as error:
                    logger.warning("could not get a lease (%s); retrying", error)
                    await self._pause(2.0)
                    continue
                lease = reply.get("lease")
                if lease is None:
                    logger.info("no lease: %s", reply.get("reason"))
                    await self._pause(1.0)
                    continue
                try:
                    version, theta = await client.get_model(int(lease["base_version"]))
                except TransportError as error:
                    logger.warning("could not download θ for %s (%s); asking for a new lease", lease["lease_id"], error)
                    await self._pause(1.0)
                    continue
                bar = self._progress_bar(lease)
                try:
                    pseudo_gradient, seconds, step_seconds = await asyncio.to_thread(self._train, trainer, theta, lease, bar)
                    if self.options.slowdown > 1.0:
                        # emulate a slower device: one pause after the steps, so that they ran warm (module doc)
                        await self._pause(seconds * (self.options.slowdown - 1.0))
                finally:
                    if bar is not None:
                        bar.close()
                observed = self._observed_speed(step_seconds, workload.units_per_step)
                if observed is not None:
                    self.speed = ema(self.speed, observed, cfg.schedule.speed_ema)
                self.summary.tokens_per_s = self.speed
                encoded = await asyncio.to_thread(encode, codec, pseudo_gradient)
                ack = await self._submit_with_retry(client, lease, encoded)
                self.summary.rounds += 1
                self.summary.steps += int(lease["steps"])
                if ack is None:
                    continue
                if ack["accepted"]:
                    self.summary.accepted += 1
                    self.summary.duplicates += int(bool(ack["duplicate"]))
                    logger.info("lease %s accepted: version %d%s", lease["lease_id"], ack["version"], " (duplicate)" if ack["duplicate"] else "")
                else:
                    self.summary.rejected += 1
                    logger.warning("lease %s rejected: %s", lease["lease_id"], ack["reason"])
                self.summary.traffic = counters.as_dict()
                self._write_summary()
            self.summary.traffic = counters.as_dict()
            return self.summary
        finally:
            self._stop.set()
            if publisher is not None:
                await asyncio.gather(publisher, return_exceptions=True)
            self._write_summary()
            if p2p is not None:
                await p2p.shutdown()
            stop_dht(dht)

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

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
