"""Leases: RequestWork and Fetched, grace windows (requests held and answered together, paper Algorithm 2), issuing
(DyLU's steps, Eq. 2's shard, the lease id, whether it is re-run: draws.py), give-backs and expiry, and θ retained
at the base versions that leases still need."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math

import numpy as np
import torch

from asyncloco.algo.dylu import dylu_steps, link_steps, pipeline_seconds
from asyncloco.algo.grace import HoldDecision, hold_decision
from asyncloco.algo.sampler import sample_shard
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.logic.draws import PROBATION_WAIT, must_check, verify_draw, verify_reason
from asyncloco.coordinator.logic.events import (
    Action, Assign, Expired, Fetched, Hold, HoldDropped, Rejected, RequestWork,
)
from asyncloco.coordinator.logic.indexes import (
    expected_in_window, fastest_alive, index_lease, lease_book, leases_due, peer_leases, unindex_lease, version_needed,
)
from asyncloco.coordinator.logic.state import CoordinatorPolicy, CoordinatorState, Lease, PeerInfo
from asyncloco.refusals import RefusalCode


# ---------------------------------------------------------------------------- RequestWork, Fetched


def on_request(state: CoordinatorState, event: RequestWork, now: float) -> list[Action]:
    peer = event.peer
    info = state.peers.get(peer)
    if info is None or not info.alive:
        return [Rejected(peer, "", "no speed report from this peer yet; it must publish its throughput first", RefusalCode.NO_SPEED)]
    info.last_seen = now
    note_link(info, event.link_up, event.link_down)
    if update_gate.is_quarantined(state.gate, peer, now):
        until = state.gate.quarantined_until[peer]
        return [Rejected(peer, "", f"quarantined until {until:.0f} after repeated rejected updates", RefusalCode.QUARANTINED)]
    kept = event.keep if event.keep in state.leases and state.leases[event.keep].peer == peer else ""
    for lease in [lease for lease in peer_leases(state, peer) if lease.lease_id != kept][:1]:
        # A peer holds one lease at a time, and one more whose update it is uploading (``keep``: overlapped rounds):
        # asking again means it abandoned any other.
        return give_back(state, lease, "peer asked for new work before submitting") + on_request(state, event, now)
    if peer in state.held:
        return []
    policy = state.policy
    untrusted = held_untrusted(state, peer)
    if untrusted and not policy.barrier:
        # runtime.verify.serial_probation: an update of its probation (or a suspect's) waits for its verdict, from
        # whatever θ: no further lease until that verdict. Otherwise, behind a busy verifier, a newcomer keeps training
        # lease after lease whose updates all wait for its probation, then reach θ in one burst, each many versions
        # stale (a GPU loan's 60m and 150m runs: four at a time, 11-22 versions stale, perplexity 711 -> 62,346;
        # docs/gpu.md). With overlapped rounds it still trains the lease it has: at most two of its updates wait.
        state.held[peer] = now
        return [Hold(peer, math.inf, untrusted, f"its {len(untrusted)} update(s) held for a probation or suspect check "
                     "await their verdict: its next lease waits for it")]
    stacked = held_at_version(state, peer) or _probation_in_upload(state, peer)
    if stacked and not policy.barrier:
        # Its update from this very θ waits for its check (probation, a draw): a lease from the same θ again would
        # be a second step from one point, and both would reach θ (probation at a cold start: every peer's first
        # leases, all from θ₀, applied in one burst). It gets its lease once θ moves — at the next applied update,
        # its own or another's (release_held) — or its held update is dropped.
        state.held[peer] = now
        return [Hold(peer, math.inf, stacked, f"its update from θ(v{state.version}) awaits its check (held, or a probation "
                     "update on its way): the next lease starts from a newer θ")]
    if policy.barrier:
        # a round ends when its every update is in θ: a lease still out, or an update held for its check
        if state.verification.held or any(lease.base_version < state.version for lease in state.leases.values()):
            state.held[peer] = now
            waiting = tuple(sorted(state.leases) + sorted(state.verification.held))
            return [Hold(peer, math.inf, waiting, f"sync barrier: waiting for {len(waiting)} lease(s) of this round")]
        return [_issue(state, peer, now, "sync round starts")]
    if state.window_end is not None and now <= state.window_end:
        # Inside an open grace window (paper Alg. 2 and Fig. 3, docs/algorithm.md §6): join the held
        # group while updates expected in the window are outstanding; once they are all in, the window
        # is settled and a peer that finished inside it (B in Fig. 3) starts at once from the same θ
        # the group was released with — it never opens a window of its own that would chain to a
        # completion outside this one (C in Fig. 3).
        waiting = tuple(lid for lid in expected_in_window(state, state.window_end) if lid != kept)
        if not waiting:
            return [_issue(state, peer, now, "finished inside a settled grace window: starts from its newest θ")]
        state.held[peer] = now
        return [Hold(peer, state.window_end, waiting, "joined the open grace window")]
    decision = _grace_decision(state, now, kept)
    if decision.hold_until is None:
        return [_issue(state, peer, now, decision.reason)]
    state.window_end = decision.hold_until
    state.held[peer] = now
    return [Hold(peer, decision.hold_until, decision.waiting_for, decision.reason)]


def on_fetched(state: CoordinatorState, event: Fetched, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    if info is not None:
        info.last_seen = now
        info.fetched_version = max(info.fetched_version, event.version)
    for lease in peer_leases(state, event.peer):
        if lease.base_version == event.version:
            lease.fetched = True
            if lease.fetched_at is None:
                lease.fetched_at = now
    drop_unused_base_params(state)
    return []


# ---------------------------------------------------------------------- grace windows, HoldDropped


def release_held(state: CoordinatorState, now: float) -> list[Action]:
    """Answer held requests once their window is settled."""
    closed_short = None
    if state.policy.barrier and not state.leases and not state.verification.held:
        # A sync round whose leases were given back (expired, peer left) ends with fewer than N
        # arrivals buffered: step on their mean now, or the next round's updates would be averaged
        # into this round's step and every later round would stay misaligned. (Not while an update of
        # the round is held for its check: it arrives at its verdict.)
        closed_short = state.optimizer.flush(state.params)
    if not state.held:
        if state.window_end is not None and now > state.window_end:
            state.window_end = None
        return []
    pending: tuple[str, ...] = ()
    if state.policy.barrier:
        if state.leases or state.verification.held:
            return []
        reason = "sync barrier released: every lease of the round is in"
        if closed_short is not None:
            reason += f" or given back; {closed_short.reason}"
    else:
        window_end = state.window_end if state.window_end is not None else now
        pending = expected_in_window(state, window_end)
        if pending and now < window_end:
            return []
        reason = (
            "grace window closed" if pending else "every update expected in the grace window has been applied"
        )
    held = sorted(state.held.items(), key=lambda item: (item[1], item[0]))
    stacked: set[str] = set()
    if not state.policy.barrier:  # a peer whose update from this θ, or a probation one, awaits its check waits on (on_request)
        stacked = {h.lease.peer for h in state.verification.held.values() if h.lease.base_version == state.version}
        stacked.update(peer for peer, _ in held if held_untrusted(state, peer))
        stacked.update(peer for peer, _ in held if _probation_in_upload(state, peer))
        free = [peer for peer, _ in held if peer not in stacked]
        if free and state.window_end is None:
            # Peers held while their own update awaited its check, free now that θ moved: answered as their request
            # would have been — held in a grace window while updates are expected within the grace period (Alg. 2),
            # not each at once from the θ of the moment, a version or two apart from the peers finishing with them.
            decision = _grace_decision(state, now, "")
            if decision.hold_until is not None:
                state.window_end = decision.hold_until
                return [Hold(peer, decision.hold_until, decision.waiting_for, decision.reason) for peer in free]
    state.held.clear()
    state.held.update((peer, since) for peer, since in held if peer in stacked)
    held = [item for item in held if item[0] not in stacked]
    if state.policy.barrier or pending:
        state.window_end = None
    # Otherwise the window stays open (settled) until its end, so that peers whose updates were
    # applied inside it and who ask a moment later join this group instead of opening a chained one.
    actions: list[Action] = []
    for peer, _ in held:
        info = state.peers.get(peer)
        if info is None or not info.alive:
            continue
        actions.append(_issue(state, peer, now, reason))
    return actions


def _grace_decision(state: CoordinatorState, now: float, kept: str) -> HoldDecision:
    """Whether a peer asking now is held (Alg. 2): while another lease is expected to finish within the grace period
    (``kept``, the asking peer's own lease in upload, aside)."""
    soon = [lid for lid in expected_in_window(state, now + state.policy.grace_period) if lid != kept]  # O(k + log n)
    return hold_decision(now, ((lid, state.leases[lid].expected_finish) for lid in soon), state.policy.grace_period)


def _probation_in_upload(state: CoordinatorState, peer: str) -> tuple[str, ...]:
    """The probation lease from θ's current version that ``peer``, asking for its next lease, is still uploading (the
    one it keeps: overlapped rounds). Its update will be held for its check like one already submitted: a lease from the
    same θ now would be a second step from one point — at a cold start every newcomer's first two leases from θ₀,
    applied in one burst."""
    return tuple(lease.lease_id for lease in peer_leases(state, peer)
                 if lease.base_version == state.version and lease.verify.startswith("probation"))


def held_untrusted(state: CoordinatorState, peer: str) -> tuple[str, ...]:
    """With ``runtime.verify.serial_probation``: the lease ids of ``peer``'s updates held for a check that holds
    whatever the verifier's backlog (``must_check``: its probation, the leases waiting on it, a suspect's draws), from
    any θ; else none."""
    policy = state.policy.verify
    if policy is None or not policy.serial_probation:
        return ()
    return tuple(sorted(lease_id for lease_id, held in state.verification.held.items()
                        if held.lease.peer == peer and must_check(held.lease)))


def held_at_version(state: CoordinatorState, peer: str) -> tuple[str, ...]:
    """The lease ids of ``peer``'s updates held for their checks that start from θ's current version."""
    return tuple(sorted(lease_id for lease_id, held in state.verification.held.items()
                        if held.lease.peer == peer and held.lease.base_version == state.version))


def on_hold_dropped(state: CoordinatorState, event: HoldDropped, now: float) -> list[Action]:
    """A held request whose RPC is gone: forgotten, with nothing to answer."""
    state.held.pop(event.peer, None)
    return []


# ---------------------------------------------- issuing: DyLU's steps, Eq. 2's shard, the lease id


def _issue(state: CoordinatorState, peer: str, now: float, why: str) -> Assign:
    policy = state.policy
    info = state.peers[peer]
    speed = _effective_speed(state, info)
    if policy.dylu:
        fastest = max(_dylu_reference(state, now), speed)
        steps = dylu_steps({peer: speed, "": fastest}, peer, policy.max_local_steps, policy.min_steps)
        why_steps = f"DyLU: {steps} steps at {speed:.4g} units/s vs fastest {fastest:.4g}"
    else:
        steps = policy.max_local_steps
        why_steps = f"{steps} steps (fixed H)"
    if policy.link_steps:  # schedule.local_steps: auto — compute covers the peer's transfers
        transfer = transfer_seconds(policy, info)
        if transfer is not None:
            step_s = policy.units_per_step / _link_speed(state, info)
            sized = link_steps(steps, transfer, step_s, policy.transfer_cover, policy.max_auto_steps)
            if sized != steps:
                why_steps += f"; {sized} to cover {transfer:.3g} s of transfers (k = {policy.transfer_cover:g})"
                steps = sized
    sizes = [s.size for s in state.shards]
    progress = [s.assigned for s in state.shards]
    if policy.shard_progress == "learned":
        # Eq. 2 as the paper counts it: data points learned, i.e. without the steps still in flight
        in_flight = lease_book(state).in_flight
        progress = [p - f for p, f in zip(progress, in_flight)]
    shard_index = sample_shard(sizes, progress, _next_uniform(state))
    shard = state.shards[shard_index]
    lr_offset = shard.assigned
    if shard.returned:
        start, available = shard.returned.pop(0)
        if available > steps:
            shard.returned.insert(0, (start + steps, available - steps))
        else:
            steps = available
            why_steps += f"; shortened to {steps} to re-train a range given back by an abandoned lease"
    else:
        start = shard.cursor
        shard.cursor += steps
    shard.assigned += steps
    state.lease_counter += 1
    duration = steps * policy.units_per_step / speed
    transfer = transfer_allowance(policy, info)
    lease = Lease(
        lease_id=_lease_id(state),
        peer=peer,
        shard=shard_index,
        start_offset=start,
        steps=steps,
        lr_offset=lr_offset,
        base_version=state.version,
        issued_at=now,
        expected_finish=now + duration,
        deadline=now + min(duration * policy.lease_timeout_factor + policy.lease_slack + transfer, policy.max_lease_s),
        # a peer that already holds θ at this version (it prefetched the newest θ while its last update was on the
        # way) trains without downloading it again. Unmarked, a repair gave such leases back as "not downloaded"
        # while their peers trained on them (warm colluder benchmark)
        held=info.fetched_version == state.version,
    )
    if policy.verify is not None:
        lease = dataclasses.replace(lease, verify=verify_reason(state, policy.verify, peer, lease.lease_id))
    fresh = fresh_reason(policy, info)
    if fresh and carries_checked(policy, info):
        fresh = ""  # its start is the end state of its previous lease's re-run, kept here: no reveal needed
    if fresh:
        lease = dataclasses.replace(lease, fresh=True)
        why_steps += f"; {fresh}"
    lease, shed = draw_carry(state, policy, info, lease)
    if shed:
        why_steps += f"; {shed}"
    lease = eager_of(state, lease)
    if lease.eager_of:
        why_steps += f"; eager start: θ − {lease.eager_share:g} × the update of {lease.eager_of}, still on its way"
    state.leases[lease.lease_id] = lease
    index_lease(state, lease)
    return Assign(peer, lease, f"{why}; {why_steps}; shard {shard_index} sampled by Eq. 2")


def eager_of(state: CoordinatorState, lease: Lease) -> Lease:
    """``lease`` with its eager start (algo/eager.py) when the policy has one: its peer's other lease still out — the
    one it keeps while uploading it (``RequestWork.keep``; on_request gave back any other), whose update is therefore
    not in θ at this lease's base version. Not in a sync round (every update of a round is in before the next), and not
    while the updates kept for checked leases' eager starts fill ``VerifyPolicy.eager_keep_bytes`` — for any lease,
    checked or not, so that the grant tells a peer nothing of its draw."""
    share = state.policy.eager_share
    if share <= 0 or state.policy.barrier:
        return lease
    verify = state.policy.verify
    if verify is not None and len(state.verification.eager) * 4 * state.params.numel() >= verify.eager_keep_bytes:
        return lease
    out = [other.lease_id for other in peer_leases(state, lease.peer) if other.lease_id != lease.lease_id]
    if len(out) != 1:
        return lease
    return dataclasses.replace(lease, eager_of=out[0], eager_share=share)


def _effective_speed(state: CoordinatorState, info: PeerInfo) -> float:
    """The claim as DyLU uses it: capped by what the peer delivered, unless speeds are trusted."""
    if state.policy.trust_speeds or info.observed is None:
        return info.speed
    return min(info.speed, info.observed * state.policy.speed_cap_factor)


def _link_speed(state: CoordinatorState, info: PeerInfo) -> float:
    """The device speed that sizes a lease to cover the peer's transfers: its claim, capped at
    ``link_speed_cap_factor`` × its delivered throughput (which a slow link holds down, state.py)."""
    if state.policy.trust_speeds or info.observed is None:
        return info.speed
    return min(info.speed, info.observed * state.policy.link_speed_cap_factor)


def _dylu_reference(state: CoordinatorState, now: float) -> float:
    """The fastest speed DyLU scales by. Trusted speeds: the max over alive peers. Otherwise over alive,
    unquarantined peers: a proven peer (one that delivered) counts at its capped claim; an unproven claim
    counts at most 4× the median claim, and only until the peer gives a lease back without delivering — so a
    ghost that never submits moves honest steps by a bounded factor, for at most one lease deadline."""
    if state.policy.trust_speeds:
        return fastest_alive(state)
    candidates = [
        info for name, info in state.peers.items() if info.alive and not update_gate.is_quarantined(state.gate, name, now)
    ]
    claims = sorted(info.speed for info in candidates) or sorted(info.speed for info in state.peers.values() if info.alive)
    half = len(claims) // 2
    middle = claims[half] if len(claims) % 2 else 0.5 * (claims[half - 1] + claims[half])
    cap = 4.0 * middle
    counted = [
        _effective_speed(state, info) if info.observed is not None else min(info.speed, cap)
        for info in candidates
        if info.observed is not None or not info.failed
    ]
    return max(counted) if counted else min(claims[-1], cap)


def note_link(info: PeerInfo, link_up: float | None, link_down: float | None) -> None:
    """Keep the link rates a speed report or a lease request states (finite and positive, else the known ones)."""
    for name, rate in (("link_up", link_up), ("link_down", link_down)):
        if rate is not None and math.isfinite(rate) and rate > 0:
            setattr(info, name, float(rate))


def transfer_allowance(policy: CoordinatorPolicy, info: PeerInfo) -> float:
    """Seconds a lease's deadline allows for its peer's time on the wire: its last upload as the coordinator measured
    it, scaled to a download plus an upload (their byte ratio), with a 2× margin — until measured, the configured
    allowance (``runtime.transfer_allowance_s``)."""
    if info.transfer_s is None:
        return policy.transfer_allowance_s
    return 2.0 * info.transfer_s * (1.0 + policy.download_upload_ratio)


def fresh_reason(policy: CoordinatorPolicy, info: PeerInfo) -> str:
    """Why a lease of the peer ``info`` starts from a fresh inner state ("" when it carries its state): with
    commitments, its reported uplink is below ``VerifyPolicy.fresh_below`` — a reveal of its carried state would not
    arrive (below the RPC floor) or would hold its uplink longer than ``runtime.verify.fresh_start_reveal_s``. Not a
    leniency: the check of a fresh lease re-runs it from θ and the data, which need no reveal, and a peer that
    reports a slow uplink only gives up its carried state. An uplink not yet reported carries its state."""
    verify = policy.verify
    if verify is None or not verify.commit or verify.fresh_below <= 0 or info.link_up is None:
        return ""
    if info.link_up >= verify.fresh_below:
        return ""
    return (f"fresh inner state: uplink {info.link_up / 1e3:.3g} kB/s, below the {verify.fresh_below / 1e3:.3g} kB/s "
            "a reveal needs (runtime.verify.fresh_start_reveal_s)")


CARRIED_ON = "chained: re-run so that the peer's next lease may carry its end state (a slow uplink)"
"""The check reason of a lease re-run because the lease after it carries its end state (:func:`draw_carry`)."""


def carries_checked(policy: CoordinatorPolicy, info: PeerInfo) -> bool:
    """Does a lease of a peer whose uplink cannot carry a reveal (:func:`fresh_reason`) carry its inner state all the
    same? Where its start will be at hand without a reveal: the peer's previous lease is re-run by this coordinator on
    the peer's own compute class (``VerifyPolicy.keep_class``), and its passed re-run keeps that lease's end state
    bitwise (coordinator/chained.py) — the start this lease commits to. Which previous leases that is was decided at
    their grant (:func:`draw_carry`). A start not at hand after all (a restart, a kept state dropped, the previous
    lease given back) ends the check unverified, never failed (coordinator/verify.py)."""
    verify = policy.verify
    return (verify is not None and bool(verify.keep_class) and info.device_class == verify.keep_class
            and info.carry_next)


def draw_carry(state: CoordinatorState, policy: CoordinatorPolicy, info: PeerInfo, lease: Lease) -> tuple[Lease, str]:
    """Will the lease after ``lease`` carry its peer's inner state (:func:`carries_checked`)? For a peer whose uplink
    cannot carry a reveal, on a draw of its own (``VerifyPolicy.slow_carry``, HMAC of the lease id), independent of
    ``lease``'s check draw — and then ``lease`` is re-run whatever that draw was (:data:`CARRIED_ON`; its base θ is
    retained as a drawn lease's). The peer sees the outcome at its next grant, usually before it has submitted
    ``lease`` (asked ahead): a carry tells it ``lease`` is checked, a fresh start that it is checked at the usual
    fraction — never less. A probation lease is re-run anyway (and known to be), so the next one carries; a probation
    wait (held, not re-run) is not made a re-run.

    Back-pressure (``VerifyPolicy.carry_backlog_bytes``): while the updates and base θs kept for the peer's checks
    awaiting their verdicts take that many bytes, nothing is carried on — a carried-on lease's check waits for the one
    before it outside the verifier's queue, with its update and base θ kept, so a verifier slower than the re-runs asked
    of it would grow that chain without bound. The lease after it starts fresh instead, and ``lease`` is checked at the
    usual fraction: the optional re-runs are shed, never the drawn ones (the queue, ``runtime.verify.queue``, bounds
    those). Per peer, so that one peer's backlog never sheds another's.

    Returns ``lease`` as granted (its ``verify`` set when it is carried on) and why nothing was carried ("")."""
    verify = policy.verify
    info.carry_next = False
    if verify is None or not verify.keep_class or info.device_class not in ("", verify.keep_class):
        return lease, ""
    if not fresh_reason(policy, info) or lease.verify.startswith(PROBATION_WAIT):
        return lease, ""
    awaiting = awaiting_verdicts(state, lease.peer)
    kept = awaiting * 8 * state.params.numel()  # an update and a base θ, fp32, for each (logic/state.py applied_first)
    if kept >= verify.carry_backlog_bytes:
        return lease, (f"not carried on: {awaiting} of its checks await their verdicts, {kept / 2**20:.4g} MB kept for "
                       f"them (runtime.verify.carry_backlog_mb {verify.carry_backlog_bytes / 2**20:.4g}): the next lease "
                       "starts fresh")
    if lease.verify.startswith("probation ("):
        info.carry_next = True
    elif verify_draw(state.lease_secret, f"carry:{lease.lease_id}") < verify.slow_carry:
        info.carry_next = True
        if not lease.verify:
            lease = dataclasses.replace(lease, verify=CARRIED_ON)
    return lease, ""


def awaiting_verdicts(state: CoordinatorState, peer: str) -> int:
    """How many of ``peer``'s checks await their verdicts (applied first, or held for them): ``VerificationState.pending``
    — at most the verifier's queue and the checks waiting in a chain, O(that) to count."""
    return sum(1 for owner in state.verification.pending.values() if owner == peer)


def transfer_seconds(policy: CoordinatorPolicy, info: PeerInfo) -> float | None:
    """The seconds a peer's lease must cover per round, t_up + m · t_down (algo/dylu.py ``pipeline_seconds``: its
    previous upload and the next lease's ask-ahead lead): one upload and one θ download at its reported link rates;
    without a reported upload rate, its last upload as the coordinator measured it; before its first upload, the upload
    at its download rate (a home link is rarely faster up than down: a lower bound on the upload's time, so the lease
    in training while the first upload runs covers that much of it instead of DyLU's few steps — on `home150` the
    training waited ≈ 15 s for the first upload, docs/wan.md); without a download rate, the upload's time scaled by
    the bytes' ratio. None until something is known."""
    up = policy.upload_bytes / info.link_up if info.link_up and policy.upload_bytes else info.transfer_s
    if up is None and info.link_down and policy.upload_bytes:
        up = policy.upload_bytes / info.link_down
    if up is None:
        return None
    down = policy.download_bytes / info.link_down if info.link_down and policy.download_bytes else up * policy.download_upload_ratio
    return pipeline_seconds(up, down)


def _next_uniform(state: CoordinatorState) -> float:
    # Counter-based: the n-th lease's draw depends only on (seed, n), so a resumed coordinator draws
    # exactly what an uninterrupted one would have.
    return float(np.random.default_rng([state.seed, state.lease_counter]).random())


def _lease_id(state: CoordinatorState) -> str:
    """The id of lease number ``state.lease_counter``: sequential without a secret (the simulator), else an
    HMAC of the counter — unguessable by other peers, and the same again when a log is replayed."""
    if not state.lease_secret:
        return f"L{state.lease_counter:08d}"
    digest = hmac.new(state.lease_secret, state.lease_counter.to_bytes(8, "big"), hashlib.sha256).hexdigest()
    return "L" + digest[:24]


# --------------------------------------------------------------------------- give-backs and expiry


def give_back(state: CoordinatorState, lease: Lease, why: str) -> list[Action]:
    del state.leases[lease.lease_id]
    state.verification.eager.pop(lease.lease_id, None)
    unindex_lease(state, lease)
    info = state.peers.get(lease.peer)
    if info is not None and info.observed is None:
        info.failed = True
    return_range(state, lease)
    drop_unused_base_params(state)
    return [Expired(lease.peer, lease.lease_id, lease.shard, lease.steps, f"{why}; {lease.steps} steps given back to shard {lease.shard}")]


def return_range(state: CoordinatorState, lease: Lease) -> None:
    """Give ``lease``'s shard range back (its batches are issued again first; Eq. 2's progress forgets its steps)."""
    shard = state.shards[lease.shard]
    shard.assigned -= lease.steps
    if lease.start_offset + lease.steps == shard.cursor and not shard.returned:
        shard.cursor = lease.start_offset  # the newest range: simply rewind
    else:
        shard.returned.append((lease.start_offset, lease.steps))
        shard.returned.sort()


def expire(state: CoordinatorState, now: float) -> list[Action]:
    actions: list[Action] = []
    for lease_id in sorted(leases_due(state, "deadline", now, strict=True)):
        lease = state.leases[lease_id]
        actions += give_back(state, lease, f"lease deadline {lease.deadline:.1f} passed")
    return actions


# --------------------------------------------------------------------------- θ retained for leases


def base_theta(state: CoordinatorState, version: int) -> torch.Tensor | None:
    """θ at ``version`` (the live tensor for the current version — clone before releasing the lock), or
    None when it is no longer retained."""
    if version == state.version:
        return state.params
    return state.base_params.get(version)


def retain_before_step(state: CoordinatorState) -> list[Action]:
    """Copy-on-write of θ before the optimizer changes it: keep the current version when a lease still
    needs it (θ not downloaded yet, or a staleness transform wants the base). At most
    ``max_retained_versions`` older versions are kept: past that, the oldest not-yet-downloaded leases are
    given back (their peers ask again and start from the newest θ)."""
    if state.version not in state.base_params and version_needed(state, state.version):
        state.base_params[state.version] = state.params.clone()
    actions: list[Action] = []
    cap = state.policy.max_retained_versions
    while len(state.base_params) > cap:
        # Versions kept only for a pending verification (the lease downloaded its θ long ago) never cost a peer its
        # lease: up to VERIFY_PIN_FACTOR × cap of them are kept beside the cap, and beyond that the oldest one's checks
        # are dropped (counted as unverifiable), not the leases.
        serving = sorted(v for v in state.base_params if _serves_download(state, v))
        if len(serving) <= cap and len(state.base_params) <= cap * (1 + VERIFY_PIN_FACTOR):
            break
        oldest = serving[0] if len(serving) > cap else min(state.base_params)
        for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
            if lease.base_version != oldest:
                continue
            if lease.fetched and not state.needs_base_params and lease.verify and not must_check(lease):
                lease.verify = ""  # its check is dropped: the base it would re-run from is gone
                state.verification.unverifiable += 1
            else:
                actions += give_back(state, lease, f"θ of version {oldest} is no longer retained")
        state.base_params.pop(oldest, None)
    return actions


VERIFY_PIN_FACTOR = 4


def _serves_download(state: CoordinatorState, version: int) -> bool:
    """Does a lease still need θ(``version``) for a download or a staleness transform (not only for its check)?"""
    ids = lease_book(state).by_version.get(version, {})
    for lease_id in ids:
        lease = state.leases.get(lease_id)
        if lease is not None and lease.base_version == version and (state.needs_base_params or not lease.fetched):
            return True
    return False


def drop_unused_base_params(state: CoordinatorState) -> None:
    if not state.base_params:
        return
    for version in list(state.base_params):  # at most max_retained_versions (+1), each O(1) amortised
        if not version_needed(state, version):
            del state.base_params[version]
