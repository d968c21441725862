"""The sign codecs ``sgn{p}of{q}`` (the table is in asyncloco/transport/codecs.py, the measurements in
docs/compression.md): one bit per kept value, no positions on the wire.

In every group of ``q`` consecutive values the ``p`` positions ``(r + t) mod q`` (t = 0 .. p − 1) are kept, for a
rotation ``r`` the encoder derives from the data (so every position is kept in ``p / q`` of the rounds on
average, and the decoder reads ``r`` from the body instead of any index). A kept value is sent as its sign; each
block of 512 values (whole groups: ``q`` divides 512) has one bfloat16 scale

    s = min(Σ x² / Σ_kept |x|,  (q / p) · max |x|)      (0 when nothing kept is non-zero)

so the decoded block ``x̂`` (``± s`` at the kept positions, 0 elsewhere) has the same projection on ``x`` as
``x`` itself (``⟨x̂, x⟩ = ‖x‖²``): the update is not shrunk, only noisier. The cap keeps a block whose mass sits
entirely in its dropped positions from producing a huge value. Meant to be used with error feedback
(asyncloco/train/feedback.py, ``runtime.error_feedback_decay`` 0.5: measured in docs/compression.md).

Body: meta = ``r`` (uint32 LE) then the bf16 LE scales (round to nearest from fp32; 1/16 bit per value); payload = the sign bits (1 = negative) of the kept
positions, group by group and ascending inside a group, packed first bit in the lowest bit of a byte. Kept
positions past ``numel`` (a short last group) and the padding of the last byte are zero bits; the decoder
refuses anything else, a rotation ≥ q and a negative or non-finite scale.

Decoding: the whole 512-value blocks go to the compiled one-pass decoder (asyncloco/transport/native.py,
kernels/sign_decode.c) where the machine has a C compiler, else to the numpy decoder below (the same values, bit for
bit); the short last block and every check stay here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from asyncloco.transport.codec_format import EncodedTensor, SIGN_BLOCK, sign_params, wire_bytes
from asyncloco.transport.errors import CodecError
from asyncloco.transport.native import sign_decode_blocks, sign_kernel

F32_MAX = float(np.finfo(np.float32).max)
SLAB = 1 << 16  # values decoded per pass: whole scale blocks, whole groups and whole bytes of sign bits
# a byte of sign bits → its 8 unit values (bit 0 first), the decoder's look-up table
_SIGN_TABLE = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1 == 1, -1.0, 1.0).astype(np.float32)


def kept_columns(p: int, q: int, rotation: int) -> np.ndarray:
    """The kept positions inside a group of ``q``, ascending."""
    return np.sort((rotation + np.arange(p)) % q)


def rotation_of(tensor: torch.Tensor, q: int) -> int:
    """The rotation the encoder uses: the sum of the values' fp32 bit patterns mod ``q`` (deterministic for the
    same input, and it moves from round to round with the data)."""
    if q == 1:
        return 0
    return int(tensor.view(torch.int32).sum(dtype=torch.int64)) % q


def rotation_in(decoded: torch.Tensor, name: str) -> Optional[int]:
    """The rotation a decoded ``name`` tensor was encoded with: the columns (index mod q) holding a non-zero value are
    the kept ones. None when nothing is non-zero or no rotation keeps them all. A verifier of another compute class
    encodes its re-run with the peer's rotation (coordinator/rerun.py): the rotation hashes every bit of the data,
    so the last-bit differences between classes would otherwise move every kept position."""
    p, q = sign_params(name)
    if q == 1:
        return 0
    numel = decoded.numel() - decoded.numel() % q
    if numel == 0:
        return None
    seen = (decoded[:numel].view(-1, q) != 0).any(dim=0).numpy()
    if not seen.any():
        return None
    for rotation in range(q):
        kept = np.zeros(q, dtype=bool)
        kept[kept_columns(p, q, rotation)] = True
        if not (seen & ~kept).any():
            return rotation
    return None


def encode_sign(name: str, tensor: torch.Tensor, rotation: Optional[int] = None) -> EncodedTensor:
    """``rotation``: the kept positions' rotation (default: :func:`rotation_of` the data, as every peer encodes)."""
    p, q = sign_params(name)
    numel = tensor.numel()
    if rotation is None:
        rotation = rotation_of(tensor, q)
    elif not 0 <= rotation < q:
        raise CodecError(f"codec {name!r}: rotation {rotation} is not below the group size {q}")
    rows = -(-numel // SIGN_BLOCK)
    blocks = torch.zeros(rows * SIGN_BLOCK, dtype=torch.float32)
    blocks[:numel] = tensor
    blocks = blocks.view(rows, SIGN_BLOCK)
    keep_group = torch.zeros(q, dtype=torch.bool)
    keep_group[torch.from_numpy(kept_columns(p, q, rotation))] = True
    keep = keep_group.repeat(SIGN_BLOCK // q)
    magnitude = blocks.abs()
    energy = blocks.double().square().sum(dim=1)
    kept_mass = magnitude[:, keep].double().sum(dim=1)
    cap = magnitude.max(dim=1).values.double() * (q / p)
    scale = torch.where(kept_mass > 0, torch.minimum(energy / kept_mass.clamp(min=1e-300), cap), torch.zeros_like(cap))
    bits = (blocks[:, keep] < 0).reshape(-1)[: -(-numel // q) * p]  # the padding's kept positions are 0 (not < 0)
    payload = np.packbits(bits.numpy(), bitorder="little").tobytes()
    scale16 = scale.float().to(torch.bfloat16).view(torch.int16).numpy().astype("<i2")
    meta = np.array([rotation], dtype="<u4").tobytes() + scale16.tobytes()
    encoded = EncodedTensor(name, numel, payload=payload, meta=meta)
    assert encoded.nbytes == wire_bytes(name, numel), (name, numel, encoded.nbytes)
    return encoded


def decode_sign(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    name, numel = encoded.codec, encoded.numel
    p, q = sign_params(name)
    meta = memoryview(encoded.meta)
    rotation = int(np.frombuffer(meta[:4], dtype="<u4")[0])
    if rotation >= q:
        raise CodecError(f"codec {name!r}: rotation {rotation} is not below the group size {q}")
    scale = (np.frombuffer(meta[4:], dtype="<u2").astype(np.uint32) << 16).view(np.float32)  # exact widening
    if not bool((np.isfinite(scale) & (scale >= 0)).all()):
        raise CodecError(f"codec {name!r}: a block scale is negative, NaN or Inf")
    packed = np.frombuffer(encoded.payload, dtype=np.uint8)
    columns = kept_columns(p, q, rotation)
    dropped = np.setdiff1d(np.arange(q), columns)
    values = out.numpy()
    whole = numel - numel % SIGN_BLOCK

    kernel = sign_kernel()

    def decode_range(first: int, last: int) -> None:
        if kernel is not None:  # the compiled one-pass decoder (asyncloco/transport/native.py), same values
            sign_decode_blocks(kernel, packed[first * p // q // 8 : last * p // q // 8], values[first:last],
                               scale[first // SIGN_BLOCK : last // SIGN_BLOCK], p, q, rotation)
            return
        for start in range(first, last, SLAB):
            stop = min(start + SLAB, last)  # a multiple of 512: whole groups, and start · p / q whole bytes
            _decode_slab(packed[start * p // q // 8 : -(-stop * p // q // 8)], values[start:stop], scale, start,
                         p, q, columns, dropped)

    # numpy releases the GIL: a large body is decoded in torch.get_num_threads() disjoint ranges of whole slabs
    parts = max(1, min(torch.get_num_threads(), os.cpu_count() or 1, whole // (8 * SLAB)))
    bounds = [whole * i // parts // SLAB * SLAB for i in range(parts)] + [whole]
    if parts == 1:
        decode_range(0, whole)
    else:
        # the calling thread decodes the first range itself: one thread fewer competing for the cores
        rest = [_pool().submit(decode_range, bounds[i], bounds[i + 1]) for i in range(1, parts)]
        decode_range(bounds[0], bounds[1])
        for future in rest:
            future.result()
    if whole < numel:
        _decode_tail(name, packed[whole * p // q // 8 :], values, scale[-1], numel - whole, p, q, columns, dropped)
    return out


def _decode_tail(name: str, packed: np.ndarray, values: np.ndarray, scale: np.float32, length: int, p: int, q: int,
                 columns: np.ndarray, dropped: np.ndarray) -> None:
    """The short last block (``length`` < 512 values, its first bit byte-aligned): its kept positions at or past
    ``length`` and the padding bits must be 0."""
    groups = -(-length // q)
    signs = np.unpackbits(packed, bitorder="little")
    positions = np.arange(groups)[:, None] * q + columns[None, :]  # (groups, p), in bit order
    if signs[groups * p :].any() or signs[: groups * p].reshape(groups, p)[positions >= length].any():
        raise CodecError(f"codec {name!r}: bits set past the last kept value (a position past numel, or padding)")
    padded = np.empty(groups * q, dtype=np.float32)
    _place(padded, 1.0 - 2.0 * signs[: groups * p].astype(np.float32), p, q, columns, dropped)
    values[-length:] = padded[:length] * scale


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="sgn-decode")
    return _POOL


def _place(values: np.ndarray, units: np.ndarray, p: int, q: int, columns: np.ndarray, dropped: np.ndarray) -> None:
    """Write the kept unit values into their positions of ``values`` (a whole number of groups), zero the rest."""
    if p == q:
        values[:] = units
        return
    grid = values.reshape(-1, q)
    grid[:, columns] = units.reshape(-1, p)
    grid[:, dropped] = 0.0


def _decode_slab(packed: np.ndarray, values: np.ndarray, scale: np.ndarray, start: int, p: int, q: int,
                 columns: np.ndarray, dropped: np.ndarray) -> None:
    units = np.take(_SIGN_TABLE, packed, axis=0).reshape(-1)[: values.size * p // q]
    _place(values, units, p, q, columns, dropped)
    rows = values.reshape(-1, SIGN_BLOCK)
    first = start // SIGN_BLOCK
    np.multiply(rows, scale[first : first + rows.shape[0], None], out=rows)
