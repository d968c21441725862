"""Config overrides from the command line (``--model``, ``--set``; asyncloco/overrides.py) and the one-line error
of a hub config offline (asyncloco/models/hub.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncloco.cli import _resolve_config, main
from asyncloco.config import load_config, load_raw_config
from asyncloco.models import hub
from asyncloco.overrides import parse_sets

pytestmark = pytest.mark.timeout(120)


def test_set_values_are_yaml_scalars() -> None:
    assert parse_sets(["task.model=20m", "inner.lr=3e-4", "task.tokenizer=null", "runtime.allowlist=[a, b]",
                       "name=a=b", "sim.workers=4"]) == {
        "task.model": "20m", "inner.lr": 3e-4, "task.tokenizer": None, "runtime.allowlist": ["a", "b"],
        "name": "a=b", "sim.workers": 4,
    }
    for bad in ("foo", "=3", "task..model=1", "task.model"):
        with pytest.raises(ValueError, match="expected KEY.PATH=VALUE"):
            parse_sets([bad])


def test_a_size_and_a_key_override_the_shipped_config_and_are_validated_like_the_yaml() -> None:
    demo = _resolve_config("demo")
    base = load_config(demo)
    cfg = load_config(demo, {"task.model": "20m", "inner.lr": 1e-3})
    assert (base.task.model, cfg.task.model, cfg.inner.lr) == ("tiny", "20m", 1e-3)
    assert cfg.model_dump(exclude={"task", "inner"}) == base.model_dump(exclude={"task", "inner"})
    # the effective YAML the demo hands its processes loads to the very same config
    raw = load_raw_config(demo, {"task.model": "60m"})
    assert raw["task"]["model"] == "60m" and RunConfigFrom(raw) == load_config(demo, {"task.model": "60m"})
    with pytest.raises(ValueError, match=r"task.model '30m' is not a preset; choose one of \['150m', '20m', '60m', 'small', 'tiny'\]"):
        load_config(demo, {"task.model": "30m"})
    with pytest.raises(ValueError, match="task.modle: unknown key — check its spelling"):
        load_config(demo, {"task.modle": "20m"})
    with pytest.raises(ValueError, match="inner.lr: Input should be a valid number"):
        load_config(demo, {"inner.lr": "fast"})
    with pytest.raises(ValueError, match=r"cannot set task.model.width: task.model in .* is a value \('tiny'\), not a section"):
        load_config(demo, {"task.model.width": 3})


def RunConfigFrom(raw: dict) -> object:  # noqa: N802 - reads like the constructor it wraps
    from asyncloco.config import RunConfig

    return RunConfig.model_validate(raw)


def test_the_cli_refuses_a_bad_override_in_one_line_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--config", "toy", "--model", "20m"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "  task.model: unknown key — check its spelling or remove it"
    assert main(["coordinator", "--config", "demo", "--model", "30m"]) == 2
    assert "task.model '30m' is not a preset" in capsys.readouterr().err
    assert main(["demo", "--set", "nope"]) == 2
    assert capsys.readouterr().err == (
        "asyncloco: error: --set 'nope': expected KEY.PATH=VALUE, e.g. --set task.model=20m or --set inner.lr=3e-4\n")


def test_require_hub_connects_once_and_names_the_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with socket.socket() as server:  # a reachable endpoint: a listening socket on loopback
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        hub.require_hub("org/tok", "tokenizer")  # no error
        port = server.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")  # closed now: refused at once
    with pytest.raises(hub.HubUnreachable) as refused:
        hub.require_hub("org/tok", "tokenizer")
    message = str(refused.value)
    assert message.startswith(f"cannot reach the Hugging Face hub at http://127.0.0.1:{port} (Connection refused) "
                              "for the tokenizer 'org/tok'; for a local run use the embedded data")
    assert "HF_HUB_OFFLINE=1" in message and "\n" not in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubUnreachable, match="the hub dataset 'allenai/c4' is streamed from .* which HF_HUB_OFFLINE=1 forbids"):
        hub.require_hub("allenai/c4", "dataset")


def test_a_hub_config_offline_exits_2_fast_with_one_line(tmp_path: Path) -> None:
    """``asyncloco coordinator --config lm-20m`` with the hub unreachable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the discard port: nothing listens, refused at once
    env["HF_HOME"] = str(tmp_path / "hf-home")  # an empty hub cache
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "asyncloco.cli", "coordinator", "--config", "lm-20m",
                           "--checkpoint-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=100)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("asyncloco: error: cannot reach the Hugging Face hub at http://127.0.0.1:9 "
                               "(Connection refused) for the tokenizer 'google-t5/t5-base'; for a local run")
    assert not (tmp_path / "run" / "state.pt").exists()
    print(f"exit 2 after {elapsed:.1f} s")  # ≈ 6 s here (interpreter + torch/transformers imports)


def test_the_bitsandbytes_kernel_notice_is_dropped_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import asyncloco  # noqa: F401 - installs the filter

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...",
                       ModuleNotFoundError("No module named 'kernels'"))
        logger.warning("some other bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records] == ["some other bitsandbytes warning"]


def test_the_entry_points_do_not_import_each_other() -> None:
    """cli imports runtime_cli (to add its commands); runtime_cli and demo take the config lookup from
    asyncloco/shipped.py, not from cli, so there is no cli <-> runtime_cli <-> demo import circle."""
    import ast

    import asyncloco

    root = Path(asyncloco.__file__).parent
    for name in ("runtime_cli.py", "demo.py", "shipped.py"):
        tree = ast.parse((root / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert "asyncloco.cli" not in imported, name
    assert "asyncloco.runtime_cli" not in {
        node.module for node in ast.walk(ast.parse((root / "demo.py").read_text())) if isinstance(node, ast.ImportFrom)
    }
