"""Submissions: a peer's update for one of its leases is refused, rejected by the gate, held until its check
(verification.py gives the verdict), applied first and checked later, or applied through the outer optimizer — and
the inner-state commitment chain it must extend. The apply path a held update takes once its check agrees (or its
peer's probation passes) is here too, and Discard (a repair's replay voids an expelled peer's submission).
:func:`holds` and :func:`checked_after` tell the repair's replay what a submission would do (coordinator/repair.py)."""

from __future__ import annotations

import dataclasses
import math

import torch

from asyncloco.algo.dylu import ema
from asyncloco.algo.staleness import apply_transforms
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.gate import GatePolicy, GateVerdict
from asyncloco.coordinator.logic.draws import PROBATION_WAIT, gate_proven, must_check
from asyncloco.coordinator.logic.events import (
    Action, Applied, Discard, Duplicate, Held, Quarantined, Rejected, SubmitUpdate, Verify,
)
from asyncloco.coordinator.logic.indexes import peer_leases, unindex_lease
from asyncloco.coordinator.logic.leases import base_theta, drop_unused_base_params, give_back, retain_before_step
from asyncloco.coordinator.logic.state import CoordinatorState, FRESH_STATE_DIGEST, HeldUpdate, Lease, PeerInfo
from asyncloco.coordinator.sketch import Sketcher, observe
from asyncloco.refusals import RefusalCode


# ------------------------------------------------------------------------------------ SubmitUpdate


def on_submit(state: CoordinatorState, event: SubmitUpdate, now: float) -> list[Action]:
    """A peer's update for one of its leases: refused (:func:`_refusal`), rejected by the gate, held until its check
    (a lease chosen for verification: :func:`_hold`), dropped by the staleness policy, or applied to θ — in that
    order of checks (each step a function below)."""
    refused = _refusal(state, event)
    if refused is not None:
        return refused
    lease, eager = _eager_start(state, event)
    actions = _accept(state, event, lease, eager, now)
    _note_eager(state, event, actions)
    return actions


def _accept(state: CoordinatorState, event: SubmitUpdate, lease: Lease, eager: torch.Tensor | None,
            now: float) -> list[Action]:
    """:func:`on_submit` past its refusals: ``lease`` as :func:`_eager_start` returned it, ``eager`` the update its
    start subtracted (for its check)."""
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
            instead = _checked_instead(state, lease, verdict, startable=not (lease.eager_of and eager is None))
            if instead is None:
                return _gate_reject(state, policy.gate, event, lease, verdict, now)
            verdict, lease = instead  # only the probe spoke against it: held for a check instead of refused
            check = _verification_copy(state, lease, update)
    scale = verdict.scale if verdict is not None and verdict.action == "clip" else 1.0
    score = _sketch(state, event)
    del state.leases[lease.lease_id]
    unindex_lease(state, lease)
    if info is not None and not policy.trust_speeds:
        _observe_speed(state, info, lease, event, now)
    if info is not None:
        info.device_class = event.device_class or ""  # leases.carries_checked
    if policy.verify is not None and policy.verify.commit and event.state_end is not None:
        # the chain advances with every accepted lease (a held one included: its peer goes on from that state)
        state.verification.chain[event.peer] = event.state_end
    if check is not None and not _dropped(state, lease):
        # (θ at its base version no longer held — only in a replay that crosses an earlier repair, which cannot hand
        # on the live θ: held all the same, and the log's Unverified or verdict settles it as it did live)
        if _holds_check(state, lease):
            return _hold(state, event, lease, check[0] if check[0] is not None else torch.empty(0), check[1], scale,
                         verdict, now, score, eager)
        return _apply_then_check(state, event, lease, check, scale, verdict, now, score, eager)
    if scale != 1.0:  # not in place: handle never changes its event (a replay may feed it again)
        update = update.mul(scale)
    base = base_theta(state, lease.base_version) if state.needs_base_params else None
    return _apply(state, lease, update, base, verdict, now, checked=False, sketch=score)


def _eager_start(state: CoordinatorState, event: SubmitUpdate) -> tuple[Lease, torch.Tensor | None]:
    """The submission's lease as its check sees it, and the update its start subtracted (algo/eager.py): a lease
    granted with an eager start that its peer trained from θ itself (it lost the message, or saw that update refused)
    is checked as such; one that used it takes the update kept for its check (:func:`_note_eager`; None: not kept —
    not checked, or lost to a restart: its check then ends unverified)."""
    lease = state.leases[event.lease_id]
    kept = state.verification.eager.pop(lease.lease_id, None)
    if not lease.eager_of:
        return lease, None
    if event.eager_of is None:
        return dataclasses.replace(lease, eager_of="", eager_share=0.0), None
    return lease, kept


def _note_eager(state: CoordinatorState, event: SubmitUpdate, actions: list[Action]) -> None:
    """An accepted update (applied, or held for its check) of a lease that a live lease of the same peer starts eagerly
    from (``Lease.eager_of``): that lease's shifted submission may now be accepted, and if it is to be checked, the
    update is kept for its re-run (a copy: the daemon decodes the next upload into the same buffer)."""
    if not any(isinstance(a, (Applied, Held)) and a.lease_id == event.lease_id for a in actions):
        return
    for lease in peer_leases(state, event.peer):
        if lease.eager_of == event.lease_id:
            lease.eager_ready = True
            if lease.verify and state.policy.verify is not None:
                state.verification.eager[lease.lease_id] = event.pseudo_gradient.clone()


def _refusal(state: CoordinatorState, event: SubmitUpdate) -> list[Action] | None:
    """The actions for a submission that must not reach the gate or θ — a resend of an applied lease
    (Duplicate), an unknown or expired lease, an invalid update (:func:`update_problem`), an inner-state
    chain that does not link (:func:`_broken_chain`) — or None when it may go on."""
    if event.lease_id in state.applied:
        version = state.applied[event.lease_id]
        return [Duplicate(event.peer, event.lease_id, version, f"already applied at version {version}; not applied again")]
    held = state.verification.held.get(event.lease_id)
    if held is not None and held.lease.peer == event.peer:
        return [Duplicate(event.peer, event.lease_id, state.version, "accepted already and held until its check; not held twice")]
    lease = state.leases.get(event.lease_id)
    if lease is None:
        return [Rejected(event.peer, event.lease_id, "unknown or expired lease; its steps were given back", RefusalCode.UNKNOWN_LEASE)]
    problem = update_problem(state, event, lease)
    if problem is not None:
        return [Rejected(event.peer, event.lease_id, problem[1], problem[0])]
    return _broken_chain(state, event)


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
    if event.eager_of is not None and event.eager_of != lease.eager_of:
        return RefusalCode.INVALID_UPDATE, (f"its start subtracted the update of lease {event.eager_of[:40]}, but lease "
                                            f"{lease.lease_id} was granted with " + (f"the eager start of {lease.eager_of}"
                                            if lease.eager_of else "no eager start") + ": train from the θ it names")
    if event.eager_of is not None and not lease.eager_ready:
        return RefusalCode.INVALID_UPDATE, (f"its start subtracted the update of lease {event.eager_of[:40]}, which the "
                                            "coordinator has not accepted: a lease starts from θ itself then")
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


def _broken_chain(state: CoordinatorState, event: SubmitUpdate) -> list[Action] | None:
    """With commitments (``VerifyPolicy.commit``): None when the submission's inner-state digests chain — its start
    digest is the peer's end digest of its last *applied* lease, or the fresh state's (a peer resets its inner state
    when it joins, restarts, or a submission of it was not applied). Otherwise the actions: a submission without
    digests is refused; a broken chain is a failed check — the update is refused and a :class:`Verify` that has
    already failed goes to the verifier, whose ``Verified`` expels the peer and repairs θ like any failed re-run."""
    lease = state.leases[event.lease_id]
    if _unfresh(state, event):
        # a peer that ignored the lease's fresh start (an earlier version of the client): its carried state cannot be
        # re-run without a reveal its uplink cannot carry — refused, not judged (leases.py fresh_reason)
        assert event.state_start is not None
        return [Rejected(event.peer, event.lease_id, "this lease was granted with a fresh inner state (the peer's uplink "
                         "cannot carry a reveal: runtime.verify.fresh_start_reveal_s), but its submission starts from "
                         f"state {event.state_start[:16]}…; upgrade the peer (asyncloco peer join)", RefusalCode.BROKEN_CHAIN),
                *give_back(state, lease, "it did not start from the fresh inner state it was granted with")]
    if _chain_links(state, event):
        return None
    if event.state_start is None or event.state_end is None:
        return [Rejected(event.peer, event.lease_id, "this run verifies carried inner state: the submission needs "
                         "state_start and state_end digests; upgrade the peer (asyncloco peer join)", RefusalCode.BROKEN_CHAIN)]
    previous = state.verification.chain.get(event.peer, FRESH_STATE_DIGEST)
    detail = (f"inner-state chain broken: lease starts from state {event.state_start[:16]}…, the peer's last applied "
              f"lease ended at {previous[:16]}… (and it is not the fresh state)")
    state.verification.pending[lease.lease_id] = event.peer
    empty = torch.empty(0)
    actions: list[Action] = [Rejected(event.peer, lease.lease_id, detail, RefusalCode.BROKEN_CHAIN)]
    actions += give_back(state, lease, "its inner-state commitment did not chain")
    actions.append(Verify(event.peer, lease, empty, empty, "chain check", detail, event.state_start, event.state_end))
    return actions


def _commits(state: CoordinatorState) -> bool:
    return state.policy.verify is not None and state.policy.verify.commit


def _unfresh(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """A submission of a lease granted with a fresh start (Lease.fresh) whose committed start is another state."""
    lease = state.leases.get(event.lease_id)
    return (lease is not None and lease.fresh and _commits(state)
            and event.state_start is not None and event.state_start != FRESH_STATE_DIGEST)


def _chain_links(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """Whether the submission's inner-state digests chain (:func:`_broken_chain`) — a lease granted with a fresh start
    starts from the fresh state; True without commitments."""
    if not _commits(state):
        return True
    if event.state_start is None or event.state_end is None or _unfresh(state, event):
        return False
    return event.state_start in (state.verification.chain.get(event.peer, FRESH_STATE_DIGEST), FRESH_STATE_DIGEST)


def gate_verdict(state: CoordinatorState, event: SubmitUpdate, lease: Lease, gate: GatePolicy) -> GateVerdict:
    """The gate's verdict on the update as sent, with the probe losses the daemon logged in the event (pure)."""
    probe = None if event.probe_before is None or event.probe_after is None else (event.probe_before, event.probe_after)
    return update_gate.score(gate, state.gate, event.pseudo_gradient, lease.steps, event.peer, state.policy.norm_bound_per_step,
                             probe, proven=gate_proven(state, lease), sketcher=state.own_sketcher())


def _checked_instead(state: CoordinatorState, lease: Lease, verdict: GateVerdict,
                     startable: bool = True) -> tuple[GateVerdict, Lease] | None:
    """A gate rejection that only the probe shows (the update raises the probe-batch loss: a few rows' noise on honest
    cold-start work, or a sign-flipped update) is not a refusal where work is verified: the update is held for a check
    (its lease then counts as a suspect's) and applied, weakly, if its re-run agrees — the verdict and lease to do that
    with, or None to refuse it."""
    if verdict.if_checked is None or state.policy.verify is None or base_theta(state, lease.base_version) is None:
        return None
    if not startable:  # an eager start whose update was not kept (the lease was not drawn): no re-run can be had
        return None
    return verdict.if_checked, dataclasses.replace(lease, verify=f"suspect: the gate's probe: {verdict.reason}"[:300])


def _gate_reject(
    state: CoordinatorState, gate: GatePolicy, event: SubmitUpdate, lease: Lease, verdict: GateVerdict, now: float
) -> list[Action]:
    """The gate rejected the update: the work is refused and its steps go back to the shard (its batches get
    trained by someone else); the gate's record may quarantine the peer. Not for a refusal on the probe's word alone
    in a run that verifies work (one :func:`_checked_instead` could not hold for a check: θ at its base version is
    gone, or an eager start's update was not kept): the probe's few rows cannot tell honest work on a weak consensus from a sign-flipped update (a loopback run at
    outer momentum 0.5 quarantined all three honest peers so, docs/wan.md), so it makes the peer a suspect — its next
    leases drawn at ``suspect_fraction``, whose θ is kept, and a probe-only refusal of those is re-run: a flipped update
    then expels its peer."""
    doubted = verdict.if_checked is not None and state.policy.verify is not None
    quarantine = update_gate.record(gate, state.gate, verdict, None, lease.steps, event.peer, now, doubted=doubted)
    reason = f"update gate: {verdict.reason}" + ("; not counted toward quarantine (it cannot be re-run: θ at its base "
                                                  "version, or the update its eager start subtracted, is not kept), the "
                                                  "peer's next leases are checked more" if doubted else "")
    actions: list[Action] = [Rejected(event.peer, lease.lease_id, reason, RefusalCode.GATE)]
    actions += give_back(state, lease, "its update was rejected by the gate")
    if quarantine is not None:
        actions += _quarantine(state, event.peer, now, quarantine)
    return actions


def _quarantine(state: CoordinatorState, peer: str, now: float, why: str) -> list[Action]:
    actions: list[Action] = [Quarantined(peer, state.gate.quarantined_until[peer], why)]
    state.held.pop(peer, None)
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == peer:
            actions += give_back(state, lease, "peer quarantined")
    return actions


def refused_as_sent(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """Whether handling ``event`` as it is would refuse it and leave θ untouched — an invalid lease or update
    (:func:`_refusal`) or the gate's rejection — without changing ``state``. The repair's replay asks this of an
    expelled peer's submission (coordinator/repair.py)."""
    lease = state.leases.get(event.lease_id)
    if event.lease_id in state.applied or lease is None or update_problem(state, event, lease) is not None \
            or not _chain_links(state, event):
        return True
    gate = state.policy.gate
    if gate is None:
        return False
    verdict = gate_verdict(state, event, lease, gate)
    unkept = event.eager_of is not None and bool(lease.eager_of) and lease.lease_id not in state.verification.eager
    return verdict.action == "reject" and _checked_instead(state, lease, verdict, startable=not unkept) is None


def _verification_copy(
    state: CoordinatorState, lease: Lease, update: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """For a lease chosen for verification: θ at its base version (None when no longer held; copied before the
    optimizer step changes θ in place) and a copy of the update as submitted (the daemon decodes the next upload
    into the same buffer: coordinator/serving.py); None for a lease not checked. The update is then held until its
    verdict (:func:`_hold`), which emits the Verify."""
    if state.policy.verify is None or not lease.verify:
        return None
    base_now = base_theta(state, lease.base_version)
    return (None if base_now is None else base_now.clone() if base_now is state.params else base_now, update.clone())


def _sketch(state: CoordinatorState, event: SubmitUpdate) -> float | None:
    """Score an accepted update by its persistent residual (coordinator/sketch.py): a peer whose consecutive updates
    keep one direction the others' do not becomes a suspect, and its next leases are all re-run (verify_reason)."""
    policy = state.policy.verify
    if policy is None or policy.sketch_threshold >= 1.0:
        return None
    indexes = state.indexes
    if indexes.sketcher is None or indexes.sketcher.numel != state.params.numel():
        indexes.sketcher = Sketcher(state.lease_secret + b"/" + str(state.seed).encode(), state.params.numel())
    live = {name for name, info in state.peers.items() if info.alive}
    return observe(state.verification.sketch, indexes.sketcher(event.pseudo_gradient), event.peer, live,
                   policy.sketch_threshold, policy.sketch_checks)


def _observe_speed(state: CoordinatorState, info: PeerInfo, lease: Lease, event: SubmitUpdate, now: float) -> None:
    """The peer's observed speed (steps' units per busy second) and its transfer time, from this submission (when the
    policy does not trust reported speeds). Busy: from the latest of the lease's issue, the end of its θ download (when
    the coordinator saw one) and the start of the peer's previous upload (a lease asked for ahead trains after the one
    before it), to the start of this upload."""
    upload = max(0.0, event.transfer_s)
    started = max([lease.issued_at, *(t for t in (lease.fetched_at, info.upload_started) if t is not None)])
    busy = now - upload - started
    if busy > 0:
        info.observed = ema(info.observed, lease.steps * state.policy.units_per_step / busy, 0.5)
    info.transfer_s = upload
    info.upload_started = now - upload


# -------------------------------------------------------------- held for a check, or applied first


def _holds_check(state: CoordinatorState, lease: Lease) -> bool:
    """Does this checked lease's update wait for its verdict? Always for probation and a suspect (:func:`must_check`:
    a peer caught there never touches θ); a drawn check only while fewer than ``hold_backlog`` checks await theirs —
    behind a verifier that has fallen behind, held work would be applied ever staler (Delayed Nesterov diverged with
    held updates 15-23 versions old on an overloaded machine), so the update is applied now and checked later."""
    policy = state.policy.verify
    return must_check(lease) or (policy is not None and len(state.verification.pending) < policy.hold_backlog)


def _dropped(state: CoordinatorState, lease: Lease) -> bool:
    """Would the staleness policy drop ``lease``'s update now (holding it for a check would then be pointless)?"""
    return any(transform.drops(state.version - lease.base_version) for transform in state.transforms)


def holds(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """Would handling ``event`` now hold its update for a check (:func:`_hold`), without changing ``state``? The
    repair's replay asks this of an expelled peer's submission: a held one is replayed as it is (coordinator/repair.py)."""
    lease = state.leases.get(event.lease_id)
    if state.policy.verify is None or lease is None or refused_as_sent(state, event):
        return False
    gate = state.policy.gate
    forced = gate is not None and gate_verdict(state, event, lease, gate).action == "reject"  # held instead (_checked_instead)
    return (forced or (bool(lease.verify) and _holds_check(state, lease))) and not _dropped(state, lease)


def checked_after(state: CoordinatorState, event: SubmitUpdate) -> bool:
    """Would handling ``event`` now apply its update first and leave its check pending (:func:`_apply_then_check`)?
    The repair's replay asks this of an expelled peer's submission it discards: the live run's check was pending from
    then until its verdict, and the replay counts it too — every later hold decision depends on that backlog
    (:func:`_holds_check`; without it the replay held an update the live run had applied, and repaired another θ)."""
    lease = state.leases.get(event.lease_id)
    if state.policy.verify is None or lease is None or not lease.verify or refused_as_sent(state, event):
        return False
    return not holds(state, event) and not _dropped(state, lease) and base_theta(state, lease.base_version) is not None


def _record(event: SubmitUpdate, lease: Lease, update: torch.Tensor, base: torch.Tensor, scale: float,
            verdict: GateVerdict | None, now: float, eager: torch.Tensor | None = None) -> HeldUpdate:
    """A checked submission as the state keeps it until its verdict (held, or applied first), with all its check needs."""
    return HeldUpdate(lease, update, base, scale, now, None if verdict is None else dataclasses.asdict(verdict),
                      event.state_start or "", event.state_end or "", event.device_class or "",
                      event.theta_codec or "", event.theta_anchor, event.theta_digest or "", eager)


def _hold(
    state: CoordinatorState, event: SubmitUpdate, lease: Lease, base: torch.Tensor, update: torch.Tensor, scale: float,
    verdict: GateVerdict | None, now: float, sketch: float | None = None, eager: torch.Tensor | None = None,
) -> list[Action]:
    """Accept a checked lease's update but hold it until its verdict (verification.py :func:`on_verified`): θ never
    sees the work of a peer whose check fails, so nothing needs repair when one is caught on its checked leases.
    ``base``/``update``: θ at the lease's base version and the update as submitted (copies that never change)."""
    book = state.verification
    if lease.verify.startswith(PROBATION_WAIT):  # no re-run: it waits for the peer's probation verdicts (verification.py)
        book.held[lease.lease_id] = _record(event, lease, update, base, scale, verdict, now, eager)
        drop_unused_base_params(state)
        held = [Held(event.peer, lease.lease_id, state.version, "held until the peer's probation checks agree", sketch)]
        return held + release_at_verdict(state, None, event.peer, now)  # (passed meanwhile: applied at once)
    book.held[lease.lease_id] = _record(event, lease, update, base, scale, verdict, now, eager)
    book.pending[lease.lease_id] = event.peer
    drop_unused_base_params(state)
    return [
        Verify(event.peer, lease, base, update, lease.verify, "", event.state_start or "", event.state_end or "",
               event.device_class or "", event.theta_codec or "", event.theta_anchor, event.theta_digest or "",
               eager=eager),
        Held(event.peer, lease.lease_id, state.version, f"held until its check agrees ({lease.verify})", sketch),
    ]


def _apply_then_check(
    state: CoordinatorState, event: SubmitUpdate, lease: Lease, check: tuple[torch.Tensor | None, torch.Tensor],
    scale: float, verdict: GateVerdict | None, now: float, score: float | None, eager: torch.Tensor | None = None,
) -> list[Action]:
    """A drawn check while the verifier is behind: the update is applied now, unchecked (a failed verdict expels the
    peer and repairs θ), and its check still runs on the copies taken before θ moved."""
    base, copy = check
    update = event.pseudo_gradient if scale == 1.0 else event.pseudo_gradient.mul(scale)
    before = base_theta(state, lease.base_version) if state.needs_base_params else None
    actions = _apply(state, lease, update, before, verdict, now, checked=False, sketch=score)
    if base is None or not any(isinstance(a, Applied) for a in actions):
        return actions  # not applied (dropped by the staleness policy) or no θ to re-run from: nothing to check
    state.verification.pending[lease.lease_id] = event.peer
    # kept until its verdict with the check's θ and update (never changed: _verification_copy), so a restart that
    # finds the check unjudged re-runs it from the snapshot — an update applied unchecked is never left unjudged
    state.verification.applied_first[lease.lease_id] = _record(event, lease, copy, base, scale, verdict, now, eager)
    return actions + [Verify(event.peer, lease, base, copy, f"{lease.verify} (applied first: verifier behind)", "",
                             event.state_start or "", event.state_end or "", event.device_class or "",
                             event.theta_codec or "", event.theta_anchor, event.theta_digest or "", eager=eager)]


# ---------------------------------------------------------------------------------- the apply path


def _apply(
    state: CoordinatorState, lease: Lease, update: torch.Tensor, base: torch.Tensor | None, verdict: GateVerdict | None,
    now: float, checked: bool, sketch: float | None = None, share: float = 1.0, share_note: str = "",
) -> list[Action]:
    """Apply an accepted update (already clipped as the gate said) with the method's outer optimizer, its staleness
    counted from now; or drop it, consumed, where the staleness policy says so. ``checked``: its check agreed first
    (a held update); an unchecked one counts toward what a repair would have to take out of θ. ``share``: the outer
    step takes this fraction of it (updates released together at one verdict, :func:`release_at_verdict`); the gate
    records it whole."""
    staleness = state.version - lease.base_version
    adjusted = apply_transforms(state.transforms, update, staleness, state.params, base)
    if adjusted.pseudo_gradient is None:
        # Dropped by policy (e.g. PolyThres): the work is consumed, θ is untouched, the version stays.
        state.applied[lease.lease_id] = state.version
        drop_unused_base_params(state)
        return [Rejected(lease.peer, lease.lease_id, adjusted.reason, RefusalCode.DROPPED)]
    retained = retain_before_step(state)
    stepped = adjusted.pseudo_gradient if share == 1.0 else adjusted.pseudo_gradient.mul(share)
    info_step = state.optimizer.step(state.params, stepped, adjusted.lr_scale, lease.steps)
    state.version += 1
    state.local_updates += lease.steps
    state.applied[lease.lease_id] = state.version
    if not checked:
        book = state.verification
        book.unchecked[lease.peer] = book.unchecked.get(lease.peer, 0) + 1
    gate_note = _after_step(state, lease, verdict, update, now, checked)
    return retained + [
        Applied(
            lease.peer,
            lease.lease_id,
            state.version,
            staleness,
            lease.steps,
            lease.shard,
            info_step.moved,
            f"{info_step.reason}; {adjusted.reason}{share_note}",
            gate_note,
            sketch,
        )
    ]


def _after_step(
    state: CoordinatorState, lease: Lease, verdict: GateVerdict | None, update: torch.Tensor, now: float,
    checked: bool = False,
) -> str:
    """Bookkeeping once θ moved: the gate records the update it passed (when it is applied: a held update's only once
    its check agreed, ``checked``), unused base parameters are dropped. Returns the gate's note for Applied ("" without
    a gate)."""
    policy = state.policy
    gate_note = ""
    if verdict is not None and policy.gate is not None:
        update_gate.record(policy.gate, state.gate, verdict, update, lease.steps, lease.peer, now, state.own_sketcher(),
                           lease_id=lease.lease_id, checked=checked)
        gate_note = f"clipped ×{verdict.scale:.3g}: {verdict.reason}" if verdict.action == "clip" else verdict.reason
    drop_unused_base_params(state)
    return gate_note


def apply_held(state: CoordinatorState, held: HeldUpdate, now: float, verified: bool = True, share: float = 1.0,
               share_note: str = "") -> list[Action]:
    """A held update whose check agreed: applied now, its staleness counted from now. A norm clip is lifted (its
    re-run shows the norm is what honest work from the peer's committed state gives — a newcomer's fresh AdamW state
    moves θ ≈ 3 × as far per step as its warmed-up peers'); weak agreement stays weak (that is about its direction)."""
    verdict = None if held.verdict is None else GateVerdict(**held.verdict)
    scale = held.scale
    if verified and verdict is not None and verdict.action == "clip" and not verdict.weak:
        scale = 1.0
        verdict = dataclasses.replace(verdict, action="accept", scale=1.0, reason=(
            f"passed the gate: its re-run agreed, so its norm {verdict.norm:.4g} is honest work's and is applied in "
            "full (unverified, it would have been scaled down to the gate's bound)"))
    update = held.update if scale == 1.0 else held.update.mul(scale)
    base = held.base if held.base.numel() else base_theta(state, held.lease.base_version)
    return _apply(state, held.lease, update, base, verdict, now, checked=verified, share=share, share_note=share_note)


def release_at_verdict(state: CoordinatorState, held: HeldUpdate | None, peer: str, now: float) -> list[Action]:
    """What reaches θ at a verdict of ``peer``'s that agreed: ``held``, the update it judged (None: applied first, or
    none), and — once the peer has passed its probation — the updates that waited for it (not re-run themselves),
    in lease order, unverified (a norm the gate clipped stays clipped).

    None of these was in θ when any other of them was trained: they are parallel work, not a peer's successive
    steps. Applied one after another at full size they moved θ k × as far as one lease would, each many versions
    stale — the cold-start spike (a GPU loan's 60m/150m runs diverged at four at a time, docs/gpu.md; in the
    simulator, two at a time, 3,291–4,965 against 1,691–2,029 averaged, docs/threat-model.md). With ``runtime.verify.average_released`` (the default)
    each of the k takes 1/k of an outer step, so together they move θ by their mean — how synchronous DiLoCo
    combines workers that started from one θ. The decision reads only the peer's own held updates: a peer caught
    on probation has none released, and θ still equals a replay without its submissions."""
    batch = ([] if held is None else [(held, True)]) + [(waiting, False) for waiting in _probation_released(state, peer)]
    policy = state.policy.verify
    share, note = 1.0, ""
    if len(batch) > 1 and policy is not None and policy.average_released:
        share = 1.0 / len(batch)
        note = f"; released with {len(batch) - 1} other held update(s) of its peer at one verdict: 1/{len(batch)} of a step"
    actions: list[Action] = []
    for update, verified in batch:
        actions += apply_held(state, update, now, verified=verified, share=share, share_note=note)
    return actions


def _probation_released(state: CoordinatorState, peer: str) -> list[HeldUpdate]:
    """Once ``peer`` has passed its probation, the updates that waited for it, taken out of the held book in lease
    order; none before."""
    book, policy = state.verification, state.policy.verify
    if policy is None or book.passed.get(peer, 0) < policy.probation_updates:
        return []
    waiting = sorted(lease_id for lease_id, held in book.held.items()
                     if held.lease.peer == peer and held.lease.verify.startswith(PROBATION_WAIT))
    return [book.held.pop(lease_id) for lease_id in waiting]


# ----------------------------------------------------------------------------------------- Discard


def on_discard(state: CoordinatorState, event: Discard, now: float) -> list[Action]:
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
    unindex_lease(state, lease)
    policy = state.policy.verify
    if policy is not None and policy.commit and event.state_end is not None:
        state.verification.chain[event.peer] = event.state_end  # its peer went on from there, as in the live run
    state.applied[lease.lease_id] = state.version  # consumed: a resend is a duplicate, its batches count as used
    for later in peer_leases(state, event.peer):
        if later.eager_of == lease.lease_id:  # accepted live: the lease whose start subtracted it is submitted as live
            later.eager_ready = True
    drop_unused_base_params(state)
    return [Rejected(event.peer, lease.lease_id, "update discarded: its peer was expelled", RefusalCode.DISCARDED)]
