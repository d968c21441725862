"""Real multi-process runs on 127.0.0.1: a coordinator daemon and peers as separate processes.

Every test starts its processes through :class:`~asyncloco.local_cluster.LocalCluster` (each process in its
own session, ports chosen by the OS), waits only on conditions with deadlines (``cluster.wait_for``), and
checks after teardown that nothing it started is still alive — no p2pd, no Python child. The model is the
``tiny`` preset on 8 x 64 tokens per step, ~30 ms a step on a loaded 2-core machine; peers emulate slower
devices with ``--slowdown`` (a round then takes that many times as long).

These two prove that real processes on a real network work; the behaviour around failures — a peer killed
mid-round (fail-stop), a resent submission, a coordinator crash at each point of its decision path — is
tested in-process under a fake clock in tests/test_inprocess_runtime.py, and the SIGKILL of the
coordinator's main process in tests/test_crash_replay.py. What each pins:

* ``test_three_peers_learn_follow_dylu_and_send_exact_bytes`` — the version advances one applied update at
  a time and validation loss falls; every lease's step count is DyLU (paper Eq. 6) of the speeds the
  coordinator held at that moment, and a ``--slowdown 4`` peer gets about a quarter of the fast peer's
  steps; pseudo-gradient bytes on the wire are exactly ``accepted × wire_bytes("int8", numel)`` on each
  peer and their sum on the coordinator.
* ``test_coordinator_restart_resumes_and_peers_carry_on`` — SIGTERM + ``--resume``: same peer id and
  address, no version regression, every version applied exactly once across the restart, and the very same
  peer processes get new updates applied; every applied update was acknowledged to its peer exactly once.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

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
    """On one run: coordinator + peers with slowdowns 1, 4, 4, codec int8."""
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
    assert status["version"] == version >= 15, ("status.json's version vs applied events", status["version"], version)
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
    # ... and a 4x slower peer gets fewer steps than the fast one. What the logic guarantees is the Eq. 6 check
    # above, exactly, for every lease; the speeds themselves are measured, so the ratio of steps depends on the
    # machine's load (ideal 0.25: 5 of 20; 0.16-0.23 at load 3-5, and 0.105 was seen with the 2 cores
    # oversubscribed: the slow peers' few steps always run while the fast peer trains too). So only what no
    # load can change is asserted: DyLU is on (off, or an inverted or ignored slowdown, gives >= 1.0; a halved
    # one 0.5), and never below min_steps / H = 0.05. Left out: each peer's first two leases (issued from the
    # start-up measurement, taken while the others still imported torch, or before the fast peer had
    # reported) and leases issued once the peers were being stopped (a departed fastest peer no longer sets
    # the max, by design).
    def steps_of(name: str) -> list[int]:
        return [e["steps"] for e in assigns if e["peer"] == ids[name] and e["issued_at"] < stopping_at][2:]

    slow_steps = steps_of("slow1") + steps_of("slow2")
    fast_steps = steps_of("fast")
    ratio = (sum(slow_steps) / len(slow_steps)) / (sum(fast_steps) / len(fast_steps))
    assert 1 / H <= ratio < 0.5, (ratio, slow_steps, fast_steps)

    # 3. bytes on the wire: exactly the codec's size per accepted submission, on both ends
    per_submit = wire_bytes("int8", numel)
    received = status["traffic"]["submit"]["payload_bytes_received"]
    for name, summary in summaries.items():
        assert summary["rejected"] == 0 and summary["duplicates"] == 0 and summary["resends"] == 0, summary
        assert summary["traffic"]["submit"]["payload_bytes_sent"] == summary["accepted"] * per_submit, name
        assert summary["accepted"] == status["peers"][ids[name]]["applied"], (name, summary, status["peers"][ids[name]])
    assert received == sum(s["traffic"]["submit"]["payload_bytes_sent"] for s in summaries.values())
    assert received == version * per_submit


@pytest.mark.timeout(300)
def test_coordinator_restart_resumes_and_peers_carry_on(harness: Harness, tmp_path: Path) -> None:
    """SIGTERM the coordinator, restart it with --resume, peers keep running.

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
        coordinator_log = (cluster.workdir / "coordinator.log").read_text(errors="replace")

    version = assert_versions_applied_once(events)  # across both coordinator lifetimes, no version twice
    assert "download anchor(s) loaded from" in coordinator_log  # the int8 downloads' anchors survived the restart
    assert status["version"] == version > version_before
    after = [e for e in of_type(events, "applied") if e["time"] > restarted_at]
    assert min(e["version"] for e in after) == version_before + 1
    assert {e["peer"] for e in after} == set(ids.values())
    # the restart refused nothing: no lease unknown, expired or stale after it. (The update gate's judgement of an
    # update is not the restart's doing: a fresh-venv run saw the probe refuse one honest short lease here, +0.47 %
    # against a 0.05 % margin; the gate's honest-refusal rate is measured by the attack benchmark.)
    # A check held across the restart whose θ came as an int8 delta re-runs from the anchor the download service kept
    # on disk (download-anchors/, loaded back by --resume) and passes like any other: no held update is dropped.
    refused = [e for e in of_type(events, "rejected") if not e["reason"].startswith("update gate:")]
    assert not refused, refused
    assert not [e for e in of_type(events, "unverified") if "no longer held" in e["reason"]]
    verdicts = of_type(events, "verdict")
    assert verdicts and all(v["ok"] for v in verdicts), verdicts  # the probation checks of three peers at least
    # Every applied update reached its peer as exactly one ack: a first ack, or — if the coordinator went
    # down between applying and answering — a duplicate ack for the resent bytes.
    for name, summary in summaries.items():
        firsts = summary["accepted"] - summary["duplicates"]
        assert firsts + summary["duplicates"] == status["peers"][ids[name]]["applied"], (name, summary)
    assert sum(s["accepted"] for s in summaries.values()) == version
    # evaluations from before the restart are kept and continue
    assert [e["version"] for e in status["evals"]][0] == 0
    assert any(e["version"] > version_before for e in status["evals"])


@pytest.mark.timeout(300)
def test_swarm_peers_take_theta_from_the_seed_and_each_other(harness: Harness, tmp_path: Path) -> None:
    """The θ swarm in real processes: ``asyncloco coordinator`` starts the swarm's seed (transport/swarm.py), two
    ``peer join --swarm --serve`` peers take every θ body from the swarm, verified chunk by chunk, and the
    coordinator's ``get_model`` sends no body at all (it answers "unchanged" and records the fetch); training goes
    on; status.json lists the serving peers per version."""
    cluster = harness.cluster(write_config(tmp_path, codec="int8"))
    with cluster:
        cluster.start_coordinator()
        names = ["a", "b"]
        for name in names:
            cluster.start_peer(name, extra=("--swarm", "--serve"))
        ids = peer_ids(cluster, names)
        cluster.wait_for(lambda: len(of_type(cluster.events(), "applied")) >= 6, 180, "6 applied updates")
        stop_all(cluster)
        status, events = cluster.status(), cluster.events()
        summaries = {name: cluster.peer_summary(name) for name in names}

    version = assert_versions_applied_once(events)
    assert version >= 6
    for name, summary in summaries.items():
        assert summary["swarm_fallbacks"] == 0 and summary["swarm_downloads"] >= 1, (name, summary)
        assert summary["accepted"] == status["peers"][ids[name]]["applied"], (name, summary, status["peers"][ids[name]])
    # every body came through the swarm: the coordinator's get_model sent none, its seed sent the chunks
    assert status["traffic"]["get_model"]["payload_bytes_sent"] == 0, status["traffic"]
    assert status["traffic"]["get_model"]["calls"] >= sum(s["swarm_downloads"] for s in summaries.values())
    swarm = status["swarm"]
    assert swarm["seed_chunks_sent"] >= 1 and swarm["seed_bytes_sent"] > 0, swarm
    served = {holder for body in swarm["bodies"] for holder in body["holders"]}
    assert served <= set(ids.values()) and served, swarm
    assert not swarm["reports"] and not of_type(events, "swarm_report")
    # every chunk a peer used was sent by the seed or by the other peer (their summaries count what they served)
    (chunks,) = {body["chunks"] for body in swarm["bodies"]}  # one codec, one size: every body has as many chunks
    by_peers = sum(s["swarm_chunks_served"] for s in summaries.values())
    assert swarm["seed_chunks_sent"] + by_peers >= chunks * sum(s["swarm_downloads"] for s in summaries.values())
    assert all(s["swarm_bytes_served"] >= s["swarm_chunks_served"] > 0 or s["swarm_chunks_served"] == 0
               for s in summaries.values()), summaries


@pytest.mark.timeout(300)
def test_a_peer_started_before_its_coordinator_waits_and_joins(harness: Harness, tmp_path: Path) -> None:
    """``peer join`` while the coordinator is down (not up yet, or restarting) waits with backoff,
    saying what it waits for, and joins when the coordinator comes up; with a short ``--join-timeout`` it gives
    up with a clear one-line error and exit 2."""
    cluster = harness.cluster(write_config(tmp_path, codec="int8"))
    with cluster:
        address = cluster.start_coordinator()  # its identity and port exist from here on
        assert cluster.stop_coordinator(timeout=60.0) == 0
        quitter = cluster.start_peer("quitter", extra=("--join-timeout", "2"))
        early = cluster.start_peer("early", extra=("--join-timeout", "240"))
        log = cluster.workdir / "early.log"
        cluster.wait_for(lambda: log.read_text().count("waiting for the coordinator at") >= 3, 120,
                         "the early peer to wait through three attempts")
        cluster.wait_for(lambda: quitter.poll() is not None, 120, "the quitter to give up")
        assert cluster.start_coordinator(resume=True) == address
        ids = peer_ids(cluster, ["early"])
        cluster.wait_for(lambda: applied_count(cluster, ids["early"]) >= 1, 180, "an update of the early peer applied")
        assert cluster.stop(early, timeout=60.0) == 0
        assert cluster.stop_coordinator(timeout=60.0) == 0
    assert quitter.returncode == 2
    said = (cluster.workdir / "quitter.log").read_text()
    assert "Traceback" not in said
    [line] = [x for x in said.splitlines() if x.startswith("asyncloco: error:")]
    assert "could not join the DHT through" in line and "--join-timeout)" in line and "gave up after" in line, line
    assert "waiting for the coordinator at " + address in log.read_text()


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_coordinator_sigkilled_during_a_peers_start_up_comes_back_and_the_peer_joins(harness: Harness, tmp_path: Path) -> None:
    """The coordinator dies by SIGKILL (it and its p2pd, no snapshot, no goodbye) while a peer is
    still starting (its process launched, no lease given to it yet). The peer waits with backoff, the
    coordinator resumes from its write-ahead log at the same address, and the peer joins and has an update
    applied — the same peer process throughout."""
    cluster = harness.cluster(write_config(tmp_path, codec="int8"))
    with cluster:
        address = cluster.start_coordinator()
        killed = cluster.coordinator
        assert killed is not None
        peer = cluster.start_peer("starting", extra=("--join-timeout", "300"))
        cluster.signal_group(killed, signal.SIGKILL)  # the peer is still importing its libraries here
        assert killed.wait(timeout=30) == -signal.SIGKILL
        assert not of_type(cluster.events(), "assign")  # no lease was given out before the crash
        log = cluster.workdir / "starting.log"
        cluster.wait_for(lambda: "waiting for the coordinator at" in log.read_text(), 180,
                         "the starting peer to wait for its coordinator")
        assert peer.poll() is None
        assert cluster.start_coordinator(resume=True) == address
        ids = peer_ids(cluster, ["starting"])
        cluster.wait_for(lambda: applied_count(cluster, ids["starting"]) >= 1, 180, "an update of the peer applied")
        assert cluster.peers["starting"] is peer and peer.poll() is None  # it never exited and restarted
        assert cluster.stop(peer, timeout=60.0) == 0
        assert cluster.stop_coordinator(timeout=60.0) == 0
    assert "Traceback" not in log.read_text()
