"""coordinator/chained.py: which checks need no reveal — a fresh start, the end state kept from the peer's previous
check, or one that check will leave — and the bound on what is kept. The runs that use it: tests/test_overlap_runtime.py
(``test_a_checked_lease_after_a_checked_lease_is_re_run_from_the_end_state_the_coordinator_kept``) and
tests/test_verify_hostile.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncloco.coordinator.chained import ChainedStates, StateStore
from asyncloco.coordinator.logic import Lease, Verify
from asyncloco.train.commitments import FRESH_STATE_DIGEST

pytestmark = pytest.mark.timeout(30)


def check(peer: str, lease_id: str, start: str, end: str) -> Verify:
    lease = Lease(lease_id, peer, 0, 0, 5, 0, 0, 0.0, 1.0, 2.0)
    return Verify(peer, lease, torch.empty(0), torch.empty(0), "probation", state_start=start, state_end=end)


def test_a_fresh_start_needs_no_reveal_even_with_nothing_kept() -> None:
    chained = ChainedStates(0)
    how, start = chained.start(check("a", "L1", FRESH_STATE_DIGEST, "d1"))
    assert how == "fresh" and start == b""
    # a check whose end its peer reveals anyway has its fresh (empty) start revealed with it
    assert chained.start(check("a", "L0", FRESH_STATE_DIGEST, "d0"), full=True) == ("", None)
    assert chained.expected == {}  # nothing is kept with a budget of 0
    assert chained.finished(check("a", "L1", FRESH_STATE_DIGEST, "d1"), b"end-1") is None and chained.kept == {}
    assert chained.start(check("a", "L2", "d1", "d2")) == ("", None)  # the peer reveals it


def test_the_next_lease_starts_from_the_end_state_kept_or_waits_for_it() -> None:
    chained = ChainedStates(1000)
    first = check("a", "L1", FRESH_STATE_DIGEST, "d1")
    assert chained.start(first)[0] == "fresh" and chained.expected == {"a": ("L1", "d1")}
    # lease 2's check comes before lease 1's verdict: it waits for it
    second = check("a", "L2", "d1", "d2")
    assert chained.start(second) == ("wait", None) and chained.waiting == {"L1": second}
    # lease 1 passes with its end state: kept, and handed to lease 2 as its start (an empty end part)
    following = chained.finished(first, b"end-1")
    assert following == (second, b"end-1") and chained.waiting == {}
    assert chained.kept["a"].digest == "d1" and chained.bytes == 5
    assert chained.expected == {"a": ("L2", "d2")}
    # lease 2 passes; lease 3 (checked after the verdict) starts from lease 2's end, kept
    assert chained.finished(second, b"end-two") is None and chained.kept["a"].state == b"end-two" and chained.bytes == 7
    third = check("a", "L3", "d2", "d3")
    assert chained.start(third) == ("kept", b"end-two")
    # a lease whose start is not the kept end (its predecessor was not checked) is revealed by its peer
    assert chained.start(check("a", "L5", "d4", "d5")) == ("", None)
    assert chained.counts == {"fresh": 1, "kept": 1, "waited": 1, "moot": 0, "evicted": 0}


def test_a_check_ended_without_a_verdict_leaves_its_follower_without_a_start() -> None:
    chained = ChainedStates(1000)
    first, second = check("a", "L1", "d0", "d1"), check("a", "L2", "d1", "d2")
    assert chained.start(first) == ("", None)  # revealed by its peer; its end state will be kept
    assert chained.start(second) == ("wait", None)
    assert chained.finished(first, None) == (second, None)  # failed or unverified: no end state to start from
    assert "a" not in chained.kept


def test_an_expelled_peer_leaves_nothing_kept_and_its_waiting_checks_moot() -> None:
    chained = ChainedStates(1000)
    chained.start(check("a", "L1", "d0", "d1"))
    chained.finished(check("a", "L1", "d0", "d1"), b"xyz")
    chained.start(check("a", "L2", "d1", "d2"))
    waiting = check("a", "L3", "d2", "d3")
    assert chained.start(waiting) == ("wait", None)
    assert chained.forget("a") == [waiting]
    assert chained.kept == {} and chained.bytes == 0 and chained.expected == {} and chained.waiting == {}
    assert chained.counts["moot"] == 1


def test_a_lease_granted_with_a_fresh_start_drops_its_peer_s_kept_state() -> None:
    """Once a peer's leases start fresh (its uplink cannot carry a reveal: coordinator/logic/leases.py fresh_reason) no
    lease of it starts from the state kept for it: a fresh lease's verdict drops it; another peer's stays."""
    chained = ChainedStates(1000)
    chained.finished(check("a", "L1", "d0", "d1"), b"xyz")
    chained.finished(check("b", "M1", "e0", "e1"), b"uvw")
    fresh = check("a", "L2", FRESH_STATE_DIGEST, "d2")
    fresh = Verify("a", Lease("L2", "a", 0, 0, 5, 0, 0, 0.0, 1.0, 2.0, fresh=True), fresh.base, fresh.update, "sampled",
                   state_start=FRESH_STATE_DIGEST, state_end="d2")
    assert chained.finished(fresh, None) is None
    assert list(chained.kept) == ["b"] and chained.bytes == 3
    assert chained.finished(check("b", "M2", FRESH_STATE_DIGEST, "e2"), None) is None  # a reset, not a fresh grant
    assert list(chained.kept) == ["b"]


def test_the_budget_keeps_the_most_recently_used_states() -> None:
    chained = ChainedStates(10)
    for peer, state in (("a", b"aaaa"), ("b", b"bbbb")):
        chained.start(check(peer, f"{peer}1", "s", f"{peer}-end"))
        chained.finished(check(peer, f"{peer}1", "s", f"{peer}-end"), state)
    assert chained.start(check("a", "a2", "a-end", "a2-end"))[0] == "kept"  # a used last: b goes first
    chained.start(check("c", "c1", "s", "c-end"))
    chained.finished(check("c", "c1", "s", "c-end"), b"cccc")
    assert list(chained.kept) == ["a", "c"] and chained.bytes == 8 and chained.counts["evicted"] == 1
    chained.finished(check("d", "d1", "s", "d-end"), b"d" * 11)  # larger than the whole budget: not kept
    assert "d" not in chained.kept and chained.bytes == 8


def test_kept_states_on_disk_are_files_that_go_when_dropped(tmp_path: Path) -> None:
    """``keep_states_on: disk`` (the default): each kept state is a file under kept-states/, mapped read-only; replaced,
    evicted, refused by the budget or forgotten, its file goes; the store empties its directory at open and close."""
    directory = tmp_path / "kept-states"
    directory.mkdir()
    (directory / "Lold.state").write_bytes(b"from an earlier process")
    (directory / "keep.txt").write_bytes(b"not ours")
    store = StateStore(directory)
    assert sorted(p.name for p in directory.iterdir()) == ["keep.txt"]  # the earlier process's state is gone
    chained = ChainedStates(10, store)

    def kept_files() -> list[str]:
        return sorted(p.name for p in directory.glob("*.state"))

    state = store.put("L1", b"end-1")
    assert bytes(state) == b"end-1" and kept_files() == ["L1.state"] and (directory / "L1.state").read_bytes() == b"end-1"
    chained.start(check("a", "L1", FRESH_STATE_DIGEST, "d1"))
    chained.finished(check("a", "L1", FRESH_STATE_DIGEST, "d1"), state)
    assert chained.status()["on"] == "disk" and chained.bytes == 5
    # a's next end replaces it: the old file goes
    chained.finished(check("a", "L2", "d1", "d2"), store.put("L2", b"end-2"))
    assert kept_files() == ["L2.state"] and bytes(chained.start(check("a", "L3", "d2", "d3"))[1] or b"") == b"end-2"
    # b's pushes the 10-byte budget over: the least recently used (a's) is evicted with its file
    chained.finished(check("b", "L7", "e0", "e1"), store.put("L7", b"end-b1"))
    assert list(chained.kept) == ["b"] and kept_files() == ["L7.state"] and chained.counts["evicted"] == 1
    # larger than the whole budget: never kept, its file dropped at once
    chained.finished(check("c", "L9", "f0", "f1"), store.put("L9", b"x" * 11))
    assert "c" not in chained.kept and kept_files() == ["L7.state"]
    # a failed or unverified check's end (a verdict never keeps one) is dropped too
    chained.finished(check("d", "L4", "g0", ""), store.put("L4", b"end-d"))
    assert kept_files() == ["L7.state"]
    # an expelled peer's state goes; a view handed out before stays readable (the mapping outlives the name)
    view = chained.kept["b"].state
    chained.forget("b")
    assert kept_files() == [] and bytes(view) == b"end-b1" and store.files() == 0
    store.put("L10", b"end-10")
    store.clear()
    assert kept_files() == [] and sorted(p.name for p in directory.iterdir()) == ["keep.txt"]
    with pytest.raises(ValueError, match="lease id"):
        store.put("../escape", b"x")
    # a file that cannot be written (here: its directory gone) keeps nothing; the check it came from stands
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    assert store.put("L12", b"end-12") is None and store.files() == 0
    # in memory: the buffer itself, no file
    memory = StateStore(None)
    data = bytearray(b"end")
    assert memory.put("L1", data) is data and ChainedStates(10, memory).status()["on"] == "memory"
