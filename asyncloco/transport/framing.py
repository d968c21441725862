"""Framing of the coordinator RPCs on raw libp2p streams: bounded frames, deadlines, exact byte accounting.

Every RPC runs on one raw stream (``P2P.add_binary_stream_handler`` / ``call_binary_stream_handler``);
nothing of hivemind's protobuf framing is used, so no message is read before its size is checked.
A frame is::

    kind (1 byte) | length (4 bytes, big-endian) | length bytes

- ``HEADER`` (1): a msgpack map (one :mod:`asyncloco.transport.wire` message), ≤ :data:`MAX_HEADER_BYTES`;
- ``CHUNK`` (2): raw body bytes (the codec's ``meta || payload``), ≤ :data:`MAX_CHUNK_BYTES` and never
  more than the bytes of the body still expected;
- ``ERROR`` (3): a UTF-8 message from the service (refusal or failure), ≤ :data:`MAX_HEADER_BYTES`.

:class:`FrameReader` reads the 5-byte prefix, checks the kind against the ones the protocol allows at
that point and the length against that kind's maximum, and only then reads the frame; every read has
an idle deadline (no progress for ``idle_timeout`` seconds) and the whole exchange a total deadline.
Bytes on the stream per frame = 5 + length, so a body of ``B`` bytes in chunks of ``c`` after a header
of ``h`` bytes costs exactly :func:`stream_bytes` ``= 5 + h + Σ (5 + c_i)`` (libp2p's yamux/noise framing
below is not counted).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Dict, Mapping, Optional, Tuple

import msgpack

from asyncloco.transport.errors import PeerUnreachable, ProtocolError, RemoteError, RpcTimeout

__all__ = [
    "HEADER",
    "CHUNK",
    "ERROR",
    "CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "FRAME_BYTES",
    "pack_header",
    "unpack_header",
    "stream_bytes",
    "FrameReader",
    "FrameWriter",
    "BodyAssembler",
]

HEADER, CHUNK, ERROR = 1, 2, 3
KIND_NAMES = {HEADER: "header", CHUNK: "chunk", ERROR: "error"}
CHUNK_BYTES = 1 << 20  # 1 MiB sent per chunk: 5 B framing (0.0005 %); small enough to interleave streams
MAX_CHUNK_BYTES = 4 << 20  # a receiver refuses a bigger declared chunk before reading it
MAX_HEADER_BYTES = 64 << 10
FRAME_BYTES = 5  # kind + 32-bit big-endian length


def stream_bytes(header_len: int, body_len: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Exact bytes of one header frame of ``header_len`` msgpack bytes plus a body cut into chunks."""
    return FRAME_BYTES + header_len + body_len + FRAME_BYTES * math.ceil(body_len / chunk_bytes)


def pack_header(fields: Mapping[str, Any]) -> bytes:
    data: bytes = msgpack.packb(dict(fields), use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return data


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in a header")


def unpack_header(data: bytes) -> Dict[str, Any]:
    """Parse a peer's msgpack map: size-capped, plain types only (no extension types), str keys."""
    if len(data) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        # max_*_len limits default to len(data), which is already capped above.
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except Exception as error:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError(f"malformed msgpack header: {error}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"header must be a map, got {type(value).__name__}")
    return value


async def read_until_closed(reader: asyncio.StreamReader, timeout: float, max_bytes: int) -> int:
    """Read and drop what the other end still sends until it closes its side, for at most ``timeout`` seconds
    and ``max_bytes`` bytes; returns the bytes dropped. A server calls this before closing a stream whose
    answer it has written, so that it hangs up only after the caller has read the answer and closed:
    closing first lets p2pd reset the libp2p stream, and a reset can overtake the answer's last bytes."""
    discarded = 0
    deadline = time.monotonic() + timeout
    try:
        while discarded < max_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            data = await asyncio.wait_for(reader.read(64 << 10), timeout=left)
            if not data:
                break
            discarded += len(data)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
    return discarded


class FrameReader:
    """Reads bounded frames from a stream under an idle and a total deadline.

    :param idle_timeout: seconds a single read may go without completing (``None``: no idle limit).
    :param deadline: ``time.monotonic()`` value after which every read fails (``None``: none); see
        :meth:`extend`.
    """

    def __init__(self, reader: asyncio.StreamReader, *, idle_timeout: Optional[float], deadline: Optional[float] = None) -> None:
        self.reader, self.idle_timeout, self.deadline = reader, idle_timeout, deadline
        self.bytes_read = 0

    def extend(self, seconds: float) -> None:
        """Set the total deadline to ``seconds`` from now."""
        self.deadline = time.monotonic() + seconds

    async def _read(self, count: int, what: str) -> bytes:
        limit = self.idle_timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise RpcTimeout(f"deadline passed before {what}")
            limit = left if limit is None else min(limit, left)
        try:
            data = await asyncio.wait_for(self.reader.readexactly(count), timeout=limit)
        except asyncio.TimeoutError:
            raise RpcTimeout(f"no complete {what} within {limit:.1f} s") from None
        except asyncio.IncompleteReadError as error:
            raise PeerUnreachable(f"stream closed after {len(error.partial)} of {count} bytes of {what}") from None
        except (ConnectionError, OSError) as error:
            raise PeerUnreachable(f"stream broke while reading {what}: {error!r}") from None
        self.bytes_read += count
        return data

    async def read_frame(self, limits: Mapping[int, int]) -> Tuple[int, bytes]:
        """One frame whose kind is a key of ``limits`` and whose length is at most ``limits[kind]``.
        An ``ERROR`` frame, when allowed, is raised as :class:`RemoteError`."""
        prefix = await self._read(FRAME_BYTES, "frame prefix")
        kind, length = prefix[0], int.from_bytes(prefix[1:], "big")
        if kind not in limits:
            expected = "/".join(KIND_NAMES.get(k, str(k)) for k in limits)
            raise ProtocolError(f"unexpected frame kind {kind} ({KIND_NAMES.get(kind, 'unknown')}); expected {expected}")
        if length > limits[kind]:
            raise ProtocolError(f"{KIND_NAMES[kind]} frame declares {length} bytes, more than the {limits[kind]} allowed here")
        data = await self._read(length, f"{KIND_NAMES[kind]} of {length} bytes")
        if kind == ERROR:
            raise RemoteError(data.decode("utf-8", errors="replace"))
        return kind, data

    async def read_header(self, *, allow_error: bool = False) -> Dict[str, Any]:
        limits = {HEADER: MAX_HEADER_BYTES}
        if allow_error:
            limits[ERROR] = MAX_HEADER_BYTES
        _, data = await self.read_frame(limits)
        return unpack_header(data)

    async def read_body(self, expected: int, *, allow_error: bool = False) -> bytearray:
        """Exactly ``expected`` body bytes in chunk frames, each checked against what is still missing."""
        assembler = BodyAssembler(expected)
        while assembler.missing:
            limits = {CHUNK: min(MAX_CHUNK_BYTES, assembler.missing)}
            if allow_error:
                limits[ERROR] = MAX_HEADER_BYTES
            _, data = await self.read_frame(limits)
            if not data:
                raise ProtocolError("empty chunk frame")
            assembler.add(data)
        return assembler.finish()


class FrameWriter:
    """Writes frames; every ``drain`` has the idle deadline (a reader that stops reading is dropped)."""

    def __init__(self, writer: asyncio.StreamWriter, *, idle_timeout: Optional[float]) -> None:
        self.writer, self.idle_timeout = writer, idle_timeout
        self.bytes_written = 0

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.writer.drain(), timeout=self.idle_timeout)
        except asyncio.TimeoutError:
            raise RpcTimeout(f"the other side read nothing for {self.idle_timeout:.1f} s") from None
        except (ConnectionError, OSError) as error:
            raise PeerUnreachable(f"stream broke while writing: {error!r}") from None

    def _put(self, kind: int, data: Any, length: int) -> None:
        self.writer.write(bytes((kind,)) + length.to_bytes(4, "big"))
        self.writer.write(data)
        self.bytes_written += FRAME_BYTES + length

    async def header(self, fields: Mapping[str, Any]) -> int:
        """Send a header frame; returns its msgpack length."""
        data = pack_header(fields)
        self._put(HEADER, data, len(data))
        await self._drain()
        return len(data)

    async def error(self, message: str) -> None:
        data = message.encode("utf-8")[: MAX_HEADER_BYTES]
        self._put(ERROR, data, len(data))
        await self._drain()

    async def body(self, body: Any, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Send ``body`` (bytes-like, e.g. a memoryview of a tensor's storage) in chunk frames."""
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        view = memoryview(body).cast("B")
        for offset in range(0, len(view), chunk_bytes):
            piece = view[offset : offset + chunk_bytes]
            self._put(CHUNK, piece, len(piece))
            await self._drain()


class BodyAssembler:
    """Receives chunks into a buffer of exactly ``expected`` bytes, allocated up front only after the
    caller has checked the header (so ``expected`` is derived from the local model size)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.buffer = bytearray(expected)
        self.received = 0

    @property
    def missing(self) -> int:
        return self.expected - self.received

    def add(self, chunk: bytes) -> None:
        end = self.received + len(chunk)
        if end > self.expected:
            raise ProtocolError(f"body exceeds the {self.expected} bytes announced by the header")
        self.buffer[self.received : end] = chunk
        self.received = end

    def finish(self) -> bytearray:
        if self.received != self.expected:
            raise ProtocolError(f"stream ended after {self.received} of {self.expected} body bytes")
        return self.buffer
