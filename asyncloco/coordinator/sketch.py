"""A fixed-size sketch of each peer's updates, to find a peer that keeps pushing θ one way: a sleeper.

Verification re-runs a sample of leases. A peer that works honestly through its probation and then adds a hidden
direction to every update is caught only when one of its tampered leases is drawn — at 8 % per lease, within 5 of
them one time in three. What gives such a peer away before that is persistence: its updates carry one component, lease
after lease, that the other peers' updates do not share. An honest peer's updates differ from the consensus by noise
that changes with every lease (other batches, another θ).

:class:`Sketcher` maps a θ-sized update to ``BUCKETS`` numbers: ``SAMPLED`` coordinates at positions drawn from the
run secret (a peer cannot know them), each multiplied by a secret random sign and summed into a secret bucket (a count
sketch). Inner products of sketches estimate inner products of the updates (Johnson-Lindenstrauss), so a direction
spread over many coordinates keeps its share. Per peer, :func:`observe` keeps two ``BUCKETS``-sized vectors — the
peer's last normalised sketch and the part of it orthogonal to the consensus of the other peers' last sketches (its
residual) — and scores each new update by the cosine between its residual and the previous one: near 0 for an honest
peer, the hidden direction's share of the residual for a sleeper (≈ 0.5 when it adds a direction as large as its
honest update). A score above ``VerifyPolicy.sketch_threshold`` makes the peer a suspect: its next
``sketch_checks`` leases are all re-run (coordinator/logic/draws.py ``verify_reason``), so a sleeper is checked on the
lease after its second tampered one. Memory: 2 × ``BUCKETS`` floats per peer; time: a gather of ``SAMPLED`` values per
update (the same at every model size).

Everything here is deterministic (a cumulative sum in float64 per bucket, not a scatter whose order may vary), so a
replay of the write-ahead log makes the same decisions.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Collection

import torch

__all__ = ["BUCKETS", "SAMPLED", "Sketcher", "SketchState", "observe"]

BUCKETS = 256  # numbers per sketch: a cosine between two independent residuals spreads ≈ 1/√BUCKETS ≈ 0.06
SAMPLED = 1 << 18  # coordinates read per update (all of them for smaller models)


class Sketcher:
    """The count sketch of run secret ``secret`` for θ of ``numel`` values (derived data: rebuilt, never saved):
    ``buckets`` numbers from ``sampled`` coordinates (all of them for a smaller θ). :meth:`dot` estimates the inner
    product of two vectors from their sketches, without bias over the secret draws. The gate uses a larger one
    (gate_state.py, ``OWN_BUCKETS``) to take a peer's last update out of its reference."""

    def __init__(self, secret: bytes, numel: int, buckets: int = BUCKETS, sampled: int = SAMPLED) -> None:
        seed = int.from_bytes(hashlib.sha256(b"asyncloco sketch v1:" + secret).digest()[:8], "little") & ((1 << 63) - 1)
        generator = torch.Generator().manual_seed(seed)
        self.numel = numel
        if numel <= sampled:
            index = torch.arange(numel)
        else:
            index = torch.randint(0, numel, (sampled,), generator=generator)
        self.scale = numel / index.numel()  # sampled coordinates stand for all: inner products scale up by this
        bucket = torch.randint(0, buckets, (index.numel(),), generator=generator)
        sign = torch.randint(0, 2, (index.numel(),), generator=generator).to(torch.float64) * 2.0 - 1.0
        order = torch.argsort(bucket, stable=True)
        self.index = index[order]
        self.sign = sign[order]
        # one past the last position of each bucket in the sorted order (equal to the previous one's: an empty bucket)
        self.ends = torch.cumsum(torch.bincount(bucket, minlength=buckets), 0)

    def __call__(self, update: torch.Tensor) -> torch.Tensor:
        """The sketch of ``update`` (float64, ``BUCKETS`` values)."""
        values = update.detach().reshape(-1)[self.index].to(torch.float64) * self.sign
        running = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(values, 0)])  # sequential: same bits every run
        totals = running[self.ends]
        return totals - torch.cat([torch.zeros(1, dtype=torch.float64), totals[:-1]])

    def dot(self, a: torch.Tensor, b: torch.Tensor) -> float:
        """The inner product of the two vectors whose sketches are ``a`` and ``b`` (an estimate: exact in
        expectation over the secret signs and samples, spread ≈ ‖x‖‖y‖ / √buckets)."""
        return self.scale * float(torch.dot(a, b))


@dataclass
class SketchState:
    """Per peer: its last normalised sketch, its last residual, its last score and the forced checks it still owes
    (checkpointed with the coordinator's state; lists of floats)."""

    last: dict[str, list[float]] = field(default_factory=dict)
    residual: dict[str, list[float]] = field(default_factory=dict)
    score: dict[str, float] = field(default_factory=dict)
    flagged: dict[str, int] = field(default_factory=dict)  # peer -> leases still to be re-run as a suspect
    flags: int = 0  # times a peer was made a suspect by its score

    def state_dict(self) -> dict[str, Any]:
        return {"last": {k: list(v) for k, v in self.last.items()}, "residual": {k: list(v) for k, v in self.residual.items()},
                "score": dict(self.score), "flagged": dict(self.flagged), "flags": self.flags}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "SketchState":
        return cls({k: [float(x) for x in v] for k, v in state.get("last", {}).items()},
                   {k: [float(x) for x in v] for k, v in state.get("residual", {}).items()},
                   {k: float(v) for k, v in state.get("score", {}).items()},
                   {k: int(v) for k, v in state.get("flagged", {}).items()}, int(state.get("flags", 0)))

    def forget(self, peer: str) -> None:
        """A peer that left or was expelled no longer shapes the consensus."""
        for table in (self.last, self.residual, self.score):
            table.pop(peer, None)


def _unit(vector: torch.Tensor) -> torch.Tensor | None:
    norm = float(torch.linalg.vector_norm(vector))
    return None if not math.isfinite(norm) or norm == 0.0 else vector / norm


def observe(sketches: SketchState, sketch: torch.Tensor, peer: str, live: Collection[str], threshold: float,
            checks: int) -> float | None:
    """Take ``peer``'s accepted update (its ``sketch``): its residual against the consensus of the other ``live``
    peers' last sketches, the cosine with its previous residual (returned; None for its first update or a zero one),
    and the suspicion when that cosine exceeds ``threshold`` (``checks`` forced checks)."""
    unit = _unit(sketch)
    if unit is None:
        return None
    others = [torch.tensor(v, dtype=torch.float64) for name, v in sorted(sketches.last.items())
              if name != peer and name in live]
    residual = unit
    if others:
        consensus = _unit(torch.stack(others).mean(0))
        if consensus is not None:
            residual = unit - torch.dot(unit, consensus) * consensus
    residual_unit = _unit(residual)
    score = None
    previous = sketches.residual.get(peer)
    if residual_unit is not None and previous is not None:
        score = float(torch.dot(residual_unit, torch.tensor(previous, dtype=torch.float64)))
        sketches.score[peer] = score
        if score > threshold and checks > 0:
            if sketches.flagged.get(peer, 0) <= 0:
                sketches.flags += 1
            sketches.flagged[peer] = checks
    sketches.last[peer] = unit.tolist()
    if residual_unit is not None:
        sketches.residual[peer] = residual_unit.tolist()
    return score
