"""The update gate's knobs and state (``runtime.gate``; the gate itself: coordinator/gate.py), and the consensus the
gate judges directions against: an exponential moving average of the unit vectors of accepted updates in which no
one peer holds more than ``reference_share`` of the weight while others are present (:func:`reference_weight`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import math

import torch

from asyncloco.coordinator.sketch import Sketcher

__all__ = [
    "GatePolicy", "GateState", "UNKNOWN_LEASE", "OWN_PARTS_MAX", "OWN_BUCKETS", "OWN_SAMPLED", "OWN_REST_MIN", "reference_weight",
    "join_reference", "others_reference", "own_cosine",
]

UNKNOWN_LEASE = "?"  # a weak-agreement mark whose lease is not known (booked without one, or from an older checkpoint)
OWN_PARTS_MAX = 1 << 21  # θ values up to which the gate keeps each peer's part of its reference (4 bytes each per peer)
# above it, a secret count sketch of each part (coordinator/sketch.py): OWN_BUCKETS float64 values per peer, from
# OWN_SAMPLED coordinates; the cosine it gives spreads ≈ weight / √OWN_BUCKETS / ‖rest‖ (≈ 0.003 at the defaults)
OWN_BUCKETS = 1 << 15
OWN_SAMPLED = 1 << 20
OWN_REST_MIN = 0.1  # sketched: judged against the rest only while it keeps this share of the reference's norm


@dataclass(frozen=True)
class GatePolicy:
    """Knobs of the gate (``runtime.gate`` in the run config). The defaults need no per-run tuning."""

    clip_factor: float = 4.0
    reject_factor: float = 20.0
    cosine_mads: float = 6.0
    cosine_cap: float = 0.05
    flip_margin: float = 0.25
    echo_cosine: float = 0.95
    suspect_cosine: float = 0.85  # an applied update agreeing at least this closely marks its peer a verification suspect
    suspect_mads: float = 4.0  # ... raised to median + suspect_mads × MAD where honest work agrees closely
    window: int = 32
    warmup: int = 6
    reference_decay: float = 0.8
    reference_share: float = 0.5  # the most of the reference one peer's updates may hold while others are present
    probation_updates: int = 3
    probation_tightening: float = 0.5
    quarantine_after: int = 3
    quarantine_window: int = 6
    quarantine_s: float = 600.0
    probe: bool = True  # use the probe-batch losses when the daemon supplies them
    probe_step: float = 0.2  # the probe evaluates θ − probe_step·Δ
    probe_margin: float = 0.0005  # relative probe-loss change that counts as evidence, for a lease of full_steps
    full_steps: int = 1  # the schedule's max_local_steps: a shorter lease moves θ less, its margin shrinks (probe_margin())
    probe_count_factor: float = 4.0  # a rise above this × the margin also counts toward quarantine
    probe_below: float = 0.5  # the gray zone: cosine below this × the median of recent cosines (or on probation)
    probe_all_below_params: int = 25_000_000  # models up to this size: probe every update; larger: probation only
    probe_max_params: int = 50_000_000  # above this size no probe (two forward passes under the lock: see wants_probe)

    def __post_init__(self) -> None:
        if not 1.0 <= self.clip_factor <= self.reject_factor:
            raise ValueError("gate: need 1 <= clip_factor <= reject_factor")
        if not 0.0 <= self.reference_decay < 1.0:
            raise ValueError("gate: reference_decay must be in [0, 1)")
        if not 0.0 < self.reference_share <= 1.0:
            raise ValueError("gate: reference_share must be in (0, 1]")
        if self.window < 3 or self.warmup < 1 or self.quarantine_after < 1 or self.quarantine_window < self.quarantine_after:
            raise ValueError("gate: window >= 3, warmup >= 1, 1 <= quarantine_after <= quarantine_window")
        if self.probe_margin < 0 or self.probe_below < 0 or not 0 < self.probe_step <= 1:
            raise ValueError("gate: probe_margin and probe_below must be >= 0, probe_step in (0, 1]")


@dataclass
class GateState:
    norms: list[float] = field(default_factory=list)  # per-step norms of the last `window` accepted updates
    cosines: list[float] = field(default_factory=list)  # their cosines with the reference at the time
    reference: torch.Tensor | None = None  # EMA of unit accepted updates (flat fp32), None before the first
    reference_norm: float = 0.0
    accepted: int = 0
    peer_accepted: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, list[bool]] = field(default_factory=dict)  # per peer, recent: True = rejected
    quarantined_until: dict[str, float] = field(default_factory=dict)
    quarantines: dict[str, int] = field(default_factory=dict)
    # per peer, recent verdicts: the lease id of an update taken with weak agreement and not explained (a check of that
    # lease which agrees explains it away: gate.explain_weak), UNKNOWN_LEASE where its lease is not known, "" otherwise
    weak: dict[str, list[str]] = field(default_factory=dict)
    close: dict[str, list[bool]] = field(default_factory=dict)  # per peer, recent verdicts: True = close to an echo
    # per peer, recent verdicts: True = refused on the probe's word alone where the update could not be re-run instead
    # (a verified run, θ at its base version gone): a suspect's signal, not counted toward quarantine (logic/submit.py)
    doubted: dict[str, list[bool]] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)  # each peer's weight in the reference (sums to <= 1)
    present: list[str] = field(default_factory=list)  # the peers of the last `window` applied updates, weak ones too
    # each peer's last update in the reference (its unit vector × its weight there, decayed as the reference is since),
    # kept for θ of at most OWN_PARTS_MAX values: a peer's next update is judged against the reference without it
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    # above OWN_PARTS_MAX values: the secret sketch of that part and its weight (the part's norm), decayed alike
    own_sketch: dict[str, torch.Tensor] = field(default_factory=dict)
    own_weight: dict[str, float] = field(default_factory=dict)
    own_dot: dict[str, float] = field(default_factory=dict)  # r·p: exact when p joined, then updated with each join

    def state_dict(self) -> dict[str, Any]:
        return {
            "norms": list(self.norms),
            "cosines": list(self.cosines),
            "reference": self.reference,
            "reference_norm": self.reference_norm,
            "accepted": self.accepted,
            "peer_accepted": dict(self.peer_accepted),
            "verdicts": {k: list(v) for k, v in self.verdicts.items()},
            "quarantined_until": dict(self.quarantined_until),
            "quarantines": dict(self.quarantines),
            "weak": {k: list(v) for k, v in self.weak.items()},
            "close": {k: list(v) for k, v in self.close.items()},
            "doubted": {k: list(v) for k, v in self.doubted.items()},
            "shares": dict(self.shares),
            "present": list(self.present),
            "own": dict(self.own),
            "own_sketch": dict(self.own_sketch),
            "own_weight": dict(self.own_weight),
            "own_dot": dict(self.own_dot),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "GateState":
        reference = state["reference"]
        return cls(
            norms=[float(x) for x in state["norms"]],
            cosines=[float(x) for x in state["cosines"]],
            reference=None if reference is None else reference.clone(),
            reference_norm=float(state["reference_norm"]),
            accepted=int(state["accepted"]),
            peer_accepted={k: int(v) for k, v in state["peer_accepted"].items()},
            verdicts={k: [bool(x) for x in v] for k, v in state["verdicts"].items()},
            quarantined_until={k: float(v) for k, v in state["quarantined_until"].items()},
            quarantines={k: int(v) for k, v in state["quarantines"].items()},
            weak=_weak_marks(state),
            close={k: [bool(x) for x in v] for k, v in state.get("close", {}).items()},  # absent before its signal
            doubted={k: [bool(x) for x in v] for k, v in state.get("doubted", {}).items()},  # absent before it
            # absent before the share cap: no shares known, every peer starts from none
            shares={k: float(v) for k, v in state.get("shares", {}).items()},
            present=[str(x) for x in state.get("present", [])],
            own={k: v.clone() for k, v in state.get("own", {}).items()},  # absent before own parts: judged as before
            own_sketch={k: v.clone() for k, v in state.get("own_sketch", {}).items()},
            own_weight={k: float(v) for k, v in state.get("own_weight", {}).items()},
            own_dot={k: float(v) for k, v in state.get("own_dot", {}).items()},
        )


def _weak_marks(state: dict[str, Any]) -> dict[str, list[str]]:
    """``GateState.weak`` from a snapshot. Absent in the oldest; then a flag per verdict (True: weak, unexplained) with,
    once weak agreements could be explained, their lease ids beside them in ``weak_leases`` (aligned at the end, ""
    where none); now the lease ids alone."""
    leases = state.get("weak_leases", {})
    marks: dict[str, list[str]] = {}
    for peer, entries in state.get("weak", {}).items():
        if all(isinstance(x, str) for x in entries):
            marks[peer] = [str(x) for x in entries]
            continue
        known = [str(x) for x in leases.get(peer, [])][-len(entries):] if entries else []
        known = [""] * (len(entries) - len(known)) + known
        marks[peer] = [(lease or UNKNOWN_LEASE) if flag else "" for flag, lease in zip(entries, known)]
    return marks


def reference_weight(policy: GatePolicy, gate: GateState, peer: str) -> float:
    """The weight with which ``peer``'s accepted update joins the reference (module docstring): ``1 − d``, unless
    that would lift the peer's share above ``reference_share`` while other peers of the last ``window`` applied
    updates hold at least 5 % of it; then the weight that keeps it at the cap, but at least ``(1 − d) / 4``.
    A peer alone (or among peers that hold nothing: an attacker whose updates are only ever taken weakly) follows
    at the full weight."""
    full = 1.0 - policy.reference_decay
    if gate.reference is None:
        return 1.0
    others = sum(gate.shares.get(p, 0.0) for p in sorted(set(gate.present) - {peer}))  # sorted: the same sum in a replay
    if others < 0.05:
        return full
    mine = gate.shares.get(peer, 0.0)
    capped = (policy.reference_share - mine) / (1.0 - mine) if mine < 1.0 else 0.0
    return min(full, max(capped, full / 4.0))


def join_reference(
    policy: GatePolicy, gate: GateState, update: torch.Tensor, norm: float, peer: str, sketcher: Sketcher | None = None
) -> None:
    """``r ← (1−w)·r + w·Δ/‖Δ‖`` with ``w`` from :func:`reference_weight`, and every peer's share (and its last
    update's part of ``r``: kept whole for θ of at most :data:`OWN_PARTS_MAX` values, :func:`others_reference`; as the
    secret ``sketcher``'s sketch above that, :func:`own_cosine`) with it."""
    weight = reference_weight(policy, gate, peer)
    if gate.reference is None:
        gate.reference = update / norm
    else:
        gate.reference.mul_(1.0 - weight).add_(update, alpha=weight / norm)
    for other in list(gate.shares):
        gate.shares[other] *= 1.0 - weight
        if gate.shares[other] < 1e-6:  # bounded: a peer gone for long holds nothing
            del gate.shares[other]
    gate.shares[peer] = gate.shares.get(peer, 0.0) + weight
    gate.reference_norm = float(torch.linalg.vector_norm(gate.reference))
    if update.numel() > OWN_PARTS_MAX:
        if sketcher is not None:
            # r·p of the other parts: [(1−w)·r + w·û]·[(1−w)·p] = (1−w)²·r·p + w·û·p', û·p' from the sketches
            joined = sketcher(update) * (1.0 / norm)
            for other in list(gate.own_sketch):
                if other not in gate.shares or other not in gate.own_dot:
                    gate.own_sketch.pop(other), gate.own_weight.pop(other, None), gate.own_dot.pop(other, None)
                elif other != peer:
                    gate.own_sketch[other].mul_(1.0 - weight)
                    gate.own_weight[other] *= 1.0 - weight
                    gate.own_dot[other] = ((1.0 - weight) ** 2 * gate.own_dot[other]
                                           + weight * sketcher.dot(joined, gate.own_sketch[other]))
            gate.own_sketch[peer] = joined * weight
            gate.own_weight[peer] = weight
            gate.own_dot[peer] = weight * float(torch.dot(gate.reference, update)) / norm  # exact: both are here
        return
    for other in list(gate.own):
        if other not in gate.shares:
            del gate.own[other]
        elif other != peer:
            gate.own[other].mul_(1.0 - weight)
    gate.own[peer] = update * (weight / norm)


def others_reference(gate: GateState, peer: str) -> tuple[torch.Tensor, float] | None:
    """The reference without ``peer``'s last update in it, and its norm — what ``peer``'s next update is judged
    against (None: none of it is kept, or nothing else is left: judged against the whole reference).

    Why: with error feedback a peer's upload carries ``+β·e``, its last upload's coding error, and the reference holds
    that last upload, which carried ``−e``; so each upload is anticorrelated with its sender's last one by about
    ``β·‖e‖²`` — for a sign code, whose error is as large as the update, enough to put many honest sign-coded updates
    below the cosine cap (docs/compression.md, "The gate and the sign code"). Earlier uploads' errors are independent
    of the next one's and stay: only the last part is taken out, so a peer's own consistent direction still counts
    (judged against the other peers' alone, an honest peer outweighed by a newcomer's direction was refused)."""
    part = gate.own.get(peer)
    if part is None or gate.reference is None:
        return None
    rest = gate.reference - part
    rest_norm = float(torch.linalg.vector_norm(rest))
    if not rest_norm > 1e-6 * max(gate.reference_norm, 1e-30):
        return None
    return rest, rest_norm


def own_cosine(
    gate: GateState, peer: str, update: torch.Tensor, norm: float, sketcher: Sketcher | None = None
) -> float | None:
    """The cosine of ``update`` (of norm ``norm``) with the reference without ``peer``'s last update in it
    (:func:`others_reference`, whose docstring says why); None: judge it against the whole reference.

    For θ above :data:`OWN_PARTS_MAX` values that part ``p`` is known only by its secret sketch and its weight ``w``
    (= ‖p‖): ``Δ·(r − p) = Δ·r − Δ·p`` and ``‖r − p‖² = ‖r‖² − 2 r·p + w²``, with ``Δ·p`` estimated from the sketches
    (an attacker cannot aim at buckets it does not know) and ``r·p`` tracked by :func:`join_reference` (exact when
    the part joins; each later join adds a sketched term scaled by its weight). While the rest keeps less than
    :data:`OWN_REST_MIN` of the reference's norm (a peer nearly alone in it) the estimate's spread would count:
    judged against the whole reference, as without a part."""
    if gate.reference is None or not gate.reference_norm > 0 or not norm > 0:
        return None
    others = others_reference(gate, peer)
    if others is not None:
        return float(torch.dot(update, others[0])) / (norm * others[1])
    part = gate.own_sketch.get(peer)
    if part is None or sketcher is None or sketcher.numel != update.numel() or part.numel() != sketcher.ends.numel():
        return None
    weight, reference_part = gate.own_weight.get(peer), gate.own_dot.get(peer)
    if weight is None or reference_part is None:
        return None
    update_part = sketcher.dot(sketcher(update), part)
    rest_squared = gate.reference_norm**2 - 2.0 * reference_part + weight**2
    if not rest_squared >= (OWN_REST_MIN * gate.reference_norm) ** 2:
        return None
    return (float(torch.dot(update, gate.reference)) - update_part) / (norm * math.sqrt(rest_squared))
