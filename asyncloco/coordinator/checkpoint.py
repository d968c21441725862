"""Atomic, durable coordinator snapshots.

A snapshot is written to a temporary file in the same directory, flushed and ``fsync``-ed, renamed
over ``state.pt`` (atomic on POSIX), and the directory is ``fsync``-ed so the rename itself survives
a power cut. A crash at any point leaves either the previous snapshot or the new one, never a torn
file. Snapshots are our own files, loaded with ``torch.load(weights_only=True)`` (no code runs on
load); nothing received from the network is ever written here unvalidated.

Durability contract of the daemon: nothing is acknowledged before the event that decided it is durable
in the write-ahead log (:mod:`asyncloco.coordinator.wal`); snapshots are written in the background every
``runtime.snapshot_every`` updates or ``runtime.snapshot_every_s`` seconds and record, as ``wal_seq``, the
last log record they contain. ``--resume`` loads the snapshot and replays the later records, so a
coordinator killed at any moment restarts with every acknowledged update applied exactly once and every
issued lease still known. The daemon's snapshots also record the ``stamp`` of the software that wrote them
(asyncloco version + event-schema fingerprint, :func:`asyncloco.coordinator.wal.software_stamp`); ``--resume``
refuses a snapshot or log written with a different one. θ kept for base versions still leased is part of the
logic's state (``coordinator.base_params``); there is no separate per-version copy in the snapshot.

Also here: the pids of the processes the coordinator spawned (its DHT process and that process's p2pd),
recorded in the checkpoint directory so that a restart after a kill of the main process alone (what the OOM
killer does) reaps them instead of starting a second p2pd beside a stale one on the same port.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from asyncloco.durable import write_durably

__all__ = [
    "save_snapshot",
    "load_snapshot",
    "remove_partial_snapshots",
    "snapshot_wal_seq",
    "record_children",
    "reap_stale_children",
    "child_pids",
    "SNAPSHOT_NAME",
    "CHILDREN_FILE",
]

logger = logging.getLogger(__name__)

SNAPSHOT_NAME = "state.pt"
FORMAT_VERSION = 1
CHILDREN_FILE = "children.json"


def save_snapshot(directory: Path, state: dict[str, Any]) -> Path:
    return write_durably(directory / SNAPSHOT_NAME, lambda handle: torch.save({"format": FORMAT_VERSION, **state}, handle))


def remove_partial_snapshots(directory: Path) -> int:
    """Delete temporary files a crash in the middle of :func:`save_snapshot` left behind."""
    removed = 0
    # (asyncloco/durable.py names its temporary files .state.pt.*.tmp; versions before it .state-*.tmp)
    for leftover in [*directory.glob(f".{SNAPSHOT_NAME}.*.tmp"), *directory.glob(".state-*.tmp")]:
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


def snapshot_wal_seq(snapshot: dict[str, Any]) -> int:
    """The last write-ahead-log record a snapshot contains (0: written before any event; old snapshots)."""
    return int(snapshot.get("wal_seq", 0))


# ------------------------------------------------------------------------------ spawned processes


def _proc_identity(pid: int) -> tuple[str, str] | None:
    """(start time in clock ticks since boot, command line) of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return fields[19], cmdline


def child_pids(parent: int) -> list[int]:
    """Live direct children of ``parent`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent and fields[0] != "Z":
            out.append(int(entry))
    return sorted(out)


def record_children(directory: Path, pids: list[int]) -> None:
    """Remember these processes (with their start time and command line, so a recycled pid is never hit)."""
    entries = []
    for pid in pids:
        identity = _proc_identity(pid)
        if identity is not None:
            entries.append({"pid": pid, "start": identity[0], "cmdline": identity[1]})
    tmp = directory / (CHILDREN_FILE + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, directory / CHILDREN_FILE)


def reap_stale_children(directory: Path, timeout: float = 10.0) -> int:
    """SIGKILL the processes a previous coordinator of this directory recorded that are still running —
    the same pid, start time and command line, i.e. left behind when only its main process was killed.
    Returns how many were killed."""
    path = directory / CHILDREN_FILE
    if not path.is_file():
        return 0
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        logger.warning("unreadable %s; not reaping anything", path)
        return 0
    killed: list[dict[str, Any]] = []
    for entry in entries:
        pid = int(entry["pid"])
        if pid == os.getpid():
            continue
        if _proc_identity(pid) == (str(entry["start"]), str(entry["cmdline"])):
            logger.warning("killing %s (pid %d), left running by a coordinator that was killed", entry["cmdline"][:80], pid)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(entry)
            except ProcessLookupError:
                pass
    count = len(killed)
    deadline = time.monotonic() + timeout
    while killed and time.monotonic() < deadline:
        killed = [e for e in killed if _proc_identity(int(e["pid"])) == (str(e["start"]), str(e["cmdline"]))]
        if killed:
            time.sleep(0.05)  # waiting for the kernel to finish off a SIGKILLed process; bounded by the deadline
    if killed:
        raise RuntimeError(f"stale processes {[e['pid'] for e in killed]} survived SIGKILL for {timeout:.0f}s")
    path.unlink(missing_ok=True)
    return count
