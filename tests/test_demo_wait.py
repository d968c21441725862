"""The demo counts --duration from when every peer has joined (asyncloco/demo.py wait_for_peers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncloco.demo import wait_for_peers
from asyncloco.local_cluster import ClusterError


class FakeProcess:
    def __init__(self, returncode: int | None = None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def statuses(*alive_counts: int) -> Any:
    """status() returning, call by call, status.json with that many live peers (and one dead one)."""
    calls: list[int] = []

    def status() -> dict[str, Any]:
        count = alive_counts[min(len(calls), len(alive_counts) - 1)]
        calls.append(count)
        peers = {f"p{i}": {"alive": True} for i in range(count)}
        peers["gone"] = {"alive": False}
        return {"peers": peers}

    status.calls = calls  # type: ignore[attr-defined]
    return status


def test_waits_until_every_peer_is_alive(tmp_path: Path) -> None:
    status = statuses(0, 1, 2, 3, 3)
    processes = {name: FakeProcess() for name in ("peer0", "peer1", "peer2")}
    assert wait_for_peers(status, processes, tmp_path, timeout=60, poll=0.0) is True
    assert status.calls == [0, 1, 2, 3]  # returned at the first status with 3 live peers, not before


def test_gives_up_at_the_timeout_without_raising(tmp_path: Path) -> None:
    status = statuses(1)
    assert wait_for_peers(status, {"peer0": FakeProcess(), "peer1": FakeProcess()}, tmp_path, timeout=0.0, poll=0.0) is False
    assert status.calls == [1]


def test_a_peer_that_exits_while_joining_is_named(tmp_path: Path) -> None:
    processes = {"peer0": FakeProcess(), "peer1": FakeProcess(returncode=2)}
    with pytest.raises(ClusterError, match=r"^peer1 exited early \(2\); see .*peer1\.log$"):
        wait_for_peers(statuses(0), processes, tmp_path, timeout=60, poll=0.0)
