"""Overlapped rounds (``runtime.overlap``, the default): a peer trains its next lease while its last update uploads
(with its reveal, when the coordinator asks for one) and while the next θ downloads.

Round N+1 of a peer, with round N's upload in flight::

    train N ─ encode N ─┬─ upload N (resent until acknowledged) ─ reveal N, if asked ─┐
                        └─ ask N+1 (keep N) ─ download θ ─ train N+1 ─────────────── wait for N's ack ─ encode N+1 ─ …

What holds with a lease in flight (docs/design.md, "Overlapped rounds"):

* **one upload at a time, in order.** N+1 is encoded only once N's ack is in: with error feedback its encoding starts
  from the residual N's encoding left, which is kept only if N was applied (train/feedback.py);
* **two leases at most.** The request for N+1 names N (``keep``): the coordinator keeps N active, gives back any other
  lease of the peer, and never holds the request for the peer's own update (coordinator/logic/leases.py). N+1's base
  version is θ before N is applied: that staleness is counted like any other (the version the lease was based on);
* **the commitment chain.** N+1 starts from N's end state — and, with error feedback, from the residual N leaves, taken
  as current the moment N is encoded. If N is not applied (refused, expired, lost), the peer resets its inner state
  and drops the residual, as serial rounds do: before training N+1 when N's verdict is in by then; otherwise N+1 was
  trained from a state the chain refuses, and it is not submitted (``summary.discarded``): the coordinator gives its
  steps back when the peer next asks. Without commitments N+1 is submitted, encoded without the dropped residual, and
  so is a lease granted with a fresh start (``LeaseGrant.fresh``: it started from no state of N's);
* **the eager start** (``schedule.eager_start``, algo/eager.py). A lease granted with ``eager_of`` = N trains from θ
  minus ``eager_share`` × N's update, decoded from the encoding in flight (or from N's, once applied); its submission
  names N. Trained so and N then not applied: it is not submitted (the coordinator would refuse it);
* **reveals.** N's reveal goes out from N's upload task while N+1 trains; the reveal store keeps at least two leases;
* **Ctrl+C.** The first lets the lease in training finish, waits for N's ack, submits the last lease and leaves; the
  second leaves at once: the training stops after its step and N's upload is given up (both logged);
* **a coordinator restart** while N uploads: N's same bytes are resent until acknowledged (a duplicate if the old
  coordinator had applied N); the request for N+1 is asked again like any failed request.

**Asking ahead** (a slow download link). Where the peer's θ download takes a measured ``D`` seconds, it asks for N+2 and
downloads its θ *while N+1 trains*, starting ``1.5 D`` before N+1's expected end (:func:`ask_ahead_s`; ``D`` the larger of
the measured rate's expectation and the last ask ahead's observed ask + download), so that N+2
trains as soon as N+1 is sent. It does so only once N's ack is in and N was applied (then the request names N+1 as
``keep``: the peer still holds two leases at most), never in a sync-barrier run, never while stopping, never past
``max_rounds``. The staleness is unchanged: the lease's θ is as old as with a request after training plus a
download. On a fast link (``1.5 D`` under a second, or no download measured yet) the peer asks after training, as
above. The seconds it spent asking and downloading meanwhile are the summary's ``assign_ahead``/``download_ahead``;
what it still waited for the θ after training is ``download``.

The summary's ``train`` seconds over its wall time is the peer's compute fraction; ``upload_wait`` counts the seconds a
trained lease waited for the previous ack (the upload not hidden behind training).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any, Optional

from asyncloco.algo.dylu import ASK_AHEAD_MARGIN
from asyncloco.config import BARRIER_METHODS, RunConfig
from asyncloco.peer.summary import add_timing
from asyncloco.peer.waits import Leave, pause

if TYPE_CHECKING:  # the transport package imports hivemind
    from asyncloco.transport.wire import Ack, LeaseGrant

__all__ = ["OverlappedRounds", "ask_ahead_s"]

logger = logging.getLogger(__name__)

AHEAD_MARGIN = ASK_AHEAD_MARGIN  # the next lease is asked for this many expected downloads before the training ends
AHEAD_MIN_S = 1.0  # a lead shorter than this (a fast link) is not worth asking ahead: ask after training
AHEAD_RATE_STEPS = 4  # once this many steps of the lease in training are timed, its own rate says when it ends
AHEAD_RECHECK = 0.25  # the wait to ask ahead is re-estimated after this share of it (at least AHEAD_MIN_S)


def ask_ahead_s(download_s: Optional[float], observed_s: Optional[float] = None) -> Optional[float]:
    """How long before the training in progress ends to ask for the next lease (and download its θ), given the
    expected seconds of one θ download at the measured rate and, once the peer has asked ahead, ``observed_s``: how
    long its last ask plus download took (the request's own wait, a download slowed by the upload sharing the link's
    other direction — on `home150` 9 s where the rate said 6, and the training waited the difference every round);
    the larger of the two counts. None: ask after training (unmeasured, or fast)."""
    if download_s is None or not math.isfinite(download_s) or download_s < 0:
        return None
    if observed_s is not None and math.isfinite(observed_s) and observed_s > download_s:
        download_s = observed_s
    lead = AHEAD_MARGIN * download_s
    return lead if lead >= AHEAD_MIN_S else None


class _InFlight:
    """A round whose update is uploading: its lease, the task that sends it (and reveals it, if asked), and the
    encoding it sends (a lease granted with the eager start of this one starts from θ minus its decoding)."""

    def __init__(self, lease: LeaseGrant, task: "asyncio.Task[Optional[Ack]]", encoded: Any) -> None:
        self.lease = lease
        self.task = task
        self.encoded = encoded


class OverlappedRounds:
    """The rounds of ``runner`` (a peer/runner.py PeerRunner: its steps ``_ask``, ``_fetch``, ``_train_round``,
    ``_encode``, ``_submit``, ``_settle``), overlapped: ``await OverlappedRounds(...).run()`` until the peer stops,
    reaches ``max_rounds`` or leaves at once."""

    def __init__(
        self, runner: Any, client: Any, publisher: Any, cfg: RunConfig, workload: Any, trainer: Any, codec: str,
        counters: Any,
    ) -> None:
        self.runner = runner
        self.client = client
        self.publisher = publisher
        self.cfg = cfg
        self.workload = workload
        self.trainer = trainer
        self.codec = codec
        self.counters = counters
        self.inflight: Optional[_InFlight] = None
        self.sent = runner.summary.rounds  # rounds whose upload started (max_rounds counts them)
        # asking ahead: the next lease and its θ, asked for while a lease trains; ``trained`` ends its wait early
        self.ahead: Optional["asyncio.Task[Optional[tuple[LeaseGrant, Any]]]"] = None
        self.observed_ahead_s: Optional[float] = None  # how long the last ask ahead + its θ download took
        self.trained = asyncio.Event()
        self.applied_last: Optional[tuple[str, Any]] = None  # the last collected upload, if applied: (lease id, encoding)

    async def run(self) -> None:
        self._keep_two_reveals()
        failed = True
        try:
            while True:
                if self._finishing() and self.ahead is None:  # a lease asked for ahead is trained and sent first
                    if self.inflight is None:
                        break
                    await self._collect()  # stopping: the upload in flight finishes first
                    continue
                await self._round()
            failed = False
        except Leave:
            failed = False  # leaving at once: the upload in flight sees the abort and gives up
        finally:
            await self._drain(cancel=failed)

    def _finishing(self) -> bool:
        runner = self.runner
        rounds = runner.options.max_rounds
        return runner._stop.is_set() or (rounds is not None and self.sent >= rounds)

    def _keep_two_reveals(self) -> None:
        """The reveal store (peer/reveal.py) keeps the lease in flight and the one in training."""
        verify = self.cfg.runtime.verify
        if self.runner.reveals is None and verify.enabled and verify.inner_state == "carry":
            from asyncloco.peer.reveal import RevealStore

            self.runner.reveals = RevealStore(max(2, verify.reveal_keep))

    async def _round(self) -> None:
        """Ask, download and train the next lease while the last update uploads; then send it."""
        runner = self.runner
        got = await self._take_ahead()
        if got is not None:
            lease, theta = got
        elif self._finishing():
            return  # stopping (or at max_rounds): nothing was asked ahead, nothing new is asked for
        else:
            keep = self.inflight.lease.lease_id if self.inflight is not None else None
            asked = await runner._ask(self.client, self.publisher, keep)
            if asked is None:
                await self._collect_if_done()
                return
            lease, theta = asked, await runner._fetch(self.client, asked)
        await self._collect_if_done()  # a verdict that is in resets the state before training, not after
        if theta is None:
            return
        on_unsettled = self.inflight is not None  # trains from the end state of an update not yet acknowledged
        theta, eager = await self._eager_start(lease, theta)
        self._start_ahead(lease)
        try:
            pseudo_gradient = await runner._train_round(self.trainer, theta, lease, self.cfg, self.workload)
        finally:
            self.trained.set()
        if self.inflight is not None:
            waiting = runner.clock.monotonic()
            applied = await self._collect()
            add_timing(runner.summary, "upload_wait", runner.clock.monotonic() - waiting)
            if not applied and ((on_unsettled and runner._commits(self.trainer) and not lease.fresh) or eager):
                runner.summary.discarded += 1
                logger.warning("lease %s not submitted: it was trained from the end state of an update the coordinator "
                               "did not apply (the coordinator gives its %d steps back)", lease.lease_id, lease.steps)
                return
        self._send(lease, await self._encode(lease, pseudo_gradient), eager)

    async def _eager_start(self, lease: LeaseGrant, theta: Any) -> tuple[Any, Optional[str]]:
        """θ to train ``lease`` from, and the lease whose update its start subtracted (None: θ itself): with an eager
        start (``LeaseGrant.eager_of``, algo/eager.py) θ − ``eager_share`` × the update of that lease as the
        coordinator decodes it — if this peer still holds its encoding and has not seen it refused (a restart loses
        it; the submission then says it trained from θ)."""
        kept = lease.eager_of
        if not kept or lease.eager_share is None:
            return theta, None
        encoded = None
        if self.inflight is not None and self.inflight.lease.lease_id == kept:
            encoded = self.inflight.encoded
        elif self.applied_last is not None and self.applied_last[0] == kept:
            encoded = self.applied_last[1]
        if encoded is None:
            logger.info("lease %s trains from θ itself: the update of %s (its eager start) is not at hand or was not "
                        "applied", lease.lease_id, kept)
            return theta, None
        from asyncloco.algo.eager import eager_start
        from asyncloco.transport.codecs import decode

        share = float(lease.eager_share)
        shifted = await asyncio.to_thread(lambda: eager_start(theta, decode(encoded, encoded.numel), share))
        return shifted, kept

    # ---------------------------------------------------------------------------------- asking ahead

    def _start_ahead(self, training: LeaseGrant) -> None:
        """While ``training`` trains: ask for the next lease and download its θ, if the link makes it worth it."""
        rounds = self.runner.options.max_rounds
        if self.runner._stop.is_set() or self.cfg.schedule.method in BARRIER_METHODS or (
            rounds is not None and self.sent + 2 > rounds
        ):
            return  # stopping; a sync round starts when every update is in; or the lease in training is the last one
        lead = ask_ahead_s(self._download_s(), self.observed_ahead_s)
        if lead is None:
            return
        self.trained = asyncio.Event()
        started = self.runner.clock.monotonic()
        previous = self.inflight.task if self.inflight is not None else None
        self.ahead = asyncio.ensure_future(self._ask_ahead(training, started, lead, previous))

    def _download_s(self) -> Optional[float]:
        """Expected seconds of one θ download at the measured rate (None: not measured yet, or no link)."""
        link = getattr(self.client, "link", None)
        if link is None or link.measured.get("down") is None:
            return None
        from asyncloco.transport.codec_format import wire_bytes

        return float(link.expected_s("down", wire_bytes(self.client.download_codec, self.client.model_numel)))

    async def _ask_ahead(
        self, training: LeaseGrant, started: float, lead: float, previous: "Optional[asyncio.Task[Optional[Ack]]]"
    ) -> "Optional[tuple[LeaseGrant, Any]]":
        runner = self.runner
        if previous is not None:  # N's ack first: the request may name one kept lease only (N+1, training)
            await asyncio.wait({previous})
            if previous.cancelled() or previous.exception() is not None:
                return None
            ack = previous.result()
            if not (ack is not None and ack.accepted) and runner._commits(self.trainer):
                return None  # N+1 will not be submitted (trained from a refused state): ask after it
        while not self.trained.is_set():
            wait = started + self._training_s(training) - lead - runner.clock.monotonic()
            if wait <= 0:
                break
            # re-estimated as the lease's own steps are timed (a second Ctrl+C ends the training: this task is cancelled)
            await pause(runner.clock, max(min(wait, AHEAD_MIN_S), AHEAD_RECHECK * wait), self.trained)
        if runner._stop.is_set():
            return None
        asked = runner.clock.monotonic()
        left = started + self._training_s(training) - asked
        logger.info("lease %s: asking for the next one %.1f s before its training ends (lead %.1f s)",
                    training.lease_id, left, lead)
        lease = await runner._ask(self.client, self.publisher, training.lease_id, timing="assign_ahead")
        if lease is None:
            return None
        theta = await runner._fetch(self.client, lease, timing="download_ahead")
        if theta is None:
            return None
        self.observed_ahead_s = runner.clock.monotonic() - asked  # the next lead covers it (ask_ahead_s)
        return lease, theta

    def _training_s(self, training: LeaseGrant) -> float:
        """Expected seconds of ``training`` from its start, the emulated slowdown's pause included: from the lease's
        own step rate once :data:`AHEAD_RATE_STEPS` steps are timed (a lease on shared cores runs faster or slower
        than the peer's average: asked by the average, a faster lease ended before its θ came), else from the
        peer's speed."""
        runner = self.runner
        lease_id, steps = runner.lease_step_seconds  # appended by the training thread
        done = len(steps)
        if lease_id == training.lease_id and AHEAD_RATE_STEPS <= done <= training.steps:
            timed = list(steps[1:done])  # the first step warms up (allocations, compilation)
            per_step = sum(timed) / len(timed)
            return (steps[0] + per_step * (training.steps - 1)) * max(1.0, runner.options.slowdown)
        return training.steps * self.workload.units_per_step / float(runner.speed or 1.0)

    async def _take_ahead(self) -> "Optional[tuple[LeaseGrant, Any]]":
        """The lease asked for ahead and its θ (None: none, or it failed: ask now); the wait for it counts as
        ``download``."""
        if self.ahead is None:
            return None
        task, self.ahead = self.ahead, None
        waiting = self.runner.clock.monotonic()
        try:
            return await task
        finally:
            add_timing(self.runner.summary, "download", self.runner.clock.monotonic() - waiting)

    async def _encode(self, lease: LeaseGrant, pseudo_gradient: Any) -> Any:
        runner = self.runner
        started = runner.clock.monotonic()
        encoded = await runner._encode(self.trainer, lease, pseudo_gradient, self.cfg, self.codec)
        add_timing(runner.summary, "upload", runner.clock.monotonic() - started)
        return encoded

    def _send(self, lease: LeaseGrant, encoded: Any, eager: Optional[str] = None) -> None:
        """Start the upload of ``encoded`` (None: nothing to send; ``eager``: the lease whose update its start
        subtracted). The next lease starts from the state and the residual this update leaves, as if it were applied
        (:meth:`_collect` undoes that if it is not)."""
        if encoded is None:
            return
        runner = self.runner
        digests, inner_loss = runner._digests, runner._inner_loss  # this round's: the next training replaces them
        runner.feedback.settle(True)
        self.sent += 1
        upload = self._upload(lease, encoded, digests, inner_loss, eager)
        self.inflight = _InFlight(lease, asyncio.ensure_future(upload), encoded)

    async def _upload(
        self, lease: LeaseGrant, encoded: Any, digests: tuple[Any, Any], inner_loss: Optional[float],
        eager: Optional[str] = None,
    ) -> Optional[Ack]:
        runner = self.runner
        ack: Optional[Ack] = await runner._submit(
            self.client, self.trainer, lease, encoded, digests, inner_loss, runner.clock.monotonic(), eager
        )
        if ack is not None:
            await runner._settle(self.client, lease, ack, self.counters, digests=digests, prefetch=False)
        return ack

    async def _collect_if_done(self) -> None:
        if self.inflight is not None and self.inflight.task.done():
            await self._collect()

    async def _collect(self) -> bool:
        """Wait for the upload in flight; if its update was not applied, drop the residual and (with commitments)
        reset the inner state, as serial rounds do. Never called while a lease trains. True when applied."""
        assert self.inflight is not None
        inflight, self.inflight = self.inflight, None
        ack = await inflight.task
        applied = ack is not None and ack.accepted
        self.applied_last = (inflight.lease.lease_id, inflight.encoded) if applied else None
        runner = self.runner
        if not applied:
            runner.feedback.settle(False)  # the residual taken as current when it was sent is dropped
            if runner._commits(self.trainer):
                runner._reset_inner_state(self.trainer)  # only applied leases advance the commitment chain
        return applied

    async def _drain(self, cancel: bool) -> None:
        """The upload in flight as the rounds end: awaited (it ends at once after a second Ctrl+C), or cancelled when
        the rounds end on an error. A request asked ahead is cancelled (its lease, if one came, expires)."""
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            ahead.cancel()
            result = (await asyncio.gather(ahead, return_exceptions=True))[0]
            if isinstance(result, tuple):
                logger.warning("leaving: lease %s, asked for ahead, is dropped before training (the coordinator gives "
                               "its %s steps back)", result[0].lease_id, result[0].steps)
        if self.inflight is None:
            return
        task, self.inflight = self.inflight.task, None
        if cancel:
            task.cancel()
        results = await asyncio.gather(task, return_exceptions=True)
        if not cancel and isinstance(results[0], BaseException) and not isinstance(results[0], asyncio.CancelledError):
            logger.warning("the last upload failed as the peer left: %r", results[0])
