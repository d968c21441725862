"""The run configs shipped in the package, and resolving ``--config`` (a YAML path or a shipped config's name).

Its own module so that the entry points (asyncloco/cli.py, asyncloco/runtime_cli.py, asyncloco/demo.py) share it
without importing each other.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["resolve_config", "shipped_configs"]


def shipped_configs() -> dict[str, Path]:
    """The configs that ship inside the package, by name (``toy`` → ``asyncloco/configs/toy.yaml``)."""
    from importlib.resources import files

    folder = Path(str(files("asyncloco") / "configs"))
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def resolve_config(path: str) -> Path:
    """A run config by path (``my-run.yaml``, ``configs/toy.yaml``) or by the name of a shipped one (``toy``).

    An existing file wins; otherwise a bare name, or ``configs/<name>.yaml`` outside the repository,
    is looked up among the configs shipped in the package (so both spellings work from any install)."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    shipped = shipped_configs()
    name = path
    if candidate.suffix in (".yaml", ".yml") and not candidate.is_absolute() and str(candidate.parent) in (".", "configs"):
        name = candidate.stem
    if name in shipped:
        return shipped[name]
    raise ValueError(
        f"config {path!r} not found: no such file, and not the name of a shipped config "
        f"({', '.join(shipped) or 'none installed'}); pass a YAML path or one of those names"
    )
