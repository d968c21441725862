"""θ that does not all come from the coordinator: peers serve the versions they hold to each other (issue 19).

The unit shared is a version's **download body**: exactly the bytes the coordinator sends on a full
``get_model`` in a codec (``wire_bytes(codec, numel)``: fp32 θ, or the full encoding that a lossy codec's
peer keeps as its anchor, transport/delta.py). Deltas are not shared: each is taken from one peer's
anchor, so few other peers could use it.

Protocol (three raw-stream RPCs, frames of :mod:`asyncloco.transport.framing`, messages below):

- ``swarm.manifest`` (the coordinator, called the *seed*): a downloader sends :class:`ManifestRequest`
  (codec, version, whether and where it serves); the seed answers :class:`ManifestReply`: the
  :class:`Manifest` of that body (run id, version, codec, numel, body size, chunk size, SHA-256 of every
  chunk and of the whole body) signed with the coordinator's Ed25519 key, its public key, and up to
  ``max_holders`` *holders*: peers that asked for the same body and serve (they may hold only part of it).
- ``swarm.chunk`` (every serving peer and the seed): :class:`ChunkRequest` names the body and the chunks
  the downloader still lacks (a bitmap); the answer is :class:`ChunkReply` ``ok`` + one chunk of exactly
  the manifest's length for that index, or ``none`` (a peer that has none of them yet), or ``busy`` (the
  seed: every wanted chunk was served recently and the swarm can pass it on; comes with fresh holders).
- ``swarm.report`` (the seed): :class:`Report`: a source served a chunk that failed its digest, or
  timed out. The seed calls ``on_report`` (the daemon journals it) and stops listing a source that
  ``drop_after_reports`` distinct peers reported.

The downloader (:class:`SwarmDownloader`) verifies the manifest's signature (and pins the key: a later
manifest signed by another key is refused), fetches chunks ``parallel`` at a time, asking holders first
and the seed only when no holder has a wanted chunk, checks **every chunk's SHA-256 before it is stored
or served on**, skips a source that sent a bad chunk (and reports it) or that timed out twice, and returns
the body only once every chunk and the whole body's digest match: a peer never decodes, trains on or
serves unverified bytes. The seed serves each chunk once per ``refill_s`` while other serving peers are
listed, so its egress per version stays near one body whatever the number of downloaders; with no other
holder, or when a chunk's copies went missing, it serves like today's ``get_model``.

Bounds: a :class:`BodyStore` keeps the last ``keep_versions`` bodies (each ``wire_bytes(codec, numel)``,
allocated only after a verified manifest that matches the local model size); :class:`ServeLimits` caps
streams in all and per peer and the upload rate (``bandwidth``, a token bucket). Limits, trust and NAT:
docs/transport.md ("Swarm downloads").
"""

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
from typing import Any, Awaitable, Callable, ClassVar, Dict, List, Optional, Sequence, Set, Tuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from asyncloco.transport.codecs import CODECS, MAX_NUMEL, wire_bytes
from asyncloco.transport.errors import MessageError, PeerUnreachable, ProtocolError, RemoteError, RpcTimeout, TransportError
from asyncloco.transport.framing import MAX_CHUNK_BYTES, FrameReader, FrameWriter, pack_header, unpack_header
from asyncloco.transport.wire import MAX_ID_CHARS, MAX_REASON_CHARS, MAX_VERSION, _Message

logger = logging.getLogger(__name__)

__all__ = [
    "Manifest",
    "SignedManifest",
    "ManifestRequest",
    "ManifestReply",
    "ChunkRequest",
    "ChunkReply",
    "Report",
    "Holder",
    "BodyStore",
    "ServeLimits",
    "ChunkServer",
    "SwarmSeed",
    "SwarmDownloader",
    "DownloadResult",
    "chunk_size_for",
    "swarm_handle",
    "SwarmLink",
    "start_seed",
]

DIGEST_BYTES = 32  # SHA-256
MAX_CHUNKS = 1024  # 32 KiB of digests: the manifest fits one 64 KiB header frame with its holders
MIN_CHUNK_BYTES = 1 << 10
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_HOLDERS = 32
MAX_MADDRS = 3
MAX_MADDR_CHARS = 128  # 32 holders × 3 addresses stay far below a header frame beside 32 KiB of digests
EMPTY_RETRY_S = 0.25  # a holder that had none of the wanted chunks is asked again after this
RESEND_S = 5.0  # a server sends a chunk to the same caller again only after this (it may have been lost)
MAX_TRACKED = 4096  # (caller, body) pairs a server remembers for that
PER_SOURCE = 2  # requests in flight per holder from one downloader (a ChunkServer admits 2 per peer)
DOMAIN = b"asyncloco swarm manifest v1\x00"  # signed bytes = DOMAIN || msgpack(manifest)


def swarm_handle(namespace: Optional[str], rpc: str) -> str:
    """The stream handle of a swarm RPC (``manifest``, ``chunk``, ``report``) in a run's namespace."""
    return f"{namespace}::asyncloco.swarm.{rpc}" if namespace else f"asyncloco.swarm.{rpc}"


def chunk_size_for(body_bytes: int, preferred: int = DEFAULT_CHUNK_BYTES) -> int:
    """``preferred``, raised so that the body needs at most :data:`MAX_CHUNKS` chunks (≤ 4 MiB each)."""
    if not MIN_CHUNK_BYTES <= preferred <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk size must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}] bytes, got {preferred}")
    size = max(preferred, math.ceil(body_bytes / MAX_CHUNKS))
    if size > MAX_CHUNK_BYTES:
        raise ValueError(f"a body of {body_bytes} bytes needs chunks over {MAX_CHUNK_BYTES} bytes; too large for the swarm")
    return size


def _bytes_field(message: str, name: str, value: Any, low: int, high: int) -> None:
    if not isinstance(value, bytes):
        raise MessageError(f"{message}.{name}: must be bytes, got {type(value).__name__}")
    if not low <= len(value) <= high:
        raise MessageError(f"{message}.{name}: length {len(value)} is outside [{low}, {high}]")


def _maddrs_field(message: str, name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_MADDRS:
        raise MessageError(f"{message}.{name}: must be a list of at most {MAX_MADDRS} multiaddrs")
    for item in value:
        if not isinstance(item, str) or not 1 <= len(item) <= MAX_MADDR_CHARS or not item.startswith("/"):
            raise MessageError(f"{message}.{name}: {str(item)[:80]!r} is not a multiaddr string of ≤ {MAX_MADDR_CHARS} chars")


# --------------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class Manifest:
    """What a version's download body is: chunk ``i`` is ``body[i·chunk_bytes : (i+1)·chunk_bytes]`` and
    its SHA-256 is ``digests[32 i : 32 (i+1)]``; ``digest`` is the SHA-256 of the whole body."""

    run_id: str
    version: int
    codec: str
    numel: int
    body_bytes: int
    chunk_bytes: int
    digests: bytes
    digest: bytes

    def __post_init__(self) -> None:
        name = "Manifest"
        if not isinstance(self.run_id, str) or len(self.run_id) > MAX_ID_CHARS:
            raise MessageError(f"{name}.run_id: must be a str of at most {MAX_ID_CHARS} chars")
        for key, low, high in (("version", 0, MAX_VERSION), ("numel", 1, MAX_NUMEL), ("chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise MessageError(f"{name}.{key}: {value!r} is not an int in [{low}, {high}]")
        if self.codec not in CODECS:
            raise MessageError(f"{name}.codec: {self.codec!r} is not one of {CODECS}")
        if self.body_bytes != wire_bytes(self.codec, self.numel):
            raise MessageError(f"{name}.body_bytes: {self.body_bytes} != wire_bytes({self.codec!r}, {self.numel})")
        chunks = math.ceil(self.body_bytes / self.chunk_bytes)
        if chunks > MAX_CHUNKS:
            raise MessageError(f"{name}: {chunks} chunks, at most {MAX_CHUNKS}")
        _bytes_field(name, "digests", self.digests, DIGEST_BYTES * chunks, DIGEST_BYTES * chunks)
        _bytes_field(name, "digest", self.digest, DIGEST_BYTES, DIGEST_BYTES)

    @property
    def chunks(self) -> int:
        return math.ceil(self.body_bytes / self.chunk_bytes)

    @property
    def key(self) -> Tuple[int, str]:
        return self.version, self.codec

    def span(self, index: int) -> Tuple[int, int]:
        start = index * self.chunk_bytes
        return start, min(self.body_bytes, start + self.chunk_bytes)

    def chunk_ok(self, index: int, data: Any) -> bool:
        """Whether ``data`` is exactly chunk ``index`` (its length and SHA-256)."""
        start, end = self.span(index)
        if len(data) != end - start:
            return False
        return hashlib.sha256(data).digest() == self.digests[DIGEST_BYTES * index : DIGEST_BYTES * (index + 1)]

    def to_bytes(self) -> bytes:
        return pack_header({f: getattr(self, f) for f in self.__dataclass_fields__})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        fields = unpack_header(data)
        expected = set(cls.__dataclass_fields__)
        if set(fields) != expected:
            raise MessageError(f"Manifest: fields {sorted(fields)} differ from {sorted(expected)}")
        return cls(**fields)

    @classmethod
    def build(cls, run_id: str, version: int, codec: str, numel: int, body: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> "Manifest":
        """The manifest of ``body`` (the full download body of ``version`` in ``codec``)."""
        view = memoryview(body).cast("B")
        size = chunk_size_for(len(view), chunk_bytes)
        digests = b"".join(hashlib.sha256(view[i : i + size]).digest() for i in range(0, len(view), size))
        return cls(run_id, version, codec, numel, len(view), size, digests, hashlib.sha256(view).digest())


@dataclass(frozen=True)
class SignedManifest:
    """A manifest's bytes and the coordinator's Ed25519 signature of ``DOMAIN || manifest``."""

    manifest: bytes
    signature: bytes

    @classmethod
    def sign(cls, manifest: Manifest, key: Ed25519PrivateKey) -> "SignedManifest":
        data = manifest.to_bytes()
        return cls(data, key.sign(DOMAIN + data))

    def verify(self, public_key: Ed25519PublicKey) -> Manifest:
        """The manifest, if the signature is ``public_key``'s; :class:`ProtocolError` otherwise."""
        try:
            public_key.verify(self.signature, DOMAIN + self.manifest)
        except InvalidSignature:
            raise ProtocolError("swarm manifest: the signature does not verify under the coordinator's key") from None
        return Manifest.from_bytes(self.manifest)


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# --------------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Holder:
    """A peer that serves a body (it may hold only part of it) and the multiaddrs it declared."""

    peer_id: str
    maddrs: Tuple[str, ...] = ()

    def to_wire(self) -> List[Any]:
        return [self.peer_id, list(self.maddrs)]

    @classmethod
    def from_wire(cls, data: Any) -> "Holder":
        if not isinstance(data, (list, tuple)) or len(data) != 2 or not isinstance(data[0], str) or not 1 <= len(data[0]) <= MAX_ID_CHARS:
            raise MessageError("holder: must be [peer_id, [multiaddr, ...]]")
        _maddrs_field("holder", "maddrs", data[1])
        return cls(data[0], tuple(data[1]))


def _holders_field(message: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_HOLDERS:
        raise MessageError(f"{message}.holders: must be a list of at most {MAX_HOLDERS} holders")
    for item in value:
        Holder.from_wire(item)


@dataclass(frozen=True)
class ManifestRequest(_Message):
    """``swarm.manifest``: the body of ``version`` (``None``: the latest) in ``codec``; ``serve``: whether the
    caller serves what it downloads, at ``maddrs`` (its own reachable multiaddrs)."""

    codec: str
    version: Optional[int] = None
    serve: bool = False
    maddrs: Optional[List[str]] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("codec", "serve")

    def __post_init__(self) -> None:
        self._str("codec", 8, choices=CODECS)
        self._int("version", 0, MAX_VERSION, optional=True)
        self._bool("serve")
        if self.maddrs is not None:
            _maddrs_field("ManifestRequest", "maddrs", self.maddrs)


@dataclass(frozen=True)
class ManifestReply(_Message):
    manifest: bytes
    signature: bytes
    public_key: bytes
    holders: List[Any]
    REQUIRED: ClassVar[tuple[str, ...]] = ("manifest", "signature", "public_key", "holders")

    def __post_init__(self) -> None:
        _bytes_field("ManifestReply", "manifest", self.manifest, 1, 48 << 10)
        _bytes_field("ManifestReply", "signature", self.signature, 64, 64)
        _bytes_field("ManifestReply", "public_key", self.public_key, 32, 32)
        _holders_field("ManifestReply", self.holders)


@dataclass(frozen=True)
class ChunkRequest(_Message):
    """``swarm.chunk``: one of the chunks whose bits are set in ``want`` (bit ``i`` = ``want[i // 8] >> (i % 8) & 1``)."""

    version: int
    codec: str
    want: bytes
    fallback: bool = False  # to the seed: every holder this peer was given failed it (bad or unreachable)
    REQUIRED: ClassVar[tuple[str, ...]] = ("version", "codec", "want")

    def __post_init__(self) -> None:
        self._int("version", 0, MAX_VERSION)
        self._str("codec", 8, choices=CODECS)
        _bytes_field("ChunkRequest", "want", self.want, 1, MAX_CHUNKS // 8)
        self._bool("fallback")

    def wanted(self, chunks: int) -> List[int]:
        if len(self.want) != math.ceil(chunks / 8):
            raise MessageError(f"ChunkRequest.want: {len(self.want)} bytes for {chunks} chunks")
        return [i for i in range(chunks) if self.want[i // 8] >> (i % 8) & 1]

    @staticmethod
    def bitmap(indices: Sequence[int], chunks: int) -> bytes:
        out = bytearray(math.ceil(chunks / 8))
        for i in indices:
            out[i // 8] |= 1 << (i % 8)
        return bytes(out)


@dataclass(frozen=True)
class ChunkReply(_Message):
    """``ok``: chunk ``index`` follows in one CHUNK frame; ``none``: nothing wanted is held; ``busy``: the seed
    asks the caller to fetch from ``holders`` (and try again later)."""

    status: str
    index: Optional[int] = None
    holders: Optional[List[Any]] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("status",)

    def __post_init__(self) -> None:
        self._str("status", 4, choices=("ok", "none", "busy"))
        self._int("index", 0, MAX_CHUNKS - 1, optional=True)
        if (self.index is None) == (self.status == "ok"):
            raise MessageError("ChunkReply.index: set exactly when status is 'ok'")
        if self.holders is not None:
            _holders_field("ChunkReply", self.holders)


@dataclass(frozen=True)
class Report(_Message):
    """``swarm.report``: ``source`` served chunk(s) of (``version``, ``codec``) that failed their digest, or
    was too slow; ``reason`` says which."""

    version: int
    codec: str
    source: str
    reason: str
    REQUIRED: ClassVar[tuple[str, ...]] = ("version", "codec", "source", "reason")

    def __post_init__(self) -> None:
        self._int("version", 0, MAX_VERSION)
        self._str("codec", 8, choices=CODECS)
        self._str("source", MAX_ID_CHARS, empty=False)
        self._str("reason", MAX_REASON_CHARS)


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
    """What a chunk server did: chunks and body bytes sent, all bytes written, answers ``none``/``busy``, calls refused."""

    chunks_sent: int = 0
    bytes_sent: int = 0  # chunk bodies
    stream_bytes_sent: int = 0  # every frame written (headers, manifests, chunks, errors): the egress
    none: int = 0
    busy: int = 0
    refused: int = 0
    per_peer: Dict[str, int] = field(default_factory=dict)  # chunks sent per caller (≤ 4096 ids)


class ChunkServer:
    """Serves verified chunks of the bodies in ``store`` on ``swarm.chunk``. A subclass may choose which
    chunk to send (:meth:`choose`) and alter what is sent (:meth:`payload`, for tests of hostile peers)."""

    def __init__(self, store: BodyStore, limits: Optional[ServeLimits] = None) -> None:
        self.store = store
        self.limits = limits if limits is not None else ServeLimits()
        self.counters = ServeCounters()
        self._bucket = _TokenBucket(self.limits.bandwidth)
        self._active: Dict[str, int] = {}
        self._streams = 0
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
            if admitted:
                self._streams += 1
                self._active[peer_id] = self._active.get(peer_id, 0) + 1
            try:
                if not admitted:
                    self.counters.refused += 1
                    raise RemoteError(f"too many swarm calls in flight (at most {self.limits.max_per_peer} per peer, "
                                      f"{self.limits.max_streams} in all); retry later")
                await serve(peer_id, frames_in, frames_out)
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
            self.counters.none += 1
            await frames_out.header(ChunkReply("none").to_wire())
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
            if version is None and self.current is not None:
                version = self.current()
            key = (version, codec) if version is not None else None
            entry = self.store.get(key) if key is not None else None
            if entry is None or key not in self._signed:
                version, body = await self.body_for(version, codec)
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
        """The verified body of (``version``, ``codec``); raises :class:`RpcTimeout` after ``timeout``."""
        started = time.monotonic()
        manifest, holders = await self.manifest(version, codec)
        entry = self.store.open(manifest)
        entry.downloading += 1
        try:
            return await asyncio.wait_for(self._fetch(manifest, entry, holders, started), timeout=self.timeout)
        except asyncio.TimeoutError:
            raise RpcTimeout(f"swarm download of v{manifest.version} took over {self.timeout:.0f} s") from None
        finally:
            entry.downloading -= 1

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
                if isinstance(error, ProtocolError):
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
                self.client.held = (result.manifest.version, chosen, theta)
                if chosen in DELTA_CODECS:
                    self.client.anchor = (result.manifest.version, chosen, result.body)
                self.swarm_downloads += 1
            except Exception as error:  # no seed, a refusal, a timeout, p2pd errors: the coordinator serves it
                self.fallbacks += 1
                logger.info("swarm download of v%s failed (%s); downloading from the coordinator", version, error)
        reply: Tuple[int, Any] = await self.client.get_model(version, codec=codec, timeout=timeout)
        return reply
