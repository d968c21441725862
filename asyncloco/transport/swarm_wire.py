"""The θ swarm's wire: the signed manifest of a version's body (chunk digests, holders) and the typed
messages of its RPCs, each field bounded before use. The protocol: transport/swarm.py and docs/transport.md."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar, List, Optional, Sequence, Tuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from asyncloco.transport.codec_format import CODEC_NAME_MAX
from asyncloco.transport.codecs import CODECS, MAX_NUMEL, wire_bytes
from asyncloco.transport.errors import MessageError, ProtocolError
from asyncloco.transport.framing import MAX_CHUNK_BYTES, pack_header, unpack_header
from asyncloco.transport.wire import MAX_ID_CHARS, MAX_REASON_CHARS, MAX_VERSION, _Message


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
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
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
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
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
    asks the caller to fetch from ``holders`` (and try again later); ``gone``: the seed no longer holds that
    version at all (newer ones replaced it), so no chunk of it will come from there."""

    status: str
    index: Optional[int] = None
    holders: Optional[List[Any]] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("status",)

    def __post_init__(self) -> None:
        self._str("status", 4, choices=("ok", "none", "busy", "gone"))
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
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
        self._str("source", MAX_ID_CHARS, empty=False)
        self._str("reason", MAX_REASON_CHARS)
