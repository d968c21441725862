"""The carried inner state is checked across compute classes too (peer/reveal.py, coordinator/rerun.py).

A checked lease reveals its start *and* end states (``pack_parts``); the end must hash to the committed ``state_end``,
and the re-run's end state is compared with it: bitwise (the digest) for a peer naming the verifier's compute class,
within ``runtime.verify.cross_device_state_tolerance`` (relative L2 errors of m, v and the AdamW step, the RMS
log-ratio of the step size; step counts exactly; the residual within the upload's bound) for a peer naming another
class.

* an honest lease from a carried state, its end a few last bits off the re-run's (as another CPU's kernels leave it),
  passes under a foreign class and fails under the verifier's own (bitwise there);
* a forger that trains honestly but pushes its carried first moment along its own direction before committing the end
  (``testing/attacks.py forge_moment``, inside the plausibility bound the verifier checks) fails under a foreign class,
  naming the part and how far, and under its own; one that stays inside the tolerance passes a foreign-class check
  (what a peer can still hide); a second moment shrunk with its first where it is smallest (the step unchanged, the
  next steps there amplified) passes m's, v's and u's L2 bounds and fails on the step size;
* a lease that started fresh is revealed too (empty start part) and its end checked;
* a revealed end one bit off its commitment fails; malformed reveals are refused; a step count set off fails;
* the reveal's size bound: two full states with their length field, refused above it before the body is read.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Optional

import pytest
import torch

from asyncloco.config import CROSS_DEVICE_STATE_TOLERANCE, RunConfig
from asyncloco.coordinator import logic
from asyncloco.coordinator.logic import Verify
from asyncloco.coordinator.rerun import Rerunner, implausible_state, state_gap, state_moments
from asyncloco.testing.attacks import forge_moment, hidden_direction
from asyncloco.train.commitments import (
    FRESH_STATE_DIGEST, inner_state_chunks, load_inner_state, pack_parts, revealed_digest, revealed_size, split_parts,
)
from asyncloco.train.inner import InnerTrainer
from asyncloco.workloads import build_workload

pytestmark = pytest.mark.timeout(120)

FOREIGN = "cuda/NVIDIA H100 80GB HBM3 cuda 13.0/torch 2.11.0+cu130"


def config(**verify: Any) -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 16, "hidden": 8, "points": 1024, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"max_local_steps": 6},
        "runtime": {"verify": {"enabled": True, "inner_state": "carry", **verify}},
    })


def layout(trainer: InnerTrainer) -> bytes:
    return b"".join(inner_state_chunks(trainer.optimizer) or [])


class Lease:
    """One peer's lease from a carried (or fresh) state: what it submits, its start and its end as it commits them."""

    def __init__(self, cfg: RunConfig, carried: bool = True, tamper_end: Optional[Any] = None) -> None:
        workload = build_workload(cfg)
        peer = InnerTrainer.from_config(cfg, workload)
        self.theta = peer.full_params()
        if carried:
            peer.run(self.theta, 0, 0, 6, 0)  # an earlier lease: this one starts from a carried state
        self.start = layout(peer)
        self.lease = logic.Lease("L1", "p", 1, 5, 6, 3, 0, 0.0, 1.0, 10.0)
        self.update = peer.run(self.theta, 1, 5, 6, 3).pseudo_gradient
        if tamper_end is not None:  # what the peer does to its state before committing the end
            tamper_end(peer)
        self.end = layout(peer)
        self.peer = peer
        self.workload = workload

    def task(self, device_class: str, end: Optional[bytes] = None) -> Verify:
        return Verify("p", self.lease, self.theta, self.update, "sampled", "", revealed_digest(self.start),
                      revealed_digest(self.end if end is None else end), device_class)

    def revealed(self, end: Optional[bytes] = None) -> bytes:
        return pack_parts(self.start, self.end if end is None else end)


def nudge(relative: float, seed: int = 0) -> Any:
    """A peer-side change of the end state's moments by ``relative`` × their norm in a random direction (last-bit noise
    of other kernels for a small ``relative``)."""
    def tamper(peer: InnerTrainer) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for state in peer.optimizer.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    noise = torch.randn(state[key].shape, generator=generator)
                    state[key].mul_(1.0 + relative * noise)
    return tamper


def forge(share: float) -> Any:
    """The forge-state attack: the first moment pushed along a fixed direction by ``share`` × its norm."""
    def tamper(peer: InnerTrainer) -> None:
        forge_moment(peer.optimizer, hidden_direction(peer.numel, 1234), share, list(peer.model.parameters()))
        assert implausible_state(peer.optimizer) is None  # inside the bound the verifier checks: not caught by it
    return tamper


def test_an_honest_foreign_class_lease_passes_within_the_state_tolerance() -> None:
    cfg = config()
    honest = Lease(cfg, tamper_end=nudge(1e-6))
    rerunner = Rerunner(cfg, honest.workload)
    own = rerunner.compute_class
    assert rerunner.state_tolerance() == CROSS_DEVICE_STATE_TOLERANCE["fp32"]
    verdict = rerunner.check_revealed(honest.task(FOREIGN), honest.revealed())
    assert verdict.ok and verdict.bitwise and "its end state within" in verdict.detail, verdict.detail
    # the same last bits from a peer naming the verifier's own class: bitwise there, so the end differs
    verdict = rerunner.check_revealed(honest.task(own), honest.revealed())
    assert not verdict.ok and "end differs from the committed one" in verdict.detail
    # without any change the end is the re-run's, bitwise, in either class
    exact = Lease(cfg)
    for device_class in (own, FOREIGN, ""):
        verdict = rerunner.check_revealed(exact.task(device_class), exact.revealed())
        assert verdict.ok and verdict.bitwise, verdict.detail
    assert rerunner.trainer.state_digest() == FRESH_STATE_DIGEST and rerunner.trainer.reset_state


def test_a_forged_first_moment_fails_in_a_foreign_class_and_in_its_own() -> None:
    cfg = config()
    forger = Lease(cfg, tamper_end=forge(0.2))
    rerunner = Rerunner(cfg, forger.workload)
    verdict = rerunner.check_revealed(forger.task(FOREIGN), forger.revealed())
    assert not verdict.ok and verdict.bitwise, verdict.detail  # the update itself is honest: equal to the re-run
    assert "beyond the state tolerance 0.01" in verdict.detail and "first moment (exp_avg)" in verdict.detail
    assert "second moment" not in verdict.detail  # only m was forged
    verdict = rerunner.check_revealed(forger.task(rerunner.compute_class), forger.revealed())
    assert not verdict.ok and "end differs from the committed one" in verdict.detail
    # what a peer can still hide: a forgery inside the tolerance passes a foreign-class check (never its own class's)
    small = Lease(cfg, tamper_end=forge(0.2 * CROSS_DEVICE_STATE_TOLERANCE["fp32"]))
    assert rerunner.check_revealed(small.task(FOREIGN), small.revealed()).ok
    assert not rerunner.check_revealed(small.task(rerunner.compute_class), small.revealed()).ok
    # a tighter bound from the organiser catches it; 0 allows only the bitwise end
    for tolerance in (1e-4, 0.0):
        strict = Rerunner(config(cross_device_state_tolerance=tolerance), small.workload)
        verdict = strict.check_revealed(small.task(FOREIGN), small.revealed())
        assert not verdict.ok and f"state tolerance {tolerance:g}" in verdict.detail, verdict.detail


def shrink(share: float) -> Any:
    """A second moment shrunk 10⁴× (and m 100×, so the AdamW step stays as it was) on the elements where it is
    smallest, as many as keep m's and v's changes within ``share`` of their norms: the next steps there are ~100×
    larger (the gradients then dominate v), which the L2 errors of m, v and u hardly see."""
    def tamper(peer: InnerTrainer) -> None:
        states = list(peer.optimizer.state.values())
        m = torch.cat([s["exp_avg"].reshape(-1) for s in states]).double()
        v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states]).double()
        order = torch.argsort(v)
        fits = ((m[order] ** 2).cumsum(0) <= share ** 2 * float((m ** 2).sum())) & \
            ((v[order] ** 2).cumsum(0) <= share ** 2 * float((v ** 2).sum()))
        chosen = torch.zeros_like(v, dtype=torch.bool)
        chosen[order[: int(fits.sum())]] = True
        offset = 0
        with torch.no_grad():
            for state in states:
                count = state["exp_avg"].numel()
                mask = chosen[offset : offset + count].view_as(state["exp_avg"])
                state["exp_avg"][mask] *= 1e-2
                state["exp_avg_sq"][mask] *= 1e-4
                offset += count
        assert int(chosen.sum()) > 0 and implausible_state(peer.optimizer) is None
    return tamper


def test_a_second_moment_shrunk_where_it_is_small_fails_on_the_step_size() -> None:
    cfg = config()
    shrunk = Lease(cfg, tamper_end=shrink(0.3 * CROSS_DEVICE_STATE_TOLERANCE["fp32"]))
    rerunner = Rerunner(cfg, shrunk.workload)
    ours = Lease(cfg).peer.optimizer
    gaps, _ = state_gap(state_moments(ours), state_moments(shrunk.peer.optimizer))
    assert max(gaps["m"], gaps["v"], gaps["u"]) <= CROSS_DEVICE_STATE_TOLERANCE["fp32"] < gaps["precond"], gaps
    verdict = rerunner.check_revealed(shrunk.task(FOREIGN), shrunk.revealed())
    assert not verdict.ok and "step size 1/(√v̂+eps), RMS log-ratio" in verdict.detail, verdict.detail
    assert "first moment" not in verdict.detail and "second moment" not in verdict.detail


def test_a_fresh_start_is_revealed_and_its_end_checked() -> None:
    cfg = config()
    fresh = Lease(cfg, carried=False)
    assert fresh.start == b"" and revealed_digest(b"") == FRESH_STATE_DIGEST
    rerunner = Rerunner(cfg, fresh.workload)
    for device_class in (rerunner.compute_class, FOREIGN):
        verdict = rerunner.check_revealed(fresh.task(device_class), fresh.revealed())
        assert verdict.ok and verdict.bitwise, verdict.detail
    forged = Lease(cfg, carried=False, tamper_end=forge(0.2))
    verdict = rerunner.check_revealed(forged.task(FOREIGN), forged.revealed())
    assert not verdict.ok and "first moment (exp_avg)" in verdict.detail


def test_an_end_off_its_commitment_or_malformed_fails() -> None:
    cfg = config()
    honest = Lease(cfg)
    rerunner = Rerunner(cfg, honest.workload)
    task = honest.task(FOREIGN)
    tampered = bytearray(honest.end)
    tampered[20] ^= 1  # one bit of the first parameter's exp_avg
    for device_class in (FOREIGN, rerunner.compute_class):
        verdict = rerunner.check_revealed(honest.task(device_class), honest.revealed(bytes(tampered)))
        assert not verdict.ok and verdict.detail == "the revealed end state does not match its commitment"
    # the start part alone (the layout before end states were revealed), a length field past the data, a truncated end
    for bad, why in ((honest.start, "the revealed inner state is malformed"),
                     (struct.pack("<Q", 10**9) + honest.revealed()[8:], "runs past"),
                     (b"\x00" * 7, "fewer than its 8-byte length field")):
        verdict = rerunner.check_revealed(task, bad)
        assert not verdict.ok and why in verdict.detail, verdict.detail
    # an end committed and revealed consistently but with a step count set off: no honest re-run reaches it
    peer = honest.peer
    for state in peer.optimizer.state.values():
        state["step"] = state["step"] + 1
    off = layout(peer)
    verdict = rerunner.check_revealed(honest.task(FOREIGN, off), honest.revealed(off))
    assert not verdict.ok and "step count" in verdict.detail, verdict.detail
    load_inner_state(peer.optimizer, honest.end)
    assert rerunner.trainer.state_digest() == FRESH_STATE_DIGEST


def test_state_gap_measures_each_part() -> None:
    cfg = config()
    honest = Lease(cfg)
    ours = state_moments(honest.peer.optimizer)
    gaps, problem = state_gap(ours, ours)
    assert problem is None and gaps == {"m": 0.0, "v": 0.0, "u": 0.0, "precond": 0.0, "residual": 0.0}
    theirs = [None if entry is None else (entry[0], entry[1] * 1.01, *entry[2:]) for entry in ours]
    gaps, problem = state_gap(ours, theirs)  # type: ignore[arg-type]
    assert problem is None and gaps["m"] == pytest.approx(0.01, rel=1e-4) and gaps["v"] == 0.0
    assert gaps["u"] == pytest.approx(0.01, rel=1e-3) and gaps["precond"] == 0.0
    quartered = [None if entry is None else (entry[0], entry[1], entry[2] * 0.25, *entry[3:]) for entry in ours]
    gaps, _ = state_gap(ours, quartered)  # type: ignore[arg-type]
    assert gaps["precond"] == pytest.approx(math.log(2), rel=1e-2)  # √v halved: the step size doubles, ε aside
    residual = torch.ones(10)
    gaps, _ = state_gap(ours, ours, residual, residual * 1.5)
    assert gaps["residual"] == pytest.approx(0.5)
    gaps, _ = state_gap(ours, ours, residual, residual * 1.5, residual_scale=50 * float(residual.norm()))
    assert gaps["residual"] == pytest.approx(0.01)
    assert state_gap(ours, ours, residual, None)[1] == "a residual on one side only"
    assert state_gap(ours, ours[:-1])[1] is not None


def test_the_reveal_bound_is_two_states_and_refused_before_reading(tmp_path: Any) -> None:
    from asyncloco.coordinator.node import EVENT_TYPES
    from asyncloco.coordinator.verify import DaemonVerification, VerificationPort

    cfg = config()
    honest = Lease(cfg)
    params = list(honest.peer.model.parameters())
    inner = sum(9 + 8 * p.numel() for p in params)
    numel = sum(p.numel() for p in params)
    assert revealed_size(inner, numel, False) == 8 + 2 * inner == 8 + 2 * len(honest.end)
    assert revealed_size(inner, numel, True) == 8 + 2 * (inner + 8 + 4 * numel)
    assert revealed_size(inner, numel, True, ends=False) == inner + 8 + 4 * numel
    assert len(honest.revealed()) <= revealed_size(inner, numel, False)
    # the coordinator's side: the bound is known before any body byte, and an oversize reveal is refused at it
    def unused(*_: Any) -> Any:
        raise AssertionError("the reveal bound needs nothing of the coordinator but its config and model")

    port = VerificationPort(cfg=cfg, dir=tmp_path, workload=build_workload(cfg), model=honest.peer.model,
                            node=unused, journal=unused, eval_model=unused, bookkeep=unused, write_status=unused,
                            wait_for_snapshot=unused)  # type: ignore[arg-type]
    desk = DaemonVerification(port, EVENT_TYPES)
    check = honest.task(FOREIGN)
    desk.awaiting["L1"] = (check, 0.0, None)  # type: ignore[assignment]  # (the reveal the check asked for)
    limit = desk.reveal_limit("L1", "p")
    assert limit == revealed_size(inner, numel, False)
    with pytest.raises(ValueError, match="exceeds"):
        desk.reveal("L1", b"\x00" * (limit + 1), "p")
    assert "L1" in desk.awaiting  # still awaited: nothing was taken
    with pytest.raises(ValueError, match="no reveal of lease"):
        desk.reveal_limit("L1", "someone else")
    assert split_parts(honest.revealed()) == (honest.start, honest.end)


def test_a_forged_residual_fails_in_a_foreign_class() -> None:
    """With error feedback the end state carries the residual the upload left; a foreign-class peer's is held to the
    upload's own cross-device bound, of the upload's norm."""
    from asyncloco.train.feedback import ErrorFeedback
    from asyncloco.peer.reveal import RevealStore
    from asyncloco.train.commitments import committed_digest, pack_reveal

    codec, decay = "sgn15of16", 0.5
    cfg = RunConfig.model_validate({
        **config().model_dump(exclude={"runtime"}),
        "runtime": {"codec": codec, "error_feedback": True, "error_feedback_decay": decay,
                    "verify": {"enabled": True, "inner_state": "carry"}},
    })
    workload = build_workload(cfg)
    peer = InnerTrainer.from_config(cfg, workload)
    feedback = ErrorFeedback(codec, True, decay)
    theta = peer.full_params()
    feedback.encode_decoded(peer.run(theta, 0, 0, 6, 0).pseudo_gradient)
    feedback.settle(True)
    store = RevealStore(2)
    store.hold("L2", peer.optimizer, feedback.residual, feedback=True)
    start = committed_digest(peer.state_digest() or "", feedback.residual)
    pseudo_gradient = peer.run(theta + 0.01, 1, 2, 5, 6).pseudo_gradient
    inner_end = store.hold_end("L2", peer.optimizer)
    _, decoded = feedback.encode_decoded(pseudo_gradient)
    assert inner_end is not None and decoded is not None and feedback.pending is not None
    end = store.end_residual("L2", inner_end, feedback.pending)
    revealed = store.reveal("L2")
    assert revealed is not None
    lease = logic.Lease("L2", "p", 1, 2, 5, 6, 0, 0.0, 1.0, 10.0)
    rerunner = Rerunner(cfg, workload)
    verdict = rerunner.check_revealed(Verify("p", lease, theta + 0.01, decoded, "", "", start, end, FOREIGN), revealed)
    assert verdict.ok and "its end state within" in verdict.detail, verdict.detail
    # a residual pushed along a direction of its own by 10 % of the upload's norm, committed and revealed consistently
    direction = hidden_direction(peer.numel, 7)
    forged = feedback.pending + 0.1 * float((decoded + feedback.pending).norm()) * direction
    forged_end = pack_reveal(b"".join(inner_state_chunks(peer.optimizer) or []), forged)
    task = Verify("p", lease, theta + 0.01, decoded, "", "", start, committed_digest(inner_end, forged), FOREIGN)
    verdict = rerunner.check_revealed(task, pack_parts(split_parts(revealed)[0], forged_end))
    assert not verdict.ok and "error-feedback residual differs from the re-run's by 0.1 of the upload's norm" in \
        verdict.detail, verdict.detail


def test_only_a_passed_check_leaves_its_end_state_in_the_store(tmp_path: Any) -> None:
    """coordinator/chained.py ``StateStore`` on disk (the default): a passed own-class check writes the lease's end state
    (the re-run's, equal to the committed layout), a foreign-class pass the revealed end, a failed check nothing."""
    import dataclasses

    from asyncloco.coordinator.chained import StateStore

    cfg = config()
    exact = Lease(cfg)
    rerunner = Rerunner(cfg, exact.workload)
    rerunner.keep_end, rerunner.store = True, StateStore(tmp_path / "kept-states")
    files = lambda: sorted(p.name for p in (tmp_path / "kept-states").glob("*.state"))  # noqa: E731
    # an update off the re-run (the lease's end state is still the committed one): failed, nothing written
    off = dataclasses.replace(exact.task(rerunner.compute_class), update=exact.update * 1.5)
    verdict = rerunner.check_revealed(off, exact.revealed())
    assert not verdict.ok and verdict.end_state is None and files() == []
    verdict = rerunner.check_revealed(exact.task(rerunner.compute_class), exact.revealed())
    assert verdict.ok and verdict.end_state is not None and files() == ["L1.state"]
    assert bytes(verdict.end_state) == exact.end and (tmp_path / "kept-states" / "L1.state").read_bytes() == exact.end
    rerunner.store.drop("L1")
    verdict = rerunner.check_revealed(exact.task(FOREIGN), exact.revealed())
    assert verdict.ok and bytes(verdict.end_state or b"") == exact.end and files() == ["L1.state"]


def test_a_reveal_is_awaited_for_its_transfer_and_no_longer_than_the_floor_allows(tmp_path: Any) -> None:
    """The deadline of a reveal (coordinator/verify.py ``reveal_window``): ``reveal_timeout`` plus the states' transfer at
    half the upload rate the coordinator measured (a fixed 300 s expelled honest peers at 150m on a home uplink), at
    most at the RPC service's floor rate; a body still arriving stretches it, up to that cap, then the check fails."""
    import asyncio
    import dataclasses
    from types import SimpleNamespace

    from asyncloco.clock import FakeClock
    from asyncloco.coordinator.node import EVENT_TYPES
    from asyncloco.coordinator.verify import DaemonVerification, VerificationPort
    from asyncloco.transport.rpc import ServiceLimits

    def unused(*_: Any) -> Any:
        raise AssertionError("not used by the reveal's deadline")

    cfg = config()
    honest = Lease(cfg)
    clock = FakeClock()
    peer = SimpleNamespace(transfer_s=None)
    node = SimpleNamespace(clock=clock, state=SimpleNamespace(peers={"p": peer}, policy=SimpleNamespace(upload_bytes=1000)))
    port = VerificationPort(cfg=cfg, dir=tmp_path, workload=build_workload(cfg), model=honest.peer.model,
                            node=node, journal=unused, eval_model=unused, bookkeep=unused, write_status=unused,
                            wait_for_snapshot=unused)  # type: ignore[arg-type]
    desk = DaemonVerification(port, EVENT_TYPES)
    verdicts: list[tuple[float, str]] = []

    async def record(task: Verify, comparison: Any) -> None:
        verdicts.append((clock.monotonic(), comparison.detail))

    desk._verdict = record  # type: ignore[method-assign]
    check = honest.task(desk.verifier.rerunner.compute_class)  # the verifier's own class: the start state alone
    size, base = 8 + desk.state_part_size(), cfg.runtime.verify.reveal_timeout
    cap = base + ServiceLimits().transfer_timeout(size)
    assert desk.reveal_window(check) == (cap, cap)  # no upload measured yet: the floor's window
    peer.transfer_s = 10.0 * 1000 / (2 * size)  # its last update (1000 bytes) at a rate that sends the state in 5 s
    window, _ = desk.reveal_window(check)
    assert window == pytest.approx(base + 10.0) and window < cap
    # another class reveals both states: twice the bytes
    assert desk.reveal_window(honest.task(FOREIGN))[0] == pytest.approx(base + 10.0 * (8 + 2 * (size - 8)) / size)
    peer.transfer_s = 1e9  # a crawling uplink: never beyond the floor's window
    assert desk.reveal_window(check) == (cap, cap)
    peer.transfer_s = 10.0 * 1000 / (2 * size)

    async def scenario() -> None:
        desk._await_reveal(check)
        await asyncio.sleep(0)
        await clock.advance(window - 1.0)
        assert verdicts == [] and "L1" in desk.awaiting
        desk.reveal_limit("L1", "p", size)  # its body starts arriving: the deadline waits for its transfer
        await clock.advance(2.0)
        assert verdicts == [] and "L1" in desk.awaiting  # past the window, the body still on its way
        await clock.advance(cap)  # the transfer never completes: failed at the cap
        (at, detail), = verdicts
        assert at == pytest.approx(cap) and "L1" not in desk.awaiting and desk.reveals["late"] == 1
        rate = 1000 / peer.transfer_s  # its last update's, as measured: below the floor a reveal needs, and so named
        assert rate < ServiceLimits().transfer_min_bytes_per_s
        assert detail == (f"the lease's inner states were not revealed within {cap:.0f} s "
                          f"(runtime.verify.reveal_timeout {base:g} s and their transfer); its last update came at "
                          f"{rate / 1e3:.1f} kB/s, below the 65.5 kB/s a reveal needs — an uplink this slow cannot be "
                          "verified with runtime.verify.inner_state carry (use reset)")
        verdicts.clear()
        # a silent peer on a fast uplink: failed at its window, nothing said of its link
        peer.transfer_s = 1000 / 1e6
        silent = dataclasses.replace(check, lease=logic.Lease("L2", "p", 1, 5, 6, 3, 0, 0.0, 1.0, 10.0))
        silent_window, _ = desk.reveal_window(silent)
        desk._await_reveal(silent)
        await asyncio.sleep(0)
        start = clock.monotonic()
        await clock.advance(cap)
        (at, detail), = verdicts
        assert at - start == pytest.approx(silent_window) and detail.endswith("and their transfer)")

    asyncio.run(asyncio.wait_for(scenario(), timeout=30.0))
