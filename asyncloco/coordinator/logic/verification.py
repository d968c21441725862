"""Verification's verdicts and what follows from them: Verified (a check agreed: its held update is applied and the
peer's probation advances; it failed: the peer is expelled), Unverified (a check ended without a verdict), held
updates dropped that will never be applied, and Repaired (what a repair after an expulsion decided beyond its
replay). Which leases are checked is decided when they are issued (draws.py); coordinator/verify.py carries out the
re-runs, coordinator/repair.py the repair's replay."""

from __future__ import annotations

from typing import Any, Callable

from asyncloco.coordinator.gate import explain_weak
from asyncloco.coordinator.logic.draws import PROBATION_WAIT
from asyncloco.coordinator.logic.events import (
    ADOPTED_FIELDS, Action, Expelled, Rejected, Released, Repaired, Unverified, Verdict, Verified,
)
from asyncloco.coordinator.logic.leases import give_back, return_range
from asyncloco.coordinator.logic.state import CoordinatorState, DerivedIndexes, HeldUpdate, Lease, VerificationState
from asyncloco.coordinator.logic.submit import release_at_verdict
from asyncloco.refusals import RefusalCode


# ---------------------------------------------------------------------------- Verified, Unverified


def on_verified(state: CoordinatorState, event: Verified, now: float) -> list[Action]:
    """A check's verdict. Agreed: it counts toward the peer's probation and its held update is applied now. Failed:
    the peer is expelled — its held updates are never applied, its leases go back, and a repair is asked for only
    where θ holds updates of it that were applied without a check (``Expelled.repair``)."""
    book = state.verification
    book.pending.pop(event.lease_id, None)
    _judged(book, event.lease_id, event.peer)
    held = book.held.get(event.lease_id)
    if held is not None and held.lease.peer == event.peer:
        del book.held[event.lease_id]
    else:
        held = None  # none, or another peer's: left as it is
    book.checked += 1
    if event.peer in book.expelled:
        actions: list[Action] = [Verdict(event.peer, event.lease_id, event.ok, f"{event.detail} (peer already expelled)")]
        return actions + ([] if held is None else _drop_held(state, held, "its peer was expelled"))
    if event.ok:
        book.passed[event.peer] = book.passed.get(event.peer, 0) + 1
        # an applied-first update taken with weak agreement: honest work's, no longer a suspect's mark
        explained = "; its weak agreement explained" if explain_weak(state.gate, event.peer, event.lease_id) else ""
        verdict = Verdict(event.peer, event.lease_id, True, event.detail + explained)
        return [verdict] + release_at_verdict(state, held, event.peer, now)
    book.failed += 1
    reason = f"lease {event.lease_id} did not reproduce: {event.detail}"
    book.expelled[event.peer] = reason
    actions = [Verdict(event.peer, event.lease_id, False, event.detail)]
    if held is not None:
        actions += _drop_held(state, held, "its check failed")
    actions += _drop_peer_held(state, event.peer, "its peer was expelled")
    book.sketch.forget(event.peer)
    actions.append(Expelled(event.peer, event.lease_id, reason, event.anchor, repair=book.unchecked.get(event.peer, 0) > 0))
    info = state.peers.get(event.peer)
    if info is not None:
        info.alive = False
    state.held.pop(event.peer, None)
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == event.peer:
            actions += give_back(state, lease, "peer expelled")
    return actions


def on_unverified(state: CoordinatorState, event: Unverified, now: float) -> list[Action]:
    """A check ends without a verdict: counted unverifiable. A held update is not applied (no verdict, no application:
    a peer must not be able to skip its check by making it fail to run) — its range goes back to the shard; unless
    the coordinator's restart lost the check (``apply``), when it is applied as its peer was told."""
    book = state.verification
    held = book.held.get(event.lease_id)
    if held is not None and held.lease.peer != event.peer:
        held = None
    if book.pending.get(event.lease_id) != event.peer and held is None:
        return []  # judged meanwhile, or cleared by a repair
    book.pending.pop(event.lease_id, None)
    _judged(book, event.lease_id, event.peer)
    book.unverifiable += 1
    if held is None:
        return []
    del book.held[event.lease_id]
    if event.apply and event.peer not in book.expelled:
        return release_at_verdict(state, held, event.peer, now)
    actions = _drop_held(state, held, f"its check ended without a verdict ({event.reason})")
    if held.lease.verify.startswith("probation ("):  # the updates waiting for that probation would wait for ever
        actions += drop_probation_wait(state, event.peer, "its peer's probation check ended without a verdict")
    return actions


def _judged(book: VerificationState, lease_id: str, peer: str) -> None:
    """An applied-first check has its verdict (or ended without one): its kept copies are no longer needed."""
    record = book.applied_first.get(lease_id)
    if record is not None and record.lease.peer == peer:
        del book.applied_first[lease_id]


# ---------------------------------------------------------------------- held updates never applied


def _drop_held(state: CoordinatorState, held: HeldUpdate, why: str) -> list[Action]:
    """A held update that is never applied (its check failed or ended without a verdict, or its peer was expelled):
    the lease's range goes back to its shard, to be trained by someone else."""
    lease = held.lease
    return_range(state, lease)
    state.verification.dropped += 1
    return [Rejected(lease.peer, lease.lease_id, f"held update not applied: {why}; {lease.steps} steps given back to "
                     f"shard {lease.shard}", RefusalCode.DISCARDED)]


def _drop_peer_held(state: CoordinatorState, peer: str, why: str, keep_checks: bool = False) -> list[Action]:
    """Drop every held update of ``peer``: it was expelled (their checks no longer matter) or cut off (``keep_checks``:
    a revoked token — its checks still run, and one that fails still expels it and repairs what it got into θ)."""
    book = state.verification
    actions: list[Action] = []
    for lease_id in sorted(lease_id for lease_id, held in book.held.items() if held.lease.peer == peer):
        if not keep_checks:
            book.pending.pop(lease_id, None)
        actions += _drop_held(state, book.held.pop(lease_id), why)
    return actions


def drop_revoked_held(state: CoordinatorState, peer: str) -> list[Action]:
    """A peer whose token was revoked: from then on nothing of it reaches θ — its held updates (waiting for their own
    checks or for its probation) are dropped, their ranges given back; the checks themselves go on."""
    return _drop_peer_held(state, peer, "its token was revoked", keep_checks=True)


def drop_probation_wait(state: CoordinatorState, peer: str, why: str) -> list[Action]:
    """Drop ``peer``'s updates that wait for its probation (not re-run themselves): its probation check ended without
    a verdict, or it was cut off (a revoked token)."""
    book = state.verification
    actions: list[Action] = []
    for lease_id in sorted(lease_id for lease_id, held in book.held.items()
                           if held.lease.peer == peer and held.lease.verify.startswith(PROBATION_WAIT)):
        actions += _drop_held(state, book.held.pop(lease_id), why)
    return actions


# ---------------------------------------------------------------------------------------- Repaired


def on_repaired(state: CoordinatorState, event: Repaired) -> list[Action]:
    """Repeat what a repair decided beyond its replay (events.Repaired): give back every lease but the kept ones,
    which keep their live base version; jump the version and the lease counter; restore the commitment chain."""
    kept = dict(zip(event.kept, event.kept_versions))
    adopted = {str(entry[0]): _adopted_lease(entry) for entry in event.adopted}
    # a lease already adopted (the event handled again) stays; a replayed one under an adopted id goes back
    # handled again (a --resume replay meets the record of a repair it has just carried out): the θs retained for the
    # kept leases' checks — the live ones the repair handed on — stay
    again = state.version >= event.version
    actions = void_leases(state, "θ was repaired after an expulsion: ask for a new lease",
                          lambda lease: lease.lease_id in kept or adopted.get(lease.lease_id) == lease, clear_bases=not again)
    renumbered = False
    for lease in state.leases.values():
        if lease.base_version != kept.get(lease.lease_id, lease.base_version):
            lease.base_version, renumbered = kept[lease.lease_id], True
    renumbered = _adopt(state, event) or renumbered
    if renumbered:
        state.indexes = DerivedIndexes()  # the lease book indexes leases by base version: rebuilt on next use
    book = state.verification
    book.pending = {lease_id: peer for lease_id, peer in book.pending.items() if lease_id in book.held}  # held: still judged
    state.version = max(state.version, event.version)
    state.lease_counter = max(state.lease_counter, event.lease_counter)
    expelled = state.verification.expelled
    state.verification.chain = {peer: digest for peer, digest in zip(event.chain_peers, event.chain_digests)
                                if peer not in expelled}
    return actions


def _adopted_lease(entry: tuple[Any, ...] | list[Any]) -> Lease:
    """An entry of events.Repaired ``adopted`` (the log may give it back as a list) as the lease it describes."""
    fields: dict[str, Any] = dict(zip(ADOPTED_FIELDS, entry))
    return Lease(
        lease_id=str(fields["lease_id"]), peer=str(fields["peer"]), shard=int(fields["shard"]),
        start_offset=int(fields["start_offset"]), steps=int(fields["steps"]), lr_offset=int(fields["lr_offset"]),
        base_version=int(fields["base_version"]), issued_at=float(fields["issued_at"]),
        expected_finish=float(fields["expected_finish"]), deadline=float(fields["deadline"]),
        fetched=bool(fields["fetched"]), held=bool(fields["held"]),
        fetched_at=None if fields.get("fetched_at") is None else float(fields["fetched_at"]),
    )


def _adopt(state: CoordinatorState, event: Repaired) -> bool:
    """Take on the live leases the repair's replay did not issue as they were (events.Repaired ``adopted``), each
    with the work its peer has. Its shard range is claimed: the cursor moves past it (a gap before it goes back to
    the shard, to be issued first); a range the replay already issued is trained again by the adopted lease (a few
    batches twice rather than the peer's whole lease thrown away). True when a lease was adopted. Repeating the event
    adopts nothing twice."""
    changed = False
    for lease in sorted((_adopted_lease(e) for e in event.adopted), key=lambda l: (l.shard, l.start_offset, l.lease_id)):
        if lease.lease_id in state.leases or not 0 <= lease.shard < len(state.shards) or lease.steps < 1 \
                or lease.peer not in state.peers:
            continue
        shard = state.shards[lease.shard]
        if lease.start_offset > shard.cursor:
            shard.returned.append((shard.cursor, lease.start_offset - shard.cursor))
            shard.returned.sort()
        shard.cursor = max(shard.cursor, lease.start_offset + lease.steps)
        shard.assigned += lease.steps
        state.leases[lease.lease_id] = lease
        changed = True
    return changed


def void_leases(state: CoordinatorState, why: str, keep: Callable[[Lease], bool] | None = None,
                clear_bases: bool = True) -> list[Action]:
    """Give back every active lease (but those ``keep`` holds valid) and drop every held request (after a repair
    replaced θ: no lease's base version means the same θ any more). Deterministic, so a replay repeats it."""
    actions: list[Action] = []
    failed = {name: info.failed for name, info in state.peers.items()}
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if keep is not None and keep(lease):
            continue
        actions += give_back(state, lease, why)
    for name, info in state.peers.items():
        info.failed = failed[name]  # not the peers' doing: their DyLU standing stays
    for peer in sorted(state.held):
        actions.append(Released(peer, why))
    state.held.clear()
    state.window_end = None
    if clear_bases:
        state.base_params.clear()
    return actions
