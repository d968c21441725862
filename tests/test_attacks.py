"""The attack suite: real coordinator and peer processes on 127.0.0.1, hostile peers.

The hostile peer is :mod:`asyncloco.testing.hostile`, a real hivemind peer speaking the real protocol.
One coordinator (token admission) serves every attack — start-up is what costs on a busy machine, so
the attacks share it (three clusters took ≈ 290 s):

1. **Update attacks and ghosts.** An *admitted* insider (a token) sends, between honest rounds, a huge
   (×1e30), a NaN, a sign-flipped ×1000, a sign-flipped-at-honest-norm and a random-direction update,
   replays an applied lease with a harmful update, and submits under another peer's lease id (known from
   the journal). Huge, NaN and ×1000 are rejected (or clipped), the sign-flipped one at the honest norm
   is rejected (pointing away, or uphill on the probe batch), a random one gets in only if it agrees
   weakly and lowers the probe loss (on probation: clipped, at most 3); the replay is acknowledged as a
   duplicate at the version it was first applied and nothing more, the stolen lease still counts for
   its owner; θ stays finite and the run keeps learning. An honest peer
   joining at the same time (fresh AdamW state, on probation) has its *first* update accepted (the
   gate's probe vouches for it) and most of the rest. Meanwhile DHT records claiming 1e12 tokens/s, from
   a ghost under its own id and forged for an honest peer (with a ``last_seen`` in the future), leave
   the honest peers' DyLU steps where their real speeds put them.
2. **A flood** (after phase 1, so that its memory and log are measured alone; the honest peers keep
   training): 2,000 malformed calls on the raw RPC streams: the coordinator stays up and keeps training
   the honest peers, its memory grows by less than 150 MB, its log by a bounded number of lines and no
   traceback.

The unadmitted-outsider test is in tests/test_admission.py. The test tears down every process it
started (checked: no process group left).
"""

from __future__ import annotations

import json
import re
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from asyncloco.coordinator.admission import issue_token
from asyncloco.coordinator.checkpoint import load_snapshot
from asyncloco.local_cluster import LocalCluster

pytestmark = pytest.mark.integration

H = 10
MIN_STEPS = 2


def write_config(directory: Path, **runtime: Any) -> Path:
    config = {
        "name": "attacks",
        "seed": 0,
        "task": {"kind": "lm", "model": "tiny", "source": "embedded", "seq_len": 64, "batch_size": 8, "num_shards": 4,
                 "val_sequences": 16, "max_train_sequences": 4000},
        "inner": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": 2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": H, "min_steps": MIN_STEPS, "grace_period": 0.5},
        "sim": {"workers": 2},
        "runtime": {"run_id": f"atk-{uuid.uuid4().hex[:12]}", "codec": "int8", "eval_every": 2,
                    "speed_report_period": 1.0, "lease_timeout_factor": 2.0, "lease_slack": 10.0, **runtime},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_hostile(cluster: LocalCluster, name: str, attack: str, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    summary = cluster.workdir / f"{name}.json"
    log = (cluster.workdir / f"{name}.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncloco.testing.hostile", "--initial-peers", str(cluster.multiaddr), "--run-id",
         str(cluster.run_id), "--attack", attack, "--summary", str(summary), *extra],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=cluster.env, start_new_session=True,
    )
    log.close()
    cluster.spawned.append(process)  # close() stops it and its p2pd with everything else
    return process, summary


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def assert_all_gone(cluster: LocalCluster, timeout: float = 30.0) -> None:
    """Every process the test started has exited, and nothing of its session (p2pd, DHT child) is left."""

    def group_alive(pid: int) -> bool:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return False
        return True

    for process in cluster.spawned:
        assert process.poll() is not None, f"process {process.pid} still running"
    # a SIGKILLed group's orphans are reaped by init a moment later
    cluster.wait_for(lambda: not any(group_alive(p.pid) for p in cluster.spawned), timeout, "process groups to vanish")


def peer_ids(cluster: LocalCluster, names: list[str]) -> dict[str, str]:
    return {name: cluster.wait_for(lambda n=name: cluster.peer_summary(n).get("peer_id"), 120, f"{name}'s id") for name in names}


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


# --------------------------------------------------------------------------------- the attacks

ATTACKS = ["huge", "nan", "signflip", "signflip-honest", "random", "replay", "other-lease"]


def gate_trace(events: list[dict[str, Any]], names: dict[str, str]) -> str:
    """One line of the gate's verdicts in journal order: ``name:a|r@cosine`` (a = applied, w = applied with weak
    agreement, r = rejected), to read a failure's cause from its message (the run's directory is gone in CI)."""
    marks = []
    for event in events:
        if event.get("type") not in ("applied", "rejected"):
            continue
        text = event.get("gate") or event.get("reason") or ""
        found = re.search(r"cosine (-?[0-9.]+)", text)
        kind = "r" if event["type"] == "rejected" else ("w" if "weak agreement" in text else "a")
        marks.append(f"{names.get(event.get('peer', ''), '?')}:{kind}@{found[1] if found else '-'}")
    return " ".join(marks)


@pytest.mark.timeout(900)
def test_attacks_on_one_coordinator(tmp_path: Path) -> None:
    # quarantine would (rightly) stop the insider after 3 rejections; here every attack must reach the gate — and
    # so must verification not expel it after the first one the gate lets through (its probation leases are all
    # re-run: a signflip-honest update the gate accepted got it expelled and its later attacks refused, failing
    # this test in a suite run; verification against such a client: tests/test_verify_hostile.py)
    config = write_config(tmp_path, admission="token", gate={"quarantine_after": 100, "quarantine_window": 100},
                          verify={"enabled": False})
    cluster = LocalCluster(config, tmp_path / "run", threads=1)
    count = 2000
    try:
        tokens = {name: issue_token(cluster.checkpoint_dir, name, 3600.0)[0] for name in ("a", "b", "c", "mallory")}
        cluster.start_coordinator()
        cluster.start_peer("a", 1.0, ["--token", tokens["a"]])
        cluster.start_peer("b", 1.5, ["--token", tokens["b"]])
        ids = peer_ids(cluster, ["a", "b"])
        journal = str(cluster.checkpoint_dir / "events.jsonl")

        # ---- phase 1, all at once (start-up is what costs): the update attacks, an honest newcomer, two
        # ghosts. The insider starts once the gate has warmed up (6 accepted honest updates): it judges
        # directions against recently accepted updates; the others start meanwhile.
        cluster.start_peer("c", 1.0, ["--token", tokens["c"]])  # an honest newcomer, joining as late as mallory
        ghost, ghost_summary = start_hostile(cluster, "ghost", "ghost", "--duration", "45")
        forger, forge_summary = start_hostile(cluster, "forger", "ghost-forge", "--spy-journal", journal, "--duration", "45")
        cluster.wait_for(lambda: cluster.status().get("version", 0) >= 6, 240, "6 honest updates")
        hostile, summary_path = start_hostile(cluster, "mallory", ",".join(ATTACKS), "--token", tokens["mallory"],
                                              "--spy-journal", journal, "--rounds", str(len(ATTACKS)))
        late = peer_ids(cluster, ["c"])["c"]
        honest_ids = {*ids.values(), late}

        def published() -> float | None:
            calls = [c for path in (ghost_summary, forge_summary) for c in read_json(path).get("calls", [])
                     if c["call"] == "publish_speed" and c["ok"]]
            return min(c["time"] for c in calls) if len({c["claimed_peer"] for c in calls}) >= 2 else None

        since = cluster.wait_for(published, 120, "both ghosts' records in the DHT")
        # three speed-report periods for the coordinator to read the claims, then 8 more honest leases
        cluster.wait_for(lambda: len([e for e in cluster.events() if e.get("type") == "assign" and e.get("peer") in honest_ids
                                      and e.get("issued_at", 0) > since + 3.0]) >= 8, 240, "8 honest leases after the claims")
        forged = {c["claimed_peer"] for c in read_json(forge_summary)["calls"] if c["call"] == "publish_speed"}
        ghost_status = cluster.status()
        cluster.wait_for(lambda: read_json(summary_path).get("finished") or hostile.poll() is not None, 400,
                         "the hostile peer's rounds")
        assert read_json(summary_path).get("finished"), (cluster.workdir / "mallory.log").read_text()[-3000:]
        cluster.wait_for(lambda: len([e for e in cluster.events() if e.get("peer") == late
                                      and e.get("type") in ("applied", "rejected")]) >= 3, 120, "3 verdicts on c")
        version_before_flood = cluster.status()["version"]
        for process in (hostile, ghost, forger):  # the ghosts stop after their --duration
            cluster.wait_for(lambda p=process: p.poll() is not None, 120, "the hostile peers to finish")

        # ---- phase 2: the flood, its memory and log measured alone
        assert cluster.coordinator is not None
        pid = cluster.coordinator.pid
        log = cluster.workdir / "coordinator.log"
        rss_before, lines_before = rss_kb(pid), len(log.read_text().splitlines())
        flood, flood_path = start_hostile(cluster, "flood", "flood", "--count", str(count), "--config", str(config))
        cluster.wait_for(lambda: read_json(flood_path).get("finished") or flood.poll() is not None, 400, "the flood")
        flood_summary = read_json(flood_path)
        assert flood_summary.get("finished") and flood_summary["flood"]["sent"] == count, flood_summary
        assert cluster.coordinator.poll() is None, "the coordinator died"
        rss_after = rss_kb(pid)
        new_lines = log.read_text().splitlines()[lines_before:]
        version = cluster.status()["version"]
        cluster.wait_for(lambda: cluster.status().get("version", 0) >= version + 2, 120, "2 more honest updates")
    finally:
        cluster.close()  # peers first, then the coordinator (SIGTERM: it writes its final snapshot)
    assert_all_gone(cluster)
    theta = load_snapshot(cluster.checkpoint_dir)["coordinator"]["params"]
    events = cluster.events()

    # ---- the update attacks
    summary = read_json(summary_path)
    mallory = summary["peer_id"]
    verdicts: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        if event.get("lease_id"):
            verdicts.setdefault(event["lease_id"], []).append(event)
    submits = [c for c in summary["calls"] if c["call"] == "submit"]
    by_attack: dict[str, list[dict[str, Any]]] = {}
    for call in submits:
        by_attack.setdefault(call["attack"], []).append(call)
    assert sorted(set(by_attack) - {"honest"}) == sorted(ATTACKS), by_attack.keys()

    def decided(lease_id: str) -> list[str]:
        return [e["type"] for e in verdicts.get(lease_id, []) if e["type"] in ("applied", "rejected", "duplicate")]

    def answers(attack: str) -> list[dict[str, Any]]:
        """The last attempt at each lease: the hostile client sends the same bytes again after a failure with no
        refusal code (a dropped stream on a loaded machine, a timeout), as an honest peer does; what the
        coordinator answered is the last attempt's."""
        attempts: dict[str, list[dict[str, Any]]] = {}
        for call in by_attack[attack]:
            attempts.setdefault(call["lease_id"], []).append(call)
        for calls in attempts.values():
            assert all(c["ok"] is False and c.get("code") is None for c in calls[:-1]), calls  # retried: uncoded failures
        return [calls[-1] for calls in attempts.values()]

    for attack in ("huge", "nan", "signflip", "signflip-honest", "random"):
        for call in answers(attack):
            outcome = decided(call["lease_id"])
            if call["ok"] is False:  # refused by the transport (e.g. a NaN caught at decode): nothing applied
                assert outcome == [], (attack, call, outcome)
                assert "finite" in call["error"].lower() or "nan" in call["error"].lower(), (attack, call)
                continue
            # sign-flipped at the honest norm: refused — unless the gate's documented exceptions apply: the probe
            # saw it lower the probe-batch loss (on probation: at all), or, from a peer past probation, it agrees
            # weakly without raising the probe loss; then it is taken at no more than the median norm (below)
            assert call["accepted"] is False or attack in ("huge", "signflip", "random", "signflip-honest"), (
                attack, call, verdicts.get(call["lease_id"]))
            if call["accepted"] and attack in ("huge", "signflip"):
                # a norm attack may be clipped to the honest scale instead of rejected
                [applied] = [e for e in verdicts[call["lease_id"]] if e["type"] == "applied"]
                assert "clipped" in applied["gate"], (attack, applied)
            elif call["accepted"]:
                # A random direction gets in only while it agrees weakly and lowers the probe-batch loss (on
                # probation, by any amount): at the honest norm, with a bounded effect.
                [applied] = [e for e in verdicts[call["lease_id"]] if e["type"] == "applied"]
                cosine = float(re.search(r"cosine (-?[0-9.]+)", applied["gate"])[1])  # type: ignore[index]
                vouched = "lowers the probe-batch loss" in applied["gate"] or "weak agreement" in applied["gate"]
                if attack == "signflip-honest":  # pointing away: only by the probe's or weak agreement's exception
                    assert cosine > 0 or vouched, (attack, applied)
                else:
                    assert abs(cosine) < 0.25 and (cosine > 0 or vouched), (attack, applied)
            else:
                assert outcome == ["rejected"], (attack, call, outcome)
                [rejected] = [e for e in verdicts[call["lease_id"]] if e["type"] == "rejected"]
                assert rejected["peer"] == mallory and rejected["reason"], rejected
    for call in answers("replay"):
        # an applied lease resent with other bytes: acknowledged as the duplicate it is, never applied again
        assert call["ok"] and call["accepted"] and call["duplicate"] and call["version"] == call["first_version"], call
        assert decided(call["lease_id"]).count("applied") == 1
    for call in answers("other-lease"):
        assert call["victim"] is True and call["lease_id"] not in [c["lease_id"] for c in submits if c["attack"] == "honest"]
        stolen = verdicts.get(call["lease_id"], [])
        assert stolen and stolen[0]["type"] == "assign" and stolen[0]["peer"] in honest_ids, stolen
        owner = stolen[0]["peer"]
        # refused, or (the owner was faster) acknowledged as a duplicate of the owner's applied update
        assert call["ok"] is False or call["accepted"] is False or call["duplicate"] is True, call
        # the owner's lease is not counted against it: never given back for the thief's sake (only for the
        # owner's own verdict or its deadline), applied at most once and only for its owner
        owner_rejected = any(e["type"] == "rejected" and e["peer"] == owner for e in stolen)
        for given_back in (e for e in stolen if e["type"] == "expired"):
            assert owner_rejected or "deadline" in given_back["reason"], stolen
        applied = [e for e in stolen if e["type"] == "applied"]
        assert len(applied) <= 1 and all(e["peer"] == owner for e in applied), stolen
    assert bool(torch.isfinite(theta).all()) and float(theta.abs().max()) < 100.0
    evals = [e for e in events if e.get("type") == "eval"]
    assert len(evals) >= 3 and all(math.isfinite(e["perplexity"]) for e in evals)
    assert evals[-1]["perplexity"] < evals[0]["perplexity"], [e["perplexity"] for e in evals]
    honest_rejected = [e for e in events if e.get("type") == "rejected" and e.get("peer") in ids.values()]
    honest_applied = [e for e in events if e.get("type") == "applied" and e.get("peer") in ids.values()]
    assert len(honest_applied) >= version_before_flood // 2
    # What the gate guarantees: a peer past probation is never refused for merely agreeing weakly (its
    # update is taken at ≤ the median norm, "weak agreement"), nor for pointing away while the probe loss does not
    # rise by more than its margin (a fresh-clone CI run refused 9 of 148 such honest updates, +0.003 % each, when
    # that was refused); only for raising the probe loss by more than the margin or an out-of-bounds norm. So
    # after a peer's first 3 accepted updates no "not counted" refusal, and ≤ 1 % refused in all, two allowed: with
    # the gate alone (verification off here; with it, a probe-only refusal is checked instead) an honest stale update
    # pointing away can raise the probe loss past its margin by the probe's noise — a fresh-clone CI run refused 2 of
    # 141 so (cosine −0.23 and −0.25; one raised it by 0.076 % against a 0.039 % margin).
    names = {**{peer: name for name, peer in ids.items()}, late: "c", mallory: "mallory"}
    trace = gate_trace(events, names)  # for the message of a failure: every verdict, whose, at what cosine
    for peer in ids.values():
        mine = [e for e in events if e.get("peer") == peer and e.get("type") in ("applied", "rejected")]
        established = [e for i, e in enumerate(mine) if sum(x["type"] == "applied" for x in mine[:i]) >= 3]
        weakly = [e for e in established if e["type"] == "rejected" and "not counted" in e["reason"]]
        assert not weakly, (weakly, trace)
    assert len(honest_rejected) <= max(2, len(honest_applied) // 100), ([e["reason"] for e in honest_rejected], trace)
    # the honest newcomer: on probation with a fresh AdamW state, but its honest work counts from its first
    # update on (the probe-batch loss vouches for it; it must not be taken for an attacker)
    late_verdicts = [e for e in events if e.get("peer") == late and e.get("type") in ("applied", "rejected")]
    assert late_verdicts[0]["type"] == "applied", late_verdicts[0]
    kinds = [e["type"] for e in late_verdicts]
    assert kinds.count("applied") >= kinds.count("rejected"), [e.get("reason") for e in late_verdicts if e["type"] == "rejected"]

    # ---- the ghosts: two honest peers of speeds 1 and 1/1.5 and a newcomer; DyLU gives the fastest H, the
    # others their share — a believed 1e12 claim would cut every honest lease to MIN_STEPS (the median lease
    # stays at least H/2, at most a quarter are that short)
    assert forged <= honest_ids and forged, forged
    after = [e for e in events if e.get("type") == "assign" and e.get("peer") in honest_ids and e.get("issued_at", 0) > since + 3.0]
    steps = sorted(e["steps"] for e in after)
    # (a lease may be cut short to re-train a range given back — the insider's rejected leases — never by a claim)
    assert len(after) >= 8 and steps[len(steps) // 2] >= H // 2, [(e["peer"][-6:], e["steps"]) for e in after]
    assert sum(s <= MIN_STEPS for s in steps) <= len(steps) // 4, [(e["peer"][-6:], e["steps"], e.get("start_offset")) for e in after]
    assert all(row.get("speed", 0) < 1e9 for row in ghost_status.get("peers", {}).values()), ghost_status.get("peers")

    # ---- the flood
    outcomes = flood_summary["flood"]["outcomes"]
    assert sum(sum(kind.values()) for kind in outcomes.values()) == count
    assert (rss_after - rss_before) < 150 * 1024, f"RSS grew by {(rss_after - rss_before) / 1024:.0f} MB"
    assert len(new_lines) < 300, f"{len(new_lines)} log lines for {count} malformed calls"
    assert not [line for line in new_lines if "Traceback" in line], new_lines[:20]
