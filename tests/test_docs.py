"""The docs cannot drift from the code or rot: the generated reference is current, every relative link (and its
#heading) resolves, every results file is cited (and every cited one exists), and the README stays short.

Fast (no processes, no network): the reference is regenerated in memory from the config classes and the argparse
parser, and compared with the committed files.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200
CI_TEST_COMMAND = "bash scripts/setup.sh && python -m pytest -q -n 2"


def _script(name: str) -> ModuleType:
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link and image outside code blocks and inline code."""
    found: list[tuple[int, str]] = []
    in_fence = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        found.extend((number, target) for target in _LINK.findall(line))
    return found


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (lower case, punctuation dropped, spaces → '-')."""
    anchors: set[str] = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            unique, n = slug, 0
            while unique in anchors:
                n += 1
                unique = f"{slug}-{n}"
            anchors.add(unique)
    return anchors


def test_generated_reference_matches_the_code() -> None:
    gen = _script("gen_reference")
    for path, text in gen.generated().items():
        rel = path.relative_to(ROOT)
        assert path.exists(), f"{rel} is missing: run `python scripts/gen_reference.py` and commit it"
        assert path.read_text() == text, (
            f"{rel} is out of date with the code (a config key or CLI option changed): "
            "run `python scripts/gen_reference.py` and commit the result"
        )


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in _markdown_files():
        for number, target in _links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http(s), mailto: not checked offline
            file_part, _, anchor = target.partition("#")
            linked = doc.parent / file_part if file_part else doc
            if not linked.exists():
                broken.append(f"{doc.relative_to(ROOT)}:{number}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{doc.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "links to files or headings that do not exist:\n" + "\n".join(broken)


def test_results_files_and_citations_match() -> None:
    problems = _script("render_results").check()
    assert not problems, "\n".join(problems)


def test_every_results_file_renders() -> None:
    render = _script("render_results")
    for path in render.results_files():
        if path.suffix == ".json":
            assert render.render(path).startswith(("|", "`", "at ", "(")), path


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/ and link it"
    )
    assert "bash scripts/setup.sh && asyncloco demo" in text
    assert CI_TEST_COMMAND in text
    assert CI_TEST_COMMAND in (ROOT / ".ci" / "run").read_text(), ".ci/run runs the README's test command"


@pytest.mark.timeout(60)
def test_no_tracker_numbers_in_code() -> None:
    """Code says what it does and why, not which ticket asked for it: no "issue <number>" in the package, the
    scripts or the tests (a ticket number means nothing to a reader of the code; the history has them)."""
    import re

    pattern = re.compile(r"\bissues? #?[0-9]", re.IGNORECASE)
    root = Path(__file__).resolve().parent.parent
    found = [f"{path.relative_to(root)}:{number}" for folder in ("asyncloco", "scripts", "tests")
             for path in sorted((root / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == [], f"tracker numbers in code: {found}"
