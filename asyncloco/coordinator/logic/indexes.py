"""The logic's derived indexes (state.DerivedIndexes), kept beside the state so that a per-event decision needs no
scan over every lease or peer: the lease book (a peer's leases, the leases per base version, the steps in flight per
shard), the active leases sorted by deadline and by expected finish, and a heap of the alive peers' speeds.

Never checkpointed: each remembers the table it was built from and is rebuilt when that table is replaced (a
checkpoint load, a replay) or no longer matches it. The handlers that change the lease table or a peer's speed keep
them up to date (:func:`index_lease`, :func:`unindex_lease`, :func:`note_speed`); queries.py is the read-only way to
ask them from outside the logic."""

from __future__ import annotations

import bisect
import heapq

from asyncloco.coordinator.logic.state import CoordinatorState, Lease, LeaseBook


# ------------------ the lease book: a peer's leases, a version's leases, steps in flight per shard


def _book_add(book: LeaseBook, lease: Lease) -> None:
    book.count += 1
    book.by_peer.setdefault(lease.peer, {})[lease.lease_id] = None
    book.by_version.setdefault(lease.base_version, {})[lease.lease_id] = None
    book.in_flight[lease.shard] += lease.steps


def lease_book(state: CoordinatorState) -> LeaseBook:
    """The lease book of ``state.leases``, rebuilt in O(n) when it no longer matches the table."""
    book = state.indexes.lease_book
    if (
        book is None
        or book.table is not state.leases
        or book.count != len(state.leases)
        or len(book.in_flight) != len(state.shards)
    ):
        book = LeaseBook(state.leases, 0, {}, {}, [0] * len(state.shards))
        for lease in state.leases.values():
            _book_add(book, lease)
        state.indexes.lease_book = book
    return book


def _book_issued(state: CoordinatorState, lease: Lease) -> None:
    """``lease`` was just added to ``state.leases``."""
    book = state.indexes.lease_book
    if book is not None and book.table is state.leases and book.count == len(state.leases) - 1:
        _book_add(book, lease)


def index_lease(state: CoordinatorState, lease: Lease) -> None:
    """``lease`` was just issued (added to ``state.leases``): into the sorted indexes and the lease book."""
    caches = state.indexes.lease_indexes
    for key, (table, entries) in caches.items():
        if table is state.leases:
            bisect.insort(entries, (getattr(lease, key), lease.lease_id))
    _book_issued(state, lease)


def unindex_lease(state: CoordinatorState, lease: Lease) -> None:
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


def peer_leases(state: CoordinatorState, peer: str) -> list[Lease]:
    """The active leases of ``peer`` in issue order (normally at most one): O(its leases)."""
    ids = lease_book(state).by_peer.get(peer, {})
    return [state.leases[lease_id] for lease_id in ids if lease_id in state.leases]


def version_needed(state: CoordinatorState, version: int) -> bool:
    """Does an active lease still need θ(``version``) (not downloaded yet, or a staleness transform wants the
    base)? Amortised O(1): a lease that no longer needs it (downloaded, and no transform needs bases) never
    will again, so it leaves the version's list at the first query that meets it."""
    book = lease_book(state)
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


# ------------------------------------------------ leases sorted by deadline and by expected finish


def _lease_index(state: CoordinatorState, key: str) -> list[tuple[float, str]]:
    """Active leases sorted by ``key`` ("expected_finish" or "deadline"), as (time, lease_id).

    A derived cache kept beside the state (never checkpointed): leases enter it when issued
    (:func:`index_lease`); leases that left ``state.leases`` (applied, given back) are pruned lazily when
    a query meets them. It is rebuilt when the lease table is replaced (checkpoint load). With k leases
    due before a query's bound, a query costs O(k + log n) instead of a scan over all n leases."""
    caches = state.indexes.lease_indexes
    cached = caches.get(key)
    if cached is None or cached[0] is not state.leases:
        entries = sorted((getattr(lease, key), lease_id) for lease_id, lease in state.leases.items())
        cached = caches[key] = (state.leases, entries)
    return cached[1]


def leases_due(state: CoordinatorState, key: str, bound: float, strict: bool = False) -> list[str]:
    """Ids of the active leases whose ``key`` time is <= ``bound`` (< with ``strict``), pruning stale entries."""
    entries = _lease_index(state, key)
    end = bisect.bisect_left(entries, (bound, "")) if strict else bisect.bisect_right(entries, (bound, "\U0010ffff"))
    live = [entry for entry in entries[:end] if entry[1] in state.leases]
    if len(live) < end:
        entries[:end] = live
    return [lease_id for _, lease_id in live]


def expected_in_window(state: CoordinatorState, window_end: float) -> tuple[str, ...]:
    return tuple(sorted(leases_due(state, "expected_finish", window_end)))


# ------------------------------------------------------------------------- the alive peers' speeds


def note_speed(state: CoordinatorState, peer: str) -> None:
    """``peer``'s speed or liveness may have changed: record it for :func:`fastest_alive`."""
    cache = state.indexes.speed_heap
    info = state.peers.get(peer)
    if cache is not None and cache[0] is state.peers and info is not None and info.alive:
        heapq.heappush(cache[1], (-info.speed, peer))


def fastest_alive(state: CoordinatorState) -> float:
    """max(speed) over the alive peers, amortised O(log n): a max-heap of (−speed, peer) entries, pushed on every
    report (:func:`note_speed`); entries that no longer match their peer (a newer speed, a peer gone) are
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
