"""The namespace WAN harness (``asyncloco.wan.netns``, used by ``scripts/wan.py``): two namespaces on a
bridge, a ``home`` access link (50/10 Mbit, 40 ms), a fault proxy in the server's namespace for the latency.

Measured: bulk TCP throughput each way within ±25 % of the tbf rate, the round trip at least twice the
one-way latency, and nothing — namespace, veth, bridge, process — left behind. Needs root and ``ip netns``;
skipped with the reason otherwise."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from asyncloco.wan.netns import PROFILES, WanNetwork, leftovers, namespaces_unavailable, wait_for_port_file

REASON = namespaces_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")


@pytest.mark.timeout(180)
def test_home_profile_rates_and_latency_then_nothing_left() -> None:
    profile = PROFILES["home"]  # 50 Mbit down, 10 Mbit up, 40 ms one way
    tag = None
    processes = []
    with tempfile.TemporaryDirectory() as scratch, WanNetwork() as net:
        tag = net.tag
        server = net.add_node("srv")
        client = net.add_node("cli", profile)
        sink = net.spawn(server, [sys.executable, "-m", "asyncloco.wan.probe", "serve", "--host", "127.0.0.1", "--port", "5201"])
        port_file = str(Path(scratch) / "proxy.port")
        latency_ms = profile.latency_ms
        proxy = net.spawn(
            server,
            [sys.executable, "-m", "asyncloco.wan.proxy", "--listen", f"{server.address}:0", "--target", "127.0.0.1:5201",
             "--latency-ms", str(latency_ms), "--port-file", port_file],
        )  # fmt: skip
        processes = [sink, proxy]
        port = wait_for_port_file(port_file)
        out = net.run(
            client,
            [sys.executable, "-m", "asyncloco.wan.probe", "measure", "--host", server.address, "--port", str(port),
             "--up-bytes", str(3_000_000), "--down-bytes", str(12_000_000), "--pings", "5"],
        )  # fmt: skip
        result = json.loads(out)
    print(f"\nhome link measured: {result}")
    assert profile.up_mbit is not None and profile.down_mbit is not None
    assert abs(result["up_mbit"] - profile.up_mbit) <= 0.25 * profile.up_mbit, result
    assert abs(result["down_mbit"] - profile.down_mbit) <= 0.25 * profile.down_mbit, result
    assert min(result["rtt_s"]) >= 2 * latency_ms / 1000.0 * 0.97, result
    assert tag is not None and leftovers(tag) == []
    assert all(p.poll() is not None for p in processes)


@pytest.mark.timeout(60)
def test_close_removes_everything_after_an_exception() -> None:
    tag = None
    with pytest.raises(RuntimeError, match="boom"):
        with WanNetwork() as net:
            tag = net.tag
            net.add_node("a", PROFILES["far"])
            net.add_node("b")
            assert len(leftovers(tag)) == 2 + 2 + 1  # two namespaces, two host-side veths, the bridge
            raise RuntimeError("boom")
    assert tag is not None and leftovers(tag) == []


@pytest.mark.timeout(60)
def test_inside_namespace_moves_this_thread_and_its_children_and_comes_back() -> None:
    """What scripts/bench_swarm.py --wan relies on: the calling thread (and a process it starts) runs in the node's
    namespace — it sees the node's address and no host interface — and is back in its own afterwards."""
    import os
    import subprocess

    from asyncloco.wan.netns import inside_namespace

    own = os.stat("/proc/thread-self/ns/net").st_ino
    with WanNetwork() as net:
        tag = net.tag
        node = net.add_node("n1", PROFILES["home"])
        inside = os.stat(f"/var/run/netns/{node.namespace}").st_ino
        with inside_namespace(node.namespace):
            assert os.stat("/proc/thread-self/ns/net").st_ino == inside != own
            links = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
        assert os.stat("/proc/thread-self/ns/net").st_ino == own
    assert f"{node.address}/24" in links and net.bridge not in links and node.veth_node in links
    assert leftovers(tag) == []
