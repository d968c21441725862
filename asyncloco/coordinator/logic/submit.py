"""Submissions and verification verdicts: validating an update, applying it through the outer optimizer
and the gate, the inner-state commitment chain, expulsion and repair (coordinator/verify.py carries out
the re-runs)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from asyncloco.algo.dylu import ema
from asyncloco.algo.staleness import apply_transforms
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.logic.events import (
    ADOPTED_FIELDS,
    Action, Applied, Discard, Duplicate, Expelled, Quarantined, Rejected, Released, Repaired, SubmitUpdate, Unverified,
    Verdict, Verified, Verify,
)
from asyncloco.coordinator.logic.leases import (
    _drop_unused_base_params, _give_back, _retain_before_step, _unindex_lease, base_theta,
)
from asyncloco.coordinator.gate import GatePolicy, GateVerdict
from asyncloco.coordinator.logic.state import CoordinatorState, DerivedIndexes, FRESH_STATE_DIGEST, Lease, PeerInfo
from asyncloco.refusals import RefusalCode


def _on_verified(state: CoordinatorState, event: Verified, now: float) -> list[Action]:
    book = state.verification
    book.pending.pop(event.lease_id, None)
    book.checked += 1
    if event.peer in book.expelled:
        return [Verdict(event.peer, event.lease_id, event.ok, f"{event.detail} (peer already expelled)")]
    if event.ok:
        book.passed[event.peer] = book.passed.get(event.peer, 0) + 1
        return [Verdict(event.peer, event.lease_id, True, event.detail)]
    book.failed += 1
    reason = f"lease {event.lease_id} did not reproduce: {event.detail}"
    book.expelled[event.peer] = reason
    actions: list[Action] = [Verdict(event.peer, event.lease_id, False, event.detail), Expelled(event.peer, event.lease_id, reason, event.anchor)]
    info = state.peers.get(event.peer)
    if info is not None:
        info.alive = False
    state.held.pop(event.peer, None)
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == event.peer:
            actions += _give_back(state, lease, "peer expelled")
    return actions


def _on_unverified(state: CoordinatorState, event: Unverified) -> list[Action]:
    book = state.verification
    if book.pending.get(event.lease_id) != event.peer:
        return []  # judged meanwhile, or cleared by a repair
    del book.pending[event.lease_id]
    book.unverifiable += 1
    return []


def _on_discard(state: CoordinatorState, event: Discard, now: float) -> list[Action]:
    lease = state.leases.get(event.lease_id)
    if lease is None or lease.peer != event.peer:
        return []
    # the peer was heard, as in the live run: without this a replay saw the expelled peer silent, declared it left
    # at the next tick, refused its next request and numbered every later lease one lower than the live run did —
    # honest peers' leases then were unknown to the repaired state (found in the warm colluder benchmark)
    info = state.peers.get(event.peer)
    if info is not None:
        info.last_seen = now
    del state.leases[lease.lease_id]
    _unindex_lease(state, lease)
    state.applied[lease.lease_id] = state.version  # consumed: a resend is a duplicate, its batches count as used
    _drop_unused_base_params(state)
    return [Rejected(event.peer, lease.lease_id, "update discarded: its peer was expelled", RefusalCode.DISCARDED)]


def _on_repaired(state: CoordinatorState, event: Repaired) -> list[Action]:
    """Repeat what a repair decided beyond its replay (events.Repaired): give back every lease but the kept ones,
    which keep their live base version; jump the version and the lease counter; restore the commitment chain."""
    kept = dict(zip(event.kept, event.kept_versions))
    adopted = {str(entry[0]): _adopted_lease(entry) for entry in event.adopted}
    # a lease already adopted (the event handled again) stays; a replayed one under an adopted id goes back
    actions = void_leases(state, "θ was repaired after an expulsion: ask for a new lease",
                          lambda lease: lease.lease_id in kept or adopted.get(lease.lease_id) == lease)
    renumbered = False
    for lease in state.leases.values():
        if lease.base_version != kept.get(lease.lease_id, lease.base_version):
            lease.base_version, renumbered = kept[lease.lease_id], True
    renumbered = _adopt(state, event) or renumbered
    if renumbered:
        state.indexes = DerivedIndexes()  # the lease book indexes leases by base version: rebuilt on next use
    state.verification.pending.clear()
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


def void_leases(state: CoordinatorState, why: str, keep: Callable[[Lease], bool] | None = None) -> list[Action]:
    """Give back every active lease (but those ``keep`` holds valid) and drop every held request (after a repair
    replaced θ: no lease's base version means the same θ any more). Deterministic, so a replay repeats it."""
    actions: list[Action] = []
    failed = {name: info.failed for name, info in state.peers.items()}
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if keep is not None and keep(lease):
            continue
        actions += _give_back(state, lease, why)
    for name, info in state.peers.items():
        info.failed = failed[name]  # not the peers' doing: their DyLU standing stays
    for peer in sorted(state.held):
        actions.append(Released(peer, why))
    state.held.clear()
    state.window_end = None
    state.base_params.clear()
    return actions


def validate_update(state: CoordinatorState, event: SubmitUpdate, lease: Lease) -> str | None:
    """Why this update must not touch θ, or None if it may."""
    problem = update_problem(state, event, lease)
    return None if problem is None else problem[1]


def update_problem(state: CoordinatorState, event: SubmitUpdate, lease: Lease) -> tuple[RefusalCode, str] | None:
    """:func:`validate_update` with the typed code (STALE for the staleness bound, else INVALID_UPDATE)."""
    update = event.pseudo_gradient
    if lease.peer != event.peer:
        return RefusalCode.INVALID_UPDATE, f"lease {lease.lease_id} belongs to another peer"
    if event.base_version != lease.base_version:
        return RefusalCode.INVALID_UPDATE, f"base_version {event.base_version} does not match the lease's {lease.base_version}"
    if not isinstance(update, torch.Tensor) or update.dtype != torch.float32:
        return RefusalCode.INVALID_UPDATE, "pseudo-gradient must be a float32 tensor"
    if update.shape != state.params.shape:
        return RefusalCode.INVALID_UPDATE, f"pseudo-gradient has shape {tuple(update.shape)}, θ has {tuple(state.params.shape)}"
    staleness = state.version - lease.base_version
    if state.policy.max_staleness is not None and staleness > state.policy.max_staleness:
        return RefusalCode.STALE, f"staleness {staleness} exceeds the bound {state.policy.max_staleness}"
    if state.policy.gate is not None and state.policy.max_update_norm is None:
        return None  # the gate's own pass over Δ finds NaN/Inf and judges the norm
    # One pass: a NaN or Inf anywhere makes the sum of squares non-finite (so do values whose squares
    # overflow float32 — far beyond any honest update).
    squared = float(torch.dot(update, update))
    if not math.isfinite(squared):
        return RefusalCode.INVALID_UPDATE, "pseudo-gradient contains NaN or Inf, or its norm overflows float32"
    if state.policy.max_update_norm is not None and math.sqrt(squared) > state.policy.max_update_norm:
        return RefusalCode.INVALID_UPDATE, f"pseudo-gradient norm {math.sqrt(squared):.4g} exceeds the bound {state.policy.max_update_norm:g}"
    return None


def _on_submit(state: CoordinatorState, event: SubmitUpdate, now: float) -> list[Action]:
    """A peer's update for one of its leases: refused (:func:`_refusal`), rejected by the gate, dropped by the
    staleness policy, or applied to θ — in that order of checks (each step a function below)."""
    refused = _refusal(state, event)
    if refused is not None:
        return refused
    lease = state.leases[event.lease_id]
    staleness = state.version - lease.base_version
    info = state.peers.get(event.peer)
    if info is not None:
        info.last_seen = now
    update = event.pseudo_gradient
    policy = state.policy
    verdict = None
    check = _verification_copy(state, lease, update)
    if policy.gate is not None:
        verdict = gate_verdict(state, event, lease, policy.gate)
        if verdict.action == "reject":
            return _gate_reject(state, policy.gate, event, lease, verdict, now)
        if verdict.action == "clip":  # not in place: handle never changes its event (a replay may feed it again)
            update = update.mul(verdict.scale)
    base = base_theta(state, lease.base_version) if state.needs_base_params else None
    adjusted = apply_transforms(state.transforms, update, staleness, state.params, base)
    del state.leases[lease.lease_id]
    _unindex_lease(state, lease)
    if info is not None and not policy.trust_speeds:
        _observe_speed(state, info, lease, event, now)
    if adjusted.pseudo_gradient is None:
        # Dropped by policy (e.g. PolyThres): the work is consumed, θ is untouched, the version stays.
        state.applied[lease.lease_id] = state.version
        _drop_unused_base_params(state)
        return [Rejected(event.peer, lease.lease_id, adjusted.reason, RefusalCode.DROPPED)]
    retained = _retain_before_step(state)
    info_step = state.optimizer.step(state.params, adjusted.pseudo_gradient, adjusted.lr_scale)
    state.version += 1
    state.local_updates += lease.steps
    state.applied[lease.lease_id] = state.version
    gate_note = _after_step(state, event, lease, verdict, update, now)
    verify = _verify_actions(state, event, lease, check)
    return retained + verify + [
        Applied(
            event.peer,
            lease.lease_id,
            state.version,
            staleness,
            lease.steps,
            lease.shard,
            info_step.moved,
            f"{info_step.reason}; {adjusted.reason}",
            gate_note,
        )
    ]


def _refusal(state: CoordinatorState, event: SubmitUpdate) -> list[Action] | None:
    """The actions for a submission that must not reach the gate or θ — a resend of an applied lease
    (Duplicate), an unknown or expired lease, an invalid update (:func:`update_problem`), an inner-state
    chain that does not link (:func:`_broken_chain`) — or None when it may go on."""
    if event.lease_id in state.applied:
        version = state.applied[event.lease_id]
        return [Duplicate(event.peer, event.lease_id, version, f"already applied at version {version}; not applied again")]
    lease = state.leases.get(event.lease_id)
    if lease is None:
        return [Rejected(event.peer, event.lease_id, "unknown or expired lease; its steps were given back", RefusalCode.UNKNOWN_LEASE)]
    problem = update_problem(state, event, lease)
    if problem is not None:
        return [Rejected(event.peer, event.lease_id, problem[1], problem[0])]
    return _broken_chain(state, event)


def gate_verdict(state: CoordinatorState, event: SubmitUpdate, lease: Lease, gate: GatePolicy) -> GateVerdict:
    """The gate's verdict on the update as sent, with the probe losses the daemon logged in the event (pure)."""
    probe = None if event.probe_before is None or event.probe_after is None else (event.probe_before, event.probe_after)
    return update_gate.score(gate, state.gate, event.pseudo_gradient, lease.steps, event.peer, state.policy.norm_bound_per_step, probe)


def refused_as_sent(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """Whether handling ``event`` as it is would refuse it and leave θ untouched — an invalid lease or update
    (:func:`_refusal`) or the gate's rejection — without changing ``state``. The repair's replay asks this of an
    expelled peer's submission (coordinator/repair.py)."""
    lease = state.leases.get(event.lease_id)
    if event.lease_id in state.applied or lease is None or update_problem(state, event, lease) is not None \
            or not _chain_links(state, event):
        return True
    gate = state.policy.gate
    return gate is not None and gate_verdict(state, event, lease, gate).action == "reject"


def _verification_copy(
    state: CoordinatorState, lease: Lease, update: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """For a lease chosen for verification: θ at its base version (None when no longer held; copied before the
    optimizer step changes θ in place) and a copy of the update as submitted (the daemon decodes the next upload
    into the same buffer: coordinator/serving.py); None for a lease not checked. Verify is emitted only if the
    update is applied (:func:`_verify_actions`)."""
    if state.policy.verify is None or not lease.verify:
        return None
    base_now = base_theta(state, lease.base_version)
    return (None if base_now is None else base_now.clone() if base_now is state.params else base_now, update.clone())


def _gate_reject(
    state: CoordinatorState, gate: GatePolicy, event: SubmitUpdate, lease: Lease, verdict: GateVerdict, now: float
) -> list[Action]:
    """The gate rejected the update: the work is refused and its steps go back to the shard (its batches get
    trained by someone else); the gate's record may quarantine the peer."""
    quarantine = update_gate.record(gate, state.gate, verdict, None, lease.steps, event.peer, now)
    actions: list[Action] = [Rejected(event.peer, lease.lease_id, f"update gate: {verdict.reason}", RefusalCode.GATE)]
    actions += _give_back(state, lease, "its update was rejected by the gate")
    if quarantine is not None:
        actions += _quarantine(state, event.peer, now, quarantine)
    return actions


def _observe_speed(state: CoordinatorState, info: PeerInfo, lease: Lease, event: SubmitUpdate, now: float) -> None:
    """The peer's observed speed (steps' units per busy second, the lease's time less its transfers) and its
    transfer time, from this submission (when the policy does not trust reported speeds)."""
    busy = now - lease.issued_at - max(0.0, event.transfer_s)
    if busy > 0:
        info.observed = ema(info.observed, lease.steps * state.policy.units_per_step / busy, 0.5)
    info.transfer_s = max(0.0, event.transfer_s)


def _after_step(
    state: CoordinatorState, event: SubmitUpdate, lease: Lease, verdict: GateVerdict | None, update: torch.Tensor, now: float
) -> str:
    """Bookkeeping once θ moved: the peer's commitment chain advances (applied leases only), the gate records the
    update it passed, unused base parameters are dropped. Returns the gate's note for Applied ("" without a gate)."""
    policy = state.policy
    if policy.verify is not None and policy.verify.commit and event.state_end is not None:
        state.verification.chain[event.peer] = event.state_end  # the chain advances with applied leases only
    gate_note = ""
    if verdict is not None and policy.gate is not None:
        update_gate.record(policy.gate, state.gate, verdict, update, lease.steps, event.peer, now)
        gate_note = f"clipped ×{verdict.scale:.3g}: {verdict.reason}" if verdict.action == "clip" else verdict.reason
    _drop_unused_base_params(state)
    return gate_note


def _verify_actions(
    state: CoordinatorState, event: SubmitUpdate, lease: Lease, check: tuple[torch.Tensor | None, torch.Tensor] | None
) -> list[Action]:
    """The Verify for an applied lease chosen for verification (pending until its Verified), or none: a lease not
    chosen, or one whose base θ is no longer held (counted as unverifiable)."""
    if check is None:
        return []
    if check[0] is None:
        state.verification.unverifiable += 1
        return []
    state.verification.pending[lease.lease_id] = event.peer
    return [Verify(event.peer, lease, check[0], check[1], lease.verify, "", event.state_start or "", event.state_end or "",
                   event.device_class or "")]


def _broken_chain(state: CoordinatorState, event: SubmitUpdate) -> list[Action] | None:
    """With commitments (``VerifyPolicy.commit``): None when the submission's inner-state digests chain — its start
    digest is the peer's end digest of its last *applied* lease, or the fresh state's (a peer resets its inner state
    when it joins, restarts, or a submission of it was not applied). Otherwise the actions: a submission without
    digests is refused; a broken chain is a failed check — the update is refused and a :class:`Verify` that has
    already failed goes to the verifier, whose ``Verified`` expels the peer and repairs θ like any failed re-run."""
    if _chain_links(state, event):
        return None
    if event.state_start is None or event.state_end is None:
        return [Rejected(event.peer, event.lease_id, "this run verifies carried inner state: the submission needs "
                         "state_start and state_end digests; upgrade the peer (asyncloco peer join)", RefusalCode.BROKEN_CHAIN)]
    previous = state.verification.chain.get(event.peer, FRESH_STATE_DIGEST)
    lease = state.leases[event.lease_id]
    detail = (f"inner-state chain broken: lease starts from state {event.state_start[:16]}…, the peer's last applied "
              f"lease ended at {previous[:16]}… (and it is not the fresh state)")
    state.verification.pending[lease.lease_id] = event.peer
    empty = torch.empty(0)
    actions: list[Action] = [Rejected(event.peer, lease.lease_id, detail, RefusalCode.BROKEN_CHAIN)]
    actions += _give_back(state, lease, "its inner-state commitment did not chain")
    actions.append(Verify(event.peer, lease, empty, empty, "chain check", detail, event.state_start, event.state_end))
    return actions


def _quarantine(state: CoordinatorState, peer: str, now: float, why: str) -> list[Action]:
    actions: list[Action] = [Quarantined(peer, state.gate.quarantined_until[peer], why)]
    state.held.pop(peer, None)
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == peer:
            actions += _give_back(state, lease, "peer quarantined")
    return actions


def _chain_links(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """Whether the submission's inner-state digests chain (:func:`_broken_chain`); True without commitments."""
    policy = state.policy.verify
    if policy is None or not policy.commit:
        return True
    if event.state_start is None or event.state_end is None:
        return False
    return event.state_start in (state.verification.chain.get(event.peer, FRESH_STATE_DIGEST), FRESH_STATE_DIGEST)
