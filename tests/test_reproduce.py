"""``asyncloco reproduce`` on a tiny budget: the table's cells are the seeds' runs, exactly."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from asyncloco.cli import main
from asyncloco.config import load_config
from asyncloco.sim.engine import Simulation
from asyncloco.sim.reproduce import interpolate, parse_speeds, plan

TINY = """\
name: tiny
task: {kind: toy, dim: 8, hidden: 8, clusters_per_class: 2, points: 1024, eval_points: 128, batch_size: 32}
inner: {lr: 2.0e-3, min_lr: 2.0e-4, total_steps_per_shard: 200}
schedule: {max_local_steps: 5, grace_period: 0.5}
sim: {workers: 2, profile: [1.0, 2.0], total_local_updates: 30, eval_every: 10}
"""


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.mark.timeout(240)
def test_reproduce_table_1_with_custom_speeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    (tmp_path / "speeds.txt").write_text("1.0\n2.0\n")
    out, figure = tmp_path / "reproduction.md", tmp_path / "fig.png"
    argv = ["reproduce", "--table", "1", "--seeds", "2", "--config", str(config), "--speeds", str(tmp_path / "speeds.txt"),
            "--total-local-updates", "30", "--out", str(out), "--figure", str(figure)]
    assert main(argv) == 0
    text = out.read_text()
    assert capsys.readouterr().out.startswith(text)  # printed as well
    assert figure.stat().st_size > 0 and "![reproduction](fig.png)" in text
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| custom |")}
    assert list(rows) == ["Sync DiLoCo", "Async DiLoCo", "Async DN", "Async DN + DyLU"]
    assert "| 1.0000 ± 0.0000 |" in rows["Sync DiLoCo"]
    # the DN + DyLU cell is the mean ± std of the two seeds' runs, recomputed here independently
    losses = []
    for seed in (0, 1):
        cfg = load_config(config, {"seed": seed, "sim.seed": seed, "sim.eval_every": 1})
        losses.append(Simulation(cfg, "async_dn_dylu").run().final["loss"])
    expected = f"| {statistics.fmean(losses):.4f} ± {statistics.stdev(losses):.4f} |"
    assert expected in rows["Async DN + DyLU"]
    assert "## Check (Table 1, mean over seeds)" in text and "- custom: DN + DyLU / sync = " in text


def test_plan_shares_runs_between_tables() -> None:
    the_plan = plan(["1", "2", "3", "4"])
    runs = the_plan.runs()
    assert [s.name for s in runs] == ["none", "slight", "moderate", "very", "k=8", "k=16"]
    very = next(s for s in runs if s.name == "very")
    # Table 1's 4 + Table 3's 4 new (SGD, SGD-momentum, Adam, c = 0.1) + Table 4's 2 new (no grace)
    assert len(runs[very]) == 10 and runs[very][0] == ("sync_diloco", ())
    assert sum(len(v) for v in runs.values()) == 4 * 3 + 10 + 3 + 3
    assert next(s for s in runs if s.name == "k=16").speeds == interpolate((0.58, 0.75, 1.51, 3.33), 16)


def test_speeds_parsing_and_errors(tmp_path: Path) -> None:
    assert parse_speeds("0.5,1.2, 3") == (0.5, 1.2, 3.0)
    path = tmp_path / "s.txt"
    path.write_text("0.5 1.5\n2\n")
    assert parse_speeds(str(path)) == (0.5, 1.5, 2.0)
    with pytest.raises(ValueError, match="seconds per step as numbers"):
        parse_speeds("fast,slow")
    with pytest.raises(ValueError, match="positive"):
        parse_speeds("1,-2")
    assert interpolate((1.0, 4.0), 3) == (1.0, 2.0, 4.0)
    c_plan = plan(["3"], speeds=[1.0] * 16)  # c = 0.1 exceeds 1/N for 16 workers: capped at 1/16
    assert [r.label for r in c_plan.rows][-1] == "Async DN + DyLU, c = 0.0625"
