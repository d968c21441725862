"""Typed refusal codes (asyncloco/refusals.py) end to end: the logic decides each refusal's code in ``handle``
(coordinator/logic/), a replay of the write-ahead log reproduces the same codes, the wire carries them in
replies (LeaseReply, Ack) and ERROR frames (RemoteError.code), and the peer reacts to the code, not the text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.outer import OuterSGD
from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import (
    Assign,
    CoordinatorPolicy,
    CoordinatorState,
    Fingerprint,
    Incompatible,
    Refused,
    Rejected,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    handle,
    is_admitted,
    new_state,
)
from asyncloco.coordinator.node import EVENT_TYPES
from asyncloco.coordinator.wal import WAL_DIR, decode_event, open_log, read_records
from asyncloco.peer.joining import refused_admission
from asyncloco.transport.errors import MessageError, RemoteError
from asyncloco.refusals import FATAL, Refusal, RefusalCode, frame_text, parse_frame
from asyncloco.transport.wire import Ack, LeaseReply

A, B, C = "peerA", "peerB", "peerC"
N = 4


def make_state(**policy: Any) -> CoordinatorState:
    base = dict(max_local_steps=10, min_steps=1, lease_slack=5.0)
    base.update(policy)
    return new_state(torch.zeros(N), OuterSGD(0.5), [], CoordinatorPolicy(**base), [1000], 0)


def lease_of(actions: list[Any]) -> Any:
    (assign,) = [a for a in actions if isinstance(a, Assign)]
    return assign.lease


def codes(actions: list[Any]) -> list[tuple[str, str, RefusalCode]]:
    return [(type(a).__name__, a.reason, a.code) for a in actions if isinstance(a, (Rejected, Refused))]


def run(state: CoordinatorState, record: list[tuple[Any, float]] | None = None) -> list[list[Any]]:
    """Drive ``state`` through one refusal of each kind; return the actions of each event (and log the events)."""
    out: list[list[Any]] = []

    def do(event: Any, now: float) -> list[Any]:
        if record is not None:
            record.append((event, now))
        actions = handle(state, event, now)[1]
        out.append(actions)
        return actions

    do(RequestWork(A), 0.0)  # no speed report yet → NO_SPEED
    do(SpeedReport(A, 100.0), 0.0)
    lease = lease_of(do(RequestWork(A), 0.0))
    do(SubmitUpdate(A, "L-unknown", 0, torch.zeros(N)), 1.0)  # → UNKNOWN_LEASE
    do(SubmitUpdate(A, lease.lease_id, lease.base_version, torch.zeros(N + 1)), 1.0)  # wrong shape → INVALID_UPDATE
    do(SubmitUpdate(A, lease.lease_id, lease.base_version + 1, torch.zeros(N)), 1.0)  # wrong base → INVALID_UPDATE
    do(SpeedReport(B, 100.0), 1.0)
    lease_b = lease_of(do(RequestWork(B), 1.0))
    do(SubmitUpdate(A, lease_b.lease_id, lease_b.base_version, torch.zeros(N)), 1.0)  # B's lease → INVALID_UPDATE
    do(SubmitUpdate(A, lease.lease_id, lease.base_version, torch.full((N,), float("nan"))), 1.0)  # NaN → INVALID_UPDATE
    do(Fingerprint(C, "model architecture differs", ("architecture",), "0.0.1"), 2.0)  # → Incompatible
    do(Fingerprint(C, "model architecture differs", ("architecture",), "0.0.1"), 2.0)  # the same again: nothing
    do(SpeedReport(C, 100.0), 2.0)  # turned away silently (no say in DyLU)
    do(RequestWork(C), 2.0)  # → Refused INCOMPATIBLE
    do(Fingerprint(C, ""), 3.0)  # a later check fits: admitted again
    return out


EXPECTED_REFUSALS = [
    [("Rejected", "no speed report from this peer yet; it must publish its throughput first", RefusalCode.NO_SPEED)],
    [], [],
    [("Rejected", "unknown or expired lease; its steps were given back", RefusalCode.UNKNOWN_LEASE)],
    [("Rejected", "pseudo-gradient has shape (5,), θ has (4,)", RefusalCode.INVALID_UPDATE)],
    [("Rejected", "base_version 1 does not match the lease's 0", RefusalCode.INVALID_UPDATE)],
    [], [],
    [("Rejected", "lease L-B belongs to another peer", RefusalCode.INVALID_UPDATE)],
    [("Rejected", "pseudo-gradient contains NaN or Inf, or its norm overflows float32", RefusalCode.INVALID_UPDATE)],
    [], [], [],
    [("Refused", "model architecture differs", RefusalCode.INCOMPATIBLE)],
    [],
]


def _expected(actions: list[list[Any]]) -> list[list[tuple[str, str, RefusalCode]]]:
    lease_b = lease_of(actions[7]).lease_id
    return [[(k, r.replace("L-B", lease_b), c) for k, r, c in row] for row in EXPECTED_REFUSALS]


@pytest.mark.timeout(60)
def test_each_refusal_has_its_code_decided_in_handle() -> None:
    state = make_state()
    actions = run(state)
    assert [codes(a) for a in actions] == _expected(actions)
    assert [a for a in actions[10] if isinstance(a, Incompatible)] == [Incompatible(C, ("architecture",), "0.0.1", "model architecture differs")]
    assert actions[11] == []  # the same refusal again changes nothing (no journal line, no WAL growth beyond the event)
    assert state.incompatible == {} and is_admitted(state, C, 3.0)
    assert logic.admission_code(state, C) is RefusalCode.NOT_ADMITTED  # (asked only for a refused peer)


@pytest.mark.timeout(60)
def test_quarantine_stale_and_admission_codes() -> None:
    state = make_state(max_staleness=0)
    handle(state, SpeedReport(A, 100.0), 0.0)
    handle(state, SpeedReport(B, 100.0), 0.0)
    lease_a = lease_of(handle(state, RequestWork(A), 0.0)[1])
    lease_b = lease_of(handle(state, RequestWork(B), 0.0)[1])
    applied = handle(state, SubmitUpdate(B, lease_b.lease_id, 0, torch.ones(N)), 1.0)[1]
    assert state.version == 1, applied
    assert codes(handle(state, SubmitUpdate(A, lease_a.lease_id, 0, torch.ones(N)), 1.0)[1]) == [
        ("Rejected", "staleness 1 exceeds the bound 0", RefusalCode.STALE)]
    state.gate.quarantined_until[A] = 50.0
    assert codes(handle(state, RequestWork(A), 2.0)[1]) == [
        ("Rejected", "quarantined until 50 after repeated rejected updates", RefusalCode.QUARANTINED)]
    allow = make_state(admission="allowlist", allowlist=frozenset({A}))
    assert codes(handle(allow, RequestWork(B), 0.0)[1]) == [
        ("Refused", "this peer id is not in the run's runtime.allowlist; send it to the organiser", RefusalCode.NOT_ADMITTED)]
    allow.verification.expelled[A] = "lease Lx did not reproduce"
    assert codes(handle(allow, RequestWork(A), 0.0)[1]) == [
        ("Refused", "expelled from this run: lease Lx did not reproduce", RefusalCode.EXPELLED)]


def _decode_blob(codec: str, numel: int, data: memoryview) -> torch.Tensor:
    assert codec == "fp32"
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()


@pytest.mark.timeout(60)
def test_replaying_the_log_reproduces_the_codes_and_the_state(tmp_path: Path) -> None:
    live = make_state()
    record: list[tuple[Any, float]] = []
    live_actions = run(live, record)
    wal = open_log(tmp_path, 0)
    for event, now in record:
        if isinstance(event, SubmitUpdate):  # the update travels as an attachment, as the daemon logs it
            update = event.pseudo_gradient.contiguous()
            plain = SubmitUpdate(event.peer, event.lease_id, event.base_version, None)  # type: ignore[arg-type]
            wal.append_event(plain, now, {"pseudo_gradient": ("fp32", update.numel(), [update.numpy().tobytes()])})
        else:
            wal.append_event(event, now)
    wal.sync()
    wal.close()
    replayed = make_state()
    replay_actions = []
    for rec in read_records(tmp_path / WAL_DIR, 0):
        event = decode_event(rec, EVENT_TYPES, _decode_blob)
        replay_actions.append(handle(replayed, event, rec.now)[1])
    assert [codes(a) for a in replay_actions] == [codes(a) for a in live_actions] == _expected(live_actions)
    assert replayed.incompatible == live.incompatible == {}
    assert replayed.state_dict()["incompatible"] == {}


@pytest.mark.timeout(60)
def test_incompatible_peers_survive_a_snapshot() -> None:
    state = make_state()
    handle(state, Fingerprint(C, "tokenizer differs", ("tokenizer",), "9.9"), 0.0)
    restored = make_state()
    restored.load_state_dict(state.state_dict())
    assert restored.incompatible == {C: "tokenizer differs"} and not is_admitted(restored, C, 1.0)


@pytest.mark.timeout(30)
def test_wire_carries_codes_and_refuses_unknown_ones() -> None:
    reply = LeaseReply(None, "quarantined until 50", RefusalCode.QUARANTINED.value)
    assert LeaseReply.from_wire(reply.to_wire()) == reply
    assert reply.to_wire() == {"reason": "quarantined until 50", "code": "quarantined"}
    ack = Ack(False, 3, "staleness 5 exceeds the bound 4", False, code="stale")
    assert Ack.from_wire(ack.to_wire()).code == "stale"
    assert "code" not in Ack(True, 3, "applied", False).to_wire()
    with pytest.raises(MessageError, match=r"LeaseReply\.code: 'bogus' is not a refusal code"):
        LeaseReply.from_wire({"reason": "x", "code": "bogus"})
    with pytest.raises(MessageError, match=r"Ack\.code"):
        Ack.from_wire({"accepted": False, "version": 0, "reason": "x", "duplicate": False, "code": 7})


@pytest.mark.timeout(30)
def test_error_frames_carry_the_code_and_the_peer_reacts_to_it() -> None:
    text = frame_text(RefusalCode.INCOMPATIBLE, "Refusal: not admitted: tokenizer differs")
    assert text == "[incompatible] Refusal: not admitted: tokenizer differs"
    assert parse_frame(text) == (RefusalCode.INCOMPATIBLE, "Refusal: not admitted: tokenizer differs")
    assert parse_frame("[nonsense] x") == (None, "[nonsense] x")
    assert parse_frame("ValueError: version 3 is no longer served") == (None, "ValueError: version 3 is no longer served")
    for code in RefusalCode:
        error = RemoteError(frame_text(code, "whatever the text says"))
        assert error.code is code
        assert refused_admission(error) is (code in FATAL)
    assert FATAL == {RefusalCode.NOT_ADMITTED, RefusalCode.EXPELLED, RefusalCode.INCOMPATIBLE}
    # text alone no longer decides: "not admitted" without a code is retried, a code without the words is fatal
    assert not refused_admission(RemoteError("PermissionError: not admitted: whatever"))
    assert refused_admission(RemoteError(frame_text(RefusalCode.EXPELLED, "bye")))
    refusal = Refusal(RefusalCode.NOT_ADMITTED, "not admitted: no token")
    assert isinstance(refusal, PermissionError) and refusal.code is RefusalCode.NOT_ADMITTED and str(refusal) == "not admitted: no token"
