"""The typed config tree: every shipped YAML loads, typos and cross-field mistakes fail with a useful
message, and the ``asyncloco simulate`` entry point runs a small config end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import yaml

from asyncloco.cli import main
from asyncloco.config import RunConfig, load_config
from asyncloco.coordinator.methods import METHODS

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _write(tmp_path: Path, raw: dict[str, Any], name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _error(tmp_path: Path, raw: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as info:
        load_config(_write(tmp_path, raw))
    return str(info.value)


# ------------------------------------------------------------------------------ shipped configs


def test_there_are_shipped_configs() -> None:
    assert REPO / "configs" / "toy.yaml" in SHIPPED


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.schedule.method in METHODS
    assert all(m in METHODS for m in cfg.sim.methods)
    # the YAML says what it means: every key written in the file survives into the typed tree
    raw = yaml.safe_load(path.read_text())
    dumped = cfg.model_dump()
    for section, values in raw.items():
        if isinstance(values, dict):
            for key in values:
                assert key in dumped[section], f"{path.name}: {section}.{key}"


def test_toy_config_matches_the_paper_setup() -> None:
    cfg = load_config(REPO / "configs" / "toy.yaml")
    assert cfg.task.kind == "toy" and cfg.task.dim == 512 and cfg.task.classes == 4
    assert cfg.task.clusters_per_class == 8 and cfg.task.noise == 0.5 and cfg.task.points == 128_000
    assert cfg.task.batch_size == 32 and cfg.task.num_shards == 4
    assert cfg.sim.workers == 4 and cfg.sim.profile == "very"
    assert cfg.schedule.max_local_steps == 20 and cfg.schedule.grace_period == 0.5
    assert cfg.inner.lr == 2e-4


# ------------------------------------------------------------------------------ errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(path)


@pytest.mark.parametrize(
    "raw,key",
    [
        ({"sim": {"wokers": 4}}, "wokers"),
        ({"schedule": {"grace": 0.5}}, "grace"),
        ({"outer": {"nesterov": True}}, "nesterov"),
        ({"task": {"kind": "toy", "hidden_size": 8}}, "hidden_size"),
        ({"trainer": {}}, "trainer"),
    ],
)
def test_unknown_keys_are_rejected_by_name(tmp_path: Path, raw: dict[str, Any], key: str) -> None:
    message = _error(tmp_path, raw)
    assert key in message and "unknown key" in message


@pytest.mark.parametrize(
    "raw,fragments",
    [
        ({"schedule": {"max_local_steps": 5, "min_steps": 6}}, ["schedule.min_steps (6)", "max_local_steps (5)"]),
        ({"outer": {"activation": 0.3}, "sim": {"workers": 4}}, ["outer.activation", "1/N = 0.25"]),
        ({"outer": {"activation": 0.3, "buffer_size": 2}, "sim": {"workers": 4}}, None),  # 1/N = 0.5: fine
        ({"schedule": {"method": "async_dn_dyl"}}, ["unknown schedule.method", "async_dn_dylu"]),
        ({"sim": {"methods": ["sync_diloco", "fedavg"]}}, ["unknown sim.methods", "fedavg"]),
        ({"sim": {"workers": 4, "profile": [1.0, 2.0, 3.0]}}, ["lists 3 speeds but sim.workers is 4"]),
        ({"sim": {"workers": 2, "profile": [1.0, -2.0]}}, ["must be positive"]),
        ({"sim": {"profile": "extreme"}}, ["sim.profile"]),
        ({"inner": {"lr": 1e-4, "min_lr": 1e-3}}, ["inner.min_lr", "inner.lr"]),
        ({"inner": {"warmup_steps": 100, "total_steps_per_shard": 100}}, ["total_steps_per_shard"]),
        ({"outer": {"momentum": 1.0}}, ["outer.momentum"]),
        ({"outer": {"lr": 0}}, ["outer.lr"]),
    ],
)
def test_cross_field_rules(tmp_path: Path, raw: dict[str, Any], fragments: list[str] | None) -> None:
    if fragments is None:
        assert load_config(_write(tmp_path, raw)).outer.activation == 0.3
        return
    message = _error(tmp_path, raw)
    assert message.startswith("invalid config")
    for fragment in fragments:
        assert fragment in message, message


def test_overrides_and_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, {"name": "x", "task": {"dim": 8}})
    cfg = load_config(path, {"sim.total_local_updates": 77, "schedule.grace_period": 0.0})
    assert cfg.task.kind == "toy" and cfg.task.dim == 8
    assert cfg.sim.total_local_updates == 77 and cfg.schedule.grace_period == 0.0
    with pytest.raises(ValueError, match="unknown key"):
        load_config(path, {"sim.bogus": 1})
    frozen = load_config(path)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        frozen.sim.workers = 3  # type: ignore[misc]


# ------------------------------------------------------------------------------ CLI


SMALL_TOY = {
    "name": "cli-toy",
    "seed": 0,
    "task": {"kind": "toy", "dim": 16, "hidden": 16, "clusters_per_class": 2, "points": 2048, "eval_points": 256},
    "inner": {"lr": 1e-2, "min_lr": 1e-3, "total_steps_per_shard": 200},
    "schedule": {"max_local_steps": 5, "grace_period": 0.5},
    "sim": {"workers": 4, "profile": "very", "total_local_updates": 60, "eval_every": 20, "methods": sorted(METHODS)},
}


@pytest.mark.timeout(180)
def test_cli_simulate_writes_table_summary_plot_and_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, SMALL_TOY, "small.yaml")
    out = tmp_path / "out"
    assert main(["simulate", "--config", str(config), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for method in METHODS:
        assert f"[{method}]" in printed, method
    run_dir = out / "cli-toy"
    png = (run_dir / "comparison.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sorted(row["method"] for row in summary) == sorted(METHODS)
    assert summary[0]["method"] == "sync_diloco"  # runs first: its final loss is everyone's target
    for row in summary:
        assert row["final"]["local_updates"] >= 60 and row["applied"] > 0
        trace = (run_dir / f"trace-{row['method']}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in trace]
        assert {r["type"] for r in records} >= {"task", "applied", "eval"}
        assert all(r["method"] == row["method"] for r in records)


@pytest.mark.timeout(60)
def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, {"sim": {"wokers": 2}}, "bad.yaml")
    assert main(["simulate", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "wokers" in err and "unknown key" in err
    assert not (tmp_path / "out").exists()
