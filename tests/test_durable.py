"""asyncloco/durable.py: a file written whole or not at all."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import pytest

from asyncloco.durable import write_durably


@pytest.mark.timeout(30)
def test_a_write_replaces_the_file_whole_and_a_failed_one_leaves_the_old_content_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.bin"
    assert write_durably(target, lambda handle: handle.write(b"first")) == target
    assert target.read_bytes() == b"first"

    def half(handle: BinaryIO) -> None:
        handle.write(b"half of the second")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_durably(target, half)
    assert target.read_bytes() == b"first" and sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]
    write_durably(target, lambda handle: handle.write(b"second"))
    assert target.read_bytes() == b"second" and sorted(p.name for p in target.parent.iterdir()) == ["file.bin"]
