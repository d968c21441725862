"""The 2-bit and sparse codecs (the table is in asyncloco/transport/codecs.py, the format in
codec_format.py): ``int2``, ``topk{k}b{b}`` and ``grp{G}b{b}``, encoded in pure vectorised torch and decoded through
lookup tables in slabs, into a caller's buffer."""

from __future__ import annotations

import numpy as np
import torch

from asyncloco.transport.codec_format import (
    Buffer,
    EncodedTensor,
    GROUP_BLOCK,
    group_params,
    INT2_BLOCKSIZE,
    INT2_INNER,
    INT2_OUTER,
    INT2_THRESHOLD,
    TOPK_CHUNK,
    topk_params,
    wire_bytes,
    _log2,
    _topk_kept,
    _uint8_tensor,
)
from asyncloco.transport.errors import CodecError


# --- 2-bit and sparse codecs: pure torch, vectorised ----------------------------------------------


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    """Pack uint8 codes of ``bits`` bits (2 or 4), first code in the lowest bits of each byte."""
    per_byte = 8 // bits
    padded = torch.zeros(-(-codes.numel() // per_byte) * per_byte, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    grouped = padded.view(-1, per_byte)
    packed = grouped[:, 0].clone()
    for slot in range(1, per_byte):
        packed |= grouped[:, slot] << (bits * slot)
    return packed.numpy().tobytes()


def _unpack(buffer: Buffer, count: int, bits: int) -> torch.Tensor:
    """The first ``count`` codes of a packed buffer, as uint8 (inverse of :func:`_pack`)."""
    per_byte = 8 // bits
    packed = _uint8_tensor(buffer)
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (bits * slot)) & mask for slot in range(per_byte)], dim=1).reshape(-1)
    return codes[:count]


def _padded_blocks(tensor: torch.Tensor, block: int, fill: float) -> torch.Tensor:
    numel = tensor.numel()
    rows = -(-numel // block)
    if rows * block == numel:
        return tensor.view(rows, block)
    padded = torch.full((rows * block,), fill, dtype=torch.float32)
    padded[:numel] = tensor
    return padded.view(rows, block)


def _encode_int2(tensor: torch.Tensor) -> EncodedTensor:
    numel = tensor.numel()
    blocks = _padded_blocks(tensor, INT2_BLOCKSIZE, 0.0)
    # the RMS over the block's real values (padding is zero, so only the count needs correcting)
    counts = torch.full((blocks.shape[0],), float(INT2_BLOCKSIZE))
    counts[-1] = numel - (blocks.shape[0] - 1) * INT2_BLOCKSIZE
    rms = (blocks.double().square().sum(dim=1) / counts).sqrt().float()
    outer = blocks.abs() > (INT2_THRESHOLD * rms).unsqueeze(1)
    codes = (blocks < 0).to(torch.uint8) << 1 | outer.to(torch.uint8)
    encoded = EncodedTensor("int2", numel, payload=_pack(codes.reshape(-1)[:numel], 2), meta=rms.numpy().tobytes())
    assert encoded.nbytes == wire_bytes("int2", numel), (numel, encoded.nbytes)
    return encoded


# Decoding int2 and grp* is a table look-up: every packed byte (int2: four 2-bit codes) or every code (grp*: a
# position and its bits) indexes a small table of unit values (int2: 4 levels; grp*: a row of G values, zero
# but at the position), and each block of 256 is then multiplied by its scale. Both run slab by slab
# (DECODE_SLAB values: the codes, the slab of ``out`` and the temporaries stay in the CPU cache), so ``out`` is
# written once and rescaled while still cached: one pass over θ, like bitsandbytes' int8 kernel.
DECODE_SLAB = 1 << 16  # values per slab: a multiple of 256 (whole scale blocks) and of 8·32 (whole code words)
F32_MAX = float(np.finfo(np.float32).max)


def _int2_table() -> np.ndarray:
    levels = np.array([INT2_INNER, INT2_OUTER, -INT2_INNER, -INT2_OUTER], dtype=np.float32)
    byte = np.arange(256)
    return np.stack([levels[(byte >> (2 * slot)) & 3] for slot in range(4)], axis=1)  # (256, 4): a byte's 4 values


def _group_table(group: int, bits: int) -> np.ndarray:
    """(2^(log2 G + bits), G): the unit row of each code — zero but at its position, where ±1 (bits 1) or
    ±0.5/±1 (bits 2: bit 0 the magnitude, bit 1 the sign)."""
    codes = np.arange(1 << (_log2(group) + bits))
    value_bits, position = codes & ((1 << bits) - 1), codes >> bits
    if bits == 1:
        unit = np.where(value_bits == 1, -1.0, 1.0)
    else:
        unit = np.where(value_bits & 1 == 1, 1.0, 0.5) * np.where(value_bits & 2 == 2, -1.0, 1.0)
    table = np.zeros((codes.size, group), dtype=np.float32)
    table[codes, position] = unit
    return table


_TABLES: dict[str, np.ndarray] = {}


def _table(name: str) -> np.ndarray:
    if name not in _TABLES:
        _TABLES[name] = _int2_table() if name == "int2" else _group_table(*group_params(name))
    return _TABLES[name]


def _scale_slab(out: np.ndarray, scale: np.ndarray, start: int, stop: int) -> None:
    """Multiply the whole 256-value blocks of ``out[start:stop]`` (start a multiple of 256) by their scales."""
    first, last = start // GROUP_BLOCK, stop // GROUP_BLOCK
    if last > first:
        rows = out[first * GROUP_BLOCK : last * GROUP_BLOCK].reshape(-1, GROUP_BLOCK)
        np.multiply(rows, scale[first:last, None], out=rows)


def _scale_tail(out: np.ndarray, scale: np.ndarray, numel: int) -> None:
    """The short last block (numel not a multiple of 256) gets the last scale."""
    if numel % GROUP_BLOCK:
        tail = out[numel - numel % GROUP_BLOCK : numel]
        np.multiply(tail, scale[-1], out=tail)


def _decode_int2(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    numel = encoded.numel
    rms = np.frombuffer(encoded.meta, dtype="<f4")
    # finite and not negative, and small enough that the outer level (1.51 σ) stays finite
    if not bool((np.isfinite(rms) & (rms >= 0) & (rms <= F32_MAX / INT2_OUTER)).all()):
        raise CodecError(
            f"codec 'int2': a block RMS is negative, NaN or Inf, or above {F32_MAX / INT2_OUTER:.4g} "
            "(its outer level would overflow)"
        )
    packed = np.frombuffer(encoded.payload, dtype=np.uint8)
    table, values = _table("int2"), out.numpy()
    whole = numel // 4  # bytes holding four real values
    for start in range(0, 4 * whole, DECODE_SLAB):
        stop = min(start + DECODE_SLAB, 4 * whole)
        np.take(table, packed[start // 4 : stop // 4], axis=0, out=values[start:stop].reshape(-1, 4))
        _scale_slab(values, rms, start, stop)
    if numel % 4:  # the last byte's first values
        values[4 * whole :] = table[packed[whole], : numel % 4]
    _scale_tail(values, rms, numel)  # the short last block: its whole-byte part and its last values
    return out


def _encode_topk(name: str, tensor: torch.Tensor) -> EncodedTensor:
    k, bits = topk_params(name)
    numel = tensor.numel()
    magnitude = _padded_blocks(tensor.abs(), TOPK_CHUNK, -1.0)  # padding (-1) is never above a real |x|
    chunks = magnitude.shape[0]
    local = torch.topk(magnitude, min(k, TOPK_CHUNK), dim=1, sorted=False).indices.sort(dim=1).values
    kept = _topk_kept(k, numel)
    tail = numel - (chunks - 1) * TOPK_CHUNK
    if tail < k:  # a short last chunk: only its real positions (the padding's indices sort last)
        local_flat = torch.cat([local[:-1].reshape(-1), local[-1, :tail]])
    else:
        local_flat = local.reshape(-1)
    chunk_of = torch.arange(chunks).repeat_interleave(k)
    if tail < k:
        chunk_of = torch.cat([chunk_of[: (chunks - 1) * k], torch.full((tail,), chunks - 1, dtype=torch.long)])
    values = tensor[chunk_of * TOPK_CHUNK + local_flat]
    scale = magnitude.amax(dim=1).clamp(min=0.0)  # the largest |x| of each chunk is always kept
    levels = 1 << (bits - 1)  # magnitudes (m + 1) / levels · scale, m in [0, levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[chunk_of]
    magnitude_code = (values.abs() / safe * levels).round().sub(1).clamp(0, levels - 1).to(torch.uint8)
    codes = (values < 0).to(torch.uint8) << (bits - 1) | magnitude_code
    assert local_flat.numel() == kept
    encoded = EncodedTensor(
        name,
        numel,
        payload=local_flat.to(torch.uint8).numpy().tobytes() + _pack(codes, bits),
        meta=scale.numpy().tobytes(),
    )
    assert encoded.nbytes == wire_bytes(name, numel), (name, numel, encoded.nbytes)
    return encoded


def _decode_topk(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    """Scatter the kept values into ``out`` (zeroed slab by slab). Validates scales and indices before writing."""
    name, numel = encoded.codec, encoded.numel
    k, bits = topk_params(name)
    scale = torch.from_numpy(np.frombuffer(encoded.meta, dtype="<f4").copy())
    if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise CodecError(f"codec {name!r}: a chunk scale is negative, NaN or Inf")
    kept = _topk_kept(k, numel)
    payload = memoryview(encoded.payload)
    local = torch.from_numpy(np.frombuffer(payload[:kept], dtype=np.uint8).astype(np.int64))
    full, tail = divmod(numel, TOPK_CHUNK)
    # strictly increasing within each chunk (no duplicates) and inside it: a uint8 is always inside a full
    # chunk of 256; the short last chunk's indices must be below its length
    rows = local[: full * k].view(full, k)
    if k > 1 and full and not bool((rows[:, 1:] > rows[:, :-1]).all()):
        raise CodecError(f"codec {name!r}: local indices must be strictly increasing within each chunk of {TOPK_CHUNK}")
    if tail:
        last = local[full * k :]
        if bool((last >= tail).any()) or (last.numel() > 1 and not bool((last[1:] > last[:-1]).all())):
            raise CodecError(f"codec {name!r}: the last chunk's indices must be strictly increasing and below {tail}")
    # values: a table of the 2^bits unit values ((m + 1)/L, signed) indexed by each code, times its chunk's
    # scale, in (chunks, k) rows so the scale broadcasts; positions likewise chunk·256 + local index
    chunks = full + (1 if tail else 0)
    levels = 1 << (bits - 1)
    code = np.arange(1 << bits)
    unit = ((code & (levels - 1)) + 1).astype(np.float32) / levels * np.where(code >= levels, -1.0, 1.0).astype(np.float32)
    codes = np.zeros(chunks * k, dtype=np.uint8)
    codes[:kept] = _unpack(payload[kept:], kept, bits).numpy()
    values = np.take(unit, codes).reshape(chunks, k)
    values *= scale.numpy()[:, None]
    local_rows = np.zeros(chunks * k, dtype=np.int64)
    local_rows[:kept] = local.numpy()
    positions = (local_rows.reshape(chunks, k) + (np.arange(chunks, dtype=np.int64) * TOPK_CHUNK)[:, None]).reshape(-1)
    flat = values.reshape(-1)
    dense = out.numpy()
    # slab by slab: zero it and scatter its kept values while it is cached (one pass over θ, not two)
    for start in range(0, numel, DECODE_SLAB):
        stop = min(start + DECODE_SLAB, numel)
        lo, hi = start // TOPK_CHUNK * k, min(-(-stop // TOPK_CHUNK) * k, kept)  # the slab's kept values
        dense[start:stop] = 0.0
        dense[positions[lo:hi]] = flat[lo:hi]
    return out


def _pack_bits(codes: torch.Tensor, width: int) -> bytes:
    """Pack codes of ``width`` bits into a little-endian bit stream (code i at bits [i·width, (i+1)·width)):
    8 codes at a time into one 64-bit word (shifted, summed: their bits do not overlap), of which the low
    ``width`` bytes are the stream's next bytes."""
    if 8 % width == 0:
        return _pack(codes.to(torch.uint8), width)
    count = codes.numel()
    words = -(-count // 8)
    padded = np.zeros(words * 8, dtype=np.int64)
    padded[:count] = codes.numpy()
    word = (padded.reshape(words, 8) << np.arange(0, 8 * width, width, dtype=np.int64)).sum(axis=1, dtype=np.int64)
    stream = word.astype("<i8").view(np.uint8).reshape(words, 8)[:, :width].reshape(-1)
    return stream[: (count * width + 7) // 8].tobytes()


def _encode_group(name: str, tensor: torch.Tensor) -> EncodedTensor:
    group, bits = group_params(name)
    numel = tensor.numel()
    groups = _padded_blocks(tensor, group, 0.0)
    magnitude = _padded_blocks(tensor.abs(), group, -1.0)  # padding is never the largest of its group
    kept_abs, position = magnitude.max(dim=1)
    negative = groups.gather(1, position.unsqueeze(1)).squeeze(1) < 0
    per_block = GROUP_BLOCK // group
    blocks = _padded_blocks(kept_abs, per_block, 0.0)
    count = torch.full((blocks.shape[0],), float(per_block))
    count[-1] = kept_abs.numel() - (blocks.shape[0] - 1) * per_block
    if bits == 1:  # sign only: the magnitude minimising the squared error is the mean kept |x|
        scale = (blocks.double().sum(dim=1) / count).float()
        codes = negative.to(torch.uint8)
    else:  # sign and one magnitude bit: levels max/2 and max
        scale = blocks.amax(dim=1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).repeat_interleave(per_block)[: kept_abs.numel()]
        high = (kept_abs / safe) > 0.75
        codes = negative.to(torch.uint8) << 1 | high.to(torch.uint8)
    packed = _pack_bits(position.to(torch.uint8) << bits | codes, _log2(group) + bits)
    encoded = EncodedTensor(name, numel, payload=packed, meta=scale.numpy().tobytes())
    assert encoded.nbytes == wire_bytes(name, numel), (name, numel, encoded.nbytes)
    return encoded


def _code_words(buffer: Buffer, width: int) -> np.ndarray:
    """The bit stream of ``width``-bit codes as 64-bit little-endian words, one per 8 codes: word m is the 8
    bytes from byte m·width (overlapping reads; the stream is copied once with 8 zero bytes of padding)."""
    padded = np.zeros(len(buffer) + 8, dtype=np.uint8)
    padded[: len(buffer)] = np.frombuffer(buffer, dtype=np.uint8)
    words = -(-len(buffer) // width)
    return np.ndarray((words,), dtype="<i8", buffer=padded, strides=(width,))


def _unpack_words(words: np.ndarray, first: int, count: int, width: int) -> np.ndarray:
    """Codes ``first .. first + count`` (first a multiple of 8) from :func:`_code_words`, as int64: word m holds
    codes 8m .. 8m + 7 at bits 0, width, 2·width, ... (a signed right shift is harmless: the mask keeps bits
    below 8·width ≤ 56)."""
    shifts = np.arange(0, 8 * width, width, dtype=np.int64)
    codes = (words[first // 8 : first // 8 + -(-count // 8), None] >> shifts) & ((1 << width) - 1)
    return codes.reshape(-1)[:count]


def _unpack_bits(buffer: Buffer, count: int, width: int) -> torch.Tensor:
    """All ``count`` codes of a ``width``-bit stream (inverse of :func:`_pack_bits`), as uint8."""
    return torch.from_numpy(_unpack_words(_code_words(buffer, width), 0, count, width).astype(np.uint8))


def _decode_group(encoded: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
    name, numel = encoded.codec, encoded.numel
    group, bits = group_params(name)
    width = _log2(group) + bits
    scale = np.frombuffer(encoded.meta, dtype="<f4")
    if not bool((np.isfinite(scale) & (scale >= 0)).all()):  # values are ±scale or ±scale/2: finite
        raise CodecError(f"codec {name!r}: a block scale is negative, NaN or Inf")
    count, whole = -(-numel // group), numel // group  # groups; groups with all G values
    words = _code_words(encoded.payload, width)
    table, values = _table(name), out.numpy()
    if whole < count:  # a short last group: its position must be one of its values (checked before writing)
        tail = numel - whole * group
        last = int(_unpack_words(words, whole - whole % 8, whole % 8 + 1, width)[-1])
        if last >> bits >= tail:
            raise CodecError(f"codec {name!r}: the last group's position {last >> bits} is not below its length {tail}")
    for start in range(0, whole * group, DECODE_SLAB):  # a full group's position is always inside it
        stop = min(start + DECODE_SLAB, whole * group)
        codes = _unpack_words(words, start // group, (stop - start) // group, width)
        np.take(table, codes, axis=0, out=values[start:stop].reshape(-1, group))
        _scale_slab(values, scale, start, stop)
    if whole < count:
        values[whole * group :] = table[last, : numel - whole * group]
    _scale_tail(values, scale, numel)
    return out
