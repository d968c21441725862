"""Real multi-process runs on 127.0.0.1: a coordinator daemon and peers as separate processes (GitHub issue 4,
item 5).

Every test starts its processes through :class:`~asyncloco.local_cluster.LocalCluster` (each process in its
own session, ports chosen by the OS), waits only on conditions with deadlines (``cluster.wait_for``), and
checks after teardown that nothing it started is still alive — no p2pd, no Python child. The model is the
``tiny`` preset on 8 x 64 tokens per step, ~30 ms a step on a loaded 2-core machine; peers emulate slower
devices with ``--slowdown`` (a round then takes that many times as long).

What each test pins:

* ``test_three_peers_learn_follow_dylu_and_send_exact_bytes`` — the version advances one applied update at
  a time and validation loss falls; every lease's step count is DyLU (paper Eq. 6) of the speeds the
  coordinator held at that moment, and a ``--slowdown 4`` peer gets about a quarter of the fast peer's
  steps; pseudo-gradient bytes on the wire are exactly ``accepted × wire_bytes("int8", numel)`` on each
  peer and their sum on the coordinator.
* ``test_peer_killed_mid_round_gives_its_lease_back`` — SIGKILL of a peer while it trains: the run goes on,
  the lease expires (peer left / deadline) and its batch range is issued again; exact bytes with codec
  ``none`` on the survivors.
* ``test_coordinator_restart_resumes_and_peers_carry_on`` — SIGTERM + ``--resume``: same peer id and
  address, no version regression, every version applied exactly once across the restart, and the very same
  peer processes get new updates applied; every applied update was acknowledged to its peer exactly once.
* ``test_coordinator_sigkill_keeps_every_acknowledged_update`` — SIGKILL of the coordinator's process group
  while a peer's call waits on it, then ``--resume``: every update acked before the crash is in the durable
  state (snapshot + write-ahead log replayed) at
  its version, the resumed version is the snapshot's, each lease is acked once and applied once (versions
  1..V), same id and port, no lease lost, and the same peer processes carry on.
* ``test_resent_submission_is_applied_once`` — an in-process client submits the same encoded bytes twice:
  one apply, one duplicate ack, θ moved by exactly one DN step.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest
import torch
import yaml

from asyncloco.config import load_config
from asyncloco.coordinator.daemon import CoordinatorDaemon
from asyncloco.local_cluster import LocalCluster
from asyncloco.transport.codecs import wire_bytes

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TAG_VAR = "ASYNCLOCO_TEST_TAG"  # every process a test starts inherits it: how leftovers are recognised
H = 20  # max_local_steps: a slowdown-4 peer gets floor(20 / 4) = 5 steps


# ------------------------------------------------------------------------------------------ config


def write_config(directory: Path, *, codec: str, lease_slack: float = 5.0, max_local_steps: int = H, **runtime: Any) -> Path:
    config = {
        "name": "integration",
        "seed": 0,
        "task": {
            "kind": "lm",
            "model": "tiny",
            "source": "embedded",
            # 512 tokens per step (~30 ms on one loaded core): long enough that the fixed cost of starting a
            # round does not dominate a 3-step lease of a slow peer and skew its measured speed
            "seq_len": 64,
            "batch_size": 8,
            "num_shards": 4,
            "val_sequences": 16,
            "max_train_sequences": 4000,
        },
        "inner": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": 3},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": max_local_steps, "min_steps": 1, "grace_period": 0.5},
        "sim": {"workers": 3},
        "runtime": {
            # unique per test: peers of another test (or another engineer's run) never mix in
            "run_id": f"it-{uuid.uuid4().hex[:12]}",
            "codec": codec,
            "eval_every": 2,
            "speed_report_period": 1.0,
            "lease_timeout_factor": 2.0,
            "lease_slack": lease_slack,
            **runtime,
        },
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------------------------- processes


def _process_table() -> dict[int, tuple[str, str, int, int]]:
    """pid -> (name, state, ppid, session) from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (name, fields[0], int(fields[1]), int(fields[3]))
    return table


def _has_tag(pid: int, tag: str) -> bool:
    try:
        return f"{TAG_VAR}={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _descends_from(pid: int, ancestor: int, table: dict[int, tuple[str, str, int, int]]) -> bool:
    seen = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid][2]
        if pid == ancestor:
            return True
    return False


def leftovers(before: set[int], sessions: set[int], tag: str) -> list[str]:
    """Live processes this test started: in a session it spawned, below pytest, or carrying its tag."""
    table = _process_table()
    found = []
    for pid, (name, state, _, session) in table.items():
        if pid in before or state == "Z":
            continue
        if name == "torch_shm_manag" and table[pid][2] == os.getpid():
            continue  # torch's per-process shared-memory helper of pytest itself, started once, ends with it
        if session in sessions or _descends_from(pid, os.getpid(), table) or _has_tag(pid, tag):
            found.append(f"{pid} {name}")
    return sorted(found)


class Harness:
    """Clusters of one test, torn down after it; then asserts that none of their processes remain."""

    def __init__(self, tmp_path: Path, tag: str) -> None:
        self.tmp_path, self.tag = tmp_path, tag
        self.clusters: list[LocalCluster] = []

    def cluster(self, config: Path, name: str = "cluster") -> LocalCluster:
        cluster = LocalCluster(config, self.tmp_path / name, threads=1, env={TAG_VAR: self.tag})
        self.clusters.append(cluster)
        return cluster

    def sessions(self) -> set[int]:
        return {process.pid for cluster in self.clusters for process in cluster.spawned}


@pytest.fixture
def harness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)  # in-process DHTs fork from pytest: their p2pd carries it too
    p2pd_before = {pid for pid, info in _process_table().items() if info[0] == "p2pd"}
    before = set(_process_table())
    harness = Harness(tmp_path, tag)
    try:
        yield harness
    finally:
        for cluster in harness.clusters:
            cluster.close()
    # A SIGKILLed group is gone at once; p2pd of a cleanly stopped process exits within a second or two.
    deadline = time.monotonic() + 15.0
    while (left := leftovers(before, harness.sessions(), tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind by the test: {left}"
    new_p2pd = {
        pid for pid, info in _process_table().items() if info[0] == "p2pd" and info[1] != "Z" and pid not in p2pd_before
    }
    assert not {pid for pid in new_p2pd if _has_tag(pid, tag)}, f"p2pd left behind: {new_p2pd}"


# ------------------------------------------------------------------------------------------ reading


def of_type(events: list[dict[str, Any]], kind: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind and all(e.get(k) == v for k, v in match.items())]


def peer_ids(cluster: LocalCluster, names: list[str], timeout: float = 120.0) -> dict[str, str]:
    """Name -> peer id, from each peer's summary (written as soon as it joined)."""

    def ready() -> dict[str, str] | None:
        ids = {name: cluster.peer_summary(name).get("peer_id", "") for name in names}
        return ids if all(ids.values()) else None

    return cluster.wait_for(ready, timeout, f"peers {names} to join")


def applied_count(cluster: LocalCluster, peer: str, after: float = 0.0) -> int:
    return sum(1 for e in of_type(cluster.events(), "applied", peer=peer) if e["time"] > after)


def stop_all(cluster: LocalCluster) -> None:
    """Graceful stop: peers first (each finishes its step, writes its summary), then the coordinator
    (final snapshot and status.json). After this every counter is final."""
    for name, process in cluster.peers.items():
        assert cluster.stop(process, timeout=60.0) == 0, f"peer {name} did not exit cleanly; see {cluster.workdir}"
    assert cluster.stop_coordinator(timeout=60.0) == 0, f"the coordinator did not exit cleanly; see {cluster.workdir}"


def assert_versions_applied_once(events: list[dict[str, Any]]) -> int:
    """Each version 1..V was produced by exactly one applied event, each lease applied at most once."""
    applied = of_type(events, "applied")
    versions = [e["version"] for e in applied]
    assert versions == list(range(1, len(applied) + 1)), versions
    lease_ids = [e["lease_id"] for e in applied]
    assert len(set(lease_ids)) == len(lease_ids)
    return len(applied)


def _socket_inodes(pids: Iterable[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def pending_streams(pid: int) -> int:
    """Connections waiting, not yet accepted, on the listening unix sockets of process ``pid`` (Linux
    /proc/net/unix). hivemind's p2pd hands each incoming libp2p stream (an RPC) to the Python process
    by connecting to such a socket: while that process is stopped (SIGSTOP), each RPC a peer starts waits
    here. A pending connection is the one socket at the listener's path that no process holds."""
    own = _socket_inodes([pid])
    session = _process_table().get(pid, ("", "", 0, -1))[3]
    held = _socket_inodes(p for p, info in _process_table().items() if info[3] == session)
    rows = [row.split() for row in Path("/proc/net/unix").read_text().splitlines()[1:]]
    listening = {r[7] for r in rows if len(r) > 7 and r[6] in own and int(r[3], 16) & 0x10000}
    return sum(1 for r in rows if len(r) > 7 and r[7] in listening and r[6] not in held)


def durable_state(cluster: LocalCluster, tmp_path: Path) -> dict[str, Any]:
    """What ``--resume`` continues from: the newest snapshot with the write-ahead log replayed (read from a
    copy of the checkpoint directory, so the real one is untouched)."""
    copy = tmp_path / f"durable-{uuid.uuid4().hex[:8]}"
    shutil.copytree(cluster.checkpoint_dir, copy)
    resumed = CoordinatorDaemon(load_config(cluster.config), checkpoint_dir=copy, resume=True)
    resumed.journal.close()
    resumed.wal.close()
    return resumed.state.state_dict()


ACK = re.compile(r"lease (L[0-9A-Za-z]+) accepted: version (\d+)( \(duplicate\))?")


def acks(cluster: LocalCluster, name: str) -> list[tuple[str, int, bool]]:
    """(lease id, version, duplicate) of every acceptance the peer ``name`` received, from its log."""
    path = cluster.workdir / f"{name}.log"
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [(m[1], int(m[2]), bool(m[3])) for m in ACK.finditer(text)]


DYLU_REASON = re.compile(r"DyLU: (\d+) steps at ([0-9.e+]+) units/s vs fastest ([0-9.e+]+)")


def dylu_allowed(speed: float, fastest: float, max_steps: int, min_steps: int = 1) -> set[int]:
    """Eq. 6 on the speeds as journalled (4 significant digits): both neighbours at an integer boundary."""
    exact = speed / fastest * max_steps
    candidates = {math.floor(exact)}
    relative_error = 2 * 5e-4  # .4g rounding of both speeds
    candidates |= {math.floor(exact * (1 - relative_error)), math.floor(exact * (1 + relative_error))}
    return {max(min_steps, min(max_steps, c)) for c in candidates}


# -------------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(300)
def test_three_peers_learn_follow_dylu_and_send_exact_bytes(harness: Harness, tmp_path: Path) -> None:
    """Issue 4 item 5, checks 1-3 on one run: coordinator + peers with slowdowns 1, 4, 4, codec int8."""
    cluster = harness.cluster(write_config(tmp_path, codec="int8"))
    with cluster:
        cluster.start_coordinator()
        slowdowns = {"fast": 1.0, "slow1": 4.0, "slow2": 4.0}
        for name, slowdown in slowdowns.items():
            cluster.start_peer(name, slowdown=slowdown)
        ids = peer_ids(cluster, list(slowdowns))

        def enough() -> bool:
            events = cluster.events()
            leases = {name: len(of_type(events, "assign", peer=ids[name])) for name in slowdowns}
            return len(of_type(events, "applied")) >= 15 and min(leases.values()) >= 6

        cluster.wait_for(enough, 180, "15 applied updates and 6 leases per peer")
        stopping_at = time.time()
        stop_all(cluster)

        status, events = cluster.status(), cluster.events()
        summaries = {name: cluster.peer_summary(name) for name in slowdowns}
        numel = of_type(events, "start")[0]["numel"]

    # 1. the version advances one applied update at a time, and validation loss falls
    version = assert_versions_applied_once(events)
    assert status["version"] == version >= 15
    assert status["local_updates"] == sum(e["steps"] for e in of_type(events, "applied"))
    evals = status["evals"]
    assert evals[0]["version"] == 0 and [e["version"] for e in evals] == sorted({e["version"] for e in evals})
    later = [e for e in evals if e["version"] >= 10]
    assert later, evals
    # loss of the initial tiny model is ~ln(4096) = 8.3; 10+ DN updates bring it to ~6.5-7.2 in trial runs
    assert later[-1]["loss"] < evals[0]["loss"] - 0.5, evals

    # 2. DyLU: every lease is Eq. 6 of the speeds the coordinator held at that moment ...
    assigns = of_type(events, "assign")
    for event in assigns:
        match = DYLU_REASON.search(event["reason"])
        assert match, event["reason"]
        steps, speed, fastest = int(match[1]), float(match[2]), float(match[3])
        assert steps in dylu_allowed(speed, fastest, H), event
        assert event["steps"] == steps  # no abandoned ranges in this run, so no shortened lease
    # ... and a 4x slower peer gets about a quarter of the fast peer's steps (ideal: 5 of 20). The speeds
    # are measured on a shared 2-core machine, and there the slow peers measure low: their few steps always
    # run while the fast peer trains too (3 training processes on 2 cores, plus whatever else runs there),
    # whereas most of the fast peer's steps run while the slow ones sit in their emulated pause. In trial
    # runs (load average 3-5) that put the ratio at 0.16-0.23; on an idle machine with spare cores it is
    # 0.25. [0.12, 0.36] admits that bias and rejects DyLU off (1.0), an inverted or doubled slowdown
    # (0.06, 0.5) and a floor at the fast peer's steps. Left out: each peer's first two leases (issued
    # from the start-up measurement, taken while the others still imported torch, or before the fast peer
    # had reported) and leases issued once the peers were being stopped (a departed fastest peer no longer
    # sets the max, by design).
    def steps_of(name: str) -> list[int]:
        return [e["steps"] for e in assigns if e["peer"] == ids[name] and e["issued_at"] < stopping_at][2:]

    slow_steps = steps_of("slow1") + steps_of("slow2")
    fast_steps = steps_of("fast")
    ratio = (sum(slow_steps) / len(slow_steps)) / (sum(fast_steps) / len(fast_steps))
    assert 0.12 <= ratio <= 0.36, (ratio, slow_steps, fast_steps)

    # 3. bytes on the wire: exactly the codec's size per accepted submission, on both ends
    per_submit = wire_bytes("int8", numel)
    received = status["traffic"]["submit"]["payload_bytes_received"]
    for name, summary in summaries.items():
        assert summary["rejected"] == 0 and summary["duplicates"] == 0 and summary["resends"] == 0, summary
        assert summary["traffic"]["submit"]["payload_bytes_sent"] == summary["accepted"] * per_submit, name
        assert summary["accepted"] == status["peers"][ids[name]]["applied"], name
    assert received == sum(s["traffic"]["submit"]["payload_bytes_sent"] for s in summaries.values())
    assert received == version * per_submit


@pytest.mark.timeout(300)
def test_peer_killed_mid_round_gives_its_lease_back(harness: Harness, tmp_path: Path) -> None:
    """Issue 4 item 5, check 4: SIGKILL a peer while it trains a lease; codec none."""
    cluster = harness.cluster(write_config(tmp_path, codec="none", max_local_steps=8))
    with cluster:
        cluster.start_coordinator()
        # rounds of 6-8 steps stretched 25-fold take a few seconds: long enough to be killed mid-round
        names = ["victim", "survivor1", "survivor2"]
        for name in names:
            cluster.start_peer(name, slowdown=25.0)
        ids = peer_ids(cluster, names)
        victim = ids["victim"]

        def victim_training() -> dict[str, Any] | None:
            events = cluster.events()
            done = {e["lease_id"] for e in events if e["type"] in ("applied", "expired", "rejected")}
            now = time.time()
            for lease in of_type(events, "assign", peer=victim):
                # issued a moment ago (θ downloaded, training under way) and not expected to finish soon
                if lease["lease_id"] not in done and lease["issued_at"] + 0.5 < now < lease["expected_finish"] - 1.0:
                    return lease
            return None

        # wait for a lease of the victim's second round or later: the run is in steady state
        cluster.wait_for(lambda: applied_count(cluster, victim) >= 1, 120, "an applied update from the victim")
        lease = cluster.wait_for(victim_training, 60, "the victim to be mid-round")
        cluster.kill_peer("victim")
        killed_at = time.time()
        version_at_kill = cluster.status()["version"]

        def given_back() -> dict[str, Any] | None:
            expired = of_type(cluster.events(), "expired", lease_id=lease["lease_id"])
            return expired[0] if expired else None

        # peer_left after 3 report periods (3 s) without a report, or the deadline (≤ 2 x duration + 5 s)
        expired = cluster.wait_for(given_back, 60, f"lease {lease['lease_id']} of the killed peer to be given back")

        def reissued() -> dict[str, Any] | None:
            for event in of_type(cluster.events(), "assign", shard=lease["shard"], start_offset=lease["start_offset"]):
                if event["lease_id"] != lease["lease_id"] and event["issued_at"] >= expired["time"] - 0.01:
                    return event
            return None

        # Eq. 2 favours the shard that just lost its steps; the range is the first one it issues again
        again = cluster.wait_for(reissued, 90, f"shard {lease['shard']} range {lease['start_offset']} to be issued again")
        cluster.wait_for(
            lambda: cluster.status().get("version", 0) >= version_at_kill + 4, 90, "4 more updates after the kill"
        )
        survivors = ["survivor1", "survivor2"]
        for name in survivors:
            assert cluster.stop(cluster.peers[name], timeout=60.0) == 0
        assert cluster.stop_coordinator(timeout=60.0) == 0
        events, status = cluster.events(), cluster.status()
        summaries = {name: cluster.peer_summary(name) for name in survivors}
        numel = of_type(events, "start")[0]["numel"]

    assert expired["peer"] == victim and expired["steps"] == lease["steps"] and expired["shard"] == lease["shard"]
    assert "peer left" in expired["reason"] or "deadline" in expired["reason"], expired
    assert expired["time"] >= killed_at - 0.01
    assert again["peer"] != victim
    assert not of_type(events, "applied", lease_id=lease["lease_id"])
    assert not of_type(events, "rejected"), of_type(events, "rejected")
    version = assert_versions_applied_once(events)
    assert any(e["peer"] != victim and e["time"] > expired["time"] for e in of_type(events, "applied"))
    # the run kept going on the survivors: nothing after the kill came from the victim
    assert not [e for e in of_type(events, "applied", peer=victim) if e["time"] > killed_at]
    per_submit = wire_bytes("none", numel)
    assert per_submit == 4 * numel
    for name, summary in summaries.items():
        assert summary["traffic"]["submit"]["payload_bytes_sent"] == summary["accepted"] * per_submit, name
    received = status["traffic"]["submit"]["payload_bytes_received"]
    assert received == version * per_submit  # the victim never got to send its killed round


@pytest.mark.timeout(300)
def test_coordinator_restart_resumes_and_peers_carry_on(harness: Harness, tmp_path: Path) -> None:
    """Issue 4 item 5, check 5: SIGTERM the coordinator, restart it with --resume, peers keep running.

    ``lease_slack`` is 30 s (the shipped default) so leases in flight outlive the ~10 s the coordinator
    needs to start again: their peers resend and nothing is lost."""
    cluster = harness.cluster(write_config(tmp_path, codec="int8", lease_slack=30.0))
    with cluster:
        address = cluster.start_coordinator()
        names = ["a", "b", "c"]
        for name, slowdown in zip(names, (2.0, 2.0, 4.0)):
            cluster.start_peer(name, slowdown=slowdown)
        ids = peer_ids(cluster, names)
        cluster.wait_for(
            lambda: all(applied_count(cluster, ids[name]) >= 2 for name in names), 120, "2 applied updates per peer"
        )
        coordinator_id = cluster.status()["peer_id"]
        pids = {name: process.pid for name, process in cluster.peers.items()}
        assert cluster.stop_coordinator(timeout=60.0) == 0
        stop_event = of_type(cluster.events(), "stop")[-1]
        version_before = stop_event["version"]
        assert cluster.status()["version"] == version_before

        assert cluster.start_coordinator(resume=True) == address  # same identity, same port
        start = of_type(cluster.events(), "start")[-1]
        assert start["resumed"] is True and start["version"] == version_before and start["peer_id"] == coordinator_id
        restarted_at = start["time"]

        def carried_on() -> bool:
            return all(applied_count(cluster, ids[name], after=restarted_at) >= 2 for name in names)

        cluster.wait_for(carried_on, 150, "2 applied updates per peer after the restart")
        for name, process in cluster.peers.items():
            assert process.poll() is None and process.pid == pids[name], f"peer {name} was restarted or died"
        stop_all(cluster)
        events, status = cluster.events(), cluster.status()
        summaries = {name: cluster.peer_summary(name) for name in names}

    version = assert_versions_applied_once(events)  # across both coordinator lifetimes, no version twice
    assert status["version"] == version > version_before
    after = [e for e in of_type(events, "applied") if e["time"] > restarted_at]
    assert min(e["version"] for e in after) == version_before + 1
    assert {e["peer"] for e in after} == set(ids.values())
    assert not of_type(events, "rejected"), of_type(events, "rejected")
    # Every applied update reached its peer as exactly one ack: a first ack, or — if the coordinator went
    # down between applying and answering — a duplicate ack for the resent bytes.
    for name, summary in summaries.items():
        firsts = summary["accepted"] - summary["duplicates"]
        assert firsts + summary["duplicates"] == status["peers"][ids[name]]["applied"], (name, summary)
    assert sum(s["accepted"] for s in summaries.values()) == version
    # evaluations from before the restart are kept and continue
    assert [e["version"] for e in status["evals"]][0] == 0
    assert any(e["version"] > version_before for e in status["evals"])


@pytest.mark.timeout(240)
def test_coordinator_sigkill_keeps_every_acknowledged_update(harness: Harness, tmp_path: Path) -> None:
    """A coordinator CRASH: SIGKILL of its whole process group (Python, DHT process, p2pd) while a peer's
    submission is in flight, then ``--resume`` under the same running peers. The durability contract
    (coordinator/checkpoint.py) says: acknowledged ⇒ in the durable snapshot; handed out ⇒ in the snapshot.

    To have a call in flight for sure, the coordinator's Python process is first frozen (SIGSTOP) while a
    peer is mid-round, until that peer's next call (its submission) waits on it; then the group is killed.
    hivemind's p2pd never ends such a stream: the peer notices the closed connection (CoordinatorClient's
    liveness check), resends the same bytes to the restarted coordinator and carries on — before that
    check it sat out the 10-minute submit timeout. ``lease_slack`` 45 s outlives the ~10 s restart."""
    cluster = harness.cluster(write_config(tmp_path, codec="int8", lease_slack=45.0))
    with cluster:
        address = cluster.start_coordinator()
        names = ["a", "b", "c"]
        for name in names:
            # rounds of ~20 steps stretched 4-fold (2-4 s): a peer is mid-round, θ in hand, most of the time
            cluster.start_peer(name, slowdown=4.0)
        ids = peer_ids(cluster, names)
        cluster.wait_for(
            lambda: cluster.status().get("version", 0) >= 6 and all(applied_count(cluster, ids[n]) >= 1 for n in names),
            120,
            "6 applied updates, one from each peer",
        )

        def mid_round() -> bool:
            """A lease issued over a second ago (θ downloaded, training under way) that is not due yet."""
            events = cluster.events()
            done = {e["lease_id"] for e in events if e["type"] in ("applied", "expired", "rejected")}
            now = time.time()
            return any(
                lease["lease_id"] not in done and lease["issued_at"] + 1.0 < now < lease["expected_finish"] - 0.3
                for lease in of_type(events, "assign")
            )

        cluster.wait_for(mid_round, 60, "a peer in the middle of a round", poll=0.05)
        coordinator_id = cluster.status()["peer_id"]
        pids = {name: process.pid for name, process in cluster.peers.items()}
        assert cluster.coordinator is not None
        group = cluster.coordinator.pid  # its own session: the CLI process, its DHT process and their p2pd
        # Freeze the coordinator's Python process (its p2pd and DHT process keep the connections up) until a
        # peer's next call — the submission of the round under way — waits on it, then kill the whole group.
        os.kill(group, signal.SIGSTOP)
        try:
            cluster.wait_for(lambda: pending_streams(group) >= 1, 30, "an RPC waiting on the frozen coordinator", poll=0.05)
        finally:
            cluster.signal_group(cluster.coordinator, signal.SIGKILL)
        assert cluster.coordinator.wait(timeout=30) == -signal.SIGKILL
        cluster.wait_for(
            lambda: not [p for p, info in _process_table().items() if info[3] == group and info[1] != "Z"],
            15,
            "the coordinator's DHT process and p2pd to be gone",
        )

        # What survived the crash (exactly what --resume loads), and what the peers were told before it. Read
        # now: nothing can be acknowledged while no coordinator runs; an ack still unread by a peer is simply
        # not in this list (it is checked with all the others at the end).
        durable = durable_state(cluster, tmp_path)  # the snapshot + the write-ahead log replayed
        durable_version = int(durable["version"])
        acked_before = {name: acks(cluster, name) for name in names}
        status_before = cluster.status()

        assert cluster.start_coordinator(resume=True) == address  # same identity, same port, after a SIGKILL
        resumed = of_type(cluster.events(), "start")[-1]
        assert resumed["resumed"] is True and resumed["peer_id"] == coordinator_id
        assert resumed["version"] == durable_version
        restarted_at = resumed["time"]

        def carried_on() -> bool:
            return all(applied_count(cluster, ids[name], after=restarted_at) >= 2 for name in names)

        cluster.wait_for(carried_on, 150, "2 applied updates per peer after the restart")
        for name, process in cluster.peers.items():
            assert process.poll() is None and process.pid == pids[name], f"peer {name} was restarted or died"
        stopping_at = time.time()
        stop_all(cluster)
        events, status = cluster.events(), cluster.status()
        summaries = {name: cluster.peer_summary(name) for name in names}
        acked = {name: acks(cluster, name) for name in names}
        logs = {name: (cluster.workdir / f"{name}.log").read_text(errors="replace") for name in names}

    # (b) no acknowledged update was lost: each one acked before the crash is in the snapshot, at its version
    before = [ack for name in names for ack in acked_before[name]]
    assert before, acked_before
    for lease_id, version, _ in before:
        assert durable["applied"].get(lease_id) == version, (lease_id, version)
    assert max(version for _, version, _ in before) <= durable_version
    assert status_before["version"] <= durable_version  # status.json is written after the snapshot

    # The journal of the killed lifetime may end with updates applied in memory but not yet durable (the
    # kill came before their snapshot, so they were never acked): those are rolled back; the rest of that
    # lifetime is exactly the snapshot's record.
    starts = [i for i, e in enumerate(events) if e["type"] == "start"]
    assert len(starts) == 2, starts
    first_life, second_life = events[starts[0] : starts[1]], events[starts[1] :]
    kept = [e for e in of_type(first_life, "applied") if e["version"] <= durable_version]
    assert {e["lease_id"]: e["version"] for e in kept} == durable["applied"]
    # (a) across the crash: versions 1..V each produced once, no lease applied twice
    version = assert_versions_applied_once(kept + of_type(second_life, "applied"))
    assert status["version"] == version > durable_version
    applied = {e["lease_id"]: e["version"] for e in kept + of_type(second_life, "applied")}
    # ... and every acknowledged update is there exactly once: each lease acked once (a first ack, or a
    # duplicate ack for a resend of bytes applied before the crash), at the version that applied it, and
    # every applied version was acked to its peer.
    every_ack = [ack for name in names for ack in acked[name]]
    assert len({lease_id for lease_id, _, _ in every_ack}) == len(every_ack), every_ack
    assert {lease_id: version for lease_id, version, _ in every_ack} == applied
    assert sum(s["accepted"] for s in summaries.values()) == version
    for name, summary in summaries.items():
        assert summary["accepted"] == len(acked[name]), name
        assert summary["duplicates"] == sum(duplicate for _, _, duplicate in acked[name]), name
        assert summary["accepted"] == status["peers"][ids[name]]["applied"], name
    # the upload cut off by the crash was resent — and no lease was lost: nothing rejected, no peer gave up
    # on a lease, nothing taken back from a peer except a lease it abandoned itself (θ download cut off)
    assert sum(s["resends"] for s in summaries.values()) >= 1, summaries
    cut_off = [
        line for name in names for line in logs[name].splitlines()
        if "failed (" in line or "could not download" in line or "could not get a lease" in line
    ]
    assert cut_off, "no peer saw a call fail at the crash"
    assert not of_type(events, "rejected") and all(s["rejected"] == 0 for s in summaries.values()), summaries
    assert not [name for name in names if "giving up on lease" in logs[name]]
    # (a stopped peer's lease is given back once it stops reporting: left out, the teardown)
    for event in of_type(events, "expired"):
        assert event["time"] >= stopping_at or event["reason"].startswith("peer asked for new work"), event
    # (d) the very same peer processes carried on after the restart
    assert {e["peer"] for e in of_type(second_life, "applied")} == set(ids.values())


@pytest.mark.timeout(180)
def test_resent_submission_is_applied_once(harness: Harness, tmp_path: Path) -> None:
    """Issue 4 item 5, check 6: the same encoded pseudo-gradient submitted twice is applied once."""
    import hivemind

    from asyncloco.transport.codecs import decode, encode
    from asyncloco.transport.rpc import CoordinatorClient, TrafficCounters

    # this client publishes no speed reports: a long report period keeps the coordinator from declaring
    # it gone (3 periods of silence) while it downloads θ and encodes its update
    cluster = harness.cluster(write_config(tmp_path, codec="int8", speed_report_period=30.0))
    with cluster:
        address = cluster.start_coordinator()
        run_id = str(cluster.run_id)
        coordinator_id = address.rsplit("/p2p/", 1)[1]
        counters = TrafficCounters()

        async def scenario() -> dict[str, Any]:
            dht = hivemind.DHT(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
            p2p = None
            try:
                p2p = await dht.replicate_p2p()
                probe = CoordinatorClient(p2p, coordinator_id, 1, namespace=run_id)
                hello = await probe.hello(timeout=30.0)
                numel, codec = hello.model_numel, hello.codec
                client = CoordinatorClient(p2p, coordinator_id, numel, namespace=run_id, counters=counters)
                reply = await client.assign(1000.0, timeout=60.0)
                lease = reply.to_wire().get("lease")
                assert lease is not None, reply
                version, theta = await client.get_model(lease["base_version"])
                pseudo_gradient = 1e-3 * torch.randn(numel, generator=torch.Generator().manual_seed(0))
                encoded = encode(codec, pseudo_gradient)
                first = (await client.submit(lease["lease_id"], lease["base_version"], encoded, timeout=60.0)).to_wire()
                second = (await client.submit(lease["lease_id"], lease["base_version"], encoded, timeout=60.0)).to_wire()
                latest, theta_after = await client.get_model(None)
                return {
                    "numel": numel, "codec": codec, "lease": lease, "version": version, "theta": theta,
                    "sent": decode(encoded, numel), "first": first, "second": second,
                    "latest": latest, "theta_after": theta_after,
                }
            finally:
                if p2p is not None:
                    await p2p.shutdown()
                dht.shutdown()

        result = asyncio.run(asyncio.wait_for(scenario(), timeout=120.0))
        assert cluster.stop_coordinator(timeout=60.0) == 0
        events, status = cluster.events(), cluster.status()

    lease, first, second = result["lease"], result["first"], result["second"]
    assert lease["base_version"] == result["version"] == 0
    assert first["accepted"] is True and first["duplicate"] is False and first["version"] == 1, first
    assert second["accepted"] is True and second["duplicate"] is True and second["version"] == 1, second
    assert result["latest"] == 1 and status["version"] == 1
    assert [e["lease_id"] for e in of_type(events, "applied")] == [lease["lease_id"]]
    assert [e["lease_id"] for e in of_type(events, "duplicate")] == [lease["lease_id"]]
    assert of_type(events, "applied")[0]["version"] == 1
    # θ moved by exactly one Delayed Nesterov step (first arrival, c = 0, N = 3): θ - ε·g/N
    expected = result["theta"] - 0.7 * (result["sent"] / 3)
    torch.testing.assert_close(result["theta_after"], expected, rtol=0, atol=1e-6)
    # both uploads carried the full body; only the first one changed θ
    per_submit = wire_bytes(result["codec"], result["numel"])
    assert counters.submit.payload_bytes_sent == 2 * per_submit
    assert status["traffic"]["submit"]["payload_bytes_received"] == 2 * per_submit
    assert status["peers"] and sum(p["duplicates"] for p in status["peers"].values()) == 1
