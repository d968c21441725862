"""A :class:`~asyncloco.local_cluster.LocalCluster` whose coordinator is reachable only through a fault proxy.

libp2p tells every peer the coordinator's real listen addresses (the identify protocol), and a peer whose
connection dropped redials *all* the addresses it knows: a coordinator merely listening on another loopback
address (127.0.0.2) is dialed directly after the first reset, bypassing the proxy. So the coordinator runs in
a private network namespace of its own (``unshare --net --map-root-user``: no root needed where unprivileged
user namespaces are allowed), listening on that namespace's 127.0.0.1 at a fixed port. A relay inside the
namespace (``python -m asyncloco.wan.proxy --listen-unix``) forwards a unix socket — the file system is shared
across network namespaces — to that port, and the :class:`~asyncloco.wan.proxy.FaultProxy` outside forwards
its TCP port to the unix socket. The only way in is the proxy; the addresses identify reveals
(127.0.0.1:<port> in the coordinator's namespace) lead nowhere from a peer's.

::

    peer ──tcp──▶ FaultProxy (127.0.0.1:P) ──unix──▶ relay ──tcp──▶ coordinator (127.0.0.1:Q, own netns)
"""

from __future__ import annotations

import logging
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from asyncloco.local_cluster import LocalCluster
from asyncloco.wan.proxy import ProxyThread

__all__ = ["ProxiedCluster", "isolation_unavailable"]

logger = logging.getLogger(__name__)


def isolation_unavailable() -> Optional[str]:
    """None when a process can be put in a private network namespace here; else the reason it cannot."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs `unshare` (util-linux) and `ip` (iproute2) to isolate the coordinator's network"
    try:
        result = subprocess.run(
            ["unshare", "--net", "--map-root-user", "--", "ip", "link", "set", "lo", "up"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`unshare --net --map-root-user` failed: {error!r}"
    if result.returncode != 0:
        return (
            "`unshare --net --map-root-user` is not allowed here "
            f"({result.stderr.strip() or result.returncode}); enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1) or run as root"
        )
    return None


class ProxiedCluster(LocalCluster):
    """Coordinator in its own network namespace behind ``proxy``; peers join through the proxy (module doc).

    ``multiaddr`` (what :meth:`start_peer` hands to peers) is the proxy's address with the coordinator's
    ``/p2p/`` id; ``direct_multiaddr`` is what the coordinator itself reports."""

    def __init__(
        self,
        config: str | Path,
        workdir: str | Path,
        proxy: ProxyThread,
        *,
        coordinator_port: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, workdir, **kwargs)
        self.proxy = proxy
        # the namespace is private: any port is free there; fixed so that --resume finds the same one
        self.coordinator_port = coordinator_port or random.Random().randrange(20000, 60000)
        self._relay_dir = tempfile.mkdtemp(prefix="asyncloco-relay-")  # short: unix socket paths are <= 107 bytes
        self.relay_socket = str(Path(self._relay_dir) / "coordinator.sock")
        self.direct_multiaddr: Optional[str] = None
        proxy.call(lambda p: p.set_target_unix(self.relay_socket))

    def _spawn(self, name: str, args: Sequence[str]) -> subprocess.Popen[bytes]:
        if name != "coordinator":
            return super()._spawn(name, args)
        python = shlex.quote(sys.executable)
        relay = (
            f"{python} -m asyncloco.wan.proxy --listen-unix {shlex.quote(self.relay_socket)} "
            f"--target 127.0.0.1:{self.coordinator_port}"
        )
        coordinator = " ".join(
            [python, "-m", "asyncloco.cli", *map(shlex.quote, args), "--port", str(self.coordinator_port)]
        )
        script = f"ip link set lo up && {{ {relay} & }} && exec {coordinator}"
        log = (self.workdir / f"{name}.log").open("ab")
        self._logs.append(log)
        process = subprocess.Popen(
            ["unshare", "--net", "--map-root-user", "--", "sh", "-c", script],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        self.spawned.append(process)
        return process

    def start_coordinator(self, resume: bool = False, timeout: float = 120.0, extra: Sequence[str] = ()) -> str:
        direct = super().start_coordinator(resume=resume, timeout=timeout, extra=extra)
        self.direct_multiaddr = direct
        peer_id = direct.rsplit("/p2p/", 1)[1]
        self.multiaddr = f"/ip4/{self.proxy.proxy.listen_host}/tcp/{self.proxy.port}/p2p/{peer_id}"
        return self.multiaddr

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(self._relay_dir, ignore_errors=True)
