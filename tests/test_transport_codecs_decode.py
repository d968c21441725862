"""The table-lookup decoders of int2 and grp* (asyncloco/transport/codecs.py) against bodies built here
by hand — codes and scales chosen at random, packed by a plain bit-by-bit packer — with the exact values they
must give, at sizes that cross the decoder's slabs and end in short bytes, groups and blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncloco.transport.codecs import (
    DECODE_SLAB,
    GROUP_BITS,
    GROUP_SIZES,
    EncodedTensor,
    decode,
    decodes_into,
    wire_bytes,
)
from asyncloco.transport.errors import CodecError

# a slab boundary twice, then a short block of 256 (61 values) that ends inside a byte of int2 (61 = 4·15 + 1)
SIZES = [1, 6, 255, 4 * 257, DECODE_SLAB - 3, 2 * DECODE_SLAB + 256 + 61]


def bit_stream(codes: np.ndarray, width: int) -> bytes:
    """Code i at bits [i·width, (i+1)·width) of a little-endian bit stream, one bit at a time."""
    bits = ((codes[:, None].astype(np.int64) >> np.arange(width)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(bits, bitorder="little").tobytes()


def random_scales(count: int, rng: np.random.Generator) -> np.ndarray:
    scales = (rng.random(count) * 3).astype(np.float32)
    scales[rng.integers(0, count)] = 0.0  # a zero scale is valid (an all-zero block)
    return scales


@pytest.mark.timeout(60)
@pytest.mark.parametrize("numel", SIZES)
def test_int2_decodes_hand_built_bodies_to_level_times_rms(numel: int) -> None:
    rng = np.random.default_rng(numel)
    codes = rng.integers(0, 4, numel)
    rms = random_scales(-(-numel // 256), rng)
    body = EncodedTensor("int2", numel, bit_stream(codes, 2), rms.tobytes())
    # code bit 0: outer level, bit 1: negative
    levels = torch.tensor([0.4528, 1.5104, -0.4528, -1.5104], dtype=torch.float32)
    expected = levels[torch.from_numpy(codes)] * torch.from_numpy(rms).repeat_interleave(256)[:numel]
    assert torch.equal(decode(body, numel), expected)
    buffer = torch.full((numel,), 7.0)  # a reused buffer: every value is written
    assert decodes_into("int2") and decode(body, numel, out=buffer) is buffer
    assert torch.equal(buffer, expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("numel", SIZES)
def test_grouped_codecs_decode_hand_built_bodies_exactly(numel: int) -> None:
    rng = np.random.default_rng(numel + 1)
    for group in GROUP_SIZES:
        for bits in GROUP_BITS:
            name = f"grp{group}b{bits}"
            count = -(-numel // group)
            tail = numel - (count - 1) * group
            positions = rng.integers(0, group, count)
            positions[-1] = rng.integers(0, tail)  # the short last group's position is one of its values
            value_bits = rng.integers(0, 1 << bits, count)
            scales = random_scales(-(-numel // 256), rng)
            body = EncodedTensor(name, numel, bit_stream(positions << bits | value_bits, group.bit_length() - 1 + bits),
                                 scales.tobytes())
            assert len(body.payload) + len(body.meta) == wire_bytes(name, numel)
            expected = np.zeros(numel, dtype=np.float32)
            for g in range(count):  # plain loop: sign bit (bits 2: bit 1), magnitude bit (bits 2: bit 0)
                scale = float(scales[g * group // 256])
                if bits == 1:
                    value = -scale if value_bits[g] else scale
                else:
                    magnitude = scale if value_bits[g] & 1 else scale * 0.5
                    value = -magnitude if value_bits[g] & 2 else magnitude
                expected[g * group + positions[g]] = value
            got = decode(body, numel, out=torch.full((numel,), -3.0))
            assert torch.equal(got, torch.from_numpy(expected)), name
            assert int((got != 0).sum()) == int(np.count_nonzero(scales.repeat(256 // group)[:count])), name


@pytest.mark.timeout(30)
def test_refused_bodies_leave_the_buffer_untouched() -> None:
    numel = DECODE_SLAB + 258  # the last group of 4 holds two values
    rng = np.random.default_rng(9)
    buffer = torch.full((numel,), 5.0)
    # int2: an RMS so large that 1.5104 × it overflows float32 is refused like an Inf
    rms = np.ones(-(-numel // 256), dtype=np.float32)
    rms[-1] = 3.0e38
    body = EncodedTensor("int2", numel, bit_stream(rng.integers(0, 4, numel), 2), rms.tobytes())
    with pytest.raises(CodecError, match="above"):
        decode(body, numel, out=buffer)
    # grp4b1: the short last group's position 3 does not exist
    positions = rng.integers(0, 4, -(-numel // 4))
    positions[-1] = 3
    body = EncodedTensor("grp4b1", numel, bit_stream(positions << 1, 3), np.ones(-(-numel // 256), np.float32).tobytes())
    with pytest.raises(CodecError, match="last group's position 3 is not below its length 2"):
        decode(body, numel, out=buffer)
    assert torch.equal(buffer, torch.full((numel,), 5.0))
