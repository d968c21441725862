"""The compiled sign decoder (asyncloco/transport/native.py, kernels/sign_decode.c): built once into the cache,
bit for bit the numpy decoder's values (signs of zero included), the numpy decoder when there is no compiler or
``ASYNCLOCO_NATIVE=0``, and its arguments checked before C touches memory."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncloco.transport import native
from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, sign_params

SIGNS = [c for c in CODECS if c.startswith("sgn")]


def needs_compiler() -> None:
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine: the compiled decoder is not built (the numpy one is tested)")


def both(encoded: EncodedTensor, numel: int, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    compiled = decode(encoded, numel, out=torch.full((numel,), 7.0))
    with monkeypatch.context() as patch:
        patch.setenv("ASYNCLOCO_NATIVE", "0")
        reference = decode(encoded, numel, out=torch.full((numel,), 7.0))
    return compiled, reference


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", SIGNS)
def test_compiled_decoder_equals_numpy_bit_for_bit(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_compiler()
    assert native.sign_kernel() is not None
    p, q = sign_params(codec)
    generator = np.random.default_rng(q * 10 + p)
    # every rotation, random bits, scales with zeros (a 1 bit under a zero scale decodes to -0.0 in both)
    numel = 40 * 512
    for rotation in range(q):
        bits = generator.integers(0, 2, size=numel // q * p, dtype=np.uint8)
        scales = generator.uniform(0.0, 3.0, size=numel // 512).astype(np.float32)
        scales[::5] = 0.0
        meta = np.array([rotation], "<u4").tobytes() + torch.from_numpy(scales).to(torch.bfloat16).view(
            torch.int16).numpy().astype("<i2").tobytes()
        body = EncodedTensor(codec, numel, np.packbits(bits, bitorder="little").tobytes(), meta)
        compiled, reference = both(body, numel, monkeypatch)
        assert torch.equal(compiled.view(torch.int32), reference.view(torch.int32)), (codec, rotation)
        assert bool((compiled.view(torch.int32) == int(np.float32(-0.0).view(np.int32))).any())  # -0.0 present
    # encoded tensors: a short last block, and a body large enough to be decoded in threaded ranges
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for size in (1, 511, 513, 16 * 65536 + 1000):
            x = torch.randn(size, generator=torch.Generator().manual_seed(size))
            compiled, reference = both(encode(codec, x), size, monkeypatch)
            assert torch.equal(compiled.view(torch.int32), reference.view(torch.int32)), (codec, size)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_the_kernel_is_built_once_into_the_cache(tmp_path: Path) -> None:
    needs_compiler()
    first = native.build(native.SIGN_SOURCE, tmp_path)
    assert first.parent == tmp_path and first.suffix == ".so" and first.stat().st_size > 0
    stamp = first.stat().st_mtime_ns
    assert native.build(native.SIGN_SOURCE, tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [first.name]
    # a source that does not compile: the compiler's complaint, nothing left in the cache
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undefined_name; }\n")
    with pytest.raises(RuntimeError, match=r"(?s)compiling broken.c with .* failed: .*undefined_name"):
        native.build(broken, tmp_path / "other")
    assert [p.name for p in (tmp_path / "other").iterdir() if not p.name.startswith(".")] == []


@pytest.mark.timeout(60)
def test_without_a_compiler_the_numpy_decoder_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_sign", None)
    monkeypatch.setenv("ASYNCLOCO_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler .* on the PATH; set CC or install one"):
        native.build(native.SIGN_SOURCE)
    with caplog.at_level(logging.WARNING, logger="asyncloco.transport.native"):
        assert native.sign_kernel() is None
    assert "decoding with numpy instead" in caplog.text
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    decoded = decode(encode("sgn15of16", x), 5000)
    scales = (np.frombuffer(bytes(encode("sgn15of16", x).meta[4:]), "<u2").astype(np.uint32) << 16).view(np.float32)
    assert float(decoded.abs().max()) == float(scales.max())  # decoded (by numpy): ± a block scale or 0
    monkeypatch.setenv("ASYNCLOCO_NATIVE", "0")
    assert not native.enabled()


@pytest.mark.timeout(60)
def test_kernel_arguments_are_checked_before_the_call() -> None:
    needs_compiler()
    kernel = native.sign_kernel()
    assert kernel is not None
    packed = np.zeros(60, dtype=np.uint8)  # one block of sgn15of16: 480 bits
    scales = np.ones(1, dtype=np.float32)
    with pytest.raises(ValueError, match="1 blocks need 512 values and 60 bytes, got 511 and 60"):
        native.sign_decode_blocks(kernel, packed, np.zeros(511, dtype=np.float32), scales, 15, 16, 0)
    with pytest.raises(ValueError, match="1 blocks need 512 values and 60 bytes, got 512 and 59"):
        native.sign_decode_blocks(kernel, packed[:59], np.zeros(512, dtype=np.float32), scales, 15, 16, 0)
    with pytest.raises(ValueError, match="C-contiguous float32 array, got float64"):
        native.sign_decode_blocks(kernel, packed, np.zeros(512), scales, 15, 16, 0)
    with pytest.raises(ValueError, match="refused p=15 q=16 rotation=16"):
        native.sign_decode_blocks(kernel, packed, np.zeros(512, dtype=np.float32), scales, 15, 16, 16)
    with pytest.raises(ValueError, match="refused p=2 q=4"):  # a shape the kernel does not have
        native.sign_decode_blocks(kernel, np.zeros(32, dtype=np.uint8), np.zeros(512, dtype=np.float32), scales, 2, 4, 0)
    out = np.zeros(512, dtype=np.float32)
    native.sign_decode_blocks(kernel, packed, out, scales, 15, 16, 3)
    expected = np.ones(512, dtype=np.float32)
    expected[2::16] = 0.0  # rotation 3 keeps (3 + t) mod 16, t < 15: position 2 of each group is dropped
    assert np.array_equal(out, expected)
