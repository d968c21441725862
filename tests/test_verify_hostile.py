"""The hostile volunteer (asyncloco/testing/hostile.py) against verification with carried inner state, over real
hivemind peers in real processes.

A run that verifies carried state refuses a submission without inner-state commitments at the door, so the hostile
client commits like an honest peer — to the state it really trained from — and reveals that state when asked. Its
first lease is honest (its check passes; its inner state becomes carried, not fresh), its second adds a hidden
direction at twice its norm. With ``probation_updates: 2`` both are checked, so the second lease's check asks for a
reveal of a non-fresh start state, re-runs from it and finds the update does not reproduce. What this pins, from the
journal and the hostile client's own record of every call:

* the attacker's reveal was asked for and taken (the reveal RPC over real P2P, from the hostile client);
* its honest lease's verdict is a match and its hidden lease's is a mismatch; it is expelled for exactly that lease,
  and its next call is refused, naming the expulsion;
* the honest peer's every verdict is a match, and θ was repaired without the attacker's updates.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

from asyncloco.local_cluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROUNDS = 10_000  # more than it can run before the verdict: it stops when it is expelled

sys.path.insert(0, str(Path(__file__).parent))
from test_attacks import assert_all_gone, read_json, start_hostile  # noqa: E402


def write_config(directory: Path, upload: Optional[dict[str, Any]] = None, **verify: Any) -> Path:
    """The run: two shards of the toy task, gate off, verification of the carried state on probation only;
    ``upload``: runtime codec keys; ``verify``: more runtime.verify keys (tests/test_validator.py adds validators)."""
    config = {
        "name": "verify-hostile",
        "seed": 0,
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 2},
        "sim": {"workers": 2},
        "runtime": {"run_id": f"vh-{uuid.uuid4().hex[:12]}", "eval_every": 1000, "speed_report_period": 1.0,
                    "lease_slack": 30.0, "gate": {"enabled": False},
                    "verify": {"enabled": True, "inner_state": "carry", "fraction": 0.0, "probation_updates": 2,
                               **verify}, **(upload or {})},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


SIGN_FEEDBACK = {"codec": "sgn15of16", "error_feedback": True, "error_feedback_decay": 0.5}  # the shipped configs'


@pytest.mark.parametrize("upload,keep", [(None, 0), (SIGN_FEEDBACK, None)], ids=["fp32-revealed", "sgn15of16-feedback-kept"])
def test_hostile_client_commits_reveals_and_is_caught_by_the_rerun(tmp_path: Path, upload: Optional[dict[str, Any]],
                                                                   keep: Optional[int]) -> None:
    """With the shipped configs' sign code and error feedback, the hostile client keeps its residual as a peer does
    (its commitments cover it): its honest lease passes bitwise and the lie is caught by the re-run, not by a malformed
    reveal — whether its hidden lease's start state is revealed (``keep_states_mb: 0``) or is the end state the
    coordinator kept from its honest lease's re-run (the default, coordinator/chained.py)."""
    verify = {} if keep is None else {"keep_states_mb": keep}
    cluster = LocalCluster(write_config(tmp_path, upload, **verify), tmp_path / "run", threads=1)
    try:
        cluster.start_coordinator()
        cluster.start_peer("honest", 1.0)
        hostile, summary_path = start_hostile(cluster, "mallory", "honest,hidden", "--rounds", str(ROUNDS))

        def expelled() -> Any:
            return [e for e in cluster.events() if e.get("type") == "expelled"]

        cluster.wait_for(expelled, 300, "the hostile peer's expulsion")
        cluster.wait_for(lambda: hostile.poll() is not None, 120, "the hostile client to stop")
        version = cluster.status().get("version", 0)
        cluster.wait_for(lambda: cluster.status().get("version", 0) >= version + 2, 120, "2 more honest updates")
    finally:
        cluster.close()
    assert_all_gone(cluster)

    summary = read_json(summary_path)
    mallory = summary["peer_id"]
    calls = summary["calls"]
    submits = [c for c in calls if c["call"] == "submit" and c["ok"]]
    assert [c["attack"] for c in submits[:2]] == ["honest", "hidden"], calls
    honest_lease, hidden_lease = submits[0]["lease_id"], submits[1]["lease_id"]
    assert submits[0]["accepted"] and submits[1]["accepted"]  # the gate is off: only verification stands in the way
    reveals = [(c["lease_id"], c["ok"]) for c in calls if c["call"] == "reveal"]
    # the honest lease started fresh: nothing to reveal (its end is the re-run's, compared with the committed digest);
    # the hidden one's start is revealed, or is the honest lease's end state the coordinator kept
    assert reveals[:1] == ([(hidden_lease, True)] if keep == 0 else []), reveals
    # after the expulsion it is refused at its next call, naming it, and stops (far fewer rounds than it asked for)
    first = next(i for i, c in enumerate(calls) if "expelled from this run" in str(c.get("error", "")))
    assert all(not c["ok"] and "expelled from this run" in c["error"] for c in calls[first:]), calls[first:]
    assert calls[-1]["call"] == "assign" and summary["rounds"] < ROUNDS and summary["finished"], calls[-3:]

    events = cluster.events()
    verdicts = {e["lease_id"]: e for e in events if e.get("type") == "verdict"}
    assert verdicts[honest_lease]["ok"] is True and verdicts[hidden_lease]["ok"] is False, verdicts
    # the re-run from the revealed state is its honest update h; it sent h + 2‖h‖u (u a unit vector): ‖sent − h‖ / ‖h‖ = 2
    # (through a sign code and the residual the decoded difference is not exactly 2 × its norm: compared as decoded)
    detail = verdicts[hidden_lease]["detail"]
    assert detail.startswith("relative error 2 (cosine ") if upload is None else detail.startswith("relative error "), detail
    assert verdicts[honest_lease]["detail"] == "bitwise equal to the re-run", verdicts[honest_lease]
    out = [e for e in events if e.get("type") == "expelled"]
    assert [(e["peer"], e["lease_id"]) for e in out] == [(mallory, hidden_lease)], out
    honest_verdicts = [v for v in verdicts.values() if v["peer"] != mallory]
    assert len(honest_verdicts) >= 2 and all(v["ok"] for v in honest_verdicts), honest_verdicts
    repaired = [e for e in events if e.get("type") == "repaired"]
    # caught on its probation: its two probation leases were held for their checks and every later one waited for
    # them (not re-run) — nothing of it reached θ but its verified honest lease, so no repair runs; the rest is dropped
    applied = [e["lease_id"] for e in events if e.get("type") == "applied" and e.get("peer") == mallory]
    dropped = {e["lease_id"] for e in events if e.get("type") == "rejected" and e.get("peer") == mallory
               and "held update not applied" in e.get("reason", "")}
    accepted = {c["lease_id"] for c in submits if c["accepted"] and not c["duplicate"]}
    assert set(applied) <= {honest_lease} and dropped == accepted - set(applied), (applied, dropped, accepted)
    assert out[0]["repair"] is False and not repaired, (out, repaired)
    status = json.loads((cluster.checkpoint_dir / "status.json").read_text())
    assert status["verification"]["failed"] == 1 and mallory in status["verification"]["expelled"]


@pytest.mark.parametrize("named", ["foreign", "own"])
def test_a_forged_carried_state_is_caught_in_any_compute_class(tmp_path: Path, named: str) -> None:
    """The forge-state attacker: honest updates, but its carried first moment pushed along its own direction
    before each lease's end is committed (inside the plausibility bound). Naming a GPU class, as every GPU volunteer of
    a CPU coordinator does, its revealed end is compared with the re-run's within the state tolerance; naming the
    verifier's own class, bitwise. Caught on its first forged lease either way."""
    cluster = LocalCluster(write_config(tmp_path), tmp_path / "run", threads=1)
    extra = ["--device-class", "cuda/NVIDIA H100 80GB HBM3 cuda 13.0/torch 2.11.0+cu130"] if named == "foreign" else []
    try:
        cluster.start_coordinator()
        cluster.start_peer("honest", 1.0)
        hostile, summary_path = start_hostile(cluster, "mallory", "forge-state", "--rounds", str(ROUNDS), *extra)
        cluster.wait_for(lambda: [e for e in cluster.events() if e.get("type") == "expelled"], 300, "the forger's expulsion")
        cluster.wait_for(lambda: hostile.poll() is not None, 120, "the hostile client to stop")
    finally:
        cluster.close()
    assert_all_gone(cluster)
    summary = read_json(summary_path)
    submits = [c for c in summary["calls"] if c["call"] == "submit" and c["ok"]]
    first = submits[0]["lease_id"]  # its end state is already forged
    assert all(c["norm_sent"] == c["norm_honest"] for c in submits)  # every update it sent is its honest one
    verdicts = {e["lease_id"]: e for e in cluster.events() if e.get("type") == "verdict"}
    assert verdicts[first]["ok"] is False, verdicts
    detail = verdicts[first]["detail"]
    if named == "foreign":
        assert "beyond the state tolerance" in detail and "first moment (exp_avg)" in detail, detail
    else:
        assert "end differs from the committed one" in detail, detail
    out = [e for e in cluster.events() if e.get("type") == "expelled"]
    assert [(e["peer"], e["lease_id"]) for e in out] == [(summary["peer_id"], first)], out
