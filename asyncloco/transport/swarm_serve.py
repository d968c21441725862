"""The θ swarm's serving side: the bounded store of bodies a node holds, the chunk server (per-peer and global
limits, the --serve-bandwidth token bucket) and the coordinator's seed (manifests, holders, reports).
The protocol: transport/swarm.py and docs/transport.md."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from asyncloco.transport.codecs import wire_bytes
from asyncloco.transport.errors import ProtocolError, RemoteError, TransportError
from asyncloco.transport.framing import FrameReader, FrameWriter, read_until_closed
from asyncloco.transport.swarm_wire import (
    ChunkReply,
    ChunkRequest,
    DEFAULT_CHUNK_BYTES,
    Holder,
    MAX_HOLDERS,
    MAX_TRACKED,
    Manifest,
    ManifestReply,
    ManifestRequest,
    RESEND_S,
    Report,
    SignedManifest,
    public_key_bytes,
    swarm_handle,
)

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ store


@dataclass
class _Body:
    manifest: Manifest
    data: bytearray
    have: bytearray  # one byte per chunk: 1 = verified and stored
    downloading: int = 0

    @property
    def complete(self) -> bool:
        return all(self.have)


class BodyStore:
    """The bodies a peer holds and serves: the last ``keep_versions`` (by insertion), complete or partial.
    Only verified chunks are stored. Memory ≤ ``keep_versions × wire_bytes(codec, numel)``."""

    def __init__(self, numel: int, keep_versions: int = 2) -> None:
        wire_bytes("none", numel)
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be ≥ 1, got {keep_versions}")
        self.numel, self.keep_versions = numel, keep_versions
        self._bodies: "OrderedDict[Tuple[int, str], _Body]" = OrderedDict()

    def get(self, key: Tuple[int, str]) -> Optional[_Body]:
        return self._bodies.get(key)

    def keys(self) -> List[Tuple[int, str]]:
        return list(self._bodies)

    def open(self, manifest: Manifest, body: Any = None) -> _Body:
        """The entry of ``manifest``'s body (created, evicting the oldest beyond ``keep_versions``); with
        ``body`` (bytes the caller built itself, e.g. the seed), stored whole after a digest check."""
        if manifest.numel != self.numel:
            raise ProtocolError(f"manifest numel {manifest.numel} != this model's {self.numel}")
        entry = self._bodies.get(manifest.key)
        if entry is not None and entry.manifest != manifest:
            raise ProtocolError(f"two different manifests for v{manifest.version} {manifest.codec}")
        if entry is None:
            evictable = [k for k, e in self._bodies.items() if e.downloading == 0]
            while len(self._bodies) >= self.keep_versions and evictable:
                del self._bodies[evictable.pop(0)]
            if body is not None:
                data = bytearray(memoryview(body).cast("B"))
                if hashlib.sha256(data).digest() != manifest.digest:
                    raise ValueError("the body does not match its manifest")
                entry = _Body(manifest, data, bytearray(b"\x01" * manifest.chunks))
            else:
                entry = _Body(manifest, bytearray(manifest.body_bytes), bytearray(manifest.chunks))
            self._bodies[manifest.key] = entry
        return entry

    def put_chunk(self, entry: _Body, index: int, data: Any) -> None:
        """Store chunk ``index`` — only after :meth:`Manifest.chunk_ok` (checked again here)."""
        if not entry.manifest.chunk_ok(index, data):
            raise ProtocolError(f"chunk {index} of v{entry.manifest.version} does not match its digest")
        start, end = entry.manifest.span(index)
        entry.data[start:end] = data
        entry.have[index] = 1


# ----------------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ServeLimits:
    """Bounds of a chunk server. ``bandwidth``: bytes/s of chunks sent in all (``None``: no cap; the peer's
    ``--serve-bandwidth``); ``max_streams``: chunk calls in flight; ``max_per_peer``: per caller."""

    bandwidth: Optional[float] = None
    max_streams: int = 16
    max_per_peer: int = 2
    idle_timeout: float = 30.0
    header_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"serve bandwidth must be positive bytes/s, got {self.bandwidth!r}")
        if self.max_streams < 1 or self.max_per_peer < 1 or self.idle_timeout <= 0 or self.header_timeout <= 0:
            raise ValueError(f"ServeLimits must be positive: {self}")


class _TokenBucket:
    """Upload rate cap: ``take(n)`` waits until ``n`` bytes fit at ``rate`` bytes/s (a burst of one second)."""

    def __init__(self, rate: Optional[float]) -> None:
        self.rate = rate
        self.tokens = rate if rate is not None else 0.0
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, nbytes: int) -> None:
        if self.rate is None:
            return
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(max(self.rate, float(nbytes)), self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= nbytes
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


@dataclass
class ServeCounters:
    """What a chunk server did: chunks and body bytes sent, all bytes written, answers ``none``/``busy``/``gone``,
    calls refused."""

    chunks_sent: int = 0
    bytes_sent: int = 0  # chunk bodies
    stream_bytes_sent: int = 0  # every frame written (headers, manifests, chunks, errors): the egress
    none: int = 0
    busy: int = 0
    gone: int = 0
    refused: int = 0
    per_peer: Dict[str, int] = field(default_factory=dict)  # chunks sent per caller (≤ 4096 ids)


class ChunkServer:
    """Serves verified chunks of the bodies in ``store`` on ``swarm.chunk``. A subclass may choose which
    chunk to send (:meth:`choose`) and alter what is sent (:meth:`payload`, for tests of hostile peers).

    A request for a body it does not hold gets ``missing_status``: ``none`` from a peer (it may hold it later),
    ``gone`` from the seed (:class:`SwarmSeed`: it published that version and has since dropped it)."""

    missing_status = "none"

    def __init__(self, store: BodyStore, limits: Optional[ServeLimits] = None) -> None:
        self.store = store
        self.limits = limits if limits is not None else ServeLimits()
        self.counters = ServeCounters()
        self._bucket = _TokenBucket(self.limits.bandwidth)
        self._active: Dict[str, int] = {}
        self._streams = 0
        self._lingering = 0  # answered streams waiting for their caller to close
        self._sent: "OrderedDict[Tuple[str, int, str], Dict[int, float]]" = OrderedDict()  # (caller, body) -> chunk -> sent at

    async def add_handlers(self, p2p: Any, namespace: Optional[str]) -> None:
        await p2p.add_binary_stream_handler(swarm_handle(namespace, "chunk"), self._stream_handler(self._serve_chunk))

    async def remove_handlers(self, p2p: Any, namespace: Optional[str]) -> None:
        await p2p.remove_binary_stream_handler(swarm_handle(namespace, "chunk"))

    def _stream_handler(self, serve: Callable[[str, FrameReader, FrameWriter], Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def handle(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer_id = info.peer_id.to_base58()
            frames_in = FrameReader(reader, idle_timeout=self.limits.idle_timeout, deadline=time.monotonic() + self.limits.header_timeout)
            frames_out = FrameWriter(writer, idle_timeout=self.limits.idle_timeout)
            admitted = self._streams < self.limits.max_streams and self._active.get(peer_id, 0) < self.limits.max_per_peer
            answered = False
            if admitted:
                self._streams += 1
                self._active[peer_id] = self._active.get(peer_id, 0) + 1
            try:
                if not admitted:
                    self.counters.refused += 1
                    raise RemoteError(f"too many swarm calls in flight (at most {self.limits.max_per_peer} per peer, "
                                      f"{self.limits.max_streams} in all); retry later")
                await serve(peer_id, frames_in, frames_out)
                answered = True
            except asyncio.CancelledError:
                raise
            except (TransportError, ValueError) as error:
                logger.debug("swarm call from %s refused: %s", peer_id, error)
                with contextlib.suppress(Exception):
                    await frames_out.error(str(error))
                    if writer.can_write_eof():
                        writer.write_eof()
                    await asyncio.wait_for(reader.read(1 << 16), timeout=1.0)  # let the ERROR frame arrive before closing
            except Exception as error:  # a bug: one line, never the server
                logger.warning("swarm call from %s failed: %r", peer_id, error)
            finally:
                self.counters.stream_bytes_sent += frames_out.bytes_written
                if admitted:
                    self._streams -= 1
                    left = self._active[peer_id] - 1
                    if left:
                        self._active[peer_id] = left
                    else:
                        del self._active[peer_id]
                if answered and self._lingering < self.limits.max_streams:
                    # hang up only once the caller has read the answer and closed (transport/framing.py)
                    self._lingering += 1
                    try:
                        await read_until_closed(reader, self.limits.idle_timeout, 1 << 16)
                    finally:
                        self._lingering -= 1
                writer.close()

        return handle

    def choose(self, peer_id: str, entry: _Body, wanted: List[int], fallback: bool = False) -> Tuple[str, Optional[int]]:
        """``("ok", index)`` of a held chunk among ``wanted`` (a random one: callers spread), else ``("none", None)``."""
        held = [i for i in wanted if entry.have[i]]
        return ("ok", random.choice(held)) if held else ("none", None)

    def payload(self, entry: _Body, index: int) -> Any:
        start, end = entry.manifest.span(index)
        return memoryview(entry.data)[start:end]

    def holders_for(self, peer_id: str, entry: _Body) -> Optional[List[Any]]:
        return None

    async def _serve_chunk(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter) -> None:
        request = ChunkRequest.from_wire(await frames_in.read_header())
        entry = self.store.get((request.version, request.codec))
        if entry is None:
            status = self.missing_status
            setattr(self.counters, status, getattr(self.counters, status) + 1)
            await frames_out.header(ChunkReply(status).to_wire())
            return
        # a chunk sent (or being sent) to this caller in the last RESEND_S is not sent again: its other requests
        # were written before that chunk arrived (after RESEND_S it may have been lost and is sent again)
        now = time.monotonic()
        key = (peer_id, request.version, request.codec)
        sent = self._sent.pop(key, {})
        sent = {i: t for i, t in sent.items() if t == math.inf or now - t < RESEND_S}
        self._sent[key] = sent
        while len(self._sent) > MAX_TRACKED:
            self._sent.popitem(last=False)
        wanted = [i for i in request.wanted(entry.manifest.chunks) if i not in sent]
        status, index = self.choose(peer_id, entry, wanted, request.fallback) if wanted else ("none", None)
        if status != "ok" or index is None:
            setattr(self.counters, status, getattr(self.counters, status) + 1)
            await frames_out.header(ChunkReply(status, holders=self.holders_for(peer_id, entry)).to_wire())
            return
        sent[index] = math.inf  # in flight
        try:
            data = self.payload(entry, index)
            await self._bucket.take(len(data))
            await frames_out.header(ChunkReply("ok", index).to_wire())
            await frames_out.body(data, max(1, len(data)))
        finally:
            sent[index] = time.monotonic()
        self.counters.chunks_sent += 1
        self.counters.bytes_sent += len(data)
        if peer_id in self.counters.per_peer or len(self.counters.per_peer) < 4096:
            self.counters.per_peer[peer_id] = self.counters.per_peer.get(peer_id, 0) + 1


# ------------------------------------------------------------------------------------------------- seed


@dataclass
class _Swarm:
    """The seed's soft state for one body: who asked for it (and serves), and when each chunk was sent."""

    members: "OrderedDict[str, Holder]" = field(default_factory=OrderedDict)
    served_at: List[float] = field(default_factory=list)
    copies: List[int] = field(default_factory=list)
    reports: Dict[str, Set[str]] = field(default_factory=dict)  # source -> distinct reporters


class SwarmSeed(ChunkServer):
    """The coordinator's side: signs manifests, lists holders, serves chunks the swarm cannot.

    :param body_for: ``async (version | None, codec) -> (version, body)``: the full download body the
        coordinator would send (e.g. the encoding its ``CoordinatorService`` sends; fp32 θ's bytes).
    :param key: the coordinator's Ed25519 key (coordinator/admission.py ``load_or_create_key``).
    :param refill_s: while other serving peers are listed, each chunk is served at most once per this.
    :param on_report: ``(reporter, source, version, reason)`` for every report (journal it).
    :param drop_after_reports: a source reported by this many distinct peers is no longer listed.
    :param admit: ``async (peer_id)``, raises to refuse an unadmitted caller (manifests and the seed's chunks).
    :param current: the latest version (a cheap call); bodies already published are then not asked again.

    Holders are soft state (not the coordinator's WAL): after a restart the swarm starts again from the
    seed, which costs bytes, never correctness.
    """

    missing_status = "gone"  # a version the seed no longer holds will not come back: downloaders stop at once

    def __init__(
        self,
        store: BodyStore,
        run_id: str,
        key: Ed25519PrivateKey,
        body_for: Callable[[Optional[int], str], Awaitable[Tuple[int, Any]]],
        *,
        limits: Optional[ServeLimits] = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        refill_s: float = 2.0,
        max_holders: int = 16,
        max_members: int = 256,
        drop_after_reports: int = 2,
        on_report: Optional[Callable[[str, str, int, str], None]] = None,
        admit: Optional[Callable[[str], Awaitable[None]]] = None,
        current: Optional[Callable[[], int]] = None,
    ) -> None:
        super().__init__(store, limits if limits is not None else ServeLimits(max_streams=64, max_per_peer=8))
        self.current = current  # the latest version, cheaply (else body_for(None, codec) is asked each time)
        self.admit = admit  # raises to refuse a caller (the coordinator's admission check), before anything is served
        self.run_id, self.key, self.body_for = run_id, key, body_for
        self.public_key = public_key_bytes(key)
        self.chunk_bytes, self.refill_s = chunk_bytes, refill_s
        self.max_holders, self.max_members, self.drop_after_reports = min(max_holders, MAX_HOLDERS), max_members, drop_after_reports
        self.on_report = on_report
        self._signed: Dict[Tuple[int, str], SignedManifest] = {}
        self._swarms: Dict[Tuple[int, str], _Swarm] = {}
        self._lock = asyncio.Lock()
        self.reports: List[Tuple[str, str, int, str]] = []  # the last 1,000 (status, tests)

    async def add_handlers(self, p2p: Any, namespace: Optional[str]) -> None:
        await super().add_handlers(p2p, namespace)
        await p2p.add_binary_stream_handler(swarm_handle(namespace, "manifest"), self._stream_handler(self._serve_manifest))
        await p2p.add_binary_stream_handler(swarm_handle(namespace, "report"), self._stream_handler(self._serve_report))

    async def remove_handlers(self, p2p: Any, namespace: Optional[str]) -> None:
        await super().remove_handlers(p2p, namespace)
        for rpc in ("manifest", "report"):
            await p2p.remove_binary_stream_handler(swarm_handle(namespace, rpc))

    async def publish(self, version: Optional[int], codec: str) -> Tuple[SignedManifest, _Body]:
        """The signed manifest of (``version``, ``codec``), building it (and storing the body) once."""
        async with self._lock:
            asked = version
            if version is None and self.current is not None:
                version = self.current()
            key = (version, codec) if version is not None else None
            entry = self.store.get(key) if key is not None else None
            if entry is None or key not in self._signed:
                # asked for the newest: ask body_for for the newest too (the version read above may have been
                # replaced meanwhile, and the coordinator no longer serves a replaced one)
                version, body = await self.body_for(version if asked is not None else None, codec)
                key = (version, codec)
                manifest = await asyncio.to_thread(Manifest.build, self.run_id, version, codec, self.store.numel, body, self.chunk_bytes)
                entry = self.store.open(manifest, body)
                self._signed[key] = SignedManifest.sign(manifest, self.key)
                self._swarms[key] = _Swarm(served_at=[-math.inf] * manifest.chunks, copies=[0] * manifest.chunks)
                for old in [k for k in self._signed if self.store.get(k) is None]:
                    del self._signed[old]
                    self._swarms.pop(old, None)
            entry = self.store.get(key)
            assert entry is not None and key is not None
            return self._signed[key], entry

    def holders(self, key: Tuple[int, str], exclude: str = "") -> List[Holder]:
        swarm = self._swarms.get(key)
        if swarm is None:
            return []
        listed = [h for p, h in swarm.members.items() if p != exclude and len(swarm.reports.get(p, ())) < self.drop_after_reports]
        return random.sample(listed, min(self.max_holders, len(listed)))

    def holders_for(self, peer_id: str, entry: _Body) -> Optional[List[Any]]:
        return [h.to_wire() for h in self.holders(entry.manifest.key, exclude=peer_id)]

    def choose(self, peer_id: str, entry: _Body, wanted: List[int], fallback: bool = False) -> Tuple[str, Optional[int]]:
        """The wanted chunk sent fewest times (then longest ago). While other serving peers are listed, chunk
        ``i`` goes out again only ``refill_s × 2^(copies_i − 1)`` after its last copy (a holder may have
        left): copies grow with the log of the time a version is in demand, not with the downloaders.
        ``fallback`` (every holder failed the caller): served like today's ``get_model``, no budget."""
        swarm = self._swarms.get(entry.manifest.key)
        if swarm is None or not wanted:
            return ("none", None)
        now = time.monotonic()
        if not fallback and self.holders(entry.manifest.key, exclude=peer_id):
            wanted = [i for i in wanted if not swarm.copies[i] or now - swarm.served_at[i] >= self.refill_s * 2 ** (swarm.copies[i] - 1)]
            if not wanted:
                return ("busy", None)  # every wanted chunk left the seed recently: the swarm has it
        index = min(wanted, key=lambda i: (swarm.copies[i], swarm.served_at[i], random.random()))
        swarm.served_at[index] = now
        swarm.copies[index] += 1
        return ("ok", index)

    async def _admit(self, peer_id: str) -> None:
        if self.admit is not None:
            try:
                await self.admit(peer_id)
            except Exception as error:
                raise RemoteError(f"refused: {error}") from None

    async def _serve_chunk(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter) -> None:
        await self._admit(peer_id)
        await super()._serve_chunk(peer_id, frames_in, frames_out)

    def status(self) -> Dict[str, Any]:
        """Who serves what (for ``asyncloco status``/the dashboard): per body, the listed holders, the chunks
        the seed sent and the reports; plus the seed's counters."""
        bodies = []
        for (version, codec), swarm in sorted(self._swarms.items()):
            bodies.append({
                "version": version,
                "codec": codec,
                "holders": [p for p in swarm.members if len(swarm.reports.get(p, ())) < self.drop_after_reports],
                "dropped": sorted(p for p, r in swarm.reports.items() if len(r) >= self.drop_after_reports),
                "seed_copies": sum(swarm.copies),
                "chunks": len(swarm.copies),
            })
        return {
            "bodies": bodies,
            "seed_bytes_sent": self.counters.stream_bytes_sent,
            "seed_chunks_sent": self.counters.chunks_sent,
            "reports": [{"reporter": r, "source": s, "version": v, "reason": why} for r, s, v, why in self.reports[-10:]],
        }

    async def _serve_manifest(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter) -> None:
        request = ManifestRequest.from_wire(await frames_in.read_header())
        await self._admit(peer_id)
        signed, entry = await self.publish(request.version, request.codec)
        key = entry.manifest.key
        holders = [h.to_wire() for h in self.holders(key, exclude=peer_id)]
        swarm = self._swarms[key]
        if request.serve and request.maddrs:
            swarm.members.pop(peer_id, None)
            swarm.members[peer_id] = Holder(peer_id, tuple(request.maddrs))
            while len(swarm.members) > self.max_members:
                swarm.members.popitem(last=False)
        await frames_out.header(ManifestReply(signed.manifest, signed.signature, self.public_key, holders).to_wire())

    async def _serve_report(self, peer_id: str, frames_in: FrameReader, frames_out: FrameWriter) -> None:
        report = Report.from_wire(await frames_in.read_header())
        swarm = self._swarms.get((report.version, report.codec))
        if swarm is not None and report.source != peer_id:
            reporters = swarm.reports.setdefault(report.source, set())
            if len(reporters) < 64:
                reporters.add(peer_id)
        record = (peer_id, report.source, report.version, report.reason[:300])
        self.reports.append(record)
        del self.reports[:-1000]
        logger.warning("swarm: %s reports %s for v%d: %s", *record)
        if self.on_report is not None:
            try:
                self.on_report(*record)
            except Exception as error:  # the journal must never break the seed
                logger.debug("on_report failed: %r", error)
        await frames_out.header({"ok": True})
