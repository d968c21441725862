"""Errors a volunteer or an organiser hits: YAML syntax errors in one line with file:line,
a wrong ``--run-id`` named with the right one at once, and a peer whose model, tokenizer, data or codec
differ from the coordinator's refused with both software versions named."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncloco import __version__
from asyncloco.cli import _resolve_config, main
from asyncloco.config import RunConfig, load_config
from asyncloco.fingerprint import COMPONENTS, check_fingerprint, mismatch_reason, run_fingerprint
from asyncloco.workloads import build_workload

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------------- YAML syntax


def test_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: x\ntask:\n  kind: toy\n   dim: 3\n")
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}:4:7: YAML syntax error: mapping values are not allowed here; fix the file at that line "
        "(indentation, a missing ':' or quote)"
    )


def test_unterminated_quote_names_where_it_starts(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text('name: "x\nseed: 1\n')
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert str(info.value).startswith(
        f"{path}:3:1: YAML syntax error: found unexpected end of stream (while scanning a quoted scalar that starts at line 1)"
    )


def test_cli_prints_the_yaml_error_as_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("sim:\n\tworkers: 2\n")
    assert main(["simulate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"asyncloco: error: {path}:2:1: YAML syntax error: found character '\\t' that cannot start any token")


# ------------------------------------------------------------------------------------- fingerprints


def _toy(**changes: Any) -> RunConfig:
    raw = yaml.safe_load(_resolve_config("toy").read_text())
    raw["task"] = {**raw.get("task", {}), "points": 2048, "eval_points": 64}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return RunConfig.model_validate(raw)


def _fingerprint(cfg: RunConfig) -> dict[str, str]:
    workload = build_workload(cfg)
    return run_fingerprint(cfg, workload, workload.build_model(cfg.seed))


@pytest.mark.timeout(60)
def test_fingerprint_is_deterministic_and_names_what_differs() -> None:
    base = _fingerprint(_toy())
    assert sorted(base) == sorted(COMPONENTS) and base["tokenizer"] == "none"
    assert _fingerprint(_toy()) == base

    def differing(other: dict[str, str]) -> list[str]:
        return [name for name in COMPONENTS if other[name] != base[name]]

    assert differing(_fingerprint(_toy(task__noise=0.6))) == ["data"]
    assert differing(_fingerprint(_toy(task__hidden=128))) == ["architecture"]
    assert differing(_fingerprint(_toy(runtime__codec="int8"))) == ["codec"]
    # what does not change the model, the data or the wire is not part of it
    assert differing(_fingerprint(_toy(runtime__lease_slack=5.0, outer__lr=0.5))) == []


@pytest.mark.timeout(180)
def test_same_parameter_count_but_4_heads_instead_of_2_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncloco.models import presets

    cfg = load_config(_resolve_config("demo"))
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)
    ours = run_fingerprint(cfg, workload, model)
    tiny = presets.PRESETS["tiny"]
    monkeypatch.setitem(presets.PRESETS, "tiny", tiny.model_copy(update={"num_heads": 4, "head_dim": 16}))
    other = workload.build_model(cfg.seed)
    assert sum(p.numel() for p in other.parameters()) == sum(p.numel() for p in model.parameters())
    theirs = run_fingerprint(cfg, workload, other)
    assert [name for name in COMPONENTS if ours[name] != theirs[name]] == ["architecture"]
    assert mismatch_reason(ours, theirs, "0.1.0", "0.0.9") == (
        "this peer's architecture differs from the coordinator's (coordinator runs asyncloco 0.1.0, this peer 0.0.9): "
        "its updates would not fit the run's model. Install the coordinator's version (pip install asyncloco==0.1.0) "
        "and join again"
    )
    assert mismatch_reason(ours, dict(ours), "0.1.0", "0.1.0") is None


def test_received_fingerprints_are_validated() -> None:
    good = {name: "ab" * 8 for name in COMPONENTS}
    assert check_fingerprint(good) == good
    for bad in ({}, {**good, "extra": "x"}, {**good, "codec": 3}, {**good, "data": "x" * 65}, ["architecture"]):
        with pytest.raises(ValueError):
            check_fingerprint(bad)


# ------------------------------------------------------------------ run info over a real p2p connection


@pytest.mark.timeout(120)
def test_run_info_names_the_run_and_judges_fingerprints() -> None:
    """Two hivemind nodes on 127.0.0.1 (the asker in client mode): a wrong --run-id fails within
    seconds naming the right one; the coordinator's verdict on a fingerprint comes back in the same call."""
    import hivemind

    from asyncloco.peer.runner import PeerError, PeerOptions, PeerRunner
    from asyncloco.transport.discovery import RunInfo, ask_run_info, serve_run_info
    from asyncloco.transport.dht import start_dht, stop_dht

    seen: list[tuple[str, dict[str, str], str]] = []

    async def check(peer_id: str, fingerprint: dict[str, str], version: str) -> str | None:
        seen.append((peer_id, fingerprint, version))
        return None if fingerprint == {"architecture": "aa"} else "architecture differs"

    async def scenario() -> dict[str, Any]:
        coordinator = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peer = None
        p2ps: list[Any] = []
        try:
            address = str(coordinator.get_visible_maddrs()[0])
            peer = start_dht(initial_peers=[address], host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True)
            served, asking = await coordinator.replicate_p2p(), await peer.replicate_p2p()
            p2ps += [asking, served]
            await serve_run_info(served, RunInfo("the-run", "9.9"), check)
            coordinator_id = coordinator.peer_id.to_base58()
            plain = await ask_run_info(asking, coordinator_id)
            fits = await ask_run_info(asking, coordinator_id, fingerprint={"architecture": "aa"}, software_version="1.0")
            refused = await ask_run_info(asking, coordinator_id, fingerprint={"architecture": "bb"}, software_version="1.0")
            runner = PeerRunner(PeerOptions(initial_peers=[address], run_id="wrong-run"))
            started = time.monotonic()
            with pytest.raises(PeerError) as info:
                await runner.joiner.check_run_id(asking, "wrong-run", time.monotonic() + 60.0)
            elapsed = time.monotonic() - started
            await runner.joiner.check_run_id(asking, "the-run", time.monotonic() + 60.0)  # the right one passes
            return {"plain": plain, "fits": fits, "refused": refused, "error": str(info.value), "elapsed": elapsed,
                    "peer_id": peer.peer_id.to_base58(), "coordinator_id": coordinator_id}
        finally:
            for p2p in p2ps:
                await p2p.shutdown()
            if peer is not None:
                stop_dht(peer)
            stop_dht(coordinator)

    result = asyncio.run(asyncio.wait_for(scenario(), timeout=100.0))
    assert result["plain"] == RunInfo("the-run", "9.9", "")
    assert result["fits"] == RunInfo("the-run", "9.9", "")
    assert result["refused"] == RunInfo("the-run", "9.9", "architecture differs")
    assert seen == [(result["peer_id"], {"architecture": "aa"}, "1.0"), (result["peer_id"], {"architecture": "bb"}, "1.0")]
    assert result["error"] == (
        f"the coordinator {result['coordinator_id']} serves run 'the-run', not 'wrong-run': join with --run-id the-run"
    )
    assert result["elapsed"] < 10.0  # one round trip, not the 60 s connect timeout


# ------------------------------------------------------------------ end to end: real coordinator + peers

_FOUR_HEADS = """
from asyncloco.models import presets
presets.PRESETS["tiny"] = presets.PRESETS["tiny"].model_copy(update={"num_heads": 4, "head_dim": 16})
"""


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_wrong_run_id_and_a_different_architecture_are_refused(tmp_path: Path) -> None:
    from asyncloco.local_cluster import LocalCluster

    patched = tmp_path / "four_heads"
    patched.mkdir()
    (patched / "sitecustomize.py").write_text(_FOUR_HEADS)  # an install whose `tiny` preset has 4 heads
    with LocalCluster(_resolve_config("demo"), tmp_path / "run") as cluster:
        cluster.start_coordinator()
        wrong = cluster.start_peer("wrong", extra=["--run-id", "not-this-run", "--connect-timeout", "60"])
        started = time.monotonic()
        plain_env = cluster.env  # both peers start together (one start-up's wait, not two)
        cluster.env = {**cluster.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(patched), cluster.env.get("PYTHONPATH")]))}
        other = cluster.start_peer("four-heads")
        cluster.env = plain_env
        assert wrong.wait(timeout=60) == 2
        wrong_seconds = time.monotonic() - started
        assert other.wait(timeout=180) == 2
        events = cluster.events()
        coordinator_id = str(cluster.multiaddr).rsplit("/p2p/", 1)[1]
    wrong_log = (tmp_path / "run" / "wrong.log").read_text()
    assert (
        f"asyncloco: error: the coordinator {coordinator_id} serves run 'asyncloco-demo', not 'not-this-run': "
        "join with --run-id asyncloco-demo" in wrong_log
    )
    assert wrong_seconds < 45.0, wrong_seconds  # start-up only; no 60 s connect timeout
    other_log = (tmp_path / "run" / "four-heads.log").read_text()
    assert (
        f"asyncloco: error: the coordinator refused this peer: this peer's architecture differs from the coordinator's "
        f"(coordinator runs asyncloco {__version__}, this peer {__version__})" in other_log
    )
    assert "Traceback" not in wrong_log + other_log
    incompatible = [e for e in events if e.get("event", e.get("type")) == "incompatible"]
    assert len(incompatible) == 1 and incompatible[0]["differing"] == ["architecture"], incompatible
    assert not [e for e in events if e.get("event", e.get("type")) == "assign"]  # neither got a lease
    assert json.loads(json.dumps(incompatible[0]))["peer_version"] == __version__
