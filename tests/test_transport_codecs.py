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
    group_params,
    meta_bytes,
    topk_params,
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
        "int2": (numel + 3) // 4 + 4 * math.ceil(numel / 256),
    }.get(codec)
    if expected is None and codec.startswith("grp"):  # one (log2 G + b)-bit code per group of G, fp32 scale per 256
        group, bits = group_params(codec)
        expected = math.ceil(math.ceil(numel / group) * (int(math.log2(group)) + bits) / 8) + 4 * math.ceil(numel / 256)
    if expected is None and codec.startswith("sgn"):  # one sign bit per kept value; rotation + bf16 scale per 512
        p, q = (int(v) for v in codec[3:].split("of"))
        expected = math.ceil(math.ceil(numel / q) * p / 8) + 4 + 2 * math.ceil(numel / 512)
    if expected is None:  # topk{k}b{b}: k uint8 indices and k b-bit codes per chunk of 256, one fp32 scale per chunk
        k, bits = topk_params(codec)
        kept = k * (numel // 256) + min(k, numel % 256)
        expected = kept + math.ceil(kept * bits / 8) + 4 * math.ceil(numel / 256)
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


@pytest.mark.timeout(180)  # bitsandbytes' first import probes the machine in subprocesses: 30 s ran out under load
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


# --- int2 and the sparse topk{k}b{b} codecs ---------------------------------------------------------


def int2_reference(x: torch.Tensor) -> torch.Tensor:
    """Per block of 256: levels ±0.4528σ / ±1.5104σ split at 0.9816σ, σ the block's RMS (plain loops)."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), 256):
        block = x[start : start + 256].double()
        sigma = float(block.square().mean().sqrt().float())
        for i, v in enumerate(block.tolist()):
            magnitude = 1.5104 if abs(v) > 0.9816 * sigma else 0.4528
            out[start + i] = (-magnitude if v < 0 else magnitude) * sigma
    return out


def topk_reference(x: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Per chunk of 256: keep the k largest |x|; each becomes sign · (m + 1)/L · max|x|, L = 2^(b-1), m the
    nearest level; everything else 0."""
    levels = 2 ** (bits - 1)
    out = torch.zeros_like(x)
    for start in range(0, x.numel(), 256):
        chunk = x[start : start + 256]
        scale = float(chunk.abs().max())
        for i in torch.topk(chunk.abs(), min(k, chunk.numel())).indices.tolist():
            m = min(max(round(abs(float(chunk[i])) / scale * levels) - 1, 0), levels - 1)
            out[start + i] = math.copysign((m + 1) / levels * scale, float(chunk[i]))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [1, 3, 255, 257, 300, 1000])
def test_int2_and_topk_match_plain_references(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    assert torch.allclose(decode(encode("int2", x), numel), int2_reference(x), rtol=1e-6, atol=0)
    for codec in ("topk1b2", "topk8b2", "topk16b4", "topk64b2"):
        k, bits = topk_params(codec)
        got = decode(encode(codec, x), numel)
        assert torch.allclose(got, topk_reference(x, k, bits), rtol=1e-6, atol=0), codec
        assert int((got != 0).sum()) == k * (numel // 256) + min(k, numel % 256)


@pytest.mark.timeout(30)
def test_sparse_decode_into_a_reused_buffer_zeroes_it_first() -> None:
    x = torch.randn(5000)
    encoded = encode("topk4b2", x)
    buffer = torch.full((5000,), 7.0)
    assert decode(encoded, 5000, out=buffer) is buffer
    assert torch.equal(buffer, decode(encoded, 5000))


def _sparse_body(codec: str, numel: int) -> tuple[EncodedTensor, bytearray]:
    encoded = encode(codec, torch.randn(numel, generator=torch.Generator().manual_seed(3)))
    return encoded, bytearray(encoded.payload)


@pytest.mark.timeout(30)
def test_malformed_sparse_and_int2_bodies_are_refused() -> None:
    numel = 256 * 3 + 100  # three full chunks and a short one
    encoded, payload = _sparse_body("topk4b2", numel)
    payload[0], payload[1] = payload[1], payload[0]  # chunk 0's indices out of order
    with pytest.raises(CodecError, match="strictly increasing within each chunk"):
        decode(EncodedTensor("topk4b2", numel, bytes(payload), encoded.meta), numel)
    encoded, payload = _sparse_body("topk4b2", numel)
    payload[1] = payload[0]  # a duplicate index
    with pytest.raises(CodecError, match="strictly increasing"):
        decode(EncodedTensor("topk4b2", numel, bytes(payload), encoded.meta), numel)
    encoded, payload = _sparse_body("topk4b2", numel)
    payload[3 * 4 + 3] = 100  # the short chunk holds positions 0..99 only
    with pytest.raises(CodecError, match="below 100"):
        decode(EncodedTensor("topk4b2", numel, bytes(payload), encoded.meta), numel)
    for codec in ("topk4b2", "int2"):
        good = encode(codec, torch.randn(numel))
        for bad in (math.nan, math.inf, -1.0):
            scales = np.frombuffer(bytes(good.meta), dtype="<f4").copy()
            scales[2] = bad
            with pytest.raises(CodecError, match="negative, NaN or Inf"):
                decode(EncodedTensor(codec, numel, good.payload, scales.tobytes()), numel)
        with pytest.raises(CodecError, match="expected payload"):
            decode(EncodedTensor(codec, numel, bytes(good.payload)[:-1], good.meta), numel)
    with pytest.raises(CodecError, match="topk\\{k\\}b\\{bits\\}"):
        topk_params("topk3b2")  # k = 3 is not in the registry
    with pytest.raises(CodecError, match="unknown codec"):
        wire_bytes("topk3b2", 1000)


@pytest.mark.timeout(30)
def test_sparse_compression_ratios_at_150m() -> None:
    numel = 151_000_000
    ratios = {c: 4 * numel / wire_bytes(c, numel) for c in ("int2", "topk16b2", "topk8b2", "topk4b2", "topk2b2")}
    # per 256 values: 1024 B of fp32 vs 64 + 4, 16 + 4 + 4, 8 + 2 + 4, 4 + 1 + 4, 2 + 0.5 + 4 bytes
    for codec, per_chunk in (("int2", 68), ("topk16b2", 24), ("topk8b2", 14), ("topk4b2", 9), ("topk2b2", 6.5)):
        assert ratios[codec] == pytest.approx(1024 / per_chunk, rel=1e-5)


def group_reference(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per group of G: only the largest |x| survives. 1 bit: its sign × the mean kept |x| of its block of 256;
    2 bits: sign × (max kept |x| of the block, or half of it when |x| ≤ 0.75 × that max)."""
    out = torch.zeros_like(x)
    kept = [(start + int(x[start : start + group].abs().argmax())) for start in range(0, x.numel(), group)]
    per_block = 256 // group
    for b in range(0, len(kept), per_block):
        members = kept[b : b + per_block]
        magnitudes = [abs(float(x[i])) for i in members]
        for i, m in zip(members, magnitudes):
            if bits == 1:
                value = float(torch.tensor(magnitudes, dtype=torch.float64).mean().float())
            else:
                top = max(magnitudes)
                value = top if top > 0 and m / top > 0.75 else top * 0.5
            out[i] = -value if float(x[i]) < 0 else value
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", [1, 3, 255, 257, 1001])
def test_grouped_codecs_match_a_plain_reference(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    for codec in ("grp4b1", "grp4b2", "grp8b1", "grp32b2"):
        group, bits = group_params(codec)
        got = decode(encode(codec, x), numel)
        assert torch.allclose(got, group_reference(x, group, bits), rtol=1e-6, atol=0), codec
        buffer = torch.full((numel,), 3.0)
        assert torch.equal(decode(encode(codec, x), numel, out=buffer), got)


@pytest.mark.timeout(30)
def test_malformed_grouped_bodies_are_refused() -> None:
    numel = 256 + 2  # the last group of 4 holds two values: positions 2 and 3 do not exist
    good = encode("grp4b1", torch.randn(numel))
    payload = bytearray(good.payload)
    last = 64  # group 64 is the short one: its 3-bit code (2-bit position, sign) starts at bit 192 = byte 24
    assert len(payload) == math.ceil(65 * 3 / 8)
    payload[24] = (payload[24] & ~0b110) | (3 << 1)  # position 3
    with pytest.raises(CodecError, match="last group's position 3 is not below its length 2"):
        decode(EncodedTensor("grp4b1", numel, bytes(payload), good.meta), numel)
    assert last * 3 == 192
    for bad in (math.nan, -math.inf, -2.0):
        scales = np.frombuffer(bytes(good.meta), dtype="<f4").copy()
        scales[0] = bad
        with pytest.raises(CodecError, match="negative, NaN or Inf"):
            decode(EncodedTensor("grp4b1", numel, good.payload, scales.tobytes()), numel)
    with pytest.raises(CodecError, match="grp\\{G\\}b\\{bits\\}"):
        group_params("grp6b1")
