"""Error feedback (asyncloco/train/feedback.py) and the runtime.codec / runtime.error_feedback keys."""

from __future__ import annotations

import re

import pytest
import torch

from asyncloco.config import UPLOAD_CODEC_PATTERN, RunConfig, load_config
from asyncloco.train.feedback import ErrorFeedback
from asyncloco.transport.codecs import CODECS, decode, encode


@pytest.mark.timeout(30)
def test_residual_carries_exactly_what_the_codec_dropped() -> None:
    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(3000, generator=gen) for _ in range(4)]
    feedback = ErrorFeedback("topk4b2")
    residual = torch.zeros(3000)
    sent_total = torch.zeros(3000)
    for delta in deltas:
        corrected = delta + residual
        expected = decode(encode("topk4b2", corrected), 3000)  # the reference: encode the corrected vector
        sent = feedback.roundtrip(delta)
        assert torch.equal(sent, expected)
        feedback.settle(True)
        residual = corrected - expected
        assert feedback.residual is not None and torch.equal(feedback.residual, residual)
        sent_total += sent
    # nothing is lost: what was sent plus what is still held is everything computed (up to fp32 rounding)
    assert torch.allclose(sent_total + residual, sum(deltas), atol=1e-5)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_refused_update_drops_the_residual_and_off_is_plain_encode() -> None:
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    feedback = ErrorFeedback("int2")
    feedback.roundtrip(delta)
    feedback.settle(True)
    assert feedback.residual_norm() > 0
    feedback.roundtrip(delta)
    feedback.settle(False)  # refused or lost: its residual and the carried one are dropped
    assert feedback.residual is None
    assert torch.equal(feedback.roundtrip(delta), decode(encode("int2", delta), 1000))  # starts afresh
    off = ErrorFeedback("int2", enabled=False)
    for _ in range(2):
        assert off.encode(delta).to_bytes() == encode("int2", delta).to_bytes()
        off.settle(True)
        assert off.residual is None
    assert not ErrorFeedback("none").enabled  # lossless: nothing to feed back


@pytest.mark.timeout(30)
def test_config_accepts_exactly_the_codec_registry() -> None:
    assert all(re.fullmatch(UPLOAD_CODEC_PATTERN, name) for name in CODECS)
    # every name the pattern could accept is in the registry
    ks, bits = (1, 2, 4, 8, 16, 32, 64), (2, 4)
    grouped = {f"grp{g}b{b}" for g in (4, 8, 16, 32) for b in (1, 2)}
    signs = {f"sgn{p}of{q}" for p, q in ((1, 1), (15, 16), (7, 8), (3, 4), (5, 8), (1, 2))}
    floats = {"none", "fp16", "bf16", "int8", "int4", "int2"}
    assert {f"topk{k}b{b}" for k in ks for b in bits} | grouped | signs | floats == set(CODECS)
    assert not re.fullmatch(UPLOAD_CODEC_PATTERN, "grp6b1") and not re.fullmatch(UPLOAD_CODEC_PATTERN, "topk3b2")
    assert not re.fullmatch(UPLOAD_CODEC_PATTERN, "sgn2of4") and not re.fullmatch(UPLOAD_CODEC_PATTERN, "sgn1of4")
    cfg = RunConfig.model_validate({"runtime": {"codec": "topk8b2"}})
    assert not cfg.runtime.uses_error_feedback  # off by default: measured worse (docs/compression.md)
    assert RunConfig.model_validate({"runtime": {"codec": "topk8b2", "error_feedback": True}}).runtime.uses_error_feedback
    assert not RunConfig.model_validate({"runtime": {"codec": "none"}}).runtime.uses_error_feedback
    assert not RunConfig.model_validate({"runtime": {"codec": "int4", "error_feedback": False}}).runtime.uses_error_feedback
    assert not RunConfig.model_validate({"runtime": {"codec": "int8"}}).runtime.uses_error_feedback  # as before error feedback existed
    assert RunConfig.model_validate({"runtime": {"codec": "int8", "error_feedback": True}}).runtime.uses_error_feedback
    with pytest.raises(ValueError, match="unknown codec 'topk3b2'.*e.g. topk8b2"):
        RunConfig.model_validate({"runtime": {"codec": "topk3b2"}})


@pytest.mark.timeout(30)
def test_error_feedback_with_verification_needs_the_carried_state() -> None:
    reset = {"enabled": True, "inner_state": "reset"}
    cfg = RunConfig.model_validate({"runtime": {"codec": "int2", "verify": reset}})
    assert not cfg.runtime.uses_error_feedback
    with pytest.raises(ValueError, match="error_feedback: true with runtime.verify.enabled needs runtime.verify.inner_state: carry"):
        RunConfig.model_validate({"runtime": {"codec": "int8", "error_feedback": True, "verify": reset}})
    # carried state (the default): the residual is committed and revealed with it (tests/test_verify_feedback.py)
    carried = RunConfig.model_validate({"runtime": {"codec": "sgn15of16", "error_feedback": True, "verify": {"enabled": True}}})
    assert carried.runtime.uses_error_feedback and carried.runtime.verify.inner_state == "carry"


@pytest.mark.timeout(120)
def test_simulator_uploads_go_through_the_codec_and_feedback() -> None:
    from asyncloco.sim.engine import Simulation

    overrides = {
        "task": {"points": 4096, "eval_points": 256, "dim": 32, "hidden": 16},
        "sim": {"total_local_updates": 200, "eval_every": 100},
    }
    base = load_config("configs/toy.yaml", overrides)
    numel = 32 * 16 + 16 + 16 * 4 + 4
    fp32 = Simulation(base, "async_dn_dylu").run()
    sparse_cfg = load_config("configs/toy.yaml", {**overrides, "runtime": {"codec": "topk8b2", "error_feedback": True}})
    sim = Simulation(sparse_cfg, "async_dn_dylu")
    sparse = sim.run()
    assert fp32.upload_bytes == 4 * numel * fp32.applied
    uploads = sparse.applied
    # 596 = 2 chunks of 256 + one of 84: 24 kept values → 24 index bytes + 6 bytes of 2-bit codes + 3 fp32 scales
    assert sparse.upload_bytes == uploads * (24 + 6 + 3 * 4)
    assert all(w.feedback is not None and w.feedback.enabled for w in sim.workers.values())
    assert sparse.final["loss"] != fp32.final["loss"]
