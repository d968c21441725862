"""One way for coordinator state to change: the node's decide path (asyncloco/coordinator/node.py).

An AST scan of the package: outside the logic (asyncloco/coordinator/logic/, which ``handle`` is made of) and the
node, no code assigns the coordinator's live state or writes into it, and no code but the node appends to the
write-ahead log. The live state is what a holder of it hands out — ``<node|daemon|coordinator|port>.state`` (or
``port.state()``) — and every local name bound to a part of it (``live = daemon.state``, ``book =
node.state.verification``, ``for lease in node.state.leases.values()``). A write is an assignment, augmented
assignment or ``del`` through it, a call of a mutating method on it (``append``, ``pop``, ``update``,
``load_state_dict``, a tensor's in-place ``copy_`` ...) or a ``handle(<live state>, ...)``. Scratch states (the
repair's replay in coordinator/repair.py, the simulator's own) are not the coordinator's and are not flagged.

The scanner is tried on planted violations too, so that it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Iterator, Optional

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "asyncloco"
STATE_ALLOWED = ("coordinator/logic/", "coordinator/node.py")  # the decide path: handle, and the node that runs it
WAL_ALLOWED = ("coordinator/node.py", "coordinator/wal.py")  # the node appends; wal.py is the log itself

HOLDERS = {"node", "daemon", "coordinator", "port"}  # what holds the live coordinator state as ``.state``
HOLDER_CLASSES = {"CoordinatorNode", "CoordinatorDaemon"}  # ``self.state`` inside them is the live state
MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "sort", "reverse", "load_state_dict", "step", "copy_", "add_", "sub_", "mul_", "div_", "zero_", "fill_",
    "lerp_", "addcmul_", "addcdiv_", "__setitem__", "__delitem__",
}
READERS = {"values", "items", "keys", "get"}  # calls through which a part of the state is still the state's


def _name(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, path: str, check_state: bool, check_wal: bool) -> None:
        self.path = path
        self.check_state = check_state
        self.check_wal = check_wal
        self.found: list[str] = []
        self.classes: list[str] = []
        self.tainted: list[set[str]] = [set()]  # per function: local names bound to a part of the live state
        self.wal_names: list[set[str]] = [set()]  # per function: local names bound to the log

    # --- what the live state is

    def is_live(self, node: ast.AST) -> bool:
        """``node`` is the live state itself: ``<holder>.state``, ``port.state()``, ``self.state`` of a holder class."""
        if isinstance(node, ast.Call) and not node.args:
            node = node.func
        if not (isinstance(node, ast.Attribute) and node.attr == "state"):
            return False
        holder = node.value
        if isinstance(holder, ast.Name) and holder.id == "self":
            return bool(self.classes) and self.classes[-1] in HOLDER_CLASSES
        return _name(holder) in HOLDERS

    def reaches(self, node: ast.AST) -> bool:
        """``node`` is the live state or a part of it (attributes, items, views of them)."""
        while True:
            if self.is_live(node):
                return True
            if isinstance(node, (ast.Attribute, ast.Subscript)):
                node = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in READERS:
                node = node.func.value
            elif isinstance(node, ast.Name):
                return node.id in self.tainted[-1]
            else:
                return False

    def is_wal(self, node: ast.AST) -> bool:
        name = _name(node)
        return name is not None and (name == "wal" or name in self.wal_names[-1])

    # --- scopes

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.tainted.append(set(self.tainted[-1]))  # closures see their enclosing function's names
        self.wal_names.append(set(self.wal_names[-1]))
        self.generic_visit(node)
        self.tainted.pop()
        self.wal_names.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    # --- bindings and writes

    def bind(self, target: ast.AST, value: Optional[ast.AST]) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) else None
            for i, element in enumerate(target.elts):
                self.bind(element, values[i] if values is not None else value)
            return
        if isinstance(target, ast.Starred):
            self.bind(target.value, value)
            return
        if isinstance(target, ast.Name):
            if value is not None and self.reaches(value):
                self.tainted[-1].add(target.id)
            else:
                self.tainted[-1].discard(target.id)
            if value is not None and self.is_wal(value) and not isinstance(value, ast.Call):
                self.wal_names[-1].add(target.id)
            return
        self.write(target)

    def write(self, target: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.write(element)
        elif isinstance(target, (ast.Attribute, ast.Subscript)) and self.reaches(target):
            self.flag(target, "writes coordinator state")

    def flag(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.path}:{getattr(node, 'lineno', 0)}: {what}: {ast.unparse(node)[:100]}")

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            if self.check_state:
                self.bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if self.check_state:
            self.bind(node.target, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.generic_visit(node)
        if self.check_state:
            self.write(node.target)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.generic_visit(node)
        if self.check_state:
            for target in node.targets:
                self.write(target)

    def visit_For(self, node: ast.For | ast.AsyncFor | ast.comprehension) -> None:
        if self.check_state:
            self.visit(node.iter)
            if self.reaches(node.iter):
                for name in ast.walk(node.target):
                    if isinstance(name, ast.Name):
                        self.tainted[-1].add(name.id)
            for child in ast.iter_child_nodes(node):
                if child is not node.iter:
                    self.visit(child)
        else:
            self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        self.generic_visit(node)
        if self.check_state:
            for item in node.items:
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, item.context_expr)

    visit_AsyncWith = visit_With

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.generic_visit(node)
        if self.check_state:
            self.bind(node.target, node.value)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        if self.check_state:
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS and self.reaches(func.value):
                self.flag(node, "changes coordinator state")
            if _name(func) == "handle" and node.args and self.reaches(node.args[0]):
                self.flag(node, "handles an event on the live state outside the node")
            if _name(func) in {"setattr", "delattr"} and node.args and self.reaches(node.args[0]):
                self.flag(node, "writes coordinator state")
        if self.check_wal and isinstance(func, ast.Attribute):
            if func.attr == "append_event" or (func.attr == "append" and self.is_wal(func.value)):
                self.flag(node, "appends to the write-ahead log outside the node")


def scan_source(source: str, path: str = "<planted>", check_state: bool = True, check_wal: bool = True) -> list[str]:
    """Every write into the live coordinator state and every append to the log in ``source``."""
    scan = _Scan(path, check_state, check_wal)
    scan.visit(ast.parse(source))
    return scan.found


def package_violations() -> Iterator[str]:
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        check_state = not relative.startswith(STATE_ALLOWED)
        check_wal = relative not in WAL_ALLOWED
        if check_state or check_wal:
            yield from scan_source(path.read_text(), f"asyncloco/{relative}", check_state, check_wal)


def test_coordinator_state_changes_only_on_the_nodes_decide_path() -> None:
    found = list(package_violations())
    assert not found, "coordinator state changed, or the log appended, outside the node's decide path:\n" + "\n".join(found)


PLANTED = [
    "daemon.state = rebuilt",
    "self.daemon.state = rebuilt",
    "self.node.state.version = 3",
    "node.state.version += 1",
    "daemon.state.leases[lease_id] = lease",
    "del self.node.state.leases[lease_id]",
    "self.port.state().verification.expelled[peer] = 'why'",
    "daemon.state.verification.held.pop(lease_id)",
    "node.state.load_state_dict(snapshot)",
    "daemon.state.params.copy_(theta)",
    "live = daemon.state\nlive.version = 4",
    "book = self.daemon.state.verification\nbook.pending.clear()",
    "state, stats = self.node.state, self.stats\nstate.load_state_dict(x)",
    "for lease in node.state.leases.values():\n    lease.deadline = 0.0",
    "handle(daemon.state, event, now)",
    "logic.handle(self.node.state, event, now)",
    "daemon.wal.append_event(event, now)",
    "self.node.wal.append(record)",
    "wal = self.node.wal\nwal.append(record)",
    "class CoordinatorDaemon:\n    def f(self):\n        self.state = rebuilt",
]


@pytest.mark.parametrize("planted", PLANTED)
def test_the_scan_catches_a_planted_violation(planted: str, tmp_path: Path) -> None:
    source = "async def somewhere(daemon, node, event, now, theta, lease, lease_id, peer, snapshot, record):\n" + \
        textwrap.indent(planted, "    ") + "\n"
    planted_file = tmp_path / "planted.py"
    planted_file.write_text(source)
    assert scan_source(planted_file.read_text(), str(planted_file)), planted


ALLOWED = [
    "theta = daemon.state.params.clone()\ntheta.add_(1.0)",  # a copy
    "version = node.state.version\nversion += 1",  # an int read out
    "state = fresh_state()\nstate.load_state_dict(snapshot)\nstate.version = 2",  # a scratch state (the repair's)
    "self.state = new_state()",  # the simulator's own (not a holder class)
    "optimizer.state.clear()",  # torch's
    "records.append(record)",
    "await node.decide(event)",
    "node.apply_repair(rebuilt, repaired, log=True)",
    "live = daemon.state\nlive = other\nlive.version = 4",  # rebound before the write
]


@pytest.mark.parametrize("allowed", ALLOWED)
def test_the_scan_passes_what_is_not_a_change(allowed: str) -> None:
    source = "def somewhere(daemon, node, event, snapshot, optimizer, records, rebuilt, repaired, other):\n" + \
        textwrap.indent(allowed, "    ") + "\n"
    assert scan_source(source) == []


def test_the_scan_reads_the_node_itself_and_finds_its_writes() -> None:
    """The node is exempt, not invisible: scanned as if it were anywhere else, its own writes are found."""
    found = scan_source((PACKAGE / "coordinator" / "node.py").read_text(), "node.py")
    assert any("appends to the write-ahead log" in line for line in found)
    assert any("writes coordinator state" in line for line in found)


def test_the_node_logs_a_repair_before_it_installs_it(tmp_path: Path) -> None:
    """node.apply_repair: live, the Repaired record is appended while the old state is still in place, then the
    rebuilt state installed; replaying (``log`` False) only installs; a log that cannot be written installs nothing
    and stops the coordinator, as decide does."""
    from typing import Any

    from asyncloco.clock import SYSTEM_CLOCK
    from asyncloco.coordinator.logic import Repaired
    from asyncloco.coordinator.node import CoordinatorNode

    old: Any = object()
    rebuilt: Any = object()
    repaired = Repaired(("mal",), 7, 12, (), (), (), (), remedy="rerun")
    seen: list[tuple[object, object]] = []

    class Log:
        broken = False

        def append_event(self, event: object, now: float, attachments: object = None) -> None:
            if self.broken:
                raise OSError("disk full")
            seen.append((event, node.state))

    node = CoordinatorNode(old, tmp_path, SYSTEM_CLOCK)
    node.wal = Log()  # type: ignore[assignment]
    node.apply_repair(rebuilt, repaired, log=True)
    assert seen == [(repaired, old)] and node.state is rebuilt

    node.apply_repair(old, repaired, log=False)  # a --resume replay: the record is in the log already
    assert len(seen) == 1 and node.state is old

    node.wal.broken = True  # type: ignore[attr-defined]
    with pytest.raises(OSError):
        node.apply_repair(rebuilt, repaired, log=True)
    assert node.state is old and node.stopping
