"""Wide-area links between network namespaces: one namespace per node, a veth pair to a shared bridge, and
``tc tbf`` bandwidth caps per direction (root required).

Each node gets namespace ``<tag>-<name>``, address ``10.<net>.0.<i>/24`` on its veth, and, with a profile:

* upload cap: ``tbf`` on the egress of the node's own veth end (what the node sends);
* download cap: ``tbf`` on the egress of the bridge-side veth end (what the bridge delivers to the node) —
  shaping egress on both ends gives asymmetric up/down without an ifb device.

One-way latency and loss are not done here (no netem on this kernel): :class:`~asyncloco.wan.proxy.FaultProxy`
adds them in userspace, in front of the coordinator (``scripts/wan.py`` runs one per peer in the
coordinator's namespace).

:class:`WanNetwork` is a context manager that removes every namespace, veth, qdisc and bridge it made and
kills every process it started (each in its own session, the whole group), on exit, on an exception, on
SIGINT/SIGTERM (its handlers turn them into exceptions while it is active) and at interpreter exit
(``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, Iterator, Optional, Sequence, Union

__all__ = ["Profile", "PROFILES", "Node", "WanNetwork", "NetnsError", "namespaces_unavailable", "tc_burst_bytes",
           "enter_namespace", "inside_namespace"]

logger = logging.getLogger(__name__)


class NetnsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Profile:
    """An access link: download/upload in Mbit/s (None: unlimited), one-way latency, segment loss."""

    name: str
    down_mbit: Optional[float]
    up_mbit: Optional[float]
    latency_ms: float = 0.0
    loss: float = 0.0

    def describe(self) -> str:
        rates = f"{self.down_mbit or '∞'}/{self.up_mbit or '∞'} Mbit"
        loss = f" {self.loss * 100:g} % loss" if self.loss else ""
        return f"{self.name}: {rates} {self.latency_ms:g} ms{loss}"


PROFILES: dict[str, Profile] = {
    "home": Profile("home", 50.0, 10.0, 40.0),
    "campus": Profile("campus", 500.0, 500.0, 10.0),
    "far": Profile("far", 20.0, 5.0, 150.0, 0.01),
    "lan": Profile("lan", None, None, 0.0),
    # `home` as the 150m preset on an H200 meets it, scaled to the demo's tiny model on this CPU (docs/wan.md,
    # "150m on a home link"): transfer time over compute time kept — 151 MB int8 up at 10 Mbit/s is 121 s against
    # 4.4 s per 50-step lease (27.5 ×); the tiny model's 369 kB int8 up against its 30-step lease of ≈ 1.08 s
    "home150": Profile("home150", 0.49, 0.099, 40.0),
}


def tc_burst_bytes(mbit: float) -> int:
    """tbf bucket: 10 ms at the rate, at least 64 KiB (a GSO super-packet on a veth must fit in the bucket)."""
    return int(max(65536, mbit * 1e6 / 8 * 0.01))


@dataclass
class Node:
    name: str
    namespace: str
    address: str  # IPv4 on its veth
    veth_node: str  # end inside the namespace
    veth_host: str  # end on the bridge
    profile: Optional[Profile]


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    logger.debug("$ %s", " ".join(argv))
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def namespaces_unavailable() -> Optional[str]:
    """None when network namespaces, veth, bridges and tbf can be used here; else why not (and the fix)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs `ip` and `tc` (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc qdiscs); run as root or with sudo"
    probe = f"alprobe{uuid.uuid4().hex[:6]}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as error:
        return f"`ip netns add` is not permitted here: {error}"
    try:
        _run(["ip", "netns", "exec", probe, "ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst", "64kb", "latency", "50ms"])
    except NetnsError as error:
        return f"veth pairs or the tbf qdisc are unavailable: {error}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


class WanNetwork:
    """``with WanNetwork() as net: a = net.add_node("coord"); b = net.add_node("peer0", PROFILES["home"])``."""

    _active: list["WanNetwork"] = []

    def __init__(self, tag: Optional[str] = None, subnet: Optional[int] = None) -> None:
        self.tag = tag or f"al{uuid.uuid4().hex[:5]}"
        if len(self.tag) > 7:
            raise NetnsError(f"tag {self.tag!r} too long: interface names are limited to 15 characters")
        self.subnet = subnet if subnet is not None else 100 + int(uuid.uuid4().hex[:4], 16) % 150
        self.bridge = f"{self.tag}br"
        self.nodes: dict[str, Node] = {}
        self.processes: list[subprocess.Popen[bytes]] = []
        self._created_namespaces: list[str] = []
        self._bridge_made = False
        self._closed = False
        self._saved_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "WanNetwork":
        reason = namespaces_unavailable()
        if reason is not None:
            raise NetnsError(reason)
        WanNetwork._active.append(self)
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._saved_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: atexit and __exit__ still clean up
                pass
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._bridge_made = True
        _run(["ip", "link", "set", self.bridge, "up"])
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        logger.warning("signal %d: tearing the WAN network down", signum)
        self.close()
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def close(self) -> None:
        """Kill every process started here, delete every veth, namespace and the bridge. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for process in self.processes:
            self._stop(process)
        for node in self.nodes.values():
            _run(["ip", "link", "del", node.veth_host], check=False)  # deletes both ends and their qdiscs
        for namespace in self._created_namespaces:
            _run(["ip", "netns", "del", namespace], check=False)
        if self._bridge_made:
            _run(["ip", "link", "del", self.bridge], check=False)
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        atexit.unregister(self.close)
        if self in WanNetwork._active:
            WanNetwork._active.remove(self)
        logger.info("WAN network %s removed", self.tag)

    @staticmethod
    def _stop(process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("process %d ignored SIGTERM; killing its group", process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)

    # ---------------------------------------------------------------------------------- nodes

    def add_node(self, name: str, profile: Optional[Profile] = None) -> Node:
        if name in self.nodes:
            raise NetnsError(f"node {name!r} exists")
        index = len(self.nodes) + 1
        if index > 250:
            raise NetnsError("at most 250 nodes per network")
        namespace = f"{self.tag}-{name}"
        veth_host, veth_node = f"{self.tag}h{index}", f"{self.tag}n{index}"
        node = Node(name, namespace, f"10.{self.subnet}.0.{index}", veth_node, veth_host, profile)
        _run(["ip", "netns", "add", namespace])
        self._created_namespaces.append(namespace)
        self.nodes[name] = node
        _run(["ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_node])
        _run(["ip", "link", "set", veth_node, "netns", namespace])
        _run(["ip", "link", "set", veth_host, "master", self.bridge])
        _run(["ip", "link", "set", veth_host, "up"])
        inside = ["ip", "netns", "exec", namespace]
        _run([*inside, "ip", "addr", "add", f"{node.address}/24", "dev", veth_node])
        _run([*inside, "ip", "link", "set", veth_node, "up"])
        _run([*inside, "ip", "link", "set", "lo", "up"])
        if profile is not None:
            if profile.up_mbit:
                self._tbf(inside, veth_node, profile.up_mbit)
            if profile.down_mbit:
                self._tbf([], veth_host, profile.down_mbit)
        logger.info("node %s in %s at %s (%s)", name, namespace, node.address, profile.describe() if profile else "unshaped")
        return node

    @staticmethod
    def _tbf(prefix: list[str], device: str, mbit: float) -> None:
        _run([*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
              "burst", str(tc_burst_bytes(mbit)), "latency", "100ms"])  # fmt: skip

    def spawn(
        self,
        node: Union[Node, str],
        argv: Sequence[str],
        *,
        log: Optional[IO[bytes]] = None,
        env: Optional[dict[str, str]] = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the node's namespace, in its own session; stopped by :meth:`close`."""
        node = self.nodes[node] if isinstance(node, str) else node
        process = subprocess.Popen(
            ["ip", "netns", "exec", node.namespace, *argv],
            stdout=log if log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
        self._stop(process, timeout)
        return int(process.returncode)

    def run(self, node: Union[Node, str], argv: Sequence[str], timeout: float = 120.0) -> str:
        """Run ``argv`` in the node's namespace to completion; returns its stdout."""
        node = self.nodes[node] if isinstance(node, str) else node
        result = subprocess.run(
            ["ip", "netns", "exec", node.namespace, *argv], capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise NetnsError(f"{argv} in {node.namespace} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        return result.stdout


_CLONE_NEWNET = 0x40000000


def _setns(fd: int, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise NetnsError(f"setns into {what} failed: {os.strerror(errno)} (needs root)")


def enter_namespace(namespace: str) -> None:
    """Move the calling thread — and every process it starts afterwards, e.g. a p2pd — into network namespace
    ``namespace`` (made by :meth:`WanNetwork.add_node`). For a benchmark's worker process, before it opens any socket."""
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(fd, namespace)
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside_namespace(namespace: str) -> Iterator[None]:
    """:func:`enter_namespace` for the ``with`` block, then back to the thread's own namespace (so that
    :meth:`WanNetwork.close` runs where the network was made)."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter_namespace(namespace)
        try:
            yield
        finally:
            _setns(original, "the original namespace")
    finally:
        os.close(original)


def leftovers(tag: str) -> list[str]:
    """Namespaces and links whose names start with ``tag`` (empty after a clean :meth:`WanNetwork.close`)."""
    found = [f"netns {line.split()[0]}" for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.startswith(tag)]
    for line in _run(["ip", "-o", "link", "show"]).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(tag):
            found.append(f"link {name}")
    return found


def wait_for_port_file(path: str, timeout: float = 60.0) -> int:
    """The port a process wrote to ``path`` once listening (see ``python -m asyncloco.wan.proxy --port-file``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = open(path).read().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise NetnsError(f"no port written to {path} within {timeout:.0f}s")
