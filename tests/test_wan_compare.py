"""scripts/wan.py compare (asyncloco/wan/compare.py): a run against its twin at equal local steps, on journals whose
curves have closed forms."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from asyncloco.wan.compare import compare, perplexity_at, read_curve, steps_to

ROOT = Path(__file__).resolve().parents[1]
SCALE = 5000.0  # the twin: perplexity 1000 · exp(−steps / SCALE), exactly log-linear between any two evaluations


def journal(directory: Path, curve: list[tuple[int, float]], cut: str = "") -> Path:
    (directory / "coordinator").mkdir(parents=True)
    records = [{"type": "assign", "peer": "p", "steps": 30}]
    records += [{"type": "eval", "version": i, "local_updates": s, "perplexity": p} for i, (s, p) in enumerate(curve)]
    text = "".join(json.dumps(r) + "\n" for r in records) + cut
    (directory / "coordinator" / "events.jsonl").write_text(text)
    return directory


def twin_ppl(steps: float) -> float:
    return 1000.0 * math.exp(-steps / SCALE)


@pytest.mark.timeout(60)
def test_a_constant_lag_is_found_in_steps_and_its_ratio_in_closed_form(tmp_path: Path) -> None:
    lag = 600
    twin = journal(tmp_path / "twin", [(s, twin_ppl(s)) for s in range(0, 12_001, 100)])
    # the run: the twin's curve 600 steps later, evaluated at other steps; a last line cut short by a stop
    run_steps = [0, *range(650, 9_001, 350)]
    run = journal(tmp_path / "run", [(s, twin_ppl(max(0, s - lag))) for s in run_steps], cut='{"type": "ev')
    got = compare(read_curve(run), read_curve(twin))
    assert got["common_local_steps"] == run_steps[-1] == 8_700
    # run / twin at s = exp(lag / SCALE) wherever s ≥ lag: the same at every evaluation, so also their geometric mean
    assert got["last_third"] == round(math.exp(lag / SCALE), 4) == 1.1275
    third = [s for s in run_steps if s >= 2 * 8_700 / 3]
    assert got["last_third_evaluations"] == len(third) == 9
    assert got["at_end"] == {"local_steps": 8_700, "ratio": 1.1275}
    assert [row["lag_steps"] for row in got["lag"]] == [lag] * (len(run_steps) - 1)
    assert got["lag"][0] == {"local_steps": 650, "perplexity": round(twin_ppl(50), 2), "twin_reached_it_at": 50,
                             "lag_steps": 600}


@pytest.mark.timeout(60)
def test_interpolation_is_log_linear_and_none_outside_the_curve() -> None:
    curve = [(0, 1000.0), (100, 10.0)]
    assert perplexity_at(curve, 50) == pytest.approx(100.0, rel=1e-12)  # the geometric mean of the two
    assert perplexity_at(curve, 101) is None
    assert steps_to(curve, 100.0) == pytest.approx(50.0, rel=1e-12)
    assert steps_to(curve, 5.0) is None
    # a spike: the first time the curve reaches a value counts
    assert steps_to([(0, 1000.0), (100, 100.0), (200, 900.0), (300, 50.0)], 500.0) == pytest.approx(
        100 * math.log(2) / math.log(10), rel=1e-12)


@pytest.mark.timeout(120)
def test_the_command_prints_and_writes_the_comparison_and_names_a_missing_run(tmp_path: Path) -> None:
    twin = journal(tmp_path / "twin", [(s, twin_ppl(s)) for s in range(0, 3_001, 300)])
    run = journal(tmp_path / "run", [(s, twin_ppl(s) * 1.02) for s in range(0, 3_001, 500)])
    out = tmp_path / "compare.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "wan.py"), "compare", str(run), str(twin),
                           "--json", str(out)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert written["last_third"] == 1.02 and written["at_end"] == {"local_steps": 3_000, "ratio": 1.02}
    assert "× the twin over the last third of 3000 common local steps: 1.020 (3 evaluations)" in done.stdout
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "wan.py"), "compare", str(tmp_path / "none"),
                              str(twin)], capture_output=True, text=True, timeout=100)
    assert missing.returncode == 2
    assert f"{tmp_path / 'none' / 'coordinator' / 'events.jsonl'} does not exist" in missing.stderr
    one = journal(tmp_path / "one", [(0, 1000.0)])
    with pytest.raises(ValueError, match="has 1 evaluation"):
        read_curve(one)
