"""Leases: speeds and DyLU, issuing, the per-event indexes of the lease table, holds, expiry, give-backs,
and which leases are re-run for verification (``verify_draw``/``verify_reason``)."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import heapq
import hmac
import math

import numpy as np
import torch

from asyncloco.algo.dylu import dylu_steps, link_steps
from asyncloco.algo.grace import hold_decision
from asyncloco.algo.sampler import sample_shard
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.logic.events import (
    Action, Assign, Expired, Fetched, Hello, Hold, Left, Notice, PeerLeft, Rejected, Released, RequestWork,
    Restarted, SpeedReport,
)
from asyncloco.coordinator.logic.state import CoordinatorPolicy, CoordinatorState, Lease, PeerInfo, VerifyPolicy, _LeaseBook
from asyncloco.refusals import RefusalCode


def _on_speed(state: CoordinatorState, event: SpeedReport, now: float) -> list[Action]:
    """Take a throughput claim. The peer smooths its own measurements, so a new report replaces the
    old value (no second smoothing here); a record read again with the same timestamp is no new sample.
    Unless ``trust_speeds`` (the simulator), a DHT record counts only for a peer that said hello over its
    authenticated RPC and only when signed by the key it bound there, and never from the future."""
    speed = float(event.units_per_second)
    if not (math.isfinite(speed) and speed > 0):
        return []  # a bogus report never reaches DyLU; the peer keeps its previous speed
    info = state.peers.get(event.peer)
    if not state.policy.trust_speeds and event.signer is not None:
        if info is None or info.signer is None or info.signer != event.signer:
            return []  # about a peer that never said hello, or signed by a key that is not its own
    if event.reported_at is not None:
        if event.reported_at > now + state.policy.max_clock_skew:
            return []
        if info is not None and info.reported_at is not None and event.reported_at <= info.reported_at:
            return []
    if info is None or not info.alive:
        keep = info if info is not None else PeerInfo(speed, now)
        keep.speed, keep.last_seen, keep.alive, keep.reported_at = speed, now, True, event.reported_at
        _note_link(keep, event)
        state.peers[event.peer] = keep
        _note_speed(state, event.peer)
        return []
    info.speed, info.last_seen = speed, now
    if event.reported_at is not None:
        info.reported_at = event.reported_at
    _note_link(info, event)
    _note_speed(state, event.peer)
    return []


def _note_link(info: PeerInfo, event: SpeedReport) -> None:
    """Keep the link rates and time split a speed report carries (finite and positive / non-negative, else kept)."""
    for name in ("link_up", "link_down"):
        rate = getattr(event, name)
        if rate is not None and math.isfinite(rate) and rate > 0:
            setattr(info, name, float(rate))
    split = event.time_split
    if split is not None and len(split) == 4 and all(math.isfinite(s) and s >= 0 for s in split):
        info.time_split = (float(split[0]), float(split[1]), float(split[2]), float(split[3]))


def transfer_seconds(policy: CoordinatorPolicy, info: PeerInfo) -> float | None:
    """A peer's seconds on the wire per round, t_up + t_down: one upload and one θ download at its reported link rates;
    without a reported upload rate, its last upload as the coordinator measured it; without a download rate, the
    upload's time scaled by the bytes' ratio. None until something is known."""
    up = policy.upload_bytes / info.link_up if info.link_up and policy.upload_bytes else info.transfer_s
    if up is None:
        return None
    down = policy.download_bytes / info.link_down if info.link_down and policy.download_bytes else up * policy.download_upload_ratio
    return up + down


def _on_hello(state: CoordinatorState, event: Hello, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    speed = event.units_per_second
    if info is None:
        if speed is None or not (math.isfinite(speed) and speed > 0):
            return []  # registered once it reports a usable speed
        info = state.peers[event.peer] = PeerInfo(float(speed), now)
    elif speed is not None and math.isfinite(speed) and speed > 0:
        info.speed = float(speed)
    info.alive, info.last_seen = True, now
    _note_speed(state, event.peer)
    info.signer = event.signer  # the authenticated peer itself re-binds its key (a restart makes a new one)
    info.name = event.name[:64]
    return []


def _effective_speed(state: CoordinatorState, info: PeerInfo) -> float:
    """The claim as DyLU uses it: capped by what the peer delivered, unless speeds are trusted."""
    if state.policy.trust_speeds or info.observed is None:
        return info.speed
    return min(info.speed, info.observed * state.policy.speed_cap_factor)


def _dylu_reference(state: CoordinatorState, now: float) -> float:
    """The fastest speed DyLU scales by. Trusted speeds: the max over alive peers. Otherwise over alive,
    unquarantined peers: a proven peer (one that delivered) counts at its capped claim; an unproven claim
    counts at most 4× the median claim, and only until the peer gives a lease back without delivering — so a
    ghost that never submits moves honest steps by a bounded factor, for at most one lease deadline."""
    if state.policy.trust_speeds:
        return _fastest_alive(state)
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

def _alive_speeds(state: CoordinatorState) -> dict[str, float]:
    return {name: info.speed for name, info in state.peers.items() if info.alive}


def _on_request(state: CoordinatorState, event: RequestWork, now: float) -> list[Action]:
    peer = event.peer
    info = state.peers.get(peer)
    if info is None or not info.alive:
        return [Rejected(peer, "", "no speed report from this peer yet; it must publish its throughput first", RefusalCode.NO_SPEED)]
    info.last_seen = now
    if update_gate.is_quarantined(state.gate, peer, now):
        until = state.gate.quarantined_until[peer]
        return [Rejected(peer, "", f"quarantined until {until:.0f} after repeated rejected updates", RefusalCode.QUARANTINED)]
    kept = event.keep if event.keep in state.leases and state.leases[event.keep].peer == peer else ""
    for lease in [lease for lease in _peer_leases(state, peer) if lease.lease_id != kept][:1]:
        # A peer holds one lease at a time, and one more whose update it is uploading (``keep``: overlapped rounds):
        # asking again means it abandoned any other.
        return _give_back(state, lease, "peer asked for new work before submitting") + _on_request(state, event, now)
    if peer in state.held:
        return []
    policy = state.policy
    if policy.barrier:
        if any(lease.base_version < state.version for lease in state.leases.values()):
            state.held[peer] = now
            waiting = tuple(sorted(state.leases))
            return [Hold(peer, math.inf, waiting, f"sync barrier: waiting for {len(waiting)} lease(s) of this round")]
        return [_issue(state, peer, now, "sync round starts")]
    if state.window_end is not None and now <= state.window_end:
        # Inside an open grace window (paper Alg. 2 and Fig. 3, docs/algorithm.md §6): join the held
        # group while updates expected in the window are outstanding; once they are all in, the window
        # is settled and a peer that finished inside it (B in Fig. 3) starts at once from the same θ
        # the group was released with — it never opens a window of its own that would chain to a
        # completion outside this one (C in Fig. 3).
        waiting = tuple(lid for lid in _expected_in_window(state, state.window_end) if lid != kept)
        if not waiting:
            return [_issue(state, peer, now, "finished inside a settled grace window: starts from its newest θ")]
        state.held[peer] = now
        return [Hold(peer, state.window_end, waiting, "joined the open grace window")]
    soon = [lid for lid in _expected_in_window(state, now + policy.grace_period) if lid != kept]  # O(k + log n)
    decision = hold_decision(now, ((lid, state.leases[lid].expected_finish) for lid in soon), policy.grace_period)
    if decision.hold_until is None:
        return [_issue(state, peer, now, decision.reason)]
    state.window_end = decision.hold_until
    state.held[peer] = now
    return [Hold(peer, decision.hold_until, decision.waiting_for, decision.reason)]


def _lease_index(state: CoordinatorState, key: str) -> list[tuple[float, str]]:
    """Active leases sorted by ``key`` ("expected_finish" or "deadline"), as (time, lease_id).

    A derived cache kept beside the state (never checkpointed): leases enter it when issued
    (:func:`_index_lease`); leases that left ``state.leases`` (applied, given back) are pruned lazily when
    a query meets them. It is rebuilt when the lease table is replaced (checkpoint load). With k leases
    due before a query's bound, a query costs O(k + log n) instead of a scan over all n leases."""
    caches = state.indexes.lease_indexes
    cached = caches.get(key)
    if cached is None or cached[0] is not state.leases:
        entries = sorted((getattr(lease, key), lease_id) for lease_id, lease in state.leases.items())
        cached = caches[key] = (state.leases, entries)
    return cached[1]


def _index_lease(state: CoordinatorState, lease: Lease) -> None:
    caches = state.indexes.lease_indexes
    for key, (table, entries) in caches.items():
        if table is state.leases:
            bisect.insort(entries, (getattr(lease, key), lease.lease_id))
    _book_issued(state, lease)


# --- per-event indexes of the lease table and of the peers' speeds ---------------------------------


def _book_add(book: _LeaseBook, lease: Lease) -> None:
    book.count += 1
    book.by_peer.setdefault(lease.peer, {})[lease.lease_id] = None
    book.by_version.setdefault(lease.base_version, {})[lease.lease_id] = None
    book.in_flight[lease.shard] += lease.steps


def _book(state: CoordinatorState) -> _LeaseBook:
    book = state.indexes.lease_book
    if (
        book is None
        or book.table is not state.leases
        or book.count != len(state.leases)
        or len(book.in_flight) != len(state.shards)
    ):
        book = _LeaseBook(state.leases, 0, {}, {}, [0] * len(state.shards))
        for lease in state.leases.values():
            _book_add(book, lease)
        state.indexes.lease_book = book
    return book


def _book_issued(state: CoordinatorState, lease: Lease) -> None:
    """``lease`` was just added to ``state.leases``."""
    book = state.indexes.lease_book
    if book is not None and book.table is state.leases and book.count == len(state.leases) - 1:
        _book_add(book, lease)


def _unindex_lease(state: CoordinatorState, lease: Lease) -> None:
    """``lease`` was just removed from ``state.leases`` (applied, rejected or given back)."""
    book = state.indexes.lease_book
    if book is None:
        return
    mine = book.by_peer.get(lease.peer, {})
    if book.table is not state.leases or book.count != len(state.leases) + 1 or lease.lease_id not in mine:
        state.indexes.lease_book = None  # out of step: rebuilt at the next query
        return
    book.count -= 1
    del mine[lease.lease_id]
    if not mine:
        del book.by_peer[lease.peer]
    version = book.by_version.get(lease.base_version)
    if version is not None:
        version.pop(lease.lease_id, None)
        if not version:
            del book.by_version[lease.base_version]
    book.in_flight[lease.shard] -= lease.steps


def _peer_leases(state: CoordinatorState, peer: str) -> list[Lease]:
    """The active leases of ``peer`` in issue order (normally at most one): O(its leases)."""
    ids = _book(state).by_peer.get(peer, {})
    return [state.leases[lease_id] for lease_id in ids if lease_id in state.leases]


def _version_needed(state: CoordinatorState, version: int) -> bool:
    """Does an active lease still need θ(``version``) (not downloaded yet, or a staleness transform wants the
    base)? Amortised O(1): a lease that no longer needs it (downloaded, and no transform needs bases) never
    will again, so it leaves the version's list at the first query that meets it."""
    book = _book(state)
    ids = book.by_version.get(version)
    if not ids:
        return False
    needs_base = state.needs_base_params
    while ids:
        lease_id = next(iter(ids))
        lease = state.leases.get(lease_id)
        if lease is not None and lease.base_version == version and (needs_base or not lease.fetched or lease.verify):
            return True
        del ids[lease_id]
    del book.by_version[version]
    return False


def _note_speed(state: CoordinatorState, peer: str) -> None:
    """``peer``'s speed or liveness may have changed: record it for :func:`_fastest_alive`."""
    cache = state.indexes.speed_heap
    info = state.peers.get(peer)
    if cache is not None and cache[0] is state.peers and info is not None and info.alive:
        heapq.heappush(cache[1], (-info.speed, peer))


def _fastest_alive(state: CoordinatorState) -> float:
    """max(speed) over the alive peers, amortised O(log n): a max-heap of (−speed, peer) entries, pushed on every
    report (:func:`_note_speed`); entries that no longer match their peer (a newer speed, a peer gone) are
    dropped when they reach the top. Derived, never checkpointed: rebuilt when ``state.peers`` is replaced
    or the heap holds more than 4× as many entries as there are peers."""
    cache = state.indexes.speed_heap
    if cache is None or cache[0] is not state.peers or len(cache[1]) > 4 * len(state.peers) + 64:
        entries = [(-info.speed, name) for name, info in state.peers.items() if info.alive]
        heapq.heapify(entries)
        cache = state.indexes.speed_heap = (state.peers, entries)
    heap = cache[1]
    while heap:
        negative, name = heap[0]
        info = state.peers.get(name)
        if info is not None and info.alive and info.speed == -negative:
            return -negative
        heapq.heappop(heap)
    raise ValueError("no alive peer has reported a speed")


def _leases_due(state: CoordinatorState, key: str, bound: float, strict: bool = False) -> list[str]:
    """Ids of the active leases whose ``key`` time is <= ``bound`` (< with ``strict``), pruning stale entries."""
    entries = _lease_index(state, key)
    end = bisect.bisect_left(entries, (bound, "")) if strict else bisect.bisect_right(entries, (bound, "\U0010ffff"))
    live = [entry for entry in entries[:end] if entry[1] in state.leases]
    if len(live) < end:
        entries[:end] = live
    return [lease_id for _, lease_id in live]


def _expected_in_window(state: CoordinatorState, window_end: float) -> tuple[str, ...]:
    return tuple(sorted(_leases_due(state, "expected_finish", window_end)))


def _release_held(state: CoordinatorState, now: float) -> list[Action]:
    """Answer held requests once their window is settled."""
    closed_short = None
    if state.policy.barrier and not state.leases:
        # A sync round whose leases were given back (expired, peer left) ends with fewer than N
        # arrivals buffered: step on their mean now, or the next round's updates would be averaged
        # into this round's step and every later round would stay misaligned.
        closed_short = state.optimizer.flush(state.params)
    if not state.held:
        if state.window_end is not None and now > state.window_end:
            state.window_end = None
        return []
    pending: tuple[str, ...] = ()
    if state.policy.barrier:
        if state.leases:
            return []
        reason = "sync barrier released: every lease of the round is in"
        if closed_short is not None:
            reason += f" or given back; {closed_short.reason}"
    else:
        window_end = state.window_end if state.window_end is not None else now
        pending = _expected_in_window(state, window_end)
        if pending and now < window_end:
            return []
        reason = (
            "grace window closed" if pending else "every update expected in the grace window has been applied"
        )
    held = sorted(state.held.items(), key=lambda item: (item[1], item[0]))
    state.held.clear()
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


def _next_uniform(state: CoordinatorState) -> float:
    # Counter-based: the n-th lease's draw depends only on (seed, n), so a resumed coordinator draws
    # exactly what an uninterrupted one would have.
    return float(np.random.default_rng([state.seed, state.lease_counter]).random())


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
            sized = link_steps(steps, transfer, policy.units_per_step / speed, policy.transfer_cover, policy.max_auto_steps)
            if sized != steps:
                why_steps += f"; {sized} to cover {transfer:.3g} s of transfers (k = {policy.transfer_cover:g})"
                steps = sized
    sizes = [s.size for s in state.shards]
    progress = [s.assigned for s in state.shards]
    if policy.shard_progress == "learned":
        # Eq. 2 as the paper counts it: data points learned, i.e. without the steps still in flight
        in_flight = _book(state).in_flight
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
    # The peer's time on the wire, from its last upload as the coordinator measured it, scaled to a download
    # plus an upload (their byte ratio), with a 2× margin — until measured, the configured allowance.
    transfer = (
        policy.transfer_allowance_s if info.transfer_s is None
        else 2.0 * info.transfer_s * (1.0 + policy.download_upload_ratio)
    )
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
    state.leases[lease.lease_id] = lease
    _index_lease(state, lease)
    return Assign(peer, lease, f"{why}; {why_steps}; shard {shard_index} sampled by Eq. 2")


def _lease_id(state: CoordinatorState) -> str:
    """The id of lease number ``state.lease_counter``: sequential without a secret (the simulator), else an
    HMAC of the counter — unguessable by other peers, and the same again when a log is replayed."""
    if not state.lease_secret:
        return f"L{state.lease_counter:08d}"
    digest = hmac.new(state.lease_secret, state.lease_counter.to_bytes(8, "big"), hashlib.sha256).hexdigest()
    return "L" + digest[:24]


def base_theta(state: CoordinatorState, version: int) -> torch.Tensor | None:
    """θ at ``version`` (the live tensor for the current version — clone before releasing the lock), or
    None when it is no longer retained."""
    if version == state.version:
        return state.params
    return state.base_params.get(version)


def _retain_before_step(state: CoordinatorState) -> list[Action]:
    """Copy-on-write of θ before the optimizer changes it: keep the current version when a lease still
    needs it (θ not downloaded yet, or a staleness transform wants the base). At most
    ``max_retained_versions`` older versions are kept: past that, the oldest not-yet-downloaded leases are
    given back (their peers ask again and start from the newest θ)."""
    if state.version not in state.base_params and _version_needed(state, state.version):
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
                actions += _give_back(state, lease, f"θ of version {oldest} is no longer retained")
        state.base_params.pop(oldest, None)
    return actions


VERIFY_PIN_FACTOR = 4


def _serves_download(state: CoordinatorState, version: int) -> bool:
    """Does a lease still need θ(``version``) for a download or a staleness transform (not only for its check)?"""
    ids = _book(state).by_version.get(version, {})
    for lease_id in ids:
        lease = state.leases.get(lease_id)
        if lease is not None and lease.base_version == version and (state.needs_base_params or not lease.fetched):
            return True
    return False


def _give_back(state: CoordinatorState, lease: Lease, why: str) -> list[Action]:
    del state.leases[lease.lease_id]
    _unindex_lease(state, lease)
    info = state.peers.get(lease.peer)
    if info is not None and info.observed is None:
        info.failed = True
    return_range(state, lease)
    _drop_unused_base_params(state)
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


def _drop_unused_base_params(state: CoordinatorState) -> None:
    if not state.base_params:
        return
    for version in list(state.base_params):  # at most max_retained_versions (+1), each O(1) amortised
        if not _version_needed(state, version):
            del state.base_params[version]


def _expire(state: CoordinatorState, now: float) -> list[Action]:
    actions: list[Action] = []
    for lease_id in sorted(_leases_due(state, "deadline", now, strict=True)):
        lease = state.leases[lease_id]
        actions += _give_back(state, lease, f"lease deadline {lease.deadline:.1f} passed")
    return actions


def _on_tick(state: CoordinatorState, now: float) -> list[Action]:
    actions = _expire(state, now)
    policy = state.policy
    for peer, since in list(state.held.items()):
        if now - since > policy.hold_limit:
            del state.held[peer]
            actions.append(Released(peer, f"held {now - since:.0f} s, longer than the hold limit {policy.hold_limit:g} s; ask again"))
    if math.isfinite(policy.peer_timeout):
        # A peer with a lease in hand or a held request is judged by its lease's deadline (which allows for its
        # measured transfer time), not by its speed reports: those travel through the DHT and may not reach
        # the coordinator over a slow or lossy link (a peer behind a latency spike was declared gone mid-lease
        # over and over when silence counted for it too).
        busy = {lease.peer for lease in state.leases.values()} | set(state.held)
        for peer, info in sorted(state.peers.items()):
            if info.alive and peer not in busy and now - info.last_seen > policy.peer_timeout:
                actions += _on_peer_left(state, PeerLeft(peer), now)
                actions.append(Left(peer, f"no report, request or submission for {now - info.last_seen:.0f} s (limit {policy.peer_timeout:g} s)"))
    return actions


def _on_fetched(state: CoordinatorState, event: Fetched, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    if info is not None:
        info.last_seen = now
        info.fetched_version = max(info.fetched_version, event.version)
    for lease in _peer_leases(state, event.peer):
        if lease.base_version == event.version:
            lease.fetched = True
    _drop_unused_base_params(state)
    return []


def _on_restarted(state: CoordinatorState, event: Restarted, now: float) -> list[Action]:
    state.held.clear()
    state.window_end = None
    for info in state.peers.values():
        info.last_seen = max(info.last_seen, now + event.grace_s)
    # The downtime is not the peers' fault: a lease whose θ was not downloaded (nor held) could not start, so it gets
    # its whole time again; one in training may be resending, so at least the grace (34-44 s restarts under load had
    # expired such leases and refused their updates 0.4-5 s after the resume).
    for lease in state.leases.values():
        if not (lease.fetched or lease.held):
            lease.expected_finish = max(lease.expected_finish, now + lease.expected_finish - lease.issued_at)
            lease.deadline = max(lease.deadline, now + lease.deadline - lease.issued_at)
        lease.deadline = max(lease.deadline, now + event.grace_s)
    for key in ("deadline", "expected_finish"):
        state.indexes.lease_indexes.pop(key, None)  # rebuilt from the table on its next query
    return []


def _notice_peer_count(state: CoordinatorState) -> list[Action]:
    """Tell the organiser when the live peers stop matching the outer optimizer's N. N stays as configured
    (changing it mid-run would change the method); fewer peers than N make DN's momentum step rarer (every N
    arrivals), more peers make it more frequent relative to each peer's rounds. docs/algorithm.md."""
    n = state.policy.buffer_size
    if n is None:
        return []
    live = sum(1 for info in state.peers.values() if info.alive)
    if live == state.noticed_peers:
        return []
    previous, state.noticed_peers = state.noticed_peers, live
    if live == n or live == 0 or (previous != n and previous > 0 and (previous < n) == (live < n)):
        return []
    relation = "fewer" if live < n else "more"
    return [Notice(f"{live} live peer(s), {relation} than the outer optimizer's N = {n} (outer.buffer_size): "
                   "the DN buffer steps every N arrivals; set outer.buffer_size to the number of peers you expect")]


def _on_peer_left(state: CoordinatorState, event: PeerLeft, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    if info is not None:
        info.alive = False
    state.held.pop(event.peer, None)
    actions: list[Action] = []
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == event.peer:
            actions += _give_back(state, lease, "peer left")
    return actions


# ---------------------------------------------------------------------------------- verification


PROBATION_WAIT = "probation: held until the peer's probation checks agree, not re-run"


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
