"""What a repair applies in place of an expelled peer's updates (docs/threat-model.md, "The remedy: honest
re-runs in place of the expelled peer's updates"): :class:`Substitutes`, the coordinator's own honest run of each of
that peer's leases, from the θ the repair's replay holds at the lease's base version, with the inner state carried
from one of its leases to the next as an honest peer carries it (``runtime.verify.repair: rerun``).

Why not just leave its updates out (``repair: discard``): the honest updates that followed were trained from θs that
held the expelled peer's work, and replayed without it they no longer fit the θ they land on — measured, a repair
that left out 85 updates of a peer hiding 0.5 % of its norm took the perplexity from 173 to 1.1 × 10⁶, while
replaying the same log with honest re-runs in their place gave 173.2 (``scripts/repair_quality.py``). A re-run holds
none of what the peer sent, only the work its lease asked for.

The re-runs are stored under ``<checkpoint_dir>/verify-substitutes/<anchor seq>/`` (the encoded update, as a peer
would upload it, under a key of everything it depends on), so that the daemon's replay under its lock after the
re-runs trained outside it, or a ``--resume`` that re-derives the same repair, reads them back instead of training
again; the directory goes when its anchor is rotated away (coordinator/repair.py ``Anchors``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Mapping, Optional

import torch

from asyncloco.durable import write_durably
from asyncloco.coordinator.logic import CoordinatorState, Lease, SubmitUpdate
from asyncloco.coordinator.repair import SUBSTITUTE_DIR, Anchors, log_events, repair
from asyncloco.coordinator.rerun import Rerunner
from asyncloco.transport.codec_format import EncodedTensor

if TYPE_CHECKING:
    from asyncloco.config import RunConfig
    from asyncloco.models.workload import Workload

__all__ = ["RepairReruns", "Substitutes", "substitute_dir"]

logger = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def substitute_dir(checkpoint_dir: Path, anchor_seq: int) -> Path:
    """Where the re-runs of a repair replaying from the anchor at log record ``anchor_seq`` are kept."""
    return checkpoint_dir / SUBSTITUTE_DIR / f"{anchor_seq:020d}"


class Substitutes:
    """The repair's ``substitute`` (coordinator/repair.py :func:`~asyncloco.coordinator.repair.repair`): called with an
    expelled peer's submission, its lease and θ at the lease's base version in the replay; returns the honest re-run's
    update (as the coordinator decodes it), or None when it cannot be had (the submission is then left out).

    One instance per replay. The inner state (and the error-feedback residual) is carried per peer from one re-run to
    the next, starting fresh at the first of its leases the replay meets and at each lease granted with a fresh start
    (``carry`` False: fresh for every lease, the ``inner_state: reset`` mode), so a re-run is a function of the lease, its base θ and the peer's earlier re-runs in
    this replay — named by a key chained over exactly those (:meth:`key`). A stored re-run under the same key is read
    back instead of trained again (the same bits: it is the same computation); the carried state after the newest
    re-run of each peer is stored too, so that a replay that meets a lease not yet re-run after stored ones continues
    from the right state."""

    def __init__(self, rerunner: Rerunner, directory: Path, numel: int, carry: bool = True) -> None:
        self.rerunner = rerunner
        self.directory = directory
        self.numel = numel
        self.carry = carry
        # peer -> (chain key after its newest re-run in this replay, the state and residual then: None if not at hand)
        self._chain: dict[str, tuple[str, Optional[tuple[bytes, Optional[torch.Tensor]]]]] = {}
        self.computed = 0
        self.loaded = 0
        self.steps = 0  # inner steps trained for substitutes (a repair's cost)

    def key(self, peer: str, lease: Lease, base: torch.Tensor) -> str:
        """What the re-run of ``lease`` depends on: the peer's key before it (its earlier re-runs in this replay; a
        fresh start without ``carry``), the lease's work and its base θ."""
        before = self._chain[peer][0] if self._continues(peer, lease) else "fresh"
        hasher = hashlib.sha256(f"asyncloco substitute v1:{before}:{lease.lease_id}:{lease.shard}:{lease.start_offset}:"
                                f"{lease.steps}:{lease.lr_offset}:".encode())
        hasher.update(base.detach().cpu().contiguous().numpy().tobytes())
        return hasher.hexdigest()[:48]

    def _continues(self, peer: str, lease: Lease) -> bool:
        """Does ``lease``'s re-run start from the peer's previous one's state? Not without ``carry``, not at the first of
        its leases the replay meets, not for a lease granted with a fresh start (``Lease.fresh``: its peer started it
        from a fresh inner state and no residual)."""
        return self.carry and not lease.fresh and peer in self._chain

    def __call__(self, event: SubmitUpdate, lease: Lease, base: torch.Tensor) -> Optional[torch.Tensor]:
        peer = event.peer
        if not _SAFE_ID.fullmatch(peer):
            return None
        key = self.key(peer, lease, base)
        stored = self._load(self.directory / f"{key}.pt")
        if stored is not None:
            self.loaded += 1
            self._chain[peer] = (key, self._stored_state(peer, key))
            return stored
        start: tuple[bytes, Optional[torch.Tensor]] = (b"", None)
        if self._continues(peer, lease):
            before, carried = self._chain[peer]
            if carried is None:
                carried = self._stored_state(peer, before)
            if carried is None:  # a stored re-run without the state after it (a crash between the two writes)
                logger.warning("the inner state after %s's stored re-run %s is gone: its lease %s is left out", peer[-8:],
                               before[:12], lease.lease_id)
                return None
            start = carried
        update, end, left, encoded = self.rerunner.rerun_carried(lease, base, *start)
        self.computed += 1
        self.steps += lease.steps
        self._save(self.directory / f"{key}.pt", update, encoded)
        if self.carry:
            self._save_state(peer, key, end, left)
        self._chain[peer] = (key, (end, left))
        return update

    def _stored_state(self, peer: str, key: str) -> Optional[tuple[bytes, Optional[torch.Tensor]]]:
        """The carried state stored after ``peer``'s re-run ``key`` (None: not the one stored)."""
        if not self.carry:
            return (b"", None)
        path = self.directory / f"{peer}.state.pt"
        try:
            saved = torch.load(path, weights_only=True) if path.is_file() else None
        except Exception:  # noqa: BLE001 — a torn file: as if absent
            saved = None
        if saved is None or saved.get("after") != key:
            return None
        return bytes(saved["state"].numpy().tobytes()), saved.get("residual")

    # --- storage

    def _load(self, path: Path) -> Optional[torch.Tensor]:
        from asyncloco.transport.codecs import EncodedTensor, decode

        if not path.is_file():
            return None
        try:
            saved = torch.load(path, weights_only=True)
            if saved["codec"] == "none":
                update = saved["update"]
            else:
                body = bytes(saved["update"].numpy().tobytes())
                update = decode(EncodedTensor.from_bytes(saved["codec"], self.numel, body), self.numel)
        except Exception as error:  # noqa: BLE001 — a torn or foreign file is trained again
            logger.warning("stored re-run %s unreadable (%r): trained again", path, error)
            return None
        if not isinstance(update, torch.Tensor) or update.numel() != self.numel or update.dtype != torch.float32:
            logger.warning("stored re-run %s does not fit this model: trained again", path)
            return None
        return update

    def _save(self, path: Path, update: torch.Tensor, encoded: Optional[EncodedTensor]) -> None:
        if encoded is None:
            _write(path, {"codec": "none", "update": update.contiguous()})
        else:
            _write(path, {"codec": encoded.codec, "update": _bytes_tensor(encoded.to_bytes())})

    def _save_state(self, peer: str, key: str, state: bytes, residual: Optional[torch.Tensor]) -> None:
        payload: dict[str, object] = {"after": key, "state": _bytes_tensor(state)}
        if residual is not None:
            payload["residual"] = residual.contiguous()
        _write(self.directory / f"{peer}.state.pt", payload)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class RepairReruns:
    """The daemon's side (coordinator/verify.py): one model replica for the repairs' re-runs (the verification worker
    trains beside it), :meth:`prepare` to train them outside the daemon's lock, :meth:`substitutes` for the repair."""

    def __init__(self, cfg: "RunConfig", workload: "Workload", checkpoint_dir: Path, anchors: Anchors,
                 fresh_state: Callable[[], CoordinatorState], event_types: Mapping[str, type]) -> None:
        self.cfg = cfg
        self.workload = workload
        self.checkpoint_dir = checkpoint_dir
        self.anchors = anchors
        self.fresh_state = fresh_state
        self.event_types = event_types
        self.lock = threading.Lock()  # one replay trains at a time (one replica)
        self._rerunner: Optional[Rerunner] = None

    def substitutes(self, anchor: int) -> Substitutes:
        """The re-runs of a repair replaying from the anchor at log record ``anchor`` (stored with it)."""
        if self._rerunner is None:
            self._rerunner = Rerunner(self.cfg, self.workload, device=self.cfg.runtime.eval_device)
        return Substitutes(self._rerunner, substitute_dir(self.checkpoint_dir, anchor), self._rerunner.trainer.numel,
                           carry=self.cfg.runtime.verify.inner_state == "carry")

    def prepare(self, anchor: int, upto: int, excluded: Collection[str]) -> None:
        """In a worker thread, after an expulsion and before its repair: replay the log from ``anchor`` up to record
        ``upto`` as the repair will (``excluded``'s submissions re-run), storing each re-run. Best effort — what
        fails here is trained during the repair itself, under the daemon's lock."""
        from asyncloco.coordinator.checkpoint import load_snapshot, snapshot_wal_seq

        started = time.perf_counter()
        try:
            with self.lock:
                substitutes = self.substitutes(anchor)
                snapshot = load_snapshot(self.anchors.path(anchor))
                state = self.fresh_state()
                state.load_state_dict(snapshot["coordinator"])
                records = log_events(self.checkpoint_dir / "wal", snapshot_wal_seq(snapshot), upto, self.event_types,
                                     state.params.numel())
                repair(state, records, excluded, 0, substitute=substitutes)
        except Exception as error:  # noqa: BLE001 — e.g. a log segment rotated away mid-read
            logger.warning("re-running the expelled peers' leases ahead of the repair failed (%r); the repair trains "
                           "them", error)
            return
        logger.info("re-ran %d leases of expelled peers ahead of the repair (%d stored already) in %.1f s",
                    substitutes.computed, substitutes.loaded, time.perf_counter() - started)


def _write(path: Path, payload: Mapping[str, object]) -> None:
    """Durably: a --resume that re-derives the repair must find the same bits."""
    write_durably(path, lambda handle: torch.save(payload, handle))
