"""Config overrides from the command line: ``--model SIZE`` and ``--set key.path=value`` (repeatable).

Used by ``asyncloco simulate``, ``coordinator`` and ``demo`` (a peer takes its config from the coordinator).
Values are parsed as YAML scalars/lists (``--set inner.lr=3e-4``, ``--set task.tokenizer=null``,
``--set runtime.allowlist=[a,b]``) and applied to the YAML before validation, so an override is checked exactly
like the file (:func:`asyncloco.config.load_config`): an unknown key, a bad value or an unknown model size is a
one-line error naming it.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Sequence

import yaml

__all__ = ["add_override_arguments", "overrides_from_args", "parse_sets"]

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")  # 3e-4: a string to YAML 1.1, a number to a user


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``["task.model=20m", "inner.lr=3e-4"]`` → ``{"task.model": "20m", "inner.lr": 0.0003}``."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise ValueError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set task.model=20m or --set inner.lr=3e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text  # not YAML: taken as the literal string (validation still judges it)
        if isinstance(value, str) and _FLOAT.match(value.strip()):
            value = float(value)
        overrides[key] = value
    return overrides


def add_override_arguments(parser: argparse.ArgumentParser) -> None:
    from asyncloco.models.presets import PRESETS

    parser.add_argument("--model", metavar="SIZE",
                        help=f"model preset of a language-model config (sets task.model): one of {', '.join(PRESETS)}")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override any config key, validated like the YAML (repeatable), e.g. --set inner.lr=3e-4")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The overrides ``--set`` and ``--model`` ask for (``--model`` wins over ``--set task.model``)."""
    overrides = parse_sets(getattr(args, "sets", None) or [])
    model = getattr(args, "model", None)
    if model is not None:
        overrides["task.model"] = model
    return overrides
