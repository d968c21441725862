"""Cheap signals for verification: the gate marks a peer a *suspect* — more of its leases re-run
(coordinator/logic/ ``verify_reason`` at ``suspect_fraction``) — without refusing its work.

Pure: :func:`asyncloco.coordinator.gate.score` / ``record`` / ``suspect`` on a constructed gate state, exact
verdicts and marks. The false-positive rates on honest peers measured in the attack benchmark are in
docs/threat-model.md.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncloco.coordinator import gate as G

# the gate's fixtures: a 64-dim consensus e0, a warmed-up gate, an update at an exact cosine
from tests.test_gate_probe import N, e0, warm_state, with_cosine  # noqa: E402


def submit(policy: G.GatePolicy, state: G.GateState, peer: str, cosine: float) -> G.GateVerdict:
    """Score and book an update at ``cosine``; the consensus is put back to e0 (``record`` moves it towards every
    accepted update), with no peer's last update in it, so the next cosine is exact."""
    update = with_cosine(cosine)
    verdict = G.score(policy, state, update, 10, peer)
    G.record(policy, state, verdict, None if verdict.action == "reject" else update * verdict.scale, 10, peer, 0.0)
    state.reference, state.reference_norm = e0(), 1.0
    state.own.clear()
    return verdict


@pytest.mark.timeout(30)
def test_close_to_an_echo_marks_a_peer_suspect_but_is_applied() -> None:
    """An applied update at cosine ≥ max(suspect_cosine 0.85, median + 4 MAD) with the consensus — below the echo
    bar (0.95) that refuses — marks its peer a suspect, and its work is applied. Honest updates of the attack
    benchmark agreed at most 0.824; a free-rider's echoes at 0.96-1.0, three colluders' at 0.82-0.92."""
    policy = G.GatePolicy()
    state = warm_state(center=0.4)  # MAD stays 0 (floor 1e-3) below: the bar is 0.85 throughout
    state.peer_accepted.update({"h": 10, "x": 10})
    streams = {"h": [0.2, 0.82, 0.5, 0.849, 0.3], "x": [0.86, 0.9, 0.94]}
    for peer, cosines in streams.items():
        for cosine in cosines:
            assert G.close_bar(policy, state.cosines) == pytest.approx(0.85)
            verdict = submit(policy, state, peer, cosine)
            assert (verdict.action, verdict.weak) == ("accept", False), verdict.reason
    assert state.close == {"h": [False] * 5, "x": [True] * 3}
    assert G.suspect(state, "h") == "" and state.accepted == 18
    assert G.suspect(state, "x") == "recently agreed with the consensus almost like an echo of it"
    # an echo at or above 0.95 is refused (counted), not marked close: the rejection is the stronger reason
    echo = submit(policy, state, "h", 0.97)
    assert (echo.action, echo.counts) == ("reject", True)
    assert state.close["h"] == [False] * 6 and G.suspect(state, "h") == "recently refused by the gate"
    # it survives a snapshot; one written before the signal (no "close" key) still loads
    restored = G.GateState.from_state_dict(state.state_dict())
    assert restored.close == state.close and G.suspect(restored, "x") == G.suspect(state, "x")
    old = state.state_dict()
    del old["close"]
    assert G.GateState.from_state_dict(old).close == {}
    # six ordinary updates later (quarantine_window) the mark is gone
    for _ in range(policy.quarantine_window):
        assert submit(policy, state, "x", 0.4).action == "accept"
    assert state.close["x"] == [False] * 6 and G.suspect(state, "x") == ""


@pytest.mark.timeout(30)
def test_close_bar_follows_a_tight_consensus_and_waits_for_warm_up() -> None:
    policy = G.GatePolicy()
    # where honest work agrees closely the bar rises to median + 4 MAD (0.84 + 4 × 0.02), never above the echo bar
    assert G.close_bar(policy, [0.8, 0.82, 0.84, 0.86, 0.88]) == pytest.approx(0.92)
    assert G.close_bar(policy, [0.9, 0.92, 0.94, 0.96, 0.98]) == pytest.approx(0.95)
    # before warm-up nothing is marked (and nothing is judged on direction)
    early = warm_state(center=0.4, accepted=3)
    assert submit(policy, early, "old", 0.9).action == "accept"
    assert early.close == {"old": [False]} and G.suspect(early, "old") == ""


@pytest.mark.timeout(30)
def test_honest_stream_of_the_benchmark_marks_no_one() -> None:
    """The per-peer median cosines of the honest peers of two clean benchmark runs (0.16-0.54, max single 0.82)
    replayed through the gate: no close mark, no weak verdict, no refusal — 0 false positives of 30."""
    policy = G.GatePolicy()
    state = warm_state(center=0.33)
    state.cosines = [0.16, 0.25, 0.54, 0.19, 0.27, 0.48, 0.3, 0.33, 0.41, 0.22]
    state.peer_accepted.update({"a": 10, "b": 10, "c": 10})
    pattern = {"a": [0.16, 0.05, 0.3, 0.12, 0.22], "b": [0.25, 0.4, 0.1, 0.33, 0.28], "c": [0.54, 0.82, 0.7, 0.45, 0.6]}
    verdicts = [submit(policy, state, peer, c) for _ in range(2) for peer, cs in pattern.items() for c in cs]
    assert [v.action for v in verdicts] == ["accept"] * 30
    assert sum(v.weak for v in verdicts) == 0
    assert {p: sum(marks) for p, marks in state.close.items()} == {"a": 0, "b": 0, "c": 0}
    assert [G.suspect(state, p) for p in pattern] == ["", "", ""]


@pytest.mark.timeout(30)
def test_a_peer_proven_by_its_verification_probation_is_judged_past_the_gates_probation() -> None:
    """A newcomer's update at 3× the median per-step norm (fresh AdamW state) and cosine 0.4: on the gate's probation
    (tightening 0.5) the norm is clipped to 2× the median; from a peer proven by its re-run probation (``proven``) it
    is taken whole — the clip bound is clip_factor (4×) as for any peer past probation — and the same holds for
    whether the probe is read."""
    policy = G.GatePolicy()
    assert policy.clip_factor == 4.0 and policy.probation_tightening == 0.5
    update = with_cosine(0.4, norm=30.0)  # 10 steps: per-step norm 3, the median 1
    new = G.score(policy, warm_state(), update, 10, "new")
    assert new.action == "clip" and new.scale == pytest.approx(2.0 / 3.0) and "probation" in new.reason
    proven = G.score(policy, warm_state(), update, 10, "new", proven=True)
    assert proven.action == "accept" and proven.scale == 1.0 and "probation" not in proven.reason
    # a direction pointing away (cosine −0.15 < −0.25 × the median 0.4): refused outright from a newcomer, counted; from
    # a proven peer it is in the gray zone, where the probe decides — and the daemon reads the probe exactly then
    away = with_cosine(-0.15)
    new = G.score(policy, warm_state(), away, 10, "new")
    assert new.action == "reject" and new.counts and G.needs_probe(policy, warm_state(), away, 10, "new") is False
    assert G.needs_probe(policy, warm_state(), away, 10, "new", proven=True) is True
