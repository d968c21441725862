"""A validator peer: an organiser-run machine that re-runs checks for the coordinator (docs/threat-model.md,
"Who verifies").

``asyncloco validator id --identity val.key`` prints the peer id a key file gives (creating the key); the organiser
lists it in ``runtime.verify.validators``; ``asyncloco validator join --initial-peers ADDR --identity val.key`` then
joins like a volunteer (DHT, run id, the run's config by ``hello``) and loops: ``verify_task`` lends it the next
pending check (the lease, θ at its base version, the update as submitted, the peer's revealed start inner state),
:class:`~asyncloco.coordinator.rerun.Rerunner` re-runs it with the peers' own inner loop, and ``verdict`` sends the
comparison back; the coordinator decides it exactly as a check it re-ran itself (coordinator/validators.py).
Verification then scales with the organiser's machines rather than the coordinator's CPU: at ``fraction`` 0.1,
one validator per ten peers of the same hardware. A validator must run the peers' device type for bitwise checks
(``runtime.verify.tolerance`` covers bf16 GPU kernels).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from asyncloco.clock import SYSTEM_CLOCK, Clock
from asyncloco.peer.joining import PeerError, RunJoiner, coordinator_id_from, refused_admission

__all__ = ["ValidatorOptions", "ValidatorSummary", "Validator", "identity_peer_id"]

logger = logging.getLogger(__name__)


@dataclass
class ValidatorOptions:
    initial_peers: list[str]
    run_id: str = "asyncloco-demo"
    coordinator_id: Optional[str] = None  # default: the /p2p/<id> of the first initial peer
    host: str = "127.0.0.1"
    identity_path: Optional[str] = None  # the key whose peer id the organiser listed (runtime.verify.validators)
    device: str = "cpu"
    connect_timeout: float = 600.0  # --join-timeout
    wait_s: float = 20.0  # how long one verify_task request waits for a check
    max_checks: Optional[int] = None  # leave after this many verdicts (tests, benchmarks)
    summary_path: Optional[Path] = None
    # what RunJoiner reads (peer/joining.py JoinOptions): a validator is a DHT client and needs no admission token
    dht_server: bool = False
    name: Optional[str] = None
    token: Optional[str] = None


@dataclass
class ValidatorSummary:
    peer_id: str = ""
    checks: int = 0  # verdicts sent and taken
    passed: int = 0
    failed: int = 0
    refused: int = 0  # verdicts the coordinator did not take (late: the check had gone back to the queue)
    errors: int = 0  # re-runs that failed here (no verdict sent: the check goes back at validator_timeout)
    rerun_steps: int = 0
    busy_s: float = 0.0
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # the last 256: lease, peer, ok, detail


def identity_peer_id(identity_path: str) -> str:
    """The libp2p peer id of the key in ``identity_path`` (created, as hivemind does, when missing)."""
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID

    path = Path(identity_path).expanduser()
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return str(PeerID.from_identity(path.read_bytes()).to_base58())


class Validator:
    """``await Validator(options).run()``: join, then take checks until :meth:`stop` (or ``max_checks``)."""

    def __init__(self, options: ValidatorOptions, clock: Clock = SYSTEM_CLOCK) -> None:
        if not options.initial_peers:
            raise PeerError("give --initial-peers: the multiaddr the coordinator printed")
        self.options = options
        self.clock = clock
        self.coordinator_id = options.coordinator_id or coordinator_id_from(options.initial_peers[0])
        self._stop = asyncio.Event()
        self.summary = ValidatorSummary()

    def stop(self) -> None:
        self._stop.set()

    def _write_summary(self) -> None:
        path = self.options.summary_path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self.summary), indent=1))
        tmp.replace(path)

    async def run(self) -> ValidatorSummary:
        from asyncloco.coordinator.rerun import Rerunner
        from asyncloco.transport.dht import stop_dht
        from asyncloco.transport.rpc import CoordinatorClient
        from asyncloco.workloads import build_workload

        joiner = RunJoiner(self.options, self.coordinator_id, self._stop, self.clock)
        dht = p2p = None
        try:
            dht = await joiner.join_dht()
            self.summary.peer_id = dht.peer_id.to_base58()
            logger.info("validator %s: the organiser lists this id in runtime.verify.validators", self.summary.peer_id)
            self._write_summary()
            p2p = await dht.replicate_p2p()
            cfg, hello = await joiner.fetch_config(p2p, self.options.run_id)
            rerunner = Rerunner(cfg, build_workload(cfg), device=self.options.device)
            model = rerunner.trainer.model
            if rerunner.trainer.numel != hello.model_numel:
                raise PeerError(f"this validator builds a {rerunner.trainer.numel}-parameter model but the coordinator "
                                f"serves {hello.model_numel}; run the coordinator's asyncloco version ({hello.software_version})")
            from asyncloco.train.commitments import revealed_size

            # a full AdamW state's layout, with error feedback plus the residual (peer/reveal.py)
            max_revealed = revealed_size(sum(9 + 8 * param.numel() for param in model.parameters()),
                                         sum(param.numel() for param in model.parameters()), cfg.runtime.uses_error_feedback)
            client = CoordinatorClient(p2p, self.coordinator_id, hello.model_numel, namespace=self.options.run_id)
            await self._loop(client, rerunner, max_revealed)
        finally:
            self._write_summary()
            if p2p is not None:
                await p2p.shutdown()
            if dht is not None:
                stop_dht(dht)
        return self.summary

    async def _loop(self, client: Any, rerunner: Any, max_revealed: int) -> None:
        from asyncloco.transport.errors import TransportError

        limit = self.options.max_checks
        while not self._stop.is_set() and (limit is None or self.summary.checks < limit):
            try:
                header, base, update, revealed = await client.verify_task(self.options.wait_s, max_revealed)
            except TransportError as error:
                if refused_admission(error):
                    raise PeerError(f"the coordinator refused this validator: {error}") from error
                logger.warning("asking for a check failed (%s); retrying in 2 s", error)
                await self.clock.sleep(2.0)
                continue
            if header.empty:
                continue
            await self._judge(client, rerunner, header, base, update, revealed)
            self._write_summary()

    async def _judge(self, client: Any, rerunner: Any, header: Any, base: Any, update: Any, revealed: Optional[bytes]) -> None:
        """Re-run one lent check and send the verdict."""
        from asyncloco.coordinator.logic import Lease, Verify
        from asyncloco.transport.errors import TransportError
        from asyncloco.transport.wire import VerdictHeader

        lease = Lease(header.lease_id, header.peer, header.shard, header.start_offset, header.steps, header.lr_offset,
                      header.base_version, 0.0, 0.0, 0.0)
        task = Verify(header.peer, lease, base, update, "lent to a validator", state_start=header.state_start or "",
                      state_end=header.state_end or "", device_class=header.device_class or "")
        started = time.perf_counter()
        try:
            if revealed is None:
                comparison = await asyncio.to_thread(rerunner.check, task)
            else:
                comparison = await asyncio.to_thread(rerunner.check_revealed, task, revealed)
        except Exception as error:  # no verdict: the check goes back to the queue at the coordinator's timeout
            self.summary.errors += 1
            logger.error("re-running lease %s failed (%r); no verdict sent", header.lease_id, error)
            return
        self.summary.busy_s += time.perf_counter() - started
        self.summary.rerun_steps += header.steps
        rel = comparison.rel_error if math.isfinite(comparison.rel_error) and comparison.rel_error <= 1e300 else None
        verdict = VerdictHeader(header.lease_id, comparison.ok, comparison.bitwise, max(-1.0, min(1.0, float(comparison.cosine))),
                                comparison.detail[:4096], rel)
        try:
            reply = await client.verdict(verdict)
        except TransportError as error:
            self.summary.errors += 1
            logger.warning("sending the verdict on lease %s failed: %s", header.lease_id, error)
            return
        if not reply.accepted:
            self.summary.refused += 1
            logger.warning("the coordinator did not take the verdict on lease %s: %s", header.lease_id, reply.reason)
            return
        self.summary.checks += 1
        if comparison.ok:
            self.summary.passed += 1
        else:
            self.summary.failed += 1
        logger.info("lease %s of %s: %s", header.lease_id, header.peer[-8:], comparison.detail)
        record = {"lease_id": header.lease_id, "peer": header.peer, "ok": comparison.ok, "detail": comparison.detail}
        self.summary.verdicts = (self.summary.verdicts + [record])[-256:]
