"""Verification with error feedback (peer/reveal.py, coordinator/rerun.py): the residual a peer
adds to its upload is committed with its inner state and revealed with it, so a re-run reproduces a sign-coded
upload with feedback bit for bit.

* an honest chain of two leases (fresh, then from the first lease's inner state and residual) re-runs bitwise from
  the revealed state, and ends at the committed end (inner state and the new residual);
* the residual matters: the same lease without it does not reproduce;
* a residual one bit off its commitment, a reveal without the residual, a hidden direction in the upload, a false
  end digest and a malformed reveal are each refused, naming the problem; the revealed end state carries the residual
  the upload left (peer/reveal.py ``RevealStore.end_residual``).
"""

from __future__ import annotations

import struct

import pytest
import torch

from asyncloco.config import RunConfig
from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import Verify
from asyncloco.coordinator.rerun import Rerunner, compare
from asyncloco.peer.reveal import RevealStore
from asyncloco.train.commitments import (
    FRESH_STATE_DIGEST, committed_digest, inner_state_chunks, pack_parts, pack_reveal, split_parts, unpack_reveal,
)
from asyncloco.train.feedback import ErrorFeedback
from asyncloco.train.inner import InnerTrainer
from asyncloco.workloads import build_workload

pytestmark = pytest.mark.timeout(120)

CODEC, DECAY = "sgn15of16", 0.5


def config() -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 16, "hidden": 8, "points": 1024, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"max_local_steps": 6},
        "runtime": {"codec": CODEC, "error_feedback": True, "error_feedback_decay": DECAY,
                    "verify": {"enabled": True, "inner_state": "carry"}},
    })


def test_a_sign_coded_upload_with_feedback_reproduces_from_its_revealed_state() -> None:
    cfg = config()
    workload = build_workload(cfg)
    peer = InnerTrainer.from_config(cfg, workload)
    feedback = ErrorFeedback(CODEC, True, DECAY)
    theta = peer.full_params()
    numel = theta.numel()
    # lease 1, from the fresh state: no residual yet, so its commitment is the fresh one
    assert committed_digest(FRESH_STATE_DIGEST, feedback.residual) == FRESH_STATE_DIGEST
    first = peer.run(theta, 0, 0, 6, 0).pseudo_gradient
    feedback.encode_decoded(first)
    assert feedback.pending is not None
    inner_end = peer.state_digest()
    assert inner_end is not None
    end_of_first = committed_digest(inner_end, feedback.pending)
    feedback.settle(True)  # applied: the residual is current
    # lease 2 starts where lease 1 ended, residual included: the chain holds
    assert committed_digest(peer.state_digest() or "", feedback.residual) == end_of_first
    store = RevealStore(2)
    store.hold("L2", peer.optimizer, feedback.residual, feedback=True)
    start_part = store.get("L2")
    chunks = inner_state_chunks(peer.optimizer)
    assert start_part is not None and chunks
    assert start_part == struct.pack("<Q", len(b"".join(chunks))) + b"".join(chunks) + feedback.residual.numpy().tobytes()
    pseudo_gradient = peer.run(theta + 0.01, 1, 2, 5, 6).pseudo_gradient
    inner_end = store.hold_end("L2", peer.optimizer)  # as the runner keeps it: the digest from the same bytes
    assert inner_end == peer.state_digest()
    _, decoded = feedback.encode_decoded(pseudo_gradient)
    assert decoded is not None and inner_end is not None
    end = store.end_residual("L2", inner_end, feedback.pending)
    assert end == committed_digest(inner_end, feedback.pending)
    revealed = store.reveal("L2")
    assert revealed is not None and split_parts(revealed)[0] == start_part
    assert split_parts(revealed)[1] == pack_reveal(b"".join(inner_state_chunks(peer.optimizer) or []), feedback.pending)
    lease = logic.Lease("L2", "p", 1, 2, 5, 6, 0, 0.0, 1.0, 10.0)
    rerunner = Rerunner(cfg, workload)
    own = peer.compute_class  # the verifier's class: compared bitwise
    honest = Verify("p", lease, theta + 0.01, decoded, "sampled", "", end_of_first, end, own)
    verdict = rerunner.check_revealed(honest, revealed)
    assert verdict.ok and verdict.bitwise, verdict.detail
    assert rerunner.trainer.state_digest() == FRESH_STATE_DIGEST and rerunner.trainer.reset_state  # clean for the next
    # the residual matters: the same lease re-run from the same inner state without it does not give the upload
    inner, residual = unpack_reveal(start_part, numel)
    assert residual is not None and torch.equal(residual, feedback.residual)
    assert not compare(rerunner.rerun(lease, theta + 0.01), decoded).ok
    # a residual one bit off its commitment; the inner state alone (the residual withheld)
    tampered = bytearray(start_part)
    tampered[-3] ^= 1
    end_part = split_parts(revealed)[1]
    for bad in (pack_parts(bytes(tampered), end_part), pack_parts(pack_reveal(inner, None), end_part)):
        verdict = rerunner.check_revealed(honest, bad)
        assert not verdict.ok and verdict.detail == "the revealed inner state does not match its commitment"
    # a hidden direction of 0.1 % of the upload's norm; a false end digest
    direction = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    lie = Verify("p", lease, theta + 0.01, decoded + 1e-3 * decoded.norm() * direction / direction.norm(), "sampled", "",
                 end_of_first, end, own)
    caught = rerunner.check_revealed(lie, revealed)
    assert not caught.ok and caught.rel_error == pytest.approx(1e-3, rel=1e-3)
    verdict = rerunner.check_revealed(Verify("p", lease, theta + 0.01, decoded, "sampled", "", end_of_first, "a" * 64, own),
                                      revealed)
    assert not verdict.ok and verdict.detail == "the revealed end state does not match its commitment"
    # the end state without the residual its upload left
    verdict = rerunner.check_revealed(honest, pack_parts(start_part, pack_reveal(unpack_reveal(end_part, numel)[0], None)))
    assert not verdict.ok and verdict.detail == "the revealed end state does not match its commitment"
    # malformed reveals: a residual of the wrong length, a length field past the data, NaN in the residual
    for bad, why in ((pack_parts(start_part[:-4], end_part), f"leaves {4 * numel - 4} bytes for the residual, which needs 0 or {4 * numel}"),
                     (pack_parts(struct.pack("<Q", 10**9) + start_part[8:], end_part), "leaves"),
                     (struct.pack("<Q", 10**9) + revealed[8:], "runs past"),
                     (pack_parts(pack_reveal(inner, torch.full((numel,), float("nan"))), end_part),
                      "the revealed residual has a NaN or Inf")):
        verdict = rerunner.check_revealed(honest, bad)
        assert not verdict.ok and verdict.detail.startswith("the revealed inner state is malformed") and why in verdict.detail
    with pytest.raises(ValueError, match="fewer than its 8-byte length field"):
        unpack_reveal(b"\x00" * 7, numel)
    assert unpack_reveal(b"", numel) == (b"", None)
