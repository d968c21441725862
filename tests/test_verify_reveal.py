"""Verification with the carried inner state (stage 2 of the commitments; coordinator/verify.py,
peer/reveal.py): the real coordinator daemon and real peer runners over the in-memory transport, with
``runtime.verify`` on and ``inner_state: carry`` (the paper's default: AdamW's moments carry across a peer's leases).

A peer commits to the digests of its inner state at each lease's start and end; when a lease is chosen for
verification its Ack asks for ``reveal`` and the peer sends the start state (the ``reveal`` RPC, bounded by the
model's inner-state size). What this pins, with two honest peers, one liar and one silent peer:

* every honest lease chosen for verification gets a verdict, bitwise equal to its re-run — from the revealed carried
  state where the lease did not start fresh (counted: every reveal asked of an honest peer was received);
* the liar, which reveals a state one bit off the one it committed to, fails on the digest and is expelled; the
  silent peer, which never reveals, is awaited until ``reveal_timeout`` passes on the coordinator's clock, then fails and is expelled — both through ``Verified`` events
  (write-ahead log, journal, status.json);
* both peers' updates are repaired away: the live θ (with the outer optimizer's state and the version) equals, bitwise,
  an independent replay of the whole log from the initial anchor with their submissions discarded;
* the wire: the reveal header round-trips, refuses a negative size, and a reveal nobody asked for is refused before
  its body is read; the peer's store keeps only its last ``reveal_keep`` start states.
"""

from __future__ import annotations

import re

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.checkpoint import load_snapshot
from asyncloco.coordinator.daemon import EVENT_TYPES, JOURNAL_FILE, STATUS_FILE
from asyncloco.coordinator.logic import Repaired, Verified, handle
from asyncloco.coordinator.rerun import Rerunner
from asyncloco.coordinator.substitute import Substitutes
from asyncloco.coordinator.repair import ANCHOR_DIR, log_events, repair
from asyncloco.coordinator.verify import live_base
from asyncloco.peer.reveal import RevealStore, send_reveal
from asyncloco.transport.rpc import ServiceLimits
from asyncloco.peer.runner import PeerError, PeerOptions, PeerRunner
from asyncloco.testing.memory import MemoryClient, MemoryTransport, as_actor, drive
from tests.test_verify_runtime import re_run
from asyncloco.train.commitments import FRESH_STATE_DIGEST, inner_state_size, split_parts
from asyncloco.train.inner import InnerTrainer
from asyncloco.transport.errors import MessageError, RemoteError
from asyncloco.transport.rpc import TrafficCounters
from asyncloco.transport.wire import Ack, RevealHeader, RevealReply
from asyncloco.workloads import build_workload

pytestmark = pytest.mark.timeout(240)

SPEED = 1000.0
HONEST = ("h0", "h1")
LIAR, SILENT = "liar", "silent"
REVEAL_TIMEOUT = 30.0


def config(feedback: bool = False) -> RunConfig:
    """The run; ``feedback``: sign-coded uploads with error feedback, whose residual is committed and revealed with the
    inner state (peer/reveal.py)."""
    upload = {"codec": "sgn15of16", "error_feedback": True, "error_feedback_decay": 0.5} if feedback else {}
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 4},
        "sim": {"workers": 4},
        "runtime": {
            "snapshot_every": 4, "eval_every": 100000, "lease_slack": 30.0, "speed_report_period": 600.0,
            "gate": {"enabled": False},
            "verify": {"enabled": True, "inner_state": "carry", "fraction": 0.5, "probation_updates": PROBATION, "horizon": 100000,
                       "queue": 256, "reveal_timeout": REVEAL_TIMEOUT,
                       # no end state kept (coordinator/chained.py): every check but a fresh start's asks for its reveal —
                       # a silent peer whose checks all chained from kept states would never be asked, and pass
                       "keep_states_mb": 0},
            **upload,
        },
    })


PROBATION = 3  # runtime.verify.probation_updates below


class LiarRunner(PeerRunner):
    """Trains honestly and reveals honestly through its probation (its leases held until their checks agree), then
    reveals a state with one bit of one moment flipped: the lease's start state (carried by then). Its unchecked leases
    meanwhile were applied: the repair takes them out."""

    revealed = 0

    async def _reveal(self, client: Any, lease_id: str, digest: Any, end: bool = True, start: bool = True) -> None:
        self.revealed += 1
        if self.revealed <= PROBATION:
            await super()._reveal(client, lease_id, digest, end, start)
            return
        state = self.reveals.reveal(lease_id, end, start)
        assert state
        tampered = bytearray(state)
        tampered[8 + 20] ^= 1  # past the start part's length field: in the start state
        # sent as the real client sends it: a reveal refused because the first one already expelled this peer
        # is logged, and the next lease request ends the peer with PeerError
        await send_reveal(client, lease_id, bytes(tampered), digest)


class SilentRunner(PeerRunner):
    """Trains honestly and reveals through its probation, then never again."""

    revealed = 0

    async def _reveal(self, client: Any, lease_id: str, digest: Any, end: bool = True, start: bool = True) -> None:
        self.revealed += 1
        if self.revealed <= PROBATION:
            await super()._reveal(client, lease_id, digest, end, start)


def start_peer(transport: MemoryTransport, name: str, rounds: int, runner_cls: Any = PeerRunner,
               link: Any = None) -> tuple[PeerRunner, "asyncio.Task[Any]"]:
    cfg = transport.cfg
    options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                          progress=False, max_rounds=rounds)
    runner = runner_cls(options, clock=transport.clock)
    runner.summary.peer_id = name
    runner.speed = SPEED
    counters = TrafficCounters()
    client = MemoryClient(transport, name, counters=counters, download_codec=cfg.runtime.download_codec)
    client.link = link  # transport/linkspeed.py LinkSpeed: the link rates its lease requests state (None: none)
    trainer = InnerTrainer.from_config(cfg, transport.workload)
    assert not trainer.reset_state  # carried inner state
    task = as_actor(name, runner.serve(client, transport.publisher(name, signer=f"key-{name}"), cfg, transport.workload,
                                       trainer, cfg.runtime.codec, counters))
    return runner, task


def journal(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / JOURNAL_FILE).read_text().splitlines() if line.strip()]
    return [r for r in records if r["type"] == kind]


@pytest.mark.parametrize("feedback", [False, True], ids=["int8", "sgn15of16-feedback"])
def test_carried_state_reveal_catches_a_liar_and_a_silent_peer(tmp_path: Path, feedback: bool) -> None:
    cfg = config(feedback)
    clock = FakeClock()
    run_dir = tmp_path / "run"

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, run_dir, clock=clock)
        await transport.start()
        try:
            peers = {name: start_peer(transport, name, rounds=10) for name in HONEST}
            liar = start_peer(transport, LIAR, rounds=30, runner_cls=LiarRunner)
            silent = start_peer(transport, SILENT, rounds=30, runner_cls=SilentRunner)
            tasks = {name: task for name, (_, task) in peers.items()} | {LIAR: liar[1], SILENT: silent[1]}
            daemon = transport.daemon
            assert daemon is not None and daemon.verification is not None
            verification = daemon.verification
            # the silent peer's check fails only at its deadline: move time past it once the others are done
            await drive(clock, tasks, real_timeout=150.0)
            await asyncio.wait_for(verification.drain(), timeout=60.0)
            # unless fake time already passed its deadline during the run, only the silent peer's reveal is awaited
            if verification.awaiting:
                assert {task.peer for task, _, _ in verification.awaiting.values()} == {SILENT}
                # its window: reveal_timeout and the start state's transfer at half its measured upload rate, at most
                # at the RPC service's floor (coordinator/verify.py reveal_window)
                windows = [verification.reveal_window(check) for check, _, _ in verification.awaiting.values()]
                size = 8 + verification.state_part_size()  # the verifier's own class: the start state alone
                cap = REVEAL_TIMEOUT + ServiceLimits().transfer_timeout(size)
                info, policy = daemon.node.state.peers[SILENT], daemon.node.state.policy
                measured = REVEAL_TIMEOUT + 2 * size * (info.transfer_s or 0.0) / policy.upload_bytes
                expected = min(cap, measured) if info.transfer_s else cap
                assert all(window == pytest.approx(expected, rel=1e-12) and each_cap == cap for window, each_cap in windows)
                assert windows[0][0] > REVEAL_TIMEOUT
                # each window was set when its reveal was asked, from the upload measured then: at most the cap
                await clock.advance(cap)
            # (the repair re-runs the silent peer's unchecked leases: on a loaded machine that took over 30 s)
            deadline = asyncio.get_running_loop().time() + 120.0
            while verification.awaiting or not any(r["peer"] == SILENT for r in verification.repairs):  # expelled, repaired
                assert asyncio.get_running_loop().time() < deadline, "the silent peer's deadline passed without a verdict"
                await asyncio.sleep(0.01)
            await asyncio.wait_for(verification.drain(), timeout=60.0)
            # a reveal nobody asked for is refused before its body is read
            intruder = MemoryClient(transport, HONEST[0])
            with pytest.raises(RemoteError, match="no reveal of lease L-nope is awaited"):
                await intruder.reveal("L-nope", b"\x00" * 10)
            daemon.monitoring.write_status()
            for name in (LIAR, SILENT):  # out for good: a call now is refused naming the expulsion
                error = tasks[name].exception()
                assert error is None or (isinstance(error, PeerError) and "expelled from this run" in str(error))
                with pytest.raises(RemoteError, match="expelled from this run"):
                    await MemoryClient(transport, name).assign(SPEED)
            for name in HONEST:
                tasks[name].result()
            return {
                "state": daemon.node.state, "last_seq": daemon.node.wal.last_seq, "numel": daemon.numel,
                "status": json.loads((run_dir / STATUS_FILE).read_text()), "fresh": verification.fresh_state,
                "reveals": dict(verification.reveals), "stores": {n: r.reveals for n, (r, _) in peers.items()},
                "state_size": verification.reveal_bound(),
                "layout_size": inner_state_size(InnerTrainer.from_config(cfg, transport.workload).optimizer),
            }
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    out = asyncio.run(asyncio.wait_for(scenario(), timeout=220.0))
    live = out["state"]
    book = live.verification
    assert sorted(book.expelled) == sorted([LIAR, SILENT]) and book.failed == 2
    verdicts = [v for v in journal(run_dir, "verdict") if "(peer already expelled)" not in v["detail"]]
    failed = {v["peer"]: v["detail"] for v in verdicts if not v["ok"]}
    assert set(failed) == {LIAR, SILENT}
    assert failed[LIAR] == "the revealed inner state does not match its commitment"
    # awaited for reveal_timeout plus its states' transfer (coordinator/verify.py reveal_window), then failed
    silent = re.fullmatch(r"the lease's inner states were not revealed within (\d+) s \(runtime.verify.reveal_timeout "
                          + f"{REVEAL_TIMEOUT:g}" + r" s and their transfer\)"
                          # (a loaded machine may time the in-memory upload below the RPC floor: then it is named)
                          + r"(; its last update came at [\d.]+ kB/s, below the 65\.5 kB/s a reveal needs — .*)?",
                          failed[SILENT])
    assert silent is not None and int(silent.group(1)) >= REVEAL_TIMEOUT, failed[SILENT]
    # honest peers: every chosen applied lease got a bitwise match; the carried ones were revealed and re-run from it
    honest = [v for v in verdicts if v["peer"] in HONEST]
    assert honest and all(v["ok"] and v["detail"] == "bitwise equal to the re-run" for v in honest)
    assigned = {a["lease_id"]: a for a in journal(run_dir, "assign")}
    chosen = {a["lease_id"] for a in journal(run_dir, "applied") if a["peer"] in HONEST and re_run(assigned[a["lease_id"]]["verify"])}
    assert {v["lease_id"] for v in honest} == chosen and not book.pending
    reveals = out["reveals"]
    # every reveal asked for was received, or late (only the silent peer's), or moot (its peer expelled meanwhile)
    assert reveals["asked"] == reveals["received"] + reveals["late"] + reveals["moot"]
    assert reveals["late"] >= 1 and reveals["refused"] == 1  # the intruder's
    assert reveals["received"] >= 3
    # every peer here is of the verifier's compute class and only the coordinator re-runs: each was asked for its start
    # state alone (its end is the re-run's, compared with the committed digest) and sent nothing more
    assert reveals["start_only"] == reveals["received"]
    assert out["status"]["verification"]["reveals"]["awaiting"] == 0
    # the reveal's bound is the exact size of two full inner states, the start's and the end's (each with feedback:
    # its length field and the residual), and the length field of the start part
    assert out["state_size"] == 8 + 2 * (out["layout_size"] + (8 + 4 * out["numel"] if feedback else 0))
    for store in out["stores"].values():  # the honest peers kept at most reveal_keep (2) start states
        assert store is not None and len(store) <= 2
    if feedback:  # the kept start states carry the residual: length field, full inner state, 4 bytes per parameter
        sizes = {len(state) for store in out["stores"].values() for state in store._states.values()}
        assert 8 + out["layout_size"] + 4 * out["numel"] in sizes, sizes
    # both peers' updates are gone, each replaced by the honest re-run of its lease (runtime.verify.repair: rerun):
    # an independent replay of the whole log, re-running their leases afresh, equals the live coordinator bitwise
    workload = build_workload(cfg)

    def rerun(name: str) -> Substitutes:  # nothing stored: every re-run trained again
        return Substitutes(Rerunner(cfg, workload), tmp_path / name, out["numel"])

    repairs = journal(run_dir, "repaired")
    # a peer caught with no update applied unchecked (every one of its leases held for its check) needs no repair
    repaired = [e["peer"] for e in journal(run_dir, "expelled") if e.get("repair", True)]
    assert repaired and [r["peer"] for r in repairs] == repaired and repairs[-1]["anchor"] == 0
    # each of their applied updates re-run or discarded, by the remedy the repair chose (a submission not applied live
    # is a no-op Discard)
    assert sum(r["substituted"] + r["discarded"] for r in repairs) > 0
    anchor = load_snapshot(run_dir / ANCHOR_DIR / f"{0:020d}")
    state = out["fresh"]()
    state.load_state_dict(anchor["coordinator"])
    events = list(log_events(run_dir / "wal", 0, out["last_seq"], EVENT_TYPES, out["numel"]))
    # each repair was carried out right before its Repaired record (after the expulsion, once its re-runs were
    # trained): replayed there, without every peer expelled by then, then the log goes on as it was
    marks = [i for i, (e, _) in enumerate(events) if isinstance(e, Repaired)]
    assert len(marks) == len(repairs) and all(any(isinstance(e, Verified) and not e.ok for e, _ in events[:i]) for i in marks)
    live_then = out["fresh"]()
    live_then.load_state_dict(anchor["coordinator"])
    replayed = live_then
    for index, (mark, record) in enumerate(zip(marks, repairs)):
        for event, now in events[(marks[index - 1] if index else 0) : mark]:
            handle(replayed, event, now)
        fresh = out["fresh"]()
        fresh.load_state_dict(anchor["coordinator"])
        # the remedy the live repair chose by validation loss (coordinator/verify.py): re-runs in their place, or nothing
        substitute = rerun(f"repair-{index}") if record["remedy"] == "rerun" else None
        result = repair(fresh, events[:mark], sorted(replayed.verification.expelled), record["version_before"],
                        replayed.leases, replayed.lease_counter, replayed.verification.chain, live_base(replayed),
                        substitute)
        assert events[mark][0] == dataclasses.replace(result.repaired, remedy=record["remedy"])
        replayed = result.state
    for event, now in events[marks[-1] :]:
        handle(replayed, event, now)
    assert torch.equal(replayed.params, live.params)
    assert replayed.version == live.version and replayed.local_updates == live.local_updates


def test_reveal_wire_and_store() -> None:
    header = RevealHeader("L7", 123)
    assert RevealHeader.from_wire(header.to_wire()) == header
    with pytest.raises(MessageError, match="RevealHeader.size"):
        RevealHeader.from_wire({"lease_id": "L7", "size": -1})
    with pytest.raises(MessageError, match="unknown field"):
        RevealHeader.from_wire({"lease_id": "L7", "size": 1, "pickle": b""})
    assert RevealReply.from_wire(RevealReply(True, "ok").to_wire()) == RevealReply(True, "ok")
    ack = Ack(True, 3, "applied", False, True)
    assert Ack.from_wire(ack.to_wire()).reveal is True and "reveal" not in Ack(True, 3, "x").to_wire()
    with pytest.raises(MessageError, match="Ack.reveal"):
        Ack.from_wire({**ack.to_wire(), "reveal": 1})
    start_only = Ack(True, 3, "applied", False, True, reveal_end=False)
    assert Ack.from_wire(start_only.to_wire()).reveal_end is False and "reveal_end" not in ack.to_wire()
    with pytest.raises(MessageError, match="Ack.reveal_end"):
        Ack.from_wire({**ack.to_wire(), "reveal_end": "no"})
    # the store without end states (as before end states were revealed): nothing for a fresh state, the last `keep` start states
    # otherwise, each the exact canonical bytes
    cfg = config()
    trainer = InnerTrainer.from_config(cfg, build_workload(cfg))
    store = RevealStore(keep=2, ends=False)
    store.hold("L0", trainer.optimizer)
    assert len(store) == 0 and store.get("L0") is None and store.reveal("L0") is None
    theta = trainer.full_params()
    for index in range(1, 4):
        trainer.run(theta, 0, 0, 2, 0)
        store.hold(f"L{index}", trainer.optimizer)
    size = inner_state_size(trainer.optimizer)
    assert len(store) == 2 and store.get("L1") is None and store.nbytes() == 2 * size
    state = store.get("L3")
    assert state is not None and len(state) == size and store.reveal("L3") == state
    # with end states (the default): a fresh start is kept (empty), each lease's end too, and a start that is the
    # previous lease's end is held once — (keep + 1) full states in the steady state, at most 2 × keep
    trainer.reset_inner_state()
    store = RevealStore(keep=2)
    for index in range(4):
        store.hold(f"L{index}", trainer.optimizer)
        trainer.run(theta, 0, 0, 2, 0)
        assert store.hold_end(f"L{index}", trainer.optimizer) == trainer.state_digest()
    assert store.get("L1") is store.get_end("L0") is None and store.get_end("L3") is not None
    assert store.nbytes() == 3 * size and len(store) == 2
    fresh = RevealStore(keep=2)
    fresh.hold("F", InnerTrainer.from_config(cfg, build_workload(cfg)).optimizer)
    assert fresh.get("F") == b"" and fresh.reveal("F") is None  # no end kept yet
    revealed = store.reveal("L3")
    assert revealed is not None and split_parts(revealed) == (store.get("L3"), store.get_end("L3"))
    assert len(revealed) == 8 + 2 * size
    parts = store.reveal_parts("L3")  # what the runner sends: the same bytes, not joined
    assert parts is not None and parts[1] is store.get("L3") and b"".join(parts) == revealed
    assert store.reveal_parts("L0") is None
    # asked for the start alone (Ack reveal_end: false): the start part and an empty end part
    alone = store.reveal("L3", end=False)
    assert alone is not None and split_parts(alone) == (store.get("L3"), b"") and len(alone) == 8 + size
    assert b"".join(store.reveal_parts("L3", end=False) or []) == alone
    with pytest.raises(ValueError, match="reveal_keep >= 1"):
        RevealStore(keep=0)


class RevealHandler:
    """The coordinator side of ``reveal`` over real hivemind P2P daemons: one awaited lease, a 1,000-byte bound."""

    LIMIT = 1000

    def __init__(self) -> None:
        self.revealed: list[tuple[str, bytes, str]] = []

    async def reveal_limit(self, header: RevealHeader, peer_id: str) -> int:
        if header.lease_id != "L1":
            raise ValueError(f"no reveal of lease {header.lease_id} is awaited")
        return self.LIMIT

    async def reveal(self, header: RevealHeader, state: bytes, peer_id: str) -> RevealReply:
        self.revealed.append((header.lease_id, state, peer_id))
        return RevealReply(True, "queued for verification")


@pytest.mark.timeout(60)
def test_a_reveal_lost_on_the_way_is_sent_again_until_its_budget() -> None:
    """An honest peer's reveal cut by a reset would fail its check at reveal_timeout (and expel it): the upload is sent
    again with backoff (0.5 s doubling, on the runner's clock) within ``retry_for``; a refusal is an answer, not
    retried; without a budget one failure is final (a validator or a hostile client's own choice)."""
    from asyncloco.transport.errors import PeerUnreachable

    class Flaky:
        def __init__(self, failures: int, reply: RevealReply) -> None:
            self.failures, self.reply, self.calls = failures, reply, 0

        async def reveal(self, lease_id: str, state: bytes) -> RevealReply:
            self.calls += 1
            if self.calls <= self.failures:
                raise PeerUnreachable("stream closed after 163840 of 1048576 bytes")
            return self.reply

    waits: list[float] = []  # the runner's clock: time passes only in its waits

    async def wait(seconds: float) -> None:
        waits.append(seconds)

    async def send(client: Flaky, retry_for: float) -> bool:
        return await send_reveal(client, "L1", b"state", "a" * 64, retry_for=retry_for, wait=wait, now=lambda: sum(waits))

    took = RevealReply(True, "")
    flaky = Flaky(3, took)
    assert asyncio.run(send(flaky, 150.0)) and flaky.calls == 4 and waits == [0.5, 1.0, 2.0]
    waits.clear()
    dead = Flaky(10**6, took)  # never gets through: gives up once the next wait would pass the budget
    assert not asyncio.run(send(dead, 20.0))
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0] and dead.calls == 6  # 15.5 s waited; another 10 s would pass 20
    waits.clear()
    refused = Flaky(0, RevealReply(False, "no reveal of lease L1 is awaited"))
    assert not asyncio.run(send(refused, 150.0)) and refused.calls == 1 and waits == []
    once = Flaky(1, took)
    assert not asyncio.run(send_reveal(once, "L1", b"state", "a" * 64)) and once.calls == 1

    class Answered(Flaky):  # the coordinator's handler raised: an answer too (a restarted one awaits no reveal)
        async def reveal(self, lease_id: str, state: bytes) -> RevealReply:
            self.calls += 1
            raise RemoteError("ValueError: no reveal of lease L1 is awaited from this peer")

    answered = Answered(0, took)
    assert not asyncio.run(send(answered, 150.0)) and answered.calls == 1 and waits == []


def test_reveal_rpc_over_p2p_is_bounded_before_its_body() -> None:
    from hivemind.p2p import P2P

    from asyncloco.transport.framing import ERROR, HEADER, FrameReader, pack_header
    from asyncloco.transport.rpc import CoordinatorClient, CoordinatorService, handle_name

    numel, run = 1000, "reveal-test"

    async def main() -> None:
        server = client_p2p = None
        try:
            server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            client_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
            handler = RevealHandler()
            service = CoordinatorService(handler, numel)  # type: ignore[arg-type]
            await service.add_p2p_handlers(server, namespace=run)
            client = CoordinatorClient(client_p2p, server.peer_id, numel, namespace=run)
            state = bytes(range(256)) * 3  # 768 bytes
            assert await client.reveal("L1", state) == RevealReply(True, "queued for verification")
            assert handler.revealed == [("L1", state, client_p2p.peer_id.to_base58())]
            assert client.counters.reveal.payload_bytes_sent == 768 == service.counters.reveal.payload_bytes_received
            with pytest.raises(RemoteError, match="no reveal of lease L2 is awaited"):
                await client.reveal("L2", state)
            # a header declaring more than the bound is refused at once: no Ready, no body read, nothing handed on
            _, reader, writer = await client_p2p.call_binary_stream_handler(server.peer_id, handle_name(run, "reveal"))
            try:
                packed = pack_header(RevealHeader("L1", RevealHandler.LIMIT + 1).to_wire())
                writer.write(bytes((HEADER,)) + len(packed).to_bytes(4, "big") + packed)
                await writer.drain()
                with pytest.raises(RemoteError, match="1001 bytes; this model's inner state has at most 1000"):
                    await FrameReader(reader, idle_timeout=20.0).read_frame({HEADER: 1 << 16, ERROR: 1 << 16})
            finally:
                writer.close()
            assert len(handler.revealed) == 1
        finally:
            for p2p in (client_p2p, server):
                if p2p is not None:
                    await p2p.shutdown()

    asyncio.run(main())


def test_a_lease_lays_out_its_state_once_and_the_next_start_reuses_it() -> None:
    """A peer's commitments per lease (peer/reveal.py): the end state is laid out and hashed once; the next lease's
    start, unchanged since, is that same buffer and digest (no second layout); anything that changes the state — a
    step, a reset, a moment changed in place without a step — is seen, and the digest is taken afresh. Each layout
    is exactly the canonical bytes (train/commitments.py inner_state_chunks, joined)."""
    from asyncloco.train.commitments import inner_state_buffer, inner_state_chunks

    cfg = config()
    trainer = InnerTrainer.from_config(cfg, build_workload(cfg))
    theta = trainer.full_params()
    store = RevealStore(keep=2)
    assert store.hold("L0", trainer.optimizer) == FRESH_STATE_DIGEST and store.laid_out == 1
    for index in range(3):
        trainer.run(theta, 0, 0, 2, 0)
        end = store.hold_end(f"L{index}", trainer.optimizer)
        assert end == trainer.state_digest()
        assert store.hold(f"L{index + 1}", trainer.optimizer) == end  # the next start: the same state
        assert store.get(f"L{index + 1}") is store.get_end(f"L{index}")  # the same buffer, kept once
    assert store.laid_out == 1 + 3  # one layout per lease end, none for the starts that followed
    assert store.recycled == 0  # L0's end, also L1's start, was dropped only as L3 started: no layout since
    chunks = inner_state_chunks(trainer.optimizer)
    buffer = inner_state_buffer(trainer.optimizer)
    assert chunks is not None and buffer is not None and bytes(store.get("L3") or b"") == b"".join(chunks) == bytes(buffer)
    # a moment changed in place, no step taken: its version counter moved, the start is laid out again
    param = next(p for group in trainer.optimizer.param_groups for p in group["params"])
    trainer.optimizer.state[param]["exp_avg"].mul_(2.0)
    changed = store.hold("L4", trainer.optimizer)
    assert store.laid_out == 5 and changed == trainer.state_digest() and changed != end
    # that layout wrote into the dropped buffer of L0's end; every state still kept is intact
    from asyncloco.train.commitments import revealed_digest
    assert store.recycled == 1
    assert revealed_digest(store.get("L3") or b"") == revealed_digest(store.get_end("L2") or b"") == end
    assert revealed_digest(store.get("L4") or b"") == changed
    # a reset: the fresh state
    trainer.run(theta, 0, 0, 2, 0)
    store.hold_end("L4", trainer.optimizer)
    trainer.reset_inner_state()
    assert store.hold("L5", trainer.optimizer) == FRESH_STATE_DIGEST and store.get("L5") == b""
    # a state with some parameters still without moments lays out as the chunks do (marker 0 for those)
    trainer.run(theta, 0, 0, 1, 0)
    del trainer.optimizer.state[param]
    chunks = inner_state_chunks(trainer.optimizer)
    buffer = inner_state_buffer(trainer.optimizer)
    assert chunks is not None and chunks[0] == b"\x00" and buffer is not None and bytes(buffer) == b"".join(chunks)
    assert store.hold("L6", trainer.optimizer) == trainer.state_digest()


@pytest.mark.parametrize("implementation", [{"foreach": False}, {"foreach": True}, {"fused": True}])
def test_every_adamw_implementation_s_step_is_seen(implementation: dict[str, bool]) -> None:
    """The store recognises an unchanged state by its tensors' version counters: each of AdamW's implementations (the
    for-loop, foreach — the default on CUDA — and fused, which leaves the moments' counters alone) bumps its step
    tensor's, so a state one step on is always laid out and hashed afresh."""
    from asyncloco.train.commitments import inner_state_digest

    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW(params, lr=1e-2, **implementation)
    store = RevealStore(keep=2)

    def step() -> None:
        for param in params:
            param.grad = torch.full_like(param, 0.5)
        optimizer.step()

    step()
    digests = [store.hold_end("L0", optimizer)]
    for index in range(1, 4):
        assert store.hold(f"L{index}", optimizer) == digests[-1]  # unchanged: the last end
        step()
        digests.append(store.hold_end(f"L{index}", optimizer))
        assert digests[-1] == inner_state_digest(optimizer) != digests[-2]
    step()  # a step after the last end, no hold_end: the next start must see it
    assert store.hold("L4", optimizer) == inner_state_digest(optimizer) != digests[-1]
    # the deferred forms the runner uses: the same digests, awaited once their hashing thread is done
    import asyncio

    from asyncloco.peer.reveal import settled

    step()
    end = store.hold_end_deferred("L4", optimizer)
    start = store.hold_deferred("L5", optimizer)
    assert end is not None and start is end  # the next start is the last end, its digest the same computation
    assert asyncio.run(settled(end)) == inner_state_digest(optimizer) and asyncio.run(settled("ready")) == "ready"
