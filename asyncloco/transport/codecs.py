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
| "sgn{p}of{q}" | the sign of p of every q | rotation (uint32), then bf16   | ceil(ceil(n/q)·p / 8)               |
|        | values (rotating, no indices) | Σx²/Σ_kept|x| per 512 values   | + 4 + 2·ceil(n / 512)               |

The 8-bit dynamic code book and the NF4 table are constants of bitsandbytes, not sent. Decoding never
unpickles and validates the codec name, ``numel`` against the caller's expectation, and both lengths
before it allocates the output. See docs/transport.md for why bitsandbytes and why NF4.

The sparse family ``topk{k}b{b}`` (k in :data:`TOPK_KS`, b in :data:`TOPK_BITS`; density k/256, e.g.
``topk8b2``: 8 of every 256 values, 2 bits each, ≈ 73× fewer bytes than fp32) and ``int2`` are meant
for pseudo-gradients with error feedback (asyncloco/train/feedback.py, docs/compression.md): on their
own they drop most of the update. A sparse body's local indices must be strictly increasing within each
chunk and inside the chunk (the last chunk may be short); decoding refuses anything else. ``grp{G}b{b}``
(G in :data:`GROUP_SIZES`, b in :data:`GROUP_BITS`) keeps one value per group of G: ``grp4b1`` is 36.6×.
``sgn{p}of{q}`` ((p, q) in :data:`SIGN_SHAPES`, asyncloco/transport/codecs_sign.py) sends one bit per kept value
and no positions: ``sgn15of16`` is 33.0×, ``sgn1of2`` 60.2×.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from asyncloco.transport.codec_format import (  # noqa: F401 (re-exported)
    all_finite,
    Buffer,
    CODECS,
    decodes_into,
    EncodedTensor,
    FP16_MAX,
    GROUP_BITS,
    group_params,
    GROUP_SIZES,
    INT2_BLOCKSIZE,
    INT4_BLOCKSIZE,
    INT8_BLOCKSIZE,
    LOSSLESS,
    MAX_NUMEL,
    meta_bytes,
    sign_params,
    SIGN_SHAPES,
    TOPK_BITS,
    TOPK_CHUNK,
    TOPK_KS,
    topk_params,
    value_bytes,
    wire_bytes,
    _check_codec_and_numel,
    _check_input,
    _count_non_finite,
    _uint8_tensor,
)
from asyncloco.transport.codecs_sparse import (  # noqa: F401 (re-exported)
    DECODE_SLAB,
    _decode_group,
    _decode_int2,
    _decode_topk,
    _encode_group,
    _encode_int2,
    _encode_topk,
)
from asyncloco.transport.codecs_sign import decode_sign, encode_sign
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
    "SIGN_SHAPES",
    "sign_params",
]


def encode(name: str, tensor: torch.Tensor, *, sign_rotation: int | None = None) -> EncodedTensor:
    """Encode a flat fp32 CPU tensor. Raises :class:`CodecError` on a bad codec or tensor, and on any
    NaN/Inf value (an honest peer never sends one; the receiver refuses them at decode anyway).
    ``sign_rotation``: for the sign codecs, the kept positions' rotation to use instead of the data's own (a
    cross-class verifier re-encodes with the peer's: asyncloco/coordinator/rerun.py).

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
    if name.startswith("sgn"):
        return encode_sign(name, tensor, sign_rotation)
    if sign_rotation is not None:
        raise CodecError(f"sign_rotation is for the sign codecs, not {name!r}")

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


# --- int8 decoding into a preallocated tensor (the coordinator's ack latency) -----------------------
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
        raise CodecError(f"decode(out=...) is implemented for int8, int2, topk*, grp* and sgn* only, not {name!r}; leave out=None")
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

    if name == "int2" or name.startswith(("topk", "grp", "sgn")):
        if out is None:
            out = torch.empty(numel, dtype=torch.float32)
        else:
            _check_out(out, numel)
        if name == "int2":
            return _decode_int2(encoded, out)
        if name.startswith("sgn"):
            return decode_sign(encoded, out)
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
