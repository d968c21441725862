"""The peer's side of the inner-state commitments (docs/threat-model.md, "Commitments").

With ``runtime.verify.enabled`` and ``inner_state: carry`` a peer commits, in each submission, to the digests of its
inner AdamW state at the lease's start and end (train/commitments.py ``inner_state_digest``). When the coordinator picks
that lease for verification — after the submission, by an HMAC the peer cannot compute — its :class:`~asyncloco.
transport.wire.Ack` asks for ``reveal``: the peer sends the lease's start *and* end states with the ``reveal`` RPC
(:func:`pack_parts`: the start part's length as uint64 LE, the start part, the end part; each part in the canonical
layout of ``inner_state_chunks`` — raw little-endian floats, never pickled — with error feedback followed by the
residual, :func:`pack_reveal`), and the coordinator re-runs the lease from the start state and compares its own end
state with the revealed one (coordinator/rerun.py ``Rerunner.check_revealed``): bitwise via the digest for a peer of
the verifier's compute class, within ``runtime.verify.cross_device_state_tolerance`` for another class.
A lease that started fresh is revealed too (its start part is empty): its end state is what is checked. A lease
that is not revealed before ``runtime.verify.reveal_timeout`` counts as a failed check.

:class:`RevealStore` keeps the start and the end states of the peer's last ``runtime.verify.reveal_keep`` leases
(default 2: the lease being trained and the one being submitted). Memory: a full state is ``S = Σ (9 + 8 n)`` bytes
over the parameter tensors of n elements (with feedback plus ``8 + 4 N`` for the residual, N parameters): two fp32
moments per weight (20m: ≈ 0.16 GB). The store holds at most ``2 × reveal_keep × S``; in the steady state (each
lease applied, the next starting from its end) a lease's start is the previous lease's end and is kept once, so
``(reveal_keep + 1) × S`` (20m, default: ≈ 0.48 GB, of which 0.16 GB is the end states this module adds). A reveal
sends ``8 + 2 S`` bytes (one part empty for a fresh start).

Cost per lease: the end state is laid out once, straight from the optimizer's tensors into one buffer, and hashed from
it; the next lease's start — unchanged since, unless the peer reset it — is that same buffer and digest, recognised
without reading the state (each state tensor by identity and its in-place version counter: the step tensor's moves
with every step in each of AdamW's implementations — fused leaves the moments' counters alone; a reset or a load
replaces the tensors). So a lease costs one copy of its end state and one sha256 of it, both off the GIL (train/commitments.py
``inner_state_buffer``), instead of hashing the start twice and copying each state through bytes chunks. Only the copy
is on the training's path (the optimizer moves on after it): the sha256 runs in a hashing thread while the next lease
trains, and the submission that carries the digests awaits it (:func:`settled`); with error feedback the start's
commitment, which covers the residual as it is then, is taken at once.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import numpy as np
import torch

from asyncloco.train.commitments import (
    FRESH_STATE_DIGEST, Buffer, committed_digest, inner_state_buffer, inner_state_digest, pack_reveal,
    revealed_digest,
)

__all__ = ["RevealStore", "send_reveal", "settled"]

logger = logging.getLogger(__name__)


async def settled(digest: "Optional[str | Future[str]]") -> Optional[str]:
    """The digest, once its hashing is done (awaited without blocking the event loop)."""
    if isinstance(digest, Future):
        return await asyncio.wrap_future(digest)
    return digest


_HASHER: Optional[ThreadPoolExecutor] = None  # one thread for the process: digests in the order their layouts were made


def _hasher() -> ThreadPoolExecutor:
    global _HASHER
    if _HASHER is None:
        _HASHER = ThreadPoolExecutor(1, thread_name_prefix="asyncloco-commit")
    return _HASHER


def _done(value: str) -> "Future[str]":
    future: "Future[str]" = Future()
    future.set_result(value)
    return future


# per parameter: None without state, else (key, the value when a tensor, its version counter or the value itself)
Marks = list[Optional[tuple[tuple[str, Optional[torch.Tensor], Any], ...]]]


def state_marks(optimizer: Any) -> Marks:
    """What identifies ``optimizer``'s state without reading it: each tensor by identity (the marks hold it, so its id
    cannot be reused) and its in-place version counter, anything else (a float step count) by value."""
    marks: Marks = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            marks.append(None if not state else tuple(
                (key, value, value._version) if isinstance(value, torch.Tensor) else (key, None, value)
                for key, value in sorted(state.items())))
    return marks


def same_marks(old: Marks, new: Marks) -> bool:
    """Is the state :func:`state_marks` saw as ``old`` still the one it sees as ``new`` (no step, reset or load since)?"""
    if len(old) != len(new):
        return False
    for before, now in zip(old, new):
        if before is None or now is None:
            if before is not now:
                return False
            continue
        if len(before) != len(now):
            return False
        for (key, tensor, mark), (key_now, tensor_now, mark_now) in zip(before, now):
            if key != key_now or tensor is not tensor_now or mark != mark_now:
                return False
    return True


@dataclass
class _LastEnd:
    marks: Marks
    inner: Buffer  # the end state's canonical layout (train/commitments.py inner_state_buffer)
    digest: "Future[str]"


class RevealStore:
    """Start and end states of the peer's most recent leases, by lease id, at most ``keep`` of each (oldest dropped
    first). ``ends`` (the default): the end states are kept too and a fresh start is kept as b"", so that
    :meth:`reveal` has both parts of every kept lease; ``ends=False``: start states only, as in older runs."""

    def __init__(self, keep: int = 2, ends: bool = True) -> None:
        if keep < 1:
            raise ValueError(f"RevealStore keeps at least one lease's state, got keep={keep}; set runtime.verify.reveal_keep >= 1")
        self.keep = keep
        self.ends = ends
        self._states: "OrderedDict[str, Buffer]" = OrderedDict()
        self._ends: "OrderedDict[str, Buffer]" = OrderedDict()
        self._last: Optional[_LastEnd] = None  # the last end state held, to be the next start if nothing changed it
        self._spare: Optional[np.ndarray] = None  # a dropped state's buffer, written into by the next layout
        self.laid_out = 0  # states laid out and hashed (a start recognised as the last end is not)
        self.recycled = 0  # of those, laid out into a dropped state's buffer
        self._hashing: list["Future[str]"] = []  # digests still being computed (a buffer is not reused under one)

    def _put(self, kept: "OrderedDict[str, Buffer]", lease_id: str, state: Buffer, keep: int) -> None:
        kept[lease_id] = state
        kept.move_to_end(lease_id)
        while len(kept) > keep:
            _, dropped = kept.popitem(last=False)
            self._recycle(dropped)

    def _recycle(self, dropped: Buffer) -> None:
        """Keep a dropped layout's buffer for the next one, unless the store still holds it (a start that is an end).
        Only with ``ends``, where :meth:`reveal` sends a copy (:func:`pack_parts`): without, it sends the kept state
        itself, which may still be on its way when the next lease's layout would overwrite it."""
        if not self.ends or not isinstance(dropped, memoryview) or not isinstance(dropped.obj, np.ndarray):
            return
        held = list(self._states.values()) + list(self._ends.values()) + ([self._last.inner] if self._last else [])
        if any(state is dropped for state in held):
            return
        self._spare = dropped.obj

    def _hash(self, inner: Buffer) -> "Future[str]":
        """sha256 of ``inner`` in the store's hashing thread (sha256 releases the GIL: training goes on meanwhile)."""
        self._hashing = [future for future in self._hashing if not future.done()]
        future = _hasher().submit(revealed_digest, inner)
        self._hashing.append(future)
        return future

    def _layout(self, optimizer: Any) -> Optional[tuple[Buffer, "Future[str]"]]:
        """``optimizer``'s state in its canonical layout and its inner digest, being hashed (None: it cannot be committed
        to)."""
        last = self._last
        if last is not None and same_marks(last.marks, state_marks(optimizer)):
            return last.inner, last.digest
        self._last = None  # changed since (a reset): let its tensors go
        spare = self._spare
        if spare is not None:
            for future in self._hashing:  # a buffer dropped while its digest was still being computed
                future.result()
        inner = inner_state_buffer(optimizer, spare)
        if inner is not None and spare is not None and inner.obj is spare:
            self._spare = None
            self.recycled += 1
        if inner is None:
            return None
        self.laid_out += 1
        return inner, (self._hash(inner) if len(inner) else _done(revealed_digest(inner)))

    def hold(self, lease_id: str, optimizer: Any, residual: Optional[torch.Tensor] = None, feedback: bool = False
             ) -> Optional[str]:
        """Keep ``optimizer``'s state (and, with error feedback on, the residual) as lease ``lease_id`` starts from
        it — without ``ends``, nothing for a fresh state without a residual (with ``ends``: b""); returns its inner
        digest (train/commitments.py ``inner_state_digest``; None when it cannot be committed to)."""
        digest = self.hold_deferred(lease_id, optimizer, residual, feedback)
        return None if digest is None else digest.result()

    def hold_deferred(self, lease_id: str, optimizer: Any, residual: Optional[torch.Tensor] = None, feedback: bool = False
                      ) -> "Optional[Future[str]]":
        """:meth:`hold`, its digest still being computed (:func:`settled` awaits it): the lease need not wait for it."""
        laid = self._layout(optimizer)
        if laid is None:
            return None
        inner, digest = laid
        if not inner and residual is None and not self.ends:
            return digest
        state: Buffer = b"" if not inner and residual is None else (pack_reveal(inner, residual) if feedback else inner)
        if feedback:
            for end in self._ends.values():  # the previous lease's end, where this one starts: kept once
                if end == state:
                    state = end
                    break
        self._put(self._states, lease_id, state, self.keep)
        return digest

    def hold_end(self, lease_id: str, optimizer: Any) -> Optional[str]:
        """Keep ``optimizer``'s state as lease ``lease_id`` ends (with ``ends``); returns its inner digest (train/inner.py
        ``inner_state_digest``, None when it cannot be committed to). With error feedback call :meth:`end_residual`
        once the upload's residual is known."""
        digest = self.hold_end_deferred(lease_id, optimizer)
        return None if digest is None else digest.result()

    def hold_end_deferred(self, lease_id: str, optimizer: Any) -> "Optional[Future[str]]":
        """:meth:`hold_end` with the digest still being computed: the state is laid out before this returns (the
        optimizer may move on), the sha256 runs in the store's hashing thread while the next lease trains."""
        if not self.ends:
            whole = inner_state_digest(optimizer)
            return None if whole is None else _done(whole)
        self._last = None
        laid = self._layout(optimizer)
        if laid is None:
            return None
        end, digest = laid
        self._put(self._ends, lease_id, end, self.keep)
        self._last = _LastEnd(state_marks(optimizer), end, digest)
        return digest  # the digest of the same bytes (FRESH_STATE_DIGEST for an empty state)

    def end_residual(self, lease_id: str, inner_digest: str, residual: Optional[torch.Tensor]) -> str:
        """Error feedback: the end state of ``lease_id`` gets the residual its upload leaves (:func:`pack_reveal`);
        returns the end's commitment (:func:`committed_digest`)."""
        inner = self._ends.get(lease_id)
        if inner is not None:
            self._ends[lease_id] = pack_reveal(inner, residual)
        return committed_digest(inner_digest, residual)

    def get(self, lease_id: str) -> Optional[Buffer]:
        """The start state of ``lease_id`` (None when it is not kept: dropped, or without ``ends`` a fresh start)."""
        return self._states.get(lease_id)

    def get_end(self, lease_id: str) -> Optional[Buffer]:
        return self._ends.get(lease_id)

    def reveal(self, lease_id: str, end: bool = True, start: bool = True) -> Optional[Buffer]:
        """What the ``reveal`` RPC sends for ``lease_id``: with ``ends`` both parts (:func:`pack_parts`; ``end`` false:
        an empty end part, as the coordinator's Ack ``reveal_end: false`` asks; ``start`` false: an empty start part, as
        ``reveal_start: false`` asks), else the start state; None when what it needs is no longer kept."""
        parts = self.reveal_parts(lease_id, end, start)
        return None if parts is None else (parts[0] if len(parts) == 1 else b"".join(parts))

    def reveal_parts(self, lease_id: str, end: bool = True, start: bool = True) -> Optional[list[Buffer]]:
        """:meth:`reveal` as the parts it joins (the start part's length, the start, the end), for sending one after
        another without the joined copy (which holds the GIL for its whole length, gigabytes at 150m)."""
        state = self._states.get(lease_id)
        if not self.ends:
            return None if state is None else [state]
        if not start and end:  # the coordinator has the start: the end alone, after an empty start part
            ending = self._ends.get(lease_id)
            return None if ending is None else [struct.pack("<Q", 0), ending]
        if state is None:
            return None
        if not end:
            return [struct.pack("<Q", len(state)), state]
        ending = self._ends.get(lease_id)
        return None if ending is None else [struct.pack("<Q", len(state)), state, ending]

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> int:
        """Bytes held (a start that is the previous lease's end counted once)."""
        unique = {id(state): len(state) for state in list(self._states.values()) + list(self._ends.values())}
        return sum(unique.values())


async def send_reveal(client: Any, lease_id: str, state: "Optional[Buffer | list[Buffer]]", digest: Optional[str], *,
                      retry_for: float = 0.0, wait: Optional[Callable[[float], Awaitable[None]]] = None,
                      now: Callable[[], float] = time.monotonic, aborted: Callable[[], bool] = lambda: False) -> bool:
    """Answer the coordinator's ``reveal`` request for ``lease_id`` with ``state`` (:meth:`RevealStore.reveal`); True
    when it took it. Without end states (``state`` None) a lease whose start was the fresh state needs no reveal; one
    whose state was dropped cannot be revealed (the check fails at the deadline: raise ``runtime.verify.reveal_keep``). An upload that fails on the
    way (a reset, a dropped stream) is sent again with backoff (``wait``) for ``retry_for`` seconds — an honest peer
    whose reveal is lost would fail its check at ``runtime.verify.reveal_timeout``; a refusal is an answer, and so is
    an error the coordinator's handler returns (a restarted coordinator awaits no reveal of an older check)."""
    from asyncloco.transport.errors import RemoteError, TransportError

    if state is None and digest == FRESH_STATE_DIGEST:
        return True
    if state is None:
        logger.error("the coordinator asked for lease %s's states, which this peer no longer keeps "
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
                logger.warning("revealing lease %s's states failed: %s", lease_id, error)
                return False
            logger.warning("revealing lease %s's states failed (%s); sending it again in %.1fs", lease_id, error, delay)
            await wait(delay)
            delay = min(2 * delay, 10.0)
    if not reply.accepted:
        logger.warning("the coordinator refused lease %s's revealed state: %s", lease_id, reply.reason)
    return bool(reply.accepted)
