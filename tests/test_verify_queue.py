"""The verifier's queue (coordinator/verify.py ``UrgentFirst``): first in, first out, except that a check θ waits for —
its update, or one of its peer's behind it, held for a verdict — goes first, at most ``URGENT_RUN`` times in a row
while another waits."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from asyncloco.coordinator.logic import Lease, Verify
from asyncloco.coordinator.verify import URGENT_RUN, DaemonVerification, UrgentFirst


def _check(lease_id: str, peer: str) -> Verify:
    lease = Lease(lease_id, peer, 1, 4, 3, 7, 2, 0.0, 0.0, 0.0)
    return Verify(peer, lease, torch.zeros(6), torch.zeros(6), "drawn", state_start="", state_end="")


def _order(queue: UrgentFirst, checks: list[Verify]) -> list[str]:
    for at, check in enumerate(checks):
        queue.put_nowait((check, float(at), None))
    return [queue.get_nowait()[0].lease.lease_id for _ in checks]


@pytest.mark.timeout(60)
def test_urgent_checks_go_first_in_order_and_never_starve_the_others() -> None:
    async def main() -> None:
        urgent = {"u1", "u2", "u3", "u4", "u5", "u6"}
        queue = UrgentFirst(16, lambda task: task.lease.lease_id in urgent)
        # no urgent check: first in, first out
        assert _order(queue, [_check(n, "QmA") for n in ("a", "b", "c")]) == ["a", "b", "c"]
        # urgent ones pass the others, oldest first; an urgent check at the head passes nobody (the run restarts)
        assert _order(queue, [_check(n, "QmA") for n in ("a", "u1", "b", "u2", "c")]) == ["u1", "u2", "a", "b", "c"]
        assert _order(queue, [_check(n, "QmA") for n in ("u1", "a", "u2")]) == ["u1", "u2", "a"]
        # at most URGENT_RUN urgent checks in a row pass a waiting one; then the oldest other goes, and the run restarts
        names = ["a", "u1", "u2", "u3", "u4", "u5", "u6", "b"]
        assert URGENT_RUN == 4
        assert _order(queue, [_check(n, "QmA") for n in names]) == ["u1", "u2", "u3", "u4", "a", "u5", "u6", "b"]
        assert queue.empty()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_check_is_urgent_when_its_update_or_one_of_its_peers_is_held() -> None:
    held = {"L2": SimpleNamespace(lease=SimpleNamespace(peer="QmB"))}
    verification = SimpleNamespace(port=SimpleNamespace(node=SimpleNamespace(
        state=SimpleNamespace(verification=SimpleNamespace(held=held)))))
    urgent = lambda check: DaemonVerification._urgent(verification, check)  # type: ignore[arg-type]  # noqa: E731
    assert urgent(_check("L2", "QmB"))  # its own update held
    assert urgent(_check("L1", "QmB"))  # its peer's held update waits behind it (its chain of carried states)
    assert not urgent(_check("L3", "QmA"))  # another peer's: applied first, or nothing held
    held.clear()
    assert not urgent(_check("L2", "QmB"))
