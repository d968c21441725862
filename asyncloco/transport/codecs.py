"""Codecs for flat fp32 vectors (θ and pseudo-gradients) on the wire.

Every codec turns a 1-D contiguous fp32 CPU tensor of ``numel`` elements into an :class:`EncodedTensor`
whose size is a closed form of ``numel`` alone (:func:`wire_bytes`), so a receiver knows the exact byte
count from the header before it allocates anything, and benchmarks can assert bytes on the wire.

| name   | values                        | meta (per block, fp32 LE)      | wire_bytes(numel)                  |
|--------|-------------------------------|--------------------------------|------------------------------------|
| "none" | fp32 little-endian            | -                              | 4·n                                |
| "fp16" | IEEE half, round-to-nearest   | -                              | 2·n                                |
| "bf16" | bfloat16, round-to-nearest    | -                              | 2·n                                |
| "int8" | bitsandbytes blockwise 8-bit, | absmax per 4096 values         | n + 4·ceil(n / 4096)               |
|        | dynamic map                   |                                |                                    |
| "int4" | bitsandbytes blockwise NF4,   | absmax per 256 values          | ceil(n / 2) + 4·ceil(n / 256)      |
|        | two values per byte           |                                |                                    |

| "int2" | 2-bit Lloyd-Max levels for a   | RMS per 256 values             | ceil(n / 4) + 4·ceil(n / 256)      |
|        | Gaussian: ±0.4528σ, ±1.510σ   |                                |                                    |
| "topk{k}b{b}" | per chunk of 256 values the | max kept |x| per chunk        | K + ceil(K·b / 8) + 4·chunks       |
|        | k largest |x| (uint8 local    |                                | K = k·full chunks + min(k, tail)   |
|        | index), b-bit sign+magnitude  |                                |                                    |
| "grp{G}b{b}" | per group of G values the | mean (b=1) or max (b=2) kept   | ceil(ceil(n/G)·(log2 G + b) / 8)    |
|        | largest |x|: position + b bits | |x| per 256 values             | + 4·ceil(n / 256)                  |

The 8-bit dynamic code book and the NF4 table are constants of bitsandbytes, not sent. Decoding never
unpickles and validates the codec name, ``numel`` against the caller's expectation, and both lengths
before it allocates the output. See docs/transport.md for why bitsandbytes and why NF4.

The sparse family ``topk{k}b{b}`` (k in :data:`TOPK_KS`, b in :data:`TOPK_BITS`; density k/256, e.g.
``topk8b2``: 8 of every 256 values, 2 bits each, ≈ 73× fewer bytes than fp32) and ``int2`` are meant
for pseudo-gradients with error feedback (asyncloco/peer/feedback.py, docs/compression.md): on their
own they drop most of the update. A sparse body's local indices must be strictly increasing within each
chunk and inside the chunk (the last chunk may be short); decoding refuses anything else. ``grp{G}b{b}``
(G in :data:`GROUP_SIZES`, b in :data:`GROUP_BITS`) keeps one value per group of G: ``grp4b1`` is 36.6×.
"""

from __future__ import annotations

import logging
import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from asyncloco.transport.errors import CodecError

logger = logging.getLogger(__name__)

__all__ = [
    "CODECS",
    "INT8_BLOCKSIZE",
    "INT4_BLOCKSIZE",
    "MAX_NUMEL",
    "EncodedTensor",
    "Buffer",
    "encode",
    "decode",
    "wire_bytes",
    "meta_bytes",
    "value_bytes",
    "all_finite",
    "TOPK_CHUNK",
    "TOPK_KS",
    "TOPK_BITS",
    "INT2_BLOCKSIZE",
    "LOSSLESS",
    "decodes_into",
    "topk_params",
    "group_params",
    "GROUP_SIZES",
    "GROUP_BITS",
    "DECODE_SLAB",
]

if sys.byteorder != "little":  # the raw formats below are little-endian views of native tensors
    raise ImportError("asyncloco.transport.codecs supports little-endian hosts only")

TOPK_CHUNK = 256  # a local index fits one byte
TOPK_KS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # values kept per chunk of 256 (density 0.4 % .. 25 %)
TOPK_BITS: tuple[int, ...] = (2, 4)  # bits per kept value: a sign and (b - 1) magnitude bits
INT2_BLOCKSIZE = 256
GROUP_SIZES: tuple[int, ...] = (4, 8, 16, 32)  # grp{G}b{B}: the largest |x| of every G values
GROUP_BITS: tuple[int, ...] = (1, 2)  # 1: its sign (magnitude = the block's mean kept |x|); 2: sign + magnitude bit
GROUP_BLOCK = 256  # values per fp32 scale
CODECS: tuple[str, ...] = (
    ("none", "fp16", "bf16", "int8", "int4", "int2")
    + tuple(f"topk{k}b{b}" for b in TOPK_BITS for k in TOPK_KS)
    + tuple(f"grp{g}b{b}" for b in GROUP_BITS for g in GROUP_SIZES)
)
LOSSLESS: tuple[str, ...] = ("none",)  # every other codec drops something: error feedback applies
# Lloyd-Max 4-level quantizer of a unit Gaussian (levels ±0.4528, ±1.510; threshold 0.9816), times the block RMS
INT2_INNER, INT2_OUTER, INT2_THRESHOLD = 0.4528, 1.5104, 0.9816
INT8_BLOCKSIZE = 4096  # bitsandbytes' default for blockwise 8-bit; absmax overhead 0.1 %
INT4_BLOCKSIZE = 256  # NF4: 3 % absmax overhead; relative error 0.099 vs 0.092 at blocksize 64 (12.5 % overhead)
MAX_NUMEL = 2**31 - 1  # bitsandbytes kernels index with int32
FP16_MAX = 65504.0

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class EncodedTensor:
    """A flat fp32 vector in wire form. ``meta`` holds per-block absmax (fp32 LE) for int8/int4."""

    codec: str
    numel: int
    payload: Buffer
    meta: Buffer = b""

    @property
    def nbytes(self) -> int:
        return len(self.payload) + len(self.meta)

    def to_bytes(self) -> bytes:
        """The stream body: ``meta`` then ``payload``; exactly ``wire_bytes(codec, numel)`` long."""
        if not self.meta:  # float codecs: no concatenation copy (θ in fp32 can be hundreds of MB)
            return self.payload if isinstance(self.payload, bytes) else bytes(self.payload)
        return bytes(self.meta) + bytes(self.payload)

    @classmethod
    def from_bytes(cls, codec: str, numel: int, body: Buffer) -> EncodedTensor:
        """Split a stream body back into meta and payload, checking its length first."""
        expected = wire_bytes(codec, numel)
        if len(body) != expected:
            raise CodecError(f"codec {codec!r} with numel={numel} needs {expected} bytes, got {len(body)}")
        view = memoryview(body)
        split = meta_bytes(codec, numel)
        return cls(codec=codec, numel=numel, payload=view[split:], meta=view[:split])


def _check_codec_and_numel(name: str, numel: int) -> None:
    if name not in CODECS:
        raise CodecError(f"unknown codec {name!r}; expected one of {CODECS}")
    if isinstance(numel, bool) or not isinstance(numel, int) or not 1 <= numel <= MAX_NUMEL:
        raise CodecError(f"numel must be an int in [1, {MAX_NUMEL}], got {numel!r}")


def value_bytes(name: str, numel: int) -> int:
    """Bytes of the encoded values alone (no absmax)."""
    _check_codec_and_numel(name, numel)
    if name == "none":
        return 4 * numel
    if name in ("fp16", "bf16"):
        return 2 * numel
    if name == "int8":
        return numel
    if name == "int4":
        return (numel + 1) // 2  # two values per byte
    if name == "int2":
        return (numel + 3) // 4  # four values per byte
    if name.startswith("grp"):
        group, bits = group_params(name)
        return (math.ceil(numel / group) * (_log2(group) + bits) + 7) // 8  # one (position, value) code per group
    k, bits = topk_params(name)
    kept = _topk_kept(k, numel)
    return kept + (kept * bits + 7) // 8  # uint8 local indices, then the packed codes


def meta_bytes(name: str, numel: int) -> int:
    """Bytes of per-block fp32 absmax (zero for the float codecs)."""
    _check_codec_and_numel(name, numel)
    if name == "int8":
        return 4 * math.ceil(numel / INT8_BLOCKSIZE)
    if name == "int4":
        return 4 * math.ceil(numel / INT4_BLOCKSIZE)
    if name == "int2":
        return 4 * math.ceil(numel / INT2_BLOCKSIZE)
    if name.startswith("topk"):
        return 4 * math.ceil(numel / TOPK_CHUNK)
    if name.startswith("grp"):
        return 4 * math.ceil(numel / GROUP_BLOCK)
    return 0


def _log2(group: int) -> int:
    return group.bit_length() - 1


def group_params(name: str) -> tuple[int, int]:
    """``(group, bits)`` of a grouped codec name ``grp{G}b{B}``; :class:`CodecError` for any other name."""
    match = re.fullmatch(r"grp([0-9]+)b([0-9])", name)
    if match is None or name not in CODECS:
        raise CodecError(
            f"{name!r} is not a grouped codec; expected grp{{G}}b{{bits}} with G in {GROUP_SIZES} and bits in "
            f"{GROUP_BITS} (e.g. grp8b1: the largest of every 8 values, its sign)"
        )
    return int(match.group(1)), int(match.group(2))


def topk_params(name: str) -> tuple[int, int]:
    """``(k, bits)`` of a sparse codec name ``topk{k}b{bits}``; :class:`CodecError` for any other name."""
    match = re.fullmatch(r"topk([0-9]+)b([0-9])", name)
    if match is None or name not in CODECS:
        raise CodecError(
            f"{name!r} is not a sparse codec; expected topk{{k}}b{{bits}} with k in {TOPK_KS} and bits in {TOPK_BITS} "
            "(e.g. topk8b2: 8 of every 256 values, 2 bits each)"
        )
    return int(match.group(1)), int(match.group(2))


def _topk_kept(k: int, numel: int) -> int:
    """Values kept: k per full chunk of 256, min(k, tail) in a short last chunk."""
    full, tail = divmod(numel, TOPK_CHUNK)
    return k * full + min(k, tail)


def decodes_into(name: str) -> bool:
    """Whether :func:`decode` can write into a caller's preallocated buffer (``out=``) for codec ``name``."""
    return name in ("int8", "int2") or name.startswith(("topk", "grp"))


def wire_bytes(name: str, numel: int) -> int:
    """Exact encoded size of a ``numel``-element vector under codec ``name`` (values + meta)."""
    return value_bytes(name, numel) + meta_bytes(name, numel)


def _check_input(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.float32 or tensor.dim() != 1 or tensor.device.type != "cpu":
        raise CodecError(
            f"expected a flat fp32 CPU tensor, got dtype={tensor.dtype} shape={tuple(tensor.shape)} "
            f"device={tensor.device}; flatten with torch.nn.utils.parameters_to_vector(...).cpu()"
        )


def all_finite(tensor: torch.Tensor) -> bool:
    """True iff every value of a float tensor is finite, in one pass and without a tensor-sized temporary.

    A NaN or ±Inf anywhere makes the sum NaN or ±Inf, so a finite sum proves every value finite. A
    non-finite sum can also come from finite values overflowing; only then is the exact element check run.
    """
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def _count_non_finite(tensor: torch.Tensor) -> int:
    return int((~torch.isfinite(tensor)).sum())


def encode(name: str, tensor: torch.Tensor) -> EncodedTensor:
    """Encode a flat fp32 CPU tensor. Raises :class:`CodecError` on a bad codec or tensor, and on any
    NaN/Inf value (an honest peer never sends one; the receiver refuses them at decode anyway).

    ``fp16`` refuses values beyond ±65504 (they would silently become inf): use ``bf16`` for such data.
    """
    _check_input(tensor)
    numel = tensor.numel()
    _check_codec_and_numel(name, numel)
    tensor = tensor.contiguous()
    if not all_finite(tensor):
        raise CodecError(
            f"refusing to encode a tensor with NaN or Inf values ({_count_non_finite(tensor)} of {numel}); "
            "the training step diverged: lower the inner learning rate or check the data"
        )
    if name == "none":
        return EncodedTensor(name, numel, tensor.numpy().tobytes())
    if name == "fp16":
        if numel and float(tensor.abs().max()) > FP16_MAX:
            raise CodecError("values exceed the fp16 range (±65504); use codec 'bf16' or 'none'")
        return EncodedTensor(name, numel, tensor.to(torch.float16).numpy().tobytes())
    if name == "bf16":
        return EncodedTensor(name, numel, tensor.to(torch.bfloat16).view(torch.int16).numpy().tobytes())

    if name == "int2":
        return _encode_int2(tensor)
    if name.startswith("topk"):
        return _encode_topk(name, tensor)
    if name.startswith("grp"):
        return _encode_group(name, tensor)

    import bitsandbytes.functional as bnbf  # imported lazily: it logs a kernel notice at import on CPU

    if name == "int8":
        quantized, state = bnbf.quantize_blockwise(tensor, blocksize=INT8_BLOCKSIZE)
    else:
        quantized, state = bnbf.quantize_4bit(tensor, blocksize=INT4_BLOCKSIZE, quant_type="nf4")
    encoded = EncodedTensor(
        name,
        numel,
        payload=quantized.contiguous().numpy().tobytes(),
        meta=state.absmax.to(torch.float32).contiguous().numpy().tobytes(),
    )
    assert encoded.nbytes == wire_bytes(name, numel), (name, numel, encoded.nbytes)
    return encoded



# --- 2-bit and sparse codecs (issue 18): pure torch, vectorised ----------------------------------------------


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    """Pack uint8 codes of ``bits`` bits (2 or 4), first code in the lowest bits of each byte."""
    per_byte = 8 // bits
    padded = torch.zeros(-(-codes.numel() // per_byte) * per_byte, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    grouped = padded.view(-1, per_byte)
    packed = grouped[:, 0].clone()
    for slot in range(1, per_byte):
        packed |= grouped[:, slot] << (bits * slot)
    return packed.numpy().tobytes()


def _unpack(buffer: Buffer, count: int, bits: int) -> torch.Tensor:
    """The first ``count`` codes of a packed buffer, as uint8 (inverse of :func:`_pack`)."""
    per_byte = 8 // bits
    packed = _uint8_tensor(buffer)
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (bits * slot)) & mask for slot in range(per_byte)], dim=1).reshape(-1)
    return codes[:count]


def _padded_blocks(tensor: torch.Tensor, block: int, fill: float) -> torch.Tensor:
    numel = tensor.numel()
    rows = -(-numel // block)
    if rows * block == numel:
        return tensor.view(rows, block)
    padded = torch.full((rows * block,), fill, dtype=torch.float32)
    padded[:numel] = tensor
    return padded.view(rows, block)


def _encode_int2(tensor: torch.Tensor) -> EncodedTensor:
    numel = tensor.numel()
    blocks = _padded_blocks(tensor, INT2_BLOCKSIZE, 0.0)
    # the RMS over the block's real values (padding is zero, so only the count needs correcting)
    counts = torch.full((blocks.shape[0],), float(INT2_BLOCKSIZE))
    counts[-1] = numel - (blocks.shape[0] - 1) * INT2_BLOCKSIZE
    rms = (blocks.double().square().sum(dim=1) / counts).sqrt().float()
    outer = blocks.abs() > (INT2_THRESHOLD * rms).unsqueeze(1)
    codes = (blocks < 0).to(torch.uint8) << 1 | outer.to(torch.uint8)
    encoded = EncodedTensor("int2", numel, payload=_pack(codes.reshape(-1)[:numel], 2), meta=rms.numpy().tobytes())
    assert encoded.nbytes == wire_bytes("int2", numel), (numel, encoded.nbytes)
    return encoded


# Decoding int2 and grp* is a table look-up: every packed byte (int2: four 2-bit codes) or every code (grp*: a
# position and its bits) indexes a small table of unit values (int2: 4 levels; grp*: a row of G values, zero
# but at the position), and each block of 256 is then multiplied by its scale. Both run slab by slab
# (DECODE_SLAB values: the codes, the slab of ``out`` and the temporaries stay in the CPU cache), so ``out`` is
# written once and rescaled while still cached: one pass over θ, like bitsandbytes' int8 kernel.
DECODE_SLAB = 1 << 16  # values per slab: a multiple of 256 (whole scale blocks) and of 8·32 (whole code words)
F32_MAX = float(np.finfo(np.float32).max)


def _int2_table() -> np.ndarray:
    levels = np.array([INT2_INNER, INT2_OUTER, -INT2_INNER, -INT2_OUTER], dtype=np.float32)
    byte = np.arange(256)
    return np.stack([levels[(byte >> (2 * slot)) & 3] for slot in range(4)], axis=1)  # (256, 4): a byte's 4 values


def _group_table(group: int, bits: int) -> np.ndarray:
    """(2^(log2 G + bits), G): the unit row of each code — zero but at its position, where ±1 (bits 1) or
    ±0.5/±1 (bits 2: bit 0 the magnitude, bit 1 the sign)."""
    codes = np.arange(1 << (_log2(group) + bits))
    value_bits, position = codes & ((1 << bits) - 1), codes >> bits
    if bits == 1:
        unit = np.where(value_bits == 1, -1.0, 1.0)
    else:
        unit = np.where(value_bits & 1 == 1, 1.0, 0.5) * np.where(value_bits & 2 == 2, -1.0, 1.0)
    table = np.zeros((codes.size, group), dtype=np.float32)
    table[codes, position] = unit
    return table


_TABLES: dict[str, np.ndarray] = {}


def _table(name: str) -> np.ndarray:
    if name not in _TABLES:
        _TABLES[name] = _int2_table() if name == "int2" else _group_table(*group_params(name))
    return _TABLES[name]


def _scale_slab(out: np.ndarray, scale: np.ndarray, start: int, stop: int) -> None:
    """Multiply the whole 256-value blocks of ``out[start:stop]`` (start a multiple of 256) by their scales."""
    first, last = start // GROUP_BLOCK, stop // GROUP_BLOCK
    if last > first:
        rows = out[first * GROUP_BLOCK : last * GROUP_BLOCK].reshape(-1, GROUP_BLOCK)
        np.multiply(rows, scale[first:last, None], out=rows)


def _scale_tail(out: np.ndarray, scale: np.ndarray, numel: int) -> None:
    """The short last block (numel not a multiple of 256) gets the last scale."""
    if numel % GROUP_BLOCK:
        tail = out[numel - numel % GROUP_BLOCK : numel]
        np.multiply(tail, scale[-1], out=tail)


def _decode_int2(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    numel = encoded.numel
    rms = np.frombuffer(encoded.meta, dtype="<f4")
    # finite and not negative, and small enough that the outer level (1.51 σ) stays finite
    if not bool((np.isfinite(rms) & (rms >= 0) & (rms <= F32_MAX / INT2_OUTER)).all()):
        raise CodecError(
            f"codec 'int2': a block RMS is negative, NaN or Inf, or above {F32_MAX / INT2_OUTER:.4g} "
            "(its outer level would overflow)"
        )
    packed = np.frombuffer(encoded.payload, dtype=np.uint8)
    table, values = _table("int2"), out.numpy()
    whole = numel // 4  # bytes holding four real values
    for start in range(0, 4 * whole, DECODE_SLAB):
        stop = min(start + DECODE_SLAB, 4 * whole)
        np.take(table, packed[start // 4 : stop // 4], axis=0, out=values[start:stop].reshape(-1, 4))
        _scale_slab(values, rms, start, stop)
    if numel % 4:  # the last byte's first values
        values[4 * whole :] = table[packed[whole], : numel % 4]
    _scale_tail(values, rms, numel)  # the short last block: its whole-byte part and its last values
    return out


def _encode_topk(name: str, tensor: torch.Tensor) -> EncodedTensor:
    k, bits = topk_params(name)
    numel = tensor.numel()
    magnitude = _padded_blocks(tensor.abs(), TOPK_CHUNK, -1.0)  # padding (-1) is never above a real |x|
    chunks = magnitude.shape[0]
    local = torch.topk(magnitude, min(k, TOPK_CHUNK), dim=1, sorted=False).indices.sort(dim=1).values
    kept = _topk_kept(k, numel)
    tail = numel - (chunks - 1) * TOPK_CHUNK
    if tail < k:  # a short last chunk: only its real positions (the padding's indices sort last)
        local_flat = torch.cat([local[:-1].reshape(-1), local[-1, :tail]])
    else:
        local_flat = local.reshape(-1)
    chunk_of = torch.arange(chunks).repeat_interleave(k)
    if tail < k:
        chunk_of = torch.cat([chunk_of[: (chunks - 1) * k], torch.full((tail,), chunks - 1, dtype=torch.long)])
    values = tensor[chunk_of * TOPK_CHUNK + local_flat]
    scale = magnitude.amax(dim=1).clamp(min=0.0)  # the largest |x| of each chunk is always kept
    levels = 1 << (bits - 1)  # magnitudes (m + 1) / levels · scale, m in [0, levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[chunk_of]
    magnitude_code = (values.abs() / safe * levels).round().sub(1).clamp(0, levels - 1).to(torch.uint8)
    codes = (values < 0).to(torch.uint8) << (bits - 1) | magnitude_code
    assert local_flat.numel() == kept
    encoded = EncodedTensor(
        name,
        numel,
        payload=local_flat.to(torch.uint8).numpy().tobytes() + _pack(codes, bits),
        meta=scale.numpy().tobytes(),
    )
    assert encoded.nbytes == wire_bytes(name, numel), (name, numel, encoded.nbytes)
    return encoded


def _decode_topk(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    """Scatter the kept values into ``out`` (zeroed slab by slab). Validates scales and indices before writing."""
    name, numel = encoded.codec, encoded.numel
    k, bits = topk_params(name)
    scale = torch.from_numpy(np.frombuffer(encoded.meta, dtype="<f4").copy())
    if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise CodecError(f"codec {name!r}: a chunk scale is negative, NaN or Inf")
    kept = _topk_kept(k, numel)
    payload = memoryview(encoded.payload)
    local = torch.from_numpy(np.frombuffer(payload[:kept], dtype=np.uint8).astype(np.int64))
    full, tail = divmod(numel, TOPK_CHUNK)
    # strictly increasing within each chunk (no duplicates) and inside it: a uint8 is always inside a full
    # chunk of 256; the short last chunk's indices must be below its length
    rows = local[: full * k].view(full, k)
    if k > 1 and full and not bool((rows[:, 1:] > rows[:, :-1]).all()):
        raise CodecError(f"codec {name!r}: local indices must be strictly increasing within each chunk of {TOPK_CHUNK}")
    if tail:
        last = local[full * k :]
        if bool((last >= tail).any()) or (last.numel() > 1 and not bool((last[1:] > last[:-1]).all())):
            raise CodecError(f"codec {name!r}: the last chunk's indices must be strictly increasing and below {tail}")
    # values: a table of the 2^bits unit values ((m + 1)/L, signed) indexed by each code, times its chunk's
    # scale, in (chunks, k) rows so the scale broadcasts; positions likewise chunk·256 + local index
    chunks = full + (1 if tail else 0)
    levels = 1 << (bits - 1)
    code = np.arange(1 << bits)
    unit = ((code & (levels - 1)) + 1).astype(np.float32) / levels * np.where(code >= levels, -1.0, 1.0).astype(np.float32)
    codes = np.zeros(chunks * k, dtype=np.uint8)
    codes[:kept] = _unpack(payload[kept:], kept, bits).numpy()
    values = np.take(unit, codes).reshape(chunks, k)
    values *= scale.numpy()[:, None]
    local_rows = np.zeros(chunks * k, dtype=np.int64)
    local_rows[:kept] = local.numpy()
    positions = (local_rows.reshape(chunks, k) + (np.arange(chunks, dtype=np.int64) * TOPK_CHUNK)[:, None]).reshape(-1)
    flat = values.reshape(-1)
    dense = out.numpy()
    # slab by slab: zero it and scatter its kept values while it is cached (one pass over θ, not two)
    for start in range(0, numel, DECODE_SLAB):
        stop = min(start + DECODE_SLAB, numel)
        lo, hi = start // TOPK_CHUNK * k, min(-(-stop // TOPK_CHUNK) * k, kept)  # the slab's kept values
        dense[start:stop] = 0.0
        dense[positions[lo:hi]] = flat[lo:hi]
    return out


def _pack_bits(codes: torch.Tensor, width: int) -> bytes:
    """Pack codes of ``width`` bits into a little-endian bit stream (code i at bits [i·width, (i+1)·width)):
    8 codes at a time into one 64-bit word (shifted, summed: their bits do not overlap), of which the low
    ``width`` bytes are the stream's next bytes."""
    if 8 % width == 0:
        return _pack(codes.to(torch.uint8), width)
    count = codes.numel()
    words = -(-count // 8)
    padded = np.zeros(words * 8, dtype=np.int64)
    padded[:count] = codes.numpy()
    word = (padded.reshape(words, 8) << np.arange(0, 8 * width, width, dtype=np.int64)).sum(axis=1, dtype=np.int64)
    stream = word.astype("<i8").view(np.uint8).reshape(words, 8)[:, :width].reshape(-1)
    return stream[: (count * width + 7) // 8].tobytes()


def _encode_group(name: str, tensor: torch.Tensor) -> EncodedTensor:
    group, bits = group_params(name)
    numel = tensor.numel()
    groups = _padded_blocks(tensor, group, 0.0)
    magnitude = _padded_blocks(tensor.abs(), group, -1.0)  # padding is never the largest of its group
    kept_abs, position = magnitude.max(dim=1)
    negative = groups.gather(1, position.unsqueeze(1)).squeeze(1) < 0
    per_block = GROUP_BLOCK // group
    blocks = _padded_blocks(kept_abs, per_block, 0.0)
    count = torch.full((blocks.shape[0],), float(per_block))
    count[-1] = kept_abs.numel() - (blocks.shape[0] - 1) * per_block
    if bits == 1:  # sign only: the magnitude minimising the squared error is the mean kept |x|
        scale = (blocks.double().sum(dim=1) / count).float()
        codes = negative.to(torch.uint8)
    else:  # sign and one magnitude bit: levels max/2 and max
        scale = blocks.amax(dim=1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).repeat_interleave(per_block)[: kept_abs.numel()]
        high = (kept_abs / safe) > 0.75
        codes = negative.to(torch.uint8) << 1 | high.to(torch.uint8)
    packed = _pack_bits(position.to(torch.uint8) << bits | codes, _log2(group) + bits)
    encoded = EncodedTensor(name, numel, payload=packed, meta=scale.numpy().tobytes())
    assert encoded.nbytes == wire_bytes(name, numel), (name, numel, encoded.nbytes)
    return encoded


def _code_words(buffer: Buffer, width: int) -> np.ndarray:
    """The bit stream of ``width``-bit codes as 64-bit little-endian words, one per 8 codes: word m is the 8
    bytes from byte m·width (overlapping reads; the stream is copied once with 8 zero bytes of padding)."""
    padded = np.zeros(len(buffer) + 8, dtype=np.uint8)
    padded[: len(buffer)] = np.frombuffer(buffer, dtype=np.uint8)
    words = -(-len(buffer) // width)
    return np.ndarray((words,), dtype="<i8", buffer=padded, strides=(width,))


def _unpack_words(words: np.ndarray, first: int, count: int, width: int) -> np.ndarray:
    """Codes ``first .. first + count`` (first a multiple of 8) from :func:`_code_words`, as int64: word m holds
    codes 8m .. 8m + 7 at bits 0, width, 2·width, ... (a signed right shift is harmless: the mask keeps bits
    below 8·width ≤ 56)."""
    shifts = np.arange(0, 8 * width, width, dtype=np.int64)
    codes = (words[first // 8 : first // 8 + -(-count // 8), None] >> shifts) & ((1 << width) - 1)
    return codes.reshape(-1)[:count]


def _unpack_bits(buffer: Buffer, count: int, width: int) -> torch.Tensor:
    """All ``count`` codes of a ``width``-bit stream (inverse of :func:`_pack_bits`), as uint8."""
    return torch.from_numpy(_unpack_words(_code_words(buffer, width), 0, count, width).astype(np.uint8))


def _decode_group(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    name, numel = encoded.codec, encoded.numel
    group, bits = group_params(name)
    width = _log2(group) + bits
    scale = np.frombuffer(encoded.meta, dtype="<f4")
    if not bool((np.isfinite(scale) & (scale >= 0)).all()):  # values are ±scale or ±scale/2: finite
        raise CodecError(f"codec {name!r}: a block scale is negative, NaN or Inf")
    count, whole = -(-numel // group), numel // group  # groups; groups with all G values
    words = _code_words(encoded.payload, width)
    table, values = _table(name), out.numpy()
    if whole < count:  # a short last group: its position must be one of its values (checked before writing)
        tail = numel - whole * group
        last = int(_unpack_words(words, whole - whole % 8, whole % 8 + 1, width)[-1])
        if last >> bits >= tail:
            raise CodecError(f"codec {name!r}: the last group's position {last >> bits} is not below its length {tail}")
    for start in range(0, whole * group, DECODE_SLAB):  # a full group's position is always inside it
        stop = min(start + DECODE_SLAB, whole * group)
        codes = _unpack_words(words, start // group, (stop - start) // group, width)
        np.take(table, codes, axis=0, out=values[start:stop].reshape(-1, group))
        _scale_slab(values, scale, start, stop)
    if whole < count:
        values[whole * group :] = table[last, : numel - whole * group]
    _scale_tail(values, scale, numel)
    return out

# --- int8 decoding into a preallocated tensor (issue 8: the coordinator's ack latency) -----------------------
# bitsandbytes 0.50 registers only the allocating CPU op. Its cost is mostly the fresh θ-sized allocation
# (the kernel zero-fills every page on first touch: ≈ 7 × a memcpy of the output on this 2-core VM), not
# the dequantization (≈ 2 × memcpy). So the daemon decodes into a buffer it reuses, calling bitsandbytes'
# own CPU kernel (``cdequantize_blockwise_cpu_fp32``: code[q] · absmax[block] in fp32, bitwise the same
# result) on it; a bitsandbytes without that symbol gets the allocating op and a copy.


def _decode_int8_into(payload: Buffer, absmax: np.ndarray, numel: int, out: torch.Tensor) -> None:
    import ctypes

    import bitsandbytes.functional as bnbf

    codes = np.frombuffer(payload, dtype=np.uint8, count=numel)  # read in place, never copied
    scales = np.ascontiguousarray(absmax, dtype=np.float32)
    code = _int8_code_book()
    kernel = _int8_cpu_kernel()
    if kernel is not None:
        kernel(
            ctypes.c_void_p(code.data_ptr()),
            ctypes.c_void_p(codes.ctypes.data),
            ctypes.c_void_p(scales.ctypes.data),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_longlong(INT8_BLOCKSIZE),
            ctypes.c_longlong(numel),
        )
        return
    state = bnbf.QuantState(
        absmax=torch.from_numpy(scales), shape=torch.Size([numel]), code=code, blocksize=INT8_BLOCKSIZE, dtype=torch.float32
    )
    out.copy_(bnbf.dequantize_blockwise(torch.from_numpy(codes.copy()), quant_state=state).reshape(-1))


_CODE_BOOK: torch.Tensor | None = None


def _int8_code_book() -> torch.Tensor:
    global _CODE_BOOK
    if _CODE_BOOK is None:
        import bitsandbytes.functional as bnbf

        _CODE_BOOK = bnbf.create_dynamic_map().to(torch.float32).contiguous()
    return _CODE_BOOK


def _int8_cpu_kernel() -> Any:
    """bitsandbytes' native fp32 blockwise dequantize kernel, or None when this build has none."""
    try:
        from bitsandbytes.cextension import lib
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        return None
    native = getattr(lib, "_lib", None)  # the ctypes library; absent when bitsandbytes loaded no native code
    return getattr(native, "cdequantize_blockwise_cpu_fp32", None) if native is not None else None


def _uint8_tensor(buffer: Buffer) -> torch.Tensor:
    array = np.frombuffer(buffer, dtype=np.uint8)
    if not array.flags.writeable:  # torch warns on read-only memory; bitsandbytes only reads it
        array = array.copy()
    return torch.from_numpy(array)


def _check_out(out: torch.Tensor, numel: int) -> None:
    if out.dtype != torch.float32 or out.shape != (numel,) or not out.is_contiguous() or out.device.type != "cpu":
        raise CodecError(
            f"out must be a contiguous fp32 CPU tensor of shape ({numel},), got dtype={out.dtype} "
            f"shape={tuple(out.shape)}; allocate it with torch.empty({numel})"
        )


def decode(encoded: EncodedTensor, expected_numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode to a new flat fp32 tensor of ``expected_numel`` elements (for int8 and the sparse codecs, into
    ``out`` when given: a preallocated contiguous fp32 tensor of that size, which is returned).

    Validates, before allocating: the codec name, ``encoded.numel == expected_numel``, and the exact
    lengths of payload and meta. Raises :class:`CodecError` when the result would hold a NaN or Inf:
    for int8/int4 a non-finite block absmax (the code books are finite, so finite scales give finite
    values), for int2/topk* a negative or non-finite scale (and, for topk*, indices out of order or out of
    their chunk), for none/fp16/bf16 a non-finite value. A NaN on the wire never becomes a finite number.
    """
    name, numel = encoded.codec, encoded.numel
    _check_codec_and_numel(name, expected_numel)
    if numel != expected_numel:
        raise CodecError(f"payload declares numel={numel!r}, expected {expected_numel}")
    if len(encoded.payload) != value_bytes(name, numel) or len(encoded.meta) != meta_bytes(name, numel):
        raise CodecError(
            f"codec {name!r} numel={numel}: expected payload {value_bytes(name, numel)} B and meta "
            f"{meta_bytes(name, numel)} B, got {len(encoded.payload)} B and {len(encoded.meta)} B"
        )
    if out is not None and not decodes_into(name):
        raise CodecError(f"decode(out=...) is implemented for int8, int2, topk* and grp* only, not {name!r}; leave out=None")
    if name in ("none", "fp16", "bf16"):
        if name == "none":
            values = torch.from_numpy(np.frombuffer(encoded.payload, dtype="<f4").copy())
        elif name == "fp16":
            values = torch.from_numpy(np.frombuffer(encoded.payload, dtype="<f2").astype(np.float32))
        else:
            upper = np.frombuffer(encoded.payload, dtype="<u2").astype(np.uint32) << 16  # exact widening
            values = torch.from_numpy(upper.view(np.float32))
        if not all_finite(values):
            raise CodecError(f"codec {name!r}: {_count_non_finite(values)} NaN/Inf values in payload")
        return values

    if name == "int2" or name.startswith(("topk", "grp")):
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        else:
            _check_out(out, numel)
        if name == "int2":
            return _decode_int2(encoded, out)
        return _decode_topk(encoded, out) if name.startswith("topk") else _decode_group(encoded, out)
    absmax = torch.from_numpy(np.frombuffer(encoded.meta, dtype="<f4").copy())
    if not bool(torch.isfinite(absmax).all()):
        raise CodecError(f"codec {name!r}: non-finite block absmax in payload")
    if name == "int8":
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        else:
            _check_out(out, numel)
        _decode_int8_into(encoded.payload, absmax.numpy(), numel, out)
        return out
    quantized = _uint8_tensor(encoded.payload)

    import bitsandbytes.functional as bnbf

    # int4: bitsandbytes' NF4 CPU kernel (0.50 implements only the allocating variant, no ``out=``).
    # The fast CPU kernel needs an even length; an odd numel falls back to a pure-torch path ~20x
    # slower. Decoding numel + 1 reads the same bytes and the same number of blocks (an odd numel is
    # never a multiple of the block size), so we decode one padding value and drop it.
    padded = numel + (numel % 2)
    state = bnbf.QuantState(
        absmax=absmax,
        shape=torch.Size([padded]),
        blocksize=INT4_BLOCKSIZE,
        quant_type="nf4",
        dtype=torch.float32,
    )
    # The CPU kernels return (numel,), (1, numel) or (numel, 1) depending on parity and a
    # transpose shim; the element order is the same in all of them.
    values4: torch.Tensor = bnbf.dequantize_4bit(quantized, quant_state=state)
    values4 = values4.reshape(-1)[:numel]
    assert values4.dtype == torch.float32 and values4.numel() == numel, (values4.dtype, values4.shape)
    return values4
