"""Durable files: written whole or not at all, and still there after a power cut.

:func:`write_durably` writes to a temporary file in the target's directory, flushes and ``fsync``-s it, renames it
over the target (atomic on POSIX) and ``fsync``-s the directory so the rename itself survives. The coordinator's
snapshots (coordinator/checkpoint.py), the repair's stored re-runs (coordinator/substitute.py) and the download
service's anchors (transport/delta.py) are written so; the write-ahead log (coordinator/wal.py) syncs its directory
with :func:`fsync_dir`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["fsync_dir", "write_durably"]


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (a create, a rename, an unlink) durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_durably(path: Path, write: Callable[[BinaryIO], None]) -> Path:
    """Write ``path`` through ``write(handle)``: the old content or the new one, never a part, after any crash. A
    failure (``write`` raising, a full disk) leaves no temporary file behind and raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
