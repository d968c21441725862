"""Packaging: configs ship inside the package and resolve by name or path, ``--version``,
a LICENSE, and a non-editable install in a fresh venv outside the repository runs the simulator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncloco import __version__
from asyncloco.cli import _resolve_config, main, shipped_configs
from asyncloco.config import RunConfig, load_config

REPO = Path(__file__).resolve().parent.parent
REPO_CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))


def test_every_repository_config_ships_in_the_package() -> None:
    shipped = shipped_configs()
    assert sorted(shipped) == REPO_CONFIGS and "toy" in shipped and "demo" in shipped
    for name, path in shipped.items():
        assert path.read_bytes() == (REPO / "configs" / f"{name}.yaml").read_bytes(), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", REPO_CONFIGS)
def test_every_shipped_config_loads_by_name(name: str) -> None:
    path = _resolve_config(name)
    assert path == shipped_configs()[name]
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    raw = yaml.safe_load(path.read_text())
    assert cfg.name == raw.get("name", "run")


def test_config_resolution_by_path_and_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = tmp_path / "toy.yaml"
    own.write_text("name: mine\n")
    monkeypatch.chdir(tmp_path)
    assert _resolve_config("toy.yaml") == Path("toy.yaml")  # an existing file wins over a shipped name
    assert _resolve_config(str(own)) == own
    assert _resolve_config("toy") == shipped_configs()["toy"]
    # the README's spelling works outside the repository too
    assert _resolve_config("configs/demo.yaml") == shipped_configs()["demo"]
    assert _resolve_config("configs/lm-tiny.yml") == shipped_configs()["lm-tiny"]


def test_unknown_config_names_the_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for wrong in ("toyy", "elsewhere/toy.yaml", str(tmp_path / "configs" / "toy.yaml")):
        with pytest.raises(ValueError) as info:
            _resolve_config(wrong)
        message = str(info.value)
        assert repr(wrong) in message and "demo, lm-150m, lm-20m, lm-60m, lm-tiny, toy" in message


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"asyncloco {__version__}\n"


def test_license_is_the_apache_2_text() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in pyproject and 'license-files = ["LICENSE"]' in pyproject


# ------------------------------------------------------------------ a non-editable install elsewhere

SIM_ARGS = ["simulate", "--config", "toy", "--method", "async_dn_dylu", "--total-local-updates", "40"]


def _copy_checkout(destination: Path) -> None:
    """The working tree as git sees it (tracked and untracked-but-not-ignored files), links kept."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode().split("\0")
    for relative in filter(None, listed):
        source = REPO / relative
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif source.is_file():
            shutil.copy2(source, target)


def _summary(out: Path) -> list[dict[str, Any]]:
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    rows = json.loads((folder / "summary.json").read_text())
    return [{k: v for k, v in row.items() if "wall" not in k} for row in rows]


@pytest.mark.packaging
@pytest.mark.timeout(300)
def test_non_editable_install_in_a_fresh_venv_outside_the_repo(tmp_path: Path) -> None:
    """A wheel of the checkout installed into a fresh venv (no editable link, no download: the venv sees
    this interpreter's packages), then from a directory outside the repository:
    ``asyncloco --version`` and ``asyncloco simulate --config toy`` give the repository's exact result."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to copy (git ls-files)")
    checkout, venv, work = tmp_path / "checkout", tmp_path / "venv", tmp_path / "elsewhere"
    _copy_checkout(checkout)  # the build writes build/ and *.egg-info next to the sources: not in the shared tree
    work.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python, cli = venv / "bin" / "python", venv / "bin" / "asyncloco"
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if sys.prefix != sys.base_prefix:
        # this interpreter is itself a venv's: --system-site-packages shows the new venv the *base* interpreter's
        # packages, not this venv's torch & co. A .pth line adds them after the new venv's own site-packages
        # (a .pth in a directory added this way is not processed, so an editable asyncloco here stays out).
        import sysconfig

        parents = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
        (site / "_asyncloco_test_parent_venv.pth").write_text("".join(f"{path}\n" for path in parents))
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    # the wheel is built by this interpreter's setuptools (a venv's bundled one may predate PEP 639)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(wheels), str(checkout)],
        check=True, cwd=work, env=env,
    )
    (wheel,) = wheels.glob("asyncloco-*.whl")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True, cwd=work, env=env
    )
    located = subprocess.run(
        [str(python), "-c", "import asyncloco, asyncloco.cli as c; print(asyncloco.__file__); print(c.shipped_configs()['demo'])"],
        check=True, cwd=work, env=env, capture_output=True, text=True,
    ).stdout.split()
    assert located == [str(site / "asyncloco" / "__init__.py"), str(site / "asyncloco" / "configs" / "demo.yaml")]
    assert not (site / "asyncloco" / "configs").is_symlink()  # real files, not a link back into the checkout
    assert (site / "asyncloco" / "data" / "corpus.jsonl.xz").is_file()

    version = subprocess.run([str(cli), "--version"], check=True, cwd=work, env=env, capture_output=True, text=True)
    assert version.stdout == f"asyncloco {__version__}\n"

    subprocess.run([str(cli), *SIM_ARGS, "--out", "out"], check=True, cwd=work, env=env, capture_output=True)
    assert main([*SIM_ARGS, "--out", str(tmp_path / "here")]) == 0  # the same run from this checkout
    installed, here = _summary(work / "out"), _summary(tmp_path / "here")
    assert [row["method"] for row in installed] == ["async_dn_dylu"]
    assert installed == here
