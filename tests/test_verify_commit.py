"""Commitments to the carried inner state (docs/threat-model.md, "Commitments").

* train/commitments.py: the digest of a fresh trainer is the fresh-state constant (the logic's copy agrees); it covers every
  byte of the AdamW state in its canonical layout (1 + 8 + 2 × 4 × n bytes per parameter of n elements); two
  trainers that ran the same leases have equal digests, and one that ran a different lease does not;
* transport/wire.py: the submit header carries both digests (64 lowercase hex characters), optional for old peers,
  and refuses anything else naming the field;
* the logic, with ``VerifyPolicy.commit``: a submission without digests is refused; an honest chain (fresh, then
  each start = the previous applied lease's end, and fresh again after a reset) is applied; a broken chain is
  refused, its lease given back, and an already failed ``Verify`` goes to the verifier, whose ``Verified`` expels
  the peer; the chain survives a checkpoint, and the digests replay from the write-ahead log;
* coordinator/verify.py ``Rerunner.check_revealed``: an honest carried-state lease re-run from its revealed start
  state is bitwise equal (from θ alone it is not); a hidden direction, a revealed state one bit off its commitment
  and a false end digest are each caught; a malformed state is refused, the trainer's state untouched (the end state
  against a foreign class's: tests/test_verify_end_state.py).
"""

from __future__ import annotations

import copy
import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncloco.algo.outer import OuterNesterov
from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import (
    Applied,
    Assign,
    CoordinatorPolicy,
    CoordinatorState,
    Expelled,
    Expired,
    Rejected,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    Verified,
    Verify,
    VerifyPolicy,
    handle,
    new_state,
)
from asyncloco.config import RunConfig
from asyncloco.train.commitments import FRESH_STATE_DIGEST, inner_state_chunks
from asyncloco.train.inner import InnerTrainer
from asyncloco.transport.errors import MessageError
from asyncloco.transport.wire import SubmitHeader
from asyncloco.workloads import build_workload

pytestmark = pytest.mark.timeout(120)

DIM = 6
A, B, C = ("a" * 64), ("b" * 64), ("c" * 64)


def toy_config() -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 16, "hidden": 8, "points": 1024, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"max_local_steps": 6},
    })


def test_inner_state_digest() -> None:
    assert logic.FRESH_STATE_DIGEST == FRESH_STATE_DIGEST
    cfg = toy_config()
    workload = build_workload(cfg)
    one, two = InnerTrainer.from_config(cfg, workload), InnerTrainer.from_config(cfg, workload)
    assert not one.reset_state
    assert one.state_digest() == FRESH_STATE_DIGEST
    theta = one.full_params()
    for trainer in (one, two):
        trainer.run(theta, 0, 0, 3, 0)
    digest = one.state_digest()
    assert digest is not None and digest != FRESH_STATE_DIGEST and digest == two.state_digest()
    # the canonical layout: every parameter's marker, step (float64) and both moments (float32), nothing else
    chunks = inner_state_chunks(one.optimizer)
    assert chunks is not None
    params = [p for group in one.optimizer.param_groups for p in group["params"]]
    assert len(chunks) == 3 * len(params)
    assert sum(len(c) for c in chunks) == sum(1 + 8 + 2 * 4 * p.numel() for p in params)
    assert chunks[0] == b"\x01" + struct.pack("<d", 3.0)  # three steps taken
    expected = hashlib.sha256(b"asyncloco inner state v1:")
    for chunk in chunks:
        expected.update(chunk)
    assert digest == expected.hexdigest()
    # one more lease on one trainer only: the digests part; a reset gives the fresh state back
    one.run(theta, 1, 0, 2, 3)
    assert one.state_digest() != two.state_digest()
    one.reset_inner_state()
    assert one.state_digest() == FRESH_STATE_DIGEST


def test_submit_header_digests() -> None:
    header = SubmitHeader("L1", 3, "int8", 10, 2.5, A, B)
    assert SubmitHeader.from_wire(header.to_wire()) == header
    old = SubmitHeader("L1", 3, "int8", 10)
    assert "state_start" not in old.to_wire() and SubmitHeader.from_wire(old.to_wire()).state_end is None
    for bad in ("A" * 64, "a" * 63, "a" * 65, "g" * 64, 7):
        with pytest.raises(MessageError, match="SubmitHeader.state_start"):
            SubmitHeader.from_wire({**old.to_wire(), "state_start": bad})
    # the compute class the lease ran on (train/inner.py compute_class): what this machine names passes the wire's
    # bound; anything else is refused naming the field
    from asyncloco.train.inner import compute_class

    named = SubmitHeader("L1", 3, "int8", 10, device_class=compute_class("cpu"))
    assert SubmitHeader.from_wire(named.to_wire()) == named and named.device_class.startswith("cpu/")
    for bad in ("", "x" * 97, "cpu;rm -rf", "cpu\n", 3):
        with pytest.raises(MessageError, match="SubmitHeader.device_class"):
            SubmitHeader.from_wire({**old.to_wire(), "device_class": bad})

def test_a_compute_class_with_odd_characters_is_made_wire_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a device reports (a GPU name, a CPU capability) is out of our hands: anything outside the wire's characters
    becomes "_", and the class is cut at 96 characters, so every peer's class passes SubmitHeader."""
    from asyncloco.train.inner import compute_class

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2;é\n" + "x" * 200)
    named = compute_class("cpu")
    assert named.startswith("cpu/AVX2___xxx") and len(named) == 96
    assert SubmitHeader.from_wire({**SubmitHeader("L1", 3, "int8", 10).to_wire(), "device_class": named}).device_class == named
    # a DDP group is a class of its own, named first (a long device name is cut, not the group's size)
    group = compute_class("cpu", ranks=4)
    assert group.startswith("ddp4/cpu/AVX2___xxx") and len(group) == 96 and group != named
    monkeypatch.undo()
    assert compute_class("cpu", ranks=2) == "ddp2/" + compute_class("cpu") and compute_class("cpu", ranks=1) == compute_class("cpu")


def commit_state() -> CoordinatorState:
    policy = CoordinatorPolicy(
        max_local_steps=4, grace_period=0.0, lease_timeout_factor=3.0, lease_slack=100.0,
        verify=VerifyPolicy(fraction=0.0, probation_updates=0, suspect_fraction=0.0, commit=True),
    )
    state = new_state(torch.zeros(DIM), OuterNesterov(0.5, 0.9), [], policy, [10_000], seed=3, lease_secret=b"s" * 32)
    handle(state, SpeedReport("p", 10.0), 0.0)
    return state


def lease_for(state: CoordinatorState, now: float) -> logic.Lease:
    _, actions = handle(state, RequestWork("p"), now)
    return next(a.lease for a in actions if isinstance(a, Assign))


def submit(state: CoordinatorState, lease: logic.Lease, now: float, start: str | None, end: str | None) -> list[logic.Action]:
    return handle(state, SubmitUpdate("p", lease.lease_id, lease.base_version, torch.ones(DIM), state_start=start, state_end=end), now)[1]


def test_chain_of_commitments() -> None:
    state = commit_state()
    lease = lease_for(state, 0.0)
    refused = submit(state, lease, 1.0, None, None)
    assert len(refused) == 1 and isinstance(refused[0], Rejected) and "state_start and state_end" in refused[0].reason
    assert state.version == 0 and lease.lease_id in state.leases and state.verification.chain == {}
    # an honest chain: fresh → A, A → B, then a reset (fresh) → C
    for now, (start, end) in enumerate([(FRESH_STATE_DIGEST, A), (A, B), (FRESH_STATE_DIGEST, C)], start=2):
        actions = submit(state, lease, float(now), start, end)
        assert [type(a) for a in actions] == [Applied], actions
        assert state.verification.chain == {"p": end}
        lease = lease_for(state, float(now))
    assert state.version == 3
    restored = commit_state()
    restored.load_state_dict(copy.deepcopy(state.state_dict()))
    assert restored.verification.chain == {"p": C}
    # a broken chain: starts from A, but the last applied lease ended at C
    actions = submit(state, lease, 10.0, A, B)
    assert [type(a) for a in actions] == [Rejected, Expired, Verify]
    check = actions[2]
    assert isinstance(check, Verify) and check.failed.startswith("inner-state chain broken") and check.state_start == A
    assert state.version == 3 and lease.lease_id not in state.leases and state.verification.chain == {"p": C}
    assert state.verification.pending == {lease.lease_id: "p"}
    _, actions = handle(state, Verified("p", lease.lease_id, False, check.failed), 11.0)
    assert [type(a) for a in actions][:2] == [logic.Verdict, Expelled]
    assert "p" in state.verification.expelled and not state.verification.pending


def test_commit_off_ignores_digests() -> None:
    state = commit_state()
    state.policy = CoordinatorPolicy(
        max_local_steps=4, grace_period=0.0, lease_timeout_factor=3.0, lease_slack=100.0,
        verify=VerifyPolicy(fraction=0.0, probation_updates=0, suspect_fraction=0.0, commit=False),
    )
    lease = lease_for(state, 0.0)
    assert [type(a) for a in submit(state, lease, 1.0, A, B)] == [Applied]
    assert state.verification.chain == {}


def carried_config(**verify: Any) -> RunConfig:
    cfg = toy_config()
    knobs = cfg.runtime.verify.model_copy(update={"inner_state": "carry", **verify})
    return cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"verify": knobs})}, deep=True)


def test_rerun_from_a_revealed_carried_state() -> None:
    from asyncloco.coordinator.rerun import Rerunner
    from asyncloco.train.commitments import inner_state_size, load_inner_state, pack_parts, revealed_digest

    cfg = carried_config()
    workload = build_workload(cfg)
    peer = InnerTrainer.from_config(cfg, workload)
    theta = peer.full_params()
    peer.run(theta, 0, 0, 6, 0)  # earlier leases: the state the lease starts from is carried, not fresh
    peer.run(theta + 0.01, 1, 0, 4, 0)
    chunks = inner_state_chunks(peer.optimizer)
    assert chunks
    revealed = b"".join(chunks)
    start = peer.state_digest()
    assert revealed_digest(revealed) == start and len(revealed) == inner_state_size(peer.optimizer)
    lease = logic.Lease("L1", "p", 1, 5, 6, 3, 0, 0.0, 1.0, 10.0)
    submitted = peer.run(theta, 1, 5, 6, 3).pseudo_gradient
    end = peer.state_digest()
    assert start is not None and end is not None
    start_part = revealed
    revealed = pack_parts(start_part, b"".join(inner_state_chunks(peer.optimizer) or []))  # the start and end states
    rerunner = Rerunner(cfg, workload)
    own = rerunner.compute_class  # the peer ran on this machine: the verifier's compute class, compared bitwise
    assert own == peer.compute_class
    honest = Verify("p", lease, theta, submitted, "sampled", "", start, end, own)
    verdict = rerunner.check_revealed(honest, revealed)
    assert verdict.ok and verdict.bitwise, verdict.detail
    # from θ alone (a fresh state) the lease does not reproduce: the revealed state is what makes it checkable
    assert not rerunner.check(honest).ok
    # a lie in a hidden direction of 0.1 % of the update's norm
    direction = torch.randn(submitted.numel(), generator=torch.Generator().manual_seed(1))
    lie = Verify("p", lease, theta, submitted + 1e-3 * submitted.norm() * direction / direction.norm(), "sampled", "",
                 start, end, own)
    caught = rerunner.check_revealed(lie, revealed)
    assert not caught.ok and caught.rel_error == pytest.approx(1e-3, rel=1e-3) and "bitwise equality" in caught.detail
    # a revealed state that is not the committed one (one moment changed by one ulp), and a fabricated end digest
    tampered = bytearray(revealed)
    tampered[8 + 20] ^= 1
    verdict = rerunner.check_revealed(honest, bytes(tampered))
    assert not verdict.ok and verdict.detail == "the revealed inner state does not match its commitment"
    verdict = rerunner.check_revealed(Verify("p", lease, theta, submitted, "sampled", "", start, A, own), revealed)
    assert not verdict.ok and verdict.detail == "the revealed end state does not match its commitment"
    # the start alone (Ack reveal_end: false), from the verifier's class: the re-run's end digest stands for the end
    alone = pack_parts(start_part, b"")
    verdict = rerunner.check_revealed(honest, alone)
    assert verdict.ok and verdict.bitwise, verdict.detail
    verdict = rerunner.check_revealed(Verify("p", lease, theta, submitted, "sampled", "", start, A, own), alone)
    assert not verdict.ok and verdict.detail == "the re-run's inner state at the lease's end differs from the committed one"
    assert not rerunner.check_revealed(lie, alone).ok
    # ... but not from another class, whose end state must be revealed to be compared within the state tolerance
    verdict = rerunner.check_revealed(Verify("p", lease, theta, submitted, "sampled", "", start, end, "cuda/x"), alone)
    assert not verdict.ok and verdict.detail.startswith("the reveal has no end state, which a peer of another compute")
    # another compute class (a GPU peer, a CPU with other kernels; or one that names none) cannot be re-run bitwise:
    # the fp32 default bound is a relative error of 0.01 with cosine 0.9999 (config.py CROSS_DEVICE_BOUNDS), which
    # takes the 0.1 % lie — the slack any peer gets by naming a foreign class (docs/threat-model.md) — and refuses 2 %
    assert rerunner.bounds(honest) == (0.0, -1.0)
    for foreign in ("cuda/NVIDIA H100 80GB HBM3 cuda 13.0/torch 2.11.0+cu130", ""):
        named = Verify("p", lease, theta, lie.update, "sampled", "", start, end, foreign)
        assert rerunner.bounds(named) == (0.01, 0.9999)
        verdict = rerunner.check_revealed(named, revealed)
        assert verdict.ok and not verdict.bitwise and "its end state within" in verdict.detail, verdict.detail
        far = Verify("p", lease, theta, submitted + 2e-2 * submitted.norm() * direction / direction.norm(), "sampled",
                     "", start, end, foreign)
        verdict = rerunner.check_revealed(far, revealed)
        assert not verdict.ok and verdict.rel_error == pytest.approx(2e-2, rel=1e-3) and "≤ 0.01" in verdict.detail
        # bitwise equal from a foreign class (a codec can make two classes' uploads agree): the revealed end state
        # must still hash to the committed one, and lie within the state tolerance of the re-run's
        agreed = rerunner.check_revealed(Verify("p", lease, theta, submitted, "sampled", "", start, end, foreign), revealed)
        assert agreed.ok and agreed.bitwise and "its end state within" in agreed.detail
        forged = rerunner.check_revealed(Verify("p", lease, theta, submitted, "sampled", "", start, A, foreign), revealed)
        assert not forged.ok and forged.detail == "the revealed end state does not match its commitment"
    # the organiser's own bound, and 0: only peers of the verifier's class can pass
    strict = carried_config(cross_device_tolerance=0.0)
    assert Rerunner(strict, workload).bounds(Verify("p", lease, theta, submitted, "", "", start, end, "x")) == (0.0, 0.9999)
    carried = carried_config()
    bf16 = carried.model_copy(update={"inner": carried.inner.model_copy(update={"precision": "bf16"})})
    assert Rerunner(bf16, workload).bounds(Verify("p", lease, theta, submitted, "", "", start, end, "x")) == (0.1, 0.99)
    # a codec that selects what it keeps (sign, topk, grp) moves kept values on a last-bit difference: wider bounds
    for config, bounds in ((carried, (0.03, 0.9995)), (bf16, (0.4, 0.9))):
        signed = config.model_copy(update={"runtime": config.runtime.model_copy(update={"codec": "sgn15of16"})})
        assert Rerunner(signed, workload).bounds(Verify("p", lease, theta, submitted, "", "", start, end, "x")) == bounds
    # the verifier's own trainer is fresh again afterwards; a malformed state is refused, the state untouched
    assert rerunner.trainer.state_digest() == FRESH_STATE_DIGEST and rerunner.trainer.reset_state
    with pytest.raises(ValueError, match="bytes past its last parameter"):
        load_inner_state(peer.optimizer, start_part + b"\x00")
    assert peer.state_digest() == end


def test_commitments_replay_from_the_log(tmp_path: Path) -> None:
    """The digests are plain fields of the logged SubmitUpdate: a replay gives the same event back, and an event
    logged without them, or by a version before they existed, decodes with both None."""
    from asyncloco.coordinator.daemon import EVENT_TYPES
    from asyncloco.coordinator.wal import WAL_DIR, decode_event, open_log, read_records
    from asyncloco.transport.codecs import decode, encode

    update = torch.arange(DIM, dtype=torch.float32)
    log = open_log(tmp_path, 0, stamp="asyncloco test")
    for start, end in ((FRESH_STATE_DIGEST, A), (None, None)):
        event = SubmitUpdate("p", "L1", 0, update, state_start=start, state_end=end)
        encoded = encode("none", update)
        log.append_event(event, 1.0, {"pseudo_gradient": ("none", DIM, [encoded.to_bytes()])})
    log.close()
    records = list(read_records(tmp_path / WAL_DIR, 0))

    def blob(codec: str, count: int, data: memoryview) -> torch.Tensor:
        from asyncloco.transport.codecs import EncodedTensor

        return decode(EncodedTensor.from_bytes(codec, count, bytes(data)), count)

    replayed = [decode_event(record, EVENT_TYPES, blob) for record in records]
    assert [(e.state_start, e.state_end) for e in replayed] == [(FRESH_STATE_DIGEST, A), (None, None)]
    assert all(torch.equal(e.pseudo_gradient, update) for e in replayed)
    # a record written before the fields existed has no such keys: the event decodes with both None
    import dataclasses

    old = dataclasses.replace(records[1], fields={k: v for k, v in records[1].fields.items() if not k.startswith("state_")})
    assert "state_start" in records[1].fields and "state_start" not in old.fields
    assert decode_event(old, EVENT_TYPES, blob).state_end is None


def test_a_reveal_is_read_through_views_not_copies() -> None:
    """The verifier splits, hashes and loads a reveal in a worker thread of the coordinator's process; a copy of a bytes
    object holds the GIL for its whole length (at 150m a reveal is 1.8 GB), stalling every RPC. So splitting and hashing
    allocate nothing of the reveal's size (tracemalloc, which sees bytes and numpy allocations), loading allocates only
    the moments themselves, and each gives what the byte-copying definitions give."""
    import tracemalloc

    from asyncloco.train.commitments import load_inner_state, pack_parts, pack_reveal, revealed_digest, split_parts, unpack_reveal

    numel = 1_000_000
    param = torch.nn.Parameter(torch.zeros(numel))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    param.grad = torch.linspace(-1.0, 1.0, numel)
    optimizer.step()
    chunks = inner_state_chunks(optimizer)
    assert chunks is not None
    inner = b"".join(chunks)
    residual = torch.linspace(0.0, 1.0, numel)
    data = pack_parts(inner, pack_reveal(inner, residual))
    assert len(data) == 8 + len(inner) + 8 + len(inner) + 4 * numel  # 8 MB of moments per part, 4 MB of residual

    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(numel))], lr=1e-3)
    tracemalloc.start()
    try:
        start, end = split_parts(data)
        start_digest = revealed_digest(start)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 64 * 1024, f"splitting and hashing a {len(data)}-byte reveal allocated {peak} bytes"
        tracemalloc.reset_peak()
        end_inner, end_residual = unpack_reveal(end, numel)
        digests = start_digest, revealed_digest(end_inner)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 4 * numel + 64 * 1024  # the residual's tensor, nothing more
        tracemalloc.reset_peak()
        held, _ = tracemalloc.get_traced_memory()  # the residual's tensor, still alive
        load_inner_state(fresh, start)
        _, peak = tracemalloc.get_traced_memory()
        assert peak - held < 2 * 4 * numel + 64 * 1024  # the two moments, nothing more
    finally:
        tracemalloc.stop()
    # the same values as byte copies give
    copy_start = bytes(data[8 : 8 + len(inner)])
    assert bytes(start) == copy_start == inner and bytes(end_inner) == inner
    assert end_residual is not None and torch.equal(end_residual, residual)
    expected = hashlib.sha256(b"asyncloco inner state v1:" + inner).hexdigest()
    assert digests == (expected, expected)
    assert inner_state_chunks(fresh) == chunks
    from asyncloco.train.commitments import inner_state_digest
    assert inner_state_digest(fresh) == inner_state_digest(optimizer) == expected


def test_the_numpy_built_layouts_equal_the_joined_ones() -> None:
    """train/commitments.py ``join_parts`` / ``pack_reveal_buffer`` / ``copy_buffer`` (the coordinator builds reveals from
    kept states with them: no GIL-held copy of a state's length) give exactly :func:`pack_parts` / :func:`pack_reveal`."""
    from asyncloco.train.commitments import (copy_buffer, join_parts, pack_parts, pack_reveal, pack_reveal_buffer,
                                             revealed_end)

    inner = bytes(range(256)) * 3
    residual = torch.linspace(-1.0, 1.0, 17)
    for start, end in ((inner, b""), (b"", inner), (inner, inner[:5]), (b"", b"")):
        assert bytes(join_parts(start, end)) == pack_parts(start, end)
    for state, left in ((inner, residual), (inner, None), (b"", residual), (b"", None)):
        assert bytes(pack_reveal_buffer(state, left)) == pack_reveal(state, left)
    view = memoryview(inner)[3:40]
    copied = copy_buffer(view)
    assert bytes(copied) == inner[3:40] and copied.obj is not inner and bytes(copy_buffer(b"")) == b""
    end = revealed_end(pack_parts(inner[:7], inner))  # what a pass keeps of a reveal with an end part
    assert end is not None and bytes(end) == inner
    assert revealed_end(pack_parts(inner, b"")) is None and revealed_end(b"\x05") is None  # none, malformed
