"""Validator peers' side of the coordinator (docs/threat-model.md, "Who verifies").

Organiser-run machines (``asyncloco validator join``, asyncloco/validator.py) whose libp2p peer ids are listed in
``runtime.verify.validators`` take checks off the same queue as the coordinator's own verification worker
(coordinator/verify.py ``Verifier``; ``runtime.verify.local: false`` leaves the queue to them): the ``verify_task``
RPC lends the next check — the lease, θ at its base version, the update as submitted and the revealed start state —
and the ``verdict`` RPC turns the validator's judgement into the same ``Verified`` event through the daemon's
decision entry point. A check not judged within ``runtime.verify.validator_timeout``, or whose bodies did not all go
out, goes back to the queue. Validators are trusted (their verdicts expel peers): only the ids the organiser listed
are served; anyone else is refused with ``not_admitted``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from asyncloco.train.commitments import Buffer

__all__ = ["ValidatorDesk"]

logger = logging.getLogger(__name__)


@dataclass
class _Loan:
    """A check lent to a validator peer."""

    task: Any  # logic.Verify
    queued_at: float
    revealed: "Optional[Buffer]"
    validator: str
    expiry: Optional["asyncio.Task[None]"] = None


@dataclass
class DeskStats:
    lent: int = 0  # checks handed to validators
    judged: int = 0  # verdicts received
    returned: int = 0  # given back to the queue unjudged (timeout, failed transfer)
    by: dict[str, int] = field(default_factory=dict)  # verdicts per validator


def fp32_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's values as little-endian fp32 bytes (a view, no copy, when it already is fp32 and contiguous)."""
    return tensor.detach().to(torch.float32).contiguous().cpu().numpy().view("u1").data


class ValidatorDesk:
    """The checks lent to validator peers, for ``verification`` (coordinator/verify.py ``DaemonVerification``: its
    ``verifier`` queue, ``knobs``, ``port`` (the node's state and clock), ``judged`` and ``unverified`` entry points)."""

    def __init__(self, verification: Any) -> None:
        self.verification = verification
        self.validators = frozenset(verification.knobs.validators)
        self.lent: dict[str, _Loan] = {}
        self.stats = DeskStats()

    def status(self) -> dict[str, Any]:
        return {"lent": self.stats.lent, "judged": self.stats.judged, "returned": self.stats.returned,
                "by": dict(self.stats.by), "out": len(self.lent), "local": bool(self.verification.knobs.local),
                "listed": len(self.validators)}

    def _check_validator(self, peer: str) -> None:
        from asyncloco.refusals import Refusal, RefusalCode

        if peer not in self.validators:
            raise Refusal(RefusalCode.NOT_ADMITTED, "not a validator of this run: the organiser lists validator peer ids "
                          "in runtime.verify.validators (`asyncloco validator join` prints this peer's id)")

    async def lend(self, wait_s: float, peer: str) -> tuple[Any, list[Any]]:
        """The ``verify_task`` RPC: the next queued check, lent to validator ``peer`` until its verdict or
        ``validator_timeout``; ``(CheckHeader, bodies)``, the header empty when no check came within ``wait_s``."""
        from asyncloco.transport.wire import CheckHeader

        self._check_validator(peer)
        verifier = self.verification.verifier
        numel = int(self.verification.port.node.state.params.numel())
        deadline = verifier.clock() + wait_s
        while True:
            try:
                task, queued_at, revealed = verifier.queue.get_nowait()
            except asyncio.QueueEmpty:
                left = deadline - verifier.clock()
                if left <= 0:
                    return CheckHeader(numel), []
                try:
                    task, queued_at, revealed = await asyncio.wait_for(verifier.queue.get(), timeout=left)
                except asyncio.TimeoutError:
                    return CheckHeader(numel), []
            if not verifier.moot(task):
                from asyncloco.coordinator.rerun import start_theta

                # a compressed download: the validator re-runs from the θ the peer decoded, rebuilt here
                base, why = await asyncio.to_thread(start_theta, task) if task.theta_codec or task.lease.eager_of else (task.base, "")
                if base is not None:
                    break
                await self.verification.judged(task, False, False, math.inf, -1.0, why)
            else:
                verifier.stats.moot += 1  # its peer was expelled meanwhile: dropped unrun
            verifier._done()
        lease = task.lease
        loan = _Loan(task, queued_at, revealed, peer)
        self.lent[lease.lease_id] = loan
        loan.expiry = asyncio.get_running_loop().create_task(self._expire(loan))
        self.stats.lent += 1
        header = CheckHeader(
            numel, lease.lease_id, task.peer, lease.base_version, lease.shard, lease.start_offset, lease.steps,
            lease.lr_offset, task.state_start or None, task.state_end or None, None if revealed is None else len(revealed),
            task.device_class or None,
        )
        return header, [fp32_bytes(base), fp32_bytes(task.update), revealed or b""]

    async def _expire(self, loan: _Loan) -> None:
        timeout = float(self.verification.knobs.validator_timeout)
        await self.verification.port.node.clock.sleep(timeout)
        lease_id = loan.task.lease.lease_id
        if self.lent.get(lease_id) is loan:
            logger.warning("validator %s did not judge lease %s within runtime.verify.validator_timeout (%g s); the "
                           "check goes back to the queue", loan.validator[-8:], lease_id, timeout)
            self.give_back(lease_id, loan.validator)

    def give_back(self, lease_id: Optional[str], peer: str) -> None:
        """A lent check comes back unjudged: queued again (a full queue ends it unverified)."""
        loan = self.lent.get(lease_id or "")
        if loan is None or loan.validator != peer:
            return
        del self.lent[loan.task.lease.lease_id]
        if loan.expiry is not None and loan.expiry is not asyncio.current_task():
            loan.expiry.cancel()
        self.stats.returned += 1
        verifier = self.verification.verifier
        verifier._done()  # the loan's get() ends here, and the same check is queued again
        if verifier.offer(loan.task, loan.revealed, offered_at=loan.queued_at):
            verifier.stats.queued -= 1  # not a new check
        else:
            self.verification.unverified_later(loan.task, "the verification queue was full when a validator gave it back")

    async def take_verdict(self, header: Any, peer: str) -> Any:
        """The ``verdict`` RPC: validator ``peer``'s judgement of a check it was lent becomes the same ``Verified``
        event as the coordinator's own re-runs (its detail names the validator)."""
        from asyncloco.transport.wire import VerdictReply

        self._check_validator(peer)
        loan = self.lent.get(header.lease_id)
        if loan is None or loan.validator != peer:
            return VerdictReply(False, "this check is not lent to this validator (unknown, already judged, or given "
                                       "back after runtime.verify.validator_timeout)")
        del self.lent[header.lease_id]
        if loan.expiry is not None:
            loan.expiry.cancel()
        verifier = self.verification.verifier
        verifier.stats.rerun_steps += loan.task.lease.steps
        verifier.stats.latencies = (verifier.stats.latencies + [verifier.clock() - loan.queued_at])[-256:]
        self.stats.judged += 1
        self.stats.by[peer] = self.stats.by.get(peer, 0) + 1
        rel = math.inf if header.rel_error is None else float(header.rel_error)
        try:
            await self.verification.judged(loan.task, bool(header.ok), bool(header.bitwise), rel, float(header.cosine),
                                           f"{header.detail} (validator {peer[-8:]})", loan.revealed)
        finally:
            verifier._done()
        return VerdictReply(True, "decided")

    def close(self) -> None:
        for loan in self.lent.values():
            if loan.expiry is not None:
                loan.expiry.cancel()
        self.lent.clear()
