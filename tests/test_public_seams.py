"""Tests drive public seams: no test touches a private member of the coordinator daemon or of the logic.

An AST scan of tests/ (and of this repository's scripts/ and asyncloco/testing/, which drive the daemon the same way):
it fails on ``<daemon>._x`` (any private attribute read or written through a name ``daemon``, ``...daemon``, or a
private member the daemon class defines, whatever the receiver is called), on ``logic._x`` (the logic package or one
of its modules, imported under any name) and on ``from asyncloco.coordinator.logic... import _x``. What a test needs
is a public API: ``daemon.node`` (state, decide, the log), ``daemon.serving`` (the RPC handler),
``daemon.durability``, ``daemon.monitoring``, :mod:`asyncloco.coordinator.logic.queries` (the logic's indexes).
The same scan runs over the logic's own modules: they meet through public names only (a name another module uses is
public), and the package's ``__init__`` re-exports exactly its public ``__all__``. It is tried on planted violations too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = [ROOT / "tests", ROOT / "scripts", ROOT / "asyncloco" / "testing"]
DAEMON_FILE = ROOT / "asyncloco" / "coordinator" / "daemon.py"
LOGIC = "asyncloco.coordinator.logic"


def daemon_privates() -> set[str]:
    """The private members the daemon class defines: its methods and the ``self._x`` it assigns."""
    tree = ast.parse(DAEMON_FILE.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CoordinatorDaemon":
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("_") \
                        and not item.name.startswith("__"):
                    names.add(item.name)
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self" \
                        and item.attr.startswith("_") and isinstance(item.ctx, ast.Store):
                    names.add(item.attr)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _receiver_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def absolute_module(node: ast.ImportFrom, package: str) -> str:
    """The module an ``import from`` names, a relative one resolved against ``package`` (the importing file's)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
    return ".".join(parts + ([node.module] if node.module else []))


def scan_source(source: str, path: str = "<planted>", privates: frozenset[str] = frozenset(), package: str = "") -> list[str]:
    """What ``source`` touches of the daemon's or the logic's private members. ``package``: the package the file is
    in, to resolve its relative imports (a module of the logic itself: ``asyncloco.coordinator.logic``)."""
    tree = ast.parse(source)
    found: list[str] = []
    logic_names: set[str] = set()  # local names of the logic package or of its modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == LOGIC or alias.name.startswith(LOGIC + "."):
                    if alias.asname:
                        logic_names.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and (node.module or node.level):
            module = absolute_module(node, package)
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if full == LOGIC or full.startswith(LOGIC + ".") and module.startswith("asyncloco.coordinator"):
                    logic_names.add(alias.asname or alias.name)
                if (module == LOGIC or module.startswith(LOGIC + ".")) and _private(alias.name):
                    found.append(f"{path}:{node.lineno}: imports the logic's private {alias.name}")

    def dotted(node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return f"{dotted(node.value)}.{node.attr}"
        return ""

    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target = (node.value, node.attr)
        elif isinstance(node, ast.Call) and _receiver_name(node.func) in {"getattr", "setattr", "delattr", "hasattr"} \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            target = (node.args[0], node.args[1].value)
        if target is None:
            continue
        receiver, name = target
        receiver_name = _receiver_name(receiver)
        whose = None
        if receiver_name == "daemon" or receiver_name.endswith("daemon") or name in privates:
            whose = "the daemon's"
        elif receiver_name in logic_names or dotted(receiver) == LOGIC or dotted(receiver).startswith(LOGIC + "."):
            whose = "the logic's"
        if whose is not None:
            found.append(f"{path}:{getattr(node, 'lineno', 0)}: touches {whose} private {name}: {ast.unparse(node)[:80]}")
    return found


def test_no_test_touches_a_private_member_of_the_daemon_or_the_logic() -> None:
    privates = frozenset(daemon_privates())
    assert "_carry_out" in privates  # the scan knows the daemon's own
    found = []
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            if path.name == Path(__file__).name:
                continue  # the planted examples below
            found += scan_source(path.read_text(), str(path.relative_to(ROOT)), privates)
    assert not found, "private members of the daemon or the logic touched; use a public seam:\n" + "\n".join(found)


PLANTED = [
    "daemon._save()",
    "await self.daemon._decide(event)",
    "transport.daemon._stopping = True",
    "coordinator._carry_out([])",  # a private the daemon defines, whatever the receiver is called
    "getattr(daemon, '_stop_event')",
    "from asyncloco.coordinator import logic\nlogic._book(state)",
    "import asyncloco.coordinator.logic.leases as leases\nleases._peer_leases(state, 'p')",
    "from asyncloco.coordinator.logic import leases\nleases._fastest_alive(state)",
    "from asyncloco.coordinator.logic.leases import _book",
    "asyncloco.coordinator.logic._book(state)",
]


@pytest.mark.parametrize("planted", PLANTED)
def test_the_scan_catches_a_planted_private(planted: str, tmp_path: Path) -> None:
    path = tmp_path / "test_planted.py"
    path.write_text(planted + "\n")
    assert scan_source(path.read_text(), str(path), frozenset({"_carry_out"})), planted


ALLOWED = [
    "daemon.node.state.version",
    "await daemon.durability.save()",
    "await daemon.node.decide_locked(event)",
    "from asyncloco.coordinator.logic import queries\nqueries.peer_leases(state, 'p')",
    "from asyncloco.coordinator.logic import handle, new_state",
    "wal._fd",  # not the daemon's, not the logic's
    "os._exit(0)",
]


@pytest.mark.parametrize("allowed", ALLOWED)
def test_the_scan_passes_public_seams(allowed: str) -> None:
    assert scan_source(allowed + "\n", privates=frozenset({"_carry_out"})) == []


LOGIC_DIR = ROOT / "asyncloco" / "coordinator" / "logic"


def test_no_logic_module_imports_a_private_name_of_another() -> None:
    """The logic's modules (coordinator/logic/) meet through public names: none imports another module's ``_x`` or
    reads it as ``module._x``, absolute or relative import alike; __init__ included."""
    paths = sorted(LOGIC_DIR.glob("*.py"))
    assert {"__init__.py", "leases.py", "submit.py"} <= {path.name for path in paths}
    found: list[str] = []
    for path in paths:
        found += scan_source(path.read_text(), str(path.relative_to(ROOT)), package=LOGIC)
    assert not found, "the logic's modules use each other's private names; make the name public:\n" + "\n".join(found)


def test_the_logic_package_re_exports_exactly_its_public_all() -> None:
    """logic/__init__.py's ``__all__`` is public names only, and what it imports from its modules (beyond the modules
    themselves, which ``handle`` dispatches to) is exactly that ``__all__``, less what it defines itself."""
    tree = ast.parse((LOGIC_DIR / "__init__.py").read_text())
    exported: set[str] = set()
    defined: set[str] = set()
    imported: set[str] = set()
    modules = {path.stem for path in LOGIC_DIR.glob("*.py")}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
            assert isinstance(node.value, ast.List)
            exported = {element.value for element in node.value.elts if isinstance(element, ast.Constant)}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.ImportFrom) and absolute_module(node, LOGIC).startswith(LOGIC):
            imported.update(alias.asname or alias.name for alias in node.names
                            if not (absolute_module(node, LOGIC) == LOGIC and alias.name in modules))
    assert "handle" in exported and "Lease" in exported
    assert not [name for name in exported if _private(name)], "logic.__all__ names a private name"
    assert imported == exported - defined, (
        f"re-exported but not in __all__: {sorted(imported - exported)}; in __all__ but not there: "
        f"{sorted(exported - defined - imported)}")


PLANTED_IN_LOGIC = [
    "from .leases import _issue",
    "from . import leases\nleases._issue(state, 'p', 0.0, '')",
    "from asyncloco.coordinator.logic.submit import _apply",
    "import asyncloco.coordinator.logic.indexes as indexes\nindexes._book_add(book, lease)",
]


@pytest.mark.parametrize("planted", PLANTED_IN_LOGIC)
def test_the_scan_catches_a_private_name_between_logic_modules(planted: str) -> None:
    assert scan_source(planted + "\n", package=LOGIC), planted
    assert not scan_source(planted.replace("._", ".").replace("import _", "import ") + "\n", package=LOGIC)
