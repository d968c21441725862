"""The exact remedy after a failed verification (docs/threat-model.md, "The remedy"): :func:`repair`
rebuilds the coordinator's state by replaying the write-ahead log from a repair anchor with the expelled peers'
submissions discarded, and :class:`Anchors` keeps the snapshots a repair may start from. The daemon's side, the
re-runs and the verdicts are in asyncloco/coordinator/verify.py (which re-exports these names).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator, Mapping, Optional

import torch

from asyncloco.coordinator.logic import (
    Action,
    CoordinatorState,
    DerivedIndexes,
    Discard,
    Event,
    Fetched,
    Lease,
    Repaired,
    SubmitUpdate,
    base_theta,
    checked_after,
    gate_proven,
    gate_verdict,
    handle,
    holds,
    refused_as_sent,
)
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.logic.events import ADOPTED_FIELDS

__all__ = ["ANCHOR_DIR", "KEEP_ANCHORS", "SUBSTITUTE_DIR", "Anchors", "RepairResult", "log_events", "repair", "repaired_event"]

logger = logging.getLogger(__name__)

ANCHOR_DIR = "verify-anchors"
SUBSTITUTE_DIR = "verify-substitutes"  # the honest re-runs a repair from an anchor applied (coordinator/substitute.py)
KEEP_ANCHORS = 3


# ------------------------------------------------------------------------------------------------ repair


@dataclass
class RepairResult:
    state: CoordinatorState
    voided: list[Action]  # what the repair itself did after the replay: leases given back, held requests released
    discarded: int  # submissions of expelled peers replayed as Discard
    replayed: int  # events replayed
    repaired: Repaired  # what the repair decided beyond the replay: the daemon logs it after the Verified record
    substituted: int = 0  # submissions of expelled peers replayed as an honest re-run of their lease
    refused: int = 0  # submissions of expelled peers refused as sent, as the live run refused them
    held: int = 0  # submissions of expelled peers held for their check, as live: applied where it agreed, else dropped


# (submission, its lease, θ at the lease's base version in the replay) -> the update applied in its place, or None
Substitute = Callable[[SubmitUpdate, Lease, torch.Tensor], Optional[torch.Tensor]]


def _note_bases(state: CoordinatorState, excluded: Collection[str], bases: dict[str, torch.Tensor]) -> None:
    """Keep θ at the base version of every active lease of an excluded peer, from when the replay issues it (the
    current θ changes in place; a retained base θ is not kept for every lease)."""
    for lease_id in [lease_id for lease_id in bases if lease_id not in state.leases]:
        del bases[lease_id]
    for lease in state.leases.values():
        if lease.peer in excluded and lease.lease_id not in bases:
            theta = base_theta(state, lease.base_version)
            if theta is not None:
                bases[lease.lease_id] = theta.clone()


def _replay_excluded(
    state: CoordinatorState, event: SubmitUpdate, bases: Mapping[str, torch.Tensor], substitute: Optional[Substitute],
    now: float,
) -> str:
    """Replay an expelled peer's submission; what was done: "refused", "held", "discarded" or "substituted".

    The replay makes every decision the live run made; only θ differs. The gate judges and records the submission as
    it was sent, as the live gate did, so its statistics stay the live ones and every later verdict is the live verdict
    too. Refused as sent (an invalid lease or update, or the gate's rejection): handled as it is — refused, its steps
    given back, θ untouched. Otherwise its lease is consumed as the live run consumed it and θ takes the honest re-run
    of the lease (``substitute``; scaled as the gate would clip it, refused where the gate would refuse it — judged
    without the probe, which was evaluated on the submitted update — and handled with the gate off, so that only the
    submission as sent is recorded), or nothing (a :class:`Discard`: ``repair: discard``, no re-run, or a re-run the
    gate would refuse).

    Why the live decisions: replaced by a re-run (or a Discard) where the live gate had refused the submission, the
    replay kept work the live run gave back, held a request the live run answered with that range and numbered
    every later lease one off the live run's — the honest peers' later submissions then named leases the repaired
    state did not hold. In an attack-benchmark run (the `tailored` attacker: 2 submissions applied, 3 refused by the
    gate with their leases) 11 honest updates were lost so: perplexity 261 live, 300 after the repair."""
    if refused_as_sent(state, event):
        handle(state, event, now)
        return "refused"
    if holds(state, event):
        # held for its check, as the live run held it: the log's verdict applies it (its re-run agreed: the update is
        # the honest one) or drops it, exactly as it did live
        handle(state, event, now)
        return "held"
    pending = checked_after(state, event)  # live: applied first, its check pending until its verdict
    gate = state.policy.gate
    lease = state.leases[event.lease_id]
    verdict = None if gate is None else gate_verdict(state, event, lease, gate)
    # (an update the staleness policy drops was never recorded by the live gate: logic/submit.py)
    dropped = any(transform.drops(state.version - lease.base_version) for transform in state.transforms)
    update = _substitute(state, event, bases, substitute)
    if update is not None and gate is not None:
        own = update_gate.score(gate, state.gate, update, lease.steps, event.peer, state.policy.norm_bound_per_step,
                                proven=gate_proven(state, lease), sketcher=state.own_sketcher())
        update = None if own.action == "reject" else update if own.scale == 1.0 else update * own.scale
    if update is None:
        handle(state, Discard(event.peer, event.lease_id, event.state_end), now)
        if pending:  # as live: the verifier's backlog decides whether later checked updates are held
            state.verification.pending[event.lease_id] = event.peer
    else:
        policy = state.policy
        state.policy = dataclasses.replace(policy, gate=None)
        try:
            handle(state, dataclasses.replace(event, pseudo_gradient=update, probe_before=None, probe_after=None), now)
        finally:
            state.policy = policy
    if verdict is not None and gate is not None and not dropped:
        update_gate.record(gate, state.gate, verdict, event.pseudo_gradient * verdict.scale, lease.steps, event.peer, now,
                           state.own_sketcher(), lease_id=lease.lease_id)  # as live: applied first, its check pending
    return "discarded" if update is None else "substituted"


def _substitute(state: CoordinatorState, event: SubmitUpdate, bases: Mapping[str, torch.Tensor],
                substitute: Optional[Substitute]) -> Optional[torch.Tensor]:
    """The update applied in place of an excluded peer's submission (None: it is discarded)."""
    if substitute is None:
        return None
    lease = state.leases.get(event.lease_id)
    base = bases.get(event.lease_id)
    if lease is None or lease.peer != event.peer or base is None:
        return None  # not a lease the replay holds for it (refused live too), or its base θ is gone
    return substitute(event, lease, base)


def repair(
    anchor: CoordinatorState,
    records: Iterable[tuple[Event, float]],
    expelled: Collection[str],
    live_version: int,
    live_leases: Optional[Mapping[str, Lease]] = None,
    live_lease_counter: int = 0,
    live_chain: Optional[Mapping[str, str]] = None,
    live_base: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
    substitute: Optional[Substitute] = None,
    live_eager: Optional[Mapping[str, torch.Tensor]] = None,
) -> RepairResult:
    """θ and the whole coordinator state as if the expelled peers' updates had never been applied.

    ``anchor`` (mutated and returned) is the state at some log record; ``records`` every later ``(event, now)`` up to
    and including the ``Verified`` event that expelled the last of ``expelled``. The replay makes every decision the live run
    made, only θ differs (:func:`_replay_excluded`): a submission of an expelled peer that was refused stays
    refused; one that was applied is replaced by ``substitute(submission, lease, θ at its base version in the
    replay)`` — the honest re-run of that lease (coordinator/substitute.py; ``repair: rerun``) — or, where that gives
    None (or without ``substitute``: ``repair: discard``), by a :class:`Discard` (its lease is consumed, θ untouched);
    every other submission is replayed with its base version renumbered to the replayed lease's. Verdicts in the
    records are replayed (counters, expulsions) but start no nested repair. Afterwards an active lease stays valid
    when it is one of ``live_leases`` (the live coordinator's, before the repair) with the same peer, its θ downloaded
    (the repair drops the retained base θs), of a peer not expelled, not chosen for verification, and the method needs
    no θ_base: it keeps the live base version (the one its peer's submission names) and its update is then applied
    to the repaired θ as a stale one. Every other active lease is given back (all of them without ``live_leases``).
    A live lease the replay never issued (its grace windows held that request) is adopted with its live work under
    the same conditions (not chosen for verification), where its shard range is still free (:func:`repaired_event`,
    logic/verification.py ``_adopt``). The version jumps to ``live_version + 1``, and the lease counter to at least ``live_lease_counter`` (the live
    coordinator's): the replay can issue fewer leases than the live run did (its holds and grace windows see other
    versions), and a lease id is the counter's HMAC, so a lower counter would hand out again ids of leases issued
    before the repair — an honest peer still holding a voided one would then submit a lease that "belongs to another
    peer", and its new owner's commitment chain would be judged against the wrong history (measured: an honest peer
    expelled in a 3-colluder benchmark run). With ``live_chain`` (the live coordinator's inner-state commitment
    chain) every peer not expelled keeps its live chain end: the chain records what a peer really trained from, which
    a replay cannot change — where the replay does not re-apply one of its updates (a lease the replay numbered
    differently after an earlier repair), the peer's next lease must still chain to the state it actually has.

    ``live_base(v)``: the live θ at version ``v`` (or None): with it, a lease chosen for verification is kept too, its
    live base θ retained for the re-run (without it such leases are given back), and with ``live_eager`` (the live
    ``verification.eager``) the update its eager start subtracted, kept for that re-run as the live run kept it. A later replay's ``Repaired`` has no
    θ to hand: there such a lease's check is counted unverifiable, which changes no θ.

    What the repair decides after its replay (kept leases, version, counter, chain) is a :class:`Repaired` event,
    handled here and returned for the daemon to log after the ``Verified`` record: a later repair whose replay
    crosses this point then repeats it there (a ``Repaired`` in ``records`` is handled like any event)."""
    state = anchor
    excluded = set(expelled)
    discarded = replayed = substituted = refused = held = 0
    last_now = 0.0
    bases: dict[str, torch.Tensor] = {}  # an excluded peer's active lease -> θ at its base version in the replay
    if substitute is not None:
        _note_bases(state, excluded, bases)  # leases the anchor holds already
    for event, now in records:
        replayed += 1
        last_now = now
        if isinstance(event, SubmitUpdate):
            lease = state.leases.get(event.lease_id)
            if lease is not None and lease.peer == event.peer and lease.base_version != event.base_version:
                event = dataclasses.replace(event, base_version=lease.base_version)
            if event.peer in excluded:
                kind = _replay_excluded(state, event, bases, substitute, now)
                discarded += kind == "discarded"
                substituted += kind == "substituted"
                refused += kind == "refused"
                held += kind == "held"
                if substitute is not None:
                    _note_bases(state, excluded, bases)
                continue
        elif isinstance(event, Fetched) and live_leases is not None:
            event = _renumbered_fetch(state, event, live_leases)
        handle(state, event, now)  # Verify and Expelled actions of the past start nothing here; a Repaired repeats
        # the give-backs and the version jump of an earlier repair at the point where the live run made them
        if substitute is not None:
            _note_bases(state, excluded, bases)
    repaired = repaired_event(state, excluded, live_version, live_leases, live_lease_counter, live_chain, live_base)
    _, voided = handle(state, repaired, last_now)
    if live_leases is not None and live_base is not None:
        _keep_checks(state, live_leases, live_base, live_eager or {})
    return RepairResult(state, voided, discarded, replayed, repaired, substituted, refused, held)


def _keep_checks(state: CoordinatorState, live_leases: Mapping[str, Lease],
                 live_base: Callable[[int], Optional[torch.Tensor]], live_eager: Mapping[str, torch.Tensor]) -> None:
    """A kept lease that the live coordinator chose for verification stays chosen (the live draw is the one that
    counts), and θ at its base version — the live one its peer trained from — is retained for the re-run, with the
    update its eager start subtracts where the live run kept it (that update is its peer's own, as submitted: a repair
    changes θ, not an update; without it the check would end unverified, rerun.start_theta)."""
    for lease in state.leases.values():
        live = live_leases[lease.lease_id]
        # the eager start its peer was granted, and whether the update it subtracts was accepted, as they were live
        lease.eager_of, lease.eager_share, lease.eager_ready = live.eager_of, live.eager_share, live.eager_ready
        if not (live.verify or lease.verify):
            continue
        lease.verify = live.verify or lease.verify
        base = live_base(lease.base_version)
        if base is not None and lease.base_version not in state.base_params:
            state.base_params[lease.base_version] = base
        kept = live_eager.get(lease.lease_id)
        if kept is not None and lease.eager_ready:
            state.verification.eager[lease.lease_id] = kept


def repaired_event(
    state: CoordinatorState,
    excluded: Collection[str],
    live_version: int,
    live_leases: Optional[Mapping[str, Lease]],
    live_lease_counter: int,
    live_chain: Optional[Mapping[str, str]],
    live_base: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
) -> Repaired:
    """What a repair decides after its replay of ``state`` (:func:`repair`'s docstring says why), as the event that
    carries it out through ``handle`` and that a later repair's replay meets in the log."""
    # Honest work in flight stays valid (repairs voided 5.7 % of honest leases, measured): its update is
    # applied to the repaired θ as a stale one, like any update trained from an older θ. A lease chosen for
    # verification is kept when the live θ at its base version (the one its peer trained from, which the re-run
    # needs) is at hand (``live_base``); given back otherwise, and all of them for methods that need θ_base at
    # submission. A kept lease keeps the base version its peer knows (its
    # submission names it): the replay numbers versions without the discarded updates, so a lease issued after one
    # of them has a lower replayed base version; its staleness is then counted from the version the peer really
    # trained from (the repair's version jump is above it).
    def keep(lease: Lease) -> bool:
        live = live_leases.get(lease.lease_id) if live_leases is not None else None
        # downloaded, or held by its peer at issue (a prefetch), as the live coordinator knew it (a replay numbers
        # versions differently, so a download it replays may not match the lease it served)
        if not (live is not None and live.peer == lease.peer and (lease.fetched or live.fetched or live.held)
                and lease.peer not in excluded and not state.needs_base_params):
            return False
        # the work its peer was given: the replay may issue the same lease id with other steps or data (DyLU and the
        # shard cursors saw no discarded update) — keeping that one would judge the peer's honest update against a
        # lease it never had (a false expulsion, seen in a suite run: 5 steps trained, 3 replayed); given back instead
        if (lease.shard, lease.start_offset, lease.steps, lease.lr_offset) != (live.shard, live.start_offset, live.steps, live.lr_offset):
            return False
        return not (lease.verify or live.verify) or (live_base is not None and live_base(live.base_version) is not None)

    kept = sorted(lease_id for lease_id, lease in state.leases.items() if keep(lease))
    assert live_leases is not None or not kept
    # Honest work in flight that the replay never issued: its grace windows see other versions without the discarded
    # updates and held those requests instead (an attack benchmark run: all 3 honest leases in flight at a repair,
    # downloaded and training, were lost so). Adopted as the live coordinator issued them when their peer has θ, is
    # not expelled, no θ_base is needed and no check is due; the logic claims their shard ranges (logic/verification.py).
    # The same goes for a live lease the replay issued with other work (its shard cursors saw other leases): the
    # replayed one is given back and the live one adopted.
    adopted = tuple(
        tuple(getattr(live, name) for name in ADOPTED_FIELDS)
        for lease_id, live in sorted((live_leases or {}).items())
        if lease_id not in kept and live.peer not in excluded and (live.fetched or live.held)
        and not live.verify and not state.needs_base_params
    )
    chain = dict(state.verification.chain) if live_chain is None else dict(live_chain)
    peers = sorted(peer for peer in chain if peer not in excluded)
    return Repaired(
        expelled=tuple(sorted(excluded)),
        version=max(state.version, live_version) + 1,
        lease_counter=max(state.lease_counter, live_lease_counter),
        kept=tuple(kept),
        kept_versions=tuple(live_leases[lease_id].base_version for lease_id in kept) if live_leases else (),
        chain_peers=tuple(peers),
        chain_digests=tuple(chain[peer] for peer in peers),
        adopted=adopted,
    )


def _renumbered_fetch(state: CoordinatorState, event: Fetched, live_leases: Mapping[str, Lease]) -> Fetched:
    """A download of θ(v) names the live numbering; in a replay without discarded updates a lease still active at the
    repair may have a lower base version. The event then names the replayed one, so that the lease counts as fetched
    (kept across the repair)."""
    for lease_id, live in live_leases.items():
        replayed = state.leases.get(lease_id)
        if (live.peer == event.peer and live.base_version == event.version and replayed is not None
                and replayed.base_version != event.version):
            return dataclasses.replace(event, version=replayed.base_version)
    return event


def log_events(
    wal_dir: Path,
    after_seq: int,
    upto_seq: int,
    event_types: Mapping[str, type],
    numel: int,
) -> Iterator[tuple[Event, float]]:
    """Events of log records ``after_seq < seq <= upto_seq``, from the archived and the live segments of
    ``wal_dir``, oldest first, submissions decoded as the daemon decodes them."""
    from asyncloco.coordinator.wal import ARCHIVE_DIR, decode_event, read_records
    from asyncloco.transport.codecs import EncodedTensor, decode

    def decode_blob(codec: str, count: int, data: memoryview) -> torch.Tensor:
        return decode(EncodedTensor.from_bytes(codec, count, data), numel)

    expected = after_seq + 1
    for directory in (wal_dir / ARCHIVE_DIR, wal_dir):
        if not directory.is_dir():
            continue
        for record in read_records(directory, expected - 1):
            if record.seq > upto_seq:
                return
            if record.seq != expected:
                raise ValueError(
                    f"the repair needs log record {expected} but {directory} continues at {record.seq}: the log "
                    "segments after the repair anchor are missing"
                )
            expected += 1
            if record.kind == "event":
                yield decode_event(record, event_types, decode_blob), record.now
    if expected <= upto_seq:
        raise ValueError(f"the repair needs log records {expected}..{upto_seq}, which are not in {wal_dir}")


class Anchors:
    """Snapshots a repair may start from, as hard links of ``state.pt`` under ``<checkpoint_dir>/verify-anchors/
    <wal seq>/state.pt``. :meth:`note_snapshot` (after a durable snapshot) takes one every ``horizon`` applied
    updates; the newest :data:`KEEP_ANCHORS` are kept and archived log segments older than the oldest are pruned
    (unless ``keep_archive``: ``runtime.wal_archive`` wants them all)."""

    def __init__(self, checkpoint_dir: Path, horizon: int, keep_archive: bool, keep: int = KEEP_ANCHORS) -> None:
        self.dir = checkpoint_dir / ANCHOR_DIR
        self.wal_dir = checkpoint_dir / "wal"
        self.horizon = horizon
        self.keep_archive = keep_archive
        self.keep = keep
        self._last_version: Optional[int] = None
        # held while a snapshot thread rotates anchors / prunes segments and while a repair reads them
        self.lock = threading.Lock()
        self._pinned: dict[int, int] = {}  # anchor seq -> verdicts being decided that name it (never rotated away)

    def pin_oldest(self) -> int:
        """The anchor a verdict names (the oldest), kept until :meth:`unpin` even if newer anchors arrive meanwhile."""
        with self.lock:
            seq = self.oldest()
            if seq >= 0:
                self._pinned[seq] = self._pinned.get(seq, 0) + 1
            return seq

    def pin(self, seq: int) -> None:
        """Keep the anchor ``seq`` (a repair about to start from it) until :meth:`unpin`."""
        with self.lock:
            if seq >= 0:
                self._pinned[seq] = self._pinned.get(seq, 0) + 1

    def unpin(self, seq: int) -> None:
        with self.lock:
            if seq in self._pinned:
                self._pinned[seq] -= 1
                if not self._pinned[seq]:
                    del self._pinned[seq]

    def seqs(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.dir.iterdir() if p.name.isdigit() and (p / "state.pt").is_file())

    def oldest(self) -> int:
        """The anchor a repair starts from now (-1: none yet)."""
        seqs = self.seqs()
        return seqs[0] if seqs else -1

    def path(self, seq: int) -> Path:
        return self.dir / f"{seq:020d}"

    def note_snapshot(self, snapshot: Path, wal_seq: int, version: int) -> bool:
        """Called in the snapshot thread once ``snapshot`` (covering log records up to ``wal_seq``) is durable."""
        with self.lock:
            return self._note(snapshot, wal_seq, version)

    def _note(self, snapshot: Path, wal_seq: int, version: int) -> bool:
        if self._last_version is None:
            seqs = self.seqs()
            self._last_version = -self.horizon if not seqs else version  # a resumed run anchored before
        if version - self._last_version < self.horizon and self.seqs():
            return False
        target = self.path(wal_seq)
        if (target / "state.pt").is_file():
            return False
        target.mkdir(parents=True, exist_ok=True)
        try:
            os.link(snapshot, target / "state.pt")  # state.pt is replaced by rename: this inode stays as it is
        except OSError:
            shutil.copyfile(snapshot, target / "state.pt")
        self._last_version = version
        for old in self.seqs()[: -self.keep]:
            if old not in self._pinned:
                shutil.rmtree(self.path(old), ignore_errors=True)
                shutil.rmtree(self.dir.parent / SUBSTITUTE_DIR / f"{old:020d}", ignore_errors=True)
        self._prune_archive()
        return True

    def _prune_archive(self) -> None:
        if self.keep_archive:
            return
        oldest = self.oldest()
        archive = self.wal_dir / "archive"
        if oldest < 0 or not archive.is_dir():
            return
        segments = sorted((int(p.name[:-4]), p) for p in archive.glob("*.wal") if p.name[:-4].isdigit())
        for index, (first, path) in enumerate(segments):
            following = segments[index + 1][0] if index + 1 < len(segments) else None
            if following is not None and following - 1 <= oldest:
                path.unlink(missing_ok=True)  # every record in it is covered by the oldest anchor
