"""The coordinator daemon and the peer runner in one event loop, over the in-memory transport with fault
injection and a fake clock (asyncloco/testing/memory.py, asyncloco/clock.py).

The real :class:`~asyncloco.coordinator.daemon.CoordinatorDaemon` (write-ahead log, snapshots, journal) and
the real :meth:`~asyncloco.peer.runner.PeerRunner.serve` loop (lease, download, train, submit, resend) run
unchanged; only the network and the clock are replaced. Time moves only when every peer waits on the
clock (:func:`~asyncloco.testing.memory.drive`), so deadlines, holds and backoffs are exact and these
tests take seconds. What each pins:

* a lost ack: the peer resends the same bytes, the coordinator answers a duplicate, the update is applied
  once; a submission reset mid-transfer is resent and applied once (no duplicate: it never arrived);
* a submission delayed past its lease's deadline is refused; the lease's steps were given back at the
  first tick after the deadline;
* fail-stop: a peer that dies after training, before its submit, has its lease given back at the first tick
  past the lease's deadline, and the same batch range goes to the next peer that asks;
* a silent peer without a lease is declared gone after ``3 × speed_report_period``;
* holds: a request inside the grace period waits (held) until the update expected in the window arrives —
  then it starts from the new θ — or until the window closes;
* a coordinator crash at each named point ("wal_appended", "wal_synced", "before_reply" of a submission,
  "wal_synced" of a lease request), then ``--resume`` (snapshot + log replay): the peers carry on; every
  acknowledged update is applied exactly once at the version its ack named; versions 1..V each come from one
  lease; the final state equals a replay of the whole log from the initial snapshot.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.checkpoint import load_snapshot
from asyncloco.coordinator.daemon import JOURNAL_FILE
from asyncloco.train.inner import InnerTrainer
from asyncloco.peer.runner import PeerOptions, PeerRunner
from asyncloco.peer.summary import PeerSummary
from asyncloco.peer.upload import submit_with_retry
from asyncloco.refusals import RefusalCode
from asyncloco.transport.codecs import wire_bytes
from asyncloco.transport.codec_format import EncodedTensor
from asyncloco.transport.errors import PeerUnreachable, RemoteError
from asyncloco.testing.memory import KillSwitch, Killed, MemoryClient, MemoryTransport, as_actor, drive
from asyncloco.transport.rpc import TrafficCounters
from asyncloco.transport.rpc_client import CoordinatorClient
from asyncloco.transport.wire import Ack

ROOT = Path(__file__).resolve().parents[1]
SPEED = 1000.0  # every peer's units/s (the toy task's units are samples)


def config(**overrides: Any) -> RunConfig:
    """The toy task: a round trains in milliseconds. Speed reports every 10 minutes (fake), so that a peer's
    report loop never counts as waiting on the clock while it trains (see testing.memory.drive)."""
    raw: dict[str, Any] = {
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 2},
        "sim": {"workers": 2},
        "runtime": {
            "snapshot_every": 3, "wal_archive": True, "eval_every": 100000, "lease_slack": 30.0,
            "speed_report_period": 600.0, "gate": {"enabled": False},
            "verify": {"enabled": False},  # some tests submit raw updates; verified runs: tests/test_verify_runtime.py
        },
    }
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    return RunConfig.model_validate(raw)


def journal(transport: MemoryTransport, kind: Optional[str] = None) -> list[dict[str, Any]]:
    path = transport.dir / JOURNAL_FILE
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [e for e in events if kind is None or e["type"] == kind]


class RecordingClient(MemoryClient):
    """A peer's link that remembers every ack it received, (lease id, ack)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acks: list[tuple[str, Ack]] = []

    async def submit(self, lease_id: str, base_version: int, pseudo_gradient: Any, **kwargs: Any) -> Ack:
        ack = await super().submit(lease_id, base_version, pseudo_gradient, **kwargs)
        self.acks.append((lease_id, ack))
        return ack


class Peer:
    """A PeerRunner serving over the in-memory transport, as actor ``name`` of the fake clock."""

    def __init__(self, transport: MemoryTransport, name: str, rounds: int, crash_hook: Any = None,
                 connect_timeout: float = 30.0) -> None:
        cfg = transport.cfg
        options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                              progress=False, max_rounds=rounds, connect_timeout=connect_timeout)
        self.runner = PeerRunner(options, clock=transport.clock, crash_hook=crash_hook)
        self.runner.summary.peer_id = name
        self.runner.speed = SPEED  # no start-up measurement: every peer is equally fast
        self.counters = TrafficCounters()
        self.client = RecordingClient(transport, name, counters=self.counters, download_codec=cfg.runtime.download_codec)
        trainer = InnerTrainer.from_config(cfg, transport.workload)
        self.task = as_actor(name, self.runner.serve(
            self.client, transport.publisher(name, signer=f"key-{name}"), cfg, transport.workload, trainer,
            cfg.runtime.codec, self.counters,
        ))


async def started(tmp_path: Path, cfg: RunConfig, clock: FakeClock) -> MemoryTransport:
    transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
    await transport.start()
    return transport


async def leased(transport: MemoryTransport, name: str) -> tuple[MemoryClient, Any, torch.Tensor]:
    """Peer ``name``'s client, its first lease and the θ it starts from (version 0)."""
    client = transport.client(name)
    reply = await client.assign(SPEED)
    assert reply.lease is not None
    version, theta = await client.get_model(reply.lease.base_version)
    assert version == 0
    return client, reply.lease, theta


def run(scenario: Any) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, timeout=90.0))


# ------------------------------------------------------------------------------------- resend / faults


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["drop_reply", "reset"])
def test_a_lost_ack_or_a_reset_upload_is_resent_and_applied_once(tmp_path: Path, fault: str) -> None:
    cfg = config()
    clock = FakeClock()

    async def scenario() -> tuple[Peer, MemoryTransport, dict[str, Any]]:
        transport = await started(tmp_path, cfg, clock)
        try:
            transport.add_fault("submit", fault, peer="a")  # the first submission of peer a
            peer = Peer(transport, "a", rounds=3)
            await drive(clock, {"a": peer.task}, real_timeout=60.0)
            peer.task.result()
            assert transport.daemon is not None
            state = transport.daemon.node.state.state_dict()
            served[:] = [transport.daemon.counters.submit.calls, transport.daemon.counters.submit.payload_bytes_received]
            return peer, transport, state
        finally:
            await transport.close()

    served: list[int] = []
    peer, transport, state = run(scenario())
    summary = peer.runner.summary
    # the peer's real client called the coordinator's real service: each of its 4 submit calls reached the service,
    # and the service read a whole body for each except a reset one
    assert isinstance(peer.client, CoordinatorClient) and peer.counters.submit.calls == served[0] == 4
    assert served[1] == (4 if fault == "drop_reply" else 3) * wire_bytes(cfg.runtime.codec, int(state["params"].numel()))
    assert summary.rounds == 3 and summary.accepted == 3 and summary.resends == 1 and summary.rejected == 0
    # a lost ack: the resend arrives as a duplicate of an applied update; a reset upload never arrived
    assert summary.duplicates == (1 if fault == "drop_reply" else 0)
    leases = [lease_id for lease_id, _ in peer.client.acks]
    assert len(leases) == 3 and len(set(leases)) == 3
    assert [ack.version for _, ack in peer.client.acks] == [1, 2, 3]
    assert state["version"] == 3 and state["applied"] == {lease: v for lease, v in zip(leases, (1, 2, 3))}
    assert [e["lease_id"] for e in journal(transport, "applied")] == leases
    assert len(journal(transport, "duplicate")) == summary.duplicates
    # a lost ack's body had arrived: its resend is a 4th body; a reset body never got through
    numel = int(state["params"].numel())
    assert peer.counters.submit.payload_bytes_sent == (4 if fault == "drop_reply" else 3) * wire_bytes(cfg.runtime.codec, numel)


@pytest.mark.timeout(120)
def test_a_submission_delayed_past_its_deadline_is_refused_and_its_steps_were_given_back(tmp_path: Path) -> None:
    cfg = config()
    clock = FakeClock()

    async def scenario() -> tuple[Any, Any, float, list[dict[str, Any]]]:
        transport = await started(tmp_path, cfg, clock)
        try:
            client, lease, theta = await leased(transport, "a")
            late = lease.deadline - clock.time() + 2.0
            transport.add_fault("submit", "delay", peer="a", seconds=late)
            submitting = asyncio.ensure_future(client.submit(lease.lease_id, 0, torch.full_like(theta, 1e-3), codec=cfg.runtime.codec))
            await drive(clock, {}, until=submitting.done, real_timeout=30.0, idle_step=0.5)
            # (the delay sleeps on the clock as no actor: idle steps move time until it ends)
            return lease, submitting.result(), clock.time(), journal(transport)
        finally:
            await transport.close()

    lease, ack, now, events = run(scenario())
    assert now >= lease.deadline + 2.0
    assert ack.accepted is False and ack.reason == "unknown or expired lease; its steps were given back"
    expired = [e for e in events if e["type"] == "expired"]
    assert [e["lease_id"] for e in expired] == [lease.lease_id]
    assert expired[0]["steps"] == lease.steps and f"lease deadline {lease.deadline:.1f} passed" in expired[0]["reason"]
    # given back at the first tick after the deadline (ticks every second of the fake clock)
    assert lease.deadline < expired[0]["time"] <= lease.deadline + 1.0 + 1e-6
    assert not [e for e in events if e["type"] == "applied"]


@pytest.mark.timeout(120)
def test_a_payload_refused_at_decode_is_a_typed_answer_sent_once_and_leaves_the_lease_open(tmp_path: Path) -> None:
    # NaN values on the wire are caught at decode, before any event: the error carries INVALID_UPDATE, so the
    # peer's resend loop (peer/upload.py) takes it as the answer it is (the same bytes would get the same one) instead
    # of resending until the deadline — a resend of a refused body once raced the stream's close under load and the
    # refusal's text was lost; nothing is journaled for the lease, which a finite update then completes
    cfg = config()
    clock = FakeClock()

    async def scenario() -> tuple[Any, PeerSummary, Any, Any, list[dict[str, Any]]]:
        transport = await started(tmp_path, cfg, clock)
        try:
            client, lease, theta = await leased(transport, "a")
            poisoned = torch.full_like(theta, 1e-3)
            poisoned[3] = float("nan")
            nan_bytes = EncodedTensor("none", theta.numel(), poisoned.numpy().tobytes())
            summary = PeerSummary()
            refused = await submit_with_retry(client, lease, nan_bytes, inner_loss=None, digests=(None, None),
                                              clock=clock, abort=asyncio.Event(), summary=summary)
            with pytest.raises(RemoteError) as caught:
                await client.submit(lease.lease_id, lease.base_version, nan_bytes)
            ack = await client.submit(lease.lease_id, lease.base_version, torch.full_like(theta, 1e-3), codec="none")
            return refused, summary, caught.value, ack, journal(transport)
        finally:
            await transport.close()

    refused, summary, error, ack, events = run(scenario())
    assert refused is None and summary.resends == 0  # sent once: the typed refusal is the answer
    assert error.code is RefusalCode.INVALID_UPDATE and "1 NaN/Inf values" in error.message
    assert ack.accepted is True and ack.version == 1  # the lease stayed open: nothing was decided on the NaN bytes
    assert [e["type"] for e in events if e["type"] in ("applied", "rejected", "duplicate")] == ["applied"]
    # still the sender's protocol error, journaled (at the transport's bounded rate) for each of the two sends
    assert [e["peer"] for e in events if e["type"] == "protocol_error" and "NaN/Inf" in e["reason"]] == ["a", "a"]


# ------------------------------------------------------------------------------------------- fail-stop


@pytest.mark.timeout(120)
def test_a_peer_dying_after_training_gives_its_lease_back_and_its_range_is_issued_again(tmp_path: Path) -> None:
    # serial rounds: the next draw (Eq. 2) lands on the given-back range; overlapped rounds draw the second lease with
    # the first in flight, and a peer dying with a lease in flight is tests/test_overlap_runtime.py's
    cfg = config(runtime={"overlap": False})
    clock = FakeClock()
    switch = KillSwitch()
    switch.arm("trained", nth=2)  # the peer dies after training its second lease, before submitting it

    async def scenario() -> tuple[Peer, list[dict[str, Any]], dict[str, Any], float]:
        transport = await started(tmp_path, cfg, clock)
        try:
            victim = Peer(transport, "victim", rounds=5, crash_hook=switch)
            await drive(clock, {"victim": victim.task}, real_timeout=60.0)
            with pytest.raises(Killed):
                victim.task.result()
            died_at = clock.time()
            lost = next(e for e in journal(transport, "assign") if e["peer"] == "victim" and e["lease_id"] not in
                        {lid for lid, _ in victim.client.acks})
            await drive(clock, {}, until=lambda: bool(journal(transport, "expired")), real_timeout=30.0, idle_step=1.0)
            reply = await transport.client("next").assign(SPEED)
            assert reply.lease is not None
            again = reply.lease.to_wire()
            return victim, journal(transport), {"lost": lost, "again": again}, died_at
        finally:
            await transport.close()

    victim, events, leases, died_at = run(scenario())
    lost, again = leases["lost"], leases["again"]
    assert switch.fired == ["trained"] and victim.runner.summary.accepted == 1
    expired = [e for e in events if e["type"] == "expired"]
    assert len(expired) == 1 and expired[0]["lease_id"] == lost["lease_id"] and expired[0]["steps"] == lost["steps"]
    assert lost["deadline"] < expired[0]["time"] <= lost["deadline"] + 1.0 + 1e-6 and expired[0]["time"] > died_at
    # the same batch range (shard, offset, steps) goes to the next peer, from the current θ
    assert (again["shard"], again["start_offset"], again["steps"]) == (lost["shard"], lost["start_offset"], lost["steps"])
    assert not [e for e in events if e["type"] == "applied" and e["lease_id"] == lost["lease_id"]]


@pytest.mark.timeout(120)
def test_a_silent_peer_without_a_lease_is_declared_gone_after_three_report_periods(tmp_path: Path) -> None:
    cfg = config(runtime={"speed_report_period": 5.0})
    clock = FakeClock()

    async def scenario() -> tuple[float, list[dict[str, Any]]]:
        transport = await started(tmp_path, cfg, clock)
        try:
            await transport.client("quiet").hello()
            client = transport.client("quiet")
            reply = await client.assign(SPEED, signer="key-quiet")
            assert reply.lease is not None
            _, theta = await client.get_model(reply.lease.base_version)
            ack = await client.submit(reply.lease.lease_id, reply.lease.base_version, torch.full_like(theta, 1e-3), codec=cfg.runtime.codec)
            assert ack.accepted
            last_seen = clock.time()  # its submission: then nothing more
            await drive(clock, {}, until=lambda: bool(journal(transport, "peer_left")), real_timeout=30.0, idle_step=1.0)
            return last_seen, journal(transport, "peer_left")
        finally:
            await transport.close()

    last_seen, left = run(scenario())
    assert [e["peer"] for e in left] == ["quiet"]
    assert "limit 15 s" in left[0]["reason"]
    assert last_seen + 15.0 < left[0]["time"] <= last_seen + 16.0 + 1e-6


# ----------------------------------------------------------------------------------------------- holds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arrives", [True, False], ids=["update-arrives", "window-closes"])
def test_a_request_inside_the_grace_period_is_held_until_the_update_or_the_window_end(tmp_path: Path, arrives: bool) -> None:
    cfg = config(schedule={"grace_period": 30.0})
    clock = FakeClock()

    async def scenario() -> dict[str, Any]:
        transport = await started(tmp_path, cfg, clock)
        try:
            first, second = transport.client("first"), transport.client("second")
            lease = (await first.assign(SPEED)).lease
            assert lease is not None and transport.daemon is not None
            expected_finish = transport.daemon.node.state.leases[lease.lease_id].expected_finish
            asked = clock.time()
            held = asyncio.ensure_future(second.assign(SPEED))
            await drive(clock, {}, until=lambda: bool(journal(transport, "hold")), real_timeout=10.0)
            assert not held.done()
            hold = journal(transport, "hold")[0]
            await clock.advance(min(2.0, (expected_finish - asked) / 2))
            assert not held.done()  # still held: the first peer's update is expected within the grace period
            if arrives:
                _, theta = await first.get_model(lease.base_version)
                ack = await first.submit(lease.lease_id, lease.base_version, torch.full_like(theta, 1e-3), codec=cfg.runtime.codec)
                assert ack.accepted and ack.version == 1
                submitted = clock.time()
            else:
                submitted = None
            await drive(clock, {}, until=held.done, real_timeout=30.0, idle_step=1.0)
            reply = held.result()
            return {"lease": lease, "expected_finish": expected_finish, "asked": asked, "hold": hold, "reply": reply,
                    "answered": clock.time(), "submitted": submitted, "events": journal(transport)}
        finally:
            await transport.close()

    result = run(scenario())
    hold, reply = result["hold"], result["reply"]
    assert hold["peer"] == "second" and hold["waiting_for"] == [result["lease"].lease_id]
    # the window: the grace period from the request, which the first peer's expected finish falls in
    assert hold["until"] == result["asked"] + cfg.schedule.grace_period and result["asked"] < result["expected_finish"] < hold["until"]
    assert reply.lease is not None
    if arrives:  # released the moment the awaited update was applied, starting from it
        assert reply.lease.base_version == 1 and reply.lease.issued_at == result["submitted"] < hold["until"]
    else:  # nothing arrived: released at the first tick past the window's end, from θ as it was
        assert reply.lease.base_version == 0
        assert hold["until"] <= reply.lease.issued_at < hold["until"] + 1.0
        released = [e for e in result["events"] if e["type"] == "assign" and e["peer"] == "second"]
        assert released and "grace window closed" in released[0]["reason"]


# ------------------------------------------------------------------------------- coordinator crashes


def _crash_script() -> Any:
    spec = importlib.util.spec_from_file_location("crash_test", ROOT / "scripts" / "crash_test.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "point, rpc",
    [("wal_appended", "submit"), ("wal_synced", "submit"), ("before_reply", "submit"), ("wal_synced", "assign")],
)
def test_a_coordinator_crash_at_each_point_then_resume_loses_no_acknowledged_update(tmp_path: Path, point: str, rpc: str) -> None:
    cfg = config()
    clock = FakeClock()
    names = ("a", "b")

    async def scenario() -> tuple[MemoryTransport, dict[str, Peer]]:
        transport = await started(tmp_path, cfg, clock)
        try:
            transport.kill.arm(point, nth=3, rpc=rpc)  # mid-run: the third such event
            peers = {name: Peer(transport, name, rounds=4) for name in names}
            tasks = {name: peer.task for name, peer in peers.items()}
            await drive(clock, tasks, until=lambda: transport.down or all(t.done() for t in tasks.values()), real_timeout=60.0)
            assert transport.down, "the armed kill point was never reached"
            with pytest.raises(PeerUnreachable):  # down means down, for everyone
                await transport.client("someone").hello()
            await transport.restart()  # --resume: the newest snapshot + the log replayed
            await drive(clock, tasks, real_timeout=60.0)
            for task in tasks.values():
                task.result()
            return transport, peers
        finally:
            await transport.close()

    transport, peers = run(scenario())
    assert transport.crashes == [point] and transport.lives == 2
    final = load_snapshot(transport.dir)["coordinator"]
    applied: dict[str, int] = {k: int(v) for k, v in final["applied"].items()}
    version = int(final["version"])
    assert sorted(applied.values()) == list(range(1, version + 1))  # each version from exactly one lease
    acks = [(lease_id, ack) for peer in peers.values() for lease_id, ack in peer.client.acks]
    assert all(ack.accepted for _, ack in acks)
    first_acks = {lease_id: ack.version for lease_id, ack in acks if not ack.duplicate}
    assert len(first_acks) == len([a for a in acks if not a[1].duplicate])  # no lease acknowledged as new twice
    for lease_id, ack in acks:  # every acknowledged update is in the state, at the version its ack named
        assert applied.get(lease_id) == ack.version, (lease_id, ack)
    assert set(applied) == {lease_id for lease_id, _ in acks}  # and nothing else was applied
    summaries = [peer.runner.summary for peer in peers.values()]
    assert sum(s.accepted for s in summaries) == len(acks) and sum(s.rejected for s in summaries) == 0
    if rpc == "submit":
        # the update in flight was logged before the crash: its resend is answered as a duplicate (the other
        # peer's submission may have been in the log, mid-fsync, when the process died: a duplicate as well)
        assert 1 <= sum(s.duplicates for s in summaries) <= len(names) and sum(s.resends for s in summaries) >= 1
    else:
        # the lease handed out at the crash was never told: its peer asked again, the lease was given back
        assert sum(s.duplicates for s in summaries) == 0
    # the final state equals a replay of the whole log from the initial snapshot (θ bitwise, optimizer, leases, ...)
    crash = _crash_script()
    replayed = crash.replay_whole_log(cfg, transport.dir, tmp_path / "replay")
    assert crash.state_differences(replayed.node.state.state_dict(), final) == []
    assert replayed.durability.replayed > len(applied)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("join_timeout", [300.0, 10.0])
def test_a_coordinator_down_past_a_lease_deadline_still_gets_its_update_within_the_join_timeout(
    tmp_path: Path, join_timeout: float
) -> None:
    # the peer's first submission is lost and the coordinator dies right after, its lease in training; it stays down
    # until 20 s past that lease's deadline. The peer resends past the deadline while nobody answers, up to
    # --join-timeout after its first failure (peer/upload.py); the restarted coordinator gives the lease its slack
    # and transfer time again (logic/peers.py on_restarted): applied, not expired. A join timeout shorter than the
    # downtime gives the lease up at its deadline, as before.
    cfg = config(runtime={"overlap": False})  # one lease at a time
    clock = FakeClock()

    async def scenario() -> tuple[Peer, dict[str, Any], float, list[dict[str, Any]]]:
        transport = await started(tmp_path, cfg, clock)
        try:
            lost = transport.add_fault("submit", "drop_request", peer="a")
            peer = Peer(transport, "a", rounds=2, connect_timeout=join_timeout)
            await drive(clock, {"a": peer.task}, until=lambda: lost.hits >= 1, real_timeout=60.0)
            transport.crash_now()
            [lease] = journal(transport, "assign")
            await drive(clock, {"a": peer.task}, until=lambda: clock.time() > lease["deadline"] + 20.0, real_timeout=60.0)
            restarted = clock.time()
            await transport.restart()
            await drive(clock, {"a": peer.task}, real_timeout=60.0)
            peer.task.result()
            return peer, lease, restarted, journal(transport)
        finally:
            await transport.close()

    peer, lease, restarted, events = run(scenario())
    summary = peer.runner.summary
    acked = [lease_id for lease_id, _ in peer.client.acks]
    assert summary.rounds == 2 and all(ack.accepted and not ack.duplicate for _, ack in peer.client.acks)
    if join_timeout > restarted - lease["time"]:
        assert acked[0] == lease["lease_id"] and summary.accepted == 2
        [applied] = [e for e in events if e["type"] == "applied" and e["lease_id"] == lease["lease_id"]]
        assert applied["time"] > lease["deadline"] + 20.0 and applied["version"] == 1
        assert not [e for e in events if e["type"] == "expired"]
    else:
        assert lease["lease_id"] not in acked and summary.accepted == 1
        assert [e["lease_id"] for e in events if e["type"] == "expired"] == [lease["lease_id"]]


@pytest.mark.timeout(60)
def test_fault_and_kill_point_names_are_checked() -> None:
    switch = KillSwitch()
    with pytest.raises(ValueError, match="kill point 'after_lunch' is none of"):
        switch.arm("after_lunch")
    transport = MemoryTransport(config(), Path("/nonexistent"), clock=FakeClock())
    with pytest.raises(ValueError, match="fault kind 'garble' is none of"):
        transport.add_fault("submit", "garble")
    with pytest.raises(ValueError, match="fault rpc 'upload' is none of"):
        transport.add_fault("upload", "delay")
    with pytest.raises(ValueError, match="a clock cannot go back"):
        asyncio.run(FakeClock().advance(-1.0))
