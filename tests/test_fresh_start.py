"""Leases that start fresh for an uplink that cannot carry a reveal (``runtime.verify.fresh_start_reveal_s``;
coordinator/logic/leases.py ``fresh_reason``).

With ``inner_state: carry`` a checked lease is re-run from its start inner state, which its peer reveals; on an uplink
below the RPC floor that reveal never arrives and an honest peer was expelled (docs/results/wan-home150-defaults-*.json).
Such a peer's leases start from a fresh inner state and no error-feedback residual instead: the check re-runs them from
θ and the data, with nothing revealed. Pinned here: the threshold's closed form, which leases are fresh (and which are
not: an unreported uplink, ``reset`` runs, the knob at 0), the wire, a submission that ignores the fresh start refused
(its steps given back, nothing applied), and the real daemon with real peers — the slow one never asked to reveal and
every one of its checks bitwise, the fast one revealing as before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.outer import OuterNesterov
from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import (
    Applied, Assign, CoordinatorPolicy, Expired, Rejected, RequestWork, SpeedReport, SubmitUpdate, Verify, VerifyPolicy,
    handle, new_state,
)
from asyncloco.coordinator.logic.draws import PROBATION_WAIT
from asyncloco.coordinator.logic.leases import CARRIED_ON, carries_checked
from asyncloco.coordinator.verify import fresh_below, needs_reveal
from asyncloco.peer.runner import PeerRunner
from asyncloco.refusals import RefusalCode
from asyncloco.testing.memory import MemoryTransport, drive
from asyncloco.train.commitments import FRESH_STATE_DIGEST, revealed_size
from asyncloco.transport.errors import MessageError
from asyncloco.transport.linkspeed import LinkSpeed
from asyncloco.transport.rpc import ServiceLimits
from asyncloco.transport.wire import LeaseGrant
from tests.test_verify_reveal import config, journal, start_peer

pytestmark = pytest.mark.timeout(240)

BELOW = 131_072.0  # bytes/s: twice the RPC floor, the threshold of a small model
DIM = 6


def with_verify(cfg: RunConfig, **knobs: Any) -> RunConfig:
    data = cfg.model_dump()
    data["runtime"]["verify"].update(knobs)
    return RunConfig.model_validate(data)


def state_with(fresh: float = BELOW, commit: bool = True) -> logic.CoordinatorState:
    policy = CoordinatorPolicy(
        max_local_steps=4, grace_period=0.0, lease_timeout_factor=3.0, lease_slack=100.0,
        verify=VerifyPolicy(fraction=0.0, probation_updates=0, suspect_fraction=0.0, commit=commit, fresh_below=fresh),
    )
    return new_state(torch.zeros(DIM), OuterNesterov(0.5, 0.9), [], policy, [10_000], seed=3, lease_secret=b"s" * 32)


def lease_of(state: logic.CoordinatorState, peer: str, now: float, link_up: float | None = None) -> tuple[logic.Lease, str]:
    handle(state, SpeedReport(peer, 10.0, now, None, link_up=link_up), now)
    _, actions = handle(state, RequestWork(peer), now)
    assign = next(a for a in actions if isinstance(a, Assign))
    return assign.lease, assign.reason


def test_the_threshold_in_closed_form() -> None:
    """max(2 × the RPC floor, one inner state's reveal bytes / fresh_start_reveal_s); 0 turns it off."""
    cfg = config(feedback=True)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    sizes = [1000 * 1000, 1000, 1000 * 10, 10]
    # per parameter tensor 9 bytes of markers and step count + 8 bytes per element (two fp32 moments); with error
    # feedback the residual (8 + 4 bytes per element): one part of a reveal
    part = sum(9 + 8 * n for n in sizes) + 8 + 4 * sum(sizes)
    assert part == revealed_size(sum(9 + 8 * n for n in sizes), sum(sizes), True, ends=False) == 12_132_164
    floor = 2 * ServiceLimits().transfer_min_bytes_per_s
    assert fresh_below(cfg, model) == max(floor, part / 300.0) == floor == 131_072  # 12 MB in 300 s: the floor dominates
    assert fresh_below(with_verify(cfg, fresh_start_reveal_s=10.0), model) == part / 10.0 > floor  # in 10 s: 1.2 MB/s
    assert fresh_below(with_verify(cfg, fresh_start_reveal_s=0.0), model) == 0.0


def test_which_leases_start_fresh() -> None:
    state = state_with()
    slow, why = lease_of(state, "slow", 0.0, link_up=12_500.0)  # 0.1 Mbit/s: home150's uplink
    assert slow.fresh and ("; fresh inner state: uplink 12.5 kB/s, below the 131 kB/s a reveal needs "
                           "(runtime.verify.fresh_start_reveal_s); shard 0") in why
    fast, why = lease_of(state, "fast", 0.0, link_up=BELOW)  # at the threshold: carries its state
    assert not fast.fresh and "fresh" not in why
    unknown, _ = lease_of(state, "new", 0.0)  # nothing reported yet: carries (its first lease starts fresh anyway)
    assert not unknown.fresh
    # a fresh lease round-trips the state dict (snapshots, --resume)
    restored = state_with()
    restored.load_state_dict(state.state_dict())
    assert restored.leases[slow.lease_id].fresh and not restored.leases[fast.lease_id].fresh
    # the rate is the peer's latest report: a faster one turns it back to carrying
    again, _ = lease_of(state, "slow", 1.0, link_up=2 * BELOW)
    assert not again.fresh
    for other in (state_with(fresh=0.0), state_with(commit=False)):  # the knob at 0; inner_state reset (no commitments)
        assert not lease_of(other, "slow", 0.0, link_up=12_500.0)[0].fresh


def test_the_wire_and_the_check() -> None:
    from asyncloco.coordinator.serving import lease_to_wire

    state = state_with()
    slow, _ = lease_of(state, "slow", 0.0, link_up=12_500.0)
    fast, _ = lease_of(state, "fast", 0.0, link_up=1e7)
    assert LeaseGrant.from_wire(lease_to_wire(slow, 8)).fresh is True
    assert "fresh" not in lease_to_wire(fast, 8) and LeaseGrant.from_wire(lease_to_wire(fast, 8)).fresh is None
    with pytest.raises(MessageError, match="fresh"):
        LeaseGrant.from_wire({**lease_to_wire(slow, 8), "fresh": "yes"})
    # a check of a fresh lease asks for no reveal (re-run from θ and the data); a carried one does
    empty = torch.empty(0)
    assert not needs_reveal([Verify("slow", slow, empty, empty, "probation", state_start=FRESH_STATE_DIGEST)], slow.lease_id)
    assert needs_reveal([Verify("fast", fast, empty, empty, "probation", state_start="a" * 64)], fast.lease_id)


def test_a_submission_that_ignores_its_fresh_start_is_refused() -> None:
    state = state_with()
    lease, _ = lease_of(state, "p", 0.0, link_up=12_500.0)
    assigned = state.shards[lease.shard].assigned

    def submit(start: str, now: float) -> list[logic.Action]:
        event = SubmitUpdate("p", lease.lease_id, lease.base_version, torch.ones(DIM), state_start=start, state_end="b" * 64)
        return handle(state, event, now)[1]

    actions = submit("a" * 64, 1.0)  # carried its state anyway (a client of an earlier version)
    assert [type(a) for a in actions] == [Rejected, Expired]
    refusal = actions[0]
    assert isinstance(refusal, Rejected) and refusal.code == RefusalCode.BROKEN_CHAIN
    assert refusal.reason.startswith("this lease was granted with a fresh inner state") and "upgrade the peer" in refusal.reason
    assert state.version == 0 and lease.lease_id not in state.leases and not state.verification.expelled
    assert state.shards[lease.shard].assigned == assigned - lease.steps  # its steps given back
    lease, _ = lease_of(state, "p", 2.0)
    assert lease.fresh  # the last report stands
    assert [type(a) for a in submit(FRESH_STATE_DIGEST, 3.0)] == [Applied]
    assert state.version == 1 and state.verification.chain == {"p": "b" * 64}


class RevealCounter(PeerRunner):
    asked = 0

    async def _reveal(self, client: Any, lease_id: str, digest: Any, end: bool = True, start: bool = True) -> None:
        self.asked += 1
        await super()._reveal(client, lease_id, digest, end, start)


def _run(cfg: RunConfig, run_dir: Path, rounds: int, names: tuple[str, ...]) -> dict[str, Any]:
    """Honest peers over the in-memory transport, "slow" stating a 10 kB/s uplink (below the floor), the others none:
    per peer the reveals asked of it, its fresh starts and its status row's ``fresh_start``; the coordinator's state,
    its kept states' counters and its policy's ``keep_class`` against its verifier's compute class."""
    clock = FakeClock()

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        await transport.start()
        try:
            slow_link = LinkSpeed()
            assert slow_link.observe("up", 1_000_000, 100.0)  # 10 kB/s, as its uploads measured it
            peers = {name: start_peer(transport, name, rounds=rounds, runner_cls=RevealCounter,
                                      link=slow_link if name == "slow" else None) for name in names}
            daemon = transport.daemon
            assert daemon is not None and daemon.verification is not None and daemon.node.state.policy.verify is not None
            await drive(clock, {name: task for name, (_, task) in peers.items()}, real_timeout=150.0)
            await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)
            for _, task in peers.values():
                task.result()
            status = daemon.monitoring.status_document(clock.time())["peers"]
            return {"status": {row.get("name") or peer_id: row["fresh_start"] for peer_id, row in status.items()},
                    "awaiting": {row.get("name") or peer_id: row["checks_awaiting"] for peer_id, row in status.items()},
                    "asked": {name: runner.asked for name, (runner, _) in peers.items()},
                    "fresh": {name: runner.summary.fresh_starts for name, (runner, _) in peers.items()},
                    "state": daemon.node.state, "chained": daemon.verification.chained.status(),
                    "keep_class": (daemon.node.state.policy.verify.keep_class,
                                   daemon.verification.verifier.rerunner.compute_class)}
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    return asyncio.run(asyncio.wait_for(scenario(), timeout=220.0))


def test_a_slow_uplink_reveals_nothing_and_passes_every_check(tmp_path: Path) -> None:
    """Two honest peers with sign-coded uploads and error feedback, every lease checked: "slow" states a 10 kB/s uplink
    (below the floor) — every lease of it is fresh, no reveal is asked of it, its residual starts afresh with each
    lease, and each check is bitwise; "fast" states none and carries its state, revealing each later lease."""
    cfg = with_verify(config(feedback=True), fraction=1.0, keep_states_mb=0)
    run_dir = tmp_path / "run"
    rounds = 6
    out = _run(cfg, run_dir, rounds, ("slow", "fast"))
    assert out["keep_class"][0] == ""  # no end state kept: every lease of the slow uplink fresh
    verdicts = journal(run_dir, "verdict")
    assert verdicts and all(v["ok"] and v["detail"].startswith("bitwise") for v in verdicts), verdicts
    assigned = journal(run_dir, "assign")
    leases = {name: [r for r in assigned if r["peer"] == name] for name in ("slow", "fast")}
    assert [len(leases["slow"]), len(leases["fast"])] == [rounds, rounds]
    assert all(r["fresh"] for r in leases["slow"]) and not any(r["fresh"] for r in leases["fast"])
    assert all("fresh inner state: uplink 10 kB/s, below the 131 kB/s" in r["reason"] for r in leases["slow"])
    # every lease drawn for a re-run got its verdict (probation's later leases are held on the earlier verdicts)
    drawn = {name: sorted(r["lease_id"] for r in leases[name] if r["verify"] and "not re-run" not in r["verify"])
             for name in leases}
    judged = {name: sorted(v["lease_id"] for v in verdicts if v["peer"] == name) for name in leases}
    assert judged == drawn and min(len(judged["slow"]), len(judged["fast"])) >= 3
    assert out["asked"] == {"slow": 0, "fast": len(judged["fast"]) - 1}  # fast's first lease starts fresh by itself
    assert out["fresh"] == {"slow": rounds, "fast": 0}
    assert out["status"] == {"slow": "fresh inner state: uplink 10 kB/s, below the 131 kB/s a reveal needs "
                                     "(runtime.verify.fresh_start_reveal_s)", "fast": ""}  # status.json says why
    assert not out["state"].verification.expelled and out["state"].version == 2 * rounds


def _submit_ok(state: logic.CoordinatorState, lease: logic.Lease, start: str, end: str, now: float,
               device_class: str = "cpu") -> None:
    event = SubmitUpdate(lease.peer, lease.lease_id, lease.base_version, torch.ones(DIM), state_start=start,
                         state_end=end, device_class=device_class)
    actions = handle(state, event, now)[1]
    assert not any(isinstance(a, Rejected) for a in actions), actions


def _slow_state(**knobs: Any) -> logic.CoordinatorState:
    state = state_with()
    assert state.policy.verify is not None
    state.policy = dataclasses.replace(state.policy, verify=dataclasses.replace(
        state.policy.verify, **{"fraction": 0.0, "keep_class": "cpu", "slow_carry": 1.0, **knobs}))
    return state


def _set(state: logic.CoordinatorState, **knobs: Any) -> None:
    assert state.policy.verify is not None
    state.policy = dataclasses.replace(state.policy, verify=dataclasses.replace(state.policy.verify, **knobs))


def test_after_a_lease_re_run_here_a_slow_uplink_carries_its_state() -> None:
    """``VerifyPolicy.keep_class`` and ``slow_carry`` (leases.draw_carry, carries_checked): a slow-uplink peer's lease
    carries its inner state exactly when the lease before it was drawn to be carried on — a draw of its own, which
    makes that lease re-run (``CARRIED_ON``) whatever its check draw; otherwise it starts fresh, as without the knob."""
    state = _slow_state()
    first, _ = lease_of(state, "slow", 0.0, link_up=12_500.0)
    assert first.fresh and first.verify == CARRIED_ON  # not drawn for a check, re-run for the next lease's start
    _submit_ok(state, first, FRESH_STATE_DIGEST, "e1", 1.0)
    second, why = lease_of(state, "slow", 2.0)
    assert not second.fresh and "fresh" not in why and second.verify == CARRIED_ON
    _submit_ok(state, second, "e1", "e2", 3.0)
    _set(state, slow_carry=0.0)
    third, _ = lease_of(state, "slow", 4.0)
    assert not third.fresh and third.verify == ""  # carried (the second was carried on); itself not
    _submit_ok(state, third, "e2", "e3", 5.0)
    _set(state, fraction=1.0)
    fourth, _ = lease_of(state, "slow", 6.0)
    assert fourth.fresh and fourth.verify == "sampled at 1"
    _submit_ok(state, fourth, FRESH_STATE_DIGEST, "e4", 7.0)
    fifth, _ = lease_of(state, "slow", 8.0)
    assert fifth.fresh  # its predecessor is checked, but the carry is not its check draw: nothing told ahead
    _set(state, slow_carry=1.0)
    _submit_ok(state, fifth, FRESH_STATE_DIGEST, "e5", 9.0, device_class="cuda:NVIDIA H200")
    sixth, _ = lease_of(state, "slow", 10.0)
    assert sixth.fresh and not state.peers["slow"].carry_next  # another class than the verifier's: its end is revealed
    fast, _ = lease_of(state, "fast", 0.0, link_up=2 * BELOW)
    assert not fast.fresh and fast.verify == "sampled at 1" and not state.peers["fast"].carry_next  # no slow uplink
    # a probation lease is re-run anyway: the next carries; a probation wait is only held: the one after it is fresh
    waiting = _slow_state(probation_updates=1, slow_carry=0.0)
    probation, _ = lease_of(waiting, "slow", 0.0, link_up=12_500.0)
    assert probation.fresh and probation.verify.startswith("probation (0 of 1")
    waiting.peers["slow"].device_class = "cpu"  # as named by an earlier submission
    waiting.verification.passed["other"] = 1  # a proven peer's update moves θ on (no lease twice from one θ)
    other, _ = lease_of(waiting, "other", 0.1)
    _submit_ok(waiting, other, FRESH_STATE_DIGEST, "o1", 0.2)
    assert waiting.version == 1
    _set(waiting, slow_carry=1.0)
    _, actions = handle(waiting, RequestWork("slow", keep=probation.lease_id), 0.5)  # asked ahead while it trains
    held = next(a for a in actions if isinstance(a, Assign)).lease
    assert not held.fresh and held.verify.startswith(PROBATION_WAIT)  # still only held, not made a re-run
    assert not carries_checked(waiting.policy, waiting.peers["slow"])  # the lease after it starts fresh
    # without keep_class (the daemon keeps no end state: keep_states_mb 0, validators, reset) every lease is fresh
    plain = _slow_state(keep_class="")
    one, _ = lease_of(plain, "slow", 0.0, link_up=12_500.0)
    assert one.verify == ""
    _submit_ok(plain, one, FRESH_STATE_DIGEST, "x1", 1.0)
    assert lease_of(plain, "slow", 2.0)[0].fresh


def test_a_slow_uplink_is_not_carried_on_while_its_checks_await_their_verdicts() -> None:
    """Back-pressure (``VerifyPolicy.carry_backlog_bytes``; leases.draw_carry): while the update and base θ kept for each
    of the peer's checks awaiting their verdicts reach the budget no lease of it is carried on — the next one starts fresh, this one is checked at the usual fraction (0 here:
    not at all) — and carrying resumes once a verdict is in. Only the optional re-runs are shed: a drawn one stays."""
    state = _slow_state(carry_backlog_bytes=2 * 8 * DIM)  # two checks' update and base θ
    first, _ = lease_of(state, "slow", 0.0, link_up=12_500.0)
    assert first.verify == CARRIED_ON
    _submit_ok(state, first, FRESH_STATE_DIGEST, "e1", 1.0)
    second, _ = lease_of(state, "slow", 2.0)
    assert not second.fresh and second.verify == CARRIED_ON  # one check awaits: below the backlog
    _submit_ok(state, second, "e1", "e2", 3.0)
    assert logic.leases.awaiting_verdicts(state, "slow") == 2
    third, why = lease_of(state, "slow", 4.0)
    assert not third.fresh and third.verify == "" and not state.peers["slow"].carry_next  # carried, not carried on
    assert ("not carried on: 2 of its checks await their verdicts, 9.155e-05 MB kept for them (runtime.verify."
            "carry_backlog_mb 9.155e-05)") in why
    _submit_ok(state, third, "e2", "e3", 5.0)
    assert logic.leases.awaiting_verdicts(state, "slow") == 2  # the third is not re-run
    other, why = lease_of(state, "other", 5.5, link_up=12_500.0)
    assert other.verify == CARRIED_ON and "not carried on" not in why  # per peer: another's backlog sheds nothing
    _set(state, fraction=1.0)
    fourth, why = lease_of(state, "slow", 6.0)
    assert fourth.fresh and fourth.verify == "sampled at 1" and "not carried on" in why  # drawn: still checked
    _set(state, fraction=0.0)
    _submit_ok(state, fourth, FRESH_STATE_DIGEST, "e4", 7.0)
    assert logic.leases.awaiting_verdicts(state, "slow") == 3
    for lease_id, now in ((first.lease_id, 8.0), (second.lease_id, 8.5)):
        handle(state, logic.Verified("slow", lease_id, True, "bitwise"), now)
    assert logic.leases.awaiting_verdicts(state, "slow") == 1
    fifth, why = lease_of(state, "slow", 9.0)
    assert fifth.fresh and fifth.verify == CARRIED_ON and state.peers["slow"].carry_next and "not carried on" not in why


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_a_carried_on_lease_is_checked_and_applied_first(share: float) -> None:
    """The lease a carry follows is re-run (applied first, as a drawn one: not a probation or a suspect's), its base θ
    retained until then; with no carry drawn nothing is checked (fraction 0)."""
    state = _slow_state(slow_carry=share)
    first, _ = lease_of(state, "slow", 0.0, link_up=12_500.0)
    handle(state, logic.Fetched("slow", first.base_version), 0.1)
    assert state.peers["slow"].carry_next is (share == 1.0)
    other, _ = lease_of(state, "other", 0.2)
    _submit_ok(state, other, FRESH_STATE_DIGEST, "o1", 0.3)  # θ moves on: the first lease's base is now an old version
    assert (logic.base_theta(state, 0) is not None) is (share == 1.0)  # retained only for the re-run
    event = SubmitUpdate("slow", first.lease_id, 0, torch.ones(DIM), state_start=FRESH_STATE_DIGEST, state_end="e1",
                         device_class="cpu")
    actions = handle(state, event, 1.0)[1]
    checks = [a for a in actions if isinstance(a, Verify)]
    assert [c.reason.startswith(CARRIED_ON) and c.base.numel() == DIM for c in checks] == ([] if share == 0.0 else [True])
    assert any(isinstance(a, Applied) for a in actions)


def test_a_slow_uplink_carries_after_checks_and_reveals_nothing(tmp_path: Path) -> None:
    """The real daemon keeps its re-runs' end states (the default keep_states_mb), slow_uplink_carry at 0.75 (some leases
    not carried on): the slow peer's lease after a re-run one carries its inner state and residual, after any other it
    starts fresh; no reveal is asked of it, every check is bitwise, none ends unverified, and the status says both
    rules."""
    cfg = with_verify(config(feedback=True), fraction=0.5, probation_updates=2, keep_states_mb=64, slow_uplink_carry=0.75)
    run_dir = tmp_path / "run"
    rounds = 10
    out = _run(cfg, run_dir, rounds, ("slow",))
    assert out["keep_class"][0] == out["keep_class"][1] != ""
    leases = [r for r in journal(run_dir, "assign") if r["peer"] == "slow"]
    assert len(leases) == rounds
    verdicts = journal(run_dir, "verdict")
    assert all(v["ok"] and v["detail"].startswith("bitwise") for v in verdicts), verdicts
    judged = {v["lease_id"] for v in verdicts}
    drawn = {r["lease_id"] for r in leases if r["verify"] and "not re-run" not in r["verify"]}
    assert drawn <= judged  # every lease drawn at its grant was re-run; the rest of the judged ones were carried on
    carried = [i for i in range(1, rounds) if not leases[i]["fresh"]]
    assert leases[0]["fresh"] and len(carried) >= 2
    # the rule, lease by lease: a lease carries its state only when the one before it was re-run here
    assert all(leases[i - 1]["lease_id"] in judged for i in carried)
    assert judged - drawn <= {leases[i - 1]["lease_id"] for i in carried}  # re-run only because the next one carried
    assert not journal(run_dir, "unverified") and out["asked"] == {"slow": 0}
    assert out["fresh"] == {"slow": rounds - len(carried)}
    # each carried lease that was itself re-run started from a kept end state (or one kept at its predecessor's verdict)
    assert out["chained"]["kept"] + out["chained"]["waited"] == sum(leases[i]["lease_id"] in judged for i in carried)
    assert out["status"]["slow"].endswith("; carried after a lease re-run here (its end state kept: no reveal)")
    assert not out["state"].verification.expelled and out["state"].version == rounds


def test_a_carried_start_not_at_hand_ends_unverified_never_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A carried lease's start state gone from the coordinator (a restart, a state dropped from keep_states_mb: here
    every kept one is "lost") — its check ends unverified, no reveal is asked of the slow uplink, nobody is expelled;
    the fresh leases' checks still pass bitwise."""
    from asyncloco.coordinator.chained import ChainedStates

    original = ChainedStates.start

    def lost(self: ChainedStates, check: Verify, full: bool = False) -> tuple[str, Any]:
        how, start = original(self, check, full)
        if check.state_start == FRESH_STATE_DIGEST:
            return how, start
        for waited, waiting in list(self.waiting.items()):  # nor handed on at the previous lease's verdict
            if waiting is check:
                del self.waiting[waited]
        return "", None

    monkeypatch.setattr(ChainedStates, "start", lost)
    cfg = with_verify(config(feedback=True), fraction=0.5, probation_updates=2, keep_states_mb=64, slow_uplink_carry=0.75)
    run_dir = tmp_path / "run"
    rounds = 8
    out = _run(cfg, run_dir, rounds, ("slow",))
    leases = {r["lease_id"]: r for r in journal(run_dir, "assign")}
    verdicts = journal(run_dir, "verdict")
    unverified = journal(run_dir, "unverified")
    assert verdicts and all(v["ok"] and v["detail"].startswith("bitwise") and leases[v["lease_id"]]["fresh"]
                            for v in verdicts), verdicts
    assert unverified and all(not leases[u["lease_id"]]["fresh"] and "its start state is not kept here" in u["reason"]
                              and "a reveal cannot cross its uplink" in u["reason"] for u in unverified), unverified
    chosen = {lease_id for lease_id, r in leases.items() if r["verify"] and "not re-run" not in r["verify"]}
    assert {u["lease_id"] for u in unverified} == {lease_id for lease_id in chosen if not leases[lease_id]["fresh"]}
    assert {v["lease_id"] for v in verdicts} == {lease_id for lease_id in chosen if leases[lease_id]["fresh"]}
    assert out["asked"] == {"slow": 0} and not out["state"].verification.expelled


def test_at_the_default_share_every_slow_lease_is_re_run_and_carried_on(tmp_path: Path) -> None:
    """``runtime.verify.slow_uplink_carry`` at its default (1.0), the real daemon and a slow uplink: every lease of it is
    re-run here — drawn or not — and the next one carries its inner state and residual from the kept end, so the only
    fresh starts are the first lease and the leases after a probation wait (held, not re-run); no reveal is asked,
    every check is bitwise, none ends unverified."""
    assert RunConfig.model_validate(config().model_dump()).runtime.verify.slow_uplink_carry == 1.0  # not pinned here
    cfg = with_verify(config(feedback=True), fraction=0.5, probation_updates=2, keep_states_mb=64)
    run_dir = tmp_path / "run"
    rounds = 10
    out = _run(cfg, run_dir, rounds, ("slow",))
    leases = [r for r in journal(run_dir, "assign") if r["peer"] == "slow"]
    assert len(leases) == rounds
    verdicts = journal(run_dir, "verdict")
    assert all(v["ok"] and v["detail"].startswith("bitwise") for v in verdicts), verdicts
    judged = [v["lease_id"] for v in verdicts]
    waits = {r["lease_id"] for r in leases if r["verify"].startswith(PROBATION_WAIT)}
    assert sorted(judged) == sorted(r["lease_id"] for r in leases if r["lease_id"] not in waits)  # each once
    fresh = [i for i, r in enumerate(leases) if r["fresh"]]
    assert fresh == [0] + [i for i in range(1, rounds) if leases[i - 1]["lease_id"] in waits]
    assert len(fresh) < rounds // 2
    assert not journal(run_dir, "unverified") and out["asked"] == {"slow": 0}
    assert out["fresh"] == {"slow": len(fresh)}
    assert out["chained"]["kept"] + out["chained"]["waited"] == rounds - len(fresh)
    assert out["awaiting"] == {"slow": 0}  # status.json, after the drain: every check has its verdict
    assert not out["state"].verification.expelled and out["state"].version == rounds
