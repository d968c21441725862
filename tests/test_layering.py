"""The layering of docs/design.md ("Layers"), enforced mechanically on the source (no imports executed)."""

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
    "subpackage", ["algo", "sim", "models", "train/inner.py", "train/commitments.py", "coordinator/logic/", "coordinator/methods.py"]
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


MAX_FUNCTION_LINES = 80  # a module is as long as its concern needs (cohesion over a line count); a function is not


def test_functions_stay_small() -> None:
    """No function of the library (docstring included) above MAX_FUNCTION_LINES: a change that grows one past it
    splits it at a seam instead."""
    too_long: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}(): {length} lines")
    assert not too_long, "split these at a seam: " + "; ".join(too_long)


def test_transport_does_not_import_coordinator() -> None:
    """transport/ is below coordinator/: the in-process double that wires a daemon lives in asyncloco/testing/."""
    for path in files("transport"):
        bad = {n for n in imported_roots(path) if n.startswith("asyncloco.coordinator")}
        assert not bad, f"transport/{path.name} imports {bad}; move that code to asyncloco/testing/ or a layer above"


def module_graph() -> dict[str, set[str]]:
    """asyncloco's module import graph from the source (every import statement, lazy and TYPE_CHECKING ones too)."""
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom):
                prefix = base[: len(base) - node.level + 1] if node.level else []
                module = ".".join(prefix + ([node.module] if node.module else []))
                deps.update(m for m in [module] + [f"{module}.{a.name}" for a in node.names] if m in modules)
        graph[name] = deps - {name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative enough for this package)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_import_circle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [{"a", "b", "c"}]


# Known circles still to remove: both are lazy imports inside functions. Nothing may be added here.
KNOWN_CIRCLES: list[set[str]] = []  # config <-> methods (config.METHOD_NAMES) and inner <-> distributed (train/group.py) removed


def test_no_new_import_circles() -> None:
    circles = import_circles(module_graph())
    new = [sorted(c) for c in circles if c not in KNOWN_CIRCLES]
    assert not new, f"import circles {new}: move the shared definitions down a layer"
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in circles]
    assert not gone, f"{gone} no longer a circle: drop it from KNOWN_CIRCLES"


# The layers, lowest first. A module may import its own component (a subpackage, or a module of the top level) and
# the components of lower layers; the components of one layer are siblings and import none of each other; nothing
# imports upwards. Code two siblings (or a layer and one above it) both need moves down to a layer below both —
# the inner trainer, error feedback and commitments to train/, the timing policy beside the config (timings.py),
# the toy workload to models/ — it is never reached for upwards. The root package (asyncloco/__init__.py: the
# version) is the root module only; a new module that is in no component fails the test until it is placed here.
LAYERS: list[tuple[str, ...]] = [
    ("asyncloco", "asyncloco.algo", "asyncloco.clock", "asyncloco.config_base", "asyncloco.durable", "asyncloco.refusals",
     "asyncloco.shipped"),
    ("asyncloco.models", "asyncloco.transport"),  # the model zoo and the wire know nothing of each other
    ("asyncloco.config",),
    ("asyncloco.timings", "asyncloco.overrides", "asyncloco.workloads", "asyncloco.fingerprint"),  # read the config
    ("asyncloco.train",),  # shared by peer/ and coordinator/ (and the simulator): inner loop, feedback, commitments
    ("asyncloco.peer", "asyncloco.coordinator"),  # never import each other
    ("asyncloco.sim", "asyncloco.testing", "asyncloco.validator"),  # drive the peer's and the coordinator's code
    ("asyncloco.local_cluster",),
    ("asyncloco.demo", "asyncloco.wan"),
    ("asyncloco.runtime_cli",),
    ("asyncloco.cli",),
    ("asyncloco.__main__",),
]


def component_of(module: str, layers: list[tuple[str, ...]]) -> tuple[int, str] | None:
    """(layer index, component) of ``module``: the longest component it is or lies inside (the root package only
    as itself); None when it is in none."""
    best: tuple[int, str] | None = None
    for index, components in enumerate(layers):
        for component in components:
            inside = module == component or ("." in component and module.startswith(component + "."))
            if inside and (best is None or len(component) > len(best[1])):
                best = (index, component)
    return best


def layering_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Every edge of ``graph`` that points up a layer or across to a sibling, and every module in no layer, each
    named with what to do about it."""
    problems: list[str] = []
    for module in sorted(graph):
        if component_of(module, layers) is None:
            problems.append(f"{module} is in no layer: place it in LAYERS (tests/test_layering.py)")
    for module in sorted(graph):
        here = component_of(module, layers)
        for dep in sorted(graph[module]):
            there = component_of(dep, layers)
            if here is None or there is None or here[1] == there[1]:
                continue
            if there[0] > here[0]:
                problems.append(f"{module} imports {dep}, a higher layer ({there[1]} is above {here[1]}): move what "
                                f"{module} needs from it down to a layer below {here[1]} (or {module} up)")
            elif there[0] == here[0]:
                problems.append(f"{module} imports {dep}, a sibling ({here[1]} and {there[1]} share a layer and import "
                                f"none of each other): move what both need down to a layer below both")
    return problems


def test_layering_checker_catches_planted_edges() -> None:
    layers = [("asyncloco", "asyncloco.algo"), ("asyncloco.models",), ("asyncloco.peer", "asyncloco.coordinator")]
    graph = {
        "asyncloco": set(),
        "asyncloco.algo.outer": set(),
        "asyncloco.models.lm": {"asyncloco.algo.outer", "asyncloco.peer.runner"},  # up
        "asyncloco.peer.runner": {"asyncloco.coordinator.methods", "asyncloco", "asyncloco.models.lm"},  # a sibling
        "asyncloco.coordinator.methods": {"asyncloco.coordinator.logic"},  # its own component: fine
        "asyncloco.coordinator.logic": set(),
        "asyncloco.stray": set(),  # in no layer: the root package covers only itself
    }
    problems = layering_violations(graph, layers)
    assert len(problems) == 3, problems
    assert problems[0].startswith("asyncloco.stray is in no layer")
    assert "asyncloco.models.lm imports asyncloco.peer.runner, a higher layer" in problems[1]
    assert "asyncloco.peer.runner imports asyncloco.coordinator.methods, a sibling" in problems[2]


def test_imports_only_point_down() -> None:
    """The import graph (every import statement, lazy and TYPE_CHECKING ones too) has no edge from a lower layer to a
    higher one and none between siblings (peer/ and coordinator/ above all)."""
    problems = layering_violations(module_graph(), LAYERS)
    assert not problems, "imports against the layering:\n" + "\n".join(problems)



# The coordinator logic's modules (coordinator/logic/), lowest first, as its package docstring lists them: each imports
# only modules of the rows above its own (siblings in a row import none of each other); __init__ (handle) is on top.
LOGIC = "asyncloco.coordinator.logic"
LOGIC_LAYERS: list[tuple[str, ...]] = [
    ("state",),
    ("events",),
    ("indexes", "draws"),  # the derived indexes · which leases are re-run
    ("leases",),  # RequestWork, Fetched, HoldDropped: issuing, grace windows, give-backs, expiry, θ retention
    ("peers", "submit"),  # SpeedReport, Hello, Tick, PeerLeft, Restarted · SubmitUpdate, Discard
    ("verification", "queries"),  # Verified, Unverified, Repaired · the indexes, read-only
    ("admission",),  # Admit, Revoke, Fingerprint (a revocation is a departure and drops held updates)
    ("__init__",),
]


def test_the_logic_modules_import_only_down() -> None:
    """Inside coordinator/logic/, every import points to a row below (LOGIC_LAYERS); a new module is placed there."""
    rank = {name: index for index, row in enumerate(LOGIC_LAYERS) for name in row}
    graph = module_graph()
    problems: list[str] = []
    for module in sorted(m for m in graph if m == LOGIC or m.startswith(LOGIC + ".")):
        here = "__init__" if module == LOGIC else module[len(LOGIC) + 1:]
        if here not in rank:
            problems.append(f"{module} is in no row of LOGIC_LAYERS (tests/test_layering.py): place it")
            continue
        for dep in sorted(graph[module]):
            if dep == LOGIC:  # ``from asyncloco.coordinator.logic import x`` reads __init__, the top row
                problems.append(f"{module} imports from the package {LOGIC}: import the module it needs by its own name")
                continue
            if not dep.startswith(LOGIC + "."):
                continue
            there = dep[len(LOGIC) + 1:]
            if there in rank and rank[there] >= rank[here]:
                problems.append(f"{module} imports {dep}, {'a sibling' if rank[there] == rank[here] else 'a higher row'}")
    assert not problems, "the logic's modules against their order:\n" + "\n".join(problems)


def test_each_module_logs_under_its_own_name() -> None:
    """A module that logs has its own ``logger = logging.getLogger(__name__)`` (a log line names the module that wrote
    it): no logger bound to another name, none imported from another module."""
    wrong: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = str(path.relative_to(PACKAGE))
        own = False
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) \
                    and node.value.func.attr == "getLogger":
                if [ast.unparse(arg) for arg in node.value.args] != ["__name__"]:
                    wrong.append(f"{where}:{node.lineno} {ast.unparse(node)}")
                own = own or any(isinstance(target, ast.Name) and target.id == "logger" for target in node.targets)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any((alias.asname or alias.name) == "logger" for alias in node.names):
                wrong.append(f"{where}:{node.lineno} imports another module's logger")
        uses = any(isinstance(node, ast.Name) and node.id == "logger" for node in ast.walk(tree))
        if uses and not own:
            wrong.append(f"{where} uses a logger it does not define as logging.getLogger(__name__)")
    assert not wrong, "log under the module's own name: " + "; ".join(wrong)
