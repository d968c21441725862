"""Faults of a wide-area link, injected by the userspace proxy (``asyncloco.wan``), no root needed.

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
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml

from asyncloco.wan.proxy import SEGMENT_BYTES, Direction, FaultProxy, LinkShape, ProxyThread

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
    # before any measurement: the assumed 0.1 Mbit/s (a home uplink's first upload must not time out)
    assert link.timeout("down", theta) == 3600.0  # 3 x 48,000 s, capped
    assert link.timeout("down", 1000) == 30.0  # the floor
    assert link.timeout("up", 369_000) == pytest.approx(3 * 369_000 / 12_500)  # the tiny model's int8 upload: 88.6 s
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
    # a small body that took long (>= min_seconds) is bandwidth-bound: a sample (190 kB in 15.2 s: 0.1 Mbit/s)
    slow = LinkSpeed(smoothing=1.0)
    assert slow.observe("up", 190_000, 15.2) and slow.bytes_per_s("up") == pytest.approx(12_500)
    assert not slow.observe("up", 190_000, 1.9)  # under min_seconds and min_bytes: latency-bound
    assert slow.samples["up"] == 1
    with pytest.raises(ValueError, match="direction must be 'up' or 'down'"):
        link.timeout("sideways", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="factor must be >= 1"):
        LinkSpeed(factor=0.5)



# ------------------------------------------------------------------ real processes behind the proxy

REPORT_VAR = "ASYNCLOCO_FAULT_REPORT"
ACK = re.compile(r"lease (L\w+) accepted: version (\d+)( \(duplicate\))?")
FAILED_SUBMIT = re.compile(r"submit of (L\w+) failed")
FAILED_REVEAL = re.compile(r"revealing lease (L\w+)'s (?:start state|states) failed \(.*\); sending it again")


def wan_config(directory: Path, *, lease_slack: float = 5.0, max_local_steps: int = 10, verify: bool = False) -> Path:
    """The tiny LM, 512 tokens a step, int8 pseudo-gradients, short leases (factor 2 + ``lease_slack`` s)."""
    config = {
        "name": "wan-faults",
        "seed": 0,
        "task": {"kind": "lm", "model": "tiny", "source": "embedded", "seq_len": 64, "batch_size": 8,
                 "num_shards": 4, "val_sequences": 16, "max_train_sequences": 4000},
        "inner": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 5, "weight_decay": 0.1, "grad_clip": 1.0},
        "outer": {"lr": 0.7, "momentum": 0.9, "buffer_size": 3},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": max_local_steps, "min_steps": 1, "grace_period": 0.5},
        "sim": {"workers": 3},
        "runtime": {"run_id": f"wan-{uuid.uuid4().hex[:12]}", "codec": "int8", "eval_every": 5,
                    "speed_report_period": 1.0, "lease_timeout_factor": 2.0, "lease_slack": lease_slack},
    }  # fmt: skip
    from asyncloco.config import RuntimeConfig

    if "gate" in RuntimeConfig.model_fields:
        # the robust-update gate judges directions against a consensus of other peers; with a single peer and
        # a handful of updates it is not what these tests are about (it has its own tests)
        config["runtime"]["gate"] = {"enabled": False}  # type: ignore[index]
    # verification (on by default) sends a checked lease's start state up (8 bytes per parameter) between the uploads
    # these tests cut at byte counts; its own reset: test_a_reveal_reset_mid_upload_is_sent_again
    # (no end state kept, coordinator/chained.py: every check but a fresh start's asks for its reveal, which is cut).
    # Never a fresh start (fresh_start_reveal_s 0): the uplink a peer reports is measured on its submits, whose time
    # includes the coordinator's work, and one slow sample below the 256 KiB/s floor makes the next leases start fresh
    # with nothing to reveal, which moves the reveal away from the byte the reset is armed at (the likely cause of a
    # CI run where the reset fired and no reveal failed; not reproduced here)
    keep = {"keep_states_mb": 0, "fresh_start_reveal_s": 0} if verify else {}
    config["runtime"]["verify"] = {"enabled": verify, **keep}  # type: ignore[index]
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _session_members(sessions: set[int]) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) in sessions and fields[0] != "Z":
                members.append(int(entry))
    return members


class Wan:
    """One proxy and one :class:`ProxiedCluster` per test; torn down (and checked) by the fixture."""

    def __init__(self, tmp_path: Path) -> None:
        from asyncloco.wan.cluster import ProxiedCluster

        self.tmp_path = tmp_path
        self.proxy = ProxyThread(FaultProxy(seed=11))
        self.proxy.start()
        self.cluster = ProxiedCluster(wan_config(tmp_path), tmp_path / "cluster", self.proxy, threads=1)
        self.report: dict[str, Any] = {}

    def configure(self, **kwargs: Any) -> None:
        self.cluster.config = str(wan_config(self.tmp_path, **kwargs))

    def applied(self) -> list[dict[str, Any]]:
        return [e for e in self.cluster.events() if e["type"] == "applied"]

    def applied_after(self, moment: float) -> list[dict[str, Any]]:
        return [e for e in self.applied() if e["time"] > moment]

    def wait_applied(self, count: int, timeout: float, what: str) -> list[dict[str, Any]]:
        def enough() -> Optional[list[dict[str, Any]]]:
            applied = self.applied()
            return applied if len(applied) >= count else None

        return self.cluster.wait_for(enough, timeout, what)

    def peer_log(self, name: str = "p") -> str:
        path = self.cluster.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def check_invariants(self, name: str = "p") -> dict[str, Any]:
        """No update applied twice; every acceptance the peer logged is exactly one applied record — or, for a checked
        lease the peer goes on training past, a held update whose verdict is still to come."""
        # the peer's log first, then one snapshot of the journal: every ack read was sent before the journal is read
        acks = [(m[1], int(m[2]), bool(m[3])) for m in ACK.finditer(self.peer_log(name))]
        events = self.cluster.events()
        applied = [e for e in events if e["type"] == "applied"]
        assert [e["version"] for e in applied] == list(range(1, len(applied) + 1)), applied
        lease_ids = [e["lease_id"] for e in applied]
        assert len(set(lease_ids)) == len(lease_ids), lease_ids
        by_lease = {e["lease_id"]: e for e in applied}
        # a checked lease is acknowledged when held and applied once its check agrees, at a later version
        held = {e["lease_id"] for e in events if e["type"] == "held"}
        last = {e["lease_id"]: e["type"] for e in events if e.get("lease_id")}  # each lease's latest record
        for lease_id, version, duplicate in acks:
            if last.get(lease_id) == "held":
                continue  # acknowledged while held, its check still on its way (no verdict, no drop): not applied yet
            assert lease_id in by_lease, f"the peer saw {lease_id} accepted but it was never applied"
            if not duplicate:
                applied_at = by_lease[lease_id]["version"]
                assert applied_at > version if lease_id in held else applied_at == version, (lease_id, version, applied_at)
        fresh = [lease for lease, _, duplicate in acks if not duplicate]
        assert len(set(fresh)) == len(fresh), f"a lease acknowledged as new twice: {fresh}"
        return {"applied": len(applied), "acks": len(acks)}

    def record(self, name: str, **figures: Any) -> None:
        """Report a fault's figures: printed, in <tmp>/fault-recovery.json and appended to $ASYNCLOCO_FAULT_REPORT."""
        self.report[name] = figures
        print(f"\n[wan fault] {name}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))
        (self.tmp_path / "fault-recovery.json").write_text(json.dumps(self.report, indent=1))
        target = os.environ.get(REPORT_VAR)
        if target:
            with open(target, "a") as handle:
                handle.write(json.dumps({"fault": name, **figures}) + "\n")

    def assert_through_proxy(self, numel: int) -> dict[str, Any]:
        """Every applied update's bytes crossed the proxy: the coordinator has no other reachable address.
        (Compared with what the coordinator applied, not with what the peer wrote: a reset upload's bytes
        were written by the peer but only partly forwarded.)"""
        from asyncloco.transport.codecs import wire_bytes

        snapshot = self.proxy.snapshot()
        applied = len(self.applied())
        assert applied > 0
        assert snapshot["bytes_up"] >= applied * wire_bytes("int8", numel), (snapshot, applied)
        assert snapshot["bytes_down"] >= wire_bytes("bf16", numel), snapshot  # θ came down through it too
        return snapshot

    def numel(self) -> int:
        return int([e for e in self.cluster.events() if e["type"] == "start"][0]["numel"])

    def close(self) -> None:
        """SIGKILL every process group started here (peer, coordinator with its DHT process, p2pd and relay),
        then check that nothing of them is left. A graceful stop cost 5-8 s per test (15 s after the latency
        test), none of it a timeout: a peer finishes and submits its lease at SIGTERM, and then each Python
        process spends seconds in interpreter finalization (its final garbage collection over ~400k objects
        of torch/transformers/hivemind: 12 s measured at load 14 on this 2-core machine, against 2 s when
        the process leaves with os._exit). Orderly exits are checked where they are the point: the latency
        test stops its peer with SIGTERM (exit code 0, its acknowledgements equal the coordinator's applied
        records), the restart test stops the coordinator with SIGTERM (exit code 0)."""
        sessions = {process.pid for process in self.cluster.spawned}
        try:
            for process in self.cluster.spawned:
                self.cluster.signal_group(process, signal.SIGKILL)
            for process in self.cluster.spawned:
                process.wait(timeout=30)
            self.cluster.close()  # closes the logs (every process has exited) and the relay directory
        finally:
            self.proxy.close()
        deadline = time.monotonic() + 30.0
        while (left := _session_members(sessions)) and time.monotonic() < deadline:
            time.sleep(0.1)  # SIGKILLed processes are being reaped; the condition is their absence
        assert not left, f"processes left behind: {left}"


@pytest.fixture
def wan(tmp_path: Path) -> Iterator[Wan]:
    from asyncloco.wan.cluster import isolation_unavailable

    reason = isolation_unavailable()
    if reason is not None:
        pytest.skip(f"cannot isolate the coordinator behind the proxy: {reason}")
    harness = Wan(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def _first(condition: Any, cluster: Any, timeout: float, what: str) -> Any:
    return cluster.wait_for(condition, timeout, what)


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_reset_mid_upload_and_mid_download(wan: Wan) -> None:
    from asyncloco.transport.codecs import wire_bytes

    cluster = wan.cluster
    cluster.start_coordinator()
    numel = wan.numel()
    cluster.start_peer("p")
    wan.wait_applied(2, 180, "two updates through the proxy")

    # --- upload: reset once half a pseudo-gradient has gone up (other upstream traffic is a few kB a round)
    upload = wire_bytes("int8", numel)
    wan.proxy.call(lambda p: p.arm_reset(Direction.UP, upload // 2))
    resets = _first(lambda: wan.proxy.snapshot()["resets"], cluster, 120, "the upload reset to fire")
    reset_at = resets[0]["time"]
    interrupted = _first(lambda: FAILED_SUBMIT.findall(wan.peer_log()), cluster, 60, "the peer to see its submit fail")[0]
    resent = _first(lambda: [e for e in wan.applied() if e["lease_id"] == interrupted], cluster, 120, f"{interrupted} applied")
    wan.record("reset_mid_upload", lease=interrupted, recovery_s=resent[0]["time"] - reset_at, reset_at_byte=upload // 2)

    # --- download: reset a quarter of an fp32 θ in (half of a bf16 one: mid-download whichever codec θ
    # travels in; a round's other downstream traffic is a few kB). The peer may lose a prefetch of θ
    # (logged at debug, then downloaded again) or its lease's download (it asks for a new lease).
    before = len(wan.applied())
    wan.proxy.call(lambda p: p.arm_reset(Direction.DOWN, wire_bytes("none", numel) // 4))
    resets = _first(lambda: (r := wan.proxy.snapshot()["resets"])[1:] and r, cluster, 120, "the download reset to fire")
    reset_at = resets[1]["time"]
    after = _first(lambda: wan.applied_after(reset_at), cluster, 120, "an update after the download reset")
    wan.wait_applied(before + 2, 120, "training to go on")
    wan.record("reset_mid_download", recovery_s=after[0]["time"] - reset_at, reset_at_byte=wire_bytes("none", numel) // 4,
               lease_download_failed="could not download" in wan.peer_log())  # fmt: skip

    assert cluster.peers["p"].poll() is None, "the peer recovered without a restart"
    wan.check_invariants()
    rejected = [e for e in cluster.events() if e["type"] == "rejected"]
    assert not rejected, f"no partial upload may reach the coordinator's checks: {rejected}"
    snapshot = wan.assert_through_proxy(numel)
    assert [r["direction"] for r in snapshot["resets"]] == ["up", "down"]


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_reveal_reset_mid_upload_is_sent_again(wan: Wan) -> None:
    """With verification on (the default) a checked lease's start and end states go up in a reveal, 8 bytes per
    parameter each; a reveal lost to a reset used to fail the honest peer's check at reveal_timeout and expel it.
    Upstream: the hello and lease requests (a few kB), lease 1's upload (a probation check from the fresh state:
    nothing to reveal), then uploads and the reveals of the checked leases' start states, 8 bytes per parameter each
    (no end state kept here, so none is chained) — the reset is armed past two uploads and two such states' worth,
    where a reveal is under way. The peer sends it again, the check passes bitwise, nobody is expelled."""
    from asyncloco.transport.codecs import wire_bytes

    wan.configure(verify=True)
    cluster = wan.cluster
    cluster.start_coordinator()
    numel = wan.numel()
    wan.proxy.call(lambda p: p.arm_reset(Direction.UP, 2 * wire_bytes("int8", numel) + 16 * numel))
    cluster.start_peer("p")
    resets = _first(lambda: wan.proxy.snapshot()["resets"], cluster, 240, "the reset to fire")
    lost = _first(lambda: FAILED_REVEAL.findall(wan.peer_log()), cluster, 60, "the peer to see its reveal fail")[0]
    verdict = _first(lambda: [e for e in cluster.events() if e["type"] == "verdict" and e["lease_id"] == lost], cluster,
                     120, f"{lost}'s verdict")
    assert verdict[0]["ok"] and verdict[0]["detail"] == "bitwise equal to the re-run", verdict
    assert not [e for e in cluster.events() if e["type"] == "expelled"]
    wan.record("reset_mid_reveal", lease=lost, recovery_s=verdict[0]["time"] - resets[0]["time"])
    wan.wait_applied(3, 120, "training to go on")
    assert cluster.peers["p"].poll() is None
    wan.check_invariants()


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_partition_longer_than_the_lease_deadline_then_heal(wan: Wan) -> None:
    cluster = wan.cluster
    cluster.start_coordinator()
    cluster.start_peer("p")
    wan.wait_applied(2, 180, "two updates through the proxy")
    # partition while the peer holds a lease; keep it until that lease's deadline is 3 s past
    lease = _first(
        lambda: [e for e in cluster.events() if e["type"] == "assign" and e["lease_id"] not in {a["lease_id"] for a in wan.applied()}],
        cluster, 60, "a lease in flight",
    )[-1]  # fmt: skip
    wan.proxy.call(lambda p: p.partition())
    started = time.time()
    _first(lambda: time.time() > lease["deadline"] + 3.0, cluster, 300, "the lease deadline to pass")
    _first(lambda: [e for e in cluster.events() if e["type"] == "expired" and e["lease_id"] == lease["lease_id"]],
           cluster, 60, "the coordinator to expire the partitioned lease")  # fmt: skip
    assert not [e for e in wan.applied() if e["time"] > started], "nothing crosses a partition"
    wan.proxy.call(lambda p: p.heal(reset=True))
    healed = time.time()
    after = _first(lambda: wan.applied_after(healed), cluster, 180, "an update after the heal")
    wan.record("partition", partition_s=healed - started, lease_deadline_after_s=lease["deadline"] - started,
               recovery_s=after[0]["time"] - healed)  # fmt: skip
    assert lease["lease_id"] not in {e["lease_id"] for e in wan.applied()}, "an expired lease is never applied"
    assert cluster.peers["p"].poll() is None
    wan.check_invariants()
    wan.assert_through_proxy(wan.numel())


@pytest.mark.integration
@pytest.mark.timeout(480)
def test_coordinator_restart_while_a_slow_link_uploads(wan: Wan) -> None:
    wan.configure(lease_slack=180.0)  # the restart must fit in the lease: 10-30 s on a busy machine, 69 s at load 20
    cluster = wan.cluster
    cluster.start_coordinator()
    cluster.start_peer("p")
    wan.wait_applied(2, 180, "two updates through the proxy")
    # 1 Mbit/s up: an int8 pseudo-gradient of the tiny model (~0.38 MB) takes ~3 s on the wire
    wan.proxy.call(lambda p: p.set_shape(Direction.UP, LinkShape(bandwidth_bps=1e6)))
    base = wan.proxy.snapshot()["bytes_up"]
    _first(lambda: wan.proxy.snapshot()["bytes_up"] - base > 60_000, cluster, 120, "an upload under way")
    applied_before = {e["lease_id"] for e in wan.applied()}
    restart = time.time()
    assert cluster.stop_coordinator(timeout=60.0) == 0
    cluster.start_coordinator(resume=True)
    back = time.time()
    after = _first(lambda: wan.applied_after(back), cluster, 240, "an update after the restart")
    interrupted = FAILED_SUBMIT.findall(wan.peer_log())
    assert interrupted, "the upload in flight failed and was resent"
    applied_ids = [e["lease_id"] for e in wan.applied()]
    assert interrupted[-1] in applied_ids and interrupted[-1] not in applied_before
    wan.record("coordinator_restart_during_slow_upload", downtime_s=back - restart, recovery_s=after[0]["time"] - restart,
               resent_lease=interrupted[-1])  # fmt: skip
    assert cluster.peers["p"].poll() is None
    wan.check_invariants()
    wan.assert_through_proxy(wan.numel())


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_latency_spikes(wan: Wan) -> None:
    """A latency spike (40 ms → 800 ms round trip, both directions) on a training peer's link: a whole round
    (lease, θ down, pseudo-gradient up, ack) completes inside the spike, training goes on after it, and at
    the end the peer's acknowledgements and the coordinator's applied records are the same updates, one for
    one (a lease that expired in the spike is refused, never applied)."""
    wan.configure(max_local_steps=4)  # short rounds: the spike is the point, not the training
    cluster = wan.cluster
    cluster.start_coordinator()
    normal, spike = LinkShape(latency_s=0.02), LinkShape(latency_s=0.4)
    for direction in Direction:
        wan.proxy.call(lambda p, d=direction: p.set_shape(d, normal))
    cluster.start_peer("p")
    wan.wait_applied(1, 180, "an update through the proxy")
    start = time.time()
    for direction in Direction:
        wan.proxy.call(lambda p, d=direction: p.set_shape(d, spike))

    def round_in_spike() -> list[dict[str, Any]]:
        assigned = {e["lease_id"] for e in cluster.events() if e["type"] == "assign" and e["time"] > start}
        return [e for e in wan.applied_after(start) if e["lease_id"] in assigned]

    during = _first(round_in_spike, cluster, 180, "a whole round inside the spike")
    for direction in Direction:
        wan.proxy.call(lambda p, d=direction: p.set_shape(d, normal))
    end = time.time()
    after = _first(lambda: wan.applied_after(end), cluster, 180, "an update after the spike")
    # the peer leaves in order (SIGTERM: it submits the lease in hand first); then its acknowledgements are final
    assert cluster.stop(cluster.peers["p"], timeout=120.0) == 0
    applied, summary = wan.applied(), cluster.peer_summary("p")
    acks = [(m[1], int(m[2]), bool(m[3])) for m in ACK.finditer(wan.peer_log())]
    # the same updates, in order, one for one (an ack lost in the spike and resent comes back "duplicate")
    assert [lease for lease, _, _ in acks] == [e["lease_id"] for e in applied]
    assert all(version == e["version"] for (_, version, duplicate), e in zip(acks, applied) if not duplicate)
    assert summary["accepted"] == len(applied) and summary["duplicates"] == sum(d for _, _, d in acks)
    expired = [e["lease_id"] for e in cluster.events() if e["type"] == "expired"]
    for event in cluster.events():  # a lease's deadline counts compute only (2 x expected + 5 s): a spike can outlast it
        if event["type"] == "rejected":
            assert event["lease_id"] in expired and "expired" in event["reason"], event
    assert not set(expired) & {e["lease_id"] for e in applied}
    wan.check_invariants()
    wan.assert_through_proxy(wan.numel())
    wan.record("latency_spikes", one_way_s=spike.latency_s, spike_s=end - start, round_in_spike_s=during[0]["time"] - start,
               recovery_s=after[0]["time"] - end, applied=len(applied), expired_leases=len(expired))  # fmt: skip
