"""Codecs: exact sizes, round trips against torch references, strict validation on decode."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncloco.transport.codecs import (
    CODECS,
    INT4_BLOCKSIZE,
    INT8_BLOCKSIZE,
    EncodedTensor,
    all_finite,
    decode,
    encode,
    meta_bytes,
    wire_bytes,
)
from asyncloco.transport.errors import CodecError, TransportError

SIZES = [1, 2, 3, 255, 256, 257, 4095, 4096, 4097, 100_003]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", SIZES)
def test_encoded_size_is_the_closed_form(codec: str, numel: int) -> None:
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    encoded = encode(codec, tensor)
    assert encoded.nbytes == wire_bytes(codec, numel) == len(encoded.to_bytes())
    assert len(encoded.meta) == meta_bytes(codec, numel)
    expected = {
        "none": 4 * numel,
        "fp16": 2 * numel,
        "bf16": 2 * numel,
        "int8": numel + 4 * math.ceil(numel / INT8_BLOCKSIZE),
        "int4": (numel + 1) // 2 + 4 * math.ceil(numel / INT4_BLOCKSIZE),
    }[codec]
    assert wire_bytes(codec, numel) == expected
    decoded = decode(EncodedTensor.from_bytes(codec, numel, encoded.to_bytes()), numel)
    assert decoded.dtype == torch.float32 and decoded.shape == (numel,)
    assert torch.equal(decoded, decode(encoded, numel))


@pytest.mark.timeout(30)
def test_float_codecs_match_torch_casts_exactly() -> None:
    tensor = torch.randn(10_001, generator=torch.Generator().manual_seed(0)) * 100
    assert torch.equal(decode(encode("none", tensor), tensor.numel()), tensor)
    assert torch.equal(decode(encode("fp16", tensor), tensor.numel()), tensor.half().float())
    assert torch.equal(decode(encode("bf16", tensor), tensor.numel()), tensor.bfloat16().float())


@pytest.mark.timeout(30)
def test_quantized_codecs_match_bitsandbytes_and_error_bounds() -> None:
    import bitsandbytes.functional as bnbf

    for numel in (300_000, 4097):  # the odd size exercises the padded fast path of the int4 decoder
        tensor = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        q8, s8 = bnbf.quantize_blockwise(tensor, blocksize=INT8_BLOCKSIZE)
        assert torch.equal(decode(encode("int8", tensor), numel), bnbf.dequantize_blockwise(q8, s8))
        q4, s4 = bnbf.quantize_4bit(tensor, blocksize=INT4_BLOCKSIZE, quant_type="nf4")
        reference4 = bnbf.dequantize_4bit(q4, s4).reshape(-1)  # bitsandbytes' own (slow) odd-length path
        assert torch.equal(decode(encode("int4", tensor), numel), reference4)
    # Relative L2 error on Gaussian data (measured 0.0130 and 0.0987); loose bounds catch a wrong table.
    for codec, bound in (("int8", 0.02), ("int4", 0.12)):
        decoded = decode(encode(codec, tensor), tensor.numel())
        assert float((decoded - tensor).norm() / tensor.norm()) < bound


@pytest.mark.timeout(10)
def test_decode_rejects_before_allocating() -> None:
    tensor = torch.randn(1000)
    encoded = encode("int8", tensor)
    with pytest.raises(CodecError, match="numel"):
        decode(encoded, 999)
    with pytest.raises(CodecError, match="unknown codec"):
        decode(EncodedTensor("int3", 1000, encoded.payload, encoded.meta), 1000)
    with pytest.raises(CodecError, match="expected payload"):
        decode(EncodedTensor("int8", 1000, bytes(encoded.payload)[:-1], encoded.meta), 1000)
    with pytest.raises(CodecError, match="expected payload"):
        decode(EncodedTensor("int8", 1000, encoded.payload, b""), 1000)
    with pytest.raises(CodecError, match="needs"):
        EncodedTensor.from_bytes("none", 1000, b"\x00" * 3999)
    # A huge declared numel is refused by the comparison, not by a failed allocation.
    with pytest.raises(CodecError, match="numel"):
        decode(EncodedTensor("none", 2**40, b"", b""), 1000)
    nan_absmax = EncodedTensor("int8", 1000, encoded.payload, b"\x00\x00\xc0\x7f")  # one NaN block scale
    with pytest.raises(CodecError, match="absmax"):
        decode(nan_absmax, 1000)
    assert issubclass(CodecError, TransportError) and issubclass(CodecError, ValueError)


@pytest.mark.timeout(10)
def test_encode_rejects_bad_input() -> None:
    with pytest.raises(CodecError, match="unknown codec"):
        encode("fp8", torch.zeros(4))
    with pytest.raises(CodecError, match="flat fp32"):
        encode("none", torch.zeros(2, 2))
    with pytest.raises(CodecError, match="flat fp32"):
        encode("none", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(CodecError, match="numel"):
        encode("none", torch.zeros(0))
    with pytest.raises(CodecError, match="fp16 range"):
        encode("fp16", torch.tensor([1e5]))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_never_crosses_the_wire(bad: float) -> None:
    clean = torch.randn(10_000)
    dirty = clean.clone()
    dirty[1234] = bad
    for codec in CODECS:  # an honest peer never sends a NaN: encode refuses it and counts it
        with pytest.raises(CodecError, match="1 of 10000"):
            encode(codec, dirty)
    # A hostile sender builds the bytes itself: each float codec's payload with the bad value in it.
    raw = {
        "none": dirty.numpy().astype("<f4").tobytes(),
        "fp16": dirty.numpy().astype("<f2").tobytes(),
        "bf16": dirty.to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
    }
    for codec, payload in raw.items():
        with pytest.raises(CodecError, match=f"codec '{codec}': 1 NaN/Inf values"):
            decode(EncodedTensor(codec, 10_000, payload), 10_000)
    # int8/int4: a non-finite block scale in an otherwise valid encoding (block 1 of each).
    for codec, blocksize in (("int8", INT8_BLOCKSIZE), ("int4", INT4_BLOCKSIZE)):
        good = encode(codec, clean)
        scales = np.frombuffer(bytes(good.meta), dtype="<f4").copy()
        scales[1] = bad
        with pytest.raises(CodecError, match="non-finite block absmax"):
            decode(EncodedTensor(codec, 10_000, good.payload, scales.tobytes()), 10_000)
        assert len(scales) == math.ceil(10_000 / blocksize)


@pytest.mark.timeout(30)
def test_finite_check_is_exact_at_the_float32_limits() -> None:
    # Finite values whose sum overflows to inf are still finite: the fast path must fall back, not refuse.
    huge = torch.full((1000,), 3.0e38)
    assert torch.isinf(huge.sum())
    assert torch.equal(decode(encode("none", huge), 1000), huge)
    assert all_finite(huge) and not all_finite(torch.tensor([1.0, math.nan])) and not all_finite(torch.tensor([math.inf, -math.inf]))
    # The largest finite bf16 (0x7F7F) decodes; the smallest exponent-all-ones pattern (0x7F80 = inf) is refused.
    assert float(decode(EncodedTensor("bf16", 1, b"\x7f\x7f"), 1)) == float(torch.finfo(torch.bfloat16).max)
    with pytest.raises(CodecError, match="NaN/Inf"):
        decode(EncodedTensor("bf16", 1, b"\x80\x7f"), 1)
    assert float(decode(EncodedTensor("fp16", 1, b"\xff\x7b"), 1)) == 65504.0
    with pytest.raises(CodecError, match="NaN/Inf"):
        decode(EncodedTensor("fp16", 1, b"\x00\x7c"), 1)
