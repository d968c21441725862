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
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Optional

import hashlib
import struct

import numpy as np
import torch

from asyncloco.peer.inner import FRESH_STATE_DIGEST, inner_state_chunks

__all__ = ["RevealStore", "send_reveal", "committed_digest", "pack_reveal", "unpack_reveal", "revealed_size"]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------- the error-feedback residual, committed too
#
# With error feedback (runtime.error_feedback, peer/feedback.py) the upload is encode(Δ + β·e_prev): the residual
# e_prev is part of what a lease's submission depends on, so it is committed with the inner state and revealed with
# it. The commitment is the inner state's digest when there is no residual (a fresh peer, or one whose last upload
# was not applied: both drop it), else sha256 over the inner digest and the residual's little-endian float32 bytes.
# The revealed bytes, with feedback on: the inner state's length (uint64 LE), its canonical layout, then the residual
# (4 bytes per parameter, or nothing when there is none).

_RESIDUAL_DOMAIN = b"asyncloco inner state + residual v1:"


def _residual_bytes(residual: torch.Tensor) -> bytes:
    return residual.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def committed_digest(inner_digest: str, residual: Optional[torch.Tensor]) -> str:
    """The commitment to an inner state (its digest, peer/inner.py) together with the error-feedback residual."""
    if residual is None:
        return inner_digest
    hasher = hashlib.sha256(_RESIDUAL_DOMAIN + inner_digest.encode())
    hasher.update(_residual_bytes(residual))
    return hasher.hexdigest()


def pack_reveal(inner: bytes, residual: Optional[torch.Tensor]) -> bytes:
    """The revealed bytes with error feedback on: the inner state's length and layout, then the residual."""
    return struct.pack("<Q", len(inner)) + inner + (b"" if residual is None else _residual_bytes(residual))


def revealed_size(inner_size: int, numel: int, feedback: bool) -> int:
    """The most bytes a reveal may carry: the full inner state (``inner_size``), with feedback plus 8 + 4·numel."""
    return inner_size + (8 + 4 * numel if feedback else 0)


def unpack_reveal(data: bytes, numel: int) -> tuple[bytes, Optional[torch.Tensor]]:
    """Split revealed bytes (feedback on) into the inner state's layout and the residual (None when absent); b""
    is the fresh state without a residual. Raises ValueError naming what is malformed."""
    if not data:
        return b"", None
    if len(data) < 8:
        raise ValueError(f"the revealed state has {len(data)} bytes, fewer than its 8-byte length field")
    (inner_length,) = struct.unpack_from("<Q", data, 0)
    rest = len(data) - 8 - inner_length
    if inner_length > len(data) - 8 or rest not in (0, 4 * numel):
        raise ValueError(f"the revealed state's inner part of {inner_length} bytes leaves {len(data) - 8 - inner_length} "
                         f"bytes for the residual, which needs 0 or {4 * numel}")
    inner = bytes(data[8 : 8 + inner_length])
    if rest == 0:
        return inner, None
    residual = torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=8 + inner_length, count=numel).astype(np.float32))
    if not bool(torch.isfinite(residual).all()):
        raise ValueError("the revealed residual has a NaN or Inf")
    return inner, residual


class RevealStore:
    """Start states of the peer's most recent leases, by lease id, at most ``keep`` of them (oldest dropped first)."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"RevealStore keeps at least one lease's state, got keep={keep}; set runtime.verify.reveal_keep >= 1")
        self.keep = keep
        self._states: "OrderedDict[str, bytes]" = OrderedDict()

    def hold(self, lease_id: str, optimizer: Any, residual: Optional[torch.Tensor] = None, feedback: bool = False) -> None:
        """Keep ``optimizer``'s state (and, with error feedback on, the residual) as lease ``lease_id`` starts from
        it — nothing for a fresh state without a residual."""
        chunks = inner_state_chunks(optimizer)
        if chunks is None or (not chunks and residual is None):
            return
        inner = b"".join(chunks)
        self._states[lease_id] = pack_reveal(inner, residual) if feedback else inner
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


async def send_reveal(client: Any, lease_id: str, state: Optional[bytes], digest: Optional[str], *,
                      retry_for: float = 0.0, wait: Optional[Callable[[float], Awaitable[None]]] = None,
                      now: Callable[[], float] = time.monotonic, aborted: Callable[[], bool] = lambda: False) -> bool:
    """Answer the coordinator's ``reveal`` request for ``lease_id``; True when it took the state. A lease whose start
    was the fresh state needs no reveal (the coordinator knows that state); one whose state was dropped cannot be
    revealed (the check fails at the deadline: raise ``runtime.verify.reveal_keep``). An upload that fails on the
    way (a reset, a dropped stream) is sent again with backoff (``wait``) for ``retry_for`` seconds — an honest peer
    whose reveal is lost would fail its check at ``runtime.verify.reveal_timeout``; a refusal is an answer, and so is
    an error the coordinator's handler returns (a restarted coordinator awaits no reveal of an older check)."""
    from asyncloco.transport.errors import RemoteError, TransportError

    if digest == FRESH_STATE_DIGEST:
        return True
    if state is None:
        logger.error("the coordinator asked for lease %s's start state, which this peer no longer keeps "
                     "(runtime.verify.reveal_keep); the check will fail", lease_id)
        return False
    give_up, delay = now() + retry_for, 0.5
    while True:
        try:
            reply = await client.reveal(lease_id, state)
            break
        except RemoteError as error:  # the coordinator answered (e.g. a restarted one awaits no reveal): final
            logger.warning("the coordinator refused lease %s's revealed state: %s", lease_id, error)
            return False
        except TransportError as error:
            if wait is None or now() + delay > give_up or aborted():
                logger.warning("revealing lease %s's start state failed: %s", lease_id, error)
                return False
            logger.warning("revealing lease %s's start state failed (%s); sending it again in %.1fs", lease_id, error, delay)
            await wait(delay)
            delay = min(2 * delay, 10.0)
    if not reply.accepted:
        logger.warning("the coordinator refused lease %s's revealed state: %s", lease_id, reply.reason)
    return bool(reply.accepted)
