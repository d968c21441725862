"""The layering of docs/algorithm.md §9, enforced mechanically on the source (no imports executed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "asyncloco"
STDLIB = set(sys.stdlib_module_names)


def imported_roots(path: Path) -> set[str]:
    """Top-level names of every module a file imports (absolute imports; relative ones are internal)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def files(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


@pytest.mark.parametrize("path", files("algo"), ids=lambda p: p.name)
def test_algo_is_pure(path: Path) -> None:
    allowed_third_party = {"torch", "numpy"}
    for name in imported_roots(path):
        root = name.split(".")[0]
        assert root in STDLIB or root in allowed_third_party or name.startswith("asyncloco.algo"), (
            f"{path.name} imports {name}: algo/ may import only torch, numpy, the stdlib and itself"
        )
    source = path.read_text()
    for forbidden in ("time.time(", "time.monotonic(", "random.random(", "torch.manual_seed(", "open("):
        assert forbidden not in source, f"{path.name} uses {forbidden!r}: algo/ has no clock, I/O or global RNG"


@pytest.mark.parametrize(
    "subpackage", ["algo", "sim", "models", "peer/inner.py", "coordinator/logic.py", "coordinator/methods.py"]
)
def test_only_transport_and_runtimes_import_hivemind(subpackage: str) -> None:
    target = PACKAGE / subpackage
    paths = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert paths
    for path in paths:
        offenders = {n for n in imported_roots(path) if n.split(".")[0] == "hivemind" or n.startswith("asyncloco.transport")}
        assert not offenders, f"{path.relative_to(PACKAGE)} imports {offenders}; only transport/ and the runtimes may"


def test_models_know_nothing_about_peers_or_coordinator() -> None:
    for path in files("models"):
        bad = {n for n in imported_roots(path) if n.startswith(("asyncloco.peer", "asyncloco.coordinator", "asyncloco.sim"))}
        assert not bad, f"models/{path.name} imports {bad}"


def test_no_print_in_library_code() -> None:
    allowed = {"cli.py", "runtime_cli.py", "demo.py"}  # user-facing entry points print their results
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in allowed:
            continue
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
        assert not calls, f"{path.relative_to(PACKAGE)} calls print(); use logging"
