"""Message framing of the coordinator RPCs: msgpack headers, chunked bodies, exact byte accounting.

Every RPC uses hivemind's ``runtime_pb2.ExpertRequest`` / ``ExpertResponse`` protobufs, never pickle:

- a *header* message carries a msgpack map in ``metadata`` (at most :data:`MAX_HEADER_BYTES`);
- a *chunk* message carries one ``Tensor`` whose ``buffer`` holds up to ``chunk_bytes`` of the body
  (the codec's ``meta || payload``, see :meth:`EncodedTensor.to_bytes`); no other field is set.

Bytes on a hivemind stream per message = 1 (marker) + 8 (length) + protobuf size, so for a body of
``B`` bytes cut into chunks of ``c_i`` bytes after a header of ``h`` msgpack bytes:

    stream_bytes = (9 + 1 + varint(h) + h) + Σ_i (9 + 2 + varint(c_i) + varint(1 + varint(c_i) + c_i) + c_i)

which is ``B + 17`` per full 1 MiB chunk (:func:`stream_bytes`). ``submit``'s ``ready`` and ack messages
are stream frames too (9 + protobuf size each). A streaming *request* is followed by hivemind's own 9-byte
end-of-stream frame, not counted here. Unary messages (``assign`` both ways, the ``get_model`` request)
are counted as their protobuf size; p2pd's persistent connection adds its own small envelope. libp2p's
yamux/noise framing below all of this is not counted.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator

import msgpack
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from google.protobuf.message import Message

from asyncloco.transport.errors import ProtocolError

__all__ = [
    "CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_HEADER_BYTES",
    "FRAME_BYTES",
    "pack_header",
    "unpack_header",
    "chunk_messages",
    "chunk_buffer",
    "framed_size",
    "stream_bytes",
    "varint_size",
    "BodyAssembler",
]

CHUNK_BYTES = 1 << 20  # 1 MiB: 17 B framing per chunk (0.002 %); small enough to interleave streams
MAX_CHUNK_BYTES = 4 << 20  # a receiver refuses bigger chunks (hivemind has already read them, see docs)
MAX_HEADER_BYTES = 64 << 10
FRAME_BYTES: int = 1 + int(P2P.HEADER_LEN)  # hivemind's message marker + big-endian length


def varint_size(value: int) -> int:
    """Bytes of a protobuf varint."""
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def framed_size(message: Message) -> int:
    """Bytes hivemind writes on a stream for ``message``."""
    return FRAME_BYTES + int(message.ByteSize())


def stream_bytes(header_len: int, body_len: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Exact framed bytes of one header of ``header_len`` msgpack bytes plus a body cut into chunks."""
    total = FRAME_BYTES + 1 + varint_size(header_len) + header_len
    for offset in range(0, body_len, chunk_bytes):
        chunk = min(chunk_bytes, body_len - offset)
        tensor = 1 + varint_size(chunk) + chunk
        total += FRAME_BYTES + 1 + varint_size(tensor) + tensor
    return total


def pack_header(fields: Dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(fields, use_bin_type=True)
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


def chunk_buffer(message: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse) -> bytes:
    """The body bytes of a chunk message, refusing anything that is not exactly one bounded buffer."""
    if len(message.tensors) != 1 or message.metadata:
        raise ProtocolError("expected a chunk message (one tensor buffer, no metadata)")
    buffer: bytes = message.tensors[0].buffer
    if len(buffer) > MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk of {len(buffer)} bytes exceeds {MAX_CHUNK_BYTES}")
    return buffer


def chunk_messages(body: bytes, message_type: type, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Cut ``body`` into chunk messages of ``message_type`` (ExpertRequest or ExpertResponse)."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    view = memoryview(body)
    for offset in range(0, len(view), chunk_bytes):
        yield message_type(tensors=[runtime_pb2.Tensor(buffer=bytes(view[offset : offset + chunk_bytes]))])


class BodyAssembler:
    """Receives chunk messages into a buffer of exactly ``expected`` bytes, allocated up front only
    after the caller has checked the header (so ``expected`` is derived from the local model size)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.buffer = bytearray(expected)
        self.received = 0

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
