"""Watching a run: status.json, ``asyncloco status``, the dashboard server, the summary line, metrics sinks.

The daemon is driven in-process (no network): a lease, a submission, an evaluation, then its status
document is checked field by field against what happened.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.cli import main
from asyncloco.models.workload import load_flat_params
from asyncloco.config import RunConfig
from asyncloco.coordinator.dashboard import DashboardServer, file_source
from asyncloco.coordinator.sinks import TensorBoardSink, WandbSink, build_sinks
from asyncloco.coordinator.status import (
    SubmitTimings,
    History,
    RateMeter,
    fixed,
    format_status,
    peer_row,
    read_status,
    submit_timing_lines,
    summary_line,
)


def small_config(**runtime: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2},
            "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
            "sim": {"workers": 2},
            "runtime": {"verify": {"enabled": False}, **runtime},  # raw submissions, without commitments
        }
    )


# ------------------------------------------------------------------------------------ pieces


def test_rate_meter_counts_the_window_or_the_run_so_far() -> None:
    meter = RateMeter(started=100.0, window=60.0)
    for t in (101.0, 102.0, 103.0):
        meter.note(t)
    assert meter.rate(110.0) == 3 / 10.0  # younger than the window: divided by the run's age
    assert meter.rate(161.5) == 2 / 60.0  # 101 fell out of (101.5, 161.5]
    assert meter.rate(200.0) == 0.0
    assert RateMeter(started=5.0).rate(5.0) == 0.0
    with pytest.raises(ValueError, match="window"):
        RateMeter(0.0, window=0)


def test_history_keeps_one_sample_per_interval_and_thins_out_when_full() -> None:
    history = History(interval=1.0, capacity=4)
    added = [history.add({"time": t}) for t in (0.0, 0.5, 1.0, 2.0, 3.0)]
    assert added == [True, True, False, True, True]  # 1.0 replaced 0.5: the newest sample is always current
    assert [s["time"] for s in history.samples] == [0.0, 1.0, 2.0, 3.0]
    assert history.add({"time": 4.0})  # 5 samples > capacity 4: every other one kept, newest included
    assert [s["time"] for s in history.samples] == [0.0, 2.0, 4.0] and history.interval == 2.0
    assert history.add({"time": 5.0}) and not history.add({"time": 6.0})
    assert [s["time"] for s in history.samples] == [0.0, 2.0, 4.0, 6.0]
    assert history.add({"time": 7.0}) and [s["time"] for s in history.samples] == [0.0, 4.0, 7.0]
    assert history.interval == 4.0


def test_submit_timings_sum_mean_and_largest_per_stage() -> None:
    timings = SubmitTimings()
    assert timings.document() == {"count": 0, "mean_s": dict.fromkeys(SubmitTimings.STAGES, 0.0),
                                  "max_s": dict.fromkeys(SubmitTimings.STAGES, 0.0),
                                  "total_s": dict.fromkeys(SubmitTimings.STAGES, 0.0)}
    timings.add(decode=0.5, lock_wait=1.0, probe=0.0, decide=2.0)
    timings.add(decode=1.5, decide=1.0)  # no lock wait, no probe
    document = timings.document()
    assert document["count"] == 2
    assert document["total_s"] == {"decode": 2.0, "lock_wait": 1.0, "probe": 0.0, "decide": 3.0}
    assert document["mean_s"] == {"decode": 1.0, "lock_wait": 0.5, "probe": 0.0, "decide": 1.5}
    assert document["max_s"] == {"decode": 1.5, "lock_wait": 1.0, "probe": 0.0, "decide": 2.0}
    with pytest.raises(ValueError, match="unknown submission stage"):
        timings.add(fsync=1.0)
    assert timings.count == 2


def test_peer_row_derives_means_and_keeps_raw_counters() -> None:
    row = peer_row({"leases": 4, "steps_assigned": 30, "applied": 3, "staleness_sum": 2, "speed": 7.0}, alive=True, last_seen=9.0)
    assert row == {
        "leases": 4, "steps_assigned": 30, "applied": 3, "staleness_sum": 2, "speed": 7.0,
        "alive": True, "last_seen": 9.0, "steps_per_lease": 7.5, "mean_staleness": 2 / 3,
        "time_split": None,  # no speed report with its time yet (tests/test_link_steps.py)
    }
    assert peer_row({}, alive=False, last_seen=0.0)["steps_per_lease"] == 0.0


FIXTURE: dict[str, Any] = {
    "run_id": "r1",
    "software_version": "0.1.0",
    "method": "async_dn_dylu",
    "speed_unit": "tok/s",
    "version": 7,
    "local_updates": 120,
    "active_leases": 2,
    "updates_per_s": 0.123456,
    "rejections": 1,
    "started": 1000.0,
    "dashboard": None,
    "peers": {
        "QmPeerAAAAAAAAAAAAAAAAAlice1": {
            "name": "alice", "device": "cuda:0", "speed": 1234.5, "leases": 4, "steps_assigned": 40, "applied": 3,
            "staleness_sum": 2, "last_steps": 12, "last_inner_loss": 3.14159, "alive": True, "last_seen": 1095.0,
            "steps_per_lease": 10.0, "mean_staleness": 2 / 3,
        },
        "QmPeerBBBBBBBBBBBBBBBBBBBBBob2": {
            "name": "", "device": "", "speed": 10.0, "leases": 1, "steps_assigned": 1, "applied": 0,
            "staleness_sum": 0, "last_steps": 1, "last_inner_loss": None, "alive": False, "last_seen": 0.0,
            "steps_per_lease": 1.0, "mean_staleness": 0.0,
        },
    },
    "evals": [
        {"time": 1001.0, "version": 0, "local_updates": 0, "loss": 6.0, "perplexity": 403.4287934927351},
        {"time": 1050.0, "version": 5, "local_updates": 90, "loss": 5.0, "perplexity": 148.4131591025766},
    ],
    "history": [{"time": 1000.0, "version": 0, "local_updates": 0, "updates_per_s": 0.0}],
    "updated": 1100.0,
}


def test_fixed_rounds_like_javascript_to_fixed() -> None:
    # the exact binary value decides; a true tie goes up (Python's own format would give "1234" and "0.12")
    assert [fixed(1234.5, 0), fixed(0.125, 2), fixed(2.675, 2), fixed(0.6666, 2), fixed(10.0, 1)] == [
        "1235", "0.13", "2.67", "0.67", "10.0",
    ]
    assert [fixed(None, 2), fixed(float("nan"), 2), fixed(float("inf"), 1), fixed(-0.001, 2), fixed(-0.0, 2)] == [
        "-", "-", "-", "-0.00", "0.00",  # as (-0.001).toFixed(2) and (-0).toFixed(2) in JavaScript
    ]


def test_summary_line_and_status_table_of_a_fixture() -> None:
    assert summary_line(FIXTURE) == (
        "version 7, 0.12 updates/s, val ppl 148.41, 1/2 peers alive, 2 leases in flight, 1 rejections"
    )
    lines = format_status(FIXTURE, now=1100.0).splitlines()
    assert lines[0] == "run r1 (async_dn_dylu), asyncloco 0.1.0, status written 0s ago"
    assert lines[1] == "version 7  local updates 120  updates/s 0.12  validation perplexity 148.41 (at version 5)"
    assert lines[2] == "peers alive 1/2  leases in flight 2  rejections 1"
    assert lines[4].split() == [
        "name", "id", "device", "speed", "tok/s", "DyLU", "steps", "leases", "applied", "mean", "stale", "last", "seen",
        "inner", "loss", "%", "comp/up/down/wait",
    ]
    # unnamed peers first (sorted by name, then id), values in the table's formats (no time split reported: "-")
    assert lines[6].split() == ["-", "BBBBBBBob2", "-", "10", "1", "1", "0", "0.00", "never", "-", "-"]
    assert lines[7].split() == ["alice", "AAAAAlice1", "cuda:0", "1235", "12", "4", "3", "0.67", "5s", "ago", "3.1416", "-"]
    timed = SubmitTimings()
    timed.add(decode=0.25, lock_wait=0.5, probe=0.0, decide=0.125)
    with_timing = format_status({**FIXTURE, "submit_timing": timed.document()}, now=1100.0).splitlines()
    assert with_timing[3] == "submissions 1: 0.875 s each (decode 0.250  lock wait 0.500  probe 0.000  decide 0.125)"
    assert with_timing[4:] == lines[3:]  # and nothing else changes; no line without a submission (above)
    toy = {**FIXTURE, "evals": [{"time": 1.0, "version": 3, "loss": 0.5}], "peers": {}}
    assert "val loss 0.5000" in summary_line(toy)
    assert format_status(toy, now=1100.0).splitlines()[-1] == "(no peer has joined yet)"


# ------------------------------------------------------------------------- the daemon's document


def drive_daemon(tmp_path: Path, **runtime: Any) -> Any:
    """A daemon in-process: two peers, one lease each, one applied submission, one evaluation."""
    from asyncloco.coordinator.daemon import CoordinatorDaemon
    from asyncloco.transport.codecs import encode
    from asyncloco.transport.wire import AssignRequest, SubmitHeader

    daemon = CoordinatorDaemon(small_config(**runtime), checkpoint_dir=tmp_path)

    async def scenario() -> dict[str, Any]:
        daemon.node.stop_event = asyncio.Event()
        lease_a = (await daemon.serving.assign(AssignRequest("lease", tokens_per_s=300.0), "peer-a")).to_wire().get("lease")
        lease_b = (await daemon.serving.assign(AssignRequest("lease", tokens_per_s=100.0), "peer-b")).to_wire().get("lease")
        assert lease_a is not None and lease_b is not None
        # what the peer's join and submission carry (wired in by the peer protocol)
        daemon.monitoring.stats.peer("peer-a").name = "alice"
        daemon.monitoring.stats.peer("peer-a").device = "cpu"
        daemon.monitoring.stats.peer("peer-a").last_inner_loss = 2.5
        update = encode("none", torch.full_like(daemon.node.state.params, 1e-4))  # within the update gate's norm bound
        header = SubmitHeader(lease_a["lease_id"], lease_a["base_version"], "none", update.numel)
        verdict = await daemon.serving.submit(header, update, "peer-a")
        assert verdict.accepted and verdict.version == 1
        await daemon.monitoring.evaluate(daemon.node.state.version, daemon.node.state.local_updates, daemon.node.state.params.clone())
        return {"a": lease_a, "b": lease_b}

    leases = asyncio.run(scenario())
    daemon.monitoring.journal.close()
    return daemon, leases


@pytest.mark.timeout(120)
def test_evaluations_started_together_run_one_at_a_time_in_version_order(tmp_path: Path) -> None:
    """Two evaluations in flight share the coordinator's model: they run one at a time, in the order they started,
    each on its own θ (the first one waits up to 1 s for a second to enter beside it — with the lock none does)."""
    import threading

    from asyncloco.coordinator.daemon import CoordinatorDaemon

    daemon = CoordinatorDaemon(small_config(), checkpoint_dir=tmp_path)
    monitoring = daemon.monitoring
    evaluate = monitoring.workload.evaluate
    inside, most, entered = [0], [0], threading.Event()
    lock = threading.Lock()

    def watched(model: torch.nn.Module) -> dict[str, float]:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            first = inside[0] == 1 and not entered.is_set()
            if inside[0] > 1:
                entered.set()
        if first:
            entered.wait(1.0)  # a second evaluation beside this one would set it
        try:
            return evaluate(model)
        finally:
            with lock:
                inside[0] -= 1

    monitoring.workload.evaluate = watched  # type: ignore[method-assign]
    theta = daemon.node.state.params.clone()
    other = theta + 0.5

    async def both() -> None:
        first = asyncio.create_task(monitoring.evaluate(4, 40, theta.clone()))
        second = asyncio.create_task(monitoring.evaluate(6, 60, other.clone()))
        await asyncio.gather(first, second)

    asyncio.run(both())
    monitoring.journal.close()
    assert most[0] == 1 and not entered.is_set()
    assert [e["version"] for e in monitoring.stats.evals] == [4, 6]
    alone = []
    for vector in (theta, other):
        model = monitoring.eval_model()
        load_flat_params(model, vector)
        alone.append(evaluate(model)["loss"])
    assert [e["loss"] for e in monitoring.stats.evals] == alone


@pytest.mark.timeout(120)
def test_status_json_carries_everything_the_table_shows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asyncloco.coordinator"):
        daemon, leases = drive_daemon(tmp_path)
    # a lease or an applied update is a DEBUG line now, not INFO
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and r.getMessage().startswith(("lease ", "applied "))]
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == daemon.monitoring.stats.document and (tmp_path / "status.json").read_bytes() == daemon.monitoring.stats.document_json
    assert status["version"] == 1 and status["local_updates"] == leases["a"]["steps"]
    assert status["active_leases"] == 1 and status["rejections"] == 0
    assert status["software_version"] and status["speed_unit"] == "samples/s"
    # one update applied since the daemon started, younger than the 60 s window
    assert status["updates_per_s"] == 1 / (status["updated"] - status["started"])
    assert status["evals"][-1]["version"] == 1 and status["history"][-1]["version"] == 1
    a, b = status["peers"]["peer-a"], status["peers"]["peer-b"]
    assert (a["name"], a["device"], a["last_inner_loss"], a["alive"]) == ("alice", "cpu", 2.5, True)
    assert (a["leases"], a["applied"], a["last_steps"], a["steps_per_lease"]) == (1, 1, leases["a"]["steps"], leases["a"]["steps"])
    assert a["mean_staleness"] == 0.0 and a["speed"] == daemon.node.state.peers["peer-a"].speed
    assert status["started"] <= a["last_seen"] <= status["updated"]
    assert (b["name"], b["last_inner_loss"], b["leases"], b["applied"]) == ("", None, 1, 0)
    assert b["last_steps"] == leases["b"]["steps"] and leases["a"]["steps"] > leases["b"]["steps"]  # DyLU: 3× faster


@pytest.mark.timeout(120)
def test_status_command_reads_a_checkpoint_dir_and_a_live_dashboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    daemon, _ = drive_daemon(tmp_path)
    document = json.loads((tmp_path / "status.json").read_text())

    assert main(["status", "--checkpoint-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == document
    assert main(["status", "--checkpoint-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].startswith("version 1  local updates ")
    # the one submission's timing line (the update applied), then the peers' table
    assert document["submit_timing"]["count"] == 1 and table[3] == submit_timing_lines(document["submit_timing"])[0]
    assert [line.split()[:4] for line in table[7:9]] == [
        ["-", "peer-b", "-", f"{document['peers']['peer-b']['speed']:.0f}"],
        ["alice", "peer-a", "cpu", f"{document['peers']['peer-a']['speed']:.0f}"],
    ]

    with DashboardServer(lambda: daemon.monitoring.stats.document_json) as server:
        assert read_status(url=server.url) == document
        assert main(["status", "--url", server.url.rstrip("/"), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == document


def test_status_errors_name_the_problem_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="status.json does not exist: pass the coordinator's runtime.checkpoint_dir"):
        read_status(checkpoint_dir=tmp_path)
    (tmp_path / "status.json").write_text("{half")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_status(checkpoint_dir=tmp_path)
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValueError, match="is the coordinator running with --dashboard-port"):
        read_status(url=f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(ValueError, match="must start with http://"):
        read_status(url="127.0.0.1:8080")
    assert main(["status", "--checkpoint-dir", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------- dashboard server


def test_dashboard_serves_the_page_and_the_status_bytes(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text(json.dumps(FIXTURE))
    with DashboardServer(file_source(path)) as server:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(server.url) as response:
            page = response.read().decode()
        assert response.headers["Content-Type"] == "text/html; charset=utf-8"
        assert 'id="chart-ppl-time"' in page and "fetch(\"status.json\"" in page and "http" not in page.split("<script>")[1].replace(
            "http://www.w3.org/2000/svg", ""
        )  # no external resource
        with urllib.request.urlopen(server.url + "status.json?t=1") as response:
            assert response.read() == path.read_bytes()
        host, port = server.url[len("http://") :].rstrip("/").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("GET", "/secrets")
        assert connection.getresponse().status == 404
        connection.close()
        with pytest.raises(ValueError, match="choose another --dashboard-port"):
            DashboardServer(file_source(path), port=int(port)).start()
        path.unlink()
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("GET", "/status.json")
        assert connection.getresponse().status == 503
        connection.close()
    with pytest.raises(ValueError, match="0..65535"):
        DashboardServer(file_source(path), port=70000)


def test_dashboard_config_and_cli_flags() -> None:
    cfg = small_config(dashboard_port=0, log_to=["tensorboard"], summary_every=5)
    assert (cfg.runtime.dashboard_port, cfg.runtime.dashboard_host, cfg.runtime.log_to) == (0, "127.0.0.1", ["tensorboard"])
    assert small_config().runtime.dashboard_port is None and small_config().runtime.log_to == []  # off by default
    with pytest.raises(ValueError, match="log_to"):
        small_config(log_to=["mlflow"])
    from asyncloco.cli import build_parser

    args = build_parser().parse_args(["coordinator", "--config", "demo", "--dashboard-port", "8080", "--dashboard-host", "0.0.0.0"])
    assert (args.dashboard_port, args.dashboard_host) == (8080, "0.0.0.0")


# ------------------------------------------------------------------- summary line and sinks


class FakeWriter:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.scalars: list[tuple[str, float, int, float]] = []
        self.closed = False

    def add_scalar(self, tag: str, value: float, global_step: int, walltime: float) -> None:
        self.scalars.append((tag, value, global_step, walltime))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_tensorboard_sink_logs_evals_at_their_version_and_run_scalars(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "tb", writer_factory=FakeWriter)
    writer = sink.writer
    assert isinstance(writer, FakeWriter) and writer.log_dir == str(tmp_path / "tb")
    sink.log_eval({"time": 50.0, "version": 5, "local_updates": 90, "loss": 5.0, "perplexity": 148.4})
    sink.log_run({"updates_per_s": 0.5, "peers_alive": 2.0}, step=7, wall_time=60.0)
    sink.close()
    assert writer.scalars == [
        ("eval/local_updates", 90.0, 5, 50.0),
        ("eval/loss", 5.0, 5, 50.0),
        ("eval/perplexity", 148.4, 5, 50.0),
        ("run/updates_per_s", 0.5, 7, 60.0),
        ("run/peers_alive", 2.0, 7, 60.0),
    ]
    assert writer.closed


def test_wandb_sink_through_a_stand_in_module(tmp_path: Path) -> None:
    calls: list[tuple[str, Any]] = []

    class Run:
        def log(self, values: dict[str, float]) -> None:
            calls.append(("log", values))

        def finish(self) -> None:
            calls.append(("finish", None))

    class Module:
        @staticmethod
        def init(**kwargs: Any) -> Run:
            calls.append(("init", kwargs))
            return Run()

    sink = WandbSink("r1", {"seed": 0}, tmp_path / "wandb", module=Module)
    sink.log_eval({"time": 1.0, "version": 3, "loss": 0.25})
    sink.log_run({"updates_per_s": 2.0}, step=4, wall_time=2.0)
    sink.close()
    assert calls == [
        ("init", {"project": "asyncloco", "name": "r1", "config": {"seed": 0}, "dir": str(tmp_path / "wandb")}),
        ("log", {"eval/loss": 0.25, "version": 3}),
        ("log", {"run/updates_per_s": 2.0, "version": 4}),
        ("finish", None),
    ]


def test_sinks_are_optional_and_a_missing_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_sinks([], tmp_path, "r1", {}) == []
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"'tensorboard' package is not installed: `pip install tensorboard`"):
        build_sinks(["tensorboard"], tmp_path, "r1", {})
    with pytest.raises(ValueError, match=r"`pip install wandb`, or remove 'wandb' from runtime.log_to"):
        build_sinks(["wandb"], tmp_path, "r1", {})
    with pytest.raises(ValueError, match="unknown metrics sink 'mlflow'"):
        build_sinks(["mlflow"], tmp_path, "r1", {})


@pytest.mark.timeout(120)
def test_monitor_loop_logs_a_summary_line_and_feeds_the_sinks(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    daemon, _ = drive_daemon(tmp_path, summary_every=0.5)
    writer = FakeWriter(str(tmp_path))
    sink = TensorBoardSink(tmp_path, writer_factory=lambda _: writer)
    daemon.monitoring.stats.sinks = [sink]
    daemon.monitoring.stats.evals_logged = 0  # the sink has seen no evaluation yet

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.monitoring.loop(stop))
        deadline = asyncio.get_running_loop().time() + 60
        while not any(r.getMessage().startswith("version 1, ") for r in caplog.records):
            assert asyncio.get_running_loop().time() < deadline, "no summary line within 60 s"
            await asyncio.sleep(0.05)  # polling the condition, not synchronising on time
        stop.set()
        await task

    with caplog.at_level(logging.INFO, logger="asyncloco.coordinator"):
        asyncio.run(scenario())
    line = next(r for r in caplog.records if r.getMessage().startswith("version 1, "))
    assert line.levelno == logging.INFO
    assert "2/2 peers alive, 1 leases in flight, 0 rejections" in line.getMessage()
    tags = [s[0] for s in writer.scalars]
    assert tags[:2] == ["eval/local_updates", "eval/loss"] and [s[2] for s in writer.scalars[:2]] == [1, 1]
    run = {s[0]: s[1] for s in writer.scalars if s[0].startswith("run/")}
    assert run["run/peers_alive"] == 2.0 and run["run/active_leases"] == 1.0 and run["run/rejections"] == 0.0


# ------------------------------------------------------------------ a real coordinator process


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_live_coordinator_serves_its_dashboard_and_logs_summaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncloco coordinator --dashboard-port 0`` with one peer: the dashboard serves exactly status.json,
    ``asyncloco status --url`` reads it, the log has summary lines (no INFO line per event), and the port
    closes at shutdown. No process outlives the test (the integration harness checks)."""
    from test_integration_runtime import TAG_VAR, Harness, _process_table, leftovers, write_config
    import time
    import uuid

    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_VAR, tag)
    before = set(_process_table())
    harness = Harness(tmp_path, tag)
    try:
        cluster = harness.cluster(write_config(tmp_path, codec="none", summary_every=1.0))
        cluster.start_coordinator(extra=("--dashboard-port", "0"))
        url = cluster.status()["dashboard"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        cluster.start_peer("p0")
        cluster.wait_for(lambda: read_status(url=url)["version"] >= 1, 180, "an applied update, seen through the dashboard")

        def same_document() -> Any:  # a status.json not rewritten while the dashboard was read, and served as is
            first = (cluster.checkpoint_dir / "status.json").read_bytes()
            served = read_status(url=url)
            unchanged = (cluster.checkpoint_dir / "status.json").read_bytes() == first
            return served if unchanged and served == json.loads(first) else None

        # the dashboard serves status.json as it is on disk (same_document compared them; a later re-read could
        # see the next rewrite)
        served = cluster.wait_for(same_document, 60, "the dashboard serving status.json as it is on disk", poll=0.05)
        (peer_id, row), = served["peers"].items()
        assert row["alive"] and row["leases"] >= 1 and row["applied"] >= 1 and row["last_steps"] >= 1
        assert served["updates_per_s"] > 0 and served["speed_unit"] == "tok/s"
        assert main(["status", "--url", url]) == 0
        out = capsys.readouterr().out
        assert f"{peer_id[-10:]}" in out and "validation perplexity" in out

        log = (cluster.workdir / "coordinator.log").read_text()
        assert f"Dashboard: {url}" in log
        cluster.wait_for(
            lambda: re.search(r"INFO \[asyncloco\.coordinator\.[a-z_]+\] version \d+, [0-9.]+ updates/s, ",
                              (cluster.workdir / "coordinator.log").read_text()),
            60, "a summary line in the coordinator's log",
        )
        for name, process in cluster.peers.items():
            assert cluster.stop(process, timeout=60.0) == 0, name
        assert cluster.stop_coordinator(timeout=60.0) == 0
        log = (cluster.workdir / "coordinator.log").read_text()
        assert not re.search(r"INFO \[asyncloco\.coordinator\.[a-z_]+\] (applied|lease) ", log)
        with pytest.raises(ValueError, match="could not read"):
            read_status(url=url, timeout=5)
    finally:
        for cluster in harness.clusters:
            cluster.close()
    deadline = time.monotonic() + 15.0
    while (left := leftovers(before, harness.sessions(), tag)) and time.monotonic() < deadline:
        time.sleep(0.2)  # p2pd of a cleanly stopped process exits within a second or two
    assert not left, f"processes left behind by the test: {left}"
