"""The library and its scripts type-check: ``python -m mypy`` with the ``[tool.mypy]`` settings of pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_mypy_passes_on_the_library() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"],  # files, plugins and strictness come from pyproject.toml
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=290,
    )
    assert proc.returncode == 0, f"mypy failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
