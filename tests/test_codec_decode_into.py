"""int8 decoding into a preallocated tensor (the coordinator's ack latency at 150m).

The daemon decodes every int8 submission into a buffer it reuses, with bitsandbytes' native CPU kernel; the
result must be bitwise what bitsandbytes' own (allocating) dequantize returns, for any length (a short last
block, an odd count), and a buffer of the wrong kind is refused before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from asyncloco.transport import codecs
from asyncloco.transport.codecs import INT8_BLOCKSIZE, EncodedTensor, decode, encode
from asyncloco.transport.errors import CodecError

pytestmark = pytest.mark.timeout(60)


def reference(tensor: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    quantized, state = bnbf.quantize_blockwise(tensor, blocksize=INT8_BLOCKSIZE)
    return bnbf.dequantize_blockwise(quantized, quant_state=state).reshape(-1)


@pytest.mark.parametrize("numel", [1, 2, 3, 4095, 4096, 4097, 3 * 4096 + 1, 70_001])
def test_decode_into_a_buffer_equals_bitsandbytes_bitwise(numel: int) -> None:
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3e-3
    encoded = encode("int8", tensor)
    buffer = torch.full((numel,), float("nan"))
    out = decode(encoded, numel, buffer)
    assert out is buffer
    expected = reference(tensor)
    assert torch.equal(out, expected)
    assert torch.equal(decode(encoded, numel), expected)  # the allocating call: the same kernel, a fresh tensor
    # a reused buffer holds nothing of the previous update
    other = torch.randn(numel, generator=torch.Generator().manual_seed(numel + 1))
    assert torch.equal(decode(encode("int8", other), numel, buffer), reference(other))


def test_decode_from_a_received_body_reads_it_in_place() -> None:
    numel = 3 * INT8_BLOCKSIZE + 5
    tensor = torch.linspace(-1.0, 1.0, numel)
    body = bytearray(encode("int8", tensor).to_bytes())  # what the transport hands over
    encoded = EncodedTensor.from_bytes("int8", numel, memoryview(body))
    assert torch.equal(decode(encoded, numel, torch.empty(numel)), reference(tensor))


def test_without_the_native_kernel_the_fallback_gives_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    numel = 2 * INT8_BLOCKSIZE + 3
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(codecs, "_int8_cpu_kernel", lambda: None)
    assert torch.equal(decode(encode("int8", tensor), numel, torch.empty(numel)), reference(tensor))


def test_a_wrong_buffer_is_refused_before_anything_is_written() -> None:
    encoded = encode("int8", torch.ones(100))
    for bad in (torch.zeros(99), torch.zeros(100, dtype=torch.float64), torch.zeros(200)[::2], torch.zeros(10, 10)):
        before = bad.clone()
        with pytest.raises(CodecError, match=r"out must be a contiguous fp32 CPU tensor of shape \(100,\)"):
            decode(encoded, 100, bad)
        assert torch.equal(bad, before)
    with pytest.raises(CodecError, match=r"implemented for int8, int2, topk\*, grp\* and sgn\* only, not 'bf16'"):
        decode(encode("bf16", torch.ones(100)), 100, torch.zeros(100))
