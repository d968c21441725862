"""Sending a trained round to the coordinator (peer/runner.py's upload step).

:func:`error_feedback` keeps the peer's one :class:`~asyncloco.train.feedback.ErrorFeedback` (its residual lives across
leases), made anew only when the run's codec changes. :func:`submit_with_retry` sends the *same encoded bytes* until the
coordinator acknowledges them, with exponential backoff (0.5 s doubling up to 10 s), until the lease's deadline — or,
while the coordinator does not answer at all, until ``--join-timeout`` after the first failure: a coordinator restart
loses nothing, since it acknowledges a resend of an applied lease as a duplicate and gives a lease in training its
time again. The inner-state commitments travel with the submission (peer/reveal.py sends the reveal when the ack
asks for it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Optional

from asyncloco.clock import Clock
from asyncloco.config import RunConfig
from asyncloco.peer.summary import PeerSummary
from asyncloco.peer.waits import Aborted, pause, race

if TYPE_CHECKING:  # the transport package imports hivemind: imported where used
    from asyncloco.transport.wire import Ack, LeaseGrant

__all__ = ["error_feedback", "submit_with_retry"]

logger = logging.getLogger(__name__)


def error_feedback(current: Any, cfg: RunConfig, codec: str) -> Any:
    """This peer's error feedback (train/feedback.py): ``current`` unless the run's codec (or whether it uses
    error feedback) changed, then a fresh one."""
    from asyncloco.train.feedback import ErrorFeedback

    enabled, decay = cfg.runtime.uses_error_feedback, cfg.runtime.error_feedback_decay
    if (current is None or current.codec != codec or current.enabled != (enabled and codec != "none")
            or current.decay != decay):
        return ErrorFeedback(codec, enabled, decay)
    return current


async def submit_with_retry(
    client: Any,
    lease: LeaseGrant,
    encoded: Any,
    *,
    inner_loss: Optional[float],
    digests: tuple[Optional[str], Optional[str]],
    clock: Clock,
    abort: asyncio.Event,
    summary: PeerSummary,
    device_class: Optional[str] = None,
    unanswered_for: float = 0.0,
    eager_of: Optional[str] = None,
) -> Optional[Ack]:
    """Send the same encoded bytes until acknowledged, refused with a typed code (asyncloco/refusals.py: e.g. a NaN
    caught at decode, an unadmitted sender; None), or the lease's deadline (the coordinator's wall time, compared
    with ``clock.time()``) passes; each resend is counted in ``summary.resends``. A first Ctrl+C does not stop this (the
    lease is being finished); a second one (``abort``) does (None). ``digests``: the inner-state commitments (start,
    end) of the lease; ``device_class`` the compute class it ran on (train/inner.py ``compute_class``); ``eager_of`` the
    lease whose update its start subtracted (algo/eager.py).

    ``unanswered_for`` (``--join-timeout``): past the deadline, resends go on while the coordinator does not answer at
    all (a timeout, no stream), up to this many seconds after the first failure: a coordinator that restarts gives a
    lease in training its slack and transfer time again from the restart (coordinator/logic/peers.py ``on_restarted``),
    so a downtime longer than the lease's deadline loses nothing; a coordinator that answers decides (an expired lease
    is acknowledged as refused)."""
    from asyncloco.transport.errors import PeerUnreachable, RpcTimeout, TransportError

    delay = 0.5
    first_failure: Optional[float] = None
    while not abort.is_set():
        try:
            ack: Ack = await race(client.submit(
                lease.lease_id, lease.base_version, encoded, inner_loss=inner_loss,
                state_start=digests[0], state_end=digests[1], device_class=device_class,
                **({"eager_of": eager_of} if eager_of is not None else {})), abort)
            return ack
        except Aborted:
            break
        except TransportError as error:
            if getattr(error, "code", None) is not None:  # a typed refusal is an answer: the same bytes get the same one
                logger.warning("lease %s refused: %s", lease.lease_id, error)
                return None
            first_failure = clock.monotonic() if first_failure is None else first_failure
            unanswered = isinstance(error, (PeerUnreachable, RpcTimeout))
            if clock.time() > lease.deadline and not (unanswered and clock.monotonic() - first_failure < unanswered_for):
                logger.warning("giving up on lease %s: deadline passed (%s)", lease.lease_id, error)
                return None
            summary.resends += 1
            logger.warning("submit of %s failed (%s); resending in %.1fs", lease.lease_id, error, delay)
            await pause(clock, delay, abort)
            delay = min(delay * 2, 10.0)
    logger.warning("leaving at once: the trained pseudo-gradient of lease %s (%s steps) is dropped, unsent",
                   lease.lease_id, lease.steps)
    return None
