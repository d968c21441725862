"""Read-only queries of the logic's derived indexes, the public way to ask them.

The logic keeps indexes derived from the state (the lease book by peer, base version and shard; the sorted lease
deadlines and expected finishes; the heap of the alive peers' speeds: coordinator/logic/indexes.py), never
checkpointed and rebuilt when they no longer match. Each function below answers what a full scan over the state
answers — tests compare them with one (tests/test_logic_indexes.py, tests/test_sim_logic_index.py, tests/test_verify.py).
Queries may prune stale index entries; they never change the state's meaning.
"""

from __future__ import annotations

import asyncloco.coordinator.logic.indexes as indexes
from asyncloco.coordinator.logic.state import CoordinatorState, Lease

__all__ = ["expected_in_window", "fastest_alive", "in_flight", "leases_at_version", "leases_due", "peer_leases",
           "version_needed"]


def peer_leases(state: CoordinatorState, peer: str) -> list[Lease]:
    """The active leases of ``peer``, in issue order."""
    return indexes.peer_leases(state, peer)


def version_needed(state: CoordinatorState, version: int) -> bool:
    """Does an active lease still need θ at ``version`` (not downloaded yet, or a staleness transform wants it)?"""
    return indexes.version_needed(state, version)


def in_flight(state: CoordinatorState) -> list[int]:
    """Inner steps leased out and not yet returned, per shard."""
    return list(indexes.lease_book(state).in_flight)


def leases_at_version(state: CoordinatorState, version: int) -> list[str]:
    """Ids of the active leases indexed under base version ``version``."""
    return list(indexes.lease_book(state).by_version.get(version, {}))


def fastest_alive(state: CoordinatorState) -> float:
    """The highest speed among the alive peers."""
    return indexes.fastest_alive(state)


def leases_due(state: CoordinatorState, key: str, bound: float, strict: bool = False) -> list[str]:
    """Ids of the active leases whose ``key`` time (``deadline`` or ``expected_finish``) is <= ``bound`` (< with
    ``strict``)."""
    return indexes.leases_due(state, key, bound, strict)


def expected_in_window(state: CoordinatorState, window_end: float) -> tuple[str, ...]:
    """Ids of the active leases expected to finish by ``window_end``, sorted."""
    return indexes.expected_in_window(state, window_end)
