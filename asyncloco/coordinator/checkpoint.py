"""Atomic, durable coordinator snapshots.

A snapshot is written to a temporary file in the same directory, flushed and ``fsync``-ed, renamed
over ``state.pt`` (atomic on POSIX), and the directory is ``fsync``-ed so the rename itself survives
a power cut. A crash at any point leaves either the previous snapshot or the new one, never a torn
file. Snapshots are our own files, loaded with ``torch.load(weights_only=True)`` (no code runs on
load); nothing received from the network is ever written here unvalidated.

Durability contract of the daemon: an update is acknowledged only after a snapshot that contains
it is durable, and a lease is handed out only after a snapshot that contains it is durable. So a
coordinator killed at any moment restarts (``--resume``) with every acknowledged update applied
exactly once and every issued lease still known.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_snapshot", "load_snapshot", "remove_partial_snapshots", "SNAPSHOT_NAME"]

logger = logging.getLogger(__name__)

SNAPSHOT_NAME = "state.pt"
FORMAT_VERSION = 1


def save_snapshot(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / SNAPSHOT_NAME
    fd, tmp_name = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({"format": FORMAT_VERSION, **state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def remove_partial_snapshots(directory: Path) -> int:
    """Delete temporary files a crash in the middle of :func:`save_snapshot` left behind."""
    removed = 0
    for leftover in directory.glob(".state-*.tmp"):
        leftover.unlink(missing_ok=True)
        removed += 1
    if removed:
        logger.info("removed %d partial snapshot(s) left by an interrupted save in %s", removed, directory)
    return removed


def load_snapshot(directory: Path) -> dict[str, Any]:
    path = directory / SNAPSHOT_NAME
    if not path.is_file():
        raise ValueError(
            f"no checkpoint at {path}: give the directory an `asyncloco coordinator` run writes to (its "
            "runtime.checkpoint_dir or --checkpoint-dir); to start a new run, leave out --resume"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} is not an asyncloco checkpoint of format {FORMAT_VERSION}")
    return state
