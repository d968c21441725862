"""Deterministic fake-time simulation of asynchronous Local-SGD (paper Algorithm 2).

Workers are in-process :class:`~asyncloco.train.inner.InnerTrainer` replicas that really train;
only *time* is fake: a worker with ``s`` seconds per step finishes a lease of H_w steps
``H_w · s`` seconds after it started. The coordinator is the same pure
:func:`~asyncloco.coordinator.logic.handle` the networked daemon drives, with exact speed reports,
so the grace window predicts completions perfectly and the run is Algorithm 2 exactly:

* a completed worker submits its pseudo-gradient (applied at once) and asks for new work;
* if other leases are expected to finish within the grace period it is held, and all workers that
  finish in the window restart together from the newest θ at the last in-window completion;
* sync DiLoCo is the same loop in barrier mode (everyone waits for the whole round).

The run stops once the applied updates sum to ``sim.total_local_updates``. Same seed and config →
bit-identical JSON-lines trace.

Scoring (docs/algorithm.md §8): a method's *final* metrics are those of θ after the last update that
moved θ within the budget — never more local updates than the budget (an update that would cross it
is left out of the score, though the run goes on), and never a sync round half buffered: evaluations
only ever look at θ right after it moved, and report the local updates θ actually contains.
"""

from __future__ import annotations

import dataclasses

import heapq
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

import torch

from asyncloco.algo.eager import eager_start
from asyncloco.algo.schedule import ShardSchedule
from asyncloco.config import RunConfig, worker_seconds_per_step
from asyncloco.coordinator.logic import (
    Action,
    Applied,
    Assign,
    Expired,
    FRESH_STATE_DIGEST,
    Fetched,
    Hold,
    PROBATION_WAIT,
    Rejected,
    RequestWork,
    SpeedReport,
    SubmitUpdate,
    Tick,
    Verified,
    Verify,
    handle,
    new_state,
)
from asyncloco.coordinator.methods import build_method, coordinator_policy
from asyncloco.models.workload import Workload, flatten_params, load_flat_params, param_groups
from asyncloco.train.inner import InnerTrainer, RoundResult
from asyncloco.sim.fast_toy import FastToyTrainer, FlatAdamState
from asyncloco.models.toy import ToyWorkload
from asyncloco.workloads import build_workload

__all__ = ["SimResult", "Simulation", "build_workload", "pretrain"]

logger = logging.getLogger(__name__)


def pretrain(cfg: RunConfig, workload: Workload) -> torch.Tensor:
    """θ0 after ``sim.pretrain_steps`` plain AdamW steps (one worker, no Local-SGD), as a flat vector.

    The paper fine-tunes a checkpoint pretrained for 24,000 steps; this is the scaled-down version.
    Batches come from the *tail* of each shard's first epoch, round-robin over shards, while
    Local-SGD leases start at the head, so the two phases do not share data within an epoch.
    """
    model = workload.build_model(cfg.seed)
    steps = cfg.sim.pretrain_steps
    if steps == 0:
        return flatten_params(model)
    peak = cfg.sim.pretrain_lr or cfg.inner.lr
    schedule = ShardSchedule(peak, min(cfg.inner.min_lr, peak), min(cfg.inner.warmup_steps, steps - 1), steps)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=peak, betas=cfg.inner.betas, weight_decay=cfg.inner.weight_decay
    )
    sizes = workload.shard_sizes()
    model.train()
    for step in range(steps):
        shard = step % len(sizes)
        index = sizes[shard] - 1 - (step // len(sizes)) % sizes[shard]
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr(step)
        loss = workload.loss(model, workload.batch(shard, index))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.inner.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        optimizer.step()
    logger.info("pretrained θ0 for %d steps (final train loss %.4f)", steps, float(loss.detach()))
    return flatten_params(model)


@dataclass
class SimResult:
    method: str
    label: str
    evals: list[dict[str, float]] = field(default_factory=list)  # time, local_updates, version, loss, ...
    at_budget: dict[str, float] = field(default_factory=dict)  # the eval once sim.total_local_updates is reached
    applied: int = 0
    local_updates: int = 0
    sim_time: float = 0.0
    staleness: list[int] = field(default_factory=list)
    upload_bytes: int = 0  # wire_bytes(runtime.codec, numel) per submitted update
    held: int = 0  # updates held for a modelled check (sim.checks)

    @property
    def final(self) -> dict[str, float]:
        """Metrics of θ after the last update within the budget, the paper's comparison point."""
        return self.at_budget or self.evals[-1]

    def time_to_reach(self, loss: float) -> float | None:
        """Simulated time of the first evaluation at or below ``loss`` (None if never). Inclusive, so a
        method identical to sync DiLoCo reaches sync's final loss exactly when sync does."""
        for record in self.evals:
            if record["loss"] <= loss:
                return record["time"]
        return None


@dataclass
class _Worker:
    """A simulated worker holds no model: only its inner optimizer state (the AdamW moments, which the
    paper keeps on each worker across rounds) and, while its lease runs, the pseudo-gradient."""

    name: str
    seconds_per_step: float
    inner_state: dict[int, dict[str, Any]] = field(default_factory=dict)  # param index -> optimizer state
    fast_state: FlatAdamState | None = None  # the same, for the toy task's fast trainer
    lease_id: str | None = None
    base_version: int = 0
    steps: int = 0
    result: RoundResult | None = None
    feedback: Any = None  # train/feedback.py ErrorFeedback: runtime.codec + error feedback, exactly as a peer applies them
    # the eager start (algo/eager.py): the update on its way as the coordinator will decode it (lease id, tensor), the
    # last one it refused, and the lease whose update the lease in training started from θ minus
    out: tuple[str, torch.Tensor] | None = None
    refused: str = ""
    eager_of: str | None = None
    # sim.ask_ahead_s: the lease granted while one trains, with the θ it was granted from (it trains next); the lease
    # in training it asked ahead for (the ask then is not repeated at its upload); an ask put off behind an upload
    pending: tuple[Assign, torch.Tensor, float] | None = None  # (the grant, its θ, when granted)
    asked_for: str | None = None
    ask_deferred: bool = False


class Simulation:
    """One method, one config: ``Simulation(cfg, "async_dn_dylu").run(trace=fh)``.

    With ``target_loss`` the run goes on past the budget, until an evaluation reaches that loss or
    the simulated time passes ``time_limit`` — that is how "time to reach sync DiLoCo's final
    loss" is measured. ``result.final`` is always the evaluation at the budget.
    """

    def __init__(
        self,
        cfg: RunConfig,
        method: str,
        workload: Workload | None = None,
        target_loss: float | None = None,
        time_limit: float = math.inf,
        initial_params: torch.Tensor | None = None,
        fast: bool = True,
    ) -> None:
        self.cfg = cfg
        self.target_loss = target_loss
        self.time_limit = time_limit
        self.update_limit = cfg.sim.reach_budget_factor * cfg.sim.total_local_updates
        self.workload = workload if workload is not None else build_workload(cfg)
        speeds = worker_seconds_per_step(cfg.sim.profile, cfg.sim.workers)
        self.eval_model = self.workload.build_model(cfg.seed)
        theta = (initial_params if initial_params is not None else pretrain(cfg, self.workload)).clone()
        self.spec, optimizer, transforms = build_method(
            method, cfg.outer, cfg.sim.workers, param_groups(self.eval_model), 2 if cfg.sim.overlap else 1,
            cfg.schedule.max_local_steps,
        )
        policy = coordinator_policy(cfg, self.spec, self.workload.units_per_step, simulated=True)
        self.state = new_state(theta, optimizer, transforms, policy, self.workload.shard_sizes(), cfg.sim.seed)
        # One model replica trains every lease in turn (its parameters are loaded from θ each round);
        # each worker's own AdamW state is swapped in while it trains. Memory: one model plus, per
        # worker, its optimizer moments and its pending pseudo-gradient — 1,024 workers fit.
        self.trainer = InnerTrainer.from_config(cfg, self.workload)
        self._trainer_params = list(self.trainer.model.parameters())
        # The toy MLP with plain fp32 AdamW trains on a hand-written loop, ~3× faster per step, same update
        # (asyncloco/sim/fast_toy.py); ``fast=False`` keeps the autograd path (tests compare the two).
        self.fast: FastToyTrainer | None = None
        if (fast and isinstance(self.workload, ToyWorkload) and cfg.inner.optimizer == "adamw" and cfg.inner.precision == "fp32"
                and not self.trainer.lease_warmup):  # runtime.verify.lease_warmup: only the autograd path ramps the LR
            self.fast = FastToyTrainer(
                self.workload, cfg.inner.schedule(), cfg.inner.betas, cfg.inner.weight_decay, cfg.inner.grad_clip
            )
        self.workers = {f"w{i}": _Worker(f"w{i}", s) for i, s in enumerate(speeds)}
        # runtime.codec: every upload goes through the peer's own encode → decode (train/feedback.py), with the
        # residual when runtime.error_feedback is on; "none" is fp32 and skips the round trip (bit-identical)
        self.upload_bytes = 4 * theta.numel()
        if cfg.runtime.codec != "none":
            # imported only here: the codecs live in transport/ (whose package imports hivemind), which the
            # simulator does not need for fp32 uploads
            from asyncloco.train.feedback import ErrorFeedback, upload_bytes

            self.upload_bytes = upload_bytes(cfg.runtime.codec, theta.numel())
            for worker in self.workers.values():
                worker.feedback = ErrorFeedback(cfg.runtime.codec, cfg.runtime.uses_error_feedback,
                                                cfg.runtime.error_feedback_decay)
        # sim.checks: the chosen leases' updates wait for one verifier's re-run, one check at a time (honest workers:
        # every verdict agrees; what is modelled is the wait, which makes a held update staler when applied)
        if cfg.sim.checks and self.state.policy.verify is None:
            raise ValueError("sim.checks models verification's held checks: it needs runtime.verify.enabled true")
        self.rerun_seconds_per_step = cfg.sim.rerun_seconds_per_step or min(speeds)
        self._verifier_free = 0.0
        # runtime.verify.ahead with inner_state reset: a chosen lease's re-run is queued when it is issued (lease id -> when
        # it is done), not when its update arrives; the bound on results kept is not modelled
        verify = cfg.runtime.verify
        self.ahead = verify.enabled and verify.inner_state == "reset" and verify.ahead > 0
        self._ahead_ready: dict[str, float] = {}
        self._on_arrival: list[tuple[str, str]] = []  # (lease id, worker): verdicts decided right after their submit
        self._queue: list[tuple[float, int, str, str]] = []
        self._uploads: dict[str, list[tuple[SubmitUpdate, int]]] = {}  # per worker: updates on their way (sim.upload_s)
        self._seq = 0
        self._next_eval = cfg.sim.eval_every
        self._moved_at = (0, 0.0)  # (local updates θ contains, time) after the last update that moved θ
        self.result = SimResult(method, self.spec.label)
        self._trace: TextIO | None = None

    # ------------------------------------------------------------------------------------ output

    def _emit(self, record: dict[str, Any]) -> None:
        if self._trace is not None:
            self._trace.write(json.dumps(record, sort_keys=True) + "\n")

    def _evaluate(self, now: float) -> None:
        """Evaluate θ as it stands: it contains the local updates up to the last update that moved it."""
        if self.result.evals and self.result.evals[-1]["local_updates"] == self._moved_at[0] and self.result.evals[-1]["time"] == self._moved_at[1]:
            return  # this θ is already evaluated
        load_flat_params(self.eval_model, self.state.params)
        metrics = self.workload.evaluate(self.eval_model)
        local_updates, time = self._moved_at
        record = {"time": time, "local_updates": local_updates, "version": self.state.version, **metrics}
        self.result.evals.append(record)
        self._emit({"type": "eval", "method": self.result.method, **record})

    # ------------------------------------------------------------------------------------- loop

    def _push(self, time: float, kind: str, worker: str) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (time, self._seq, kind, worker))

    def _start(self, action: Assign, now: float, theta: torch.Tensor | None = None, asked: float | None = None) -> None:
        """A lease assigned: its worker trains it now (the result waits for its "complete" event) — or, asked for
        ahead (``sim.ask_ahead_s``) while another trains, once that one ends, from the θ it was granted from."""
        if self._out_of_budget():
            return  # the run ends with this event: don't train a lease that can never finish
        lease = action.lease
        worker = self.workers[action.peer]
        if worker.lease_id is not None:
            worker.pending = (action, self.state.params.clone(), now)
            self._dispatch(handle(self.state, Fetched(worker.name, lease.base_version), now)[1], now)
            return
        worker.lease_id, worker.base_version, worker.steps = lease.lease_id, lease.base_version, lease.steps
        if lease.fresh:  # granted with a fresh start (a slow uplink: coordinator/logic/leases.py fresh_reason)
            worker.inner_state, worker.fast_state = {}, None
            if worker.feedback is not None:
                worker.feedback.drop()
        fetched = theta is not None
        theta, worker.eager_of = self.state.params if theta is None else theta, None
        if lease.eager_of and worker.out is not None and worker.out[0] == lease.eager_of:
            theta, worker.eager_of = eager_start(theta, worker.out[1], lease.eager_share), lease.eager_of
        worker.result = self._train(worker, lease.shard, lease.start_offset, lease.steps, lease.lr_offset, theta)
        if not fetched:  # the worker has its θ: the coordinator need not retain that version for this lease
            self._dispatch(handle(self.state, Fetched(worker.name, lease.base_version), now)[1], now)
        if self.cfg.sim.checks and self.ahead and lease.verify and not lease.verify.startswith(PROBATION_WAIT) \
                and not lease.eager_of:
            # runtime.verify.ahead (coordinator/ahead.py): its re-run starts now, while the worker trains
            start = max(now, self._verifier_free)
            self._verifier_free = self._ahead_ready[lease.lease_id] = start + lease.steps * self.rerun_seconds_per_step
        finish = now + lease.steps * worker.seconds_per_step
        self._push(finish, "complete", worker.name)
        if self.cfg.sim.ask_ahead_s > 0:
            self._push(max(now, finish - self.cfg.sim.ask_ahead_s), "ask", worker.name)
        self._emit(
            {
                "type": "task",
                "method": self.result.method,
                "time": now,
                "worker": worker.name,
                "lease_id": lease.lease_id,
                "shard": lease.shard,
                "steps": lease.steps,
                "start_offset": lease.start_offset,
                "lr_offset": lease.lr_offset,
                "base_version": lease.base_version,
                "finish": finish,
                "train_loss": worker.result.mean_loss,
                **({"verify": lease.verify} if self.cfg.sim.checks and lease.verify else {}),  # why it is re-run
                **({"eager_of": worker.eager_of} if worker.eager_of else {}),  # started from θ minus its update
                **({"asked": asked} if asked is not None else {}),  # granted then, from θ then (sim.ask_ahead_s)
            }
        )

    def _dispatch(self, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, Assign):
                self._start(action, now)
            elif isinstance(action, Hold):
                if math.isfinite(action.until):
                    self._push(action.until, "tick", action.peer)
            elif isinstance(action, Applied):
                self.result.applied += 1
                self.result.staleness.append(action.staleness)
                if action.moved:
                    self._moved_at = (self.state.local_updates, now)
                self._emit(
                    {
                        "type": "applied",
                        "method": self.result.method,
                        "time": now,
                        "worker": action.peer,
                        "lease_id": action.lease_id,
                        "version": action.version,
                        "staleness": action.staleness,
                        "steps": action.steps,
                        "local_updates": self.state.local_updates,
                    }
                )
                if action.moved and self.state.local_updates >= self._next_eval:
                    self._evaluate(now)
                    while self._next_eval <= self.state.local_updates:
                        self._next_eval += self.cfg.sim.eval_every
            elif isinstance(action, Expired):
                # never in a simulation (no deadlines, every θ fetched at once): a lease taken back would
                # leave its worker training for nothing, so fail loudly rather than skew a comparison
                raise AssertionError(f"simulated lease {action.lease_id} was taken back: {action.reason}")
            elif isinstance(action, Verify):
                # one verifier, first come first served: the re-run of the lease's steps (sim.checks), or the one made
                # ahead of the update (runtime.verify.ahead)
                self.result.held += 1
                ready = self._ahead_ready.pop(action.lease.lease_id, None)
                if ready is None:
                    ready = self._verifier_free = max(now, self._verifier_free) + action.lease.steps * self.rerun_seconds_per_step
                verdict_at = max(now, ready)
                if ready <= now:  # its re-run made ahead is done: the verdict is decided right after the submit
                    self._on_arrival.append((action.lease.lease_id, action.peer))
                else:
                    self._push(verdict_at, f"verdict:{action.lease.lease_id}", action.peer)
                self._emit({"type": "held", "method": self.result.method, "time": now, "worker": action.peer,
                            "lease_id": action.lease.lease_id, "why": action.lease.verify, "verdict_at": verdict_at})
            elif isinstance(action, Rejected):
                self._emit({"type": "rejected", "method": self.result.method, "time": now, "worker": action.peer, "reason": action.reason})

    def _train(self, worker: _Worker, shard: int, start_offset: int, steps: int, lr_offset: int,
               theta: torch.Tensor | None = None) -> RoundResult:
        """Run one lease from ``theta`` (default: θ) on the shared replica with ``worker``'s inner optimizer state
        swapped in."""
        theta = self.state.params if theta is None else theta
        if self.fast is not None:
            if worker.fast_state is None or self.trainer.reset_state:  # runtime.verify.inner_state: reset
                worker.fast_state = self.fast.new_state()
            return self.fast.run(worker.fast_state, theta, shard, start_offset, steps, lr_offset)
        state = self.trainer.optimizer.state
        state.clear()
        for index, param in enumerate(self._trainer_params):
            if index in worker.inner_state:
                state[param] = worker.inner_state[index]
        result = self.trainer.run(theta, shard, start_offset, steps, lr_offset)
        worker.inner_state = {index: state[param] for index, param in enumerate(self._trainer_params) if param in state}
        state.clear()
        return result

    def _out_of_budget(self) -> bool:
        limit = self.cfg.sim.total_local_updates if self.target_loss is None else self.update_limit
        return self.state.local_updates >= limit

    def _score_at_budget(self, now: float) -> None:
        """Fix the final metrics: θ after the last update that moved it within the budget."""
        if not self.result.at_budget:
            self._evaluate(now)
            self.result.at_budget = dict(self.result.evals[-1])

    def _finished(self, now: float) -> bool:
        if self.state.local_updates < self.cfg.sim.total_local_updates:
            return False
        self._score_at_budget(now)
        if self.target_loss is None or now >= self.time_limit or self.state.local_updates >= self.update_limit:
            return True
        return any(record["loss"] <= self.target_loss for record in self.result.evals)

    def events(self) -> Iterator[tuple[float, str, str]]:
        while self._queue:
            time, _, kind, worker = heapq.heappop(self._queue)
            yield time, kind, worker

    def _upload(self, name: str, now: float) -> None:
        """Start uploading the worker's oldest finished update (``sim.upload_s``) and ask for its next lease, as a
        peer of a slow link does: its lease request names the lease still uploading (two leases at most)."""
        submit, steps = self._uploads[name][0]
        feedback = self.workers[name].feedback
        if feedback is not None:  # encoded now, after the previous upload settled its residual (in order, as a peer)
            submit = dataclasses.replace(submit, pseudo_gradient=feedback.roundtrip(submit.pseudo_gradient))
            self._uploads[name][0] = (submit, steps)
        worker = self.workers[name]
        worker.out = (submit.lease_id, submit.pseudo_gradient)
        if worker.asked_for != submit.lease_id:  # not asked for ahead: ask now
            self._dispatch(handle(self.state, RequestWork(name, keep=submit.lease_id), now)[1], now)
        worker.asked_for, worker.ask_deferred = None, False
        self._push(now + self.cfg.sim.upload_s, "arrive", name)
        if worker.pending is not None and worker.lease_id is None:  # the lease asked for ahead trains now
            (action, theta, asked), worker.pending = worker.pending, None
            self._start(action, now, theta, asked)

    def _ask(self, name: str, now: float) -> None:
        """``sim.ask_ahead_s`` before its lease's end: the worker asks for the next one, naming the lease in training
        (``keep``) — once its previous update is in, as a peer asks ahead (peer/pipeline.py); until then put off."""
        worker = self.workers[name]
        if worker.lease_id is None or worker.asked_for == worker.lease_id:
            return
        if self._uploads.get(name):
            worker.ask_deferred = True
            return
        worker.asked_for, worker.ask_deferred = worker.lease_id, False
        self._dispatch(handle(self.state, RequestWork(name, keep=worker.lease_id), now)[1], now)

    def _arrive(self, name: str, submit: SubmitUpdate, steps: int, now: float) -> bool:
        """An update reaches the coordinator (its lease's end, or ``sim.upload_s`` later); True: the run is over."""
        worker = self.workers[name]
        if submit.eager_of is not None and submit.eager_of == worker.refused:
            # it started from θ minus an update the coordinator refused: a peer drops such a lease (its steps are given
            # back, peer/pipeline.py); the simulator, which never takes a lease back, submits it as trained from θ (its
            # start off by that update's share: after a refused update only)
            submit = dataclasses.replace(submit, eager_of=None)
        if self.state.local_updates + steps > self.cfg.sim.total_local_updates:
            self._score_at_budget(now)  # this update would cross the budget: score θ before it
        actions = handle(self.state, submit, now)[1]
        applied = any(isinstance(a, Applied) and a.lease_id == submit.lease_id for a in actions)
        if worker.feedback is not None:
            worker.feedback.settle(applied)
        if not applied and not any(isinstance(a, Verify) and a.lease.lease_id == submit.lease_id for a in actions):
            worker.refused = submit.lease_id
        self._dispatch(actions, now)
        while self._on_arrival:  # verdicts judged on arrival (coordinator/verify.py decide_on_arrival)
            checked, peer = self._on_arrival.pop(0)
            self._dispatch(handle(self.state, Verified(peer, checked, True, "simulated re-run"), now)[1], now)
        return self._finished(now)

    def run(self, trace: TextIO | None = None) -> SimResult:
        self._trace = trace
        units = self.workload.units_per_step
        for name, worker in self.workers.items():
            self._dispatch(handle(self.state, SpeedReport(name, units / worker.seconds_per_step), 0.0)[1], 0.0)
        self._evaluate(0.0)
        for name in self.workers:
            self._dispatch(handle(self.state, RequestWork(name), 0.0)[1], 0.0)
        now = 0.0
        for now, kind, name in self.events():
            if kind == "complete":
                worker = self.workers[name]
                assert worker.result is not None and worker.lease_id is not None
                update = worker.result.pseudo_gradient
                if worker.feedback is not None and not self.cfg.sim.upload_s > 0:  # (with upload_s: at its upload's start)
                    update = worker.feedback.roundtrip(update)
                self.result.upload_bytes += self.upload_bytes
                # with sim.checks the commitments are stand-ins: every lease starts from a fresh state (which always
                # chains) and ends in a state of its own
                digests = (FRESH_STATE_DIGEST, f"sim:{worker.lease_id}") if self.cfg.sim.checks else (None, None)
                submit = SubmitUpdate(name, worker.lease_id, worker.base_version, update,
                                      state_start=digests[0], state_end=digests[1], eager_of=worker.eager_of)
                lease_id, steps = worker.lease_id, worker.steps
                worker.result, worker.lease_id = None, None
                if self.cfg.sim.upload_s > 0:  # the update arrives once uploaded; the next lease trains meanwhile
                    uploads = self._uploads.setdefault(name, [])
                    uploads.append((submit, steps))
                    if len(uploads) == 1:
                        self._upload(name, now)
                    continue  # else it waits for the one on its way (one upload at a time, the next lease asked after)
                if self.cfg.sim.overlap:  # runtime.overlap's order: the next lease is asked for before this update is in
                    worker.out = (lease_id, update)
                    self._dispatch(handle(self.state, RequestWork(name, keep=lease_id), now)[1], now)
                if self._arrive(name, submit, steps, now):
                    break
                if not self.cfg.sim.overlap:
                    self._dispatch(handle(self.state, RequestWork(name), now)[1], now)
            elif kind == "arrive":
                submit, steps = self._uploads[name].pop(0)
                if self._arrive(name, submit, steps, now):
                    break
                if self._uploads[name]:
                    self._upload(name, now)
                elif self.workers[name].ask_deferred:
                    self._ask(name, now)
            elif kind == "ask":
                self._ask(name, now)
            elif kind.startswith("verdict:"):
                self._dispatch(handle(self.state, Verified(name, kind.split(":", 1)[1], True, "simulated re-run"), now)[1], now)
                if self._finished(now):
                    break
            else:
                self._dispatch(handle(self.state, Tick(), now)[1], now)
        self._finished(now)
        self.result.local_updates = self.state.local_updates
        self.result.sim_time = now
        return self.result


def run_to_file(cfg: RunConfig, method: str, trace_path: Path | None, workload: Workload | None = None) -> SimResult:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if trace_path is None:
        return Simulation(cfg, method, workload).run()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    with trace_path.open("w") as fh:
        return Simulation(cfg, method, workload).run(trace=fh)
