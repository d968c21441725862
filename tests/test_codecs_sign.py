"""The sign codecs sgn{p}of{q} (asyncloco/transport/codecs_sign.py): exact values against a reference
written here from the format's definition, hand-built bodies, every malformed body refused, and the decayed error
feedback (asyncloco/train/feedback.py) they are used with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncloco.train.feedback import ErrorFeedback
from asyncloco.transport import native
from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, sign_params, wire_bytes
from asyncloco.transport.codecs_sign import rotation_of
from asyncloco.transport.errors import CodecError

SIGNS = [c for c in CODECS if c.startswith("sgn")]


@pytest.fixture(params=["native", "numpy"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both decoders: the compiled one (asyncloco/transport/native.py; skipped without a C compiler) and numpy's."""
    if request.param == "native":
        if native.sign_kernel() is None:
            pytest.skip("no compiled sign decoder on this machine (no C compiler): the numpy decoder is tested")
    else:
        monkeypatch.setenv("ASYNCLOCO_NATIVE", "0")
    return str(request.param)


def reference(x: torch.Tensor, p: int, q: int, rotation: int) -> torch.Tensor:
    """The format's definition, value by value (float64 sums, then one bf16 scale per 512 values)."""
    out = torch.zeros(x.numel(), dtype=torch.float32)
    for start in range(0, x.numel(), 512):
        block = x[start : start + 512].double()
        kept = [i for i in range(block.numel()) if ((start + i) % q - rotation) % q < p]
        mass = float(block[kept].abs().sum())
        cap = float(block.abs().max()) * q / p
        scale32 = torch.tensor(min(float(block.square().sum()) / mass, cap) if mass > 0 else 0.0, dtype=torch.float32)
        scale = float(scale32.to(torch.bfloat16).float())  # sent as bfloat16
        for i in kept:
            out[start + i] = float(-scale if block[i] < 0 else scale)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", SIGNS)
def test_decoded_values_are_the_definition_exactly(codec: str, decoder: str) -> None:
    p, q = sign_params(codec)
    gen = torch.Generator().manual_seed(7)
    for numel in (1, 5, 17, 255, 512, 513, 1000, 2 * 65536 + 300):
        x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)
        x[::7] = 0.0  # zeros: sent as +s
        encoded = encode(codec, x)
        assert encoded.nbytes == wire_bytes(codec, numel)
        rotation = int(np.frombuffer(bytes(encoded.meta[:4]), "<u4")[0])
        assert rotation == rotation_of(x, q) < q
        decoded = decode(EncodedTensor.from_bytes(codec, numel, encoded.to_bytes()), numel)
        expected = reference(x, p, q, rotation) if numel < 5000 else None
        if expected is not None:
            assert torch.equal(decoded, expected), (codec, numel)
        out = torch.full((numel,), 9.0)
        assert torch.equal(decode(encoded, numel, out=out), decoded) and torch.equal(out, decoded)
        # kept exactly p of every q positions (the rest zero), and the projection on x is ‖x‖² where no cap binds
        nonzero = (decoded != 0).reshape(-1)
        assert int(nonzero.sum()) <= -(-numel // q) * p
    big = torch.randn(65536 * 3, generator=gen)
    decoded = decode(encode(codec, big), big.numel())
    blocks, values = big.double().view(-1, 512), decoded.double().view(-1, 512)
    assert torch.allclose((blocks * values).sum(1), blocks.square().sum(1), rtol=2**-8)  # up to the bf16 rounding


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", SIGNS)
def test_every_rotation_decodes_bits_and_scales_to_their_places(codec: str, decoder: str) -> None:
    """Bodies built from random sign bits and scales, for every rotation of the shape: each value is the sign of
    its bit × its block's scale at a kept position, 0 at a dropped one (the decoder's runs of kept columns,
    one or two per group, against the definition value by value)."""
    p, q = sign_params(codec)
    numel = 3 * 512 + 512  # whole blocks (the slab path), several of them
    generator = np.random.default_rng(q * 100 + p)
    for rotation in range(q):
        bits = generator.integers(0, 2, size=numel // q * p, dtype=np.uint8)
        scales = generator.uniform(0.5, 2.0, size=numel // 512).astype(np.float32)
        scale16 = torch.from_numpy(scales).to(torch.bfloat16)
        meta = np.array([rotation], "<u4").tobytes() + scale16.view(torch.int16).numpy().astype("<i2").tobytes()
        payload = np.packbits(bits, bitorder="little").tobytes()
        decoded = decode(EncodedTensor(codec, numel, payload, meta), numel)
        columns = sorted((rotation + t) % q for t in range(p))
        expected = torch.zeros(numel, dtype=torch.float32)
        for i in range(numel):
            group, column = divmod(i, q)
            if column in columns:
                bit = bits[group * p + columns.index(column)]
                expected[i] = (-1.0 if bit else 1.0) * float(scale16[i // 512].float())
        assert torch.equal(decoded, expected), (codec, rotation)


def test_a_hand_built_body_decodes_to_its_values() -> None:
    # 9 values, sgn1of2, rotation 1: positions 1, 3, 5, 7 kept (the last group's position 9 is past numel: bit 0)
    meta = np.array([1], "<u4").tobytes() + np.array([0x3F00], "<u2").tobytes()  # bf16 0.5
    body = EncodedTensor("sgn1of2", 9, bytes([0b0010]), meta)  # position 3 negative
    assert torch.equal(decode(body, 9), torch.tensor([0, 0.5, 0, -0.5, 0, 0.5, 0, 0.5, 0], dtype=torch.float32))
    # sgn3of4, rotation 3: positions 0, 1, 3 of each group of 4 (bit order: ascending positions)
    meta = np.array([3], "<u4").tobytes() + np.array([0x4000], "<u2").tobytes()
    body = EncodedTensor("sgn3of4", 8, bytes([0b100001]), meta)
    assert torch.equal(decode(body, 8), torch.tensor([-2, 2, 0, 2, 2, 2, 0, -2], dtype=torch.float32))


@pytest.mark.timeout(30)
def test_malformed_bodies_are_refused() -> None:
    good = encode("sgn1of2", torch.randn(9, generator=torch.Generator().manual_seed(3)))
    rotation2 = np.array([2], "<u4").tobytes() + bytes(good.meta[4:])
    with pytest.raises(CodecError, match="rotation 2 is not below the group size 2"):
        decode(EncodedTensor("sgn1of2", 9, good.payload, rotation2), 9)
    for bad in (float("nan"), float("inf"), -1.0):
        meta = bytes(good.meta[:4]) + torch.tensor([bad]).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        with pytest.raises(CodecError, match="scale is negative, NaN or Inf"):
            decode(EncodedTensor("sgn1of2", 9, good.payload, meta), 9)
    meta = np.array([1], "<u4").tobytes() + np.array([0x3F80], "<u2").tobytes()  # bf16 1.0
    for payload in (bytes([0b10000]), bytes([0b100000])):  # position 9 (past numel), then a padding bit
        with pytest.raises(CodecError, match="bits set past the last kept value"):
            decode(EncodedTensor("sgn1of2", 9, payload, meta), 9)
    with pytest.raises(CodecError, match="expected payload 1 B and meta 6 B"):
        decode(EncodedTensor("sgn1of2", 9, b"\x00\x00", meta), 9)
    with pytest.raises(CodecError, match="'sgn2of4' is not a sign codec; expected one of sgn1of1, sgn15of16, sgn7of8"):
        sign_params("sgn2of4")


@pytest.mark.timeout(30)
def test_error_feedback_carries_the_decayed_residual() -> None:
    gen = torch.Generator().manual_seed(5)
    deltas = [torch.randn(3000, generator=gen) for _ in range(3)]
    feedback = ErrorFeedback("sgn3of4", decay=0.5)
    residual = torch.zeros(3000)
    for delta in deltas:
        corrected = delta + 0.5 * residual
        expected = decode(encode("sgn3of4", corrected), 3000)
        assert torch.equal(feedback.roundtrip(delta), expected)
        feedback.settle(True)
        residual = corrected - expected
        assert feedback.residual is not None and torch.equal(feedback.residual, residual)
    with pytest.raises(ValueError, match=r"decay must be in \(0, 1\], got 0"):
        ErrorFeedback("sgn3of4", decay=0.0)


@pytest.mark.timeout(60)
def test_a_large_body_decodes_the_same_in_threads(decoder: str) -> None:
    numel = 16 * 65536 * 2 + 777  # past the threaded decoder's threshold, with a short last block
    x = torch.randn(numel, generator=torch.Generator().manual_seed(11))
    encoded = encode("sgn7of8", x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(encoded, numel)
        torch.set_num_threads(2)
        two = decode(encoded, numel)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    # vectorised definition: kept positions (rotation), signs, one bf16 scale per 512 values
    rotation = int(np.frombuffer(bytes(encoded.meta[:4]), "<u4")[0])
    kept = ((torch.arange(numel) % 8 - rotation) % 8) < 7
    scales = torch.from_numpy((np.frombuffer(bytes(encoded.meta[4:]), "<u2").astype(np.uint32) << 16).view(np.float32))
    expected = torch.where(x < 0, -1.0, 1.0) * scales.repeat_interleave(512)[:numel] * kept
    assert torch.equal(one, expected)


@pytest.mark.timeout(30)
def test_every_codec_name_fits_the_wire() -> None:
    from asyncloco.transport.codec_format import CODEC_NAME_MAX
    from asyncloco.transport.wire import SubmitHeader

    assert max(len(name) for name in CODECS) <= CODEC_NAME_MAX
    header = SubmitHeader(lease_id="l", base_version=0, codec="sgn15of16", numel=10)
    assert SubmitHeader.from_wire(header.to_wire()).codec == "sgn15of16"  # the 9-character name crosses the wire


@pytest.mark.parametrize("codec", [c for c in CODECS if c.startswith("sgn")])
def test_the_rotation_is_read_off_a_decoded_upload_and_can_be_imposed(codec: str) -> None:
    """A verifier of another compute class re-encodes its re-run with the peer's rotation (coordinator/rerun.py):
    the rotation hashes every bit, so a last-bit difference moves every kept position (a relative error of 0.37 on
    a 1e-6 perturbation here) — with the peer's rotation the two decode to the same values."""
    from asyncloco.transport.codecs_sign import rotation_in

    p, q = sign_params(codec)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(5))
    upload = decode(encode(codec, x), x.numel())
    assert rotation_in(upload, codec) == rotation_of(x, q)
    for rotation in range(q):  # every imposed rotation decodes to the definition at that rotation, and is read back
        imposed = decode(encode(codec, x, sign_rotation=rotation), x.numel())
        assert rotation_in(imposed, codec) == rotation
        assert int((imposed.view(-1, q) != 0).any(dim=0).sum()) == p
    nearby = x * (1 + 1e-6 * torch.randn(x.numel(), generator=torch.Generator().manual_seed(6)))
    if q > 1 and rotation_of(nearby, q) != rotation_of(x, q):
        moved = decode(encode(codec, nearby), x.numel())
        assert float((moved - upload).norm() / upload.norm()) > 0.1
    matched = decode(encode(codec, nearby, sign_rotation=rotation_in(upload, codec)), x.numel())
    assert float((matched - upload).norm() / upload.norm()) < 1e-3
    assert rotation_in(torch.zeros(64), codec) == (0 if q == 1 else None)  # q = 1: one rotation only
    with pytest.raises(CodecError, match="is not below the group size"):
        encode(codec, x, sign_rotation=q)
    with pytest.raises(CodecError, match="sign_rotation is for the sign codecs"):
        encode("int8", x, sign_rotation=0)
