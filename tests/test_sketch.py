"""The update sketch that finds sleepers (asyncloco/coordinator/sketch.py): a count sketch whose inner products
estimate the updates', deterministic; a peer whose consecutive updates keep a direction the others' do not becomes a
suspect on its second such update and has its next leases re-run, while peers whose updates differ from the
consensus by fresh noise each time are never flagged."""

from __future__ import annotations

import math

import pytest
import torch

from asyncloco.algo.outer import OuterNesterov
from asyncloco.coordinator.logic import (
    Assign, CoordinatorPolicy, Held, RequestWork, SpeedReport, SubmitUpdate, Verified, VerifyPolicy, handle, new_state,
)
from asyncloco.coordinator.sketch import BUCKETS, Sketcher, SketchState, observe

pytestmark = pytest.mark.timeout(120)

DIM = 20_000


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()))


def test_the_sketch_is_deterministic_linear_and_keeps_inner_products() -> None:
    sketcher = Sketcher(b"k" * 32, DIM)
    generator = torch.Generator().manual_seed(0)
    u, v, d = (torch.randn(DIM, generator=generator) for _ in range(3))
    assert sketcher(u).shape == (BUCKETS,) and sketcher(u).dtype == torch.float64
    assert torch.equal(sketcher(u), Sketcher(b"k" * 32, DIM)(u.clone()))  # the same bits from the same secret
    assert not torch.equal(sketcher(u), Sketcher(b"other", DIM)(u))  # another secret, other positions and signs
    assert torch.allclose(sketcher(u + v), sketcher(u) + sketcher(v), atol=1e-3)
    # every coordinate lands in one bucket with a sign ±1: the sketch's squared norm estimates the update's
    for i in range(0, DIM, 997):
        one_hot = torch.zeros(DIM)
        one_hot[i] = 1.0
        assert sorted(sketcher(one_hot).abs().tolist())[-2:] == [0.0, 1.0]
    # cosines survive within the estimate's spread (≈ 1/√BUCKETS)
    spread = 4.0 / math.sqrt(BUCKETS)
    assert abs(cosine(sketcher(u), sketcher(v)) - cosine(u, v)) < spread
    assert abs(cosine(sketcher(u + d), sketcher(v + d)) - cosine(u + d, v + d)) < spread
    # a model larger than the sample: positions are drawn from the secret, the estimate holds
    big = Sketcher(b"k" * 32, 1 << 20)
    x, y = torch.randn(1 << 20, generator=generator), torch.randn(1 << 20, generator=generator)
    assert big.index.numel() < 1 << 20 and abs(cosine(big(x + 2 * y), big(y)) - cosine(x + 2 * y, y)) < spread


def test_fresh_noise_is_never_flagged_and_a_persistent_direction_is_flagged_on_its_second_update() -> None:
    sketcher = Sketcher(b"s" * 32, DIM)
    sketches = SketchState()
    generator = torch.Generator().manual_seed(1)
    consensus = torch.randn(DIM, generator=generator)
    hidden = torch.randn(DIM, generator=generator)
    peers = ["h0", "h1", "h2", "s"]
    scores: dict[str, list[float]] = {peer: [] for peer in peers}
    flagged_at = None
    for round_index in range(60):
        for peer in peers:
            update = consensus + torch.randn(DIM, generator=generator)  # the consensus plus fresh noise (same norm)
            if peer == "s" and round_index >= 40:  # the sleeper turns: a fixed direction as large as its noise
                update = update + hidden * (float(update.norm()) / float(hidden.norm())) * 0.7
            score = observe(sketches, sketcher(update), peer, set(peers), threshold=0.35, checks=2)
            if score is not None:
                scores[peer].append(score)
            if peer == "s" and flagged_at is None and sketches.flagged.get("s"):
                flagged_at = round_index
    honest = [score for peer in ("h0", "h1", "h2") for score in scores[peer]] + scores["s"][:39]
    assert max(abs(score) for score in honest) < 0.35 and sketches.flags == 1
    assert flagged_at == 41  # its second tampered update: the first one's residual has nothing before it to agree with
    assert min(scores["s"][40:]) > 0.35
    assert set(sketches.flagged) == {"s"} and sketches.flagged["s"] == 2
    restored = SketchState.from_state_dict(sketches.state_dict())
    assert restored == sketches


def test_a_flagged_peer_has_its_next_leases_re_run() -> None:
    """In the logic: past probation and with fraction 0 nothing is re-run, until the sleeper's residual persists — then
    its next ``sketch_checks`` leases are checked (held until their verdicts), and then none again."""
    policy = CoordinatorPolicy(max_local_steps=4, grace_period=0.0, lease_timeout_factor=3.0, lease_slack=100.0,
                               verify=VerifyPolicy(fraction=0.0, probation_updates=0, sketch_threshold=0.35, sketch_checks=2))
    state = new_state(torch.zeros(DIM), OuterNesterov(0.1, 0.9), [], policy, [10_000], seed=3, lease_secret=b"q" * 32)
    generator = torch.Generator().manual_seed(2)
    consensus = torch.randn(DIM, generator=generator)
    hidden = torch.randn(DIM, generator=generator)
    peers = ["h0", "h1", "s"]
    for peer in peers:
        handle(state, SpeedReport(peer, 10.0), 0.0)
    reasons: list[str] = []
    now = 0.0
    for round_index in range(14):
        for peer in peers:
            now += 1.0
            lease = next(a.lease for a in handle(state, RequestWork(peer), now)[1] if isinstance(a, Assign))
            if peer == "s":
                reasons.append(lease.verify)
            else:
                assert lease.verify == ""
            update = 1e-3 * (consensus + torch.randn(DIM, generator=generator))
            if peer == "s" and round_index >= 6:
                update = update + 1e-3 * hidden * (float(consensus.norm()) / float(hidden.norm()))
            actions = handle(state, SubmitUpdate(peer, lease.lease_id, lease.base_version, update), now + 0.5)[1]
            if any(isinstance(a, Held) for a in actions):  # its check agrees (the test's sleeper is not re-run here)
                handle(state, Verified(peer, lease.lease_id, True, "bitwise"), now + 0.6)
    # rounds 0-7: nothing; the update of round 7 is its second tampered one: leases of rounds 8 and 9 are re-run; its
    # score stays high, so every second update re-flags it
    assert reasons[:8] == [""] * 8
    assert reasons[8].startswith("suspect: its updates keep one direction") and reasons[9].startswith("suspect:")
    assert sum(bool(r) for r in reasons[8:]) >= 5
    assert state.verification.sketch.flags >= 1 and set(state.verification.sketch.score) == set(peers)
