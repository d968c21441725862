"""Overlapped rounds (runtime.overlap; asyncloco/peer/pipeline.py): a peer trains its next lease while its last update
uploads, and nothing is lost or applied twice with a lease in flight.

The logic (coordinator/logic/leases.py): a request naming the lease still uploading (``keep``) keeps it active, gives
back any other, and is never held for the peer's own update. The runtime — the real daemon and the real runner over the
in-memory transport (asyncloco/testing/memory.py), with the carried inner state committed and verified — through the
moments that matter, each made to happen while the next lease trains (the trainer is gated in its thread, the client
holds the upload until then): a coordinator restart (the upload is resent and answered as a duplicate), a refused
update (the lease trained from its end state is not submitted, the chain goes on from a fresh state, nobody is
expelled), a reveal request (sent during the training and checked bitwise), and both Ctrl+Cs. Each asserts exact counts
from the journal and the summaries: every update applied once, every lease either applied or given back.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from asyncloco.algo.outer import OuterSGD
from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.daemon import JOURNAL_FILE
from asyncloco.coordinator.logic import (
    Applied, Assign, CoordinatorPolicy, Expired, Hold, RequestWork, SpeedReport, SubmitUpdate, handle, new_state,
)
from asyncloco.peer.runner import PeerOptions, PeerRunner
from asyncloco.testing.memory import KillSwitch, MemoryClient, MemoryTransport, as_actor, drive
from asyncloco.train.inner import InnerTrainer
from asyncloco.transport.rpc import TrafficCounters
from asyncloco.transport.wire import Ack, AssignRequest

SPEED = 1000.0


# ------------------------------------------------------------------------------------------------ the logic


def _state(grace: float = 0.0) -> Any:
    policy = CoordinatorPolicy(max_local_steps=10, min_steps=1, grace_period=grace, units_per_step=1,
                               lease_timeout_factor=3.0, lease_slack=5.0)
    state = new_state(torch.zeros(4), OuterSGD(0.5), (), policy, (1000,), 0)
    for peer in ("a", "b"):
        handle(state, SpeedReport(peer, 1.0), 0.0)
    return state


def _lease(actions: list[Any]) -> Any:
    assert len(actions) == 1 and isinstance(actions[0], Assign), actions
    return actions[0].lease


def test_a_request_keeping_the_lease_in_flight_gets_a_second_lease_and_gives_back_any_other() -> None:
    state = _state()
    first = _lease(handle(state, RequestWork("a"), 0.0)[1])
    second = _lease(handle(state, RequestWork("a", keep=first.lease_id), 10.0)[1])  # trained: asks before uploading
    assert sorted(state.leases) == sorted([first.lease_id, second.lease_id]) and second.base_version == 0
    # asking again keeping the first: the second (abandoned) goes back, the first stays
    expired, third = handle(state, RequestWork("a", keep=first.lease_id), 11.0)[1]
    assert isinstance(expired, Expired) and expired.lease_id == second.lease_id and "before submitting" in expired.reason
    third_lease = _lease([third])
    assert sorted(state.leases) == sorted([first.lease_id, third_lease.lease_id])
    # the kept update arrives and is applied; its staleness is the version the next lease was based on
    (applied,) = handle(state, SubmitUpdate("a", first.lease_id, 0, torch.ones(4)), 12.0)[1]
    assert isinstance(applied, Applied) and applied.version == 1
    (applied,) = handle(state, SubmitUpdate("a", third_lease.lease_id, 0, torch.ones(4)), 20.0)[1]
    assert isinstance(applied, Applied) and applied.version == 2 and applied.staleness == 1
    # without keep, a peer holds one lease: asking again abandons it (serial rounds, unchanged)
    fourth = _lease(handle(state, RequestWork("a"), 21.0)[1])
    expired, fifth = handle(state, RequestWork("a"), 22.0)[1]
    assert isinstance(expired, Expired) and expired.lease_id == fourth.lease_id and list(state.leases) == [_lease([fifth]).lease_id]


def test_a_peer_is_never_held_for_its_own_update_in_flight() -> None:
    state = _state(grace=5.0)
    first = _lease(handle(state, RequestWork("a"), 0.0)[1])  # expected at 10.0
    # at 9.0 the peer's own lease is due within the grace period: with keep it is not waited for
    second = _lease(handle(state, RequestWork("a", keep=first.lease_id), 9.0)[1])
    assert second.issued_at == 9.0 and first.lease_id in state.leases
    # another peer is held for it, as before
    (hold,) = handle(state, RequestWork("b"), 9.0)[1]
    assert isinstance(hold, Hold) and hold.waiting_for == (first.lease_id,)


def test_keep_names_only_the_peers_own_lease() -> None:
    state = _state(grace=5.0)
    theirs = _lease(handle(state, RequestWork("b"), 0.0)[1])  # b's, expected at 10.0
    mine = _lease(handle(state, RequestWork("a"), 0.0)[1])  # b's lease is due at 10.0, beyond 0 + 5
    # naming another peer's lease keeps nothing: a's own lease is given back, and a is held for b's lease as anyone
    expired, hold = handle(state, RequestWork("a", keep=theirs.lease_id), 9.0)[1]
    assert isinstance(expired, Expired) and expired.lease_id == mine.lease_id
    assert isinstance(hold, Hold) and hold.waiting_for == (theirs.lease_id,)


def test_the_wire_carries_keep() -> None:
    request = AssignRequest("lease", tokens_per_s=1.0, keep="L1234")
    assert AssignRequest.from_wire(request.to_wire()).keep == "L1234"
    assert AssignRequest.from_wire(AssignRequest("lease").to_wire()).keep is None


# ---------------------------------------------------------------------------------------------- the runtime


def config(verify: Optional[dict[str, Any]] = None, **runtime: Any) -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 1},
        "sim": {"workers": 1},
        "runtime": {
            "snapshot_every": 3, "wal_archive": True, "eval_every": 100000, "lease_slack": 30.0,
            "speed_report_period": 600.0, "gate": {"enabled": False},
            "verify": {"enabled": True, "inner_state": "carry", "fraction": 1.0, "probation_updates": 0,
                       "horizon": 100000, "queue": 256, **(verify or {})},
            **runtime,
        },
    })


class Gates:
    """Orders a peer's overlap deterministically: the upload of its k-th lease (in the order they were granted) waits
    until lease k+1 trains (``trains[k+1]``; not for the last submission, nor once the peer stops: ``no_more``), and
    the training of lease k+1 waits (in its thread) until ``release[k+1]`` — set once lease k's ack (and its reveal,
    when asked) is in, so that they happen while lease k+1 trains."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.trains: dict[int, asyncio.Event] = {}
        self.no_more = asyncio.Event()
        self.release = {k: threading.Event() for k in range(1, 2 * rounds + 2)}
        self.release[1].set()
        self.order: list[str] = []  # what happened, in order

    async def until_trains(self, k: int) -> None:
        waits = {asyncio.ensure_future(self.trains_event(k).wait()), asyncio.ensure_future(self.no_more.wait())}
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()

    def trains_event(self, k: int) -> asyncio.Event:
        return self.trains.setdefault(k, asyncio.Event())

    def gate_trainer(self, trainer: InnerTrainer, on_start: Any = None) -> None:
        run, count = trainer.run, [0]

        def gated(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            k = count[0]
            assert self.loop is not None
            self.order.append(f"train {k} starts")
            self.loop.call_soon_threadsafe(self.trains_event(k).set)
            if on_start is not None:
                on_start(k)
            assert self.release[k].wait(timeout=30.0), f"lease {k}'s training was never released"
            result = run(*args, **kwargs)
            self.order.append(f"train {k} ends")
            return result

        trainer.run = gated  # type: ignore[method-assign]


class GatedClient(MemoryClient):
    """The upload of lease k is sent once lease k+1 trains; its ack (and reveal) release that training. ``refuse``: the
    k-th submission goes out with a wrong base version, which the coordinator refuses (INVALID_UPDATE)."""

    def __init__(self, *args: Any, gates: Gates, refuse: int = 0, stall: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gates = gates
        self.refuse = refuse
        self.stall = stall  # the stall-th submission never gets through (a link that hangs)
        self.granted: list[str] = []  # leases granted, in order (the k-th is the k-th trained)
        self.leases: list[str] = []  # leases submitted, in order
        self.acks: list[tuple[str, Ack]] = []
        self.keeps: list[Optional[str]] = []
        self.reveals: list[str] = []
        self.revealed_bytes: list[int] = []
        self.eager: list[str] = []  # the eager_of each submission named (schedule.eager_start), in order

    async def assign(self, *args: Any, keep: Optional[str] = None, **kwargs: Any) -> Any:
        self.keeps.append(keep)
        reply = await super().assign(*args, keep=keep, **kwargs)
        if reply.lease is not None:
            self.granted.append(reply.lease.lease_id)
        return reply

    async def submit(self, lease_id: str, base_version: int, pseudo_gradient: Any, **kwargs: Any) -> Ack:
        if lease_id not in self.leases:
            self.leases.append(lease_id)
            if kwargs.get("eager_of") is not None:
                self.eager.append(kwargs["eager_of"])
        k = self.granted.index(lease_id) + 1
        if len(self.leases) < self.gates.rounds:
            await self.gates.until_trains(k + 1)
        self.gates.order.append(f"submit {k}")
        if len(self.leases) == self.stall:
            await asyncio.Event().wait()
        refused = len(self.leases) == self.refuse
        ack = await super().submit(lease_id, base_version + (1000 if refused else 0), pseudo_gradient, **kwargs)
        self.acks.append((lease_id, ack))
        if not ack.reveal:
            self.gates.release[k + 1].set()
        if refused:  # lease k+1 will not be submitted: lease k+2 trains with nothing in flight
            self.gates.release[k + 2].set()
        return ack

    async def reveal(self, lease_id: str, state: bytes, **kwargs: Any) -> Any:
        k = self.granted.index(lease_id) + 1
        try:
            reply = await super().reveal(lease_id, state, **kwargs)
            self.reveals.append(lease_id)
            self.revealed_bytes.append(sum(len(part) for part in state) if isinstance(state, list) else len(state))
            self.gates.order.append(f"reveal {k}")
            return reply
        finally:
            self.gates.release[k + 1].set()


class GatedPeer:
    def __init__(self, transport: MemoryTransport, name: str, rounds: int, gates: Gates, *, refuse: int = 0,
                 stall: int = 0, on_start: Any = None, crash_hook: Any = None) -> None:
        cfg = transport.cfg
        options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                              progress=False, max_rounds=rounds)
        self.runner = PeerRunner(options, clock=transport.clock, crash_hook=crash_hook)
        self.runner.summary.peer_id = name
        self.runner.speed = SPEED
        self.counters = TrafficCounters()
        self.client = GatedClient(transport, name, gates=gates, refuse=refuse, stall=stall, counters=self.counters,
                                  download_codec=cfg.runtime.download_codec)
        self.trainer = InnerTrainer.from_config(cfg, transport.workload)
        gates.loop = asyncio.get_running_loop()
        gates.gate_trainer(self.trainer, on_start)
        self.task = as_actor(name, self.runner.serve(
            self.client, transport.publisher(name, signer=f"key-{name}"), cfg, transport.workload, self.trainer,
            cfg.runtime.codec, self.counters,
        ))


def journal(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = run_dir / JOURNAL_FILE
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in records if r["type"] == kind]


async def _finish(transport: MemoryTransport) -> None:
    daemon = transport.daemon
    if daemon is not None and daemon.verification is not None:
        await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)


async def _close(transport: MemoryTransport) -> None:
    if transport.daemon is not None and transport.daemon.verification is not None:
        await transport.daemon.verification.close()
    await transport.close()


async def _one_gated_peer(cfg: RunConfig, run_dir: Path, gates: Gates, verifier_class: str = ""
                          ) -> tuple[GatedPeer, torch.Tensor, dict[str, Any]]:
    """One gated peer through ``gates.rounds`` rounds against a fresh coordinator, every check decided: the peer, θ at
    the end, and verification's status. ``verifier_class``: the compute class the coordinator's re-runs name (the peer's
    own when empty; another makes the peer one of another class, which reveals its end states)."""
    clock = FakeClock()
    transport = MemoryTransport(cfg, run_dir, clock=clock)
    await transport.start()
    if verifier_class:
        assert transport.daemon is not None and transport.daemon.verification is not None
        transport.daemon.verification.verifier.rerunner.compute_class = verifier_class
    try:
        peer = GatedPeer(transport, "a", gates.rounds, gates)
        await drive(clock, {"a": peer.task}, real_timeout=60.0)
        peer.task.result()
        await _finish(transport)
        daemon = transport.daemon
        assert daemon is not None and daemon.verification is not None
        return peer, daemon.node.state.params.clone(), daemon.verification.status()
    finally:
        await _close(transport)


def _every_lease_applied_once_or_given_back(run_dir: Path) -> tuple[list[str], list[str]]:
    """(applied lease ids, given-back lease ids) from the journal; each assigned lease is exactly one of them."""
    assigned = [a["lease_id"] for a in journal(run_dir, "assign")]
    applied = [a["lease_id"] for a in journal(run_dir, "applied")]
    back = [e["lease_id"] for e in journal(run_dir, "expired")]
    assert len(applied) == len(set(applied)), "an update applied twice"
    assert sorted(applied + back) == sorted(assigned), (assigned, applied, back)
    versions = [a["version"] for a in journal(run_dir, "applied")]
    assert versions == list(range(1, len(applied) + 1))
    return applied, back


def _verdicts_ok(run_dir: Path) -> list[dict[str, Any]]:
    verdicts = journal(run_dir, "verdict")
    assert verdicts and all(v["ok"] for v in verdicts), verdicts
    return verdicts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("feedback", [False, True], ids=["int8", "sgn15of16-feedback"])
def test_reveals_go_out_while_the_next_lease_trains_and_every_check_passes(tmp_path: Path, feedback: bool) -> None:
    upload = {"codec": "sgn15of16", "error_feedback": True, "error_feedback_decay": 0.5} if feedback else {"codec": "int8"}
    # no end state kept (coordinator/chained.py): every check but the first (a fresh start) asks its peer for a reveal
    cfg, gates, rounds = config(verify={"keep_states_mb": 0}, **upload), Gates(4), 4
    peer, _, _ = asyncio.run(asyncio.wait_for(_one_gated_peer(cfg, tmp_path / "run", gates), timeout=100.0))
    summary, run_dir = peer.runner.summary, tmp_path / "run"
    applied, back = _every_lease_applied_once_or_given_back(run_dir)
    assert len(applied) == rounds and back == [] and summary.accepted == rounds and summary.discarded == 0
    # each lease after the first was asked for with the previous one still uploading, and trained while it uploaded
    # (in lease order: a held update is applied at its verdict, so the applied order may differ)
    assigned = [a["lease_id"] for a in journal(run_dir, "assign")]
    assert sorted(assigned) == sorted(applied)
    assert peer.client.keeps[0] is None and peer.client.keeps[1:] == assigned[:-1]
    order = gates.order
    for k in range(1, rounds):
        assert order.index(f"train {k + 1} starts") < order.index(f"submit {k}") < order.index(f"train {k + 1} ends"), order
        if k > 1:
            assert order.index(f"submit {k}") < order.index(f"reveal {k}") < order.index(f"train {k + 1} ends"), order
    # every lease was checked, each from the state its predecessor left (revealed while the next one trained); the
    # first started fresh: nothing to reveal
    assert f"reveal 1" not in order and peer.client.reveals == assigned[1:]
    verdicts = _verdicts_ok(run_dir)
    assert sorted(v["lease_id"] for v in verdicts) == sorted(applied)
    assert all(v["detail"] == "bitwise equal to the re-run" for v in verdicts)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("feedback", [False, True], ids=["int8", "sgn15of16-feedback"])
def test_a_checked_lease_after_a_checked_lease_is_re_run_from_the_end_state_the_coordinator_kept(
        tmp_path: Path, feedback: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lease checked, the default ``keep_states_mb``: the first starts fresh, each later one from the end state its
    predecessor's re-run left (coordinator/chained.py) — the peer is asked for no reveal and every check is bitwise: the
    re-run from the kept state gave the peer's update bit for bit, as in the same run with every start state revealed.
    (θ itself may differ between the two: a held update is applied at its verdict, whose timing is the worker's.)"""
    upload = {"codec": "sgn15of16", "error_feedback": True, "error_feedback_decay": 0.5} if feedback else {"codec": "int8"}
    rounds, on = 4, "memory" if feedback else "disk"  # both stores (coordinator/chained.py StateStore), one each
    joined_in_a_thread: list[str] = []
    if not feedback:  # a kept start joined in a worker thread, as a 60m/150m state is (coordinator/verify.py)
        from asyncloco.coordinator.verify import DaemonVerification

        offer_joined = DaemonVerification._offer_joined

        async def spy(self: DaemonVerification, check: Any, *args: Any) -> None:
            joined_in_a_thread.append(check.lease.lease_id)
            await offer_joined(self, check, *args)

        monkeypatch.setattr("asyncloco.coordinator.verify._INLINE_JOIN", 0)
        monkeypatch.setattr(DaemonVerification, "_offer_joined", spy)

    def run(keep_mb: int, run_dir: Path) -> tuple[GatedPeer, torch.Tensor, dict[str, Any]]:
        cfg = config(verify={"keep_states_mb": keep_mb, "keep_states_on": on}, **upload)
        return asyncio.run(asyncio.wait_for(_one_gated_peer(cfg, run_dir, Gates(rounds)), timeout=80.0))

    peer, _, status = run(2048, tmp_path / "kept")
    assert status["chained"]["on"] == on and status["chained"]["bytes"] > 0
    assert [p.name for p in (tmp_path / "kept").rglob("kept-states")] == (["kept-states"] if on == "disk" else [])
    assert list((tmp_path / "kept").rglob("*.state")) == []  # the files of the states kept went with the coordinator
    _, _, revealed = run(0, tmp_path / "revealed")
    applied, back = _every_lease_applied_once_or_given_back(tmp_path / "kept")
    assert len(applied) == rounds and back == [] and peer.runner.summary.accepted == rounds
    assert peer.client.reveals == [] and not any(ack.reveal for _, ack in peer.client.acks)
    assert status["reveals"]["asked"] == 0 and status["reveals"]["refused"] == 0
    chained = status["chained"]
    assert chained["fresh"] == 1 and chained["kept"] + chained["waited"] == rounds - 1 and chained["moot"] == 0
    assert chained["states"] == 1 and chained["waiting"] == 0
    assert len(joined_in_a_thread) == (0 if feedback else rounds - 1)  # every kept start, when joined off the loop
    verdicts = _verdicts_ok(tmp_path / "kept")
    assert sorted(v["lease_id"] for v in verdicts) == sorted(applied)
    assert all(v["detail"] == "bitwise equal to the re-run" for v in verdicts)
    # the same run asking for every start state: its peer revealed all but the fresh first one
    assert revealed["reveals"]["asked"] == revealed["reveals"]["received"] == rounds - 1
    assert revealed["chained"]["fresh"] == 1 and revealed["checked"] == revealed["passed"] == rounds


@pytest.mark.timeout(180)
def test_a_peer_of_another_class_reveals_the_end_alone_when_the_coordinator_has_its_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lease checked, the peer of another compute class than the verifier's (its end states are compared within
    the state tolerance, so it reveals them): the first lease reveals its empty fresh start and its end; each later one
    its end alone (the Ack's ``reveal_start: false``) — the coordinator puts the end the previous check kept in front of
    it (coordinator/chained.py) — and every check passes. Without kept states each reveals both."""
    upload, rounds = {"codec": "sgn15of16", "error_feedback": True, "error_feedback_decay": 0.5}, 4
    monkeypatch.setattr("asyncloco.coordinator.verify._INLINE_JOIN", 0)  # kept start + revealed end joined in a thread

    def run(keep_mb: int, run_dir: Path) -> tuple[GatedPeer, torch.Tensor, dict[str, Any]]:
        cfg = config(verify={"keep_states_mb": keep_mb}, **upload)
        return asyncio.run(asyncio.wait_for(_one_gated_peer(cfg, run_dir, Gates(rounds), "another-class"), timeout=80.0))

    peer, _, status = run(2048, tmp_path / "kept")
    full, _, revealed = run(0, tmp_path / "revealed")
    applied, back = _every_lease_applied_once_or_given_back(tmp_path / "kept")
    assert len(applied) == rounds and back == [] and peer.runner.summary.accepted == rounds
    acks = dict(peer.client.acks)
    assigned = [a["lease_id"] for a in journal(tmp_path / "kept", "assign")]
    assert [acks[lid].reveal for lid in assigned] == [True] * rounds and [acks[lid].reveal_end for lid in assigned] == [None] * rounds
    assert [acks[lid].reveal_start for lid in assigned] == [None] + [False] * (rounds - 1)
    assert peer.client.reveals == assigned and status["reveals"]["asked"] == status["reveals"]["received"] == rounds
    chained = status["chained"]
    assert chained["fresh"] == 0 and chained["kept"] + chained["waited"] == rounds - 1 and chained["waiting"] == 0
    verdicts = _verdicts_ok(tmp_path / "kept")
    assert sorted(v["lease_id"] for v in verdicts) == sorted(applied)
    assert all(v["detail"].startswith("bitwise equal to the re-run (peer's compute class") for v in verdicts), verdicts
    # what the end-only reveals saved: the start part of each, a whole state (its 8-byte length field stays)
    assert [ack.reveal_start for _, ack in full.client.acks] == [None] * rounds
    assert revealed["chained"]["kept"] == revealed["chained"]["waited"] == 0
    sizes, full_sizes = peer.client.revealed_bytes, full.client.revealed_bytes
    assert sizes[0] == full_sizes[0] and full_sizes[0] < full_sizes[1]  # the fresh start is empty in both
    state = full_sizes[1] - full_sizes[0]  # a carried start (inner state and residual) in a reveal part's layout
    assert sizes[1:] == [size - state for size in full_sizes[1:]]


@pytest.mark.timeout(120)
def test_a_refused_update_while_the_next_lease_trains_loses_nothing_and_breaks_no_chain(tmp_path: Path) -> None:
    cfg, clock, gates, rounds = config(codec="int8"), FakeClock(), Gates(5), 5

    async def scenario() -> GatedPeer:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            peer = GatedPeer(transport, "a", rounds, gates, refuse=2)  # lease 2's submission is refused
            await drive(clock, {"a": peer.task}, real_timeout=60.0)
            peer.task.result()
            await _finish(transport)
            return peer
        finally:
            await _close(transport)

    peer = asyncio.run(asyncio.wait_for(scenario(), timeout=100.0))
    summary, run_dir = peer.runner.summary, tmp_path / "run"
    refused = peer.client.leases[1]
    acks = dict(peer.client.acks)
    assert not acks[refused].accepted and "base_version" in acks[refused].reason
    # lease 3 trained from lease 2's end state: not submitted; given back when the peer next asked
    applied, back = _every_lease_applied_once_or_given_back(run_dir)
    assert summary.discarded == 1 and len(back) == 2 and refused not in applied
    discarded = next(lid for lid in back if lid != refused)
    assert discarded not in peer.client.leases  # never sent
    assert summary.rejected == 1 and summary.accepted == len(applied) == rounds - 1
    # the chain went on from a fresh state: no broken chain, nobody expelled, every check bitwise
    assert not journal(run_dir, "expelled") and not [r for r in journal(run_dir, "rejected") if "chain" in r.get("reason", "")]
    _verdicts_ok(run_dir)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "every-lease-checked"])
def test_a_coordinator_restart_while_an_upload_is_in_flight_applies_it_once(tmp_path: Path, checked: bool) -> None:
    """Lease 2 is applied (or held for its check) and the coordinator dies before answering, while lease 3 trains: the
    resend is answered as a duplicate — asking for the reveal the restarted coordinator still awaits — and applied once."""
    # θ downloaded in int8 (the default), as deltas from an anchor: a check of a lease whose θ was a delta re-runs after
    # the restart from the anchor the download service kept on disk (download-anchors/) and passes like any other
    cfg, clock, gates, rounds = config(codec="int8", verify={
        "enabled": True, "inner_state": "carry", "fraction": 1.0 if checked else 0.0, "probation_updates": 0,
        "horizon": 100000, "queue": 256, "keep_states_mb": 0}), FakeClock(), Gates(4), 4
    reloaded: list[tuple[str, int]] = []  # the anchors the restarted coordinator took back from disk

    async def scenario() -> GatedPeer:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            transport.kill.arm("before_reply", nth=2, rpc="submit")  # lease 2 applied, the ack never sent
            peer = GatedPeer(transport, "a", rounds, gates)
            if checked:
                # lease 2's upload goes out once lease 1's check has its verdict (as it has when its re-run is quick): a
                # verdict still on its way at the crash would be decided by the crashed in-memory daemon's verifier —
                # in its log, lost from its journal if that closes meanwhile, which this test reads
                submit = peer.client.submit

                async def submit_after_the_first_verdict(lease_id: str, *args: Any, **kwargs: Any) -> Any:
                    while lease_id in peer.client.granted[1:2] and transport.daemon is not None \
                            and transport.daemon.node.state.version < 1:
                        await asyncio.sleep(0.01)
                    return await submit(lease_id, *args, **kwargs)

                peer.client.submit = submit_after_the_first_verdict  # type: ignore[method-assign]
            await drive(clock, {"a": peer.task}, until=lambda: transport.down or peer.task.done(), real_timeout=60.0)
            assert transport.down and not peer.task.done()
            daemon = await transport.restart()  # --resume while lease 3 trains and lease 2's upload is being resent
            reloaded.extend(daemon.serving.service.downloads.anchors())
            await drive(clock, {"a": peer.task}, real_timeout=60.0)
            peer.task.result()
            await _finish(transport)
            return peer
        finally:
            await _close(transport)

    peer = asyncio.run(asyncio.wait_for(scenario(), timeout=100.0))
    summary, run_dir = peer.runner.summary, tmp_path / "run"
    applied, back = _every_lease_applied_once_or_given_back(run_dir)
    assert back == [] and len(applied) == rounds == summary.accepted
    assert summary.duplicates == 1 and summary.resends >= 1 and summary.discarded == 0
    second = peer.client.leases[1]
    assert [lid for lid, ack in peer.client.acks if ack.duplicate] == [second]
    assert peer.client.keeps.count(second) >= 1  # lease 3 was asked for (and trained) with lease 2 in flight
    assert not journal(run_dir, "expelled")  # the commitment chain held across the restart
    # the peer trained from int8 deltas, and the restarted coordinator took back the anchors they were taken from
    assert any(anchor is not None for _, anchor, _ in peer.client.decoded.values())
    assert reloaded
    if checked:  # lease 2's check awaited its reveal at the restart: it ends unverified; every other one passes —
        # a delta's among them (no "download anchor … no longer held": with the anchors lost, one was dropped)
        unverified = journal(run_dir, "unverified")
        assert [u["lease_id"] for u in unverified] == [second] and "restarted" in unverified[0]["reason"]
        others = sorted(lid for lid in applied if lid != second)
        assert sorted(v["lease_id"] for v in _verdicts_ok(run_dir)) == others
        # (no end state kept: each asked its peer for a reveal, but the first, which started fresh)
        assert sorted(peer.client.reveals) == sorted(lid for lid in others if lid != peer.client.leases[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_with_a_lease_in_flight(tmp_path: Path, presses: int) -> None:
    """One Ctrl+C as lease 2 starts training (lease 1 uploading): both are finished and submitted, then the peer leaves.
    Two, with lease 1's upload hanging on the link: the peer leaves at once (lease 2's training stops, lease 1's upload
    is given up); the coordinator gives both back at their deadlines, nothing is applied."""
    cfg, clock, gates, rounds = config(codec="int8"), FakeClock(), Gates(10), 10
    peers: list[GatedPeer] = []

    def on_start(k: int) -> None:
        if k == 2:
            runner = peers[0].runner
            assert gates.loop is not None
            gates.loop.call_soon_threadsafe(runner.stop if presses == 1 else runner.abort)
            gates.loop.call_soon_threadsafe(gates.no_more.set)

    async def scenario() -> None:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            peers.append(GatedPeer(transport, "a", rounds, gates, on_start=on_start, stall=1 if presses == 2 else 0))
            if presses == 2:
                gates.release[2].set()  # lease 2 trains at once, with lease 1's upload hanging
            task = peers[0].task
            await drive(clock, {"a": task}, real_timeout=60.0)
            task.result()
            await _finish(transport)
            if presses == 2:  # the dropped leases go back at their deadlines
                await drive(clock, {}, until=lambda: len(journal(tmp_path / "run", "expired")) == 2, real_timeout=30.0,
                            idle_step=5.0)
        finally:
            await _close(transport)

    asyncio.run(asyncio.wait_for(scenario(), timeout=100.0))
    summary, run_dir = peers[0].runner.summary, tmp_path / "run"
    applied, back = _every_lease_applied_once_or_given_back(run_dir)
    assert len(journal(run_dir, "assign")) == 2  # no third lease asked for
    if presses == 1:
        assert len(applied) == 2 and back == [] and summary.accepted == summary.rounds == 2
        _verdicts_ok(run_dir)
    else:
        assert applied == [] and len(back) == 2 and summary.accepted == 0 and summary.rounds == 1  # sent, not acked
        assert all("deadline" in e["reason"] for e in journal(run_dir, "expired"))
        assert not journal(run_dir, "expelled")


def test_peer_join_no_overlap_reaches_the_peer_options() -> None:
    """``asyncloco peer join --no-overlap``: serial rounds for this peer whatever the run's ``runtime.overlap``; without
    it the run decides (``PeerOptions.overlap`` None)."""
    from asyncloco.cli import build_parser
    from asyncloco.runtime_cli import peer_options

    join = ["peer", "join", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmcoordinatorXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX"]
    assert peer_options(build_parser().parse_args(join)).overlap is None
    assert peer_options(build_parser().parse_args([*join, "--no-overlap"])).overlap is False


# ------------------------------------------------------------------------------------- asking ahead (slow download link)


def test_ask_ahead_lead_follows_the_measured_download() -> None:
    from asyncloco.peer.pipeline import AHEAD_MARGIN, ask_ahead_s

    assert ask_ahead_s(None) is None  # nothing measured yet: ask after training
    assert ask_ahead_s(0.2) is None  # a fast link: 0.3 s of lead is not worth a longer staleness window
    assert ask_ahead_s(10.0) == AHEAD_MARGIN * 10.0
    assert ask_ahead_s(float("nan")) is None and ask_ahead_s(-1.0) is None
    # once it has asked ahead, the last ask + download it observed counts when it took longer than the rate says
    assert ask_ahead_s(6.0, 9.0) == AHEAD_MARGIN * 9.0 and ask_ahead_s(6.0, 2.0) == AHEAD_MARGIN * 6.0
    assert ask_ahead_s(None, 9.0) is None and ask_ahead_s(6.0, float("inf")) == AHEAD_MARGIN * 6.0


def test_the_ask_ahead_times_a_lease_by_its_own_steps() -> None:
    """When to ask ahead: a lease on shared cores may run faster than the peer's average speed says (asked by the
    average, its θ came after it ended); once AHEAD_RATE_STEPS of its steps are timed, their rate (the first step
    apart: it warms up) and the emulated slowdown's pause say when it ends."""
    from types import SimpleNamespace

    from asyncloco.peer.pipeline import AHEAD_RATE_STEPS, OverlappedRounds

    rounds = OverlappedRounds.__new__(OverlappedRounds)  # only the runner and the workload are read
    runner = SimpleNamespace(speed=100.0, options=SimpleNamespace(slowdown=2.0), lease_step_seconds=("", []))
    rounds.runner, rounds.workload = runner, SimpleNamespace(units_per_step=50)
    lease: Any = SimpleNamespace(lease_id="L", steps=20)
    by_speed = 20 * 50 / 100.0
    runner.lease_step_seconds = ("previous", [0.25] * 20)  # another lease's steps do not count
    assert rounds._training_s(lease) == by_speed
    runner.lease_step_seconds = ("L", [3.0] + [0.25] * (AHEAD_RATE_STEPS - 2))  # too few timed yet
    assert rounds._training_s(lease) == by_speed
    runner.lease_step_seconds = ("L", [3.0] + [0.25] * (AHEAD_RATE_STEPS - 1))
    assert rounds._training_s(lease) == (3.0 + 19 * 0.25) * 2.0  # first step + 19 at the timed rate, × slowdown
    runner.lease_step_seconds = ("L", [3.0] + [0.25] * 19)  # all done (the slowdown's pause runs): the same
    assert rounds._training_s(lease) == (3.0 + 19 * 0.25) * 2.0


class SlowDownloadClient(MemoryClient):
    """A client whose link says a θ download takes 20 s (measured), so the runner asks ahead; it records the order of
    its grants and downloads. Training lease k (k < rounds) waits in its thread until lease k+1's θ is here."""

    def __init__(self, *args: Any, gates: Gates, **kwargs: Any) -> None:
        from asyncloco.transport.linkspeed import LinkSpeed

        super().__init__(*args, **kwargs)
        self.link = LinkSpeed()
        self.link.measured["down"] = 1.0  # bytes/s: any θ takes far more than the 1 s that makes asking ahead worth it
        self.gates = gates
        self.granted: list[str] = []
        self.keeps: list[Optional[str]] = []
        self.eager: list[Optional[str]] = []  # each submission's eager_of, in order

    async def submit(self, lease_id: str, base_version: int, pseudo_gradient: Any, **kwargs: Any) -> Any:
        self.eager.append(kwargs.get("eager_of"))
        return await super().submit(lease_id, base_version, pseudo_gradient, **kwargs)

    async def assign(self, *args: Any, keep: Optional[str] = None, **kwargs: Any) -> Any:
        reply = await super().assign(*args, keep=keep, **kwargs)
        if reply.lease is not None:
            self.keeps.append(keep)
            self.granted.append(reply.lease.lease_id)
            self.gates.order.append(f"granted {len(self.granted)}")
        return reply

    async def get_model(self, version: Optional[int] = None, **kwargs: Any) -> Any:
        result = await super().get_model(version, **kwargs)
        k = len(self.granted)
        self.gates.order.append(f"theta {k}")
        if k > 1:
            self.gates.release[k - 1].set()  # lease k-1's training may end: lease k's θ is here
        return result


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eager", [0.0, 0.7], ids=["plain", "eager-start"])
def test_a_slow_download_link_asks_for_the_next_lease_while_one_trains(tmp_path: Path, eager: float) -> None:
    """Asking ahead (peer/pipeline.py): the next lease is asked for (naming the one in training as ``keep``) and its
    θ downloaded while the current one trains; every lease applied once, every check passes (the commitment chain
    runs through leases asked for ahead), the exposed download wait is only the first lease's. With the eager start
    (schedule.eager_start) each lease asked for ahead starts from θ minus the update of the one that was training,
    sent by the time it trains: every check bitwise all the same."""
    cfg, clock, rounds = config(), FakeClock(), 4
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"eager_start": eager})})
    gates = Gates(rounds)
    for k in gates.release:
        gates.release[k].clear()

    async def scenario() -> tuple[PeerRunner, SlowDownloadClient]:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                                  progress=False, max_rounds=rounds)
            runner = PeerRunner(options, clock=transport.clock)
            runner.summary.peer_id, runner.speed = "a", SPEED
            counters = TrafficCounters()
            client = SlowDownloadClient(transport, "a", gates=gates, counters=counters,
                                        download_codec=cfg.runtime.download_codec)
            trainer = InnerTrainer.from_config(cfg, transport.workload)
            gates.loop = asyncio.get_running_loop()
            gates.release[rounds].set()  # training k waits for lease k+1's θ (k < rounds); the last one at once
            gates.gate_trainer(trainer)
            task = as_actor("a", runner.serve(client, transport.publisher("a", signer="key-a"), cfg, transport.workload,
                                              trainer, cfg.runtime.codec, counters))
            await drive(clock, {"a": task}, real_timeout=60.0)
            task.result()
            await _finish(transport)
            return runner, client
        finally:
            await _close(transport)

    runner, client = asyncio.run(asyncio.wait_for(scenario(), timeout=100.0))
    run_dir, order = tmp_path / "run", gates.order
    applied, back = _every_lease_applied_once_or_given_back(run_dir)
    assert len(applied) == rounds and back == [] and runner.summary.accepted == rounds
    for k in range(1, rounds):  # lease k+1 was granted, and its θ downloaded, while lease k trained
        assert order.index(f"train {k} starts") < order.index(f"granted {k + 1}") < order.index(f"theta {k + 1}") \
            < order.index(f"train {k} ends"), order
    assert client.keeps == [None] + client.granted[:-1]  # each request kept exactly the lease in training
    timing = runner.summary.timing
    assert timing["download_ahead"] >= 0.0 and timing["assign_ahead"] >= 0.0
    verdicts = _verdicts_ok(run_dir)
    assert sorted(v["lease_id"] for v in verdicts) == sorted(applied)
    eagerly = [r["lease_id"] for r in journal(run_dir, "assign") if "eager start" in r["reason"]]
    assert eagerly == (client.granted[1:] if eager else [])
    assert client.eager == ([None] + client.granted[:-1] if eager else [None] * rounds)  # and the peer took each
    assert all(v["detail"] == "bitwise equal to the re-run" for v in verdicts), verdicts
