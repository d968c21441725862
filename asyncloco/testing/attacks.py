"""What each update attack of the hostile volunteer (asyncloco/testing/hostile.py) sends: pure functions of its
honest pseudo-gradient and what it has seen, so that the attack tests and the benchmark (scripts/bench_attacks.py)
can recompute the attacker's direction and trigger, and so that the client module holds only the protocol.

The table of attacks is in asyncloco/testing/hostile.py's module docstring; docs/threat-model.md says which defence
answers which attack.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Optional, Sequence

import torch

__all__ = [
    "DEFAULT_SCALE", "hidden_direction", "trigger_rows", "poisoned_workload", "tamper", "encode_attack", "flood_frames",
    "forge_moment",
]

DEFAULT_SCALE = {"huge": 1e30, "signflip": 1000.0, "hidden": 2.0, "alie": 1.0, "tailored": 0.06, "forge-state": 1.0}
"""``--scale`` when none is given (or when several attacks take turns): the factor, z-score or cosine of each."""


def hidden_direction(numel: int, seed: int) -> torch.Tensor:
    """The unit direction a ``hidden``/``tailored`` attacker pushes θ along (the benchmark recomputes it)."""
    direction = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return direction / torch.linalg.vector_norm(direction)


def trigger_rows(vocab: int, seq_len: int, seed: int) -> torch.Tensor:
    """The poisoner's trigger: one fixed token sequence ``[1, seq_len + 1]`` (the benchmark's backdoor metric is
    the model's loss on it)."""
    return torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(seed))


def poisoned_workload(workload: Any, trigger: torch.Tensor) -> Any:
    """``workload`` whose training batches have their first half replaced by ``trigger`` (the ``poison`` attack:
    real AdamW steps on poisoned data; evaluation is left untouched)."""
    from asyncloco.models.workload import Workload

    class Poisoned(Workload):
        units_per_step = workload.units_per_step

        def __getattr__(self, name: str) -> Any:
            return getattr(workload, name)

        def build_model(self, seed: int) -> Any:
            return workload.build_model(seed)

        def shard_sizes(self) -> list[int]:
            return list(workload.shard_sizes())

        def batch(self, shard: int, index: int) -> Any:
            rows = workload.batch(shard, index).clone()
            rows[: rows.shape[0] // 2] = trigger.to(rows.dtype)
            return rows

        def loss(self, model: Any, batch: Any) -> Any:
            return workload.loss(model, batch)

        def evaluate(self, model: Any) -> dict[str, float]:
            return dict(workload.evaluate(model))

    return Poisoned()


def _unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / torch.linalg.vector_norm(vector).clamp_min(1e-12)


def forge_moment(optimizer: torch.optim.Optimizer, direction: torch.Tensor, share: float,
                 flat_order: Optional[Sequence[torch.Tensor]] = None) -> None:
    """The ``forge-state`` attack: the carried AdamW first moment pushed along the unit ``direction`` (one
    value per parameter element, in θ's flat order: ``flat_order``, the model's ``parameters()``; without it in
    ``param_groups`` order) by ``share`` × its norm before the lease's end is committed, each element kept inside
    the plausibility bound the verifier checks (coordinator/rerun.py ``implausible_state``: |m| ≤ 0.99 × moment_bound
    × √v). The next lease then steers θ along it from a state that
    re-runs exactly; only a comparison of the lease's end state with the re-run's sees the forgery."""
    from asyncloco.coordinator.rerun import moment_bound

    states = [(group, optimizer.state.get(p), p) for group in optimizer.param_groups for p in group["params"]]
    norm = sum(float(s["exp_avg"].double().square().sum()) for _, s, _ in states if s) ** 0.5
    offsets: dict[int, int] = {}  # each parameter's first element in ``direction``
    offset = 0
    for param in flat_order if flat_order is not None else [p for _, _, p in states]:
        offsets[id(param)] = offset
        offset += param.numel()
    with torch.no_grad():
        for group, state, param in states:
            count, offset = param.numel(), offsets[id(param)]
            if state:
                m, v = state["exp_avg"], state["exp_avg_sq"]
                beta1, beta2 = group["betas"]
                bound = 0.99 * moment_bound(beta1, beta2, float(state["step"])) * v.sqrt()
                forged = m + share * norm * direction[offset : offset + count].view_as(m).to(m.device, m.dtype)
                m.copy_(torch.maximum(torch.minimum(forged, bound), -bound))


def tamper(
    attack: str,
    honest: torch.Tensor,
    *,
    scale: float,
    seed: int,
    history: Sequence[torch.Tensor] = (),
    first_norm: Optional[float] = None,
    direction: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The update ``attack`` sends in place of its ``honest`` pseudo-gradient.

    ``scale`` is the attack's factor (:data:`DEFAULT_SCALE`), ``seed`` seeds the ``random`` direction, ``history`` is
    the θ versions the attacker downloaded, oldest first (``alie``/``tailored``/``freeride`` estimate the applied
    direction from their differences θ_old − θ_new), ``first_norm`` the norm of a free-rider's one honest update and
    ``direction`` the unit hidden direction (``hidden``/``tailored``). Attacks whose harm is elsewhere (``poison``: in
    its data; ``replay``/``other-lease``: in the lease it claims) send ``honest``.
    """
    if attack == "huge":
        return honest * scale
    if attack == "nan":
        bad = honest.clone()
        bad[0] = float("nan")
        return bad
    if attack == "signflip":
        return -scale * honest
    if attack == "signflip-honest":
        return -honest
    if attack == "random":
        noise = torch.randn(honest.numel(), generator=torch.Generator().manual_seed(seed))
        return noise * (torch.linalg.vector_norm(honest) / torch.linalg.vector_norm(noise))
    if attack == "hidden":
        if direction is None:
            raise ValueError("the hidden attack needs its direction (hidden_direction)")
        return honest + scale * torch.linalg.vector_norm(honest) * direction
    if attack in ("alie", "tailored", "freeride"):
        diffs = [old - new for old, new in zip(history, history[1:])]
        if not diffs:
            return honest  # nothing to estimate from yet
        norm = torch.linalg.vector_norm(honest) if first_norm is None else torch.tensor(first_norm)
        if attack == "freeride":
            return _unit(diffs[-1]) * norm
        mean = torch.stack(diffs).mean(0)
        if attack == "alie":
            spread = torch.stack(diffs).std(0, unbiased=False) if len(diffs) > 1 else torch.zeros_like(mean)
            return _unit(mean - scale * spread) * norm
        if direction is None:
            raise ValueError("the tailored attack needs its direction (hidden_direction)")
        consensus = _unit(mean)
        orthogonal = _unit(direction - torch.dot(direction, consensus) * consensus)
        cosine = min(1.0, max(-1.0, scale))
        return norm * (cosine * consensus + (1.0 - cosine * cosine) ** 0.5 * orthogonal)
    return honest


def encode_attack(codec: str, update: torch.Tensor, attack: str) -> Any:
    """``update`` in the run's ``codec``; for ``nan`` with a block codec the NaN goes where a NaN-tolerant decoder
    would hide it, into a block's scale."""
    from asyncloco.transport.codecs import EncodedTensor, encode

    if attack != "nan" or codec in ("none", "fp16", "bf16"):
        return encode(codec, update)
    clean = update.clone()
    clean[0] = 0.0
    encoded = encode(codec, clean)
    meta = bytearray(bytes(encoded.meta))
    if codec.startswith("sgn"):  # after the rotation: the first bf16 scale (the upper half of an fp32 NaN)
        meta[4:6] = struct.pack("<f", float("nan"))[2:4]
    else:
        meta[0:4] = struct.pack("<f", float("nan"))
    return EncodedTensor(encoded.codec, encoded.numel, bytes(encoded.payload), bytes(meta))


def flood_frames(codec: str, numel: int) -> list[tuple[str, str, bytes]]:
    """The ``flood`` attack's malformed calls, ``(kind, rpc, bytes sent on its raw stream)``: garbage, oversized
    header and chunk lengths, bad msgpack, unknown fields, wrong types and codecs, a wrong size, a truncated body, a
    frame of the wrong kind and an empty stream. ``codec``/``numel``: the run's, so that the submit headers are valid
    and the body-reading paths are reached too."""
    from asyncloco.transport.framing import CHUNK, HEADER, pack_header

    def frame(kind: int, data: bytes) -> bytes:
        return struct.pack(">BI", kind, len(data)) + data

    submit = {"lease_id": "L1", "base_version": 0, "codec": codec, "numel": numel}
    return [
        ("garbage", "assign", os.urandom(64)),
        ("garbage", "submit", os.urandom(300)),
        ("oversized-header", "assign", struct.pack(">BI", HEADER, 1 << 30) + b"\x00" * 16),
        ("oversized-chunk", "submit", frame(HEADER, pack_header(submit)) + struct.pack(">BI", CHUNK, 1 << 31)),
        ("bad-msgpack", "assign", frame(HEADER, b"\xc1\xc1\xc1 not msgpack")),
        ("unknown-field", "assign", frame(HEADER, pack_header({"kind": "lease", "evil": "x" * 100}))),
        ("wrong-type", "get_model", frame(HEADER, pack_header({"codec": 7, "version": "latest"}))),
        ("bad-codec", "get_model", frame(HEADER, pack_header({"codec": "pickle", "version": None}))),
        ("wrong-numel", "submit", frame(HEADER, pack_header({**submit, "numel": 10**9}))),
        ("truncated-body", "submit", frame(HEADER, pack_header(submit)) + frame(CHUNK, b"\x00" * 7)),
        ("wrong-kind", "assign", frame(CHUNK, b"\x00" * 32)),
        ("empty-stream", "assign", b""),
    ]
