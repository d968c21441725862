"""Re-runs ahead (``runtime.verify.ahead``, docs/threat-model.md "Verified work"): a checked lease's re-run started
when the coordinator sends the lease's θ, while the peer trains, so that the held update's verdict is ready when the
update arrives instead of one re-run (and the queue before it) later.

With ``runtime.verify.inner_state: reset`` a lease is a deterministic function of the θ its peer decoded and the
lease's data (coordinator/rerun.py): once the coordinator has served that θ — in fp32, or in a lossy codec in full or
as a delta from an anchor the peer holds (transport/delta.py ``decoded_theta``) — it knows everything the re-run
needs. Whether a lease is checked is decided at issue (coordinator/logic/draws.py) and never told to the peer; every
download is served the same way, so the peer learns nothing from this either.

An ahead result is only ever a *faster* re-run: it is used for a check only when the lease (shard, offset, steps, LR
offset, base version) and the θ the submission names (codec, anchor, sha256 of the decoded θ; for a submission that
names none, θ at the base version itself) are exactly the ones it was made for — otherwise the check re-runs as
before. Nothing here changes coordinator state: the verdict still goes through the node's decide as a ``Verified``
event when the update is in. Bounded: at most ``ahead`` planned and ``ahead`` finished results (each θ-sized); past
that the oldest is dropped unused.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from asyncloco.coordinator.logic import Lease, Verify
    from asyncloco.coordinator.rerun import Comparison, Rerunner

__all__ = ["Ahead", "AheadRun", "AheadResult"]

logger = logging.getLogger(__name__)

SENT_KEEP = 256  # (peer, version, codec) -> how θ was sent, for the downloads answered "unchanged" (no body)
PLANS_PER_LEASE = 2  # a lease downloaded again in another encoding is re-run ahead again, this many times at most


def _lease_fields(lease: "Lease") -> tuple[Any, ...]:
    return (lease.lease_id, lease.peer, lease.base_version, lease.shard, lease.start_offset, lease.steps, lease.lr_offset)


@dataclass
class AheadRun:
    """A planned re-run: ``lease`` from θ at its base version (``base``) as sent in ``codec`` (``anchor``: the version of
    the full encoding a delta was added to, whose bytes are ``anchor_body``; None: in full)."""

    lease: "Lease"
    base: torch.Tensor
    codec: str
    anchor: Optional[int]
    anchor_body: Optional[bytes]


@dataclass
class AheadResult:
    """A finished re-run: the lease it was made for, the θ it started from (codec, anchor, sha256) and its pseudo-gradient
    before the upload codec."""

    lease: tuple[Any, ...]
    codec: str
    anchor: Optional[int]
    digest: str
    pseudo_gradient: torch.Tensor


@dataclass
class AheadStats:
    planned: int = 0
    run: int = 0  # re-runs made ahead
    steps: int = 0  # their inner steps
    used: int = 0  # checks judged from one
    unused: int = 0  # made but dropped unused (the bound, or its peer was expelled): compute spent for nothing
    superseded: int = 0  # planned but never started (its update came first, the bound, or its peer was expelled)
    mismatched: int = 0  # its check named another θ or lease: re-run as before
    on_arrival: int = 0  # verdicts decided by their update's submit, under the same hold of the lock

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Ahead:
    """The planned and finished re-runs ahead of their updates (``limit`` each). Used on the event loop only, except
    :meth:`run` and :meth:`judge`, which the caller runs in a worker thread on objects it has taken out."""

    limit: int
    planned: "OrderedDict[str, AheadRun]" = field(default_factory=OrderedDict)
    done: "OrderedDict[str, AheadResult]" = field(default_factory=OrderedDict)
    running: Optional[str] = None
    sent: "OrderedDict[tuple[str, int, str], Optional[int]]" = field(default_factory=OrderedDict)
    stats: AheadStats = field(default_factory=AheadStats)
    # plans per lease id (the newest SENT_KEEP): a peer that downloads its θ again and again in other encodings gets
    # PLANS_PER_LEASE re-runs ahead, not one per download
    plans: "OrderedDict[str, int]" = field(default_factory=OrderedDict)

    def note_sent(self, peer: str, version: int, codec: str, anchor: Optional[int]) -> None:
        """θ at ``version`` went to ``peer`` in ``codec`` (a delta from ``anchor``, or in full)."""
        key = (peer, version, codec)
        self.sent[key] = anchor
        self.sent.move_to_end(key)
        while len(self.sent) > SENT_KEEP:
            self.sent.popitem(last=False)

    def sent_as(self, peer: str, version: int, codec: str) -> tuple[bool, Optional[int]]:
        """(known, anchor) of the last time θ at ``version`` went to ``peer`` in ``codec``."""
        key = (peer, version, codec)
        return key in self.sent, self.sent.get(key)

    def plan(self, run: AheadRun) -> bool:
        """Plan ``run`` (False: this lease from this θ is planned, running or done already)."""
        lease_id = run.lease.lease_id
        finished = self.done.get(lease_id)
        if lease_id == self.running or (finished is not None and (finished.codec, finished.anchor) == (run.codec, run.anchor)):
            return False
        old = self.planned.get(lease_id)
        if old is not None and (old.codec, old.anchor) == (run.codec, run.anchor):
            return False
        if self.plans.get(lease_id, 0) >= PLANS_PER_LEASE:
            return False
        self.plans[lease_id] = self.plans.get(lease_id, 0) + 1
        self.plans.move_to_end(lease_id)
        while len(self.plans) > SENT_KEEP:
            self.plans.popitem(last=False)
        self.planned[lease_id] = AheadRun(copy.copy(run.lease), run.base, run.codec, run.anchor, run.anchor_body)
        self.planned.move_to_end(lease_id)
        self.stats.planned += 1
        while len(self.planned) > self.limit:
            self.planned.popitem(last=False)
            self.stats.superseded += 1
        return True

    def next(self) -> Optional[AheadRun]:
        """The oldest planned run, taken out (:attr:`running` until :meth:`finish`)."""
        if not self.planned:
            return None
        lease_id, run = self.planned.popitem(last=False)
        self.running = lease_id
        return run

    @staticmethod
    def run(run: AheadRun, rerunner: "Rerunner") -> AheadResult:
        """Re-run ``run`` (in the verification worker's thread: the rerunner's trainer is not shared)."""
        from asyncloco.transport.delta import decoded_theta, theta_digest

        theta = decoded_theta(run.codec, run.base, run.anchor_body)
        pseudo_gradient = rerunner.trained(run.lease, theta)
        return AheadResult(_lease_fields(run.lease), run.codec, run.anchor, theta_digest(theta), pseudo_gradient)

    def finish(self, result: Optional[AheadResult]) -> None:
        """The running re-run ended (``result`` None: it failed or was dropped)."""
        self.running = None
        if result is None:
            return
        self.stats.run += 1
        self.stats.steps += int(result.lease[5])
        lease_id = str(result.lease[0])
        self.done[lease_id] = result
        self.done.move_to_end(lease_id)
        while len(self.done) > self.limit:
            self.done.popitem(last=False)
            self.stats.unused += 1

    def take(self, lease_id: str) -> Optional[AheadResult]:
        """The finished result for ``lease_id``'s check, taken out (None: none; a planned one not started is dropped:
        the check re-runs the lease itself)."""
        if self.planned.pop(lease_id, None) is not None:
            self.stats.superseded += 1
        return self.done.pop(lease_id, None)

    def forget(self, lease_ids: set[str]) -> None:
        """Drop what is planned or done for leases whose check will not come (their peer was expelled)."""
        for lease_id in [i for i in self.planned if i in lease_ids]:
            del self.planned[lease_id]
            self.stats.superseded += 1
        for lease_id in [i for i in self.done if i in lease_ids]:
            del self.done[lease_id]
            self.stats.unused += 1

    def judge(self, task: "Verify", result: AheadResult, rerunner: "Rerunner") -> Optional["Comparison"]:
        """``task`` judged from ``result`` (in a worker thread: hashing θ), or None when ``result`` was made for another
        lease or θ than the one ``task``'s submission names — then the check re-runs as before."""
        from asyncloco.transport.delta import theta_digest

        if _lease_fields(task.lease) != result.lease:
            return None
        if task.theta_codec:
            named = (task.theta_codec, task.theta_anchor, task.theta_digest)
        else:  # no provenance named: the check re-runs from θ at the base version itself (rerun.start_theta)
            named = ("none", None, theta_digest(task.base) if task.base.numel() else "")
        if named != (result.codec, result.anchor, result.digest):
            return None
        return rerunner.check_trained(task, result.pseudo_gradient)
