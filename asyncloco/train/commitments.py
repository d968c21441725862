"""Commitments to a lease's inner state (docs/threat-model.md, "Commitments"): the inner AdamW state's canonical
byte layout and its digest, the commitment to that state together with the error-feedback residual, and the byte
layout of a reveal (a lease's start and end states). The peer commits and reveals with these (peer/reveal.py); the
verifier re-computes them (coordinator/rerun.py).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Optional, Union

import numpy as np
import torch

__all__ = [
    "FRESH_STATE_DIGEST", "committable", "inner_state_buffer", "inner_state_chunks", "inner_state_digest", "inner_state_size", "load_inner_state",
    "revealed_digest", "committed_digest", "pack_reveal", "unpack_reveal", "revealed_size", "pack_parts", "split_parts",
    "copy_buffer", "join_parts", "pack_reveal_buffer", "revealed_end",
]


Buffer = Union[bytes, bytearray, memoryview]
"""A state's bytes as received or sliced: the functions below take views of a reveal rather than copies of it."""

# Why views: a copy of a bytes object (slicing, concatenation, ``bytes()``, ``bytearray()``, ``ndarray.tobytes``)
# holds the GIL for all its length, and the verifier runs in a worker thread of the coordinator's process: a reveal
# of 1.8 GB (the 150m preset) copied three times stalled every RPC for seconds. sha256 and numpy's copies release
# the GIL (scripts/bench_coordinator.py measures the lease latency this protects).

FRESH_STATE_DIGEST = hashlib.sha256(b"asyncloco inner state v1: fresh").hexdigest()
"""The commitment to a fresh inner optimizer state (step 0, no moments): what a peer's first lease, and every lease
after a reset (:meth:`InnerTrainer.reset_inner_state`), starts from (docs/threat-model.md, "Commitments")."""


def inner_state_chunks(optimizer: torch.optim.Optimizer) -> Optional[list[bytes]]:
    """The inner AdamW state in its canonical byte layout (None: this optimizer's state cannot be committed to —
    8-bit or sharded states, AMSGrad): for each parameter in ``param_groups`` order, ``b"\\x00"`` if it has no state
    yet, else ``b"\\x01"``, the step count as a little-endian float64, then ``exp_avg`` and ``exp_avg_sq`` as
    little-endian float32. An entirely empty state is the fresh state (:data:`FRESH_STATE_DIGEST`): ``[]``."""
    buffers = _state_buffers(optimizer)
    return None if buffers is None else [bytes(buffer) for buffer in buffers]


def _layout_states(optimizer: torch.optim.Optimizer) -> Optional[list[tuple[torch.Tensor, Optional[dict[str, Any]]]]]:
    """Each parameter with its AdamW state (None: none yet), in ``param_groups`` order, once every state can be laid
    out (step, float32 ``exp_avg`` and ``exp_avg_sq``); None when one cannot, or the optimizer is not
    :func:`committable`."""
    if not committable(optimizer):
        return None
    pairs = [(param, optimizer.state.get(param) or None) for group in optimizer.param_groups for param in group["params"]]
    for _, state in pairs:
        if state is not None and (set(state) != {"step", "exp_avg", "exp_avg_sq"} or any(
                state[key].dtype != torch.float32 or type(state[key]) is not torch.Tensor for key in ("exp_avg", "exp_avg_sq"))):
            return None
    return pairs


def _moment(tensor: torch.Tensor) -> np.ndarray:
    """A moment as little-endian float32 on the host, flat (no copy for a contiguous CPU tensor)."""
    return tensor.detach().cpu().contiguous().numpy().reshape(-1).astype("<f4", copy=False)


def _state_buffers(optimizer: torch.optim.Optimizer) -> Optional[list[Buffer]]:
    """:func:`inner_state_chunks` as views (markers and step counts as bytes, the moments as the arrays' own memory
    where the tensor is a contiguous little-endian float32 on the CPU): what the digest hashes without a copy."""
    pairs = _layout_states(optimizer)
    if pairs is None:
        return None
    if all(state is None for _, state in pairs):
        return []
    chunks: list[Buffer] = []
    for _, state in pairs:
        if state is None:
            chunks.append(b"\x00")
            continue
        chunks.append(b"\x01" + struct.pack("<d", float(state["step"])))
        chunks.extend(_moment(state[key]).view(np.uint8).data for key in ("exp_avg", "exp_avg_sq"))
    return chunks


def committable(optimizer: torch.optim.Optimizer) -> bool:
    """Can ``optimizer``'s state be committed to (a plain AdamW without AMSGrad)? The cheap test, without reading the
    state: :func:`inner_state_chunks` may still find a state it cannot lay out and give None."""
    return type(optimizer) is torch.optim.AdamW and not any(group.get("amsgrad") for group in optimizer.param_groups)


def inner_state_buffer(optimizer: torch.optim.Optimizer, spare: Optional[np.ndarray] = None) -> Optional[memoryview]:
    """:func:`inner_state_chunks` joined, built in one preallocated buffer: each moment copied once from its device
    into place, one tensor at a time (numpy's copies release the GIL; a join of ``tobytes`` chunks copies twice,
    holding it). b"" for the fresh state, None when the state cannot be committed to. ``spare``: a uint8 array of
    exactly the size to write into instead of a new one (a new one's pages fault in on first write, which costs more
    than the copy)."""
    pairs = _layout_states(optimizer)
    if pairs is None:
        return None
    if all(state is None for _, state in pairs):
        return memoryview(b"")
    size = sum(9 + 8 * param.numel() if state is not None else 1 for param, state in pairs)
    reuse = spare is not None and spare.dtype == np.uint8 and spare.ndim == 1 and spare.size == size
    out = spare if reuse and spare is not None else np.empty(size, dtype=np.uint8)
    offset = 0
    for _, state in pairs:
        if state is None:
            out[offset] = 0
            offset += 1
            continue
        out[offset] = 1
        out[offset + 1 : offset + 9] = np.frombuffer(struct.pack("<d", float(state["step"])), dtype=np.uint8)
        offset += 9
        for key in ("exp_avg", "exp_avg_sq"):
            moment = _moment(state[key]).view(np.uint8)
            out[offset : offset + moment.size] = moment
            offset += moment.size
    return out.data.cast("B")


def inner_state_size(optimizer: torch.optim.Optimizer, fresh: bool = False) -> int:
    """The exact byte length of :func:`inner_state_chunks` when every parameter has state (``fresh``: 0) — what a
    revealed state must be, checked before anything is allocated for it."""
    if fresh:
        return 0
    return sum(1 + 8 + 8 * param.numel() for group in optimizer.param_groups for param in group["params"])


def load_inner_state(optimizer: torch.optim.Optimizer, data: Buffer) -> None:
    """Load a state in the layout of :func:`inner_state_chunks` (b"": the fresh state) into a plain AdamW; refuses
    any other length or a bad marker with a ValueError, leaving the optimizer's state as it was."""
    if type(optimizer) is not torch.optim.AdamW:
        raise ValueError("only a plain torch AdamW state can be loaded from its canonical layout")
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if not data:
        optimizer.state.clear()
        return
    view = memoryview(data)
    loaded: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    offset = 0
    for index, param in enumerate(params):
        if offset >= len(view):
            raise ValueError(f"inner state ends before parameter {index} of {len(params)}")
        marker = view[offset]
        offset += 1
        if marker == 0:
            continue
        if marker != 1:
            raise ValueError(f"inner state: parameter {index} has marker {marker}, expected 0 or 1")
        need = 8 + 8 * param.numel()
        if offset + need > len(view):
            raise ValueError(f"inner state: parameter {index} needs {need} bytes, {len(view) - offset} are left")
        (step,) = struct.unpack_from("<d", view, offset)
        offset += 8
        moments = []
        for _ in range(2):
            # numpy's copy releases the GIL (a bytearray of the slice would hold it: see Buffer)
            raw = torch.from_numpy(np.frombuffer(view, dtype="<f4", count=param.numel(), offset=offset).copy())
            moments.append(raw.view_as(param.detach().cpu()).to(param.device))
            offset += 4 * param.numel()
        loaded[param] = {"step": torch.tensor(step, dtype=torch.float32), "exp_avg": moments[0], "exp_avg_sq": moments[1]}
    if offset != len(view):
        raise ValueError(f"inner state has {len(view) - offset} bytes past its last parameter")
    optimizer.state.clear()
    for param, state in loaded.items():
        optimizer.state[param] = state


def revealed_digest(data: Buffer) -> str:
    """The digest of a state given in its canonical layout (b"": the fresh state); equals :func:`inner_state_digest`
    of the optimizer it came from."""
    if not data:
        return FRESH_STATE_DIGEST
    hasher = hashlib.sha256(b"asyncloco inner state v1:")
    hasher.update(data)  # no copy, and sha256 releases the GIL
    return hasher.hexdigest()


def inner_state_digest(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """sha256 (hex) of :func:`inner_state_chunks`; :data:`FRESH_STATE_DIGEST` for a fresh state."""
    chunks = _state_buffers(optimizer)
    if chunks is None:
        return None
    if not chunks:
        return FRESH_STATE_DIGEST
    hasher = hashlib.sha256(b"asyncloco inner state v1:")
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


# ----------------------------------------------------------------- the error-feedback residual, committed too
#
# With error feedback (runtime.error_feedback, train/feedback.py) the upload is encode(Δ + β·e_prev): the residual
# e_prev is part of what a lease's submission depends on, so it is committed with the inner state and revealed with
# it. The commitment is the inner state's digest when there is no residual (a fresh peer, or one whose last upload
# was not applied: both drop it), else sha256 over the inner digest and the residual's little-endian float32 bytes.
# The revealed bytes, with feedback on: the inner state's length (uint64 LE), its canonical layout, then the residual
# (4 bytes per parameter, or nothing when there is none).

_RESIDUAL_DOMAIN = b"asyncloco inner state + residual v1:"


def _residual_bytes(residual: torch.Tensor) -> bytes:
    return residual.detach().cpu().contiguous().numpy().astype("<f4", copy=False).tobytes()


def committed_digest(inner_digest: str, residual: Optional[torch.Tensor]) -> str:
    """The commitment to an inner state (its digest, :func:`inner_state_digest`) together with the error-feedback residual."""
    if residual is None:
        return inner_digest
    hasher = hashlib.sha256(_RESIDUAL_DOMAIN + inner_digest.encode())
    hasher.update(np.ascontiguousarray(residual.detach().cpu().numpy().astype("<f4", copy=False)).data.cast("B"))
    return hasher.hexdigest()


def pack_reveal(inner: Buffer, residual: Optional[torch.Tensor]) -> bytes:
    """The revealed bytes with error feedback on: the inner state's length and layout, then the residual."""
    return b"".join((struct.pack("<Q", len(inner)), inner, b"" if residual is None else _residual_bytes(residual)))


def revealed_size(inner_size: int, numel: int, feedback: bool, ends: bool = True) -> int:
    """The most bytes a reveal may carry: per part the full inner state (``inner_size``), with feedback plus
    8 + 4·numel; with ``ends`` (the lease's end state revealed too: :func:`pack_parts`) two parts and their 8-byte
    length field."""
    part = inner_size + (8 + 4 * numel if feedback else 0)
    return 8 + 2 * part if ends else part


def pack_parts(start: Buffer, end: Buffer) -> bytes:
    """A reveal of a lease's start and end states: the start part's length (uint64 LE), the start part (b"": the
    fresh state), the end part — each part in the single-state layout (the canonical inner layout, with error feedback
    :func:`pack_reveal`'s)."""
    return b"".join((struct.pack("<Q", len(start)), start, end))


# ---------------------------------------------- the same layouts built by numpy (no GIL held for a state's length)
#
# The coordinator builds reveals out of states it kept (coordinator/chained.py) on its event loop or in its verifier's
# thread: at 150m a state is 1.8 GB, and a bytes join or copy of it would stall every RPC for seconds (above).


def copy_buffer(data: Buffer) -> memoryview:
    """A copy of ``data`` (its own memory, so that ``data`` may be freed), made by numpy."""
    out = np.empty(len(data), dtype=np.uint8)
    if len(data):
        out[:] = np.frombuffer(data, dtype=np.uint8)
    return out.data.cast("B")


def join_parts(start: Buffer, end: Buffer) -> memoryview:
    """:func:`pack_parts` built by numpy."""
    out = np.empty(8 + len(start) + len(end), dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(start)), dtype=np.uint8)
    for offset, part in ((8, start), (8 + len(start), end)):
        if len(part):
            out[offset : offset + len(part)] = np.frombuffer(part, dtype=np.uint8)
    return out.data.cast("B")


def pack_reveal_buffer(inner: Buffer, residual: Optional[torch.Tensor]) -> memoryview:
    """:func:`pack_reveal` built by numpy."""
    tail = np.empty(0, dtype=np.uint8) if residual is None else \
        residual.detach().cpu().contiguous().numpy().astype("<f4", copy=False).reshape(-1).view(np.uint8)
    out = np.empty(8 + len(inner) + tail.size, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(inner)), dtype=np.uint8)
    if len(inner):
        out[8 : 8 + len(inner)] = np.frombuffer(inner, dtype=np.uint8)
    out[8 + len(inner) :] = tail
    return out.data.cast("B")


def revealed_end(data: Buffer) -> Optional[memoryview]:
    """A copy of the end part of a reveal (:func:`pack_parts`; by numpy), or None when it has none or is malformed."""
    try:
        end = split_parts(data)[1]
    except ValueError:
        return None
    return copy_buffer(end) if len(end) else None


def split_parts(data: Buffer) -> tuple[memoryview, memoryview]:
    """(start part, end part) of :func:`pack_parts`, as views of ``data``; raises ValueError naming what is malformed."""
    if len(data) < 8:
        raise ValueError(f"the reveal has {len(data)} bytes, fewer than its 8-byte length field")
    (start_length,) = struct.unpack_from("<Q", data, 0)
    if start_length > len(data) - 8:
        raise ValueError(f"the reveal's start part of {start_length} bytes runs past its {len(data) - 8} bytes")
    view = memoryview(data)
    return view[8 : 8 + start_length], view[8 + start_length :]


def unpack_reveal(data: Buffer, numel: int) -> tuple[Buffer, Optional[torch.Tensor]]:
    """Split revealed bytes (feedback on) into the inner state's layout and the residual (None when absent); b""
    is the fresh state without a residual. Raises ValueError naming what is malformed."""
    if not data:
        return b"", None
    if len(data) < 8:
        raise ValueError(f"the revealed state has {len(data)} bytes, fewer than its 8-byte length field")
    (inner_length,) = struct.unpack_from("<Q", data, 0)
    rest = len(data) - 8 - inner_length
    if inner_length > len(data) - 8 or rest not in (0, 4 * numel):
        raise ValueError(f"the revealed state's inner part of {inner_length} bytes leaves {len(data) - 8 - inner_length} "
                         f"bytes for the residual, which needs 0 or {4 * numel}")
    inner = memoryview(data)[8 : 8 + inner_length]
    if rest == 0:
        return inner, None
    residual = torch.from_numpy(np.frombuffer(data, dtype="<f4", offset=8 + inner_length, count=numel).astype(np.float32))
    if not bool(torch.isfinite(residual).all()):
        raise ValueError("the revealed residual has a NaN or Inf")
    return inner, residual
