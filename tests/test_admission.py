"""Admission: signed tokens, their binding to a libp2p peer id, expiry and revocation.

Three tiers: the token format and its crypto (asyncloco/coordinator/admission.py); the decisions of
the logic with an explicit clock (Admit / Revoke events, the gate in front of speed reports, lease
requests and submissions, snapshots); the CLI; and one real coordinator in token mode with real peer
processes: an unadmitted peer gets nothing, a peer with a token trains, a revoked one is cut off.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncloco.algo.outer import OuterSGD
from asyncloco.config import RunConfig
from asyncloco.coordinator import admission
from asyncloco.coordinator.admission import AdmissionError, issue_token, load_or_create_key, parse_duration, verify_token
from asyncloco.coordinator.logic import (
    Admit,
    Admitted,
    Applied,
    Assign,
    CoordinatorPolicy,
    CoordinatorState,
    Expired,
    Refused,
    RequestWork,
    Revoke,
    Revoked,
    SpeedReport,
    SubmitUpdate,
    handle,
    is_admitted,
    new_state,
)

A, B, C = "QmPeerA", "QmPeerB", "QmPeerC"
DAY = 86400.0


# ------------------------------------------------------------------------------------ tokens


@pytest.mark.timeout(30)
def test_token_roundtrip_and_key_persistence(tmp_path: Path) -> None:
    token, claims = issue_token(tmp_path, "alice", 7 * DAY, now=1000.0)
    key = load_or_create_key(tmp_path)  # the same key, read back from admission.key
    assert verify_token(key.public_key(), token) == claims
    assert (claims.name, claims.issued_at, claims.expires_at) == ("alice", 1000.0, 1000.0 + 7 * DAY)
    assert len(claims.token_id) == 32 and int(claims.token_id, 16) >= 0
    assert (tmp_path / "admission.key").stat().st_mode & 0o777 == 0o600
    assert admission.list_issued(tmp_path) == [
        {"token_id": claims.token_id, "name": "alice", "issued_at": 1000.0, "expires_at": 1000.0 + 7 * DAY}
    ]
    _, other = issue_token(tmp_path, "bob", 60.0)
    assert other.token_id != claims.token_id


@pytest.mark.timeout(30)
def test_forged_tampered_and_malformed_tokens_are_refused(tmp_path: Path) -> None:
    token, _ = issue_token(tmp_path / "run", "alice", DAY)
    foreign, _ = issue_token(tmp_path / "other-run", "alice", DAY)
    public = load_or_create_key(tmp_path / "run").public_key()
    with pytest.raises(AdmissionError, match="not signed by this run's coordinator"):
        verify_token(public, foreign)
    prefix, body, signature = token.split(".")
    claims = json.loads(admission._b64decode(body))
    claims["exp"] += 365 * DAY  # extend one's own token
    tampered = ".".join([prefix, admission._b64encode(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()), signature])
    with pytest.raises(AdmissionError, match="not signed"):
        verify_token(public, tampered)
    for bad, why in [
        ("", "non-empty"),
        (None, "non-empty"),
        ("x" * 2000, "longer than 1024"),
        ("alt2." + body + "." + signature, "not an asyncloco admission token"),
        (prefix + "." + body, "not an asyncloco admission token"),
        (prefix + ".!!!." + signature, "signed|base64"),
    ]:
        with pytest.raises(AdmissionError, match=why):
            verify_token(public, bad)


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("7d", "12h", "30m", "90s", "3600", "1w", "1.5h")] == [
        7 * DAY, 12 * 3600.0, 1800.0, 90.0, 3600.0, 7 * DAY, 5400.0
    ]
    for bad in ("", "7y", "-1d", "0", "d"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_revocation_file(tmp_path: Path) -> None:
    assert admission.read_revoked(tmp_path) == {}
    tid = "0123456789abcdef0123456789abcdef"
    assert admission.revoke_token(tmp_path, tid, now=5.0) is True
    assert admission.revoke_token(tmp_path, tid, now=6.0) is False
    assert admission.read_revoked(tmp_path) == {tid: 5.0}
    with pytest.raises(ValueError, match="not a token id"):
        admission.revoke_token(tmp_path, "L00000001")
    with pytest.raises(ValueError, match="does not exist"):
        admission.revoke_token(tmp_path / "missing", tid)


def test_config_admission_modes() -> None:
    assert RunConfig().runtime.admission == "open"
    cfg = RunConfig.model_validate({"runtime": {"admission": "allowlist", "allowlist": ["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]}})
    assert cfg.runtime.allowlist == ["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"]
    with pytest.raises(ValueError, match="allowlist is empty"):
        RunConfig.model_validate({"runtime": {"admission": "allowlist"}})
    with pytest.raises(ValueError, match="set runtime.admission: allowlist"):
        RunConfig.model_validate({"runtime": {"admission": "token", "allowlist": ["QmX"]}})
    with pytest.raises(ValueError, match="peer ids"):
        RunConfig.model_validate({"runtime": {"admission": "allowlist", "allowlist": ["/ip4/1.2.3.4"]}})


# ---------------------------------------------------------------------------- logic decisions


def make_state(mode: str = "token", allowlist: frozenset[str] = frozenset()) -> CoordinatorState:
    policy = CoordinatorPolicy(max_local_steps=10, min_steps=1, lease_slack=5.0, admission=mode, allowlist=allowlist)
    return new_state(torch.zeros(4), OuterSGD(0.5), [], policy, [1000], 0)


def do(state: CoordinatorState, event: object, now: float) -> list:
    returned, actions = handle(state, event, now)  # type: ignore[arg-type]
    assert returned is state
    assert all(isinstance(a.reason, str) and a.reason for a in actions)
    return actions


TID1, TID2 = "1" * 32, "2" * 32


@pytest.mark.timeout(30)
def test_unadmitted_peer_gets_nothing_and_has_no_say_in_dylu() -> None:
    state = make_state()
    assert do(state, SpeedReport(A, 1e12), 0.0) == []  # a ghost's claim: ignored
    assert state.peers == {}
    [refused] = do(state, RequestWork(A), 1.0)
    assert isinstance(refused, Refused) and "--token" in refused.reason
    [refused] = do(state, SubmitUpdate(A, "L1", 0, torch.ones(4)), 2.0)
    assert isinstance(refused, Refused) and refused.lease_id == "L1"
    assert state.leases == {} and state.version == 0 and torch.equal(state.params, torch.zeros(4))
    # B is admitted: its lease is sized as if A did not exist (A's 1e12 units/s never reached DyLU)
    [admitted] = do(state, Admit(B, TID1, "bob", 100.0), 3.0)
    assert admitted == Admitted(B, TID1, "bob", True, admitted.reason)
    assert do(state, SpeedReport(B, 50.0), 3.0) == []
    [assign] = do(state, RequestWork(B), 3.0)
    assert isinstance(assign, Assign) and assign.lease.steps == 10


@pytest.mark.timeout(30)
def test_token_binds_to_first_peer_expires_and_renews() -> None:
    state = make_state()
    assert isinstance(do(state, Admit(A, TID1, "alice", 100.0), 0.0)[0], Admitted)
    # the same token from another identity: refused, A keeps it
    [refused] = do(state, Admit(B, TID1, "alice", 100.0), 1.0)
    assert isinstance(refused, Refused) and "bound to another peer id (QmPeerA)" in refused.reason
    assert not is_admitted(state, B, 1.0) and is_admitted(state, A, 1.0)
    # presenting it again changes nothing
    [again] = do(state, Admit(A, TID1, "alice", 100.0), 2.0)
    assert isinstance(again, Admitted) and again.new is False
    # an expired token admits nobody, and an admitted peer's expiry ends its admission
    [late] = do(state, Admit(C, TID2, "carol", 50.0), 50.0)
    assert isinstance(late, Refused) and "expired" in late.reason
    assert is_admitted(state, A, 99.9) and not is_admitted(state, A, 100.0)
    assert do(state, SpeedReport(A, 5.0), 100.0) == []
    [refused] = do(state, RequestWork(A), 100.0)
    assert isinstance(refused, Refused) and "expired at 100" in refused.reason
    # a renewed token replaces the binding of the old one
    [renewed] = do(state, Admit(A, TID2, "alice", 500.0), 101.0)
    assert isinstance(renewed, Admitted) and renewed.new
    assert state.token_peers == {TID2: A} and state.admitted[A].token_id == TID2 and is_admitted(state, A, 101.0)


@pytest.mark.timeout(30)
def test_revocation_cuts_a_peer_off_and_gives_its_lease_back() -> None:
    state = make_state()
    do(state, Admit(A, TID1, "alice", 1e9), 0.0)
    do(state, SpeedReport(A, 10.0), 0.0)
    [assign] = do(state, RequestWork(A), 0.0)
    lease = assign.lease
    actions = do(state, Revoke(TID1, 5.0), 5.0)
    assert [type(a) for a in actions] == [Revoked, Expired]
    assert actions[0].peer == A and actions[1].lease_id == lease.lease_id
    assert state.leases == {} and state.shards[0].assigned == 0 and not state.peers[A].alive
    [refused] = do(state, SubmitUpdate(A, lease.lease_id, 0, torch.ones(4)), 6.0)
    assert isinstance(refused, Refused) and "revoked" in refused.reason
    assert torch.equal(state.params, torch.zeros(4))
    assert do(state, Revoke(TID1, 7.0), 7.0) == []  # idempotent
    [refused] = do(state, Admit(B, TID1, "alice", 1e9), 8.0)
    assert isinstance(refused, Refused) and "revoked" in refused.reason
    # revoking a token nobody used yet: refused when it shows up later
    [revoked] = do(state, Revoke(TID2, 9.0), 9.0)
    assert revoked == Revoked(TID2, None, revoked.reason)
    assert isinstance(do(state, Admit(C, TID2, "carol", 1e9), 10.0)[0], Refused)


@pytest.mark.timeout(30)
def test_admitted_peer_trains_normally() -> None:
    state = make_state()
    do(state, Admit(A, TID1, "alice", 1e9), 0.0)
    do(state, SpeedReport(A, 10.0), 0.0)
    [assign] = do(state, RequestWork(A), 0.0)
    [applied] = do(state, SubmitUpdate(A, assign.lease.lease_id, 0, torch.ones(4)), 1.0)
    assert isinstance(applied, Applied)
    assert torch.equal(state.params, torch.full((4,), -0.5))  # OuterSGD(0.5): θ - 0.5·Δ


@pytest.mark.timeout(30)
def test_allowlist_and_open_modes() -> None:
    state = make_state("allowlist", frozenset({A}))
    assert is_admitted(state, A, 0.0) and not is_admitted(state, B, 0.0)
    do(state, SpeedReport(B, 1e12), 0.0)
    assert B not in state.peers
    [refused] = do(state, RequestWork(B), 0.0)
    assert isinstance(refused, Refused) and "runtime.allowlist" in refused.reason
    [refused] = do(state, Admit(B, TID1, "bob", 1e9), 0.0)  # tokens do not admit in allowlist mode
    assert isinstance(refused, Refused) and not is_admitted(state, B, 0.0)
    open_state = make_state("open")
    assert is_admitted(open_state, "anyone", 0.0)
    do(open_state, SpeedReport(B, 3.0), 0.0)
    assert isinstance(do(open_state, RequestWork(B), 0.0)[0], Assign)


@pytest.mark.timeout(30)
def test_bindings_and_revocations_survive_a_snapshot() -> None:
    state = make_state()
    do(state, Admit(A, TID1, "alice", 1e9), 0.0)
    do(state, Revoke(TID2, 3.0), 3.0)
    restored = make_state()
    restored.load_state_dict(state.state_dict())
    assert restored.admitted == state.admitted and restored.token_peers == {TID1: A} and restored.revoked == {TID2: 3.0}
    assert is_admitted(restored, A, 1.0) and not is_admitted(restored, B, 1.0)
    legacy = state.state_dict()
    for key in ("admitted", "token_peers", "revoked"):
        del legacy[key]  # a checkpoint written before admission existed still loads
    old = make_state()
    old.load_state_dict(legacy)
    assert old.admitted == {} and old.revoked == {}


# ---------------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncloco.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(300)
def test_token_cli_issue_list_revoke(tmp_path: Path) -> None:
    issued = _cli("coordinator", "token", "--checkpoint-dir", str(tmp_path), "--peer-name", "alice", "--expires", "7d")
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip().splitlines()[-1]
    claims = verify_token(load_or_create_key(tmp_path).public_key(), token)
    assert claims.name == "alice" and claims.expires_at - claims.issued_at == 7 * DAY
    listed = _cli("coordinator", "token", "list", "--checkpoint-dir", str(tmp_path))
    assert listed.returncode == 0 and claims.token_id in listed.stdout and "alice" in listed.stdout
    revoked = _cli("coordinator", "token", "revoke", "--checkpoint-dir", str(tmp_path), claims.token_id)
    assert revoked.returncode == 0, revoked.stderr
    assert admission.read_revoked(tmp_path).keys() == {claims.token_id}
    bad = _cli("coordinator", "token", "--checkpoint-dir", str(tmp_path), "--peer-name", "alice", "--expires", "7y")
    assert bad.returncode != 0 and "7d, 12h" in bad.stderr


# ------------------------------------------------------------------------ real processes


def _token_config(directory: Path) -> Path:
    import uuid

    import yaml

    config = {
        "name": "admission",
        "seed": 0,
        "task": {"kind": "lm", "model": "tiny", "source": "embedded", "seq_len": 64, "batch_size": 8, "num_shards": 4,
                 "val_sequences": 16, "max_train_sequences": 4000},
        "inner": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": 1},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 10, "min_steps": 2, "grace_period": 0.5},
        "sim": {"workers": 1},
        "runtime": {"run_id": f"adm-{uuid.uuid4().hex[:12]}", "codec": "int8", "eval_every": 2,
                    "speed_report_period": 1.0, "lease_timeout_factor": 2.0, "lease_slack": 10.0, "admission": "token"},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_outsider_gets_nothing_token_binds_and_revocation_cuts_off(tmp_path: Path) -> None:
    """Token mode with real processes: an outsider's hello, lease request, θ download and submission are
    all refused; a peer with a token trains; the same token from another identity is refused; revoking
    the token (the CLI, while the coordinator runs) cuts the peer off within seconds."""
    from asyncloco.local_cluster import LocalCluster

    config = _token_config(tmp_path)
    cluster = LocalCluster(config, tmp_path / "run", threads=1)
    try:
        token, claims = issue_token(cluster.checkpoint_dir, "alice", 3600.0)
        address = cluster.start_coordinator()
        probe_summary = cluster.workdir / "outsider.json"
        probe = subprocess.Popen(
            [sys.executable, "-m", "asyncloco.testing.hostile", "--initial-peers", address, "--run-id", str(cluster.run_id),
             "--attack", "probe", "--config", str(config), "--summary", str(probe_summary)],
            stdout=(cluster.workdir / "outsider.log").open("ab"), stderr=subprocess.STDOUT, env=cluster.env,
            start_new_session=True,
        )
        cluster.spawned.append(probe)
        alice = cluster.start_peer("alice", 1.0, ["--token", token, "--identity", str(tmp_path / "alice.key")])
        cluster.wait_for(lambda: cluster.peer_summary("alice").get("accepted", 0) >= 2, 240, "alice's first updates")
        eve = cluster.start_peer("eve", 1.0, ["--token", token])  # alice's token, another identity
        cluster.wait_for(lambda: probe.poll() is not None and eve.poll() is not None, 120, "the outsider and eve to finish")
        revoked_at = time.time()
        revoke = _cli("coordinator", "token", "revoke", "--checkpoint-dir", str(cluster.checkpoint_dir), claims.token_id)
        assert revoke.returncode == 0, revoke.stderr
        cluster.wait_for(lambda: alice.poll() is not None, 60, "alice to be cut off")
        picked_up = next(e["time"] for e in cluster.events() if e.get("type") == "revoked")
        events = cluster.events()
    finally:
        cluster.close()
    # the outsider's submission was refused at its header: the coordinator read exactly alice's bodies
    received = cluster.status()["traffic"]["submit"]["payload_bytes_received"]
    assert received == cluster.peer_summary("alice")["traffic"]["submit"]["payload_bytes_sent"] > 0
    outsider = json.loads(probe_summary.read_text())
    calls = {c["call"]: c for c in outsider["calls"]}
    assert set(calls) == {"hello", "assign", "get_model", "submit"}
    for call in calls.values():
        assert call["ok"] is False and "not admitted" in call["error"] and "--token" in call["error"], call
    alice_id = cluster.peer_summary("alice")["peer_id"]
    # the outsider appears in the journal only as refused; nothing was leased, sent or applied for it
    assert {e["type"] for e in events if e.get("peer") == outsider["peer_id"]} == {"refused"}
    assert [e["peer"] for e in events if e.get("type") == "admitted"] == [alice_id]
    eve_log = (cluster.workdir / "eve.log").read_text()
    assert eve.returncode != 0 and "bound to another peer id" in eve_log, eve_log[-2000:]
    assert alice.returncode != 0 and "revoked" in (cluster.workdir / "alice.log").read_text()
    assert picked_up - revoked_at < 10.0
    revoked = next(e for e in events if e.get("type") == "revoked")
    assert revoked["token_id"] == claims.token_id and revoked["peer"] == alice_id
    assert not [e for e in events if e.get("type") in ("applied", "assign") and e.get("peer") == alice_id
                and e["time"] > picked_up]
