"""Every script in scripts/ runs in its smoke mode, so a benchmark cannot rot between the runs that cite it.

Each Python script has a ``--smoke`` mode (the tiniest sizes, seconds of work; wan.py: ``run --smoke``) that
this file runs as a user would — a subprocess from the checkout, writing its JSON into a temporary directory —
and then checks what it wrote: the keys a doc or a reader uses, counts above zero, finite ratios, the pass
criteria the script itself states. Scripts whose smoke run another test already makes are listed in
``COVERED`` with that test (it must exist); the shell scripts get a syntax check. A script added to scripts/
without a smoke here fails :func:`test_every_script_has_a_smoke`.

Runs that start real processes (a coordinator, peers, p2pd) are marked ``integration``; the two over emulated
links (wan.py's ``check`` of one link; bench_wan.py's run, which is wan.py ``run``'s) need root and ``ip netns``
and skip with the reason otherwise. Each test's timeout is about 5 × its
time on the 2-core development machine under load.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from asyncloco.wan.netns import namespaces_unavailable

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
NO_NETNS = namespaces_unavailable()

# scripts whose smoke run is another test's (the test named must exist)
COVERED = {
    "bench_peer.py": "tests/test_bench_peer.py::test_bench_peer_tiny_prints_and_writes_the_ratio",
    "bench_prepare.py": "tests/test_data_prepared.py::test_bench_prepare_smoke",
    "crash_test.py": "tests/test_crash_replay.py::test_coordinator_main_process_sigkill_at_random_points",
    "gen_reference.py": "tests/test_docs.py::test_generated_reference_matches_the_code",
    "gpu_check.py": "tests/test_gpu_check.py::test_tiny_mode_writes_every_part",
    "probe_noise.py": "tests/test_gate_probe.py::test_probe_noise_script_writes_the_changes_and_both_margin_rules",
    "render_results.py": "tests/test_docs.py::test_every_results_file_renders",
}
SHELL = ("gpu_wheels.sh", "setup.sh")


@dataclass
class Smoke:
    args: list[str]  # after the script; "{tmp}" is the test's temporary directory
    check: Callable[[Path, str], None]  # (the temporary directory, stdout + stderr)
    timeout: int = 120
    json: str = "out.json"  # the file under {tmp} the script writes ("" when --json is not passed)
    integration: bool = False
    netns: bool = False


def finite(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def load(tmp: Path, name: str = "out.json") -> Any:
    return json.loads((tmp / name).read_text())


# ------------------------------------------------------------------------------------------- checks


def check_bench_coordinator(tmp: Path, _: str) -> None:
    r = load(tmp)["tiny"]
    assert r["numel"] > 0 and r["verify"]["enabled"] is True  # the defaults: verification on
    for key in ("memcpy_s", "fsync_update_s", "decode_s", "validate_s", "apply_s", "wal_append_s", "ack_latency_s",
                "lease_latency_s", "snapshot_s", "snapshot_copy_s", "updates_per_s", "storage_per_update_theta"):
        assert finite(r[key]) and r[key] > 0, key
    assert r["sustained_updates"] >= 3 and r["peers_at_60s_round"] == int(r["updates_per_s"] * 60)
    # every submission accepted: commitments that chain, updates the gate takes as honest (no echoes)
    assert r["refused"] == 0 and r["submitted"] >= r["sustained_rounds"] > 0
    assert r["gate_cosine_max"] < 0.95
    v = r["verification"]  # the probation checks (at least) were re-run and passed, bitwise
    assert v["checked"] >= 2 and v["passed"] == v["checked"] and v["failed"] == v["expelled"] == v["dropped"] == 0
    # each started from a revealed state, the fresh one, or the end state the coordinator kept (coordinator/chained.py)
    assert v["reveals"] + sum(v["chained"].values()) == v["checked"] and v["chained"]["fresh"] == 1 and v["rerun_steps"] > 0


def check_bench_sim(tmp: Path, _: str) -> None:
    rows = load(tmp)
    assert [row["workers"] for row in rows] == [4, 8]
    assert all(finite(row["logic_events_per_s"], row["sim_events_per_s"]) and row["logic_events_per_s"] > 0
               and row["sim_applied"] > 0 for row in rows)


def check_bench_transport(tmp: Path, _: str) -> None:
    rows = load(tmp)
    codecs = {row["codec"]: row for row in rows}
    assert {"none", "bf16", "int8"} <= set(codecs) and all(row["numel"] == 100_000 for row in rows)
    for row in rows:
        assert row["wire_mb"] > 0 and finite(row["encode_s"], row["decode_s"], row["upload_s"], row["raw_upload_s"])
    assert codecs["int8"]["wire_mb"] < codecs["none"]["wire_mb"] / 3
    assert finite(codecs["int8"]["download_s"], codecs["int8"]["raw_download_s"])


def check_wire_budget(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["preset"] == "tiny" and r["numel"] > 0 and r["rows"] and r["uploads"]
    assert all(0 < row["fraction"] <= 1.0 and row["fraction_held"] <= row["fraction"] for row in r["rows"])
    for codec, row in r["measured"].items():  # the closed-form bound holds on the measured θ
        assert row["max_abs_error"] <= row["bound"] and finite(row["relative_l2"]), codec


def check_bench_kept_states(tmp: Path, _: str) -> None:
    r = load(tmp)
    # tiny with the embedded tokenizer's 4096: 12 bytes a weight (two AdamW moments and the residual) and a length field
    assert r["preset"] == "tiny" and r["state_bytes"] == 12 * r["numel"] + 8 and r["numel"] > 0
    for key in ("memcpy_s", "put_s", "fsync_write_s", "join_cached_s", "join_cold_s"):
        assert finite(r[key]) and r[key] > 0, key
    assert finite(r["put_vs_memcpy"], r["join_cold_vs_memcpy"]) and r["put_vs_memcpy"] == r["put_s"] / r["memcpy_s"]


def check_compression_study(tmp: Path, _: str) -> None:
    runs = load(tmp)["runs"]
    assert {(run["method"], run["codec"]) for run in runs} >= {("sync_diloco", "none"), ("async_dn_dylu", "none"),
                                                               ("async_dn_dylu", "int8")}
    assert all(finite(run["loss"]) and run["loss"] > 0 for run in runs)


def check_verify_inner_state(tmp: Path, out: str) -> None:
    rows = load(tmp)
    assert sorted(row["inner_state"] for row in rows) == ["carry", "reset"]
    assert all(row["final"]["local_updates"] > 0 and finite(row["final"]["loss"]) for row in rows)
    assert "geometric mean reset/carry" in out


def check_train_tokenizer(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["vocab_size"] == 512 and r["tokens"] > 0 and 1.0 < r["chars_per_token"] < 10.0
    assert (tmp / "tokenizer" / "tokenizer.json").is_file()


def check_tokenizer_study(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert [x["tokenizer"] for x in r["results"]] == ["embedded", "embedded-32k"]
    assert all(x["steps"] > 0 and finite(x["val_bits_per_byte"]) and x["val_bits_per_byte"] > 0 for x in r["results"])
    assert finite(r["bits_per_byte_ratio"]) and r["bits_per_byte_ratio"] > 0


def check_bench_verify(tmp: Path, _: str) -> None:
    r = load(tmp)
    (size,) = r["sizes"]  # a CPU re-run of a lease is bitwise, with a fresh and with a carried inner state
    assert size["preset"] == "tiny" and size["bitwise"] is True and size["carry_bitwise"] is True
    assert size["revealed_bytes"] > 0 and finite(size["peer_s_per_step"], size["rerun_s_per_step"])
    v = r["runtime"]["verification"]
    assert r["runtime"]["leases"] > 0 and v["checked"] >= 2 and v["failed"] == 0 and not v["expelled"]


def check_verify_tolerance(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["rerun"]["bitwise"] is True and r["rerun"]["rel_error"] == 0.0
    assert r["other_lease"]["bitwise"] is False and r["other_lease"]["rel_error"] > 0.1


def check_bench_swarm_serving(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["parameters"]["downloaders"] == 2 and not r["download_errors"]
    phases = r["phases"]
    assert set(phases) == {"alone", "serving (no cap)"}
    assert all(finite(p["steps_per_s"], p["ratio_to_alone"]) and p["steps_per_s"] > 0 for p in phases.values())
    # (what the serving peer serves in a seconds-long phase depends on who the downloaders reach first: ≥ 0, finite)
    assert finite(phases["serving (no cap)"]["served_mb_per_s"]) and phases["serving (no cap)"]["served_mb_per_s"] >= 0


def check_bench_swarm(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert not r["errors"] and r["numel"] == 200_000
    (row,) = r["rows"]
    for design in ("today", "swarm"):  # every client holds what the coordinator would have sent, bitwise
        assert row[design]["all_bitwise_equal"] and row[design]["downloads"] == 2
        assert finite(row[design]["coordinator_egress_per_version_over_encoding"])
    assert row["swarm"]["coordinator_egress_per_version_over_encoding"] < row["today"]["coordinator_egress_per_version_over_encoding"]


def check_load_test(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["problems"] == [] and r["errors"] == 0 and r["refused"] == 0
    assert r["applied_updates"] == r["acknowledged"] > 0
    assert finite(r["ack_p50_s"], r["lease_p50_s"], r["fetch_p50_s"])


def check_storage_per_update(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["applied_updates"] >= 2 and r["theta_fp32_bytes"] > 0 and r["write_bytes"] > 0
    assert finite(r["per_update_theta"], r["per_update_theta_during_run"]) and r["per_update_theta"] > 0


def check_bench_validator(tmp: Path, _: str) -> None:
    r = load(tmp)
    assert r["verdicts"] >= 1 and r["verdicts_failed"] == 0 and r["all_by_the_validator"] is True
    assert r["applied"] > 0 and r["rerun_steps"] > 0 and 0 < r["rerun_fraction_of_training"] <= 1


def check_download_quality(tmp: Path, _: str) -> None:
    r = load(tmp)
    (row,) = r["rows"]  # one demo run with int8 downloads, its own reference
    assert row["codec"] == "int8" and row["vs_reference"] == 1.0 and finite(row["mean"]) and row["mean"] > 1
    assert 0 < row["download_fraction_per_round"] < 0.5  # int8 θ: a quarter of fp32's bytes, or nothing when held
    assert r["version"] in r["runs"][0]["evals"] or str(r["version"]) in r["runs"][0]["evals"]


def check_download_verify(tmp: Path, _: str) -> None:
    runs = {run["download_codec"]: run for run in load(tmp)["runs"]}
    assert set(runs) == {"none", "int8"}
    for run in runs.values():  # every lease checked, every check bitwise, whatever θ's download codec
        assert run["checks_passed"] == run["rounds"] > 0 and run["checks_failed"] == run["unverifiable"] == 0
        assert finite(run["per_round_vs_fp32"]) and 0 < run["per_round_vs_fp32"] <= 1
    assert runs["int8"]["download_bytes_per_round"] < runs["none"]["download_bytes_per_round"] / 3


def check_build_corpus(tmp: Path, _: str) -> None:
    import lzma

    r = load(tmp)
    assert r["by_source"] == {"austen": 2, "jargon": 2, "devil": 2} and r["documents"] == 6
    docs = [json.loads(line) for line in lzma.decompress((tmp / "corpus.jsonl.xz").read_bytes()).decode().splitlines()]
    assert [d["source"] for d in docs] == ["austen"] * 2 + ["jargon"] * 2 + ["devil"] * 2
    assert docs[0]["title"] == "Pride and Prejudice (1)" and "truth universally acknowledged" in docs[0]["text"]


def check_wan(tmp: Path, _: str) -> None:
    r = load(tmp)  # the home link measured: its tbf rates (a loaded machine gets less) and twice its latency
    assert r["profile"] == "home" and len(r["rtt_s"]) > 0
    assert 0.3 * r["up_mbit_configured"] <= r["up_mbit"] <= 1.25 * r["up_mbit_configured"]
    assert 0.3 * r["down_mbit_configured"] <= r["down_mbit"] <= 1.25 * r["down_mbit_configured"]
    assert min(r["rtt_s"]) >= 2 * r["latency_ms_configured"] / 1000 * 0.97


def check_bench_wan(tmp: Path, _: str) -> None:
    r = load(tmp, "wan/bench_wan.json")
    (row,) = r["rows"]
    assert row["run"] == "sync_diloco-int8" and row["applied"] > 0 and finite(row["ppl_at_budget"])
    assert (tmp / "wan" / "perplexity_vs_time.png").read_bytes()[:4] == b"\x89PNG"


def check_slow_link_sim(tmp: Path, _: str) -> None:
    r = load(tmp)["runs"]
    assert list(r) == ["instant", "upload", "upload_fp32", "upload_poly", "upload_momentum_0.8", "upload_momentum_0.7",
                       "upload_momentum_0.75", "instant_momentum_0.7", "upload_momentum_0.5", "instant_momentum_0.5",
                       "upload_momentum_0.2", "upload_momentum_0.05", "upload_scaled_30", "instant_scaled_30",
                       "upload_lr_0.35", "upload_buffer_5", "upload_scaled_30_sign", "upload_scaled_30_sign_ef_carry",
                       "instant_sign_ef_carry", "upload_scaled_30_sign_ef_reset", "upload_scaled_30_sign_ef_pairs",
                       "upload_scaled_30_sign_ef_segments_4", "upload_scaled_30_sign_ef_after_check_0.75",
                       "upload_scaled_30_sign_ef_carry_batch_4", "upload_eager",
                       "upload_eager_lr", "upload_eager_whole", "upload_scaled_30_sign_ef_carry_eager",
                       "upload_scaled_30_sign_ef_carry_eager_lr", "upload_scaled_30_sign_ef_carry_eager_whole",
                       "upload_scaled_30_sign_ef_carry_eager_lr_ahead", "upload_scaled_30_sign_ef_after_check_0.75_eager_lr"]
    instant = ("instant", "instant_momentum_0.7", "instant_momentum_0.5", "instant_scaled_30", "instant_sign_ef_carry")
    assert all(r[name]["upload_s"] == 0 for name in instant) and r["instant"]["final_vs_instant"] == 1.0
    # the scaled momentum as if H were 30: the smoke's 10-step leases are shorter, so β is the paper's, bitwise
    assert r["upload_scaled_30"]["momentum_reference_steps"] == 30 and r["upload"]["momentum_reference_steps"] is None
    assert (r["upload_scaled_30"]["evals"], r["instant_scaled_30"]["evals"]) == (r["upload"]["evals"], r["instant"]["evals"])
    # an upload of half a lease (the fastest worker's 10 steps at 1 s) delays every update by it: staler updates
    assert all(r[name]["upload_s"] == 5.0 for name in r if name not in instant)
    assert all(r[name]["mean_staleness"] > r["instant"]["mean_staleness"] for name in r if name not in instant)
    assert r["upload_fp32"]["codec"] == "none" and r["upload_poly"]["poly"] == 0.5 and r["upload_eager"]["eager"] is True
    assert [r[name]["momentum"] for name in ("upload_momentum_0.7", "instant_momentum_0.7", "upload")] == [0.7, 0.7, 0.9]
    assert r["upload_lr_0.35"]["outer_lr"] == 0.35 and r["upload_buffer_5"]["buffer_size"] == 5
    assert (r["upload_eager_lr"]["eager"], r["upload_eager_whole"]["eager"]) == ("lr", "whole")
    # the eager starts on the carried setting: the same codec, residual and state, each share its own trajectory
    eager = [r[f"upload_scaled_30_sign_ef_carry_eager{tail}"] for tail in ("", "_lr", "_whole")]
    assert [(e["eager"], e["codec"], e["error_feedback"], e["inner_state"]) for e in eager] == [
        (share, "sgn15of16", True, "carry") for share in (True, "lr", "whole")]
    evals = [r["upload_scaled_30_sign_ef_carry"]["evals"]] + [e["evals"] for e in eager]
    assert all(a[1:] != b[1:] for i, a in enumerate(evals) for b in evals[i + 1:])
    # asking ahead (sim.ask_ahead_s, 0.8 of a lease's steps at the fastest worker's 1 s a step): the eager_lr setting
    ahead = r["upload_scaled_30_sign_ef_carry_eager_lr_ahead"]
    assert (ahead["ask_ahead_s"], r["upload_scaled_30_sign_ef_carry_eager_lr"]["ask_ahead_s"]) == (8.0, 0.0)
    assert ahead["evals"][1:] != eager[1]["evals"][1:]
    # the engine's eager start (schedule.eager_start) on the slow-uplink setting: its own trajectory
    after = r["upload_scaled_30_sign_ef_after_check_0.75_eager_lr"]
    assert (after["eager"], after["carry_after_check"]) == ("lr", 0.75)
    assert after["evals"][1:] != r["upload_scaled_30_sign_ef_after_check_0.75"]["evals"][1:]
    # the sign codec without a residual (fresh leases) and with one carried along with the inner state
    assert [(r[n]["codec"], r[n]["error_feedback"], r[n]["inner_state"]) for n in
            ("upload_scaled_30_sign", "upload_scaled_30_sign_ef_carry", "upload")] == [
        ("sgn15of16", False, "reset"), ("sgn15of16", True, "carry"), ("int4", False, "reset")]
    # the residual carried with AdamW restarted each lease, and dropped at every other upload: a different trajectory
    pairs, whole = r["upload_scaled_30_sign_ef_pairs"], r["upload_scaled_30_sign_ef_reset"]
    assert (pairs["residual_pairs"], whole["residual_pairs"], pairs["inner_state"], whole["error_feedback"]) == (
        True, False, "reset", True)
    assert pairs["evals"] != whole["evals"]
    # state and residual carried across segments of 4 leases, and after leases drawn at 0.75: fresh starts in between
    segments, drawn = r["upload_scaled_30_sign_ef_segments_4"], r["upload_scaled_30_sign_ef_after_check_0.75"]
    carried = r["upload_scaled_30_sign_ef_carry"]
    assert (segments["carry_segment"], drawn["carry_after_check"], segments["inner_state"], drawn["error_feedback"]) == (
        4, 0.75, "carry", True)
    assert segments["evals"] != carried["evals"] and drawn["evals"] != carried["evals"] != segments["evals"]
    # 4 x the rows a step in a quarter of the steps (the toy's 32 rows a step): the rows trained are the same budget
    batched = r["upload_scaled_30_sign_ef_carry_batch_4"]
    assert (carried["batch_multiple"], batched["batch_multiple"]) == (1, 4)
    assert all(e["rows"] == e["local_updates"] * 32 for e in carried["evals"])
    assert all(e["rows"] == e["local_updates"] * 128 for e in batched["evals"])
    assert 2 * max(e["local_updates"] for e in batched["evals"]) < max(e["local_updates"] for e in carried["evals"])
    assert all(run["applied"] > 0 and finite(run["final"], run["max"]) for run in r.values())


def check_gate_own_update(tmp: Path, _: str) -> None:
    r = load(tmp)["results"]["synthetic"]  # three sign-coded peers with error feedback, 40 rounds (6 left out)
    assert r["updates"] == 3 * 40 - 3 - 6 and r["cosine_cap"] == 0.05
    # judged without its sender's last update, an honest sign-coded update agrees more with the consensus
    assert r["without_the_senders_last_update"]["median"] > r["whole_reference"]["median"] > 0
    # memory counted in local steps: leases of at most H steps (the synthetic ones have 2) join as with it in updates;
    # at H = 1 each joins with weight 1 − 0.8² (not 1 − 0.8): a memory of fewer updates, which agrees less here
    same, shorter = r["memory_in_steps"]["2"], r["memory_in_steps"]["1"]
    assert same["memory_steps"] == 2 and same["median_by_third"] == r["median_by_third"] and len(r["median_by_third"]) == 3
    assert same["without_the_senders_last_update"] == r["without_the_senders_last_update"]
    assert same["median_by_peer"] == r["median_by_peer"] and sorted(r["median_by_peer"]) == ["peer0", "peer1", "peer2"]
    assert shorter["without_the_senders_last_update"]["median"] < r["without_the_senders_last_update"]["median"]


SMOKES: dict[str, Smoke] = {
    "bench_coordinator.py": Smoke(["--smoke", "--dir", "{tmp}", "--json", "{tmp}/out.json"], check_bench_coordinator, 150),
    "bench_sim.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_bench_sim, 60),
    "slow_link_sim.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_slow_link_sim, 240),
    "gate_own_update.py": Smoke(["--smoke", "--memory-steps", "1,2", "--json", "{tmp}/out.json"], check_gate_own_update, 90),
    "bench_transport.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_bench_transport, 120),
    "wire_budget.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_wire_budget, 90),
    "bench_kept_states.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_bench_kept_states, 90),
    "compression_study.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_compression_study, 90),
    "verify_inner_state.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_verify_inner_state, 120),
    "train_tokenizer.py": Smoke(["--smoke", "--out", "{tmp}/tokenizer", "--json", "{tmp}/out.json"], check_train_tokenizer, 90),
    "tokenizer_study.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_tokenizer_study, 150),
    "bench_verify.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_bench_verify, 120),
    "verify_tolerance.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_verify_tolerance, 90),
    "bench_swarm_serving.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_bench_swarm_serving, 150, integration=True),
    "bench_swarm.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_bench_swarm, 150, integration=True),
    "load_test.py": Smoke(["--smoke", "--workdir", "{tmp}/run", "--json", "{tmp}/out.json"], check_load_test, 240,
                          integration=True),
    "storage_per_update.py": Smoke(["--smoke", "--workdir", "{tmp}/run", "--json", "{tmp}/out.json"],
                                   check_storage_per_update, 300, integration=True),
    "bench_validator.py": Smoke(["--smoke", "--workdir", "{tmp}/run", "--json", "{tmp}/out.json"], check_bench_validator,
                                420, integration=True),
    "download_quality.py": Smoke(["--smoke", "--out", "{tmp}/runs", "--json", "{tmp}/out.json"], check_download_quality,
                                 420, integration=True),
    "download_verify.py": Smoke(["--smoke", "--json", "{tmp}/out.json"], check_download_verify, 150),
    "build_corpus.py": Smoke(["--smoke", "--out", "{tmp}/corpus.jsonl.xz", "--json", "{tmp}/out.json"], check_build_corpus, 60),
    # wan.py run is bench_wan.py's run_wan (below); its own smoke measures one emulated link
    "wan.py": Smoke(["check", "--profile", "home", "--json", "{tmp}/out.json"], check_wan, 120, integration=True, netns=True),
    "bench_wan.py": Smoke(["--smoke", "--out", "{tmp}/wan"], check_bench_wan, 420, json="wan/bench_wan.json",
                          integration=True, netns=True),
}
# bench_attacks.py and repair_quality.py: one test, the second on the first's run directory
CHAINED = ("bench_attacks.py", "repair_quality.py")


def run_script(name: str, args: list[str], tmp: Path, timeout: int) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(SCRIPTS / name), *(a.replace("{tmp}", str(tmp)) for a in args)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp, env=env,
                               stdin=subprocess.DEVNULL)
    out = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"{' '.join(command)} exited {completed.returncode}:\n{out[-4000:]}"
    return out


def _params() -> list[Any]:
    params = []
    for name, smoke in sorted(SMOKES.items()):
        marks = [pytest.mark.timeout(smoke.timeout + 30)]
        if smoke.integration:
            marks.append(pytest.mark.integration)
        if smoke.netns:
            marks.append(pytest.mark.skipif(NO_NETNS is not None, reason=f"network namespaces unavailable: {NO_NETNS}"))
        params.append(pytest.param(name, marks=marks, id=name.removesuffix(".py")))
    return params


@pytest.mark.parametrize("name", _params())
def test_smoke(name: str, tmp_path: Path) -> None:
    smoke = SMOKES[name]
    out = run_script(name, smoke.args, tmp_path, smoke.timeout)
    if smoke.json:
        assert (tmp_path / smoke.json).is_file(), f"{name} --smoke wrote no {smoke.json}:\n{out[-2000:]}"
    smoke.check(tmp_path, out)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_bench_attacks_then_repair_quality_smoke(tmp_path: Path) -> None:
    """The attack benchmark's smoke (clean and hidden:0.05, gate and verification on: the attacker is caught), then
    repair_quality.py on its attack run (what a repair would have made of θ)."""
    out = tmp_path / "runs"
    run_script("bench_attacks.py", ["--smoke", "--out", str(out), "--json", "{tmp}/attacks.json"], tmp_path, 660)
    r = load(tmp_path, "attacks.json")
    runs = {run["attack"]: run for run in r["runs"]}
    assert set(runs) == {"clean", "hidden:0.05"} and r["verify"] is True
    assert all(finite(run["perplexity"], run["ratio"]) and run["version"] >= 2 for run in runs.values())
    caught = runs["hidden:0.05"]["verification"]  # its probation check failed: expelled
    assert caught["failed"] >= 1 and caught["expelled"] == 1, caught
    assert any(line.startswith("honest refusals") for line in r["acceptance_issue16"])
    # the same run's log replayed without the attacker's submissions: caught before any was applied, θ is the same
    attacked = runs["hidden:0.05"]
    assert finite(attacked["without_perplexity"]) and runs["clean"]["without_perplexity"] is None
    if attacked["hostile"].get("applied", 0) == 0:
        assert attacked["trace"] == 1.0, attacked

    run_script("repair_quality.py", [str(out / "hidden_0.05-gate-on"), "--json", "{tmp}/repair.json"], tmp_path, 200)
    q = load(tmp_path, "repair.json")
    assert q["live_version"] > 0 and finite(q["live_perplexity"], q["rerun"]["perplexity"])
    assert [d["expelled"] for d in q["discards"]].count(True) == 1
    assert all(finite(d["perplexity"]) and d["updates_discarded"] > 0 for d in q["discards"])


@pytest.mark.parametrize("name", SHELL)
@pytest.mark.timeout(30)
def test_shell_script_syntax(name: str) -> None:
    completed = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True, timeout=20)
    assert completed.returncode == 0, completed.stderr


def test_every_script_has_a_smoke() -> None:
    """A script in scripts/ without a smoke here, or a COVERED entry whose test is gone, fails."""
    present = {p.name for p in SCRIPTS.iterdir() if p.is_file() and p.suffix in (".py", ".sh")}
    listed = set(SMOKES) | set(CHAINED) | set(COVERED) | set(SHELL)
    assert present - listed == set(), f"scripts without a smoke mode in {Path(__file__).name}: {sorted(present - listed)}"
    assert listed - present == set(), f"listed here but not in scripts/: {sorted(listed - present)}"
    for script, test in COVERED.items():
        path, _, function = test.partition("::")
        assert f"def {function}(" in (REPO / path).read_text(), f"{script}: its smoke test {test} is gone"
        assert Path(script).stem in (REPO / path).read_text(), f"{test} does not run {script}"
    for name in (*SMOKES, *CHAINED):
        text = (SCRIPTS / name).read_text()
        assert '"--smoke"' in text, f"{name} has no --smoke flag"
