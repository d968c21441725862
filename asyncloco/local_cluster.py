"""A coordinator and peers as real processes on 127.0.0.1 — for ``asyncloco demo`` and integration tests.

Every process starts in its own session (process group), so stopping it also stops the p2pd daemon
hivemind spawned for it, even after a SIGKILL of the Python process: :meth:`LocalCluster.close`
sends SIGTERM, waits, then SIGKILLs the whole group. Waiting is always on a condition with a
deadline (:meth:`LocalCluster.wait_for`), never a fixed sleep.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["LocalCluster", "ClusterError"]

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """A process of the cluster failed; ``exit_code`` is its exit status when it exited (2: a usage or config
    error, which its log's ``asyncloco: error:`` line names)."""

    def __init__(self, message: str, exit_code: Optional[int] = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def last_error_line(log: Path) -> Optional[str]:
    """The last ``asyncloco: error: ...`` line a process wrote to ``log`` (the CLI's one-line errors), if any."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line for line in reversed(lines) if line.startswith("asyncloco: error:")), None)


class LocalCluster:
    """``with LocalCluster(config, workdir) as cluster: cluster.start_coordinator(); cluster.start_peer("a")``."""

    def __init__(
        self,
        config: str | Path,
        workdir: str | Path,
        *,
        threads: int = 1,
        env: Optional[dict[str, str]] = None,
        run_id: Optional[str] = None,
    ) -> None:
        self.config = str(config)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = self.workdir / "coordinator"
        self.threads = threads
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.run_id = run_id
        self.coordinator: Optional[subprocess.Popen[bytes]] = None
        self.peers: dict[str, subprocess.Popen[bytes]] = {}
        self.multiaddr: Optional[str] = None
        # every process ever started, so close() also reaches a replaced coordinator or a peer name reused
        self.spawned: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []

    # ---------------------------------------------------------------------------- processes

    def command(self, name: str, args: Sequence[str]) -> list[str]:
        """The command line of process ``name`` (a subclass may wrap it, e.g. in ``ip netns exec``)."""
        return [sys.executable, "-m", "asyncloco.cli", *args]

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        self._logs.append(log)
        process = subprocess.Popen(
            self.command(name, args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        self.spawned.append(process)
        return process

    def start_coordinator(self, resume: bool = False, timeout: float = 120.0, extra: Sequence[str] = ()) -> str:
        """Start (or ``resume``) the coordinator and return the multiaddr peers join through.

        ``extra``: more ``asyncloco coordinator`` arguments, e.g. ``("--dashboard-port", "0")``."""
        if self.coordinator is not None and self.coordinator.poll() is None:
            raise ClusterError("the coordinator is already running")
        launched = time.time()
        args = ["coordinator", "--config", self.config, "--checkpoint-dir", str(self.checkpoint_dir), "--threads", str(self.threads)]
        if resume:
            args.append("--resume")
        args.extend(extra)
        self.coordinator = self._spawn("coordinator", args)

        def up() -> bool:
            if self.coordinator is not None and self.coordinator.poll() is not None:
                log = self.workdir / "coordinator.log"
                said = last_error_line(log)
                said = f": {said[len('asyncloco: error: '):]}" if said else ""
                raise ClusterError(f"the coordinator exited with {self.coordinator.returncode}{said} (log: {log})",
                                   self.coordinator.returncode)
            status = self.status()
            return bool(status) and status.get("updated", 0) >= launched and bool(status.get("multiaddrs"))

        self.wait_for(up, timeout, "the coordinator to start")
        status = self.status()
        self.multiaddr = status["multiaddrs"][0]
        self.run_id = self.run_id or status["run_id"]
        return self.multiaddr

    def start_peer(self, name: str, slowdown: float = 1.0, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        if self.multiaddr is None:
            raise ClusterError("start the coordinator first")
        args = [
            "peer",
            "join",
            "--initial-peers",
            self.multiaddr,
            "--run-id",
            str(self.run_id),
            "--slowdown",
            str(slowdown),
            "--threads",
            str(self.threads),
            "--no-progress",
            "--summary",
            str(self.workdir / f"{name}.json"),
            *extra,
        ]
        process = self._spawn(name, args)
        self.peers[name] = process
        return process

    def start_validator(self, name: str, identity: Path, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        """``asyncloco validator join`` with key file ``identity`` (its id must be in runtime.verify.validators);
        its summary goes to ``<workdir>/<name>.json``."""
        if self.multiaddr is None:
            raise ClusterError("start the coordinator first")
        args = ["validator", "join", "--initial-peers", self.multiaddr, "--run-id", str(self.run_id), "--identity",
                str(identity), "--threads", str(self.threads), "--summary", str(self.workdir / f"{name}.json"), *extra]
        process = self._spawn(name, args)
        self.peers[name] = process
        return process

    def signal_group(self, process: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    def kill_peer(self, name: str) -> None:
        """SIGKILL a peer and everything it started (its p2pd included), as a crash would."""
        process = self.peers[name]
        self.signal_group(process, signal.SIGKILL)
        process.wait(timeout=30)

    def stop(self, process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout``, then SIGKILL the group. Returns the exit code."""
        if process.poll() is None:
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("process %d ignored SIGTERM for %.0fs; killing it", process.pid, timeout)
        self.signal_group(process, signal.SIGKILL)  # stragglers of the group (p2pd)
        return process.wait(timeout=30)

    def stop_coordinator(self, timeout: float = 60.0) -> int:
        if self.coordinator is None:
            raise ClusterError("no coordinator")
        return self.stop(self.coordinator, timeout)

    def close(self) -> None:
        # peers first (they would only retry against a stopped coordinator), then the coordinator, then
        # anything replaced earlier; stop() SIGKILLs each process group, so no p2pd outlives its owner
        ordered = list(self.peers.values()) + ([self.coordinator] if self.coordinator else [])
        ordered += [process for process in self.spawned if process not in ordered]
        for process in ordered:
            try:
                self.stop(process, timeout=20.0)
            except Exception as error:  # teardown must reach every process
                logger.warning("teardown of %d: %r", process.pid, error)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        path = self.checkpoint_dir / "status.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def events(self) -> list[dict[str, Any]]:
        path = self.checkpoint_dir / "events.jsonl"
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
        return out

    def peer_summary(self, name: str) -> dict[str, Any]:
        path = self.workdir / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_for(self, condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.2) -> Any:
        """Poll ``condition`` until it returns a truthy value or ``timeout`` passes (then raise)."""
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.workdir}")
            for name, process in self.peers.items():
                if process.poll() not in (None, 0, -signal.SIGKILL, -signal.SIGTERM):
                    logger.warning("peer %s exited with %s", name, process.returncode)
            time.sleep(poll)
