"""The coordinator's write-ahead log: every event ``handle`` saw, appended and ``fsync``-ed before anyone hears of it.

Durability contract of the daemon (see :mod:`asyncloco.coordinator.daemon`): an event is handled in memory
under the lock, appended here, and the log is ``fsync``-ed **before** any of its actions is carried out (an RPC
answered, a held peer given its lease). ``--resume`` loads the newest snapshot (which records the last log
sequence number it covers) and feeds every later record through the same ``handle`` — so the state equals the
state at the last acknowledged event, θ bitwise. A crash between handling and ``fsync`` loses an event nobody
was told about.

On disk: ``<checkpoint_dir>/wal/<first seq, 20 digits>.wal`` segments, each a sequence of records::

    b"ALWR" | header length (u32 LE) | blob length (u64 LE) | crc32 of header + blob (u32 LE)
    header: msgpack map {"seq", "kind", "type", "now", "fields", "blobs", "stamp"}
    blob:   raw bytes (a submission's encoded pseudo-gradient exactly as received), possibly empty

Nothing is unpickled: the header is msgpack of plain values, the blob raw bytes. Events are encoded generically
over their dataclass fields (int, float, str, bool, None, tuples of those); a tensor field must be given as
an *attachment* (its encoded bytes), anything else is refused loudly. Sequence numbers are contiguous from 1.

Reading a log: a record that is cut short or fails its checksum **at the end of the newest segment** is a torn
tail (a crash mid-append: never acknowledged, since ``fsync`` had not returned) — it is dropped and the file is
truncated. Anything invalid elsewhere is corruption and raises :class:`WalError` naming the file and offset.
A snapshot older than the start of the log (the records in between were deleted) is refused.

Every record carries the writer's ``stamp`` (:func:`software_stamp`: the asyncloco version and a fingerprint of
the event schema). Replaying a record through a different ``handle`` could silently produce a different θ, so
the daemon refuses a log (and a snapshot) whose stamp differs from its own (:func:`check_stamp`), naming both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import msgpack

from asyncloco.durable import fsync_dir

__all__ = [
    "WalError",
    "WalRecord",
    "WriteAheadLog",
    "open_log",
    "read_records",
    "encode_fields",
    "decode_event",
    "WAL_DIR",
    "ARCHIVE_DIR",
    "software_stamp",
    "check_stamp",
]

logger = logging.getLogger(__name__)

WAL_DIR = "wal"
ARCHIVE_DIR = "archive"
MAGIC = b"ALWR"
_PREFIX = struct.Struct("<4sIQI")  # magic, header length, blob length, crc32
SEGMENT_SUFFIX = ".wal"
DEFAULT_SEGMENT_BYTES = 256 * 1024 * 1024
_PRIMITIVES = (int, float, str, bool, type(None))

# A blob attachment: (codec, numel, parts); parts are written back to back and read back as one buffer.
Attachment = tuple[str, int, Sequence[Any]]


class WalError(RuntimeError, ValueError):
    """The log cannot be used as it is; the message names the file and what to do. (A ValueError too, so the CLI
    prints it as an error message, not a traceback.)"""


@dataclass(frozen=True)
class WalRecord:
    seq: int
    kind: str  # "event" (fed to handle) or "mark" (daemon bookkeeping outside handle, e.g. a restart)
    type: str
    now: float
    fields: dict[str, Any]
    blobs: tuple[tuple[str, str, int, int], ...]  # (field, codec, numel, length) in blob order
    blob: bytes
    stamp: Optional[str] = None  # the writer's software_stamp (None: a record from before stamps)


# ------------------------------------------------------------------------------------- compatibility


def software_stamp(version: str, event_types: Mapping[str, type]) -> str:
    """``"asyncloco <version>, events <fingerprint>"``: the fingerprint (12 hex digits of a sha256) covers every
    event type's name and its fields' names and annotations, so a renamed, added or retyped field changes it."""
    parts = []
    for name in sorted(event_types):
        cls = event_types[name]
        fields = dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ()
        parts.append(name + "(" + ",".join(f"{f.name}:{f.type}" for f in fields) + ")")
    fingerprint = hashlib.sha256(";".join(parts).encode()).hexdigest()[:12]
    return f"asyncloco {version}, events {fingerprint}"


def check_stamp(found: Optional[str], expected: str, what: str) -> None:
    """Raise :class:`WalError` unless ``found`` (the stamp ``what`` was written with) equals ``expected``."""
    if found == expected:
        return
    writer = f"by {found}" if found else "by an asyncloco from before version stamps (no stamp recorded)"
    raise WalError(
        f"{what} was written {writer}; this is {expected}. Replaying it with different code could silently "
        "give a different θ, so it is refused. Resume this run with the asyncloco version that wrote it (the same "
        "release or git commit), or start a new run in an empty --checkpoint-dir"
    )


# ------------------------------------------------------------------------------------------ encoding


def _check_value(name: str, value: Any) -> Any:
    if isinstance(value, _PRIMITIVES):
        return value
    if isinstance(value, tuple):
        return tuple(_check_value(name, v) for v in value)
    raise TypeError(
        f"field {name!r} holds a {type(value).__name__}: the write-ahead log stores ints, floats, str, bool, None "
        "and tuples of them, and tensors only as encoded attachments; extend asyncloco/coordinator/wal.py"
    )


def encode_fields(
    event: Any, attachments: Optional[Mapping[str, Attachment]] = None
) -> tuple[dict[str, Any], list[tuple[str, str, int, int]], list[Any]]:
    """An event dataclass → (plain fields, blob descriptors, blob parts)."""
    if not dataclasses.is_dataclass(event) or isinstance(event, type):
        raise TypeError(f"only dataclass events can be logged, got {event!r}")
    attachments = dict(attachments or {})
    fields: dict[str, Any] = {}
    blobs: list[tuple[str, str, int, int]] = []
    parts: list[Any] = []
    for f in dataclasses.fields(event):
        if f.name in attachments:
            codec, numel, chunks = attachments.pop(f.name)
            length = sum(len(memoryview(c).cast("B")) for c in chunks)
            blobs.append((f.name, str(codec), int(numel), length))
            parts.extend(chunks)
            continue
        fields[f.name] = _check_value(f.name, getattr(event, f.name))
    if attachments:
        raise TypeError(f"{type(event).__name__} has no field(s) {sorted(attachments)} to attach")
    return fields, blobs, parts


def decode_event(
    record: WalRecord,
    event_types: Mapping[str, type],
    decode_blob: Callable[[str, int, memoryview], Any],
) -> Any:
    """A logged event back as the dataclass ``handle`` saw (attachments decoded by ``decode_blob``)."""
    cls = event_types.get(record.type)
    if cls is None:
        raise WalError(f"log record {record.seq} is a {record.type!r} event this version does not know")
    values = dict(record.fields)
    offset = 0
    view = memoryview(record.blob)
    for name, codec, numel, length in record.blobs:
        values[name] = decode_blob(codec, numel, view[offset : offset + length])
        offset += length
    return cls(**values)


# -------------------------------------------------------------------------------------------- reading


def _segments(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for path in directory.glob(f"*{SEGMENT_SUFFIX}"):
        stem = path.name[: -len(SEGMENT_SUFFIX)]
        if stem.isdigit():
            found.append((int(stem), path))
    return sorted(found)


def _scan_segment(path: Path, last: bool) -> tuple[list[tuple[int, int, int]], int]:
    """Validate a segment: [(seq, offset, size)] of its good records and the end of the last good one.
    A bad record at the very end of the newest segment is a torn tail; anywhere else it raises."""
    size = path.stat().st_size
    records: list[tuple[int, int, int]] = []
    offset = 0
    with path.open("rb") as fh:
        while offset < size:
            problem = None
            prefix = fh.read(_PREFIX.size)
            record_size = None
            if len(prefix) < _PREFIX.size:
                problem = "a record prefix cut short"
            else:
                magic, header_len, blob_len, crc = _PREFIX.unpack(prefix)
                record_size = _PREFIX.size + header_len + blob_len
                if magic != MAGIC:
                    problem = "no record marker"
                    record_size = None
                elif offset + record_size > size:
                    problem = "a record cut short"
                else:
                    header = fh.read(header_len)
                    running = zlib.crc32(header)
                    remaining = blob_len
                    while remaining:
                        chunk = fh.read(min(remaining, 16 << 20))
                        running = zlib.crc32(chunk, running)
                        remaining -= len(chunk)
                    if running != crc:
                        problem = "a checksum mismatch"
                    else:
                        try:
                            seq = int(msgpack.unpackb(header, raw=False, use_list=False)["seq"])
                        except Exception as error:  # checksum passed: our own bug or a foreign file
                            raise WalError(f"{path} at byte {offset}: unreadable record header ({error!r})") from error
                        records.append((seq, offset, record_size))
                        offset += record_size
                        continue
            # cut short: the file ends inside the record; checksum: the record is the last thing in the file;
            # no marker: the rest of the file is zeros (a file extended but never written)
            torn = last and (
                problem in ("a record prefix cut short", "a record cut short")
                or (problem == "a checksum mismatch" and record_size is not None and offset + record_size >= size)
                or (problem == "no record marker" and _all_zero(path, offset))
            )
            if torn:
                logger.warning(
                    "%s: dropping a torn tail at byte %d (%s, %d bytes): a crash interrupted that append, "
                    "before it was acknowledged",
                    path,
                    offset,
                    problem,
                    size - offset,
                )
                return records, offset
            raise WalError(
                f"{path} is corrupt at byte {offset} ({problem}) with records after it: this is not a torn tail "
                "of a crash. Restore the checkpoint directory from a backup, or resume from the snapshot alone by "
                "moving the wal/ directory away (updates acknowledged after that snapshot are then lost)"
            )
    return records, offset


def _all_zero(path: Path, offset: int) -> bool:
    with path.open("rb") as fh:
        fh.seek(offset)
        while True:
            chunk = fh.read(1 << 20)
            if not chunk:
                return True
            if chunk.count(0) != len(chunk):
                return False


def _repair(directory: Path) -> list[tuple[int, int, Path]]:
    """Check every segment, drop a torn tail, return [(first seq, last seq, path)]. Only the newest segment may
    be empty (last seq = first - 1): it marks where the log continues after a snapshot covered the rest."""
    out: list[tuple[int, int, Path]] = []
    segments = _segments(directory)
    expected: Optional[int] = None
    for index, (first, path) in enumerate(segments):
        last_segment = index == len(segments) - 1
        records, end = _scan_segment(path, last_segment)
        if end < path.stat().st_size:
            with path.open("r+b") as fh:
                fh.truncate(end)
                fh.flush()
                os.fsync(fh.fileno())
        if not records:
            if not last_segment:
                raise WalError(f"{path} holds no record but newer segments follow: the log is damaged")
            if expected is not None and first != expected:
                raise WalError(f"{path} starts at record {first}, the previous segment ended at {expected - 1}: a segment is missing")
            out.append((first, first - 1, path))
            continue
        seqs = [seq for seq, _, _ in records]
        if seqs[0] != first or seqs != list(range(first, first + len(seqs))):
            raise WalError(f"{path}: record numbers {seqs[0]}..{seqs[-1]} are not contiguous from {first}")
        if expected is not None and first != expected:
            raise WalError(f"{path} starts at record {first}, the previous segment ended at {expected - 1}: a segment is missing")
        expected = seqs[-1] + 1
        out.append((first, seqs[-1], path))
    return out


def read_records(directory: Path, after_seq: int) -> Iterator[WalRecord]:
    """Every record with ``seq > after_seq``, oldest first, blobs included (one record in memory at a time).
    Call :func:`open_log` (which repairs a torn tail) first."""
    for first, path in _segments(directory):
        with path.open("rb") as fh:
            while True:
                prefix = fh.read(_PREFIX.size)
                if len(prefix) < _PREFIX.size:
                    break
                _, header_len, blob_len, _ = _PREFIX.unpack(prefix)
                header = msgpack.unpackb(fh.read(header_len), raw=False, use_list=False)
                seq = int(header["seq"])
                if seq <= after_seq:
                    fh.seek(blob_len, os.SEEK_CUR)
                    continue
                blob = fh.read(blob_len)
                yield WalRecord(
                    seq=seq,
                    kind=str(header["kind"]),
                    type=str(header["type"]),
                    now=float(header["now"]),
                    fields=dict(header["fields"]),
                    blobs=tuple((str(b[0]), str(b[1]), int(b[2]), int(b[3])) for b in header["blobs"]),
                    blob=blob,
                    stamp=str(header["stamp"]) if header.get("stamp") is not None else None,
                )


# -------------------------------------------------------------------------------------------- writing


class WriteAheadLog:
    """Append-only, segmented. :meth:`append` writes (page cache); :meth:`sync` makes everything appended so
    far durable. Appends and syncs come from one thread at a time (the daemon holds its lock);
    :meth:`drop_covered` may run from a snapshot thread."""

    def __init__(
        self,
        directory: Path,
        next_seq: int,
        segments: Sequence[tuple[int, int, Path]] = (),
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        archive: bool = False,
        stamp: str = "",
    ) -> None:
        self.directory = directory
        self.stamp = stamp  # written into every record (software_stamp; "" only in tests of the format)
        # archive: covered segments are moved to <wal>/archive/ instead of deleted (audits, replay tests)
        self.archive_dir: Optional[Path] = directory / ARCHIVE_DIR if archive else None
        self.next_seq = next_seq
        self.segment_bytes = segment_bytes
        self._closed_segments: list[tuple[int, int, Path]] = list(segments)  # (first, last, path), all synced
        self._mutex = threading.Lock()
        self._fd: Optional[int] = None
        self._current: Optional[tuple[int, Path]] = None
        self._current_bytes = 0
        if self._closed_segments:  # append to the newest segment
            first, _, path = self._closed_segments.pop()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self._current = (first, path)
            self._current_bytes = path.stat().st_size
        self._dirty = False
        self._dir_dirty = False
        self.bytes_written = 0
        self.syncs = 0

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    def append(
        self,
        kind: str,
        type_name: str,
        now: float,
        fields: Mapping[str, Any],
        blobs: Sequence[tuple[str, str, int, int]] = (),
        parts: Sequence[Any] = (),
    ) -> int:
        seq = self.next_seq
        header = msgpack.packb(
            {
                "seq": seq,
                "kind": kind,
                "type": type_name,
                "now": float(now),
                "fields": dict(fields),
                "blobs": list(blobs),
                "stamp": self.stamp,
            },
            use_bin_type=True,
        )
        views = [memoryview(p).cast("B") for p in parts]
        blob_len = sum(len(v) for v in views)
        crc = zlib.crc32(header)
        for view in views:
            crc = zlib.crc32(view, crc)
        prefix = _PREFIX.pack(MAGIC, len(header), blob_len, crc)
        if self._fd is None or self._current_bytes >= self.segment_bytes:
            self._start_segment(seq)
        assert self._fd is not None
        _write_all(self._fd, [prefix, header, *views])
        size = _PREFIX.size + len(header) + blob_len
        self._current_bytes += size
        self.bytes_written += size
        self.next_seq += 1
        self._dirty = True
        return seq

    def append_event(
        self, event: Any, now: float, attachments: Optional[Mapping[str, Attachment]] = None, kind: str = "event"
    ) -> int:
        fields, blobs, parts = encode_fields(event, attachments)
        return self.append(kind, type(event).__name__, now, fields, blobs, parts)

    def sync(self) -> None:
        """fsync everything appended so far (and the directory entry of a new segment)."""
        if self._fd is not None and self._dirty:
            os.fdatasync(self._fd)
            self._dirty = False
            self.syncs += 1
        if self._dir_dirty:
            fsync_dir(self.directory)
            self._dir_dirty = False

    def _start_segment(self, first_seq: int) -> None:
        self._close_current()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{first_seq:020d}{SEGMENT_SUFFIX}"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._current = (first_seq, path)
        self._current_bytes = 0
        self._dir_dirty = True

    def _close_current(self) -> None:
        if self._fd is None or self._current is None:
            return
        self.sync()
        os.close(self._fd)
        first, path = self._current
        with self._mutex:
            self._closed_segments.append((first, self.next_seq - 1, path))
        self._fd = None
        self._current = None

    def rotate(self) -> None:
        """Close the current segment (synced) and start a new, empty one at the next record number. Called
        when a snapshot is taken, so the segments it covers can be deleted whole once it is durable; the empty
        segment's name records where the log continues (so an older snapshot is recognised even then)."""
        if self._fd is not None and self._current is not None and self._current_bytes == 0:
            if self._current[0] == self.next_seq:
                return
            os.close(self._fd)  # an empty marker from before a newer snapshot: replace it
            self._current[1].unlink()
            self._fd, self._current = None, None
        self._start_segment(self.next_seq)
        self.sync()

    def drop_covered(self, seq: int) -> int:
        """Delete closed segments whose every record has ``seq`` or lower (a durable snapshot covers them)."""
        with self._mutex:
            covered = [s for s in self._closed_segments if s[1] <= seq]
            self._closed_segments = [s for s in self._closed_segments if s[1] > seq]
        if covered and self.archive_dir is not None:
            self.archive_dir.mkdir(exist_ok=True)
        for _, _, path in covered:
            if self.archive_dir is not None:
                os.replace(path, self.archive_dir / path.name)
            else:
                path.unlink(missing_ok=True)
        if covered:
            fsync_dir(self.directory)
            logger.debug("deleted %d log segment(s) covered by the snapshot at record %d", len(covered), seq)
        return len(covered)

    def segment_count(self) -> int:
        with self._mutex:
            return len(self._closed_segments) + (1 if self._current is not None else 0)

    def close(self) -> None:
        self._close_current()

    def abandon(self) -> None:
        """Release the open segment's file without syncing or writing anything more: what a killed process leaves
        (the in-memory double's crashes, asyncloco/testing/memory.py). A record not yet synced is left to the page
        cache, as it would be after a SIGKILL."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._current = None


def _write_all(fd: int, buffers: list[Any]) -> None:
    pending = [memoryview(b).cast("B") for b in buffers if len(b)]
    while pending:
        written = os.writev(fd, pending[:512])
        while written and pending:
            if written >= len(pending[0]):
                written -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][written:]
                written = 0


def open_log(
    checkpoint_dir: Path,
    snapshot_seq: int,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    archive: bool = False,
    stamp: str = "",
) -> WriteAheadLog:
    """Repair a torn tail, check that the snapshot covering records ``1..snapshot_seq`` connects to the log,
    and return a log that appends after its last record."""
    directory = checkpoint_dir / WAL_DIR
    directory.mkdir(parents=True, exist_ok=True)
    segments = _repair(directory)
    # the log starts at the first segment not wholly covered by the snapshot (the newest one always counts)
    live = [s for i, s in enumerate(segments) if s[1] > snapshot_seq or i == len(segments) - 1]
    if live and live[0][0] > snapshot_seq + 1:
        raise WalError(
            f"the snapshot in {checkpoint_dir} covers the log up to record {snapshot_seq} but the log in {directory} "
            f"starts at record {live[0][0]}: records {snapshot_seq + 1}..{live[0][0] - 1} were deleted after a newer "
            "snapshot was written. This snapshot is older than the log: put back the newest state.pt of this run "
            "(or start a new run in an empty --checkpoint-dir)"
        )
    log_end = segments[-1][1] if segments else 0
    wal = WriteAheadLog(directory, max(snapshot_seq, log_end) + 1, segments, segment_bytes, archive, stamp)
    if wal._fd is None or snapshot_seq >= log_end:
        wal.rotate()  # a fresh log, or a snapshot covering the whole log: continue in a new segment
    wal.drop_covered(snapshot_seq)
    return wal
