"""Which leases a verifier re-runs, and why (``Lease.verify``): decided when a lease is issued (leases.py) and never
told to the peer — every lease of a peer on probation, every lease of a suspect (its update sketch, or the gate's
recent verdicts), else an HMAC draw under the run secret below ``fraction``. The verdicts are verification.py's."""

from __future__ import annotations

import hashlib
import hmac

from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.logic.state import CoordinatorState, Lease, VerifyPolicy


PROBATION_WAIT = "probation: held until the peer's probation checks agree, not re-run"


def gate_proven(state: CoordinatorState, lease: Lease) -> bool:
    """Is ``lease``'s update judged by the gate as from a peer past its probation (``gate.score``'s ``proven``)? Yes
    once the peer has passed its verification probation (its first leases re-run bitwise: a stronger proof of honest
    work than the gate's count of accepted updates), and for a lease issued while those checks were on their way
    (:data:`PROBATION_WAIT`: applied only once the peer has passed). A newcomer's fresh AdamW state moves θ ≈ 3× as far
    per step as its warmed-up peers': the gate's tightened probation clipped such proven honest work to 2× the median
    (3 of 97 honest updates in a warm benchmark run)."""
    policy = state.policy.verify
    if policy is None or policy.probation_updates <= 0:
        return False
    return lease.verify.startswith(PROBATION_WAIT) or state.verification.passed.get(lease.peer, 0) >= policy.probation_updates


def must_check(lease: Lease) -> bool:
    """A check that is never dropped, even when the θ it would re-run from costs memory: probation and a suspect's
    draw. A peer that holds such a lease until its base θ is no longer retained gets it given back instead —
    otherwise a deliberately slow client would skip its probation (its update applied unchecked)."""
    return lease.verify.startswith(("probation", "suspect"))


def verify_draw(secret: bytes, lease_id: str) -> float:
    """A uniform number in [0, 1) from HMAC-SHA256(run secret, lease id): fixed by the lease, unknowable to a peer
    (it never learns the secret), and the same again when the log is replayed."""
    digest = hmac.new(secret, b"asyncloco-verify:" + lease_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


def verify_reason(state: CoordinatorState, policy: VerifyPolicy, peer: str, lease_id: str) -> str:
    """Why ``peer``'s lease ``lease_id`` is to be re-run, or "" when it is not: every lease while the peer has
    fewer than ``probation_updates`` verified updates, then every lease while its update sketch makes it a suspect
    (coordinator/sketch.py: ``sketch_checks`` leases after a score above ``sketch_threshold``), then
    ``suspect_fraction`` of them while the gate refused one of its recent updates, else ``fraction``. Decided when the lease is issued, never told to the peer. Checks on
    their way count toward probation (its leases chosen and still active, its applied updates awaiting a verdict):
    a fast peer's probation is ``probation_updates`` re-runs, not every lease it takes before its first verdicts."""
    passed = state.verification.passed.get(peer, 0)
    if passed < policy.probation_updates:
        on_the_way = sum(1 for owner in state.verification.pending.values() if owner == peer)
        on_the_way += sum(1 for lease in state.leases.values() if lease.peer == peer and lease.verify)
        if passed + on_the_way < policy.probation_updates:
            return f"probation ({passed} of {policy.probation_updates} verified" + (f", {on_the_way} on the way)" if on_the_way else ")")
        # its probation checks are all on their way: this lease is not re-run, but its update waits for them (a peer
        # that cheats from its first lease must not get a later one into θ before its first verdict)
        return f"{PROBATION_WAIT} ({passed} of {policy.probation_updates} verified, {on_the_way} on the way)"
    sketches = state.verification.sketch
    if sketches.flagged.get(peer, 0) > 0:  # its updates keep a direction the others' do not (coordinator/sketch.py)
        sketches.flagged[peer] -= 1
        if not sketches.flagged[peer]:
            del sketches.flagged[peer]
        return (f"suspect: its updates keep one direction the other peers' do not (residual cosine "
                f"{sketches.score.get(peer, float('nan')):.2f} with its previous update)")
    draw = verify_draw(state.lease_secret, lease_id)
    suspect = update_gate.suspect(state.gate, peer)  # a counted gate rejection or weak agreement, recently
    if suspect and draw < policy.suspect_fraction:
        return f"suspect, sampled at {policy.suspect_fraction:g} ({suspect})"
    if draw < policy.fraction:
        return f"sampled at {policy.fraction:g}"
    return ""
