"""scripts/bench_peer.py runs end to end with tiny step counts and writes what it printed as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_bench_peer_tiny_prints_and_writes_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_peer.py"), "--smoke", "--untimed", "--commitments", "--json", str(out)],
        capture_output=True, text=True, timeout=200, cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["device"] == "cpu" and result["threads"] == 1
    assert len(result["peer_samples"]) == len(result["plain_samples"]) == len(result["untimed_samples"]) == 2
    assert result["untimed_ratio"] == pytest.approx(result["peer_untimed_tokens_per_s"] / result["plain_tokens_per_s"])
    assert result["peer_tokens_per_s"] > 0 and result["plain_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["peer_tokens_per_s"] / result["plain_tokens_per_s"])
    assert f"ratio peer / plain: {result['ratio']:.3f}" in completed.stdout
    # the commitments: one layout per lease (the start of each is the previous end), 3 leases for 2 timed repeats
    assert len(result["commit_samples"]) == 2 and result["commit_layouts"] == 1 + 3
    assert result["commit_s"] == pytest.approx(sorted(result["commit_samples"])[0] / 2 + sorted(result["commit_samples"])[1] / 2)
    assert result["commit_memcpy_ratio"] == pytest.approx(result["commit_s"] / result["memcpy_theta_s"])
    assert len(result["commit_path_samples"]) == 2
    assert all(path <= total for path, total in zip(result["commit_path_samples"], result["commit_samples"]))
    assert result["commit_lease_fraction"] == pytest.approx(result["commit_s"] / (result["commit_s"] + result["lease_s"]))


@pytest.mark.timeout(120)
def test_bench_peer_refuses_cuda_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the CUDA path is not an error here")
    completed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_peer.py"), "--device", "cuda"],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )
    assert completed.returncode == 2
    assert "no CUDA device is visible" in completed.stderr and "Traceback" not in completed.stderr
