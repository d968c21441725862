"""Swarm downloads (asyncloco/transport/swarm.py): signed manifests, verified chunks, a hostile holder.

The P2P test runs four real p2pd daemons (seed + three peers) in one process: an honest holder, a holder that
serves corrupted chunks and a downloader. Exact: the seed sends the body once in all, the downloader rejects
exactly the corrupted chunks it received (none stored), reports the hostile holder once, and ends with the
coordinator's bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, Awaitable, Callable, List, Optional, Tuple

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from asyncloco.transport.codecs import EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.errors import MessageError, ProtocolError
from asyncloco.transport.swarm import (
    MAX_CHUNKS,
    BodyStore,
    ChunkRequest,
    ChunkServer,
    Manifest,
    SignedManifest,
    SwarmDownloader,
    SwarmSeed,
    chunk_size_for,
    public_key_bytes,
)

NUMEL = 50_000
CHUNK = 4096


def make_body(version: int) -> bytes:
    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(version))
    return encode("int8", theta).to_bytes()


def test_manifest_signature_and_chunks() -> None:
    body = make_body(1)
    key = Ed25519PrivateKey.generate()
    manifest = Manifest.build("run", 1, "int8", NUMEL, body, CHUNK)
    assert manifest.body_bytes == len(body) == wire_bytes("int8", NUMEL) == 50_052
    assert manifest.chunks == 13 and manifest.span(12) == (12 * CHUNK, 50_052)
    assert manifest.digest == hashlib.sha256(body).digest()
    for i in range(manifest.chunks):
        start, end = manifest.span(i)
        assert manifest.chunk_ok(i, body[start:end])
        assert not manifest.chunk_ok(i, bytes([body[start] ^ 1]) + body[start + 1 : end])
    assert not manifest.chunk_ok(0, body[: CHUNK - 1])
    signed = SignedManifest.sign(manifest, key)
    assert signed.verify(key.public_key()) == manifest
    with pytest.raises(ProtocolError, match="signature"):
        signed.verify(Ed25519PrivateKey.generate().public_key())
    tampered = bytearray(signed.manifest)
    tampered[-1] ^= 1
    with pytest.raises(ProtocolError, match="signature"):
        SignedManifest(bytes(tampered), signed.signature).verify(key.public_key())
    # sizes: a body never needs more than MAX_CHUNKS chunks; the manifest checks its own fields
    assert chunk_size_for(2 * 10**9, 1 << 20) == -(-2 * 10**9 // MAX_CHUNKS) == 1_953_125
    assert chunk_size_for(10**9, 1 << 20) == 1 << 20
    with pytest.raises(MessageError, match="body_bytes"):
        Manifest("run", 1, "int8", NUMEL + 1, manifest.body_bytes, CHUNK, manifest.digests, manifest.digest)
    assert ChunkRequest(1, "int8", ChunkRequest.bitmap([0, 9, 12], 13)).wanted(13) == [0, 9, 12]


def test_seed_serves_each_chunk_once_while_others_hold_it() -> None:
    async def main() -> None:
        body = make_body(3)
        key = Ed25519PrivateKey.generate()

        async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
            return 3, body

        seed = SwarmSeed(BodyStore(NUMEL), "run", key, body_for, chunk_bytes=CHUNK, refill_s=10.0)
        signed, entry = await seed.publish(None, "int8")
        assert signed.verify(key.public_key()).version == 3 and entry.complete
        everything = list(range(13))
        # alone: the seed serves whatever is asked, fewest copies first
        served = [seed.choose("a", entry, everything) for _ in range(13)]
        assert sorted(i for _, i in served if i is not None) == everything
        # with another serving peer listed, a chunk already sent is "busy" until refill_s has passed
        from asyncloco.transport.swarm import Holder

        seed._swarms[(3, "int8")].members["a"] = Holder("a", ("/ip4/127.0.0.1/tcp/1",))
        assert seed.choose("b", entry, everything) == ("busy", None)
        assert seed.choose("a", entry, [4]) == ("ok", 4)  # a's only other holder is itself
        seed._swarms[(3, "int8")].served_at[5] -= 10.0  # as if 10 s had passed for chunk 5
        assert seed.choose("b", entry, everything) == ("ok", 5)
        assert seed.choose("b", entry, [5]) == ("busy", None)  # its second refill waits 2 × refill_s

    asyncio.run(main())


class CorruptServer(ChunkServer):
    """Serves the right chunk index with one bit flipped."""

    def payload(self, entry: Any, index: int) -> Any:
        data = bytearray(super().payload(entry, index))
        data[len(data) // 2] ^= 0x10
        return bytes(data)


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.mark.timeout(240)
def test_corrupt_holder_is_detected_skipped_reported_and_download_completes() -> None:
    from hivemind.p2p import P2P

    async def main() -> None:
        body = make_body(7)
        key = Ed25519PrivateKey.generate()
        reports: List[Tuple[str, str, int, str]] = []

        async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
            return 7, body

        nodes: List[Any] = []
        try:
            seed_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0)
            nodes.append(seed_p2p)
            seed = SwarmSeed(BodyStore(NUMEL), "run", key, body_for, chunk_bytes=CHUNK, refill_s=600.0,
                             on_report=lambda *r: reports.append(r))
            await seed.add_handlers(seed_p2p, "run")
            seed_maddrs = await seed_p2p.get_visible_maddrs()
            seed_id = seed_p2p.peer_id.to_base58()

            async def peer(server_type: type) -> Tuple[Any, SwarmDownloader, ChunkServer]:
                p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=seed_maddrs, startup_timeout=120.0)
                nodes.append(p2p)
                store = BodyStore(NUMEL)
                server = server_type(store)
                await server.add_handlers(p2p, "run")
                maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
                return p2p, SwarmDownloader(p2p, seed_id, store, namespace="run", maddrs=maddrs,
                                            chunk_timeout_base=20.0, timeout=60.0), server  # a stall names itself

            honest_p2p, honest, _ = await peer(ChunkServer)
            hostile_p2p, hostile, hostile_server = await peer(CorruptServer)
            fresh_p2p, fresh, _ = await peer(ChunkServer)
            fresh_id = fresh_p2p.peer_id.to_base58()
            hostile_id = hostile_p2p.peer_id.to_base58()

            first = await honest.download(None, "int8")  # alone: everything from the seed
            assert (first.chunks_from_seed, first.chunks_from_peers) == (13, 0)
            second = await hostile.download(7, "int8")  # the honest holder has it all: nothing from the seed
            assert (second.chunks_from_seed, second.chunks_from_peers) == (13 - second.chunks_from_peers, 13)
            assert bytes(first.body) == bytes(second.body) == body

            result = await fresh.download(7, "int8")  # holders: honest + hostile (serving corrupted chunks)
            served_bad = hostile_server.counters.per_peer.get(fresh_id, 0)
            assert served_bad >= 1  # the downloader's first requests go to both holders
            assert result.rejected == {hostile_id: served_bad}
            assert set(result.skipped) == {hostile_id} and "SHA-256" in result.skipped[hostile_id]
            assert (result.chunks_from_seed, result.chunks_from_peers) == (0, 13)
            assert bytes(result.body) == body and result.manifest.digest == hashlib.sha256(body).digest()
            theta = decode(EncodedTensor.from_bytes("int8", NUMEL, result.body), NUMEL)
            assert torch.equal(theta, decode(EncodedTensor.from_bytes("int8", NUMEL, body), NUMEL))
            entry = fresh.store.get((7, "int8"))
            assert entry is not None and bytes(entry.data) == body  # nothing corrupted was ever stored
            # the seed sent the body exactly once in all, and heard exactly one report, about the hostile holder
            assert seed.counters.bytes_sent == len(body) and seed.counters.chunks_sent == 13
            await fresh.close()
            await wait_for(lambda: len(reports) >= 1, 30.0, "the report")
            assert [(r[0], r[1], r[2]) for r in reports] == [(fresh_id, hostile_id, 7)] and "SHA-256" in reports[0][3]
            assert fresh.reports_sent == 1
            # `asyncloco status` shows who serves what (coordinator/status.py swarm_lines over SwarmSeed.status)
            from asyncloco.coordinator.status import swarm_lines

            honest_id = honest_p2p.peer_id.to_base58()
            status = seed.status()
            assert status["bodies"] == [{"version": 7, "codec": "int8", "holders": [honest_id, hostile_id, fresh_id],
                                         "dropped": [], "seed_copies": 13, "chunks": 13}]
            assert swarm_lines(status) == [
                f"swarm v7 int8: 3 serving peer(s) {honest_id[-10:]} {hostile_id[-10:]} {fresh_id[-10:]}; "
                "the coordinator sent 1.00 × the body",
                f"swarm report: {fresh_id[-10:]} says {hostile_id[-10:]} (v7): {reports[0][3]}",
            ]
        finally:
            for node in reversed(nodes):
                await node.shutdown()

    asyncio.run(main())


class StallingServer(ChunkServer):
    """Accepts chunk calls and never answers (until released at teardown)."""

    release: Optional[asyncio.Event] = None

    async def _serve_chunk(self, peer_id: str, frames_in: Any, frames_out: Any) -> None:
        await frames_in.read_header()
        assert self.release is not None
        await self.release.wait()


def test_publishing_the_newest_asks_for_the_newest_not_a_version_read_before() -> None:
    """``publish(None)`` reads ``current()``, then builds the body: if the coordinator replaced that version in
    between, it refuses it ("no longer served"); the seed asks ``body_for(None)`` and signs what it gets."""

    async def main() -> None:
        asked: List[Optional[int]] = []

        async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
            asked.append(version)
            if version is not None and version < 8:
                raise RuntimeError(f"version {version} is no longer served (current 8)")
            return 8, make_body(8)

        seed = SwarmSeed(BodyStore(NUMEL), "run", Ed25519PrivateKey.generate(), body_for, chunk_bytes=CHUNK,
                         current=lambda: 7)  # read just before version 8 was applied
        signed, entry = await seed.publish(None, "int8")
        assert asked == [None] and entry.manifest.version == 8 and bytes(entry.data) == make_body(8)
        again, same = await seed.publish(8, "int8")  # now stored: not built again
        assert asked == [None] and again == signed and same is entry

    asyncio.run(main())


class ReplacingSeed(SwarmSeed):
    """A seed that publishes ``replace_with`` (evicting the body being fetched: it keeps one version) when the
    first chunk of ``trigger_on`` is asked for: a run whose versions move faster than a download."""

    trigger_on: Optional[int] = None
    replace_with: int = 0
    newest: int = 1  # what body_for(None) and ``current`` answer

    async def _serve_chunk(self, peer_id: str, frames_in: Any, frames_out: Any) -> None:
        if self.trigger_on is not None and self.store.get((self.trigger_on, "int8")) is not None:
            self.trigger_on = None
            self.newest = self.replace_with
            await self.publish(self.replace_with, "int8")
        await super()._serve_chunk(peer_id, frames_in, frames_out)


@pytest.mark.timeout(240)
def test_a_version_the_seed_dropped_mid_download_ends_the_download_at_once() -> None:
    """The seed answers ``gone`` for a version it no longer holds: ``download(None)`` starts again on the newest
    manifest and ends with that version's exact body; ``download(v)`` raises VersionGone — both at once, not
    after the download's timeout (before the ``gone`` answer a fetch retried the seed until then)."""
    from hivemind.p2p import P2P

    from asyncloco.transport.errors import VersionGone

    async def main() -> None:
        async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
            version = seed.newest if version is None else version
            return version, make_body(version)

        nodes: List[Any] = []
        try:
            seed_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0)
            nodes.append(seed_p2p)
            seed = ReplacingSeed(BodyStore(NUMEL, keep_versions=1), "run", Ed25519PrivateKey.generate(), body_for,
                                 chunk_bytes=CHUNK, current=lambda: seed.newest)
            await seed.add_handlers(seed_p2p, "run")
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await seed_p2p.get_visible_maddrs(),
                                   startup_timeout=120.0)
            nodes.append(p2p)
            downloader = SwarmDownloader(p2p, seed_p2p.peer_id.to_base58(), BodyStore(NUMEL), namespace="run", timeout=60.0)

            seed.trigger_on, seed.replace_with = 1, 2
            started = time.monotonic()
            result = await downloader.download(None, "int8")
            assert result.manifest.version == 2 and bytes(result.body) == make_body(2)
            assert result.chunks_from_seed == 13 and seed.counters.gone >= 1
            assert time.monotonic() - started < 30.0

            seed.trigger_on, seed.replace_with = 5, 6
            started = time.monotonic()
            with pytest.raises(VersionGone, match="no longer holds v5"):
                await downloader.download(5, "int8")
            assert time.monotonic() - started < 30.0
            assert seed.store.get((5, "int8")) is None and seed.store.get((6, "int8")) is not None
        finally:
            for node in reversed(nodes):
                await node.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_slow_holder_is_skipped_and_the_seed_serves_the_rest() -> None:
    from hivemind.p2p import P2P

    async def main() -> None:
        body = make_body(9)
        key = Ed25519PrivateKey.generate()
        reports: List[Tuple[str, str, int, str]] = []

        async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
            return 9, body

        nodes: List[Any] = []
        release = asyncio.Event()
        try:
            seed_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0)
            nodes.append(seed_p2p)
            seed = SwarmSeed(BodyStore(NUMEL), "run", key, body_for, chunk_bytes=CHUNK, refill_s=600.0,
                             on_report=lambda *r: reports.append(r))
            await seed.add_handlers(seed_p2p, "run")
            seed_maddrs = await seed_p2p.get_visible_maddrs()
            seed_id = seed_p2p.peer_id.to_base58()
            downloaders = []
            for server in (StallingServer, ChunkServer):
                p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=seed_maddrs, startup_timeout=120.0)
                nodes.append(p2p)
                store = BodyStore(NUMEL)
                chunk_server = server(store)
                if isinstance(chunk_server, StallingServer):
                    chunk_server.release = release
                await chunk_server.add_handlers(p2p, "run")
                maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
                downloaders.append(SwarmDownloader(p2p, seed_id, store, namespace="run", maddrs=maddrs,
                                                   chunk_timeout_base=1.0, min_rate=1e12))
            staller, fresh = downloaders
            staller_id = staller.p2p.peer_id.to_base58()
            manifest, holders = await staller.manifest(9, "int8")  # listed as a holder; holds nothing, answers nothing
            assert holders == [] and manifest.chunks == 13
            started = time.monotonic()
            result = await fresh.download(9, "int8")
            assert set(result.skipped) == {staller_id} and "Timeout" in result.skipped[staller_id]
            assert (result.chunks_from_seed, result.chunks_from_peers, result.rejected) == (13, 0, {})
            assert bytes(result.body) == body
            assert time.monotonic() - started < 30.0  # two 1 s timeouts, not the 600 s download limit
            await fresh.close()
            await wait_for(lambda: len(reports) >= 1, 30.0, "the report")
            assert [(r[1], r[2]) for r in reports] == [(staller_id, 9)]
            assert seed.counters.chunks_sent == 13
        finally:
            release.set()
            for node in reversed(nodes):
                await node.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(240)
def test_swarm_link_gets_theta_from_the_swarm_and_the_coordinator_sends_no_body() -> None:
    """Two peers with a SwarmLink beside the real CoordinatorService: the first gets v5 from the seed, the
    second from the first; both hold decode(encode(θ)) bit for bit, and the coordinator's get_model sends
    only "unchanged" headers (its handler still sees every fetch)."""
    from hivemind.p2p import P2P

    from asyncloco.transport.rpc import CoordinatorClient, CoordinatorService
    from asyncloco.transport.swarm import SwarmLink

    theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    body = encode("int8", theta).to_bytes()
    fetched: List[Tuple[str, Optional[int]]] = []

    class Handler:
        async def assign(self, request: Any, peer_id: str) -> Any:
            raise RuntimeError("unused")

        async def get_model(self, version: Optional[int], peer_id: str) -> Tuple[int, torch.Tensor]:
            fetched.append((peer_id, version))
            return 5, theta

        async def submit(self, header: Any, pseudo_gradient: Any, peer_id: str, upload_seconds: float = 0.0) -> Any:
            raise RuntimeError("unused")

    async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
        return 5, encode(codec, theta).to_bytes()

    async def main() -> None:
        nodes: List[Any] = []
        links: List[SwarmLink] = []
        late: Optional[SwarmLink] = None
        try:
            seed_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], startup_timeout=120.0)
            nodes.append(seed_p2p)
            service = CoordinatorService(Handler(), NUMEL, model_codecs=("int8",))
            await service.add_p2p_handlers(seed_p2p, namespace="run")
            maddrs = await seed_p2p.get_visible_maddrs()
            for _ in range(3):
                p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs, startup_timeout=120.0)
                nodes.append(p2p)
                client = CoordinatorClient(p2p, seed_p2p.peer_id, NUMEL, namespace="run", download_codec="int8")
                link = SwarmLink(client, p2p, "run")
                await link.start()
                links.append(link)
            expected = decode(EncodedTensor.from_bytes("int8", NUMEL, body), NUMEL)
            # a coordinator without a seed: the link falls back to a full download
            late = links.pop()
            version, got = await late.get_model(5)
            assert (version, late.swarm_downloads, late.fallbacks) == (5, 0, 1) and torch.equal(got, expected)
            assert service.counters.get_model.payload_bytes_sent == len(body)
            fetched.clear()
            seed = SwarmSeed(BodyStore(NUMEL), "run", Ed25519PrivateKey.generate(), body_for, chunk_bytes=CHUNK, refill_s=600.0)
            await seed.add_handlers(seed_p2p, "run")
            for link in links:
                version, got = await link.get_model(5)
                assert version == 5 and torch.equal(got, expected)
                assert link.swarm_downloads == 1 and link.fallbacks == 0
                assert link.client.anchor is not None and bytes(link.client.anchor[2]) == body
            assert service.counters.get_model.payload_bytes_sent == len(body) and service.counters.get_model.calls == 3
            assert [peer for peer, _ in fetched] == [link.p2p.peer_id.to_base58() for link in links]
            # the seed sent the body once; the second peer took all 13 chunks from the first
            assert seed.counters.chunks_sent == 13 and links[0].server is not None
            assert links[0].server.counters.chunks_sent == 13
            version, again = await links[1].get_model(5)  # held: no swarm call, an "unchanged" reply
            assert links[1].swarm_downloads == 1 and torch.equal(again, expected)
        finally:
            for link in links + ([late] if late is not None else []):
                await link.close()
            for node in reversed(nodes):
                await node.shutdown()

    asyncio.run(main())


def test_serve_bandwidth_token_bucket_waits_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--serve-bandwidth`` (ServeLimits.bandwidth → swarm_serve._TokenBucket): a one-second burst, then exactly
    ``bytes / rate`` seconds of waiting; no cap never waits; a non-positive cap is refused. The module's clock and
    sleep are replaced by a fake clock that the recorded sleeps advance."""
    import types

    from asyncloco.transport import swarm_serve as swarm  # the serving side's module: its clock is replaced
    from asyncloco.transport.swarm import ServeLimits, _TokenBucket

    clock = {"now": 100.0}
    sleeps: List[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(swarm, "time", types.SimpleNamespace(monotonic=lambda: clock["now"]))
    monkeypatch.setattr(swarm, "asyncio", types.SimpleNamespace(sleep=fake_sleep, Lock=asyncio.Lock))

    async def run() -> None:
        bucket = _TokenBucket(1000.0)  # 1000 B/s, 1000 B of burst
        await bucket.take(1000)  # the burst: no wait
        assert sleeps == []
        await bucket.take(500)  # 500 B beyond the burst: 0.5 s
        assert sleeps == [0.5]
        await bucket.take(3000)  # a chunk larger than the burst: 3 s more
        assert sleeps == [0.5, 3.0]
        clock["now"] += 10.0  # idle for 10 s: the bucket refills to max(one second's worth, this request) only
        await bucket.take(1500)
        assert sleeps == [0.5, 3.0]
        await bucket.take(1000)  # nothing left: a full second
        assert sleeps == [0.5, 3.0, 1.0]
        free = _TokenBucket(None)
        await free.take(10**9)
        assert sleeps == [0.5, 3.0, 1.0]

    asyncio.run(run())
    for bad in (0.0, -5.0):
        with pytest.raises(ValueError, match="serve bandwidth must be positive"):
            ServeLimits(bandwidth=bad)
