"""A revealed inner state must be one AdamW can reach (asyncloco/coordinator/rerun.py ``implausible_state``): a
foreign-class check never compares the end state a peer commits to, so a modified client could craft the state its
next lease starts from — a second moment shrunk to amplify chosen coordinates, a step count set low to inflate the
bias correction. Every check of a revealed state now bounds |exp_avg| by the most AdamW reaches over the state's
step count, for any gradients (docs/threat-model.md, "What a peer can still do")."""

from __future__ import annotations

import math

import pytest
import torch

from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import Verify
from asyncloco.coordinator.rerun import Rerunner, implausible_state, moment_bound
from asyncloco.train.commitments import inner_state_chunks, load_inner_state, pack_parts, revealed_digest
from asyncloco.train.inner import InnerTrainer
from asyncloco.workloads import build_workload

from tests.test_verify_commit import carried_config

pytestmark = pytest.mark.timeout(300)

FOREIGN = "cuda/NVIDIA H100 80GB HBM3 cuda 13.0/torch 2.11.0+cu130"


def test_the_bound_is_reached_by_the_worst_gradients_and_never_passed() -> None:
    beta1, beta2 = 0.9, 0.999
    assert moment_bound(beta1, beta2, 1) == pytest.approx(0.1 / math.sqrt(0.001))  # 3.162: |m| = 0.1 |g|, v = 0.001 g²
    limit = 0.1 / math.sqrt(0.001) / math.sqrt(1 - 0.81 / 0.999)
    assert moment_bound(beta1, beta2, 10**6) == pytest.approx(limit) and limit == pytest.approx(7.27, abs=0.01)
    assert moment_bound(beta1, beta2, 0) == 0.0 and moment_bound(0.99, 0.9, 5) == math.inf
    param = torch.nn.Parameter(torch.zeros(3))
    for steps in (1, 2, 7, 40):
        optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(beta1, beta2))
        # the gradients that reach the bound (∝ (β1/β2)^k, the newest last), and random ones that stay below it
        worst = [(beta1 / beta2) ** (steps - 1 - t) for t in range(steps)]
        noise = torch.randn(steps, 2, generator=torch.Generator().manual_seed(steps))
        for t in range(steps):
            param.grad = torch.tensor([worst[t], float(noise[t, 0]), float(noise[t, 1])])
            optimizer.step()
        state = optimizer.state[param]
        ratio = state["exp_avg"].abs() / state["exp_avg_sq"].sqrt()
        bound = moment_bound(beta1, beta2, steps)
        assert float(ratio[0]) == pytest.approx(bound, rel=1e-4)  # reached
        assert float(ratio.max()) <= bound * (1 + 1e-4)
        assert implausible_state(optimizer) is None
        state["exp_avg_sq"][0] *= 0.99  # 0.5 % further: no gradients reach it
        assert "1 element(s) with |exp_avg| above" in (implausible_state(optimizer) or "")


def test_an_honest_state_passes_and_a_crafted_one_fails_the_check_of_its_lease() -> None:
    cfg = carried_config()
    workload = build_workload(cfg)
    peer = InnerTrainer.from_config(cfg, workload)
    theta = peer.full_params()
    peer.run(theta, 0, 0, 6, 0)
    peer.run(theta + 0.01, 1, 0, 4, 0)
    revealed = b"".join(inner_state_chunks(peer.optimizer) or [])
    assert implausible_state(peer.optimizer) is None
    # the honest margin: the largest |m| / √v against the bound at this step count
    worst = max(float((s["exp_avg"].abs() / s["exp_avg_sq"].sqrt().clamp_min(1e-30)).max()) for s in peer.optimizer.state.values())
    assert worst < moment_bound(0.9, 0.999, 10)  # 5.08 against 6.81: honest states come close to the bound
    lease = logic.Lease("L1", "p", 1, 5, 6, 3, 0, 0.0, 1.0, 10.0)
    submitted = peer.run(theta, 1, 5, 6, 3).pseudo_gradient
    end = b"".join(inner_state_chunks(peer.optimizer) or [])  # revealed with the start (peer/reveal.py pack_parts)
    rerunner = Rerunner(cfg, workload)

    def check(state: bytes, update: torch.Tensor) -> object:
        task = Verify("p", lease, theta, update, "sampled", "", revealed_digest(state), revealed_digest(end), FOREIGN)
        return rerunner.check_revealed(task, pack_parts(state, end))

    honest = check(revealed, submitted)
    assert getattr(honest, "ok") and "its end state within" in getattr(honest, "detail")
    # crafted: the second moment of the first parameter's first 4 elements shrunk 10⁴ × (their steps amplified ~100 ×);
    # the peer trained from it honestly, so the re-run reproduces its update — only the state's plausibility fails
    crafter = InnerTrainer.from_config(cfg, workload)
    load_inner_state(crafter.optimizer, revealed)
    first = crafter.optimizer.param_groups[0]["params"][0]
    crafter.optimizer.state[first]["exp_avg_sq"].view(-1)[:4] *= 1e-4
    crafted = b"".join(inner_state_chunks(crafter.optimizer) or [])
    crafter.reset_state = False
    update = crafter.run(theta, 1, 5, 6, 3).pseudo_gradient
    verdict = check(crafted, update)
    assert not getattr(verdict, "ok")
    assert getattr(verdict, "detail").startswith("the revealed inner state is not one AdamW reaches: parameter 0: ")
    # a step count set back to 1 with the moments of 10 steps (bias correction ×10 on m, ×1000 on v)
    load_inner_state(crafter.optimizer, revealed)
    for state in crafter.optimizer.state.values():
        state["step"] = torch.tensor(1.0)
    ones = b"".join(inner_state_chunks(crafter.optimizer) or [])
    assert worst > moment_bound(0.9, 0.999, 1) * (1 + 1e-3)  # 5.08 here: ten steps of consistent gradients
    assert "the most AdamW reaches in 1 steps" in getattr(check(ones, submitted), "detail")
    # non-finite moments
    load_inner_state(crafter.optimizer, revealed)
    crafter.optimizer.state[first]["exp_avg"].view(-1)[0] = math.inf
    broken = b"".join(inner_state_chunks(crafter.optimizer) or [])
    assert "non-finite or negative moments" in getattr(check(broken, submitted), "detail")
