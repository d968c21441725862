"""Leases sized to the link (``schedule.local_steps: auto``, docs/algorithm.md) and the per-peer time split.

The rule, closed form (algo/dylu.py ``link_steps``):

    H = min(H_max, max(H_dylu, ceil(k · (t_up + m · t_down) / t_step)))

with t_up = upload bytes / the peer's measured upload rate, t_down likewise for a θ download, m = 1.5 the ask-ahead
margin (an overlapped lease covers the previous upload and the next lease's ask-ahead lead), t_step = units per
step / its speed. Pinned with exact values: the rule itself; the logic's leases for peers with reported links (and
DyLU's steps unchanged where transfers are negligible, or where ``local_steps`` is ``fixed``); the fallbacks (the
coordinator's measured upload time, the bytes' ratio); the status split of a peer's time (coordinator/status.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.dylu import ASK_AHEAD_MARGIN, link_steps, pipeline_seconds
from asyncloco.algo.outer import OuterNesterov, OuterSGD
from asyncloco.config import RunConfig
from asyncloco.coordinator.logic import (
    Applied,
    Assign,
    CoordinatorPolicy,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    handle,
    new_state,
)
from asyncloco.coordinator.status import format_status, peer_row, time_split
from asyncloco.peer.summary import PeerSummary
from asyncloco.peer.summary import time_split as summary_split
from asyncloco.transport.link import LinkReport

pytestmark = pytest.mark.timeout(30)


def test_the_rule_in_closed_form() -> None:
    # 14 s on the wire, 0.1 s a step: ceil(1 × 14 / 0.1) = 140 steps, above DyLU's 20, below H_max 200
    assert link_steps(20, 14.0, 0.1, 1.0, 200) == 140
    assert link_steps(20, 14.0, 0.1, 1.5, 200) == 210 - 10  # k = 1.5 wants 210: capped at H_max = 200
    assert link_steps(20, 14.0, 0.1, 1.5, 500) == 210
    assert link_steps(20, 1.0, 0.1, 1.0, 200) == 20  # negligible transfers (10 steps' worth): DyLU's H unchanged
    assert link_steps(20, 2.0, 0.1, 1.0, 200) == 20  # exactly covered: 20 (no float noise makes it 21)
    assert link_steps(20, 2.01, 0.1, 1.0, 200) == 21
    assert link_steps(7, 0.0, 0.1, 1.0, 200) == 7
    assert link_steps(7, float("nan"), 0.1, 1.0, 200) == 7  # nothing usable measured: DyLU's
    # what an overlapped lease must cover: the previous upload and the ask-ahead lead of the next (the peer's margin)
    from asyncloco.peer.pipeline import AHEAD_MARGIN

    assert ASK_AHEAD_MARGIN == AHEAD_MARGIN == 1.5 and pipeline_seconds(10.0, 4.0) == 16.0


def policy(**overrides: object) -> CoordinatorPolicy:
    base: dict[str, object] = dict(max_local_steps=20, min_steps=1, grace_period=0.0, units_per_step=100,
                                   lease_timeout_factor=3.0, lease_slack=5.0, link_steps=True, transfer_cover=1.0,
                                   max_auto_steps=200, upload_bytes=1_000_000, download_bytes=4_000_000)
    base.update(overrides)
    return CoordinatorPolicy(**base)  # type: ignore[arg-type]


def steps_for(pol: CoordinatorPolicy, reports: list[SpeedReport], peer: str) -> tuple[int, str]:
    state = new_state(torch.zeros(4), OuterSGD(0.5), (), pol, (100_000,), 0)
    for report in reports:
        handle(state, report, 0.0)
    _, actions = handle(state, RequestWork(peer), 1.0)
    assign = next(a for a in actions if isinstance(a, Assign))
    return assign.lease.steps, assign.reason


def test_the_logic_sizes_a_lease_to_its_peers_link() -> None:
    # "slow": 1000 units/s, 100 units a step: t_step = 0.1 s; uploads 1 MB at 100 kB/s (10 s), downloads 4 MB at
    # 1 MB/s (4 s): 10 s + 1.5 × 4 s = 16 s to cover → 160 steps. "fast" (2000 units/s) sets DyLU's scale: the slow
    # one's DyLU steps are 10
    reports = [SpeedReport("fast", 2000.0), SpeedReport("slow", 1000.0, link_up=100_000.0, link_down=1_000_000.0)]
    steps, reason = steps_for(policy(), reports, "slow")
    assert steps == 160 and "160 to cover 16 s of transfers (k = 1)" in reason
    # k = 2: 320, capped at H_max 200
    assert steps_for(policy(transfer_cover=2.0), reports, "slow")[0] == 200
    # local_steps: fixed — DyLU's steps, whatever the link
    assert steps_for(policy(link_steps=False), reports, "slow")[0] == 10
    # a fast link: 1 MB at 10 MB/s + 1.5 × 4 MB at 40 MB/s = 0.25 s, 3 steps' worth < DyLU's 10: the paper's rule unchanged
    quick = [SpeedReport("fast", 2000.0), SpeedReport("slow", 1000.0, link_up=1e7, link_down=4e7)]
    assert steps_for(policy(), quick, "slow")[0] == 10
    # the fastest peer, no link reported and no upload measured yet: H
    assert steps_for(policy(), reports, "fast")[0] == 20
    # a reported upload rate without a download rate: the download is the upload's time × the bytes' ratio (4):
    # 10 s + 1.5 × 40 s = 70 s → 700 steps, capped at 200; with H_max 1000: 700
    up_only = [SpeedReport("fast", 2000.0), SpeedReport("slow", 1000.0, link_up=100_000.0)]
    assert steps_for(policy(download_upload_ratio=4.0), up_only, "slow")[0] == 200
    assert steps_for(policy(download_upload_ratio=4.0, max_auto_steps=1000), up_only, "slow")[0] == 700
    # before its first upload, only a download rate: the upload at that rate (a lower bound on a home link's):
    # 1 MB at 1 MB/s + 1.5 × 4 MB at 1 MB/s = 7 s → 70 steps
    down_only = [SpeedReport("fast", 2000.0), SpeedReport("slow", 1000.0, link_down=1_000_000.0)]
    steps, reason = steps_for(policy(), down_only, "slow")
    assert steps == 70 and "70 to cover 7 s of transfers" in reason


def test_a_long_lease_s_update_decays_the_outer_momentum_by_its_steps() -> None:
    """``outer.long_lease_momentum: scaled``: the logic hands the outer optimizer each update's lease steps, so the
    slow peer's 160-step update (H = 20) decays Nesterov's momentum by 0.9^(160/20), the fast peer's 20-step one by 0.9."""
    pol = policy()
    state = new_state(torch.zeros(4), OuterNesterov(1.0, 0.9, reference_steps=20), (), pol, (100_000,), 0)
    handle(state, SpeedReport("fast", 2000.0), 0.0)
    handle(state, SpeedReport("slow", 1000.0, link_up=100_000.0, link_down=1_000_000.0), 0.0)
    leases = {}
    for peer in ("fast", "slow"):
        _, actions = handle(state, RequestWork(peer), 1.0)
        leases[peer] = next(a for a in actions if isinstance(a, Assign)).lease
    assert (leases["fast"].steps, leases["slow"].steps) == (20, 160)
    g_fast, g_slow = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])
    for peer, g in (("fast", g_fast), ("slow", g_slow)):
        _, actions = handle(state, SubmitUpdate(peer, leases[peer].lease_id, 0, g.clone()), 2.0)
        assert any(isinstance(a, Applied) for a in actions)
    assert isinstance(state.optimizer, OuterNesterov) and state.optimizer.momentum_buffer is not None
    torch.testing.assert_close(state.optimizer.momentum_buffer, 0.9**8 * g_fast + g_slow)


def test_a_lease_request_states_the_link_rates_it_measured() -> None:
    """The link rates travel with the lease request too (transport/wire.py AssignRequest, bounded like a DHT record's):
    the lease asked for right after a peer's first θ download — before its DHT record is read — is sized by them."""
    from asyncloco.transport.errors import MessageError
    from asyncloco.transport.wire import AssignRequest

    request = AssignRequest("lease", tokens_per_s=1000.0, link_up=2.5e5, link_down=1e6)
    assert AssignRequest.from_wire(request.to_wire()) == request
    for bad in (float("nan"), -1.0, 1e16):
        with pytest.raises(MessageError, match="link_down"):
            AssignRequest("lease", link_down=bad)
    state = new_state(torch.zeros(4), OuterSGD(0.5), (), policy(), (100_000,), 0)
    handle(state, SpeedReport("fast", 2000.0), 0.0)
    handle(state, SpeedReport("slow", 1000.0), 0.0)  # no link in its record (yet)
    _, actions = handle(state, RequestWork("slow", link_down=1_000_000.0), 1.0)
    assert next(a for a in actions if isinstance(a, Assign)).lease.steps == 70  # 1 MB + 1.5 × 4 MB at 1 MB/s (above)
    assert state.peers["slow"].link_down == 1_000_000.0 and state.peers["slow"].link_up is None


def test_link_sizing_caps_the_claim_by_the_looser_link_factor() -> None:
    """Untrusted speeds: DyLU counts a claim up to 1.5 × the delivered throughput, but sizing to the link counts it up to
    ``link_speed_cap_factor`` (4) × — a pipelined peer on a slow link delivers at its link's pace."""
    reports = [SpeedReport("fast", 2000.0), SpeedReport("slow", 1000.0, link_up=100_000.0, link_down=1_000_000.0)]
    pol = policy(trust_speeds=False)
    state = new_state(torch.zeros(4), OuterSGD(0.5), (), pol, (100_000,), 0)
    for report in reports:
        handle(state, report, 0.0)
    for name in ("fast", "slow"):
        state.peers[name].observed = 200.0  # delivered 200 units/s: DyLU counts 300, the link sizing 800
    state.peers["fast"].observed = 2000.0
    _, actions = handle(state, RequestWork("slow"), 1.0)
    lease = next(a for a in actions if isinstance(a, Assign)).lease
    assert lease.steps == 128  # 16 s to cover / (100 units / 800 units/s) = 128 (at 300 units/s: 48)
    # a claim below 4 × delivered counts whole
    state.peers["slow"].observed = 400.0
    _, actions = handle(state, RequestWork("slow"), 2.0)
    assert next(a for a in actions if isinstance(a, Assign)).lease.steps == 160


def test_the_config_key_and_its_bounds() -> None:
    cfg = RunConfig.model_validate({"schedule": {"local_steps": "auto", "max_local_steps": 30}})
    assert cfg.schedule.local_steps == "auto" and cfg.schedule.auto_steps_cap == 300 and cfg.schedule.transfer_cover == 1.0
    assert RunConfig.model_validate({}).schedule.local_steps == "fixed"
    with pytest.raises(ValueError, match="max_auto_steps"):
        RunConfig.model_validate({"schedule": {"local_steps": "auto", "max_local_steps": 30, "max_auto_steps": 20}})
    from asyncloco.coordinator.methods import build_method, coordinator_policy

    spec, _, _ = build_method(cfg.schedule.method, cfg.outer, 4, [(0, 2)])
    pol = coordinator_policy(cfg, spec, 64, simulated=False, numel=2)
    assert pol.link_steps and pol.max_auto_steps == 300 and pol.transfer_cover == 1.0


def test_speed_reports_carry_the_link_and_the_time_split_into_status() -> None:
    summary = PeerSummary()
    summary.timing = {"train": 90.0, "upload": 5.0, "download": 3.0, "assign": 1.5}
    assert summary_split(summary, 100.0) == (90.0, 5.0, 3.0, 100.0) and summary_split(summary, 0.0) is None
    report = LinkReport(2.5e6, 1.25e7, summary_split(summary, 100.0))
    assert report.fields() == {"link_up": 2.5e6, "link_down": 1.25e7, "time_split": (90.0, 5.0, 3.0, 100.0)}
    assert LinkReport(float("inf"), None, (1.0, -1.0, 0.0, 2.0)).fields() == {}  # out of the record's bounds: left out
    state = new_state(torch.zeros(4), OuterSGD(0.5), (), policy(), (1000,), 0)
    handle(state, SpeedReport("p", 1000.0, 5.0, None, **report.fields()), 5.0)
    info = state.peers["p"]
    assert (info.link_up, info.link_down, info.time_split) == (2.5e6, 1.25e7, (90.0, 5.0, 3.0, 100.0))
    handle(state, SpeedReport("p", 1000.0, 6.0, None, link_up=-1.0, time_split=(1.0, 2.0, 3.0, float("nan"))), 6.0)
    assert info.link_up == 2.5e6 and info.time_split == (90.0, 5.0, 3.0, 100.0)  # junk never replaces a measurement
    # status: shares of the wall time, waiting the rest
    split = time_split(info.time_split)
    assert split == {"computing": 0.9, "uploading": 0.05, "downloading": 0.03, "waiting": pytest.approx(0.02)}
    assert time_split(None) is None and time_split((1.0, 1.0, 1.0, 0.0)) is None
    # the peer's side: downloading counts the θ downloaded ahead (while the previous lease trained) with the rest
    ahead = PeerSummary(timing={"train": 80.0, "upload": 30.0, "download": 2.0, "download_ahead": 8.0})
    assert summary_split(ahead, 100.0) == (80.0, 30.0, 10.0, 100.0) and summary_split(ahead, 0.0) is None
    assert time_split((80.0, 30.0, 10.0, 100.0)) == {"computing": 0.8, "uploading": 0.3, "downloading": 0.1,
                                                      "waiting": 0.0}  # overlapped: transfers while computing
    row = peer_row({"leases": 2, "applied": 1, "steps_assigned": 40, "staleness_sum": 1, "time_s": info.time_split},
                   alive=True, last_seen=6.0)
    assert row["time_split"] == split
    text = format_status({"peers": {"peer-0123456789": {**row, "name": "p"}}}, now=7.0)
    assert "% comp/up/down/wait" in text and text.rstrip().endswith("90/5/3/2")


def test_a_real_peer_reports_its_link_and_split_into_status_json(tmp_path: Path) -> None:
    """The real peer runner over the in-memory transport: its client measures the link on its transfers, its speed
    reports carry the rates and the split, the logic keeps them and the status document shows them."""
    from asyncloco.clock import FakeClock
    from asyncloco.peer.runner import InnerTrainer, PeerOptions, PeerRunner
    from asyncloco.testing.memory import MemoryClient, MemoryTransport, as_actor, drive
    from asyncloco.transport.linkspeed import LinkSpeed
    from asyncloco.transport.rpc import TrafficCounters

    cfg = RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0, "local_steps": "auto"},
        "outer": {"buffer_size": 1}, "sim": {"workers": 1},
        "runtime": {"eval_every": 100000, "speed_report_period": 2.0, "verify": {"enabled": False}},
    })
    clock = FakeClock()

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                                  progress=False, max_rounds=6)
            runner = PeerRunner(options, clock=clock)
            runner.summary.peer_id = "p"
            runner.speed = 1000.0
            counters = TrafficCounters()
            client = MemoryClient(transport, "p", counters=counters, download_codec=cfg.runtime.download_codec)
            client.link = LinkSpeed(min_bytes=0)  # the toy θ is far below a real sample's 256 KiB
            trainer = InnerTrainer.from_config(cfg, transport.workload)
            task = as_actor("p", runner.serve(client, transport.publisher("p", signer="key-p"), cfg, transport.workload,
                                              trainer, cfg.runtime.codec, counters))

            async def pace() -> None:  # fake seconds pass while the peer works, so that its reports repeat
                while not task.done():
                    await clock.sleep(1.0)

            await drive(clock, {"p": task, "pace": as_actor("pace", pace())}, real_timeout=100.0)
            daemon = transport.daemon
            assert daemon is not None
            return daemon.monitoring.status_document(clock.time())
        finally:
            await transport.close()

    status = asyncio.run(asyncio.wait_for(scenario(), timeout=150.0))
    row = status["peers"]["p"]
    assert row["link_up"] > 0 and row["link_down"] > 0  # measured on its real (in-memory) transfers
    split = row["time_split"]
    assert split is not None and set(split) == {"computing", "uploading", "downloading", "waiting"}
    assert all(0.0 <= share for share in split.values()) and split["computing"] > 0


def test_the_first_lease_replaces_the_speed_a_peer_joined_with() -> None:
    """peer/summary.py next_speed: the join measurement (a few steps while the peer starts up) is replaced by the first
    lease's warm steps; later leases are averaged in with schedule.speed_ema. observed_speed leaves the first step out
    and counts the emulated slowdown."""
    from asyncloco.peer.summary import next_speed, observed_speed

    observed = observed_speed([0.5, 0.04, 0.04, 0.04, 0.04], 512, 1.0, 7086.0)
    assert observed == pytest.approx(512 / 0.04)  # the warm steps: 12,800 units/s
    assert observed_speed([0.5, 0.04, 0.04], 512, 2.0, None) == pytest.approx(512 / 0.08)
    assert next_speed(7086.0, 12800.0, 0, 0.5) == 12800.0  # the first lease: replaced
    assert next_speed(12800.0, 6400.0, 1, 0.5) == 9600.0  # then smoothed: 0.5 × 12,800 + 0.5 × 6,400
    assert next_speed(None, 6400.0, 3, 0.5) == 6400.0


def test_a_stop_records_the_split_up_to_it_and_the_wan_result_reports_both(tmp_path: Path) -> None:
    """A measured run ends with a stop (scripts/wan.py's budget): the peer records its wall and training seconds at the
    first stop request, the lease in training included; the WAN result gives each peer's computing share over its whole
    run and up to the stop (asyncloco/wan/run.py utilisation)."""
    from asyncloco.clock import FakeClock
    from asyncloco.peer.runner import PeerOptions, PeerRunner
    from asyncloco.wan.run import utilisation

    clock = FakeClock()
    runner = PeerRunner(PeerOptions(initial_peers=["x"], coordinator_id="c", run_id="r", progress=False), clock=clock)
    runner.stop()  # before its first lease request: nothing to record
    assert runner.summary.stop_wall_s is None
    runner = PeerRunner(PeerOptions(initial_peers=["x"], coordinator_id="c", run_id="r", progress=False,
                                    summary_path=tmp_path / "peer.json"), clock=clock)
    runner._loop_started = clock.monotonic() - 100.0
    runner.summary.timing["train"] = 80.0
    runner.stop()
    runner.stop()  # a second request changes nothing
    assert runner.summary.stop_wall_s == 100.0 and runner.summary.stop_train_s == 80.0
    import json  # written at once: a peer killed while it finishes its lease still leaves the split on disk

    written = json.loads((tmp_path / "peer.json").read_text())
    assert (written["stop_wall_s"], written["stop_train_s"], written["wall_seconds"]) == (100.0, 80.0, 100.0)
    summary = {"timing": {"train": 90.0}, "wall_seconds": 120.0, "stop_train_s": 80.0, "stop_wall_s": 100.0}
    assert utilisation(summary) == {"computing": 0.75, "computing_to_stop": 0.8}
    assert utilisation({}) == {"computing": None, "computing_to_stop": None}
