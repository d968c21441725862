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

The 8-bit dynamic code book and the NF4 table are constants of bitsandbytes, not sent. Decoding never
unpickles and validates the codec name, ``numel`` against the caller's expectation, and both lengths
before it allocates the output. See docs/transport.md for why bitsandbytes and why NF4.
"""

from __future__ import annotations

import logging
import math
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
]

if sys.byteorder != "little":  # the raw formats below are little-endian views of native tensors
    raise ImportError("asyncloco.transport.codecs supports little-endian hosts only")

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "int8", "int4")
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
    return (numel + 1) // 2  # int4: two values per byte


def meta_bytes(name: str, numel: int) -> int:
    """Bytes of per-block fp32 absmax (zero for the float codecs)."""
    _check_codec_and_numel(name, numel)
    if name == "int8":
        return 4 * math.ceil(numel / INT8_BLOCKSIZE)
    if name == "int4":
        return 4 * math.ceil(numel / INT4_BLOCKSIZE)
    return 0


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


def decode(encoded: EncodedTensor, expected_numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode to a new flat fp32 tensor of ``expected_numel`` elements (for int8, into ``out`` when given: a
    preallocated contiguous fp32 tensor of that size, which is returned).

    Validates, before allocating: the codec name, ``encoded.numel == expected_numel``, and the exact
    lengths of payload and meta. Raises :class:`CodecError` when the result would hold a NaN or Inf:
    for int8/int4 a non-finite block absmax (the code books are finite, so finite scales give finite
    values), for none/fp16/bf16 a non-finite value. A NaN on the wire never becomes a finite number.
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
    if out is not None and name != "int8":
        raise CodecError(f"decode(out=...) is implemented for codec 'int8' only, not {name!r}; leave out=None")
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

    absmax = torch.from_numpy(np.frombuffer(encoded.meta, dtype="<f4").copy())
    if not bool(torch.isfinite(absmax).all()):
        raise CodecError(f"codec {name!r}: non-finite block absmax in payload")
    if name == "int8":
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (numel,) or not out.is_contiguous() or out.device.type != "cpu":
            raise CodecError(
                f"out must be a contiguous fp32 CPU tensor of shape ({numel},), got dtype={out.dtype} "
                f"shape={tuple(out.shape)}; allocate it with torch.empty({numel})"
            )
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
