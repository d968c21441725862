"""A hostile volunteer: a real hivemind peer that joins a run and misbehaves in one chosen way.

For the attack tests (tests/test_attacks.py) and the benchmark (scripts/bench_attacks.py)::

    python -m asyncloco.testing.hostile --initial-peers ADDR --run-id RUN --attack signflip --summary out.json

It speaks the real protocol with the real client (:class:`~asyncloco.transport.rpc.CoordinatorClient`)
and, for the update attacks, trains its leases honestly first, so what it sends has the shape, the
codec and (where the attack says so) the norm of an honest update:

| attack           | what it sends |
|------------------|---------------|
| ``honest``       | its honest pseudo-gradient (a control) |
| ``huge``         | its first update × ``--scale`` (default 1e30), then honest work |
| ``nan``          | honest updates whose first value is NaN (for block codecs: a NaN block scale on the wire) |
| ``signflip``     | −``--scale`` × its honest update (default 1000) |
| ``signflip-honest`` | −1 × its honest update: same norm, opposite direction |
| ``random``       | a random direction at the norm of its honest update |
| ``replay``       | honest work, then its first applied lease (or another peer's, ``--spy-journal``) again, × −1000 |
| ``other-lease``  | −1000 × its update under another peer's lease id (``--spy-journal``: an insider; else guessed) |
| ``ghost``        | nothing but a DHT speed record claiming ``--claim`` tokens/s (default 1e12) |
| ``ghost-forge``  | DHT speed records claiming to be each honest peer (ids from ``--spy-journal``), ``last_seen`` in the future |
| ``flood``        | ``--count`` malformed messages on the raw RPC streams (garbage, bad frames/headers/sizes), a few at a time |
| ``probe``        | as an outsider: hello, lease request, θ download and a submission, each once; records the answers |
| ``hidden``       | its honest update plus ``--scale`` (default 2) × its norm along a fixed unit direction |
|                  | (``hidden_direction(numel, --direction-seed)``: colluders with one seed push the same way) |
| ``poison``       | real AdamW updates on batches half replaced by one trigger sequence (``--trigger-seed``) |
| ``alie``         | "a little is enough": μ − z·σ (z = ``--scale``, default 1) per coordinate over the differences |
|                  | of the θ versions it downloaded (the applied honest direction), at its honest norm |
| ``tailored``     | cosine ``--scale`` (0.06: just above the gate's bar) with the consensus its θ downloads show, the |
|                  | rest along the hidden direction, at its honest norm |
| ``freeride``     | no training after its first lease: echoes the newest θ difference it saw, at its first honest norm |
| ``forge-state``  | honest updates; its carried first moment pushed along the hidden direction (``--scale`` × its norm, inside the plausibility bound) before each end is committed |
| ``sleeper``      | honest for ``--sleep`` leases (default 8), then ``hidden`` (``--scale``, default 2) on every lease |
| ``sandbag``      | trains a quarter of each lease's steps, sends that update × 4 and sleeps out the rest of the lease's time |

``alie``, ``tailored``, ``freeride``: honest work until two θ downloads (arithmetic: asyncloco/testing/attacks.py).

In a run that verifies carried inner state (``runtime.verify``, on by default) a submission without commitments is
refused at the door, so the update attackers commit as an honest peer does — to the state they really trained from —
and reveal their start (and, when the Ack asks, end) states: what stops them is the re-run itself. In a run whose
uploads carry error feedback (the shipped configs) what they send goes through a residual kept as a peer keeps it,
which their commitments cover and their reveals carry. ``--device-class``
names another compute class than its own (the verifier then allows the cross-device tolerances, not bitwise equality).

A comma-separated list of update attacks runs one per round, in turn. ``--token`` (and
``--identity``) make it an admitted insider in ``runtime.admission: token`` runs. The
summary (``--summary``) records every call and the coordinator's answer, for assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import torch

from asyncloco.refusals import FATAL
from asyncloco.testing.attacks import (
    DEFAULT_SCALE, encode_attack, flood_frames, forge_moment, hidden_direction, poisoned_workload, tamper, trigger_rows,
)

__all__ = ["ATTACKS", "Hostile", "HostileOptions", "main", "hidden_direction", "trigger_rows"]

logger = logging.getLogger(__name__)

ATTACKS = (
    "honest", "huge", "nan", "signflip", "signflip-honest", "random", "replay", "other-lease",
    "ghost", "ghost-forge", "flood", "probe", "hidden", "poison", "alie", "tailored", "freeride", "forge-state",
    "sleeper", "sandbag",
)
UPDATE_ATTACKS = ("honest", "huge", "nan", "signflip", "signflip-honest", "random", "replay", "other-lease",
                  "hidden", "poison", "alie", "tailored", "freeride", "forge-state", "sleeper", "sandbag")
SUBMIT_ATTEMPTS = 4  # sends of one submission (a resend only after a failure without a refusal code)
HISTORY = 6  # θ versions an estimating attacker (alie, tailored, freeride) keeps


class HostileOptions(argparse.Namespace):
    initial_peers: list[str]
    run_id: str
    attack: str
    token: Optional[str]
    identity: Optional[str]
    config: Optional[str]
    scale: Optional[float]
    claim: float
    count: int
    rounds: Optional[int]
    duration: Optional[float]
    spy_journal: Optional[str]
    summary: Optional[str]
    seed: int
    threads: int
    direction_seed: int
    trigger_seed: int
    device_class: Optional[str]
    sleep: int


def _coordinator_id(multiaddr: str) -> str:
    return multiaddr.rsplit("/p2p/", 1)[1].split("/")[0]


@dataclass
class _Run:
    """What the update attacks keep across rounds."""

    hello: Any
    client: Any
    trainer: Any
    units_per_step: int
    reveals: Any  # peer/reveal.py RevealStore when the run verifies carried inner state (commitments), else None
    feedback: Any = None  # train/feedback.py ErrorFeedback when the run's uploads carry error feedback, else None
    inner_end: Optional[str] = None  # the inner digest of the lease's end state (its commitment adds the residual)
    speed: float = 2000.0  # a modest first claim (a generous deadline); its measured speed from the first round on
    first_lease: Optional[dict[str, Any]] = None
    own: set[str] = field(default_factory=set)


class Hostile:
    def __init__(self, options: HostileOptions) -> None:
        self.sequence = [a.strip() for a in options.attack.split(",") if a.strip()]
        unknown = [a for a in self.sequence if a not in ATTACKS]
        if unknown or not self.sequence:
            raise ValueError(f"unknown attack(s) {unknown or options.attack!r}; choose from {ATTACKS}")
        if len(self.sequence) > 1 and any(a not in UPDATE_ATTACKS for a in self.sequence):
            raise ValueError(f"only update attacks {UPDATE_ATTACKS} can be combined, got {options.attack!r}")
        self.o = options
        self.coordinator_id = _coordinator_id(options.initial_peers[0])
        self.rng = random.Random(options.seed)
        self.summary: dict[str, Any] = {"attack": options.attack, "peer_id": "", "calls": [], "rounds": 0}
        self.deadline = time.monotonic() + options.duration if options.duration else None
        self.history: list[tuple[int, torch.Tensor]] = []  # (version, θ) downloaded, oldest first
        self.first_norm: Optional[float] = None  # freeride: the norm of its one honest update
        self._direction: Optional[torch.Tensor] = None
        self.digests: tuple[Optional[str], Optional[str]] = (None, None)  # inner-state commitments of this round
        self.device_class: Optional[str] = options.device_class  # the compute class it names (None: its own)

    # ------------------------------------------------------------------------------ bookkeeping

    def _note(self, call: str, ok: bool, **details: Any) -> None:
        entry = {"call": call, "ok": ok, "time": time.time(), **details}
        self.summary["calls"].append(entry)
        self._write()

    def _write(self) -> None:
        if self.o.summary:
            path = Path(self.o.summary)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.summary, indent=1, default=str))
            tmp.replace(path)

    def _time_left(self) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            return False
        return self.o.rounds is None or self.summary["rounds"] < self.o.rounds

    # ------------------------------------------------------------------------------------- run

    async def run(self) -> dict[str, Any]:
        from asyncloco.transport.dht import start_dht, stop_dht

        dht = start_dht(
            initial_peers=self.o.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=self.o.identity
        )
        p2p = None
        try:
            self.summary["peer_id"] = dht.peer_id.to_base58()
            self._write()
            p2p = await dht.replicate_p2p()
            attack = self.sequence[0]
            if attack in ("ghost", "ghost-forge"):
                await self._ghost(dht)
            elif attack == "flood":
                await self._flood(p2p)
            elif attack == "probe":
                await self._probe(p2p)
            else:
                await self._updates(p2p)
            self.summary["finished"] = True
            self._write()
            return self.summary
        finally:
            if p2p is not None:
                await p2p.shutdown()
            stop_dht(dht)

    def _client(self, p2p: Any, numel: int, codec: str = "none") -> Any:
        from asyncloco.transport.rpc import CoordinatorClient

        return CoordinatorClient(p2p, self.coordinator_id, numel, namespace=self.o.run_id, assign_timeout=120.0,
                                 get_model_timeout=120.0, submit_timeout=120.0, download_codec="none")

    async def _hello(self, p2p: Any) -> Optional[Any]:
        from asyncloco.transport.errors import TransportError

        probe = self._client(p2p, 1)
        deadline = time.monotonic() + 60.0
        while True:
            try:
                hello = await probe.hello(token=self.o.token, timeout=10.0)
                self._note("hello", True, model_numel=hello.model_numel, codec=hello.codec)
                return hello
            except TransportError as error:
                if getattr(error, "code", None) in FATAL or time.monotonic() > deadline:
                    self._note("hello", False, error=str(error))
                    return None
                await asyncio.sleep(0.5)

    # ----------------------------------------------------------------------- update attacks

    def _round_attack(self, round_index: int) -> str:
        """A single attack runs every round (``huge``: its first round only); a list ``a,b,...`` runs one
        attack per round, in turn."""
        if len(self.sequence) == 1:
            attack = self.sequence[0]
            if attack == "sleeper":  # honest through its probation and beyond, then a hidden direction on every lease
                return "honest" if round_index < self.o.sleep else "hidden"
            return "honest" if attack == "huge" and round_index > 0 else attack
        return self.sequence[round_index % len(self.sequence)]

    def _tamper(self, attack: str, honest: torch.Tensor, round_index: int) -> torch.Tensor:
        if attack == "sandbag":
            return honest  # already its quarter of the work × 4 (_work)
        scale = self.o.scale if self.o.scale is not None and len(self.sequence) == 1 else DEFAULT_SCALE.get(attack, 1000.0)
        direction = self._hidden(honest.numel()) if attack in ("hidden", "tailored") else None
        return tamper(attack, honest, scale=scale, seed=self.o.seed * 1000 + round_index,
                      history=[theta for _, theta in self.history], first_norm=self.first_norm, direction=direction)

    def _hidden(self, numel: int) -> torch.Tensor:
        if self._direction is None or self._direction.numel() != numel:
            self._direction = hidden_direction(numel, self.o.direction_seed)
        return self._direction

    def _remember(self, version: int, theta: torch.Tensor) -> None:
        if not self.history or self.history[-1][0] < version:
            self.history.append((version, theta.detach().float().clone()))
            del self.history[: max(0, len(self.history) - HISTORY)]

    def _encode(self, codec: str, update: torch.Tensor, attack: str) -> Any:
        return encode_attack(codec, update, attack)

    def _spied_applied(self) -> Optional[dict[str, Any]]:
        """The newest lease of another peer that was applied (an insider's knowledge, from the journal)."""
        applied = [r for r in self._journal_records() if r.get("type", r.get("event")) == "applied"
                   and r.get("peer") != self.summary["peer_id"] and r.get("lease_id")]
        if not applied:
            return None
        assigned = {r["lease_id"]: r for r in self._journal_records() if r.get("type", r.get("event")) == "assign"}
        last = applied[-1]
        base = assigned.get(last["lease_id"], {}).get("base_version", 0)
        return {"lease_id": last["lease_id"], "base_version": int(base), "version": int(last["version"])}

    def _spied_leases(self, own: set[str]) -> list[dict[str, Any]]:
        """Leases of other peers that are assigned and not yet applied, newest first (from the journal)."""
        if not self.o.spy_journal or not os.path.isfile(self.o.spy_journal):
            return []
        assigned: dict[str, dict[str, Any]] = {}
        done: set[str] = set()
        for line in Path(self.o.spy_journal).read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            lease_id = record.get("lease_id")
            kind = record.get("type", record.get("event"))  # the journal's record type
            if kind == "assign" and lease_id and record.get("peer") != self.summary["peer_id"]:
                assigned[lease_id] = record
            elif kind in ("applied", "expired", "rejected", "duplicate") and lease_id:
                done.add(lease_id)
        return [r for lid, r in reversed(list(assigned.items())) if lid not in done and lid not in own]

    async def _updates(self, p2p: Any) -> None:
        """Rounds of the update attacks: a lease, its θ, honest training (or none, for a free-rider), then what the
        round's attack sends in its place."""
        run = await self._prepare(p2p)
        while run is not None and self._time_left():
            got = await self._next_lease(run)
            if got == "stop":
                return
            if got is None:
                continue
            lease, theta = got
            round_index = int(self.summary["rounds"])
            attack = self._round_attack(round_index)
            honest = await self._work(run, lease, theta, attack)
            await self._send(run, lease, honest, attack)
            self.summary["rounds"] = round_index + 1
            self._write()

    async def _prepare(self, p2p: Any) -> Optional[_Run]:
        """The run's config from its hello; the workload (poisoned for ``poison``), the trainer and the client."""
        from asyncloco.config import RunConfig
        from asyncloco.train.inner import InnerTrainer
        from asyncloco.peer.reveal import RevealStore
        from asyncloco.workloads import build_workload

        hello = await self._hello(p2p)
        if hello is None:
            return None
        cfg = RunConfig.model_validate(json.loads(hello.config))
        workload = build_workload(cfg)
        if "poison" in self.sequence:
            # every lease trains on poisoned batches (a single poison attack; mixed with others, those too)
            tokenizer = getattr(workload, "tokenizer", None)
            seq_len = getattr(cfg.task, "seq_len", None)
            if tokenizer is None or seq_len is None:
                raise ValueError("the poison attack needs an LM workload (task.kind: lm)")
            workload = poisoned_workload(workload, trigger_rows(len(tokenizer), int(seq_len), self.o.trigger_seed))
        trainer = InnerTrainer.from_config(cfg, workload)
        if self.device_class is None:
            self.device_class = trainer.compute_class
        # a run that verifies carried inner state refuses submissions without commitments: commit like an honest
        # peer (to the state it really trained from) and reveal on request, so the re-run is what catches it
        verify = cfg.runtime.verify
        commits = verify.enabled and verify.inner_state == "carry" and trainer.state_digest() is not None
        # error feedback as a peer keeps it (peer/upload.py): what it sends goes through the residual, which its
        # commitments cover and its reveals carry — a consistent liar, checked by the re-run like any peer
        feedback = None
        if cfg.runtime.uses_error_feedback:
            from asyncloco.train.feedback import ErrorFeedback

            feedback = ErrorFeedback(cfg.runtime.codec, True, cfg.runtime.error_feedback_decay)
        return _Run(hello, self._client(p2p, hello.model_numel), trainer, int(workload.units_per_step),
                    RevealStore(verify.reveal_keep) if commits else None, feedback)

    async def _next_lease(self, run: _Run) -> Any:
        """``(lease, θ)``; None to try again; ``"stop"`` once refused for good (expelled, not admitted)."""
        from asyncloco.transport.errors import TransportError

        try:
            reply = await run.client.assign(run.speed, token=self.o.token)
        except TransportError as error:
            self._note("assign", False, error=str(error))
            if getattr(error, "code", None) in FATAL:
                return "stop"
            await asyncio.sleep(1.0)
            return None
        if reply.lease is None:
            self._note("assign", False, reason=reply.reason)
            await asyncio.sleep(0.5)
            return None
        lease = reply.lease
        run.own.add(lease.lease_id)
        try:
            version, theta = await run.client.get_model(lease.base_version)
        except TransportError as error:
            self._note("get_model", False, error=str(error))
            return None
        self._remember(version, theta)
        return lease, theta

    async def _work(self, run: _Run, lease: Any, theta: torch.Tensor, attack: str) -> torch.Tensor:
        """The lease's honest pseudo-gradient (zeros for a free-rider past its first lease), and this round's commitments."""
        from asyncloco.train.commitments import committed_digest

        self.digests, start_digest = (None, None), None
        if run.reveals is not None:
            residual = None if run.feedback is None else run.feedback.residual
            inner = run.reveals.hold(lease.lease_id, run.trainer.optimizer, residual, feedback=run.feedback is not None)
            start_digest = None if inner is None else committed_digest(inner, residual)
        if attack == "freeride" and self.first_norm is not None and len(self.history) > 1:
            honest = torch.zeros_like(theta)  # no training: its claimed speed stays the one it measured honestly
        else:
            started = time.perf_counter()
            steps = max(1, lease.steps // 4) if attack == "sandbag" else lease.steps
            result = await asyncio.to_thread(run.trainer.run, theta, lease.shard, lease.start_offset, steps, lease.lr_offset)
            elapsed = max(time.perf_counter() - started, 1e-6)
            honest = result.pseudo_gradient
            if attack == "sandbag":  # a quarter of the work made to look like all of it, at the speed it claims
                honest = honest * (lease.steps / steps)
                await asyncio.sleep(elapsed * (lease.steps / steps - 1.0))
                elapsed *= lease.steps / steps
            run.speed = lease.steps * run.units_per_step / elapsed
            if attack == "freeride" and self.first_norm is None:
                self.first_norm = float(torch.linalg.vector_norm(honest))
        if run.reveals is not None:
            if attack == "forge-state":  # before its end is committed (and kept to be revealed as it is)
                forge_moment(run.trainer.optimizer, self._hidden(theta.numel()), self.o.scale or DEFAULT_SCALE[attack],
                             list(run.trainer.model.parameters()))  # θ's flat order: colluders push the same way
            run.inner_end = run.reveals.hold_end(lease.lease_id, run.trainer.optimizer)
            self.digests = (start_digest, run.inner_end)  # with feedback the residual joins once the upload is encoded
        return honest

    async def _send(self, run: _Run, lease: Any, honest: torch.Tensor, attack: str) -> None:
        """What ``attack`` sends for this lease (and, for ``other-lease``/``replay``, under which lease)."""
        from asyncloco.peer.reveal import send_reveal

        client, codec = run.client, run.hello.codec
        update = self._tamper(attack, honest, int(self.summary["rounds"]))
        lease_id, base_version = lease.lease_id, lease.base_version
        if attack == "other-lease":
            victims = self._spied_leases(run.own)
            if victims:
                lease_id, base_version = victims[0]["lease_id"], int(victims[0]["base_version"])
            else:  # no insider knowledge: guess a neighbouring sequential id
                digits = "".join(ch for ch in lease.lease_id if ch.isdigit())
                lease_id = f"L{int(digits or 0) + 1:08d}" if digits else lease.lease_id + "x"
            update = -1000.0 * honest
        own_submit = "honest" if attack in ("replay", "other-lease") else attack
        if lease_id != lease.lease_id:
            await self._submit(client, codec, lease_id, base_version, update, honest, "other-lease", victim=True)
            ack = await self._submit(client, codec, lease.lease_id, lease.base_version, honest, honest, "honest", run=run)
        else:
            # its own lease's upload goes through the residual (a NaN one is encoded as the attack needs, and refused)
            ack = await self._submit(client, codec, lease_id, base_version, update, honest, own_submit,
                                     run=None if own_submit == "nan" else run)
        if run.feedback is not None:
            run.feedback.settle(ack is not None and ack.accepted)  # a refused upload's residual is dropped
        if lease_id == lease.lease_id:
            if run.first_lease is None and ack is not None and ack.accepted and not ack.duplicate:
                run.first_lease = {"lease_id": lease.lease_id, "base_version": lease.base_version, "version": ack.version}
            if run.reveals is not None and not (ack is not None and ack.accepted):
                run.trainer.reset_inner_state()  # only applied leases advance the commitment chain
            if run.reveals is not None and ack is not None and ack.reveal:
                revealed = await send_reveal(client, lease_id, run.reveals.reveal(lease_id, ack.reveal_end is not False,
                                                                                 ack.reveal_start is not False),
                                             self.digests[0])
                self._note("reveal", revealed, lease_id=lease_id)
        if attack == "replay":
            # its own first applied lease again; without one (its own work was refused), another peer's
            first = run.first_lease
            target = first if first is not None and first["lease_id"] != lease.lease_id else self._spied_applied()
            if target is not None:
                await self._submit(client, codec, target["lease_id"], target["base_version"],
                                   -1000.0 * honest, honest, "replay", first_version=target["version"])

    async def _submit(self, client: Any, codec: str, lease_id: str, base_version: int, update: torch.Tensor,
                      honest: torch.Tensor, attack: str, run: Optional[_Run] = None, **details: Any) -> Any:
        """``run``: encode through its error feedback (its own lease's upload) and commit to the residual it leaves."""
        from asyncloco.transport.errors import TransportError

        if run is not None and run.feedback is not None:
            encoded = await asyncio.to_thread(run.feedback.encode, update)
            if run.reveals is not None and run.inner_end is not None:
                self.digests = (self.digests[0], run.reveals.end_residual(lease_id, run.inner_end, run.feedback.pending))
        else:
            encoded = await asyncio.to_thread(self._encode, codec, update, attack)
        details["attack"] = attack
        norms = {"norm_sent": float(torch.linalg.vector_norm(torch.nan_to_num(update))),
                 "norm_honest": float(torch.linalg.vector_norm(honest))}
        # like an honest peer (peer/upload.py), the same bytes are sent again after a failure that carries no
        # refusal code (a timeout, a dropped stream, a busy service): the attack is in what it sends, not in
        # giving up on a lost reply; a coded refusal is an answer
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                ack = await client.submit(lease_id, base_version, encoded, state_start=self.digests[0],
                                          state_end=self.digests[1], device_class=self.device_class)
                self._note("submit", True, lease_id=lease_id, accepted=ack.accepted, duplicate=ack.duplicate,
                           version=ack.version, reason=ack.reason, **norms, **details)
                return ack
            except TransportError as error:
                code = getattr(error, "code", None)
                self._note("submit", False, lease_id=lease_id, error=str(error), code=code, **norms, **details)
                if code is not None:
                    return None
                await asyncio.sleep(0.5 * 2**attempt)
        return None

    # ------------------------------------------------------------------------------ ghosts

    async def _ghost(self, dht: Any) -> None:
        from hivemind.utils import get_dht_time

        from asyncloco import __version__
        from asyncloco.transport.records import RunRecords, SpeedRecord

        records = RunRecords(dht, self.o.run_id)
        while self._time_left():
            claims = [self.summary["peer_id"]]
            future = 0.0
            if self.sequence[0] == "ghost-forge":
                # forge the record of one honest peer (the first one leased): DyLU would then starve the others
                leased = [r["peer"] for r in self._journal_records() if r.get("type", r.get("event")) == "assign"]
                claims = leased[:1] or claims
                future = 3600.0
            for peer_id in claims:
                report = SpeedRecord(peer_id=peer_id, tokens_per_s=float(self.o.claim), device="cuda",
                                     software_version=__version__, last_seen=get_dht_time() + future)
                try:
                    stored = await asyncio.to_thread(records.publish_speed, report, 30.0)
                    self._note("publish_speed", bool(stored), claimed_peer=peer_id, tokens_per_s=self.o.claim)
                except Exception as error:  # a refused store is an answer too
                    self._note("publish_speed", False, claimed_peer=peer_id, error=repr(error))
            self.summary["rounds"] += 1
            await asyncio.sleep(1.0)

    def _journal_records(self) -> list[dict[str, Any]]:
        if not self.o.spy_journal or not os.path.isfile(self.o.spy_journal):
            return []
        out = []
        for line in Path(self.o.spy_journal).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    # ------------------------------------------------------------------------------ outsider

    async def _probe(self, p2p: Any) -> None:
        """An outsider's four calls, once each; every answer is recorded (nothing should be served)."""
        from asyncloco.transport.errors import TransportError

        numel, codec = 1, "none"
        if self.o.config:
            from asyncloco.config import load_config
            from asyncloco.models.workload import flatten_params
            from asyncloco.workloads import build_workload

            cfg = load_config(self.o.config)
            numel, codec = flatten_params(build_workload(cfg).build_model(cfg.seed)).numel(), cfg.runtime.codec
        hello = await self._hello(p2p)
        client = self._client(p2p, numel)

        async def once(name: str, call: Callable[[], Awaitable[dict[str, Any]]]) -> None:
            # an answer (or a coded refusal) is recorded; a dropped stream is asked again, as any client would — the
            # summary's last record of each call is its answer
            for attempt in range(SUBMIT_ATTEMPTS):
                try:
                    self._note(name, True, **await call())
                    return
                except TransportError as error:
                    code = getattr(error, "code", None)
                    self._note(name, False, error=str(error), code=code)
                    if code is not None:
                        return
                    await asyncio.sleep(0.5 * 2**attempt)

        async def assign() -> dict[str, Any]:
            reply = await client.assign(1e12, token=self.o.token, timeout=30.0)
            return {"lease": None if reply.lease is None else reply.lease.to_wire(), "reason": reply.reason}

        async def get_model() -> dict[str, Any]:
            version, theta = await client.get_model(None, timeout=30.0)
            return {"version": version, "numel": theta.numel()}

        async def submit() -> dict[str, Any]:
            ack = await client.submit("L00000001", 0, torch.full((numel,), 1e3), codec=codec, timeout=30.0)
            return {"accepted": ack.accepted, "reason": ack.reason, "version": ack.version}

        await once("assign", assign)
        await once("get_model", get_model)
        await once("submit", submit)
        del hello

    # --------------------------------------------------------------------------------- flood

    async def _flood(self, p2p: Any) -> None:
        """``--count`` malformed calls on the raw RPC streams, 2 at a time; each kind's outcome is counted."""
        from hivemind.p2p import PeerID

        from asyncloco.transport.rpc import handle_name

        coordinator = PeerID.from_base58(self.coordinator_id)
        codec, numel = "int8", 8
        if self.o.config:  # valid submit headers, so the body-reading paths are reached too
            from asyncloco.config import load_config
            from asyncloco.models.workload import flatten_params
            from asyncloco.workloads import build_workload

            cfg = load_config(self.o.config)
            codec, numel = cfg.runtime.codec, flatten_params(build_workload(cfg).build_model(cfg.seed)).numel()
        kinds = flood_frames(codec, numel)
        counts: dict[str, dict[str, int]] = {}

        async def one(index: int) -> None:
            name, rpc, payload = kinds[index % len(kinds)]
            outcome = "no-answer"
            try:
                _, reader, writer = await asyncio.wait_for(
                    p2p.call_binary_stream_handler(coordinator, handle_name(self.o.run_id, rpc)), timeout=10.0
                )
                try:
                    if payload:
                        writer.write(payload)
                        await asyncio.wait_for(writer.drain(), timeout=5.0)
                    if name != "empty-stream":
                        answer = await asyncio.wait_for(reader.read(5), timeout=2.0)
                        outcome = "error-frame" if answer[:1] == b"\x03" else ("closed" if not answer else "answered")
                finally:
                    writer.close()
            except asyncio.TimeoutError:
                outcome = "timeout"
            except Exception as error:  # the coordinator may reset the stream: that is an answer too
                outcome = type(error).__name__
            bucket = counts.setdefault(name, {})
            bucket[outcome] = bucket.get(outcome, 0) + 1

        sent = 0
        started = time.monotonic()
        while sent < self.o.count and (self.deadline is None or time.monotonic() < self.deadline):
            batch = min(2, self.o.count - sent)  # within the per-peer limit of calls in flight: each reaches a parser
            await asyncio.gather(*(one(sent + i) for i in range(batch)))
            sent += batch
            if sent % 200 < batch:
                self.summary["flood"] = {"sent": sent, "seconds": time.monotonic() - started, "outcomes": counts}
                self._write()
        self.summary["flood"] = {"sent": sent, "seconds": time.monotonic() - started, "outcomes": counts}
        self.summary["rounds"] = sent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m asyncloco.testing.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--initial-peers", nargs="+", required=True, help="the coordinator's multiaddr (with /p2p/...)")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--attack", required=True, help=f"one of {ATTACKS}, or a comma-separated list of update attacks")
    parser.add_argument("--token", help="admission token (an insider)")
    parser.add_argument("--identity", help="libp2p identity file")
    parser.add_argument("--config", help="the run's config (probe: to know the model size without a hello)")
    parser.add_argument("--scale", type=float, help="factor of huge / signflip (defaults 1e30 / 1000)")
    parser.add_argument("--claim", type=float, default=1e12, help="tokens/s a ghost claims")
    parser.add_argument("--count", type=int, default=2000, help="malformed messages to send (flood)")
    parser.add_argument("--rounds", type=int, help="stop after this many rounds")
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--spy-journal", help="the coordinator's events.jsonl (an insider's knowledge of lease ids)")
    parser.add_argument("--summary", help="write what was sent and answered here (JSON)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--direction-seed", type=int, default=1234, help="hidden/tailored: seed of the hidden direction")
    parser.add_argument("--trigger-seed", type=int, default=4321, help="poison: seed of the trigger sequence")
    parser.add_argument("--device-class", help="compute class named in submissions (default: its own)")
    parser.add_argument("--sleep", type=int, default=8, help="sleeper: honest leases before it turns")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    options = _parser().parse_args(argv, namespace=HostileOptions())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hostile %(levelname)s %(message)s")
    torch.set_num_threads(options.threads)
    hostile = Hostile(options)

    async def runner() -> None:
        import signal

        task = asyncio.create_task(hostile.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            hostile.summary["cancelled"] = True
            hostile._write()

    asyncio.run(runner())
    return 0


if __name__ == "__main__":
    sys.exit(main())
