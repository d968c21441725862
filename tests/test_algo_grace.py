"""Grace-period decisions on explicit timelines (paper Algorithms 2 and 5, docs/algorithm.md §6)."""

from __future__ import annotations

import math

import pytest

from asyncloco.algo.grace import Completion, hold_decision, next_in_window

pytestmark = pytest.mark.timeout(30)


def _c(worker: str, t: float) -> Completion:
    return Completion(worker, t)


def test_no_open_window_takes_the_earliest_completion() -> None:
    pending = [_c("w2", 7.0), _c("w0", 3.5), _c("w1", 12.0)]
    assert next_in_window(pending, grace=0.5) == _c("w0", 3.5)
    assert next_in_window(pending, grace=0.0, window_start=math.inf) == _c("w0", 3.5)
    assert next_in_window([], grace=0.5) is None


def test_window_admits_completions_up_to_start_plus_grace_inclusive() -> None:
    # window opened at τ_sync = 10 with grace 0.5: 10.5 is in, 10.75 is not
    assert next_in_window([_c("w1", 10.5), _c("w2", 11.0)], grace=0.5, window_start=10.0) == _c("w1", 10.5)
    assert next_in_window([_c("w1", 10.75)], grace=0.5, window_start=10.0) is None
    assert next_in_window([_c("w1", 10.0)], grace=0.0, window_start=10.0) == _c("w1", 10.0)
    assert next_in_window([_c("w1", 10.01)], grace=0.0, window_start=10.0) is None


def test_ties_break_by_worker_name() -> None:
    pending = [_c("w3", 5.0), _c("w1", 5.0), _c("w2", 5.0)]
    assert next_in_window(pending, grace=0.5) == _c("w1", 5.0)
    assert next_in_window(list(reversed(pending)), grace=0.5, window_start=4.6) == _c("w1", 5.0)


def test_algorithm_5_window_sequence() -> None:
    """Replay Algorithm 2's inner loop: pop in-window completions in order until the window closes."""
    pending = [_c("w0", 1.0), _c("w1", 1.25), _c("w2", 1.5), _c("w3", 1.75), _c("w4", 4.0)]
    window_start = math.inf
    processed = []
    while (nxt := next_in_window(pending, grace=0.5, window_start=window_start)) is not None:
        processed.append(nxt.worker)
        pending.remove(nxt)
        if math.isinf(window_start):
            window_start = nxt.completed_time
    assert processed == ["w0", "w1", "w2"]  # w3 at 1.75 is past 1.0 + 0.5
    assert [c.worker for c in pending] == ["w3", "w4"]


def test_negative_grace_is_an_error() -> None:
    with pytest.raises(ValueError, match="grace"):
        next_in_window([_c("w0", 1.0)], grace=-0.1)
    with pytest.raises(ValueError, match="grace"):
        hold_decision(0.0, [], grace=-1.0)


def test_hold_when_another_lease_finishes_within_grace() -> None:
    decision = hold_decision(10.0, [("L2", 10.4), ("L1", 10.2), ("L3", 25.0)], grace=0.5)
    assert decision.hold_until == 10.5
    assert decision.waiting_for == ("L1", "L2")  # sorted, and L3 is outside the window
    assert decision.reason


def test_answer_now_when_nothing_finishes_soon() -> None:
    decision = hold_decision(10.0, [("L1", 10.51), ("L2", 30.0)], grace=0.5)
    assert decision.hold_until is None and decision.waiting_for == () and decision.reason
    empty = hold_decision(10.0, [], grace=0.5)
    assert empty.hold_until is None and empty.reason


def test_boundary_and_overdue_leases_are_waited_for() -> None:
    decision = hold_decision(10.0, [("late", 8.0), ("edge", 10.5)], grace=0.5)
    assert decision.hold_until == 10.5
    assert decision.waiting_for == ("edge", "late")


def test_zero_grace_never_holds() -> None:
    decision = hold_decision(10.0, [("L1", 10.0), ("L2", 9.0)], grace=0.0)
    assert decision.hold_until is None and decision.waiting_for == ()
    assert "no grace" in decision.reason
