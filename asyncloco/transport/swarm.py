"""θ that does not all come from the coordinator: peers serve the versions they hold to each other.

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

The code: swarm_wire.py (manifest, messages), swarm_serve.py (store, chunk server, seed), swarm_fetch.py
(downloader, SwarmLink); every name is re-exported here.
"""

from __future__ import annotations

# every name of the parts, private ones included, is re-exported: callers and tests use swarm.X
from asyncloco.transport.swarm_wire import (
    ChunkReply,
    ChunkRequest,
    DEFAULT_CHUNK_BYTES,
    DIGEST_BYTES,
    DOMAIN,
    EMPTY_RETRY_S,
    Holder,
    MAX_CHUNKS,
    MAX_HOLDERS,
    MAX_MADDRS,
    MAX_MADDR_CHARS,
    MAX_TRACKED,
    MIN_CHUNK_BYTES,
    Manifest,
    ManifestReply,
    ManifestRequest,
    PER_SOURCE,
    RESEND_S,
    Report,
    SignedManifest,
    _bytes_field,
    _holders_field,
    _maddrs_field,
    chunk_size_for,
    public_key_bytes,
    swarm_handle,
)
from asyncloco.transport.swarm_serve import (
    BodyStore,
    ChunkServer,
    ServeCounters,
    ServeLimits,
    SwarmSeed,
    _Body,
    _Swarm,
    _TokenBucket,
)
from asyncloco.transport.swarm_fetch import (
    DownloadResult,
    SwarmDownloader,
    SwarmLink,
    _Source,
    start_seed,
)

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
