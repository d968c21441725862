"""The coordinator's write-ahead log (asyncloco/coordinator/wal.py): exact round trips, torn tails dropped,
corruption refused, covered segments deleted, a snapshot older than the log refused."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.coordinator.wal import (
    WAL_DIR,
    WalError,
    decode_event,
    encode_fields,
    open_log,
    read_records,
)


@dataclass(frozen=True)
class Ping:
    peer: str
    speed: float
    count: int
    flag: bool
    maybe: Any
    pair: tuple[str, ...]


@dataclass(frozen=True)
class Upload:
    peer: str
    lease_id: str
    payload: Any


@dataclass(frozen=True)
class WithDict:
    table: dict[str, int]


TYPES = {"Ping": Ping, "Upload": Upload}


def _blob(codec: str, numel: int, data: memoryview) -> tuple[str, int, bytes]:
    return codec, numel, bytes(data)


def _segments(directory: Path) -> list[Path]:
    return sorted((directory / WAL_DIR).glob("*.wal"))


def _write(tmp_path: Path, n: int, segment_bytes: int = 1 << 30, blob_size: int = 100) -> list[Any]:
    wal = open_log(tmp_path, 0, segment_bytes=segment_bytes)
    events: list[Any] = []
    for i in range(n):
        if i % 2:
            data = bytes([i % 251]) * blob_size
            event = Upload(f"p{i}", f"L{i:08d}", None)
            wal.append_event(event, 1000.0 + i, {"payload": ("int8", blob_size, [data[:10], data[10:]])})
            events.append(Upload(f"p{i}", f"L{i:08d}", ("int8", blob_size, data)))
        else:
            event = Ping(f"p{i}", 0.1 * i + 1e-17, -i, i % 4 == 0, None if i % 3 else 2.5, ("a", f"b{i}"))
            wal.append_event(event, 1000.0 + i)
            events.append(event)
    wal.sync()
    wal.close()
    return events


def _read(tmp_path: Path, after: int = 0) -> list[tuple[int, float, Any]]:
    return [(r.seq, r.now, decode_event(r, TYPES, _blob)) for r in read_records(tmp_path / WAL_DIR, after)]


@pytest.mark.timeout(60)
def test_events_round_trip_exactly_with_their_time_and_bytes(tmp_path: Path) -> None:
    events = _write(tmp_path, 7)
    wal = open_log(tmp_path, 0)
    assert wal.next_seq == 8
    got = _read(tmp_path)
    assert [seq for seq, _, _ in got] == list(range(1, 8))
    assert [now for _, now, _ in got] == [1000.0 + i for i in range(7)]
    assert [event for _, _, event in got] == events  # floats bit-exact, tuples stay tuples, None stays None
    assert _read(tmp_path, after=5) == got[5:]
    wal.close()


def test_fields_that_are_not_plain_values_are_refused_loudly() -> None:
    with pytest.raises(TypeError, match="field 'table' holds a dict"):
        encode_fields(WithDict({"a": 1}))
    with pytest.raises(TypeError, match="field 'payload' holds a Tensor"):
        encode_fields(Upload("p", "L1", torch.zeros(3)))
    with pytest.raises(TypeError, match=r"no field\(s\) \['nope'\]"):
        encode_fields(Ping("p", 1.0, 1, True, None, ()), {"nope": ("int8", 1, [b"x"])})


@pytest.mark.timeout(60)
def test_unknown_event_type_in_the_log_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path, 2)
    open_log(tmp_path, 0).close()
    record = next(read_records(tmp_path / WAL_DIR, 0))
    with pytest.raises(WalError, match="'Ping' event this version does not know"):
        decode_event(record, {}, _blob)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", [1, 7, 16, 40, 90])
def test_a_record_cut_short_at_the_tail_is_dropped_and_appends_continue(tmp_path: Path, cut: int) -> None:
    _write(tmp_path, 4)
    (segment,) = _segments(tmp_path)
    full = segment.read_bytes()
    sizes = _record_offsets(tmp_path)
    last_start = sizes[-1]
    segment.write_bytes(full[: last_start + cut])  # a crash in the middle of appending record 4
    wal = open_log(tmp_path, 0)
    assert wal.next_seq == 4
    assert segment.stat().st_size == last_start  # truncated back to the last whole record
    wal.append_event(Ping("again", 1.0, 4, False, None, ()), 2000.0)
    wal.sync()
    wal.close()
    got = _read(tmp_path)
    assert [seq for seq, _, _ in got] == [1, 2, 3, 4] and got[-1][2].peer == "again"


def _record_offsets(tmp_path: Path) -> list[int]:
    """Byte offset of each record in the single segment (from the scanner's view)."""
    from asyncloco.coordinator.wal import _scan_segment

    (segment,) = _segments(tmp_path)
    records, _ = _scan_segment(segment, last=True)
    return [offset for _, offset, _ in records]


@pytest.mark.timeout(60)
def test_a_checksum_mismatch_in_the_last_record_is_a_torn_tail(tmp_path: Path) -> None:
    _write(tmp_path, 4)
    (segment,) = _segments(tmp_path)
    data = bytearray(segment.read_bytes())
    data[-5] ^= 0xFF  # inside record 4's blob
    segment.write_bytes(bytes(data))
    assert open_log(tmp_path, 0).next_seq == 4
    assert [seq for seq, _, _ in _read(tmp_path)] == [1, 2, 3]


@pytest.mark.timeout(60)
def test_zeros_after_the_last_record_are_dropped(tmp_path: Path) -> None:
    _write(tmp_path, 3)
    (segment,) = _segments(tmp_path)
    size = segment.stat().st_size
    with segment.open("ab") as fh:
        fh.write(b"\0" * 4096)
    assert open_log(tmp_path, 0).next_seq == 4
    assert segment.stat().st_size == size


@pytest.mark.timeout(60)
def test_corruption_before_the_tail_is_refused_with_the_place(tmp_path: Path) -> None:
    _write(tmp_path, 4)
    (segment,) = _segments(tmp_path)
    offsets = _record_offsets(tmp_path)
    data = bytearray(segment.read_bytes())
    data[offsets[2] - 3] ^= 0xFF  # the end of record 2 (a blob byte): records 3 and 4 follow
    segment.write_bytes(bytes(data))
    with pytest.raises(WalError, match=rf"corrupt at byte {offsets[1]} \(a checksum mismatch\) with records after it"):
        open_log(tmp_path, 0)


@pytest.mark.timeout(60)
def test_covered_segments_are_deleted_and_an_older_snapshot_is_refused(tmp_path: Path) -> None:
    wal = open_log(tmp_path, 0, segment_bytes=300)  # ~2 records with a 100-byte blob per segment
    for i in range(10):
        wal.append_event(Upload("p", f"L{i}", None), float(i), {"payload": ("none", 25, [b"x" * 100])})
    wal.sync()
    firsts = [int(p.name[:-4]) for p in _segments(tmp_path)]
    assert len(firsts) >= 4 and firsts[0] == 1
    covered = firsts[2] - 1  # a snapshot containing every record of the first two segments
    assert wal.drop_covered(covered) == 2
    assert [int(p.name[:-4]) for p in _segments(tmp_path)] == firsts[2:]
    wal.close()
    # a snapshot covering up to `covered` connects; the deleted records 1..covered are not needed
    reopened = open_log(tmp_path, covered, segment_bytes=300)
    assert reopened.next_seq == 11
    reopened.close()
    assert [seq for seq, _, _ in _read(tmp_path, covered)] == list(range(covered + 1, 11))
    # the initial snapshot (covering nothing) no longer connects to the log
    with pytest.raises(WalError, match=rf"covers the log up to record 0 but the log .* starts at record {covered + 1}.*older than the log"):
        open_log(tmp_path, 0)


@pytest.mark.timeout(60)
def test_a_snapshot_newer_than_every_segment_deletes_them_and_numbering_continues(tmp_path: Path) -> None:
    _write(tmp_path, 5)
    wal = open_log(tmp_path, 5)
    # only an empty segment named after the next record remains: it says where the log continues
    assert [(p.name, p.stat().st_size) for p in _segments(tmp_path)] == [(f"{6:020d}.wal", 0)]
    assert wal.next_seq == 6
    wal.close()


@pytest.mark.timeout(60)
def test_sync_makes_appends_durable_with_one_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])
    wal = open_log(tmp_path, 0)
    for i in range(3):
        wal.append_event(Ping("p", 1.0, i, True, None, ()), float(i))
    assert calls == []
    wal.sync()
    assert len(calls) == 1 and wal.syncs == 1
    wal.sync()  # nothing new: no second fdatasync
    assert len(calls) == 1
    wal.close()
