"""Faults of a wide-area link, injected by the userspace proxy (``asyncloco.wan``), no root needed (issue 11).

Unit tests of :class:`~asyncloco.wan.proxy.FaultProxy` on plain sockets pin each emulated property exactly
(bytes before a reset, loss draws per seed, nothing forwarded in a partition) or by a bound that only the
emulation can produce (a transfer cannot beat the bandwidth cap; a round trip cannot beat twice the one-way
latency).

Integration tests (``-m integration``) run a real coordinator and a real peer process; the coordinator sits
in a private network namespace (:class:`~asyncloco.wan.cluster.ProxiedCluster`), so the proxy is the only
path — checked by its byte counters. Each fault: training continues, no partial upload is applied, no update
is applied twice (journal ``applied`` records: versions 1..V, lease ids unique), every acceptance the peer
logged is exactly one applied record, the same peer process recovers, and the time to recover is printed and
written to ``fault-recovery.json`` (in the test's directory, and appended to ``$ASYNCLOCO_FAULT_REPORT`` if
set).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml

from asyncloco.wan.proxy import SEGMENT_BYTES, Direction, FaultProxy, LinkShape

# ------------------------------------------------------------------------------ proxy unit tests


async def _sink_server() -> tuple[asyncio.base_events.Server, int, list[bytes], asyncio.Event]:
    """A server that keeps everything it receives; ``done`` is set at EOF or reset."""
    received: list[bytes] = []
    done = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                received.append(data)
        except ConnectionError:
            pass
        finally:
            done.set()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1]), received, done


async def _echo_server() -> tuple[asyncio.base_events.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


@pytest.mark.timeout(90)
def test_bandwidth_cap_bounds_a_bulk_transfer() -> None:
    size, rate = 600_000, 8e6  # 0.6 s at 8 Mbit/s

    async def scenario() -> tuple[float, int, int]:
        server, port, received, done = await _sink_server()
        async with server, FaultProxy("127.0.0.1", port, up=LinkShape(bandwidth_bps=rate)) as proxy:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
            started = time.monotonic()
            writer.write(os.urandom(size))
            await writer.drain()
            writer.write_eof()
            await done.wait()
            elapsed = time.monotonic() - started
            writer.close()
            return elapsed, sum(map(len, received)), proxy.counters.bytes["up"]

    elapsed, got, counted = _run(scenario())
    assert got == counted == size
    assert elapsed >= size * 8 / rate * 0.97  # the cap: never faster (3 % for timer granularity)
    assert elapsed < size * 8 / rate + 3.0  # and not stuck (generous for a busy machine)


@pytest.mark.timeout(90)
def test_one_way_latency_adds_up_to_the_round_trip_and_can_spike() -> None:
    latency = 0.05

    async def rtt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
        started = time.monotonic()
        writer.write(b"x" * 100)
        await writer.drain()
        await reader.readexactly(100)
        return time.monotonic() - started

    async def scenario() -> tuple[list[float], list[float]]:
        server, port = await _echo_server()
        shape = LinkShape(latency_s=latency)
        async with server, FaultProxy("127.0.0.1", port, up=shape, down=shape) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
            normal = [await rtt(reader, writer) for _ in range(5)]
            spike = LinkShape(latency_s=0.3)
            proxy.set_shape(Direction.UP, spike)
            proxy.set_shape(Direction.DOWN, spike)
            spiked = [await rtt(reader, writer) for _ in range(2)]
            writer.close()
            return normal, spiked

    normal, spiked = _run(scenario())
    assert min(normal) >= 2 * latency * 0.97
    assert min(spiked) >= 2 * 0.3 * 0.97
    assert min(normal) < 2 * latency + 1.0


@pytest.mark.timeout(90)
def test_reset_after_exactly_n_bytes_reaches_both_ends() -> None:
    async def scenario() -> tuple[int, bool, dict[str, Any]]:
        server, port, received, done = await _sink_server()
        async with server, FaultProxy("127.0.0.1", port) as proxy:
            proxy.arm_reset(Direction.UP, 100_000)
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
            client_saw_reset = False
            try:
                for _ in range(40):
                    writer.write(os.urandom(10_000))
                    await writer.drain()
                # the proxy reset the client side: the read fails (or ends) instead of hanging
                client_saw_reset = await reader.read(1) == b""
            except ConnectionError:
                client_saw_reset = True
            await done.wait()
            writer.close()
            return sum(map(len, received)), client_saw_reset, proxy.snapshot()

    got, client_saw_reset, snapshot = _run(scenario())
    assert got == 100_000
    assert client_saw_reset
    assert [(r["direction"], r["connection"], r["at_byte"]) for r in snapshot["resets"]] == [("up", 1, 100_000)]


@pytest.mark.timeout(90)
def test_partition_forwards_nothing_and_heal_resets_stale_connections() -> None:
    async def scenario() -> dict[str, Any]:
        server, port = await _echo_server()
        async with server, FaultProxy("127.0.0.1", port) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
            writer.write(b"a" * 10)
            assert await reader.readexactly(10) == b"a" * 10
            before = dict(proxy.counters.bytes)
            proxy.partition()
            writer.write(b"b" * 1000)
            await writer.drain()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.readexactly(1), timeout=1.0)
            frozen = dict(proxy.counters.bytes)
            proxy.heal(reset=True)
            stale_failed = False
            try:
                stale_failed = await asyncio.wait_for(reader.read(1), timeout=10) == b""
            except ConnectionError:
                stale_failed = True
            writer.close()
            # a new connection after the heal works
            reader2, writer2 = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
            writer2.write(b"c" * 10)
            fresh = await asyncio.wait_for(reader2.readexactly(10), timeout=10)
            writer2.close()
            return {"before": before, "frozen": frozen, "stale_failed": stale_failed, "fresh": fresh}

    result = _run(scenario())
    assert result["frozen"] == result["before"] == {"up": 10, "down": 10}
    assert result["stale_failed"]
    assert result["fresh"] == b"c" * 10


@pytest.mark.timeout(90)
def test_loss_stalls_are_drawn_per_segment_from_the_seed() -> None:
    size, loss, seed = 300_000, 0.05, 7

    async def scenario(seed: int) -> int:
        server, port, received, done = await _sink_server()
        shape = LinkShape(loss=loss, loss_stall_s=0.001)
        async with server, FaultProxy("127.0.0.1", port, up=shape, seed=seed) as proxy:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
            payload = os.urandom(size)
            for start in range(0, size, 7_000):  # uneven writes: the draws must not depend on read sizes
                writer.write(payload[start : start + 7_000])
                await writer.drain()
            writer.write_eof()
            await done.wait()
            writer.close()
            assert b"".join(received) == payload
            return proxy.counters.stalls

    rng = random.Random(f"{seed}/1/up")  # the proxy's documented stream: (seed, connection 1, direction)
    expected = sum(1 for _ in range(math.ceil(size / SEGMENT_BYTES)) if rng.random() < loss)
    assert _run(scenario(seed)) == expected
    assert _run(scenario(seed)) == expected
    assert expected > 0


def test_bad_shapes_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="loss must be a probability"):
        LinkShape(loss=1.5)
    with pytest.raises(ValueError, match="bandwidth_bps must be > 0"):
        LinkShape(bandwidth_bps=0)
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        LinkShape(latency_s=-1)


# ------------------------------------------------------------------- timeouts from link speed (item 4)


def test_link_speed_timeouts_follow_the_measured_bandwidth() -> None:
    from asyncloco.transport.linkspeed import LinkSpeed

    link = LinkSpeed(factor=3.0, floor_s=30.0, ceiling_s=3600.0, backoff=2.0, smoothing=0.5, min_bytes=1000)
    theta = 600_000_000  # 600 MB
    # before any measurement: the assumed 1 Mbit/s
    assert link.timeout("down", theta) == 3600.0  # 3 x 4800 s, capped
    assert link.timeout("down", 1000) == 30.0  # the floor
    # 10 Mbit/s measured down: 600 MB take 480 s -> 3 x 480 s
    assert link.observe("down", 12_500_000, 10.0)
    assert link.bytes_per_s("down") == 1_250_000
    assert link.expected_s("down", theta) == 480.0
    assert link.timeout("down", theta) == 1440.0
    assert link.timeout("down", theta, attempt=1) == 2880.0  # backoff after a failed attempt
    assert link.timeout("down", theta, attempt=2) == 3600.0  # ceiling
    # a second sample at 50 Mbit/s moves the average halfway: (1.25e6 + 6.25e6) / 2
    assert link.observe("down", 62_500_000, 10.0)
    assert link.bytes_per_s("down") == 3_750_000
    assert link.timeout("down", theta) == 3 * theta / 3_750_000
    # latency-bound calls and nonsense durations are not samples; directions are separate
    assert not link.observe("up", 999, 0.001)
    assert not link.observe("up", 10_000, 0.0)
    assert link.samples == {"up": 0, "down": 2}
    assert link.observe("up", 1_250_000, 2.0)  # 5 Mbit/s up
    assert link.transfer_s(down_bytes=3_750_000, up_bytes=625_000) == 1.0 + 1.0
    with pytest.raises(ValueError, match="direction must be 'up' or 'down'"):
        link.timeout("sideways", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="factor must be >= 1"):
        LinkSpeed(factor=0.5)
