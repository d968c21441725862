"""The coordinator's RPC handlers: wire messages (transport/wire.py, served by transport/rpc.py's
``CoordinatorService``) become events of the logic through the node (coordinator/node.py), and the
logic's verdicts become replies. Admission (coordinator/admission.py) is checked before anything an
outsider sent is decoded; the compatibility check (asyncloco/fingerprint.py) refuses mismatched peers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

import torch

from asyncloco import __version__
from asyncloco.config import RunConfig
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.admission import AdmissionError, verify_token
from asyncloco.coordinator.logic import (
    gate_proven,
    Admit,
    Applied,
    Duplicate,
    Held,
    Fetched,
    Fingerprint,
    Hello,
    HoldDropped,
    Lease,
    Refused,
    Rejected,
    RequestWork,
    SubmitUpdate,
    admission_code,
    admission_problem,
    base_theta,
    is_admitted,
)
from asyncloco.timings import hold_timings
from asyncloco.coordinator.monitoring import Monitoring, Waiter
from asyncloco.coordinator.node import CoordinatorNode
from asyncloco.coordinator.probe import Probe
from asyncloco.fingerprint import mismatch_reason
from asyncloco.models.workload import Workload
from asyncloco.refusals import Refusal, RefusalCode, frame_text

__all__ = ["Serving", "lease_to_wire"]

logger = logging.getLogger(__name__)


def lease_to_wire(lease: Lease, batch_size: int) -> dict[str, Any]:
    fresh = {"fresh": True} if lease.fresh else {}  # absent unless set: a peer of an earlier version reads the rest
    eager = {"eager_of": lease.eager_of, "eager_share": lease.eager_share} if lease.eager_of else {}
    return {**fresh, **eager,
        "lease_id": lease.lease_id,
        "base_version": lease.base_version,
        "shard": lease.shard,
        "start_offset": lease.start_offset,
        "steps": lease.steps,
        "lr_offset": lease.lr_offset,
        "batch_size": batch_size,
        "issued_at": lease.issued_at,
        "deadline": lease.deadline,
    }


class Serving:
    """The RPC handler of :class:`~asyncloco.transport.rpc.CoordinatorService`: ``check_admitted``, ``assign``,
    ``get_model``, ``submit``, the compatibility check, and verification's calls (``reveal_limit``, ``reveal``,
    ``verify_task``, ``verdict``, ``return_check``: coordinator/verify.py, coordinator/validators.py)."""

    def __init__(
        self,
        cfg: RunConfig,
        node: CoordinatorNode,
        monitoring: Monitoring,
        workload: Workload,
        model: torch.nn.Module,
        numel: int,
        admission_key: Any,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self.monitoring = monitoring
        self.workload = workload
        self.model = model
        self.numel = numel
        self.admission_key = admission_key  # the coordinator's public key (runtime.admission: token), else None
        self.service: Any = None  # the transport service, once serving
        self.fingerprint: dict[str, str] = {}  # this run's (asyncloco/fingerprint.py), computed at start-up
        self.verification: Any = None  # coordinator/verify.py DaemonVerification, set by the daemon when the run verifies
        self._decode_buffers: list[torch.Tensor] = []  # at most one idle θ-sized int8 decode buffer (submit)
        self._probe: Optional[Probe] = None  # the update gate's probe, built on first use

    # --- admission (coordinator/admission.py): nothing is served to a peer the logic does not admit

    async def check_admitted(self, peer_id: str, token: Any = None) -> None:
        """Raise :class:`~asyncloco.refusals.Refusal` (a PermissionError: "not admitted: ...", code
        NOT_ADMITTED, EXPELLED or INCOMPATIBLE from the logic's :func:`admission_code`) unless ``peer_id`` may be served now.

        A token (``runtime.admission: token``) is verified here (signature, format: crypto, not the
        logic's business) and becomes an :class:`Admit` event; the logic decides (expiry, revocation,
        binding to the first peer id that used it). Refusals are journaled at a bounded rate and a
        refused peer's further attempts within a few seconds are answered from a cache, so a flood of
        unadmitted calls writes neither the write-ahead log nor unbounded log lines."""
        node, refusals = self.node, self.monitoring.refusals
        now = node.clock.time()
        if is_admitted(node.state, peer_id, now):
            return
        code = admission_code(node.state, peer_id)
        if self.admission_key is None or token is None or code != RefusalCode.NOT_ADMITTED:
            reason = admission_problem(node.state, peer_id, now)
            raise Refusal(code, "not admitted: " + refusals.refuse(self.monitoring.journal, peer_id, reason, now))
        cached = refusals.cached(peer_id, token, now)
        if cached is not None:
            raise Refusal(RefusalCode.NOT_ADMITTED, "not admitted: " + cached)
        try:
            claims = verify_token(self.admission_key, token)
        except AdmissionError as error:  # signature/format: crypto, checked before the logic sees an Admit
            raise Refusal(RefusalCode.NOT_ADMITTED,
                          "not admitted: " + refusals.refuse(self.monitoring.journal, peer_id, str(error), now, token)) from None
        async with node.lock:
            node.refuse_if_stopping()
            actions = await node.decide(Admit(peer_id, claims.token_id, claims.name, claims.expires_at))
        if is_admitted(node.state, peer_id, node.clock.time()):
            return
        refused = next((a for a in actions if isinstance(a, Refused)), None)
        reason = refused.reason if refused is not None else admission_problem(node.state, peer_id, now)
        refusals.remember(peer_id, token, reason, now)
        raise Refusal(refused.code if refused is not None else admission_code(node.state, peer_id), "not admitted: " + reason)

    async def assign(self, request: Any, peer_id: str) -> Any:
        """The ``assign`` RPC: ``request`` is a transport.wire.AssignRequest; returns a HelloReply (kind
        "config") or a LeaseReply."""
        from asyncloco.transport.wire import HelloReply, LeaseReply
        from asyncloco.transport.wire import LeaseGrant

        await self.check_admitted(peer_id, request.get("token") if isinstance(request, dict) else getattr(request, "token", None))
        if request.kind == "config":
            return HelloReply(
                config=json.dumps(self.cfg.model_dump(mode="json")),
                model_numel=self.numel,
                codec=self.cfg.runtime.codec,
                download_codec=self.cfg.runtime.download_codec,
                run_id=self.cfg.runtime.run_id,
                software_version=__version__,
            )
        node, stats, waiters = self.node, self.monitoring.stats, self.monitoring.waiters
        speed = request.tokens_per_s  # a finite float ≥ 0 or None (checked by the transport)
        signer = request.signer if request.signer is not None and 0 < len(request.signer) <= 64 else None
        name = request.name or ""
        async with node.lock:
            node.refuse_if_stopping()
            if name:  # the volunteer's --name (validated by the transport), for the status table
                stats.peer(peer_id).name = name[:64]
            info = node.state.peers.get(peer_id)
            if info is None or not info.alive or (signer is not None and info.signer != signer) or (name and info.name != name):
                # The authenticated hello: registers the peer with the speed from its request (before the
                # DHT read loop saw its record) and binds its DHT signing key and name to this peer id.
                await node.decide(Hello(peer_id, signer, name[:64], speed))
                if name:
                    stats.peer(peer_id).name = name[:64]
            previous = waiters.pop(peer_id, None)
            if previous is not None and not previous.future.done():
                previous.future.cancel()
            loop = asyncio.get_running_loop()
            waiter = Waiter(loop.create_future(), node.clock.time())
            waiters[peer_id] = waiter
            actions = await node.decide(RequestWork(peer_id, getattr(request, "keep", None) or "",
                                                    request.link_up, request.link_down))
            for action in actions:
                if isinstance(action, Rejected) and action.peer == peer_id:
                    waiters.pop(peer_id, None)
                    return LeaseReply(None, action.reason, action.code.value)
        try:
            lease = await asyncio.wait_for(asyncio.shield(waiter.future), timeout=self.hold_limit())
            if lease is None:  # the logic released the held request (hold limit)
                return LeaseReply(None, "held too long; ask again", RefusalCode.HELD_TOO_LONG.value)
        except asyncio.TimeoutError:
            async with node.lock:
                if waiters.get(peer_id) is waiter:
                    del waiters[peer_id]
                if not node.stopping:  # an event of the logic, logged like every other (replay drops it too)
                    await node.decide(HoldDropped(peer_id))
            return LeaseReply(None, "held too long; ask again", RefusalCode.HELD_TOO_LONG.value)
        except asyncio.CancelledError:
            return LeaseReply(None, "superseded by a newer request", RefusalCode.SUPERSEDED.value)
        return LeaseReply(LeaseGrant.from_wire(lease_to_wire(lease, getattr(self.cfg.task, "batch_size", 1))))

    def hold_limit(self) -> float:
        """How long an RPC waits on a held request: a little past the logic's hold limit, which answers it."""
        return hold_timings(self.cfg).service

    async def get_model(self, version: Optional[int], peer_id: Optional[str] = None) -> tuple[int, torch.Tensor]:
        if peer_id is not None:
            await self.check_admitted(peer_id)
        node = self.node
        async with node.lock:
            if version is None:
                version = node.state.version
            theta = base_theta(node.state, version)
            if theta is None:
                raise ValueError(f"version {version} is no longer served (current {node.state.version}); ask for a new lease")
            theta = theta.clone() if version == node.state.version else theta  # older versions never change
            if peer_id is not None and not node.stopping:
                # θ at this version is on its way to the peer: the logic may stop retaining it
                await node.decide(Fetched(peer_id, version))
        return version, theta

    def served(self, peer_id: str, version: int, codec: str, anchor: Optional[int], unchanged: bool = False) -> None:
        """The transport sent θ at ``version`` to ``peer_id`` in ``codec`` (a delta from ``anchor``, or in full;
        ``unchanged``: no body, the peer holds it): verification may re-run its chosen leases ahead (coordinator/ahead.py)."""
        if self.verification is not None:
            self.verification.served(peer_id, version, codec, anchor, unchanged)

    async def gate_probe(
        self, peer_id: str, lease_id: str, base_version: int, update: torch.Tensor
    ) -> tuple[Optional[float], Optional[float]]:
        """The probe-batch losses at θ and θ − s·Δ for an update the gate will read them for (``gate.wants_probe``
        and ``gate.needs_probe``: in the gray zone), else (None, None). Call with the node's lock held: θ must
        not change until ``handle`` has judged it. Only a live lease of this peer at its base version is probed
        (junk costs no forward pass)."""
        state = self.node.state
        gate = state.policy.gate
        lease = state.leases.get(lease_id)
        if gate is None or lease is None or lease.peer != peer_id or lease.base_version != base_version:
            return None, None
        if not update_gate.wants_probe(gate, state.gate, peer_id, self.numel):
            return None, None
        # only where score() will read it: an update outside the gray zone gets the same verdict without it
        if not update_gate.needs_probe(gate, state.gate, update, lease.steps, peer_id, state.policy.norm_bound_per_step,
                                       proven=gate_proven(state, lease), sketcher=state.own_sketcher()):
            return None, None
        if self._probe is None:
            self._probe = Probe(self.workload, self.model, self.cfg.runtime.gate.probe_sequences, self.cfg.runtime.eval_device)
        started = time.perf_counter()
        before, after = await asyncio.to_thread(self._probe.losses, state.version, state.params, update, gate.probe_step)
        logger.debug("probe of %s: %.4f -> %.4f in %.3f s", lease_id, before, after, time.perf_counter() - started)
        return before, after

    async def _decode_submitted(self, pseudo_gradient: Any, reuse: bool) -> torch.Tensor:
        """The submitted update in fp32. int8, int2, topk*, grp* (``reuse``) are decoded into a reused θ-sized buffer
        (a fresh one costs ≈ 7 memcpy of page faults; the ack-latency target); the logic keeps no reference to the
        update after ``handle``, and :meth:`submit` hands the buffer back. NaN/Inf or a malformed payload raises a
        CodecError — still the sender's protocol error (journaled by the transport) — whose text leads with the typed
        code ``invalid_update``: an answer, since the same bytes would get the same one (the peer does not resend)."""
        from asyncloco.transport.codecs import decode
        from asyncloco.transport.errors import CodecError

        buffer = self._decode_buffers.pop() if reuse and self._decode_buffers else None
        try:
            return await asyncio.to_thread(decode, pseudo_gradient, self.numel, buffer)
        except CodecError as error:
            if buffer is not None:
                self._decode_buffers.append(buffer)
            raise CodecError(frame_text(RefusalCode.INVALID_UPDATE, f"refused at decode: {error}")) from error

    async def submit(self, header: Any, pseudo_gradient: Any, peer_id: str, upload_seconds: float = 0.0) -> Any:
        """The ``submit`` RPC: ``header`` is a transport.wire.SubmitHeader (``lease_id``, ``base_version``,
        optional ``inner_loss``); ``upload_seconds``: how long its body took to arrive, measured by the transport.
        Returns a transport.wire.Ack."""
        from asyncloco.transport.codecs import decodes_into
        from asyncloco.coordinator.verify import needs_reveal
        from asyncloco.transport.wire import MAX_REASON_CHARS, Ack

        lease_id, base_version = header.lease_id, header.base_version
        node = self.node

        # Admission was checked by the transport before the body was read (CoordinatorService / memory transport
        # call check_admitted); ``handle`` decides again on the event itself (a Refused action, below).
        upload_s = float(upload_seconds)  # measured by the transport (the body's arrival), never claimed by the peer
        reuse = decodes_into(str(getattr(pseudo_gradient, "codec", "")))
        started = time.perf_counter()
        update = await self._decode_submitted(pseudo_gradient, reuse)
        decoded = time.perf_counter()
        # a checked lease re-run while its peer trained (coordinator/ahead.py) is judged now, outside the lock, and its
        # verdict decided right after the submit, under the same hold of the lock
        verification = self.verification
        arrival = None if verification is None else await verification.judge_on_arrival(
            peer_id, lease_id, base_version, update, header)
        try:
            async with node.lock:
                locked = time.perf_counter()
                node.refuse_if_stopping()
                probe = await self.gate_probe(peer_id, lease_id, base_version, update)  # the gate's gray-zone tie-breaker
                probed = time.perf_counter()
                event = SubmitUpdate(peer_id, lease_id, base_version, update, transfer_s=round(upload_s, 6),
                                     probe_before=probe[0], probe_after=probe[1],
                                     state_start=getattr(header, "state_start", None), state_end=getattr(header, "state_end", None),
                                     device_class=getattr(header, "device_class", None),
                                     theta_codec=getattr(header, "theta_codec", None),
                                     theta_anchor=getattr(header, "theta_anchor", None),
                                     theta_digest=getattr(header, "theta_digest", None),
                                     eager_of=getattr(header, "eager_of", None))
                if arrival is not None:
                    verification.arriving.add(lease_id)
                try:
                    actions = await node.decide(event, wire=pseudo_gradient)
                finally:
                    if arrival is not None:
                        verification.arriving.discard(lease_id)
                if arrival is not None:
                    await verification.decide_on_arrival(actions, lease_id, arrival)
                self.monitoring.stats.submit_timing.add(decode=decoded - started, lock_wait=locked - decoded,
                                                        probe=probed - locked, decide=time.perf_counter() - probed)
        finally:
            if reuse and not self._decode_buffers:
                self._decode_buffers.append(update)
        if header.inner_loss is not None and any(isinstance(a, Applied) and a.lease_id == lease_id for a in actions):
            self.monitoring.stats.peer(peer_id).last_inner_loss = float(header.inner_loss)
        # commitments (verify.py): the start state, and the end when needed — unless its start is at hand (chained.py)
        reveal = needs_reveal(actions, lease_id) and verification is not None and verification.asks_reveal(lease_id)
        device_class = getattr(header, "device_class", None)
        start_only = reveal and verification is not None and not verification.needs_end(device_class)
        reveal_end = False if start_only else None
        reveal_start = False if reveal and verification is not None and not verification.asks_start(lease_id) else None
        for action in actions:
            if isinstance(action, Applied) and action.lease_id == lease_id:
                return Ack(True, action.version, action.reason[:MAX_REASON_CHARS], False, reveal=reveal or None,
                           reveal_end=reveal_end, reveal_start=reveal_start)
            if isinstance(action, Held) and action.lease_id == lease_id:  # accepted; applied once its check agrees
                return Ack(True, action.version, action.reason[:MAX_REASON_CHARS], False, reveal=reveal or None,
                           reveal_end=reveal_end, reveal_start=reveal_start)
            if isinstance(action, Duplicate) and action.lease_id == lease_id:
                return Ack(True, action.version, action.reason[:MAX_REASON_CHARS], True)
            if isinstance(action, Rejected) and action.lease_id == lease_id:
                return Ack(False, node.state.version, action.reason[:MAX_REASON_CHARS], False, code=action.code.value)
            if isinstance(action, Refused) and action.lease_id == lease_id:  # admission ended while it was uploading
                raise Refusal(action.code, "not admitted: " + action.reason)
        raise AssertionError(f"submit of {lease_id} produced no verdict: {actions}")

    async def check_fingerprint(self, peer_id: str, fingerprint: dict[str, str], software_version: str) -> Optional[str]:
        """The reason to refuse a peer whose model/tokenizer/data/codec differ from this run's (None: it fits).
        The verdict becomes a :class:`Fingerprint` event when it changes what the logic knows (the logic then turns
        the peer away with code INCOMPATIBLE until a check fits; a fitting peer never seen refused costs no event)."""
        reason = mismatch_reason(self.fingerprint, fingerprint, __version__, software_version[:64])
        node = self.node
        if (reason or "") == node.state.incompatible.get(peer_id, ""):
            return reason  # nothing changed (a compatible peer, or the same refusal again)
        differing = tuple(name for name in self.fingerprint if self.fingerprint[name] != fingerprint.get(name))
        async with node.lock:
            node.refuse_if_stopping()
            await node.decide(Fingerprint(peer_id, reason or "", differing if reason else (), software_version[:64] if reason else ""))
        return reason

    # --- verification (coordinator/verify.py): reveals of committed inner states, validator peers

    def _verification_on(self, what: str) -> Any:
        if self.verification is None:
            raise ValueError(f"this run does not verify work (runtime.verify.enabled is false): {what}")
        return self.verification

    async def reveal_limit(self, header: Any, peer_id: str) -> int:
        """The ``reveal`` RPC's size bound (commitments), before its body is read."""
        await self.check_admitted(peer_id)
        return int(self._verification_on("nothing to reveal").reveal_limit(header.lease_id, peer_id, int(header.size)))

    async def reveal(self, header: Any, state: bytes, peer_id: str) -> Any:
        return self._verification_on("nothing to reveal").reveal(header.lease_id, state, peer_id)

    async def verify_task(self, request: Any, peer_id: str) -> Any:
        """A validator peer (asyncloco/validator.py) asks for a check (coordinator/validators.py ``lend``)."""
        return await self._verification_on("no checks for validators").desk.lend(min(float(request.wait_s), 60.0), peer_id)

    async def verdict(self, header: Any, peer_id: str) -> Any:
        return await self._verification_on("no checks for validators").desk.take_verdict(header, peer_id)

    def return_check(self, lease_id: Optional[str], peer_id: str) -> None:
        if self.verification is not None:
            self.verification.desk.give_back(lease_id, peer_id)
