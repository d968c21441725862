"""The coordinator's brain: ``handle(state, event, now) -> (state, actions)``.

One pure decision function, driven by the simulator's fake clock and by the networked daemon's
real clock alike. It owns no clock, no transport and no global randomness: ``now`` is passed in,
shard sampling draws from a counter-based generator seeded by ``state.seed``, and every action
carries a human-readable ``reason``.

Events and what the coordinator decides:

* :class:`SpeedReport` — a peer's measured throughput (tokens or samples per second), smoothed.
* :class:`RequestWork` — a peer wants a lease: answer now (:class:`Assign`) or hold it for the
  grace period (:class:`Hold`), paper Algorithm 2 / docs/algorithm.md §6. A held request is answered
  later by an :class:`Assign` emitted while handling another event.
* :class:`SubmitUpdate` — a pseudo-gradient arrives for a lease: validate it, apply it with the
  method's outer optimizer (:class:`Applied`), hold it until its check agrees when the lease was chosen for
  verification (:class:`Held`), acknowledge a resend without applying it twice (:class:`Duplicate`), or refuse it
  (:class:`Rejected`).
* :class:`Tick` — time passes: expired leases give their steps back (:class:`Expired`), held
  requests whose grace window closed are answered.
* :class:`PeerLeft` — a peer is gone: its leases are given back, it leaves the DyLU max.
* :class:`Verified` — a verifier re-ran a lease (coordinator/verify.py) and compared its pseudo-gradient with
  the one submitted: a match counts toward the peer's probation; a mismatch expels the peer (:class:`Expelled`:
  its leases are given back and everything it sends is turned away from then on). Which leases are re-run is
  decided here, when a lease is issued (:func:`verify_reason`: HMAC of the lease id under the run secret below
  ``fraction``, every update of a peer on probation, more for a suspect), and the update of such a lease is held
  (:class:`Held`, not applied) with a :class:`Verify` action carrying θ at its base version and the update as
  submitted; its ``Verified`` applies it (ok) or drops it (failed), so θ never holds checked work that failed. :class:`Discard` voids a lease's update (consumed, θ untouched): the repair after an expulsion
  replays the log with the expelled peer's submissions discarded (coordinator/verify.py, ``repair``), and
  :class:`Repaired` records what that repair decided beyond the replay (leases given back, the version jump), so a
  later repair's replay repeats it.
* :class:`Admit` / :class:`Revoke` — admission (``runtime.admission: token``): a verified token
  binds to the libp2p peer id that first uses it (:class:`Admitted` or :class:`Refused`); a revoked
  token's peer loses its leases and its say in DyLU. In ``token`` and ``allowlist`` mode, speed
  reports, lease requests and submissions of a peer that :func:`is_admitted` denies are ignored or
  refused before anything else looks at them (see ``coordinator/admission.py``).

Grace windows (offline Algorithm 2, run online with predicted completion times): when a peer that
just finished asks for work while other leases are expected to finish within ``grace`` seconds, a
window opens until ``now + grace``; every request in the window is held until all leases expected
inside the window have been applied (or expired), or the window closes, and then all held peers
get leases from the newest θ, in request order. In barrier mode (sync DiLoCo) the window never
closes by time: everyone waits for every lease of the round.

``handle`` mutates ``state`` in place (θ can be hundreds of MB) and returns it.

The package, each module importing only those listed before it: state.py (the state) and events.py (events and
actions); indexes.py (the derived indexes: the lease book, leases by deadline, the speed heap; queries.py asks them
read-only); draws.py (which leases are re-run, decided at issue); leases.py (RequestWork, Fetched, HoldDropped:
issuing with DyLU and Eq. 2, grace windows, give-backs, expiry, θ retained at base versions); peers.py (SpeedReport,
Hello, Tick, PeerLeft, Restarted, Reconfigured: speeds, liveness, a restart); submit.py (SubmitUpdate: refusals, the gate, held or applied,
the commitment chain, the apply path; Discard); verification.py (Verified, Unverified, held updates dropped,
Repaired); admission.py (Admit, Revoke, Fingerprint, and the admission gate). ``handle`` and ``new_state`` are here:
``handle`` dispatches each event to its module's public ``on_*`` handler, and this package re-exports only public
names (``__all__``); no module imports another's private name (tests/test_public_seams.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from asyncloco.algo.outer import OuterOptimizer
from asyncloco.algo.staleness import StalenessTransform
from asyncloco.coordinator.logic import admission, leases, peers, submit, verification
from asyncloco.coordinator.logic.admission import (
    MAX_INCOMPATIBLE, admission_code, admission_problem, is_admitted,
)
from asyncloco.coordinator.logic.draws import PROBATION_WAIT, gate_proven, must_check, verify_draw, verify_reason
from asyncloco.coordinator.logic.events import (
    Action, Admit, Admitted, Applied, Assign, Discard, Duplicate, Event, Expelled, Expired, Fetched, Fingerprint,
    Held, Hello, Hold, HoldDropped, Incompatible, Left, Notice, PeerLeft, Quarantined, Refused, Rejected, Released,
    Reconfigured, Repaired, RequestWork, Restarted, Revoke, Revoked, SpeedReport, SubmitUpdate, Tick, Unverified, Verdict, Verified, Verify,
)
from asyncloco.coordinator.logic.leases import (
    VERIFY_PIN_FACTOR, awaiting_verdicts, base_theta, fresh_reason, return_range, transfer_seconds,
)
from asyncloco.coordinator.logic.state import (
    AdmissionRecord, CoordinatorPolicy, CoordinatorState, DerivedIndexes, FRESH_STATE_DIGEST, HeldUpdate, Lease, PeerInfo,
    ShardState, VerificationState, VerifyPolicy, decision_record,
)
from asyncloco.coordinator.logic.submit import (
    checked_after, gate_verdict, holds, refused_as_sent, update_problem, validate_update,
)
from asyncloco.coordinator.logic.verification import void_leases


__all__ = [
    # the decision function
    "handle",
    "new_state",
    # the state (state.py)
    "AdmissionRecord",
    "CoordinatorPolicy",
    "CoordinatorState",
    "DerivedIndexes",
    "FRESH_STATE_DIGEST",
    "HeldUpdate",
    "Lease",
    "PeerInfo",
    "ShardState",
    "VerificationState",
    "VerifyPolicy",
    "decision_record",
    # events (events.py)
    "Event",
    "SpeedReport",
    "Hello",
    "RequestWork",
    "Fetched",
    "SubmitUpdate",
    "Tick",
    "PeerLeft",
    "Restarted",
    "Reconfigured",
    "HoldDropped",
    "Admit",
    "Revoke",
    "Fingerprint",
    "Verified",
    "Unverified",
    "Discard",
    "Repaired",
    # actions (events.py)
    "Action",
    "Assign",
    "Hold",
    "Applied",
    "Held",
    "Duplicate",
    "Rejected",
    "Expired",
    "Admitted",
    "Refused",
    "Revoked",
    "Quarantined",
    "Released",
    "Left",
    "Notice",
    "Verify",
    "Verdict",
    "Expelled",
    "Incompatible",
    # what callers outside the logic ask of it
    "MAX_INCOMPATIBLE",
    "admission_code",
    "admission_problem",
    "is_admitted",
    "PROBATION_WAIT",
    "must_check",
    "gate_proven",
    "verify_draw",
    "verify_reason",
    "VERIFY_PIN_FACTOR",
    "base_theta",
    "return_range",
    "transfer_seconds",
    "fresh_reason",
    "awaiting_verdicts",
    "checked_after",
    "gate_verdict",
    "holds",
    "refused_as_sent",
    "update_problem",
    "validate_update",
    "void_leases",
]


# ------------------------------------------------------------------------------------- decisions


def handle(state: CoordinatorState, event: Event, now: float) -> tuple[CoordinatorState, list[Action]]:
    """Decide what ``event`` at time ``now`` does. Mutates and returns ``state``."""
    if isinstance(event, (SpeedReport, Hello, RequestWork, Fetched, SubmitUpdate)) and not is_admitted(state, event.peer, now):
        # admission gate: an unadmitted peer gets nothing and has no say in DyLU
        return state, admission.turn_away(state, event, now)
    if isinstance(event, Admit):
        return state, admission.on_admit(state, event, now) + leases.release_held(state, now)
    if isinstance(event, Revoke):
        return state, admission.on_revoke(state, event, now) + leases.release_held(state, now)
    if isinstance(event, Fingerprint):
        return state, admission.on_fingerprint(state, event) + leases.release_held(state, now)
    if isinstance(event, SpeedReport):
        actions = peers.on_speed(state, event, now)
    elif isinstance(event, Hello):
        actions = peers.on_hello(state, event, now)
    elif isinstance(event, RequestWork):
        actions = leases.on_request(state, event, now)
    elif isinstance(event, Fetched):
        actions = leases.on_fetched(state, event, now)
    elif isinstance(event, SubmitUpdate):
        actions = submit.on_submit(state, event, now)
    elif isinstance(event, Tick):
        actions = peers.on_tick(state, now)
    elif isinstance(event, PeerLeft):
        actions = peers.on_peer_left(state, event, now)
    elif isinstance(event, Restarted):
        actions = peers.on_restarted(state, event, now)
    elif isinstance(event, Reconfigured):
        actions = peers.on_reconfigured(state, event)
    elif isinstance(event, HoldDropped):
        actions = leases.on_hold_dropped(state, event, now)
    elif isinstance(event, Verified):
        actions = verification.on_verified(state, event, now)
    elif isinstance(event, Discard):
        actions = submit.on_discard(state, event, now)
    elif isinstance(event, Repaired):
        actions = verification.on_repaired(state, event)
    elif isinstance(event, Unverified):
        actions = verification.on_unverified(state, event, now)
    else:
        raise TypeError(f"unknown event {event!r}")
    actions += leases.release_held(state, now)
    actions += peers.notice_peer_count(state)
    return state, actions


def new_state(
    params: torch.Tensor,
    optimizer: OuterOptimizer,
    transforms: Sequence[StalenessTransform],
    policy: CoordinatorPolicy,
    shard_sizes: Sequence[int],
    seed: int,
    lease_secret: bytes = b"",
) -> CoordinatorState:
    if params.dim() != 1 or params.dtype != torch.float32:
        raise ValueError("θ must be a flat float32 vector")
    if not shard_sizes or any(size <= 0 for size in shard_sizes):
        raise ValueError(f"every shard needs at least one batch, got sizes {list(shard_sizes)}")
    return CoordinatorState(
        params=params,
        optimizer=optimizer,
        transforms=list(transforms),
        policy=policy,
        shards=[ShardState(int(size)) for size in shard_sizes],
        seed=seed,
        lease_secret=lease_secret,
    )
