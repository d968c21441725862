"""Admission: who may take part (tokens, allowlist, revocations) and the fingerprint refusals, decided as events
(Admit, Revoke, Fingerprint); ``handle`` asks :func:`is_admitted` before any other handler sees a peer's event
(docs/guide/organiser.md "Admission", docs/threat-model.md; the tokens themselves: coordinator/admission.py)."""

from __future__ import annotations

from asyncloco.coordinator.logic.events import (
    Action, Admit, Admitted, Fetched, Fingerprint, Hello, Incompatible, PeerLeft, Refused, RequestWork, Revoke,
    Revoked, SpeedReport, SubmitUpdate,
)
from asyncloco.coordinator.logic.peers import on_peer_left
from asyncloco.coordinator.logic.state import AdmissionRecord, CoordinatorState
from asyncloco.coordinator.logic.verification import drop_revoked_held
from asyncloco.refusals import RefusalCode


# ------------------------------------------------------------------------------------ admission


def is_admitted(state: CoordinatorState, peer: str, now: float) -> bool:
    """May ``peer`` (an authenticated libp2p peer id) take part at ``now``? Always True in ``open`` mode for a
    peer that passed the compatibility check (or was not checked)."""
    if peer in state.verification.expelled:
        return False  # failed a verification: out for good, whatever the admission mode
    if peer in state.incompatible:
        return False  # failed the compatibility check (Fingerprint): until a check fits
    mode = state.policy.admission
    if mode == "open":
        return True
    if mode == "allowlist":
        return peer in state.policy.allowlist
    record = state.admitted.get(peer)
    return record is not None and now < record.expires_at and record.token_id not in state.revoked


def admission_code(state: CoordinatorState, peer: str) -> RefusalCode:
    """The typed code of :func:`admission_problem` (for a peer :func:`is_admitted` refuses)."""
    if peer in state.verification.expelled:
        return RefusalCode.EXPELLED
    if peer in state.incompatible:
        return RefusalCode.INCOMPATIBLE
    return RefusalCode.NOT_ADMITTED


def admission_problem(state: CoordinatorState, peer: str, now: float) -> str:
    if peer in state.verification.expelled:
        return f"expelled from this run: {state.verification.expelled[peer]}"
    if peer in state.incompatible:
        return state.incompatible[peer]
    mode = state.policy.admission
    if mode == "allowlist":
        return "this peer id is not in the run's runtime.allowlist; send it to the organiser"
    record = state.admitted.get(peer)
    if record is None:
        return "this run admits peers by token: join with --token (the organiser issues one with `asyncloco coordinator token`)"
    if record.token_id in state.revoked:
        return f"the token {record.token_id} admitting this peer was revoked"
    return f"the token {record.token_id} admitting this peer expired at {record.expires_at:.0f}; ask the organiser for a new one"


def turn_away(
    state: CoordinatorState, event: SpeedReport | Hello | RequestWork | Fetched | SubmitUpdate, now: float
) -> list[Action]:
    if isinstance(event, (SpeedReport, Hello, Fetched)):
        return []  # no effect on DyLU, and no journal line per DHT read (the request that follows is refused)
    lease_id = event.lease_id if isinstance(event, SubmitUpdate) else ""
    return [Refused(event.peer, "", admission_problem(state, event.peer, now), lease_id, admission_code(state, event.peer))]


MAX_INCOMPATIBLE = 10_000  # refused fingerprints remembered (the oldest is forgotten first)


def on_fingerprint(state: CoordinatorState, event: Fingerprint) -> list[Action]:
    if not event.reason:
        state.incompatible.pop(event.peer, None)
        return []
    if state.incompatible.get(event.peer) == event.reason:
        return []  # the same refusal again: nothing changed, nothing to journal
    state.incompatible.pop(event.peer, None)
    if len(state.incompatible) >= MAX_INCOMPATIBLE:
        state.incompatible.pop(next(iter(state.incompatible)))
    state.incompatible[event.peer] = event.reason
    state.held.pop(event.peer, None)
    return [Incompatible(event.peer, tuple(event.differing), event.peer_version, event.reason)]


def on_admit(state: CoordinatorState, event: Admit, now: float) -> list[Action]:
    peer, token_id = event.peer, event.token_id
    if state.policy.admission != "token":
        return [Refused(peer, token_id, f"this run does not admit by token (runtime.admission: {state.policy.admission})")]
    if token_id in state.revoked:
        return [Refused(peer, token_id, f"token {token_id} ({event.name}) was revoked")]
    if now >= event.expires_at:
        return [Refused(peer, token_id, f"token {token_id} ({event.name}) expired at {event.expires_at:.0f}; ask the organiser for a new one")]
    bound = state.token_peers.get(token_id)
    if bound is not None and bound != peer:
        return [
            Refused(
                peer,
                token_id,
                f"token {token_id} ({event.name}) is bound to another peer id ({bound}); a token admits the one "
                "identity that first used it: rejoin with that identity (--identity) or ask for a new token",
            )
        ]
    record = state.admitted.get(peer)
    if record is not None and record.token_id == token_id:
        return [Admitted(peer, token_id, event.name, False, "already admitted by this token")]
    if record is not None:
        state.token_peers.pop(record.token_id, None)  # a renewed token replaces the old binding
    state.admitted[peer] = AdmissionRecord(token_id, event.name, float(event.expires_at), now)
    state.token_peers[token_id] = peer
    return [Admitted(peer, token_id, event.name, True, f"token {token_id} ({event.name}) bound to this peer id until {event.expires_at:.0f}")]


def on_revoke(state: CoordinatorState, event: Revoke, now: float) -> list[Action]:
    if event.token_id in state.revoked:
        return []
    state.revoked[event.token_id] = float(event.revoked_at)
    peer = state.token_peers.get(event.token_id)
    actions: list[Action] = [Revoked(event.token_id, peer, "revoked by the organiser")]
    if peer is not None:
        record = state.admitted.get(peer)
        if record is not None and record.token_id == event.token_id:
            # the peer loses its leases and its say in DyLU, exactly as if it had left, and nothing more of it reaches
            # θ: its updates held for a verdict (their own or its probation's) are dropped
            actions += on_peer_left(state, PeerLeft(peer), now)
            actions += drop_revoked_held(state, peer)
    return actions
