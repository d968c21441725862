"""Staleness transforms (docs/algorithm.md §2 baselines): exact formulas, composition, state round trips."""

from __future__ import annotations

import io

import pytest
import torch

from asyncloco.algo.staleness import (
    AsyncAwareLR,
    DelayCompensation,
    OuterWarmup,
    PolyDiscount,
    StalenessLR,
    apply_transforms,
)

pytestmark = pytest.mark.timeout(30)

DIM = 12


def _vec(seed: int, dim: int = DIM) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("staleness", [0, 1, 3, 8, 24])
def test_poly_weight_is_inverse_sqrt_of_one_plus_staleness(staleness: int) -> None:
    g = _vec(1)
    out = PolyDiscount().adjust(g, staleness, _vec(2), None)
    assert out.lr_scale == 1.0 and out.reason
    assert torch.allclose(out.pseudo_gradient, g / (1 + staleness) ** 0.5, rtol=1e-6, atol=0)
    # spelled-out values: s = 3 → 1/2, s = 8 → 1/3, s = 24 → 1/5
    halves = {0: 1.0, 3: 0.5, 8: 1 / 3, 24: 0.2}
    if staleness in halves:
        assert torch.allclose(out.pseudo_gradient, g * halves[staleness], rtol=1e-6, atol=0)


def test_poly_custom_exponent() -> None:
    g = _vec(3)
    out = PolyDiscount(exponent=1.0).adjust(g, 3, g, None)
    assert torch.allclose(out.pseudo_gradient, g / 4, rtol=1e-6, atol=0)


def test_poly_thres_drops_beyond_ten_keeps_ten() -> None:
    g = _vec(4)
    transform = PolyDiscount(0.5, max_staleness=10)
    kept = transform.adjust(g, 10, g, None)
    assert kept.pseudo_gradient is not None
    assert torch.allclose(kept.pseudo_gradient, g / 11**0.5, rtol=1e-6, atol=0)
    dropped = transform.adjust(g, 11, g, None)
    assert dropped.pseudo_gradient is None
    assert "11" in dropped.reason and "10" in dropped.reason
    # what the repair asks without adjusting (coordinator/repair.py): the same boundary; no other transform drops
    assert (transform.drops(10), transform.drops(11)) == (False, True)
    assert not PolyDiscount(0.5).drops(10**6) and not StalenessLR().drops(10**6)


def test_delay_compensation_formula() -> None:
    g, now, base = _vec(5), _vec(6), _vec(7)
    out = DelayCompensation(0.3).adjust(g, 2, now, base)
    assert out.lr_scale == 1.0 and out.reason
    expected = g.double() + 0.3 * g.double() * g.double() * (now.double() - base.double())
    assert torch.allclose(out.pseudo_gradient.double(), expected, rtol=1e-6, atol=1e-7)


def test_delay_compensation_without_delay_is_identity_and_needs_base_otherwise() -> None:
    g = _vec(8)
    transform = DelayCompensation(0.3)
    assert transform.needs_base_params
    out = transform.adjust(g, 0, _vec(9), None)
    assert torch.equal(out.pseudo_gradient, g)
    with pytest.raises(ValueError, match="base version"):
        transform.adjust(g, 1, _vec(9), None)
    with pytest.raises(ValueError):
        DelayCompensation(-1.0)
    with pytest.raises(ValueError):
        DelayCompensation(1.0, ema=1.0)


def _group_reference(g: torch.Tensor, drift: torch.Tensor, groups, strength: float, mean_sq_per_group) -> torch.Tensor:
    out = g.double().clone()
    for (start, stop), mean_sq in zip(groups, mean_sq_per_group):
        out[start:stop] += strength / mean_sq * (g.double() * g.double() * drift.double())[start:stop]
    return out


def test_grouped_delay_compensation_normalises_per_group() -> None:
    """λ per group is divided by the debiased EMA of mean(g²) in that group (first update: the mean itself)."""
    groups = [(0, 4), (4, 12)]
    ema = 0.9
    g1 = _vec(10)
    g1[4:] *= 10.0  # the second group's scale is 100x larger in g², the correction must not be
    now, base = _vec(11), _vec(12)
    transform = DelayCompensation(0.5, groups=groups, ema=ema, cap=None)  # the normalisation alone
    out1 = transform.adjust(g1, 3, now, base)
    ms1 = [float(g1[a:b].double().square().mean()) for a, b in groups]
    assert torch.allclose(out1.pseudo_gradient.double(), _group_reference(g1, now - base, groups, 0.5, ms1), rtol=1e-5, atol=1e-6)

    g2 = _vec(13)
    out2 = transform.adjust(g2, 1, now, base)
    ms2 = [float(g2[a:b].double().square().mean()) for a, b in groups]
    debiased = [(ema * a + b) / (1 + ema) for a, b in zip(ms1, ms2)]  # EMA over two samples, bias-corrected
    assert torch.allclose(out2.pseudo_gradient.double(), _group_reference(g2, now - base, groups, 0.5, debiased), rtol=1e-5, atol=1e-6)
    assert transform.updates == 2

    # state round trip: a restored transform gives the same third output
    g3 = _vec(14)
    restored = DelayCompensation(0.5, groups=groups, ema=ema, cap=None)
    restored.load_state_dict(_roundtrip(transform.state_dict()))
    assert torch.equal(restored.adjust(g3, 2, now, base).pseudo_gradient, transform.adjust(g3, 2, now, base).pseudo_gradient)


def test_delay_compensation_cap_bounds_each_correction_by_the_gradient() -> None:
    """|λ·g²·drift| ≤ cap·|g| per coordinate: a capped coordinate lies between 0 and 2·g, never flips sign."""
    g = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0])
    base = torch.zeros(5)
    now = torch.tensor([0.01, 0.5, -1.0, 0.0, 7.0])
    # λ·g²·drift = [0.1, 20, −2.5, 0, 0]; bounds |g| = [1, 2, 0.5, 3, 0]
    capped = DelayCompensation(10.0).adjust(g, 3, now, base).pseudo_gradient
    assert torch.equal(capped, torch.tensor([1.1, 0.0, 0.0, 3.0, 0.0]))
    half = DelayCompensation(10.0, cap=0.5).adjust(g, 3, now, base).pseudo_gradient
    assert torch.equal(half, torch.tensor([1.1, -1.0, 0.25, 3.0, 0.0]))
    free = DelayCompensation(10.0, cap=None).adjust(g, 3, now, base).pseudo_gradient
    assert torch.equal(free, torch.tensor([1.1, 18.0, -2.0, 3.0, 0.0]))
    # grouped: the same bound after the per-group normalisation (group mean g² = 1 → scale λ / debiased = λ)
    grouped = DelayCompensation(10.0, groups=[(0, 2)], ema=0.0).adjust(
        torch.tensor([1.0, -1.0]), 1, torch.tensor([0.05, 3.0]), torch.zeros(2)
    )
    assert torch.equal(grouped.pseudo_gradient, torch.tensor([1.5, 0.0]))
    with pytest.raises(ValueError, match="cap"):
        DelayCompensation(1.0, cap=0.0)


def test_outer_warmup_ramps_the_lr_over_the_first_arrivals_and_round_trips() -> None:
    g = _vec(15)
    warmup = OuterWarmup(3)
    scales = [warmup.adjust(g, s, g, None).lr_scale for s in (0, 2, 1)]
    assert scales == [1 / 3, 2 / 3, 1.0]
    restored = OuterWarmup(3)
    restored.load_state_dict(_roundtrip(warmup.state_dict()))
    assert restored.adjust(g, 0, g, None).lr_scale == warmup.adjust(g, 0, g, None).lr_scale == 1.0
    assert torch.equal(OuterWarmup(5).adjust(g, 4, g, None).pseudo_gradient, g)  # the update itself is untouched
    with pytest.raises(ValueError, match="at least 1"):
        OuterWarmup(0)


def test_outer_warmup_arrivals_in_the_config_adds_the_ramp_after_the_methods_own_transforms() -> None:
    """``outer.warmup_arrivals: W`` (0 by default: the paper) gives a real run's and the simulator's method the
    warm-up as its last transform: applied in order, a method's own multiplier and the ramp's multiply."""
    from asyncloco.config import OuterConfig
    from asyncloco.coordinator.methods import build_method

    g = _vec(15)
    assert build_method("async_dn_dylu", OuterConfig(), 3)[2] == []
    _, _, transforms = build_method("async_dn_dylu", OuterConfig(warmup_arrivals=4), 3)
    assert [t.name for t in transforms] == ["outer_warmup"]
    assert [apply_transforms(transforms, g, 0, g, None).lr_scale for _ in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    _, _, transforms = build_method("elasticdl_lr", OuterConfig(warmup_arrivals=2), 3)
    assert [t.name for t in transforms][-1] == "outer_warmup" and len(transforms) == 2
    assert apply_transforms(transforms, g, 4, g, None).lr_scale == pytest.approx(0.25 * 0.5)  # 1/staleness × 1/W
    with pytest.raises(ValueError, match="warmup_arrivals"):
        OuterConfig(warmup_arrivals=-1)


@pytest.mark.parametrize("staleness,scale", [(0, 1.0), (1, 1.0), (2, 0.5), (5, 0.2)])
def test_staleness_lr_is_one_over_staleness(staleness: int, scale: float) -> None:
    g = _vec(15)
    out = StalenessLR().adjust(g, staleness, g, None)
    assert torch.equal(out.pseudo_gradient, g)
    assert out.lr_scale == pytest.approx(scale, rel=1e-12)
    assert out.reason


def test_async_aware_lr_over_window() -> None:
    """min(1, τ/τ̄) with τ̄ the mean of the last ``window`` stalenesses."""
    transform = AsyncAwareLR(threshold=2.0, window=3)
    stalenesses = [0, 4, 8, 1, 1, 1]
    expected = [1.0, 1.0, 0.5, 6 / 13, 0.6, 1.0]  # means 0, 2, 4, 13/3, 10/3, 1
    g = _vec(16)
    got = []
    for s in stalenesses:
        out = transform.adjust(g, s, g, None)
        assert torch.equal(out.pseudo_gradient, g)
        got.append(out.lr_scale)
    assert got == pytest.approx(expected, rel=1e-12)

    restored = AsyncAwareLR(threshold=2.0, window=3)
    restored.load_state_dict(_roundtrip(transform.state_dict()))
    assert list(restored.recent) == [1, 1, 1]
    assert restored.adjust(g, 9, g, None).lr_scale == pytest.approx(2.0 / (11 / 3), rel=1e-12)
    with pytest.raises(ValueError):
        AsyncAwareLR(threshold=0.0)
    with pytest.raises(ValueError):
        AsyncAwareLR(threshold=1.0, window=0)


def test_apply_transforms_composes_in_order() -> None:
    g = _vec(17)
    aalr = AsyncAwareLR(threshold=1.0, window=4)
    out = apply_transforms([PolyDiscount(0.5), StalenessLR(), aalr], g, 3, g, None)
    assert torch.allclose(out.pseudo_gradient, g / 2, rtol=1e-6, atol=0)
    assert out.lr_scale == pytest.approx((1 / 3) * (1 / 3), rel=1e-12)  # ElasticDL 1/3, AALR min(1, 1/3)
    assert out.reason.count(";") == 2

    identity = apply_transforms([], g, 5, g, None)
    assert identity.pseudo_gradient is g and identity.lr_scale == 1.0 and identity.reason


def test_apply_transforms_drop_stops_the_chain() -> None:
    g = _vec(18)
    aalr = AsyncAwareLR(threshold=1.0, window=4)
    out = apply_transforms([PolyDiscount(0.5, max_staleness=2), aalr], g, 3, g, None)
    assert out.pseudo_gradient is None and out.lr_scale == 0.0
    assert "threshold" in out.reason
    assert list(aalr.recent) == []  # the later transform never saw the dropped update


def test_transform_argument_validation() -> None:
    with pytest.raises(ValueError):
        PolyDiscount(-0.5)
    with pytest.raises(ValueError):
        PolyDiscount(0.5, max_staleness=-1)
