"""Chained reveals (docs/threat-model.md, "Commitments"): start states of checked leases the coordinator already has.

With ``runtime.verify.inner_state: carry`` a drawn lease is re-run from its start inner state, which its peer reveals
(with error feedback 3 × θ's fp32 bytes: AdamW's two moments and the residual) — by far the largest thing a verified
peer uploads. Two start states need no reveal:

* a **fresh** one (the commitment :data:`~asyncloco.train.commitments.FRESH_STATE_DIGEST`: a peer's first lease, one
  after a reset): it is empty;
* the **end state of the peer's previous lease, when that lease was checked too**. A passed check of the verifier's own
  compute class re-runs the lease bitwise to the end state the peer committed to (coordinator/rerun.py
  ``Rerunner.check_revealed``), so the coordinator holds those exact bytes; the next lease commits to starting from
  them (the commitment chain, logic/submit.py), and its digest is checked again when it is re-run. With
  ``runtime.verify.fraction`` 0.45 the previous lease was checked for 45 % of the drawn ones, and for every probation
  lease after the first.

A check of the next lease may arrive before the previous one's re-run has finished (a peer trains its next lease
while the last one's check runs): it waits for that verdict here. A passed verdict hands it its start state; a failed
one expels the peer (the wait is moot); one that ends without a verdict ends the waiting check without one too.

Where the coordinator re-runs a check itself for a peer of its compute class (coordinator/verify.py
``DaemonVerification.needs_end``), the end state kept is the re-run's and such a check asks for nothing. Otherwise —
a peer of another class, or validators (who may be of another class) — the peer reveals its end state with every
check; a passed one's revealed end is kept, and the peer's next check asks for the end alone (the Ack's
``reveal_start: false``): the coordinator puts the kept start in front of it. The end states kept are bounded by
``runtime.verify.keep_states_mb`` (one per peer, the least recently used dropped first) and live where
``runtime.verify.keep_states_on`` says (:class:`StateStore`): in files under the checkpoint directory (``disk``, the
default: at 150m a state is 1.8 GB, and the page cache holds what memory allows) or in the process's memory.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    from asyncloco.coordinator.logic import Verify
    from asyncloco.train.commitments import Buffer

__all__ = ["ChainedStates", "StateStore"]

logger = logging.getLogger(__name__)

_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class StateStore:
    """Where kept end states live, by lease id. ``directory`` None: in memory (:meth:`put` returns the buffer it is
    given, which is the caller's own copy). Else one file per state under ``directory``, mapped read-only
    (``np.memmap``): what the process holds is page cache the kernel may write back and drop. :meth:`put` is called by
    the verifier's worker thread (the write releases the GIL), :meth:`drop` on the event loop; the directory is emptied
    when the store opens and when it closes (kept states do not outlive the coordinator process: after a restart each
    peer's next check asks for its reveal)."""

    def __init__(self, directory: Optional[Path]) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._files: dict[str, Path] = {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.clear()

    def put(self, key: str, data: "Buffer") -> "Optional[Buffer]":
        """``data`` kept under ``key`` (a lease id): a read-only view of its file, or ``data`` itself in memory; None
        when the file cannot be written (a full disk: logged, and the state is not kept — the check it came from stands)."""
        if self.directory is None or not len(data):
            return data
        if not _KEY.match(key):
            raise ValueError(f"a kept state's key must be a lease id ([A-Za-z0-9_-], at most 64), got {key[:80]!r}")
        path = self.directory / f"{key}.state"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            logger.warning("could not keep the end state of lease %s under %s (%s): its peer's next check asks for a "
                           "reveal; free disk space or set runtime.verify.keep_states_on: memory", key, self.directory, error)
            return None
        with self._lock:
            self._files[key] = path
        return np.memmap(path, dtype=np.uint8, mode="r").data.cast("B")

    def drop(self, key: str) -> None:
        """Forget ``key``'s file (a view handed out stays readable until it is released: the mapping outlives the name)."""
        with self._lock:
            path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove every kept state's file (at open: those of an earlier process; at close)."""
        with self._lock:
            self._files.clear()
        if self.directory is not None and self.directory.is_dir():
            for path in self.directory.iterdir():
                if path.suffix in (".state", ".tmp"):
                    path.unlink(missing_ok=True)

    def files(self) -> int:
        with self._lock:
            return len(self._files)


@dataclass(frozen=True)
class _Kept:
    lease_id: str  # the lease whose end it is (the store's key)
    digest: str  # the committed end state (the lease's ``state_end``)
    state: "Buffer"  # in a reveal part's layout (train/commitments.py pack_reveal; the inner layout alone without feedback)


class ChainedStates:
    """The end states of checked leases (one per peer, within ``budget`` bytes) and the checks waiting for one."""

    def __init__(self, budget: int, store: Optional[StateStore] = None) -> None:
        self.budget = budget
        self.store = store if store is not None else StateStore(None)
        self.kept: "OrderedDict[str, _Kept]" = OrderedDict()  # peer -> end state of its last passed check
        self.bytes = 0
        # peer -> (lease id, committed end) of its newest check in progress, whose verdict will leave its end state
        self.expected: dict[str, tuple[str, str]] = {}
        self.waiting: dict[str, "Verify"] = {}  # lease id of a check in progress -> the next lease's check waiting on it
        # fresh: started fresh, nothing to reveal; kept: re-run from a kept end state; waited: from one kept later;
        # moot: a waiting check whose peer was expelled; evicted: kept states dropped for the budget
        self.counts = {"fresh": 0, "kept": 0, "waited": 0, "moot": 0, "evicted": 0}

    def start(self, check: "Verify", full: bool = False) -> tuple[str, Optional["Buffer"]]:
        """Where ``check``'s start state comes from without its peer revealing it: ("fresh" | "kept", the start part — a
        reveal part's layout, b"" fresh), ("wait", None) when it waits for the verdict of the check in progress of the
        peer's previous lease (:meth:`finished` hands it over), or ("", None): its peer must reveal it. ``full``: a check
        whose end its peer reveals anyway (another compute class, or validators) — a fresh start is then revealed with
        it, empty. Every check is noted as :meth:`expected` too."""
        from asyncloco.train.commitments import FRESH_STATE_DIGEST

        how = ""
        start: Optional[Buffer] = None
        if check.state_start == FRESH_STATE_DIGEST:
            if not full:
                how, start = "fresh", b""
        elif self.budget > 0:
            kept = self.kept.get(check.peer)
            expected = self.expected.get(check.peer)
            if kept is not None and kept.digest == check.state_start:
                how, start = "kept", kept.state
                self.kept.move_to_end(check.peer)
            elif expected is not None and expected[1] == check.state_start and expected[0] not in self.waiting:
                how = "wait"
                self.waiting[expected[0]] = check
        if how:
            self.counts["waited" if how == "wait" else how] += 1
        self.expect(check)
        return how, start

    def expect(self, check: "Verify") -> None:
        """``check`` is in progress: its verdict (:meth:`finished`) may leave its end state for the peer's next lease."""
        if self.budget > 0 and check.state_end:
            self.expected[check.peer] = (check.lease.lease_id, check.state_end)

    def finished(self, check: "Verify", end_state: Optional["Buffer"]) -> Optional[tuple["Verify", Optional["Buffer"]]]:
        """``check`` ended: ``end_state`` its end state when it passed with one (Comparison.end_state, put in the
        :attr:`store` under the lease's id), else None. Keeps it (or drops it from the store), and returns the check
        waiting on this one with its start part (None: it cannot have one), or None."""
        peer, lease_id = check.peer, check.lease.lease_id
        if self.expected.get(peer, ("",))[0] == lease_id:
            del self.expected[peer]
        if end_state is not None and check.state_end:
            self._keep(peer, _Kept(lease_id, check.state_end, end_state))
        elif end_state is not None:
            self.store.drop(lease_id)
        elif check.lease.fresh and peer in self.kept:  # its peer's leases start fresh now: no lease starts from it
            self._drop_kept(peer)
        waiting = self.waiting.pop(lease_id, None)
        if waiting is None:
            return None
        if end_state is None or waiting.state_start != check.state_end:
            return waiting, None
        return waiting, end_state

    def forget(self, peer: str) -> list["Verify"]:
        """``peer`` was expelled: its kept state goes, and the checks of its waiting on another (moot now) are returned."""
        self._drop_kept(peer)
        self.expected.pop(peer, None)
        moot = [lease_id for lease_id, check in self.waiting.items() if check.peer == peer]
        self.counts["moot"] += len(moot)
        return [self.waiting.pop(lease_id) for lease_id in moot]

    def _drop_kept(self, peer: str) -> None:
        old = self.kept.pop(peer, None)
        if old is not None:
            self.bytes -= len(old.state)
            self.store.drop(old.lease_id)

    def _keep(self, peer: str, kept: _Kept) -> None:
        self._drop_kept(peer)
        if len(kept.state) > self.budget:
            self.store.drop(kept.lease_id)
            return
        self.kept[peer] = kept
        self.bytes += len(kept.state)
        while self.bytes > self.budget:
            _, evicted = self.kept.popitem(last=False)
            self.bytes -= len(evicted.state)
            self.store.drop(evicted.lease_id)
            self.counts["evicted"] += 1

    def status(self) -> dict[str, Any]:
        return {**self.counts, "states": len(self.kept), "bytes": self.bytes, "waiting": len(self.waiting),
                "on": "memory" if self.store.directory is None else "disk"}
