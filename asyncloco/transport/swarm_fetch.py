"""The θ swarm's downloading side: the verifying downloader (every chunk checked against the signed manifest,
bad or slow holders skipped and reported) and SwarmLink, a peer's serving + downloading in one.
The protocol: transport/swarm.py and docs/transport.md."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Set, Tuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from asyncloco.transport.errors import ProtocolError, RpcTimeout, VersionGone
from asyncloco.transport.framing import FrameReader, FrameWriter
from asyncloco.transport.swarm_serve import BodyStore, ChunkServer, ServeLimits, SwarmSeed, _Body
from asyncloco.transport.swarm_wire import (
    ChunkReply,
    ChunkRequest,
    DEFAULT_CHUNK_BYTES,
    EMPTY_RETRY_S,
    Holder,
    MAX_MADDRS,
    Manifest,
    ManifestReply,
    ManifestRequest,
    PER_SOURCE,
    Report,
    SignedManifest,
    swarm_handle,
)
from asyncloco.transport.wire import MAX_REASON_CHARS

logger = logging.getLogger(__name__)
GONE_RETRIES = 3  # download(None): fresh starts on the newest manifest when the seed drops the one being fetched


# ------------------------------------------------------------------------------------------- downloader


@dataclass
class DownloadResult:
    """A completed, verified download: ``body`` matches ``manifest`` chunk by chunk and as a whole."""

    manifest: Manifest
    body: bytearray
    chunks_from_seed: int
    chunks_from_peers: int
    rejected: Dict[str, int]  # source -> chunks that failed their digest (never stored)
    skipped: Dict[str, str]  # source -> why it was skipped (bad chunk, timeouts)
    seconds: float


@dataclass
class _Source:
    holder: Holder
    seed: bool = False
    bad: str = ""
    strikes: int = 0
    empty_until: float = 0.0
    in_flight: int = 0
    connected: bool = False


class SwarmDownloader:
    """Downloads bodies from the swarm into ``store`` (which the peer's :class:`ChunkServer` serves from).

    :param p2p: this peer's ``hivemind.P2P``; :param seed_id: the coordinator's peer id (authenticated by libp2p).
    :param serve: list this peer as a holder (it runs a :class:`ChunkServer` on ``store``, is reachable at
        ``maddrs``). A peer behind NAT (DHT client mode) downloads with ``serve=False``.
    :param public_key: the coordinator's Ed25519 public key (raw 32 bytes) if known; else the first
        manifest's key, received from the authenticated seed, is pinned.
    :param parallel: chunk requests in flight; :param chunk_timeout_base, min_rate: a chunk must arrive
        within ``base + bytes / min_rate``, else the source gets a strike (two: skipped).
    """

    def __init__(
        self,
        p2p: Any,
        seed_id: str,
        store: BodyStore,
        *,
        namespace: Optional[str] = None,
        serve: bool = True,
        maddrs: Sequence[str] = (),
        public_key: Optional[bytes] = None,
        parallel: int = 4,
        chunk_timeout_base: float = 10.0,
        min_rate: float = 256 << 10,
        timeout: float = 600.0,
    ) -> None:
        self.p2p, self.seed_id, self.store, self.namespace = p2p, seed_id, store, namespace
        self.serve, self.maddrs = serve, [str(m) for m in maddrs][:MAX_MADDRS]
        self.public_key = public_key
        self.parallel, self.chunk_timeout_base, self.min_rate, self.timeout = parallel, chunk_timeout_base, min_rate, timeout
        self.reports_sent = 0
        self._tasks: Set["asyncio.Task[None]"] = set()

    def _background(self, call: Awaitable[None]) -> None:
        task = asyncio.ensure_future(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait (≤ 10 s) for reports still being sent."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=10.0)

    async def _open(self, peer_id: str, rpc: str) -> Tuple[FrameReader, FrameWriter, asyncio.StreamWriter]:
        from hivemind.p2p import PeerID

        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), swarm_handle(self.namespace, rpc))
        return FrameReader(reader, idle_timeout=30.0), FrameWriter(writer, idle_timeout=30.0), writer

    async def manifest(self, version: Optional[int], codec: str) -> Tuple[Manifest, List[Holder]]:
        """The seed's verified manifest of (``version``, ``codec``) and its holders; registers this peer."""
        frames_in, frames_out, writer = await self._open(self.seed_id, "manifest")
        try:
            request = ManifestRequest(codec, version, self.serve and bool(self.maddrs), self.maddrs or None)
            await frames_out.header(request.to_wire())
            reply = ManifestReply.from_wire(await frames_in.read_header(allow_error=True))
        finally:
            writer.close()
        if self.public_key is None:
            self.public_key = reply.public_key  # pinned: from the authenticated coordinator stream
        elif reply.public_key != self.public_key:
            raise ProtocolError("swarm manifest signed by a key other than the pinned coordinator key")
        manifest = SignedManifest(reply.manifest, reply.signature).verify(Ed25519PublicKey.from_public_bytes(self.public_key))
        if manifest.codec != codec or (version is not None and manifest.version != version) or manifest.numel != self.store.numel:
            raise ProtocolError(f"swarm manifest v{manifest.version} {manifest.codec} numel {manifest.numel} is not what was asked")
        return manifest, [Holder.from_wire(h) for h in reply.holders]

    async def report(self, manifest: Manifest, source: str, reason: str) -> None:
        with contextlib.suppress(Exception):
            frames_in, frames_out, writer = await self._open(self.seed_id, "report")
            try:
                await frames_out.header(Report(manifest.version, manifest.codec, source, reason[:MAX_REASON_CHARS]).to_wire())
                await asyncio.wait_for(frames_in.read_header(allow_error=True), timeout=10.0)
                self.reports_sent += 1
            finally:
                writer.close()

    async def download(self, version: Optional[int], codec: str) -> DownloadResult:
        """The verified body of (``version``, ``codec``); raises :class:`RpcTimeout` after ``timeout``, and
        :class:`VersionGone` as soon as the seed says it dropped ``version`` (with ``version=None``, the newest,
        the download starts again on the seed's newest manifest, up to :data:`GONE_RETRIES` times)."""
        started = time.monotonic()
        for attempt in range(GONE_RETRIES + 1):
            manifest, holders = await self.manifest(version, codec)
            entry = self.store.open(manifest)
            entry.downloading += 1
            try:
                left = self.timeout - (time.monotonic() - started)
                return await asyncio.wait_for(self._fetch(manifest, entry, holders, started), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                raise RpcTimeout(f"swarm download of v{manifest.version} took over {self.timeout:.0f} s") from None
            except VersionGone:
                if version is not None or attempt == GONE_RETRIES:
                    raise
                logger.info("swarm: v%d was replaced at the seed during its download; fetching the newest", manifest.version)
            finally:
                entry.downloading -= 1
        raise AssertionError("unreachable")

    async def _fetch(self, manifest: Manifest, entry: _Body, holders: List[Holder], started: float) -> DownloadResult:
        me = str(self.p2p.peer_id.to_base58())
        sources: Dict[str, _Source] = {self.seed_id: _Source(Holder(self.seed_id), seed=True, connected=True)}
        for holder in holders:
            if holder.peer_id not in (me, self.seed_id):
                sources.setdefault(holder.peer_id, _Source(holder))
        in_flight: Set[int] = set()
        counts = {"seed": 0, "peers": 0}
        rejected: Dict[str, int] = {}
        skipped: Dict[str, str] = {}
        changed = asyncio.Event()
        seed_retry = {"at": 0.0, "backoff": 0.05}

        def missing() -> List[int]:
            return [i for i in range(manifest.chunks) if not entry.have[i] and i not in in_flight]

        def pick(now: float) -> Optional[_Source]:
            """A holder that may have a wanted chunk; the seed only when every holder is bad or said "none"
            recently (a holder busy with our other requests is waited for, not bypassed)."""
            live = [s for s in sources.values() if not s.seed and not s.bad and s.empty_until <= now]
            usable = [s for s in live if s.in_flight < PER_SOURCE]
            if usable:
                return random.choice(usable)
            seed = sources[self.seed_id]
            if live or seed_retry["at"] > now or seed.in_flight >= self.parallel:
                return None
            return seed

        async def worker() -> None:
            while not entry.complete:
                want = missing()
                now = time.monotonic()
                source = pick(now) if want else None
                if source is None:
                    wake = now + 1.0  # or when a request ends (changed)
                    if want:
                        waits = [s.empty_until for s in sources.values() if not s.seed and not s.bad and s.empty_until > now]
                        wake = min([wake, max(seed_retry["at"], now + 0.005), *waits])
                    changed.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(changed.wait(), timeout=max(0.005, wake - now))
                    continue
                source.in_flight += 1
                try:
                    await self._one(manifest, entry, source, want, in_flight, counts, rejected, skipped, sources, seed_retry)
                finally:
                    source.in_flight -= 1
                    changed.set()

        await asyncio.gather(*(worker() for _ in range(self.parallel)))
        if hashlib.sha256(entry.data).digest() != manifest.digest:  # cannot happen after per-chunk checks; kept as the last gate
            raise ProtocolError(f"swarm body of v{manifest.version} does not match the manifest's digest")
        return DownloadResult(manifest, entry.data, counts["seed"], counts["peers"], rejected, skipped, time.monotonic() - started)

    async def _one(self, manifest: Manifest, entry: _Body, source: _Source, want: List[int], in_flight: Set[int],
                   counts: Dict[str, int], rejected: Dict[str, int], skipped: Dict[str, str], sources: Dict[str, _Source],
                   seed_retry: Dict[str, float]) -> None:
        peer = source.holder.peer_id
        deadline = self.chunk_timeout_base + manifest.chunk_bytes / self.min_rate
        reserved: Optional[int] = None
        try:
            if not source.connected and source.holder.maddrs:
                await asyncio.wait_for(self._connect(source.holder), timeout=deadline)
                source.connected = True
            frames_in, frames_out, writer = await asyncio.wait_for(self._open(peer, "chunk"), timeout=deadline)
            try:
                fallback = source.seed and len(sources) > 1 and all(s.bad for s in sources.values() if not s.seed)
                bitmap = ChunkRequest.bitmap(want, manifest.chunks)
                await frames_out.header(ChunkRequest(manifest.version, manifest.codec, bitmap, fallback).to_wire())
                reply = ChunkReply.from_wire(await asyncio.wait_for(frames_in.read_header(allow_error=True), timeout=deadline))
                for item in reply.holders or []:
                    holder = Holder.from_wire(item)
                    if holder.peer_id not in sources and holder.peer_id != str(self.p2p.peer_id.to_base58()):
                        sources[holder.peer_id] = _Source(holder)
                if reply.status == "gone" and source.seed:
                    raise VersionGone(f"the seed no longer holds v{manifest.version} ({manifest.codec}): newer versions replaced it")
                if reply.status != "ok" or reply.index is None:
                    if source.seed:
                        seed_retry["at"] = time.monotonic() + seed_retry["backoff"]
                        seed_retry["backoff"] = min(0.5, seed_retry["backoff"] * 2)
                    else:
                        source.empty_until = time.monotonic() + EMPTY_RETRY_S
                    return
                index = reply.index
                if index >= manifest.chunks or index not in want:
                    raise ProtocolError(f"sent chunk {index}, which was not asked for")
                in_flight.add(index)
                reserved = index
                start, end = manifest.span(index)
                data = await asyncio.wait_for(frames_in.read_body(end - start), timeout=deadline)
            finally:
                writer.close()
            if not manifest.chunk_ok(index, data):  # every chunk received is checked, even one no longer needed
                rejected[peer] = rejected.get(peer, 0) + 1
                if source.seed:
                    raise ProtocolError(f"the coordinator sent chunk {index} that fails its own manifest")
                if not source.bad:
                    source.bad = skipped[peer] = f"chunk {index} failed its SHA-256"
                    logger.warning("swarm: %s sent chunk %d of v%d that fails its digest; skipping it", peer, index, manifest.version)
                    self._background(self.report(manifest, peer, source.bad))
                return
            if entry.have[index]:
                return  # another worker stored it meanwhile
            self.store.put_chunk(entry, index, data)
            counts["seed" if source.seed else "peers"] += 1
            if source.seed:
                seed_retry["backoff"] = 0.05
            source.strikes = 0
        except Exception as error:  # TransportError, timeouts, a broken stream: the source's fault or the network's
            if source.seed:
                if isinstance(error, (ProtocolError, VersionGone)):
                    raise
                seed_retry["at"] = time.monotonic() + seed_retry["backoff"]
                seed_retry["backoff"] = min(2.0, seed_retry["backoff"] * 2)
                logger.debug("swarm: seed call failed: %r", error)
                return
            source.strikes += 1
            source.empty_until = time.monotonic() + 1.0
            if (source.strikes >= 2 or isinstance(error, ProtocolError)) and not source.bad:
                source.bad = skipped[peer] = f"{type(error).__name__}: {error}"[:300]
                logger.info("swarm: skipping %s (%s)", peer, source.bad)
                self._background(self.report(manifest, peer, source.bad))
        finally:
            if reserved is not None:
                in_flight.discard(reserved)

    async def _connect(self, holder: Holder) -> None:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        # p2pd's connect wants transport addresses: drop a trailing /p2p/<id> (get_visible_maddrs adds it)
        maddrs = [Multiaddr(m.split("/p2p/")[0]) for m in holder.maddrs]
        await self.p2p._client.connect(PeerID.from_base58(holder.peer_id), maddrs)


async def start_seed(
    p2p: Any,
    run_id: str,
    numel: int,
    key: Ed25519PrivateKey,
    get_model: Callable[[Optional[int]], Awaitable[Tuple[int, Any]]],
    *,
    current: Optional[Callable[[], int]] = None,
    admit: Optional[Callable[[str], Awaitable[None]]] = None,
    on_report: Optional[Callable[[str, str, int, str], None]] = None,
    keep_versions: int = 2,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> SwarmSeed:
    """The coordinator's seed on ``p2p``, serving the bodies of ``get_model(version) -> (version, θ)`` (a θ
    snapshot, never mutated) encoded exactly as ``CoordinatorService`` encodes a full download
    (``encode(codec, θ).to_bytes()``; fp32: θ's bytes). Remove with ``seed.remove_handlers(p2p, run_id)``."""
    from asyncloco.transport.codecs import encode

    async def body_for(version: Optional[int], codec: str) -> Tuple[int, Any]:
        version, theta = await get_model(version)
        if codec == "none":
            return version, theta.detach().contiguous().numpy().view("u1").data
        return version, (await asyncio.to_thread(encode, codec, theta)).to_bytes()

    seed = SwarmSeed(BodyStore(numel, keep_versions), run_id, key, body_for, chunk_bytes=chunk_bytes,
                     on_report=on_report, admit=admit, current=current)
    await seed.add_handlers(p2p, run_id)
    return seed


# ------------------------------------------------------------------------------------------- peer side


class SwarmLink:
    """A peer's :class:`~asyncloco.transport.link.CoordinatorLink` whose ``get_model`` fetches the body from
    the swarm first: it wraps a :class:`~asyncloco.transport.rpc.CoordinatorClient` (every other call goes
    to it unchanged).

    ``get_model(version)``: the swarm's verified full body of that version in the client's download codec,
    decoded, becomes the client's held θ (and, for a lossy codec, its anchor); then the client's own
    ``get_model`` asks the coordinator, which answers "unchanged" (no body) and records the fetch (the
    logic's ``Fetched``), or sends a newer θ if ``version`` was ``None`` and one appeared meanwhile. Any
    swarm failure (no seed, a timeout, a refused manifest) falls back to the coordinator's full download.
    θ comes from verified bytes only: the swarm's ``download`` returns once every chunk and the body
    digest matched the signed manifest.

    :param serve: run a :class:`ChunkServer` on this peer (``--no-serve`` turns it off; a peer that is not
        reachable should not serve, see docs/transport.md); :param bandwidth: its upload cap in bytes/s.
    """

    def __init__(self, client: Any, p2p: Any, namespace: Optional[str], *, serve: bool = True,
                 bandwidth: Optional[float] = None, keep_versions: int = 2, maddrs: Sequence[str] = ()) -> None:
        self.client, self.p2p, self.namespace = client, p2p, namespace
        self.store = BodyStore(int(client.model_numel), keep_versions)
        self.server: Optional[ChunkServer] = ChunkServer(self.store, ServeLimits(bandwidth=bandwidth)) if serve else None
        seed_id = client.coordinator_peer_id
        self.downloader = SwarmDownloader(p2p, seed_id if isinstance(seed_id, str) else seed_id.to_base58(), self.store,
                                          namespace=namespace, serve=serve, maddrs=maddrs)
        self.swarm_downloads = 0
        self.fallbacks = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def start(self) -> None:
        """Register the chunk server (when serving) and learn this peer's own addresses."""
        if self.server is not None:
            await self.server.add_handlers(self.p2p, self.namespace)
            if not self.downloader.maddrs:
                self.downloader.maddrs = [str(m) for m in await self.p2p.get_visible_maddrs()][:MAX_MADDRS]

    async def close(self) -> None:
        await self.downloader.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.remove_handlers(self.p2p, self.namespace)

    async def get_model(self, version: Optional[int] = None, *, codec: Optional[str] = None,
                        timeout: Optional[float] = None) -> Tuple[int, Any]:
        from asyncloco.transport.codecs import EncodedTensor, decode
        from asyncloco.transport.delta import DELTA_CODECS

        chosen = str(self.client.download_codec if codec is None else codec)
        held = self.client.held
        if held is None or held[1] != chosen or version is None or held[0] != version:
            try:
                result = await asyncio.wait_for(self.downloader.download(version, chosen), timeout=timeout or self.downloader.timeout)
                numel = int(self.client.model_numel)
                theta = await asyncio.to_thread(decode, EncodedTensor.from_bytes(chosen, numel, result.body), numel)
                await asyncio.to_thread(self.client.note_decoded, result.manifest.version, chosen, None, theta)
                self.client.held = (result.manifest.version, chosen, theta)
                if chosen in DELTA_CODECS:
                    self.client.anchor = (result.manifest.version, chosen, result.body)
                self.swarm_downloads += 1
            except Exception as error:  # no seed, a refusal, a timeout, p2pd errors: the coordinator serves it
                self.fallbacks += 1
                logger.info("swarm download of v%s failed (%s); downloading from the coordinator", version, error)
        reply: Tuple[int, Any] = await self.client.get_model(version, codec=codec, timeout=timeout)
        return reply
