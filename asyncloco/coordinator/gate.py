"""The robust update gate: every pseudo-gradient is scored before it touches θ.

Pure and deterministic (no clock, no I/O, no global RNG): the coordinator logic calls :func:`score`
for an update that passed the structural checks (its lease, shape, dtype), applies the verdict, and
calls :func:`record` with what it did. The threat model — what the gate stops and what it cannot —
is in ``docs/threat-model.md``.

An update is judged against statistics of recently *accepted* updates, so no per-run tuning:

* **norm** — the per-step norm ``‖Δ‖ / steps`` (DyLU gives peers different step counts) against the
  median of the last ``window`` accepted ones: above ``clip_factor`` × median the update is scaled
  down to that bound (clipped), above ``reject_factor`` × median it is rejected. A non-finite norm
  (NaN, Inf, or values whose squares overflow float32) is always rejected.
* **direction** — the cosine between Δ and a *reference direction*, an exponential moving average of
  the unit vectors of accepted updates (the recent consensus of the honest peers). An update whose
  cosine falls below ``min(cosine_cap, max(median − cosine_mads × MAD, −flip_margin × median))`` of the
  recent accepted cosines is rejected: a sign-flipped or random update points away from (or orthogonally to) where everyone
  else is going, while honest updates of one run agree with each other.

**weak agreement** — below that bar but not pointing away (cosine ≥ −flip_margin × median), and not clearly uphill
on the probe: from a peer past probation the update is *accepted*, scaled down to at most the median per-step
norm and kept out of the statistics (see ``_weak``; refusing it wasted honest work and stopped no
shaped attack); from a peer on probation it is refused without counting.

Until ``warmup`` updates have been accepted the relative checks have no statistics; the norm is then
judged against the median of what was accepted so far, with ``reject_factor`` only (so the first
update of a run is taken as it is, and one early hostile update cannot be far above its peers).

**probe** — the tie-breaker of the gray zone. The daemon (which holds the model) evaluates the loss on a
small fixed probe batch at θ and at θ − s·Δ (``s`` = ``probe_step``: a short step along the candidate's
local progress) *before* it calls
``handle`` and passes both losses in the ``SubmitUpdate`` event (so they are in the write-ahead log and a
replay makes the same decision without a model: :func:`score` stays pure). For an update in the gray zone
— after warm-up, a cosine in [−flip_margin × median, max(cosine_cap, probe_below × median)), and from a peer past
probation also below that (pointing away: taken with weak agreement only if the probe falls,
:func:`_probe_away`) — a probe loss
that rises by more than ``probe_margin`` (relative, scaled by ``sqrt(steps / full_steps)``: :func:`probe_margin`) rejects it (counted
toward quarantine when above ``probe_count_factor`` × that: it makes the model worse), one that falls by
more accepts it even if its cosine is
weakly negative, and one in between is refused without counting (no evidence that it helps: where a random
direction lands). A peer on probation needs only to lower it: an honest newcomer's first updates (fresh
AdamW state) point slightly against the consensus and move θ little, but downhill. The probe judges the *direction* (is Δ a descent direction on data no peer
trains on?), not the step size — that is the norm check's job — hence the short step: a fresh AdamW state
moves every parameter by about the learning rate per step, so a newcomer's first update is ≈ 3× the norm
of its peers' and overshoots at the full step (probe loss +1.5 % at s = 1 in a test run) although it is a
descent direction (−0.18 % at s = 0.2, where a sign-flipped update gave +0.5 % and a random one ±0.01 %).
Which updates the daemon probes: :func:`wants_probe` (by the model's size and the peer's probation) and
:func:`needs_probe` (only those in the gray zone, where :func:`score` reads it).

Peers start on **probation**: for their first ``probation_updates`` accepted updates, the bounds are
tightened by ``probation_tightening`` (the norm bounds shrink, the cosine threshold rises), and a
rejection on probation counts twice. A peer with ``quarantine_after`` rejections among its last
``quarantine_window`` verdicts (direction rejections count only when the cosine is below
−``flip_margin`` × median: pointing away, not merely agreeing weakly) is **quarantined** for ``quarantine_s`` seconds (doubling each time):
the logic refuses it leases.

**No one peer owns the consensus**: an accepted update joins the reference with weight ``w = 1 − d`` unless its
peer already holds ``reference_share`` of the reference's weight while other present peers hold some; then ``w``
shrinks to keep it there, but never below ``(1 − d) / 4`` (the reference never freezes). Without this a peer with
a consistent direction of its own (an honest newcomer's fresh AdamW state) became the consensus within a few
updates while the others' weakly agreeing updates stayed out of it, until their honest work looked like
pointing away (:func:`reference_weight`).

Cost: two dot products over θ to score (‖Δ‖², Δ·r) and, for an accepted update, one fused
``r ← (1−w)·r + w·Δ/‖Δ‖`` plus one norm to keep the reference — no θ-sized allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Literal

import torch

from asyncloco.coordinator.gate_state import (
    OWN_PARTS_MAX, UNKNOWN_LEASE, GatePolicy, GateState, join_reference, others_reference, own_cosine, reference_weight,
)
from asyncloco.coordinator.sketch import Sketcher

__all__ = [
    "GatePolicy", "GateState", "GateVerdict", "score", "record", "is_quarantined", "adamw_norm_bound", "probe_margin", "wants_probe", "needs_probe", "suspect", "close_bar", "reference_weight",
    "others_reference", "own_cosine", "OWN_PARTS_MAX", "UNKNOWN_LEASE", "explain_weak",
]


def adamw_norm_bound(lr_max: float, numel: int, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """A ceiling on ``‖Δ‖`` per inner AdamW step of an honest peer: Adam's normalised step is at most
    (1 − β1) / sqrt(1 − β2) per element in the worst case of bias correction (≈ 3.2 at the defaults) and
    never much above 1 in practice; times η_max, times sqrt(numel); weight decay adds η·λ·|θ| (taken with
    |θ| ≤ 10). Doubled for safety: no honest update comes near it, a scaled-up one does."""
    per_element = max(1.0, (1.0 - betas[0]) / math.sqrt(1.0 - betas[1])) + 10.0 * weight_decay
    return 2.0 * lr_max * per_element * math.sqrt(numel)


@dataclass(frozen=True)
class GateVerdict:
    action: Literal["accept", "clip", "reject"]
    scale: float  # multiply Δ by this before applying (1.0 unless clipped)
    norm: float
    cosine: float | None
    reason: str
    counts: bool = True  # a rejection that counts toward quarantine (False: merely weak agreement)
    weak: bool = False  # accepted with weak agreement (see _weak): applied, but kept out of the gate's statistics
    # for a rejection only the probe shows (the update raises the probe-batch loss): the verdict to apply it with when
    # its re-run agrees — a run that verifies work holds it for a check instead of refusing it (logic/submit.py)
    if_checked: "GateVerdict | None" = None


def _weak(policy: GatePolicy, per_step: float, typical: float, norm: float, cosine: float | None, why: str) -> GateVerdict:
    """The verdict for an established peer's update that agrees only weakly with the consensus and that the probe
    does not show making the model worse: accepted, scaled down to at most the recent median per-step norm.

    Refusing it wasted honest work (11 honest refusals at cosine −0.01 in one run of the attack suite —
    a slow peer's stale or short lease, judged against a consensus dominated by the fastest peer, agrees weakly
    and is still honest) and bought no safety: an attacker shapes its update to pass any such bar (a few % of
    the consensus direction added is enough), which is what verification (coordinator/verify.py) is for. What
    stays refused: directions pointing *away* (counted), updates that clearly raise the probe loss (counted),
    norms beyond the bounds, and weak agreement from a peer on probation (it has shown no honest work yet)."""
    # (a float32 norm a rounding above the median is taken as it is)
    scale = typical / per_step if typical > 0 and per_step > typical * (1.0 + 1e-6) else 1.0
    shown = "" if cosine is None else f" (cosine {cosine:.3f} with the consensus)"
    return GateVerdict(
        "clip" if scale < 1.0 else "accept", scale, norm, cosine,
        f"accepted with weak agreement{shown}: {why}; at most the median norm, kept out of the gate's statistics",
        weak=True,
    )


def _mad(values: list[float], center: float) -> float:
    return median(abs(v - center) for v in values)


def close_bar(policy: GatePolicy, cosines: list[float]) -> float:
    """The cosine from which an applied update counts as *close to an echo* of the consensus (:func:`suspect`):
    ``suspect_cosine``, raised to median + ``suspect_mads`` × MAD of the recent accepted cosines where honest work
    itself agrees closely, and never above the echo bar (:func:`score` refuses from there)."""
    center = median(cosines)
    spread = max(_mad(cosines, center), 1e-3)
    # score's echo bar; where the consensus itself is that tight (median >= echo_cosine) both are off
    echo = policy.echo_cosine if center < policy.echo_cosine else math.inf
    return min(echo, max(policy.suspect_cosine, center + policy.suspect_mads * spread))


def suspect(gate: GateState, peer: str) -> str:
    """Why ``peer`` deserves more verification (``verify_reason`` in coordinator/logic/draws.py), or "". Cheap signals, each
    a reason to re-run more of the peer's leases, never to refuse its work (docs/threat-model.md has their
    false-positive rates on the honest peers of the attack benchmark):

    * a counted rejection among its recent verdicts;
    * an update taken with weak agreement (where an attacker shaped to pass the gate lands, honest work rarely) whose
      check has not agreed (:func:`explain_weak`: one that did is honest work's, and no signal);
    * a rejection on the probe's word alone that could not be re-run instead (``record``'s ``doubted``);
    * an applied update close to an echo of the consensus (cosine ≥ :func:`close_bar`, below the echo bar that
      refuses): a free-rider's echo scaled or noised to stay under the bar, and a peer that has steered the
      consensus its own way (three colluding identities with one hidden direction agreed at 0.82-0.92 with the
      consensus they dominated; honest updates at most 0.824, median 0.33, over the benchmark's runs)."""
    if any(gate.verdicts.get(peer, ())):
        return "recently refused by the gate"
    if any(gate.weak.get(peer, ())):
        return "recently agreed only weakly with the consensus"
    if any(gate.doubted.get(peer, ())):
        return "recently refused by the gate's probe, unchecked"
    if any(gate.close.get(peer, ())):
        return "recently agreed with the consensus almost like an echo of it"
    return ""


def explain_weak(gate: GateState, peer: str, lease_id: str) -> bool:
    """A check of ``peer``'s lease ``lease_id`` agreed: if its update was taken with weak agreement, that is no longer a
    suspect's signal — its bitwise re-run shows it is what honest work on that lease gives, so the weak agreement says
    nothing about the peer (the signal is for updates shaped to pass the gate, docs/threat-model.md). The flag goes;
    the update stays applied as it was (weakly: that is about its direction). An attacker clears a flag only by
    doing the flagged lease honestly. Returns whether a flag was cleared."""
    marks = gate.weak.get(peer, [])
    cleared = False
    for index, lease in enumerate(marks):
        if lease and lease != UNKNOWN_LEASE and lease == lease_id:
            marks[index] = ""
            cleared = True
    return cleared


def is_quarantined(gate: GateState, peer: str, now: float) -> bool:
    return gate.quarantined_until.get(peer, -math.inf) > now


def wants_probe(policy: GatePolicy, gate: GateState, peer: str, numel: int) -> bool:
    """Whether the daemon should evaluate the probe losses for an update of ``peer`` (decided without touching
    Δ, so it costs nothing when the answer is no): every update of a model up to ``probe_all_below_params``
    (two forward passes on the probe batch are cheap there, and :func:`score` uses them only in the gray
    zone), up to ``probe_max_params`` only a peer's probation updates — where the gray zone is — and above
    that never: the daemon evaluates the probe holding its lock, and at the 150m preset on a CPU coordinator
    that is tens of seconds (docs/threat-model.md); raise it for a coordinator with a GPU
    (``runtime.eval_device``)."""
    if not policy.probe or numel > policy.probe_max_params:
        return False
    return numel <= policy.probe_all_below_params or gate.peer_accepted.get(peer, 0) < policy.probation_updates


@dataclass(frozen=True)
class _Update:
    """What every check of :func:`score` reads about one update, computed once."""

    steps: int
    norm: float
    per_step: float
    typical: float  # the recent median per-step norm (> 0 unless every recent norm was 0)
    cosine: float | None  # with the consensus (gate.reference), None without one
    probation: bool
    tight: float  # probation_tightening on probation, else 1
    on: str  # " (peer on probation)" or ""
    warm: bool  # the gate has accepted warm-up updates: adaptive bars apply


def score(
    policy: GatePolicy,
    gate: GateState,
    update: torch.Tensor,
    steps: int,
    peer: str,
    bound_per_step: float | None = None,
    probe: tuple[float, float] | None = None,
    proven: bool = False,
    sketcher: Sketcher | None = None,
) -> GateVerdict:
    """Judge ``update`` (flat fp32, not modified) from a lease of ``steps`` local steps.

    ``bound_per_step``: an absolute ceiling on ``‖Δ‖ / steps`` that holds for any honest peer whatever the
    statistics say (for inner AdamW: a few × η_max × sqrt(numel), see ``adamw_norm_bound``); it guards the
    first updates of a run, before there is a median to compare with.

    ``probe``: the loss on the coordinator's probe batch at θ and at θ − probe_step·Δ (module docstring), or None
    when the daemon did not evaluate it; it decides updates in the gray zone.

    ``proven``: the peer has shown honest work by a stronger test than the gate's — its verification probation (its
    first leases re-run bitwise) — so it is judged as past the gate's probation, however few of its updates the gate
    has accepted (the gate's probation exists for peers that have shown nothing yet).

    ``sketcher``: the run's secret sketch of each peer's last update in the reference, for θ above
    ``OWN_PARTS_MAX`` values (gate_state.py :func:`own_cosine`; CoordinatorState.own_sketcher); without it such an
    update is judged against the whole reference.

    The checks, in order, each its own function: finite and bounded norm (here), the norm against the recent
    median (:func:`_norm_check`), echoing the consensus (:func:`_echo_check`), the probe in the gray zone
    (:func:`_probe_check`), the direction against the consensus (:func:`_cosine_check`), then clipping
    (:func:`_clip_or_accept`). The first verdict wins."""
    seen = _prepare(policy, gate, update, steps, peer, bound_per_step, proven, sketcher)
    if isinstance(seen, GateVerdict):
        return seen
    verdict = _norm_check(policy, seen) or _echo_check(policy, gate, seen)
    if verdict is not None:
        return verdict
    probed = ""  # set when the probe vouched for the update's direction
    if probe is not None and policy.probe:
        outcome = _probe_check(policy, gate, seen, probe)
        if isinstance(outcome, GateVerdict):
            return outcome
        probed = outcome
    if not probed:
        verdict = _cosine_check(policy, gate, seen)
        if verdict is not None:
            return verdict
    return _clip_or_accept(policy, seen, probed)


def _prepare(
    policy: GatePolicy, gate: GateState, update: torch.Tensor, steps: int, peer: str, bound_per_step: float | None,
    proven: bool = False, sketcher: Sketcher | None = None,
) -> GateVerdict | _Update:
    """The verdicts that need no statistics (non-finite, above the absolute bound, the run's first update), or
    what the other checks read about the update."""
    squared = float(torch.dot(update, update))
    if not math.isfinite(squared):
        return GateVerdict("reject", 0.0, math.nan, None, "pseudo-gradient contains NaN or Inf, or its norm overflows float32")
    norm = math.sqrt(squared)
    per_step = norm / max(1, steps)
    if bound_per_step is not None and per_step > bound_per_step:
        return GateVerdict(
            "reject", 0.0, norm, None,
            f"per-step norm {per_step:.4g} exceeds what inner AdamW can move θ in one step ({bound_per_step:.4g})",
        )
    if not gate.norms:
        return GateVerdict("accept", 1.0, norm, None, "first update of the run: no statistics yet")
    probation = not proven and gate.peer_accepted.get(peer, 0) < policy.probation_updates
    cosine = None
    if gate.reference is not None and gate.reference_norm > 0 and norm > 0:
        cosine = own_cosine(gate, peer, update, norm, sketcher)  # the consensus without the peer's own part (gate_state.py)
        if cosine is None:
            cosine = float(torch.dot(update, gate.reference)) / (norm * gate.reference_norm)
    return _Update(
        steps, norm, per_step, median(gate.norms), cosine, probation,
        policy.probation_tightening if probation else 1.0, " (peer on probation)" if probation else "",
        gate.accepted >= policy.warmup,
    )  # fmt: skip


def needs_probe(
    policy: GatePolicy, gate: GateState, update: torch.Tensor, steps: int, peer: str, bound_per_step: float | None = None,
    proven: bool = False, sketcher: Sketcher | None = None,
) -> bool:
    """Whether :func:`score` with these arguments would read the probe: the update passes the checks before it
    and lies in the gray zone. For any other update the verdict is the same with or without the probe, so the
    daemon evaluates the probe's two forward passes only when this says yes (at the 20m preset on a CPU
    coordinator they cost seconds under the lock; docs/threat-model.md). Costs two dot products over Δ."""
    if not policy.probe:
        return False
    seen = _prepare(policy, gate, update, steps, peer, bound_per_step, proven, sketcher)
    if isinstance(seen, GateVerdict) or _norm_check(policy, seen) or _echo_check(policy, gate, seen):
        return False
    return _in_gray_zone(policy, gate, seen)


def probe_margin(policy: GatePolicy, steps: int) -> float:
    """The relative probe-loss change that counts as evidence for a lease of ``steps`` local steps: ``probe_margin``
    for a full lease (``full_steps``), shrinking with the square root of the steps for a shorter one. A shorter lease
    moves θ less: its mean effect on the probe loss shrinks in proportion to its steps, but its noise (how far an
    honest lease's effect strays from that mean) only about with their square root — measured on the demo model
    (scripts/probe_noise.py, 48 honest leases per length from one warm θ): median −0.015 % and at most +0.008 % for
    one-step leases, median −0.58 % and spread ≈ 0.2 % for 30-step ones. Scaled linearly (0.0017 % for one step of
    30), the margin counted the noise of the one-step leases a repair hands out to re-train a range as a clear rise
    and quarantined honest peers (docs/threat-model.md, "The probe")."""
    return policy.probe_margin * math.sqrt(min(1.0, max(1, steps) / max(1, policy.full_steps)))


def _away_bar(policy: GatePolicy, gate: GateState) -> float:
    """The cosine below which an update points *away* from the consensus: −flip_margin × the recent median."""
    center = median(gate.cosines)
    return -policy.flip_margin * center if center > 0 else -math.inf


def _in_gray_zone(policy: GatePolicy, gate: GateState, seen: _Update) -> bool:
    """A direction that agrees weakly with the recent consensus, or — from a peer past probation — one that points
    away from it (below −flip_margin × median), where the probe decides (:func:`_probe_away`). From a peer on
    probation a direction pointing away is not gray: the cosine rule rejects it, counted, whatever 8 rows of loss
    say (a sign-flipped newcomer update at cosine −0.55 lowered the probe loss by 0.02 % in a test run). Not
    before warm-up: the first updates of a run, from random initialisation, overshoot (two honest ones at cosine
    0.75 raised the probe loss by 2 % in a clean benchmark run); the absolute norm bound guards them."""
    cosine = seen.cosine
    if not (seen.warm and cosine is not None and len(gate.cosines) >= 3):
        return False
    lowest = _away_bar(policy, gate) if seen.probation else -math.inf
    return lowest <= cosine < max(policy.cosine_cap, policy.probe_below * median(gate.cosines))


def _probe_away(policy: GatePolicy, seen: _Update, before: float, after: float, margin: float) -> GateVerdict:
    """An established peer's update pointing away from the consensus, judged by the probe. Honest updates land
    here (three at cosine −0.06…−0.13 against a median of 0.20–0.23, refused as pointing away in one
    suite run under load — the bar −0.25 × median is near zero when the consensus is spread): one that lowers the
    probe loss by more than the margin is taken with weak agreement; one that raises it by more is rejected and
    counted (a sign-flipped update goes uphill); one that lowers it by less, or raises it by no more than the
    margin, is taken with weak agreement too (a captured or weak consensus, below)."""
    cosine = seen.cosine
    if math.isfinite(before) and math.isfinite(after) and after < before * (1.0 - margin):
        return _weak(policy, seen.per_step, seen.typical, seen.norm, cosine,
                     f"points away from the consensus, but lowers the probe-batch loss {before:.5f} → {after:.5f} "
                     f"(more than the {100 * margin:.3g} % margin)")
    if math.isfinite(before) and math.isfinite(after) and after < before:
        # Downhill, by less than the margin: from an established peer that is honest work against a consensus one
        # peer has captured (a suite run: an honest newcomer's fresh-AdamW direction held ≈ 0.7 of the reference,
        # and the two established peers' updates, at cosine −0.09…−0.17 and lowering the probe loss by ≈ 0.03 %,
        # were refused 97 times in a row: their refusals kept them out of the reference, which kept them pointing
        # away), or the noise of a sign code's error feedback (docs/compression.md). Taken at no more than the
        # median norm and kept out of the statistics; a sign-flipped update goes uphill (below) and is counted.
        return _weak(policy, seen.per_step, seen.typical, seen.norm, cosine,
                     f"points away from the consensus, but lowers the probe-batch loss {before:.5f} → {after:.5f} "
                     f"(within the {100 * margin:.3g} % margin)")
    if math.isfinite(before) and math.isfinite(after) and after <= before * (1.0 + margin):
        # Flat within the margin: the probe cannot tell it from honest work where the consensus is weak. In a
        # fresh-clone CI run of test_attacks_on_one_coordinator, 9 of an honest peer's 148 updates came in
        # pointing away (cosine −0.18) and moved the probe loss by about +0.003 %: refused. On the loss plateau of
        # that test two honest peers' updates agree with the consensus at −0.11…+0.07 (local runs), so the "away"
        # bar (−0.25 × median) is near 0. A sign-flipped update goes uphill by about what the honest one lowers it
        # (more than the margin: rejected, counted); one shaped to stay inside it is bounded to the median norm, kept
        # out of the statistics and left to verification.
        return _weak(policy, seen.per_step, seen.typical, seen.norm, cosine,
                     f"points away from the consensus; the probe-batch loss {before:.5f} → {after:.5f} does not "
                     f"rise by more than the {100 * margin:.3g} % margin")
    uphill = math.isfinite(before)  # else no probe reading at θ: nothing shown either way
    reason = (f"direction points away from the recent consensus (cosine {cosine:.3f}) and "
              + (f"raises the probe-batch loss {before:.5f} → {after:.5f} (limit +{100 * margin:.3g} %)" if uphill else
                 f"the probe-batch loss at θ is not finite ({before}); not counted toward quarantine"))
    return GateVerdict("reject", 0.0, seen.norm, cosine, reason, counts=uphill,
                       if_checked=_weak(policy, seen.per_step, seen.typical, seen.norm, cosine, reason) if uphill else None)


def _norm_check(policy: GatePolicy, seen: _Update) -> GateVerdict | None:
    """Reject a per-step norm far above the recent median (tighter on probation)."""
    if seen.typical > 0:
        ratio = seen.per_step / seen.typical
        reject_at = max(policy.clip_factor, policy.reject_factor * seen.tight)
        if ratio > reject_at:
            return GateVerdict(
                "reject", 0.0, seen.norm, None,
                f"per-step norm {seen.per_step:.4g} is {ratio:.3g}× the recent median {seen.typical:.4g} (limit "
                f"{reject_at:g}×){seen.on}",
            )
    return None


def _echo_check(policy: GatePolicy, gate: GateState, seen: _Update) -> GateVerdict | None:
    """Free-riding: an update that echoes the consensus — the newest θ difference, rescaled to an
    honest norm — is no work of its own, and fed back through the outer momentum it drove the demo's model to a
    perplexity of 1e16-1e22 in the attack benchmark (37 of 62 updates were the free-rider's: not training, it
    turns leases round at once). Honest updates never agree that closely: the highest cosine of an honest update
    over 18 benchmark runs was 0.82 (median 0.3), the echo's median 0.96. The bar is a fixed echo_cosine, not one
    that follows the recent cosines: the echo's own accepted updates fill the window (a bar at median + 6 MAD
    climbed to 0.999 in a benchmark run and let it through). Only where the run's consensus is itself that tight
    (median >= echo_cosine: a small model) is the check off."""
    cosine = seen.cosine
    if not (seen.warm and cosine is not None and len(gate.cosines) >= 3):
        return None
    center = median(gate.cosines)
    if center < policy.echo_cosine <= cosine:
        return GateVerdict(
            "reject", 0.0, seen.norm, cosine,
            f"echoes the consensus: cosine {cosine:.3f} >= {policy.echo_cosine:.3f} (median {center:.3f}); no "
            f"honest update agrees this closely — work of others sent as its own{seen.on}",
        )
    return None


def _probe_check(policy: GatePolicy, gate: GateState, seen: _Update, probe: tuple[float, float]) -> GateVerdict | str:
    """The probe decides the gray zone: a verdict, or the text saying that the probe vouched for the update's
    direction ("" when the update is not in the gray zone or the probe did not vouch)."""
    before, after = float(probe[0]), float(probe[1])
    cosine, probation, on = seen.cosine, seen.probation, seen.on
    if not _in_gray_zone(policy, gate, seen):
        return ""
    margin = probe_margin(policy, seen.steps)
    if cosine is not None and cosine < _away_bar(policy, gate):  # past probation: _in_gray_zone
        return _probe_away(policy, seen, before, after, margin)
    if not math.isfinite(after) or (math.isfinite(before) and after > before * (1.0 + margin)):
        rise = (after - before) / before if before > 0 and math.isfinite(after) else math.inf
        agreement = "" if cosine is None else f", cosine {cosine:.3f} with the consensus"
        # a small rise can be the probe batch's noise on honest work: only a clear one counts
        counted = rise > policy.probe_count_factor * margin
        if not counted and not probation:
            return _weak(policy, seen.per_step, seen.typical, seen.norm, cosine,
                         f"probe-batch loss {before:.5f} → {after:.5f} (+{100 * rise:.3g} %, within "
                         f"{policy.probe_count_factor:g} × the {100 * margin:.3g} % margin: the probe's noise)")
        reason = (f"raises the probe-batch loss {before:.5f} → {after:.5f} (+{100 * rise:.3g} %, limit "
                  f"{100 * margin:.3g} %){agreement}{on}")
        # (a probe batch of a few rows is noisy: honest cold-start updates rose by 0.2-1.5 % in the attack benchmark;
        # a run that verifies holds such an update for a check and applies it, at most at the median norm, if it agrees)
        checked = _weak(policy, seen.per_step, seen.typical, seen.norm, cosine, reason) if math.isfinite(after) else None
        return GateVerdict("reject", 0.0, seen.norm, cosine,
                           reason + ("" if counted else "; not counted toward quarantine"), counts=counted,
                           if_checked=checked)
    # A peer on probation needs only to lower the loss: a newcomer's first updates (fresh AdamW state, or a short
    # lease) move θ little and noisily — but downhill, where a sign-flipped one goes uphill. An established peer in
    # the gray zone must lower it by the margin.
    wanted = before if probation else before * (1.0 - margin)
    if not (math.isfinite(before) and after < wanted) and not probation and math.isfinite(before):
        # an established peer's weakly agreeing update that does not help measurably: honest work of a slow or
        # short lease often lands here — taken at no more than the median norm
        return _weak(policy, seen.per_step, seen.typical, seen.norm, cosine,
                     f"does not lower the probe-batch loss by more than {100 * margin:.3g} % ({before:.5f} → {after:.5f})")
    if not (math.isfinite(before) and after < wanted):
        # no evidence that it helps: a random direction lands here (±0.01 % where honest updates lower the loss by
        # 0.1-0.4 %) — refused like a weakly agreeing direction, not counted toward quarantine
        agreement = "" if cosine is None else f"; cosine {cosine:.3f} with the consensus"
        return GateVerdict(
            "reject", 0.0, seen.norm, cosine,
            f"does not lower the probe-batch loss{'' if probation else f' by more than {100 * margin:.3g} %'} "
            f"({before:.5f} → {after:.5f}){agreement}{on}; not counted toward quarantine",
            counts=False,
        )
    return f"; lowers the probe-batch loss {before:.5f} → {after:.5f}"


def _cosine_check(policy: GatePolicy, gate: GateState, seen: _Update) -> GateVerdict | None:
    """The direction against the consensus, for updates the probe did not vouch for.

    Honest updates of one run agree with the consensus (cosines 0.2-0.9 in the demo), a sign-flipped one
    (≈ −median) or a random one (≈ 0 in high dimension) does not. The bar is adaptive, but
    - never higher than cosine_cap: a slow peer's stale, short-lease update agrees less (0.18 seen against a
      median of 0.77 early in a demo run) and is still honest work;
    - never lower than −flip_margin × median: where honest cosines are spread out (median 0.34, MAD 0.11 in a
      demo run) median − 6 MAD fell to −0.29 and let sign-flipped updates (≈ −0.34) in, whose acceptance then
      dragged the consensus along."""
    cosine = seen.cosine
    if not (seen.warm and cosine is not None and len(gate.cosines) >= 3):
        return None
    center = median(gate.cosines)
    spread = max(_mad(gate.cosines, center), 1e-3)
    threshold = center - policy.cosine_mads * seen.tight * spread
    if center > 0:
        threshold = max(threshold, -policy.flip_margin * center)
    threshold = min(policy.cosine_cap, threshold)
    if cosine >= threshold:
        return None
    # Only a direction that points away from the consensus counts toward quarantine. A weakly agreeing one (≈ 0:
    # a random direction, but also an honest newcomer's first updates or a stale one after a restart) is refused
    # without counting, so an honest peer is never quarantined for it.
    away = cosine < (-policy.flip_margin * center if center > 0 else threshold)
    if not away and not seen.probation:
        return _weak(policy, seen.per_step, seen.typical, seen.norm, cosine,
                     f"cosine {cosine:.3f} < {threshold:.3f} (median {center:.3f}, MAD {spread:.3f})")
    return GateVerdict(
        "reject", 0.0, seen.norm, cosine,
        f"direction disagrees with the recent consensus: cosine {cosine:.3f} < {threshold:.3f} "
        f"(median {center:.3f}, MAD {spread:.3f}){seen.on}" + ("" if away else "; not counted toward quarantine"),
        counts=away,
    )


def _clip_or_accept(policy: GatePolicy, seen: _Update, probed: str) -> GateVerdict:
    """After warm-up a norm above clip_factor × the median is scaled down to it; anything else passes."""
    cosine = seen.cosine
    if seen.warm and seen.typical > 0:
        clip_at = max(1.0, policy.clip_factor * seen.tight)
        if seen.per_step > clip_at * seen.typical:
            scale = clip_at * seen.typical / seen.per_step
            return GateVerdict(
                "clip", scale, seen.norm, cosine,
                f"per-step norm {seen.per_step:.4g} clipped to {clip_at:g}× the recent median {seen.typical:.4g}{seen.on}"
                + ("" if cosine is None else f" (cosine {cosine:.3f} with the consensus{probed})"),
            )
    agreement = "" if cosine is None else f" (cosine {cosine:.3f} with the consensus{probed})"
    if cosine is None and probed:
        agreement = f" ({probed[2:]})"
    return GateVerdict("accept", 1.0, seen.norm, cosine, f"passed the gate{agreement}")


def record(
    policy: GatePolicy, gate: GateState, verdict: GateVerdict, update: torch.Tensor | None, steps: int, peer: str, now: float,
    sketcher: Sketcher | None = None, doubted: bool = False, lease_id: str = "", checked: bool = False,
) -> str | None:
    """Book a verdict. ``update`` is the update as applied (after clipping), or None when it was rejected.
    ``doubted``: a rejection on the probe's word alone that could not be turned into a check (logic/submit.py) — it
    makes the peer a suspect (its next leases re-run more) but does not count toward quarantine.
    ``lease_id``: the update's lease; ``checked``: its re-run already agreed (a held update applied at its verdict) —
    weak agreement is then no suspect's signal (:func:`explain_weak`).
    Returns the reason when this verdict put ``peer`` into quarantine."""
    rejected = verdict.action == "reject"
    counted = rejected and verdict.counts and not doubted
    doubts = gate.doubted.setdefault(peer, [])
    doubts.append(rejected and doubted)
    del doubts[: max(0, len(doubts) - policy.quarantine_window)]
    # judged against the statistics before this update joins them (as score judged it)
    close = (
        not rejected and verdict.cosine is not None and gate.accepted >= policy.warmup and len(gate.cosines) >= 3
        and verdict.cosine >= close_bar(policy, gate.cosines)
    )
    near = gate.close.setdefault(peer, [])
    near.append(close)
    del near[: max(0, len(near) - policy.quarantine_window)]
    history = gate.verdicts.setdefault(peer, [])
    probation = gate.peer_accepted.get(peer, 0) < policy.probation_updates
    history.extend([counted, counted] if (counted and probation) else [counted])
    del history[: max(0, len(history) - policy.quarantine_window)]
    weak = gate.weak.setdefault(peer, [])
    weak.append((lease_id or UNKNOWN_LEASE) if verdict.weak and not rejected and not checked else "")
    del weak[: max(0, len(weak) - policy.quarantine_window)]
    if not rejected and update is not None:
        gate.present.append(peer)
        del gate.present[: max(0, len(gate.present) - policy.window)]
    if not rejected and update is not None and verdict.weak:
        # applied, but not part of the consensus the gate judges others by (a weakly agreeing stream must not
        # pull the bar down for everyone)
        gate.accepted += 1
        gate.peer_accepted[peer] = gate.peer_accepted.get(peer, 0) + 1
        return None
    if not rejected and update is not None:
        norm = verdict.norm * verdict.scale
        gate.norms.append(norm / max(1, steps))
        if verdict.cosine is not None:
            gate.cosines.append(verdict.cosine)
        del gate.norms[: max(0, len(gate.norms) - policy.window)]
        del gate.cosines[: max(0, len(gate.cosines) - policy.window)]
        if norm > 0:
            join_reference(policy, gate, update, norm, peer, sketcher)
        gate.accepted += 1
        gate.peer_accepted[peer] = gate.peer_accepted.get(peer, 0) + 1
        return None
    if sum(history) >= policy.quarantine_after:
        count = gate.quarantines.get(peer, 0)
        duration = policy.quarantine_s * (2**count)
        gate.quarantines[peer] = count + 1
        gate.quarantined_until[peer] = now + duration
        history.clear()
        return f"{policy.quarantine_after} rejected updates among its last {policy.quarantine_window}: quarantined for {duration:.0f} s"
    return None
