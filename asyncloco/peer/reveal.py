"""The peer's side of the inner-state commitments (issue 16, stage 2; docs/threat-model.md, "Commitments").

With ``runtime.verify.enabled`` and ``inner_state: carry`` a peer commits, in each submission, to the digests of its
inner AdamW state at the lease's start and end (peer/inner.py ``inner_state_digest``). When the coordinator picks
that lease for verification — after the submission, by an HMAC the peer cannot compute — its :class:`~asyncloco.
transport.wire.Ack` asks for ``reveal``: the peer sends the start state in its canonical layout (``inner_state_chunks``,
raw little-endian floats, never pickled) with the ``reveal`` RPC, and the coordinator re-runs the lease from it
(coordinator/verify.py ``Rerunner.check_revealed``). A lease that is not revealed before ``runtime.verify.
reveal_timeout`` counts as a failed check.

:class:`RevealStore` keeps the start states of the peer's last ``runtime.verify.reveal_keep`` leases (default 2: the
lease being trained and the one being submitted). Memory: at most ``reveal_keep × Σ (9 + 8 n)`` bytes over the
parameter tensors of n elements — two fp32 moments per weight per kept lease (20m: ≈ 0.16 GB per kept lease). A fresh state
(the first lease, or after a reset) is not kept: its digest is a constant the coordinator re-runs from directly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Optional

from asyncloco.peer.inner import FRESH_STATE_DIGEST, inner_state_chunks

__all__ = ["RevealStore", "send_reveal"]

logger = logging.getLogger(__name__)


class RevealStore:
    """Start states of the peer's most recent leases, by lease id, at most ``keep`` of them (oldest dropped first)."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"RevealStore keeps at least one lease's state, got keep={keep}; set runtime.verify.reveal_keep >= 1")
        self.keep = keep
        self._states: "OrderedDict[str, bytes]" = OrderedDict()

    def hold(self, lease_id: str, optimizer: Any) -> None:
        """Keep ``optimizer``'s state as lease ``lease_id`` starts from it (nothing for a fresh state)."""
        chunks = inner_state_chunks(optimizer)
        if not chunks:
            return
        self._states[lease_id] = b"".join(chunks)
        self._states.move_to_end(lease_id)
        while len(self._states) > self.keep:
            self._states.popitem(last=False)

    def get(self, lease_id: str) -> Optional[bytes]:
        """The start state of ``lease_id`` (b"" when it is not kept: a fresh start, or dropped)."""
        return self._states.get(lease_id)

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> int:
        return sum(len(state) for state in self._states.values())


async def send_reveal(client: Any, lease_id: str, state: Optional[bytes], digest: Optional[str]) -> bool:
    """Answer the coordinator's ``reveal`` request for ``lease_id``; True when it took the state. A lease whose start
    was the fresh state needs no reveal (the coordinator knows that state); one whose state was dropped cannot be
    revealed (the check fails at the deadline: raise ``runtime.verify.reveal_keep``)."""
    from asyncloco.transport.errors import TransportError

    if digest == FRESH_STATE_DIGEST:
        return True
    if state is None:
        logger.error("the coordinator asked for lease %s's start state, which this peer no longer keeps "
                     "(runtime.verify.reveal_keep); the check will fail", lease_id)
        return False
    try:
        reply = await client.reveal(lease_id, state)
    except TransportError as error:
        logger.warning("revealing lease %s's start state failed: %s", lease_id, error)
        return False
    if not reply.accepted:
        logger.warning("the coordinator refused lease %s's revealed state: %s", lease_id, reply.reason)
    return bool(reply.accepted)
