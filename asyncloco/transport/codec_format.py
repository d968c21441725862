"""The wire format of the codecs (asyncloco/transport/codecs.py has the table and encode/decode): the codec names,
their parameters and exact sizes (a closed form of ``numel``), :class:`EncodedTensor`, and the input checks."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from asyncloco.transport.errors import CodecError

if sys.byteorder != "little":  # the raw formats below are little-endian views of native tensors
    raise ImportError("asyncloco.transport.codecs supports little-endian hosts only")

TOPK_CHUNK = 256  # a local index fits one byte
TOPK_KS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # values kept per chunk of 256 (density 0.4 % .. 25 %)
TOPK_BITS: tuple[int, ...] = (2, 4)  # bits per kept value: a sign and (b - 1) magnitude bits
INT2_BLOCKSIZE = 256
GROUP_SIZES: tuple[int, ...] = (4, 8, 16, 32)  # grp{G}b{B}: the largest |x| of every G values
GROUP_BITS: tuple[int, ...] = (1, 2)  # 1: its sign (magnitude = the block's mean kept |x|); 2: sign + magnitude bit
GROUP_BLOCK = 256  # values per fp32 scale
# sgn{p}of{q}: the signs of p of every q values, no positions (codecs_sign.py); q divides the 512-value scale block.
# Not sparser than 1/2: the scale that keeps the projection grows as q/p, and sgn1of4 diverged on the toy task
# (docs/compression.md)
SIGN_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (15, 16), (7, 8), (3, 4), (5, 8), (1, 2))
SIGN_BLOCK = 512  # values per bf16 scale: 1/32 bit per value
CODECS: tuple[str, ...] = (
    ("none", "fp16", "bf16", "int8", "int4", "int2")
    + tuple(f"topk{k}b{b}" for b in TOPK_BITS for k in TOPK_KS)
    + tuple(f"grp{g}b{b}" for b in GROUP_BITS for g in GROUP_SIZES)
    + tuple(f"sgn{p}of{q}" for p, q in SIGN_SHAPES)
)
CODEC_NAME_MAX = 12  # characters: the wire's bound on a codec name (every name in CODECS fits: a test checks)
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
    if name.startswith("sgn"):
        kept, group = sign_params(name)
        return (math.ceil(numel / group) * kept + 7) // 8  # one sign bit per kept value, no positions
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
    if name.startswith("sgn"):
        return 4 + 2 * math.ceil(numel / SIGN_BLOCK)  # the rotation (uint32), then the bf16 scales
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


def sign_params(name: str) -> tuple[int, int]:
    """``(p, q)`` of a sign codec name ``sgn{p}of{q}``; :class:`CodecError` for any other name."""
    match = re.fullmatch(r"sgn([0-9]+)of([0-9]+)", name)
    if match is None or name not in CODECS:
        shapes = ", ".join(f"sgn{p}of{q}" for p, q in SIGN_SHAPES)
        raise CodecError(f"{name!r} is not a sign codec; expected one of {shapes} (the signs of p of every q values)")
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
    return name in ("int8", "int2") or name.startswith(("topk", "grp", "sgn"))


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


def _uint8_tensor(buffer: Buffer) -> torch.Tensor:
    array = np.frombuffer(buffer, dtype=np.uint8)
    if not array.flags.writeable:  # torch warns on read-only memory; bitsandbytes only reads it
        array = array.copy()
    return torch.from_numpy(array)
