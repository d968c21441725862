"""Outer optimizers against torch references and closed forms (docs/algorithm.md §2, §7.1, §7.3)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from asyncloco.algo.outer import (
    AsyncBuffer,
    DelayedNesterov,
    OuterAdam,
    OuterNesterov,
    OuterOptimizer,
    OuterSGD,
    OuterSGDMomentum,
)

DIM = 32
RTOL, ATOL = 1e-6, 1e-7


def _vectors(count: int, seed: int, dim: int = DIM) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, generator=gen) for _ in range(count)]


def _theta(seed: int = 100, dim: int = DIM) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed))


def _torch_run(make_opt, theta0: torch.Tensor, grads: list[torch.Tensor], lrs: list[float] | None = None) -> torch.Tensor:
    """θ after feeding ``grads`` as .grad into a torch optimizer, one step each."""
    param = torch.nn.Parameter(theta0.clone())
    opt = make_opt([param])
    for i, g in enumerate(grads):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[i]
        param.grad = g.clone()
        opt.step()
    return param.detach().clone()


def _our_run(opt: OuterOptimizer, theta0: torch.Tensor, grads: list[torch.Tensor], scales: list[float] | None = None) -> torch.Tensor:
    theta = theta0.clone()
    for i, g in enumerate(grads):
        info = opt.step(theta, g, lr_scale=1.0 if scales is None else scales[i])
        assert info.moved and info.reason
    return theta


# --------------------------------------------------------------------------- torch parity


@pytest.mark.timeout(30)
def test_sgd_is_theta_minus_lr_g() -> None:
    theta0 = _theta()
    grads = _vectors(5, seed=1)
    ours = _our_run(OuterSGD(0.3), theta0, grads)
    assert torch.allclose(ours, _torch_run(lambda p: torch.optim.SGD(p, lr=0.3), theta0, grads), rtol=RTOL, atol=ATOL)
    assert torch.allclose(ours, theta0 - 0.3 * torch.stack(grads).sum(0), rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
def test_sgd_momentum_matches_torch(momentum: float) -> None:
    theta0 = _theta()
    grads = _vectors(7, seed=2)
    ours = _our_run(OuterSGDMomentum(0.7, momentum), theta0, grads)
    ref = _torch_run(lambda p: torch.optim.SGD(p, lr=0.7, momentum=momentum), theta0, grads)
    assert torch.allclose(ours, ref, rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("momentum", [0.5, 0.9])
def test_nesterov_matches_torch(momentum: float) -> None:
    theta0 = _theta()
    grads = _vectors(7, seed=3)
    opt = OuterNesterov(0.7, momentum)
    ours = _our_run(opt, theta0, grads)
    ref_param = torch.nn.Parameter(theta0.clone())
    ref = torch.optim.SGD([ref_param], lr=0.7, momentum=momentum, nesterov=True, dampening=0)
    for g in grads:
        ref_param.grad = g.clone()
        ref.step()
    assert torch.allclose(ours, ref_param.detach(), rtol=RTOL, atol=1e-6)
    assert torch.allclose(opt.momentum_buffer, ref.state[ref_param]["momentum_buffer"], rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(30)
def test_nesterov_is_paper_eq4() -> None:
    """θ ← θ − ε(β²·m_old + (1+β)·g) (paper Eq. 4) from a non-zero momentum."""
    beta, lr = 0.9, 0.7
    theta0, m_old, g = _theta(), *_vectors(2, seed=4)
    opt = OuterNesterov(lr, beta)
    opt.load_state_dict({"momentum_buffer": m_old})
    theta = theta0.clone()
    opt.step(theta, g)
    expected = theta0.double() - lr * (beta**2 * m_old.double() + (1 + beta) * g.double())
    assert torch.allclose(theta.double(), expected, rtol=RTOL, atol=1e-6)
    assert torch.allclose(opt.momentum_buffer.double(), beta * m_old.double() + g.double(), rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(30)
def test_adam_matches_torch() -> None:
    theta0 = _theta()
    grads = [g * (i + 1) for i, g in enumerate(_vectors(8, seed=5))]  # changing scale exercises the moments
    ours = _our_run(OuterAdam(1e-2, betas=(0.8, 0.95), eps=1e-6), theta0, grads)
    ref = _torch_run(lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95), eps=1e-6), theta0, grads)
    assert torch.allclose(ours, ref, rtol=RTOL, atol=1e-6)


# --------------------------------------------------------------------------- lr_scale


@pytest.mark.timeout(30)
def test_lr_scale_multiplies_this_step_only() -> None:
    theta0 = _theta()
    grads = _vectors(5, seed=6)
    scales = [1.0, 0.5, 0.25, 1.0, 2.0]
    lrs = [0.7 * s for s in scales]
    cases = [
        (lambda: OuterSGD(0.7), lambda p: torch.optim.SGD(p, lr=0.7)),
        (lambda: OuterSGDMomentum(0.7, 0.9), lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9)),
        (lambda: OuterNesterov(0.7, 0.9), lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)),
        (lambda: OuterAdam(0.7), lambda p: torch.optim.Adam(p, lr=0.7)),
    ]
    for ours_factory, ref_factory in cases:
        ours = _our_run(ours_factory(), theta0, grads, scales)
        ref = _torch_run(ref_factory, theta0, grads, lrs)
        assert torch.allclose(ours, ref, rtol=RTOL, atol=1e-6), ours_factory().name
    # scale 0 leaves θ where it was but still accumulates momentum
    opt = OuterNesterov(0.7, 0.9)
    theta = theta0.clone()
    opt.step(theta, grads[0], lr_scale=0.0)
    assert torch.equal(theta, theta0)
    assert torch.equal(opt.momentum_buffer, grads[0])


# --------------------------------------------------------------------------- state dicts


def _roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


FACTORIES = {
    "sgd": lambda: OuterSGD(0.7),
    "sgd_momentum": lambda: OuterSGDMomentum(0.7, 0.9),
    "nesterov": lambda: OuterNesterov(0.7, 0.9),
    "adam": lambda: OuterAdam(1e-2),
    "delayed_nesterov": lambda: DelayedNesterov(0.7, 0.9, buffer_size=3, activation=0.2),
    "async_buffer": lambda: AsyncBuffer(0.7, 0.9, buffer_size=3),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("split", [1, 4])  # 4: mid-buffer for N = 3
def test_state_dict_round_trip_continues_identically(name: str, split: int) -> None:
    grads = _vectors(9, seed=7)
    scales = [1.0, 0.5, 1.0, 0.3, 1.0, 1.0, 0.8, 1.0, 1.0]
    theta0 = _theta()

    uninterrupted = _run_scaled(FACTORIES[name](), theta0.clone(), grads, scales)

    first = FACTORIES[name]()
    theta = _run_scaled(first, theta0.clone(), grads[:split], scales[:split])
    saved = _roundtrip(first.state_dict())
    theta_saved = _roundtrip({"theta": theta})["theta"]
    first.step(theta, grads[split])  # mutating the live optimizer must not change what was saved
    resumed = FACTORIES[name]()
    resumed.load_state_dict(saved)
    theta = _run_scaled(resumed, theta_saved, grads[split:], scales[split:])
    assert torch.equal(theta, uninterrupted)


def _run_scaled(opt: OuterOptimizer, theta: torch.Tensor, grads, scales) -> torch.Tensor:
    for g, s in zip(grads, scales):
        opt.step(theta, g, lr_scale=s)
    return theta


@pytest.mark.timeout(30)
def test_stateless_sgd_rejects_foreign_state() -> None:
    with pytest.raises(ValueError, match="no state"):
        OuterSGD(0.1).load_state_dict({"momentum_buffer": torch.zeros(3)})
    with pytest.raises(ValueError, match="must be a tensor"):
        OuterNesterov(0.1, 0.9).load_state_dict({"momentum_buffer": [1.0, 2.0]})


# --------------------------------------------------------------------------- Delayed Nesterov


def _reference_dn(theta0, grads, lr, beta, n, c, m0=None, scales=None):
    """Paper Algorithm 3, written out in float64 with explicit loops: returns (θ, m, Δ, m history)."""
    theta = theta0.double().clone()
    m = torch.zeros_like(theta) if m0 is None else m0.double().clone()
    delta = torch.zeros_like(theta)
    history = []
    for t, g in enumerate(grads):
        eps = lr * (1.0 if scales is None else scales[t])
        g = g.double()
        delta = delta + g
        if (t + 1) % n == 0:
            m = beta * m + delta / n
            theta = theta - eps * ((1 - c * n + c) * beta * m + g / n)
            delta = torch.zeros_like(theta)
        else:
            theta = theta - eps * (c * beta * m + g / n)
        history.append(m.clone())
    return theta, m, delta, history


@pytest.mark.timeout(30)
@pytest.mark.parametrize("activation", [0.0, 0.2, 1.0 / 3.0])
def test_delayed_nesterov_is_algorithm_3(activation: float) -> None:
    lr, beta, n = 0.7, 0.9, 3
    grads = _vectors(8, seed=8)  # 8 arrivals: two full buffers and a partial one
    scales = [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.25, 1.0]
    theta0 = _theta()
    opt = DelayedNesterov(lr, beta, n, activation)
    theta = theta0.clone()
    momentum_after = []
    for g, s in zip(grads, scales):
        info = opt.step(theta, g, lr_scale=s)
        assert info.moved and info.reason
        momentum_after.append(opt.momentum_buffer.clone())
    ref_theta, ref_m, ref_delta, ref_history = _reference_dn(theta0, grads, lr, beta, n, activation, scales=scales)
    assert torch.allclose(theta.double(), ref_theta, rtol=RTOL, atol=1e-6)
    assert torch.allclose(opt.momentum_buffer.double(), ref_m, rtol=RTOL, atol=1e-6)
    assert torch.allclose(opt.buffer.double(), ref_delta, rtol=RTOL, atol=1e-6)
    assert opt.arrivals == 8
    for got, want in zip(momentum_after, ref_history):
        assert torch.allclose(got.double(), want, rtol=RTOL, atol=1e-6)
    # m changes only at the N-th arrivals (t = 3, 6) and is bit-for-bit untouched in between
    zero = torch.zeros(DIM)
    assert torch.equal(momentum_after[0], zero) and torch.equal(momentum_after[1], zero)
    assert not torch.equal(momentum_after[2], zero)
    assert torch.equal(momentum_after[3], momentum_after[2]) and torch.equal(momentum_after[4], momentum_after[2])
    assert not torch.equal(momentum_after[5], momentum_after[4])
    assert torch.equal(momentum_after[6], momentum_after[5]) and torch.equal(momentum_after[7], momentum_after[5])
    assert torch.allclose(opt.buffer, grads[6] + grads[7], rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(30)
def test_delayed_nesterov_does_not_reapply_the_buffer() -> None:
    """c = 0, one full buffer from m = 0: θ moves by Σg/N once plus ε·β·m, never Δ/N a second time."""
    lr, beta, n = 0.5, 0.9, 3
    g1, g2, g3 = _vectors(3, seed=9)
    theta0 = _theta()
    opt = DelayedNesterov(lr, beta, n, 0.0)
    theta = theta0.clone()
    opt.step(theta, g1)
    assert torch.allclose(theta, theta0 - lr * g1 / 3, rtol=RTOL, atol=ATOL)
    opt.step(theta, g2)
    assert torch.allclose(theta, theta0 - lr * (g1 + g2) / 3, rtol=RTOL, atol=ATOL)
    opt.step(theta, g3)
    mean = (g1 + g2 + g3) / 3
    assert torch.allclose(opt.momentum_buffer, mean, rtol=RTOL, atol=ATOL)
    expected = theta0 - lr * mean - lr * beta * mean
    assert torch.allclose(theta, expected, rtol=RTOL, atol=1e-6)
    assert torch.equal(opt.buffer, torch.zeros(DIM))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_dn_with_n_equal_k_is_one_nesterov_step_on_the_mean(k: int) -> None:
    """docs/algorithm.md §7.1 — over several rounds, so the momentum carried between rounds matters too."""
    lr, beta, rounds = 0.7, 0.9, 3
    theta0 = _theta()
    dn = DelayedNesterov(lr, beta, buffer_size=k, activation=0.0)
    theta = theta0.clone()
    ref_param = torch.nn.Parameter(theta0.clone())
    ref = torch.optim.SGD([ref_param], lr=lr, momentum=beta, nesterov=True, dampening=0)
    for r in range(rounds):
        grads = _vectors(k, seed=20 + r)
        for g in grads:
            dn.step(theta, g)
        ref_param.grad = torch.stack(grads).mean(0)
        ref.step()
        assert torch.allclose(theta, ref_param.detach(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(dn.momentum_buffer, ref.state[ref_param]["momentum_buffer"], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k", [1, 4, 6])
def test_async_nesterov_k_identical_updates_match_paper_eq5(k: int) -> None:
    """docs/algorithm.md §7.3: θ_{t+k} = θ_t − ε[(Σ_{i=2}^{k+1} β^i)·m_t + (k + Σ_{i=1}^{k} (k−i+1)·β^i)·g]."""
    lr, beta = 0.7, 0.9
    theta0 = _theta()
    m_t, g = _vectors(2, seed=30)
    opt = OuterNesterov(lr, beta)
    opt.load_state_dict({"momentum_buffer": m_t})
    theta = theta0.clone()
    for _ in range(k):
        opt.step(theta, g)
    m_coef = sum(beta**i for i in range(2, k + 2))
    g_coef = k + sum((k - i + 1) * beta**i for i in range(1, k + 1))
    expected = theta0.double() - lr * (m_coef * m_t.double() + g_coef * g.double())
    assert torch.allclose(theta.double(), expected, rtol=1e-5, atol=1e-5)
    m_expected = beta**k * m_t.double() + sum(beta**i for i in range(k)) * g.double()
    assert torch.allclose(opt.momentum_buffer.double(), m_expected, rtol=1e-5, atol=1e-5)
    if k == 4:  # the polynomial written out, so the general sums above cannot hide an off-by-one
        assert math.isclose(m_coef, beta**2 + beta**3 + beta**4 + beta**5)
        assert math.isclose(g_coef, 4 + 4 * beta + 3 * beta**2 + 2 * beta**3 + beta**4)


# --------------------------------------------------------------------------- Async Buffer


@pytest.mark.timeout(30)
def test_async_buffer_holds_theta_then_takes_one_nesterov_step_on_the_mean() -> None:
    lr, beta, n = 0.7, 0.9, 3
    theta0 = _theta()
    opt = AsyncBuffer(lr, beta, n)
    theta = theta0.clone()
    ref_param = torch.nn.Parameter(theta0.clone())
    ref = torch.optim.SGD([ref_param], lr=lr, momentum=beta, nesterov=True, dampening=0)
    for r in range(2):
        before = theta.clone()
        grads = _vectors(n, seed=40 + r)
        for g in grads[:-1]:
            info = opt.step(theta, g)
            assert not info.moved and info.reason
            assert torch.equal(theta, before)
        info = opt.step(theta, grads[-1])
        assert info.moved and info.reason
        ref_param.grad = torch.stack(grads).mean(0)
        ref.step()
        assert torch.allclose(theta, ref_param.detach(), rtol=1e-5, atol=1e-6)
        assert opt.buffered == 0 and torch.equal(opt.buffer, torch.zeros(DIM))


@pytest.mark.timeout(30)
def test_async_buffer_uses_the_mean_lr_scale_of_its_arrivals() -> None:
    theta0 = _theta()
    grads = _vectors(2, seed=50)
    opt = AsyncBuffer(0.7, 0.9, 2)
    theta = theta0.clone()
    opt.step(theta, grads[0], lr_scale=1.0)
    opt.step(theta, grads[1], lr_scale=0.5)
    mean = (grads[0] + grads[1]) / 2
    # first Nesterov step from m = 0: θ − ε·s·(1 + β)·mean, s = mean of the scales
    assert torch.allclose(theta, theta0 - 0.7 * 0.75 * 1.9 * mean, rtol=RTOL, atol=1e-6)


# --------------------------------------------------------------------------- validation


@pytest.mark.timeout(30)
def test_invalid_hyper_parameters_raise() -> None:
    with pytest.raises(ValueError, match=r"1/N"):
        DelayedNesterov(0.7, 0.9, buffer_size=4, activation=0.26)
    with pytest.raises(ValueError, match="activation|1/N"):
        DelayedNesterov(0.7, 0.9, buffer_size=2, activation=-0.1)
    with pytest.raises(ValueError, match="N must be >= 1"):
        DelayedNesterov(0.7, 0.9, buffer_size=0)
    with pytest.raises(ValueError, match=">= 1"):
        AsyncBuffer(0.7, 0.9, buffer_size=0)
    for lr in (0.0, -0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="outer lr"):
            OuterNesterov(lr, 0.9)
        with pytest.raises(ValueError, match="outer lr"):
            DelayedNesterov(lr, 0.9, 2)
    for beta in (-0.1, 1.0):
        with pytest.raises(ValueError, match="momentum"):
            OuterSGDMomentum(0.7, beta)
    with pytest.raises(ValueError, match="betas"):
        OuterAdam(1e-3, betas=(0.9, 1.0))
    # the boundary c = 1/N is allowed
    assert DelayedNesterov(0.7, 0.9, buffer_size=4, activation=0.25).activation == 0.25


@pytest.mark.timeout(30)
def test_async_buffer_flush_steps_on_the_mean_of_what_arrived() -> None:
    lr, beta = 0.7, 0.9
    theta0 = _theta()
    g1, g2, g3 = _vectors(3, seed=60)
    opt = AsyncBuffer(lr, beta, buffer_size=3)
    theta = theta0.clone()
    assert opt.flush(theta) is None and torch.equal(theta, theta0)  # nothing buffered: nothing to do
    opt.step(theta, g1, lr_scale=1.0)
    opt.step(theta, g2, lr_scale=0.5)
    info = opt.flush(theta)
    assert info is not None and info.moved and "2" in info.reason
    mean = (g1 + g2) / 2
    assert torch.allclose(theta, theta0 - lr * 0.75 * (1 + beta) * mean, rtol=RTOL, atol=1e-6)
    assert torch.equal(opt.momentum_buffer, mean)
    assert opt.buffered == 0 and opt.buffered_lr_scale == 0.0 and torch.equal(opt.buffer, torch.zeros(DIM))
    # the next arrival starts a fresh buffer: θ does not move until three more have arrived
    before = theta.clone()
    assert not opt.step(theta, g3).moved and torch.equal(theta, before)
    for name in ("sgd", "nesterov", "delayed_nesterov"):  # nothing to flush in the others
        other = FACTORIES[name]()
        theta_other = theta0.clone()
        other.step(theta_other, g1)
        after_step = theta_other.clone()
        assert other.flush(theta_other) is None and torch.equal(theta_other, after_step)


@pytest.mark.timeout(60)
def test_overlapped_rounds_count_each_peers_two_updates_in_flight_in_n() -> None:
    """With overlapped rounds a peer has two updates on the way from about the same θ: the buffered methods' N is
    buffer_size × 2 (c·N kept), a barrier method's round is left as it is — and a peer's two updates g from one θ then
    move θ exactly as its one update g moved it without overlap: lr·(1 + β)·g (DN, c = 0), not twice that."""
    from asyncloco.config import OuterConfig, RunConfig
    from asyncloco.coordinator.methods import build_method, updates_in_flight

    cfg = OuterConfig(lr=0.7, momentum=0.9, buffer_size=3, activation=0.3)
    _, dn, _ = build_method("async_dn_dylu", cfg, 3, in_flight=2)
    assert isinstance(dn, DelayedNesterov) and dn.buffer_size == 6 and dn.activation == pytest.approx(0.15)
    _, sync, _ = build_method("sync_diloco", cfg, 3, in_flight=2)
    assert sync.buffer_size == 3
    assert updates_in_flight(RunConfig()) == 2  # overlap is the default
    assert updates_in_flight(RunConfig.model_validate({"runtime": {"overlap": False}})) == 1

    one = OuterConfig(lr=0.7, momentum=0.9, buffer_size=1)
    g = torch.linspace(-1.0, 1.0, 7)
    serial, overlapped = torch.zeros(7), torch.zeros(7)
    build_method("async_dn_dylu", one, 1)[1].step(serial, g)
    optimizer = build_method("async_dn_dylu", one, 1, in_flight=2)[1]
    optimizer.step(overlapped, g)
    optimizer.step(overlapped, g)
    assert torch.allclose(serial, -0.7 * 1.9 * g, atol=1e-6) and torch.allclose(overlapped, serial, atol=1e-6)


# --------------------------------------------------------------------------- outer momentum at long leases


@pytest.mark.timeout(60)
def test_long_lease_momentum_decays_by_beta_to_the_lease_over_h() -> None:
    """``outer.long_lease_momentum: scaled`` (the default): an update of h > H local steps decays the momentum by
    β^(h/H) — Nesterov equals torch's SGD(nesterov) at that β; DN's momentum step takes the mean h of its N arrivals;
    updates of at most H steps (every DyLU lease) are bitwise the paper's β; ``fixed`` ignores the steps."""
    from asyncloco.config import OuterConfig
    from asyncloco.coordinator.methods import build_method

    theta0, (g1, g2, g3, g4) = _theta(), _vectors(4, seed=7)
    h = 30
    nesterov = OuterNesterov(0.7, 0.9, reference_steps=h)
    assert nesterov.beta(h) == 0.9 and nesterov.beta(1) == 0.9 and nesterov.beta(90) == pytest.approx(0.9**3)
    ours = theta0.clone()
    nesterov.step(ours, g1, steps=h)
    nesterov.step(ours, g2, steps=3 * h)
    param = torch.nn.Parameter(theta0.clone())
    ref = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    param.grad = g1.clone()
    ref.step()
    ref.param_groups[0]["momentum"] = 0.9**3
    param.grad = g2.clone()
    ref.step()
    torch.testing.assert_close(ours, param.detach(), rtol=RTOL, atol=ATOL)

    # DN, N = 2, c = 0: the momentum step's β is β^(mean h / H) over the two buffered arrivals
    dn = DelayedNesterov(0.5, 0.8, buffer_size=2, reference_steps=h)
    theta = theta0.clone()
    for g, steps in ((g1, 10), (g2, 20), (g3, 40), (g4, 80)):
        dn.step(theta, g, steps=steps)
    m1 = (g1 + g2) / 2  # mean h 15 ≤ H: β^1 on a zero momentum
    m2 = 0.8 ** (60 / h) * m1 + (g3 + g4) / 2
    expected = theta0 - 0.5 * (g1 + g2 + g3 + g4) / 2 - 0.5 * 0.8 * m1 - 0.5 * 0.8 ** (60 / h) * m2
    torch.testing.assert_close(dn.momentum_buffer, m2, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(theta, expected, rtol=RTOL, atol=ATOL)
    restored = DelayedNesterov(0.5, 0.8, buffer_size=2, reference_steps=h)
    dn.step(theta, g1, steps=50)
    restored.load_state_dict(dn.state_dict())
    assert restored.buffered_steps == 50 and restored.arrivals == 5

    # at most H steps: bitwise the paper's DN; fixed, or no H given: β whatever the steps
    plain, scaled = DelayedNesterov(0.7, 0.9, 2), DelayedNesterov(0.7, 0.9, 2, reference_steps=h)
    a, b = theta0.clone(), theta0.clone()
    for g in (g1, g2, g3, g4):
        plain.step(a, g, steps=h)
        scaled.step(b, g, steps=h)
    assert torch.equal(a, b)
    cfg = OuterConfig(lr=0.7, momentum=0.9, buffer_size=2)
    assert build_method("async_dn_dylu", cfg, 2, reference_steps=h)[1].reference_steps == h  # type: ignore[attr-defined]
    fixed = cfg.model_copy(update={"long_lease_momentum": "fixed"})
    assert build_method("async_dn_dylu", fixed, 2, reference_steps=h)[1].reference_steps is None  # type: ignore[attr-defined]
    assert build_method("async_dn_dylu", cfg, 2)[1].reference_steps is None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="reference_steps"):
        OuterNesterov(0.7, 0.9, reference_steps=0)

    # the async buffer's Nesterov step takes the exact mean h of its arrivals (61 / 2 = 30.5 steps, not rounded)
    buffered = AsyncBuffer(0.7, 0.9, buffer_size=2, reference_steps=h)
    c = theta0.clone()
    buffered.step(c, g1, steps=31)
    buffered.step(c, g2, steps=30)
    momentum = (g1 + g2) / 2  # on a zero momentum buffer: β only weights the look-ahead term
    torch.testing.assert_close(c, theta0 - 0.7 * (momentum + 0.9 ** (30.5 / h) * momentum), rtol=RTOL, atol=ATOL)
