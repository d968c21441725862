"""Optional metrics sinks for the coordinator: TensorBoard and Weights & Biases (``runtime.log_to``).

Neither is a dependency of asyncloco: a sink is built only when the config names it, and naming one
whose package is missing fails at start-up with the ``pip install`` that fixes it. What is logged:

* every validation evaluation (``eval/loss``, ``eval/perplexity``, ... and ``eval/local_updates``),
  at step = the model version it evaluated;
* every summary period (``runtime.summary_every``): ``run/updates_per_s``, ``run/peers_alive``,
  ``run/active_leases``, ``run/rejections`` and ``run/local_updates``, at step = the current version.

TensorBoard event files go to ``<checkpoint_dir>/tensorboard`` (``tensorboard --logdir`` it); W&B
uses the project ``asyncloco`` and the run id as the run name, and honours the usual ``WANDB_*``
environment variables (``WANDB_MODE=offline`` for a machine without internet).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

__all__ = ["MetricsSink", "SINKS", "TensorBoardSink", "WandbSink", "build_sinks"]

logger = logging.getLogger(__name__)

SINKS = ("tensorboard", "wandb")


class MetricsSink(Protocol):
    def log_eval(self, record: dict[str, float]) -> None: ...

    def log_run(self, scalars: dict[str, float], step: int, wall_time: float) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: Path, writer_factory: Optional[Callable[[str], Any]] = None) -> None:
        if writer_factory is None:
            from torch.utils.tensorboard import SummaryWriter

            writer_factory = SummaryWriter
        self.log_dir = log_dir
        self.writer = writer_factory(str(log_dir))

    def log_eval(self, record: dict[str, float]) -> None:
        step = int(record["version"])
        for key, value in record.items():
            if key not in ("time", "version"):
                self.writer.add_scalar(f"eval/{key}", float(value), global_step=step, walltime=record["time"])
        self.writer.flush()

    def log_run(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"run/{key}", float(value), global_step=step, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars through ``wandb.log`` (needs the ``wandb`` package and, online, ``wandb login``)."""

    def __init__(self, run_id: str, config: dict[str, Any], log_dir: Path, module: Any = None) -> None:
        if module is None:
            module = importlib.import_module("wandb")  # optional: never a dependency of asyncloco
        self.wandb = module
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = module.init(project="asyncloco", name=run_id, config=config, dir=str(log_dir))

    def log_eval(self, record: dict[str, float]) -> None:
        values = {f"eval/{k}": float(v) for k, v in record.items() if k not in ("time", "version")}
        self.run.log({**values, "version": int(record["version"])})

    def log_run(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log({**{f"run/{k}": float(v) for k, v in scalars.items()}, "version": step})

    def close(self) -> None:
        self.run.finish()


def _require(module: str, sink: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"runtime.log_to names {sink!r} but the {module!r} package is not installed: "
            f"`pip install {module}`, or remove {sink!r} from runtime.log_to"
        )


def build_sinks(names: Sequence[str], checkpoint_dir: Path, run_id: str, config: dict[str, Any]) -> list[MetricsSink]:
    """The sinks ``runtime.log_to`` asks for; ``ValueError`` (with the fix) for an unknown or missing one."""
    sinks: list[MetricsSink] = []
    for name in names:
        if name == "tensorboard":
            _require("tensorboard", name)
            sinks.append(TensorBoardSink(checkpoint_dir / "tensorboard"))
        elif name == "wandb":
            _require("wandb", name)
            sinks.append(WandbSink(run_id, config, checkpoint_dir / "wandb"))
        else:
            raise ValueError(f"unknown metrics sink {name!r} in runtime.log_to; choose from {', '.join(SINKS)}")
        logger.info("logging metrics to %s", name)
    return sinks
