"""Build the workload a run config names: the toy classifier (``task.kind: toy``) or a language model."""

from __future__ import annotations

from asyncloco.config import RunConfig
from asyncloco.models.workload import Workload

__all__ = ["build_workload"]


def build_workload(cfg: RunConfig) -> Workload:
    if cfg.task.kind == "toy":
        from asyncloco.models.toy import ToyWorkload

        return ToyWorkload(cfg.task)
    from asyncloco.models.lm import build_lm_workload  # transformers/datasets load only when asked for

    return build_lm_workload(cfg.task)
