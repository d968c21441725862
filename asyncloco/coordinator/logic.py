"""The coordinator's brain: ``handle(state, event, now) -> (state, actions)``.

One pure decision function, driven by the simulator's fake clock and by the networked daemon's
real clock alike. It owns no clock, no transport and no global randomness: ``now`` is passed in,
shard sampling draws from a counter-based generator seeded by ``state.seed``, and every action
carries a human-readable ``reason``.

Events and what the coordinator decides:

* :class:`SpeedReport` — a peer's measured throughput (tokens or samples per second), smoothed.
* :class:`RequestWork` — a peer wants a lease: answer now (:class:`Assign`) or hold it for the
  grace period (:class:`Hold`), paper Algorithm 2 / docs/algorithm.md §6. A held request is answered
  later by an :class:`Assign` emitted while handling another event.
* :class:`SubmitUpdate` — a pseudo-gradient arrives for a lease: validate it, apply it with the
  method's outer optimizer (:class:`Applied`), acknowledge a resend without applying it twice
  (:class:`Duplicate`), or refuse it (:class:`Rejected`).
* :class:`Tick` — time passes: expired leases give their steps back (:class:`Expired`), held
  requests whose grace window closed are answered.
* :class:`PeerLeft` — a peer is gone: its leases are given back, it leaves the DyLU max.
* :class:`Verified` — a verifier re-ran a lease (coordinator/verify.py) and compared its pseudo-gradient with
  the one submitted: a match counts toward the peer's probation; a mismatch expels the peer (:class:`Expelled`:
  its leases are given back and everything it sends is turned away from then on). Which leases are re-run is
  decided here, when a lease is issued (:func:`verify_reason`: HMAC of the lease id under the run secret below
  ``fraction``, every update of a peer on probation, more for a peer the gate refused recently), and an applied
  update of such a lease yields a :class:`Verify` action carrying θ at its base version and the update as
  submitted. :class:`Discard` voids a lease's update (consumed, θ untouched): the repair after an expulsion
  replays the log with the expelled peer's submissions discarded (coordinator/verify.py, ``repair``).
* :class:`Admit` / :class:`Revoke` — admission (``runtime.admission: token``): a verified token
  binds to the libp2p peer id that first uses it (:class:`Admitted` or :class:`Refused`); a revoked
  token's peer loses its leases and its say in DyLU. In ``token`` and ``allowlist`` mode, speed
  reports, lease requests and submissions of a peer that :func:`is_admitted` denies are ignored or
  refused before anything else looks at them (see ``coordinator/admission.py``).

Grace windows (offline Algorithm 2, run online with predicted completion times): when a peer that
just finished asks for work while other leases are expected to finish within ``grace`` seconds, a
window opens until ``now + grace``; every request in the window is held until all leases expected
inside the window have been applied (or expired), or the window closes, and then all held peers
get leases from the newest θ, in request order. In barrier mode (sync DiLoCo) the window never
closes by time: everyone waits for every lease of the round.

``handle`` mutates ``state`` in place (θ can be hundreds of MB) and returns it.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import heapq
import hmac
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence, Union

import numpy as np
import torch

from asyncloco.algo.dylu import dylu_steps, ema
from asyncloco.algo.grace import hold_decision
from asyncloco.algo.outer import OuterOptimizer
from asyncloco.algo.sampler import sample_shard
from asyncloco.algo.staleness import StalenessTransform, apply_transforms
from asyncloco.coordinator import gate as update_gate
from asyncloco.coordinator.gate import GatePolicy, GateState
from asyncloco.refusals import RefusalCode

__all__ = [
    "Lease",
    "ShardState",
    "PeerInfo",
    "CoordinatorPolicy",
    "CoordinatorState",
    "DerivedIndexes",
    "SpeedReport",
    "RequestWork",
    "SubmitUpdate",
    "Tick",
    "PeerLeft",
    "Admit",
    "Revoke",
    "HoldDropped",
    "Verified",
    "Discard",
    "Fingerprint",
    "Incompatible",
    "admission_code",
    "update_problem",
    "Event",
    "Assign",
    "Hold",
    "Applied",
    "Duplicate",
    "Rejected",
    "Expired",
    "Admitted",
    "Refused",
    "Revoked",
    "Verify",
    "Verdict",
    "Expelled",
    "VerifyPolicy",
    "VerificationState",
    "verify_reason",
    "verify_draw",
    "void_leases",
    "AdmissionRecord",
    "Action",
    "handle",
    "is_admitted",
    "admission_problem",
]


# ----------------------------------------------------------------------------------------- state


@dataclass
class Lease:
    lease_id: str
    peer: str
    shard: int
    start_offset: int  # index of the first batch of the shard this lease trains
    steps: int
    lr_offset: int  # shard's local-update counter at issue: step j uses η(lr_offset + j)
    base_version: int
    issued_at: float
    expected_finish: float
    deadline: float
    fetched: bool = False  # the peer downloaded θ(base_version): the coordinator may stop retaining it
    verify: str = ""  # why this lease's update will be re-run (verify_reason), "" if not; never sent to the peer

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ShardState:
    size: int  # batches per epoch
    assigned: int = 0  # n_i of Eq. 2: local updates assigned (given back when a lease is abandoned)
    cursor: int = 0  # next never-issued batch index (monotonic)
    returned: list[tuple[int, int]] = field(default_factory=list)  # (start, steps) given back, reissued first


@dataclass
class PeerInfo:
    speed: float  # the peer's own (already smoothed) claim, units (tokens or samples) per second
    last_seen: float
    alive: bool = True
    reported_at: float | None = None  # timestamp of the newest report taken: a re-read record is no new sample
    observed: float | None = None  # throughput the coordinator measured on this peer's applied leases (smoothed)
    signer: str | None = None  # DHT signing key bound to this peer id over its authenticated hello
    transfer_s: float | None = None  # seconds its last upload took, as the coordinator measured it
    name: str = ""
    failed: bool = False  # gave a lease back before ever delivering: its claim no longer sets others' steps


@dataclass(frozen=True)
class CoordinatorPolicy:
    """Knobs of the decision function (from the run config)."""

    max_local_steps: int  # H
    min_steps: int = 1
    dylu: bool = True
    barrier: bool = False  # sync DiLoCo
    grace_period: float = 0.0
    units_per_step: int = 1  # tokens (or samples) one local step consumes
    speed_ema: float = 0.5
    lease_timeout_factor: float = 3.0
    lease_slack: float = 30.0
    max_staleness: int | None = None
    max_update_norm: float | None = None
    # Eq. 2's n_i (docs/algorithm.md §4): "learned" = applied local updates (the paper), "assigned" =
    # also counting leases in flight (concurrent leases spread over shards)
    shard_progress: Literal["learned", "assigned"] = "learned"
    # --- public runs (all off in the simulator, see methods.coordinator_policy)
    gate: GatePolicy | None = None  # the robust update gate (coordinator/gate.py)
    norm_bound_per_step: float | None = None  # absolute ceiling on ‖Δ‖/steps (gate.adamw_norm_bound)
    trust_speeds: bool = True  # False: speeds count only when bound to the peer and capped by what it delivers
    speed_cap_factor: float = 1.5  # a claim counts up to this × the throughput observed on its applied leases
    max_clock_skew: float = 5.0  # a speed report stamped further in the future than this is refused
    peer_timeout: float = math.inf  # a peer without lease that is silent this long has left
    hold_limit: float = math.inf  # a request held longer than this is answered "ask again"
    max_lease_s: float = math.inf  # cap on a lease's deadline: a peer claiming to be slow holds nothing for years
    transfer_allowance_s: float = 0.0  # added to a lease's deadline for θ down + Δ up, until measured per peer
    download_upload_ratio: float = 1.0  # bytes of a θ download ÷ bytes of an upload (the two codecs)
    max_retained_versions: int = 8  # θ copies kept for leases whose θ was not downloaded yet
    buffer_size: int | None = None  # N of the outer optimizer (DN / buffer), to warn when the live peers differ
    # --- admission (coordinator/admission.py): "open" admits everyone (demos, the simulator)
    verify: "VerifyPolicy | None" = None  # verification of the work (runtime.verify, coordinator/verify.py)
    admission: str = "open"  # "open" | "token" | "allowlist"
    allowlist: frozenset[str] = frozenset()  # libp2p peer ids admitted in "allowlist" mode


@dataclass(frozen=True)
class VerifyPolicy:
    """Which leases are re-run (``runtime.verify``; docs/threat-model.md)."""

    fraction: float = 0.08  # share of a proven peer's leases
    probation_updates: int = 2  # every one of a peer's first N verified updates
    suspect_fraction: float = 0.5  # share for a peer with a gate rejection among its recent verdicts
    commit: bool = False  # inner_state "carry": submissions carry chained digests of the inner state (Commitments)


FRESH_STATE_DIGEST = hashlib.sha256(b"asyncloco inner state v1: fresh").hexdigest()
"""The commitment to a fresh inner optimizer state; the same value as peer/inner.py's (which computes the digests)."""


@dataclass
class VerificationState:
    """Verdicts so far (checkpointed with the state)."""

    passed: dict[str, int] = field(default_factory=dict)  # peer -> its updates whose re-run matched
    expelled: dict[str, str] = field(default_factory=dict)  # peer -> why (the failed lease and the comparison)
    pending: dict[str, str] = field(default_factory=dict)  # lease id -> peer: applied, re-run not yet judged
    checked: int = 0
    failed: int = 0
    unverifiable: int = 0  # selected leases whose base θ was no longer retained at submission
    chain: dict[str, str] = field(default_factory=dict)  # peer -> inner-state digest at the end of its last applied lease

    def state_dict(self) -> dict[str, Any]:
        return {
            "passed": dict(self.passed), "expelled": dict(self.expelled), "pending": dict(self.pending),
            "checked": self.checked, "failed": self.failed, "unverifiable": self.unverifiable, "chain": dict(self.chain),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "VerificationState":
        return cls(
            {k: int(v) for k, v in state["passed"].items()}, {k: str(v) for k, v in state["expelled"].items()},
            {k: str(v) for k, v in state["pending"].items()}, int(state["checked"]), int(state["failed"]),
            int(state["unverifiable"]), {k: str(v) for k, v in state.get("chain", {}).items()},
        )


@dataclass
class AdmissionRecord:
    """A peer admitted by a token (``runtime.admission: token``), bound on first use."""

    token_id: str
    name: str
    expires_at: float
    admitted_at: float


@dataclass
class DerivedIndexes:
    """The logic's derived indexes of a :class:`CoordinatorState` (never checkpointed, never compared): the sorted lease
    indexes (:func:`_lease_index`), the lease book (:func:`_book`) and the speed heap (:func:`_fastest_alive`). Each
    remembers the table it was built from and is rebuilt when that table is replaced (a checkpoint load, a replay)."""

    lease_indexes: dict[str, tuple[dict[str, Lease], list[tuple[float, str]]]] = field(default_factory=dict)
    lease_book: "_LeaseBook | None" = None
    speed_heap: tuple[dict[str, PeerInfo], list[tuple[float, str]]] | None = None


@dataclass
class CoordinatorState:
    params: torch.Tensor  # θ, flat fp32
    optimizer: OuterOptimizer
    transforms: list[StalenessTransform]
    policy: CoordinatorPolicy
    shards: list[ShardState]
    seed: int = 0
    version: int = 0
    local_updates: int = 0  # sum of steps of applied updates
    lease_counter: int = 0
    leases: dict[str, Lease] = field(default_factory=dict)
    peers: dict[str, PeerInfo] = field(default_factory=dict)
    applied: dict[str, int] = field(default_factory=dict)  # lease_id -> version after applying it
    held: dict[str, float] = field(default_factory=dict)  # peer -> time of its held request (insertion order)
    window_end: float | None = None  # open grace window closes at this time
    base_params: dict[int, torch.Tensor] = field(default_factory=dict)  # θ(v) of older versions still needed
    lease_secret: bytes = b""  # lease ids are HMAC(secret, counter): unguessable, yet replayable from the state
    gate: GateState = field(default_factory=GateState)
    noticed_peers: int = -1  # live-peer count at the last N-vs-peers notice
    # --- admission: peer id -> its token; token id -> the peer it is bound to; revoked token ids -> when
    admitted: dict[str, AdmissionRecord] = field(default_factory=dict)
    token_peers: dict[str, str] = field(default_factory=dict)
    revoked: dict[str, float] = field(default_factory=dict)
    verification: VerificationState = field(default_factory=VerificationState)
    incompatible: dict[str, str] = field(default_factory=dict)  # peer id -> why its fingerprint was refused (Fingerprint)
    indexes: DerivedIndexes = field(default_factory=DerivedIndexes, repr=False, compare=False)  # derived, not state

    @property
    def needs_base_params(self) -> bool:
        return any(t.needs_base_params for t in self.transforms)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to continue the same trajectory (tensors + plain values)."""
        return {
            "params": self.params,
            "optimizer": self.optimizer.state_dict(),
            "transforms": [t.state_dict() for t in self.transforms],
            "shards": [dict(s.__dict__) for s in self.shards],
            "seed": self.seed,
            "version": self.version,
            "local_updates": self.local_updates,
            "lease_counter": self.lease_counter,
            "leases": {k: v.to_dict() for k, v in self.leases.items()},
            "peers": {k: dict(v.__dict__) for k, v in self.peers.items()},
            "applied": dict(self.applied),
            "held": dict(self.held),
            "window_end": self.window_end,
            "base_params": dict(self.base_params),
            "lease_secret": self.lease_secret.hex(),
            "gate": self.gate.state_dict(),
            "noticed_peers": self.noticed_peers,
            "admitted": {k: dict(v.__dict__) for k, v in self.admitted.items()},
            "token_peers": dict(self.token_peers),
            "revoked": dict(self.revoked),
            "verification": self.verification.state_dict(),
            "incompatible": dict(self.incompatible),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = state["params"]
        if params.shape != self.params.shape:
            raise ValueError(
                f"checkpoint θ has {params.numel()} values but this run's model has {self.params.numel()}; "
                "resume with the config the checkpoint was written with"
            )
        if len(state["shards"]) != len(self.shards):
            raise ValueError(f"checkpoint has {len(state['shards'])} shards, config has {len(self.shards)}")
        self.params.copy_(params)
        self.optimizer.load_state_dict(state["optimizer"])
        for transform, sub in zip(self.transforms, state["transforms"]):
            transform.load_state_dict(sub)
        self.shards = [
            ShardState(s["size"], s["assigned"], s["cursor"], [tuple(r) for r in s["returned"]])
            for s in state["shards"]
        ]
        self.seed = int(state["seed"])
        self.version = int(state["version"])
        self.local_updates = int(state["local_updates"])
        self.lease_counter = int(state["lease_counter"])
        self.leases = {k: Lease(**v) for k, v in state["leases"].items()}
        self.peers = {k: PeerInfo(**v) for k, v in state["peers"].items()}
        self.applied = {k: int(v) for k, v in state["applied"].items()}
        self.held = dict(state["held"])
        self.window_end = state["window_end"]
        self.base_params = {int(k): v.clone() for k, v in state["base_params"].items()}
        self.lease_secret = bytes.fromhex(state.get("lease_secret", ""))
        if "gate" in state:
            self.gate = GateState.from_state_dict(state["gate"])
        self.noticed_peers = int(state.get("noticed_peers", -1))
        # admission fields: absent from checkpoints written before admission existed
        self.admitted = {k: AdmissionRecord(**v) for k, v in state.get("admitted", {}).items()}
        self.token_peers = dict(state.get("token_peers", {}))
        self.revoked = {k: float(v) for k, v in state.get("revoked", {}).items()}
        verification = state.get("verification")
        self.verification = VerificationState() if verification is None else VerificationState.from_state_dict(verification)
        self.incompatible = {str(k): str(v) for k, v in state.get("incompatible", {}).items()}


# ---------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class SpeedReport:
    """A throughput claim. ``reported_at``: the record's own timestamp (None: take it as new);
    ``signer``: fingerprint of the key that signed the DHT record (None: it came over the peer's own
    authenticated RPC, or from the simulator)."""

    peer: str
    units_per_second: float
    reported_at: float | None = None
    signer: str | None = None


@dataclass(frozen=True)
class Hello:
    """A peer introduces itself over its authenticated RPC: binds its DHT signing key and name."""

    peer: str
    signer: str | None = None
    name: str = ""
    units_per_second: float | None = None


@dataclass(frozen=True)
class RequestWork:
    peer: str


@dataclass(frozen=True)
class Fetched:
    """The peer downloaded θ at ``version`` (the daemon saw the transfer complete)."""

    peer: str
    version: int


@dataclass(frozen=True)
class SubmitUpdate:
    peer: str
    lease_id: str
    base_version: int
    pseudo_gradient: torch.Tensor
    transfer_s: float = 0.0  # seconds the upload took, measured by the coordinator (not the peer's claim)
    # --- the update gate's probe (coordinator/gate.py): the loss on the coordinator's probe batch at θ and at
    # θ − s·Δ, evaluated by the daemon before ``handle`` (None: not evaluated); in the write-ahead log, so a replay
    # decides the same way without a model
    probe_before: float | None = None
    probe_after: float | None = None
    # --- commitments (runtime.verify with inner_state "carry"): sha256 hex of the peer's inner optimizer state at the
    # lease's start and end (peer/inner.py inner_state_digest); None from peers that do not commit
    state_start: str | None = None
    state_end: str | None = None


@dataclass(frozen=True)
class Restarted:
    """The coordinator restarted (``--resume``): held requests died with their RPCs, and the peers get
    ``grace_s`` to call again before their silence counts."""

    grace_s: float


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class PeerLeft:
    peer: str


@dataclass(frozen=True)
class Admit:
    """A token whose signature the daemon verified, presented by ``peer`` (the authenticated peer id)."""

    peer: str
    token_id: str
    name: str
    expires_at: float


@dataclass(frozen=True)
class Revoke:
    token_id: str
    revoked_at: float


@dataclass(frozen=True)
class HoldDropped:
    """The daemon stopped waiting on ``peer``'s held request (its RPC timed out; the peer will ask again)."""

    peer: str


@dataclass(frozen=True)
class Fingerprint:
    """The compatibility check (asyncloco/fingerprint.py) of ``peer``: ``reason`` is why its model, tokenizer, data or
    codec differ from the run's (``differing``: the components; ``peer_version``: its asyncloco), "" when it fits.
    An incompatible peer is turned away like an unadmitted one (code INCOMPATIBLE) until a check fits."""

    peer: str
    reason: str
    differing: tuple[str, ...] = ()
    peer_version: str = ""


@dataclass(frozen=True)
class Verified:
    """A verifier's verdict on lease ``lease_id`` of ``peer`` (coordinator/verify.py): ``ok`` when the re-run's
    pseudo-gradient matched the submitted one within the tolerance; ``detail`` says how close it was."""

    peer: str
    lease_id: str
    ok: bool
    detail: str
    anchor: int = -1  # the daemon's: the log record its repair replays from (coordinator/verify.py); unused here


@dataclass(frozen=True)
class Discard:
    """Void ``peer``'s update for ``lease_id``: the lease is consumed (its batches count as used, as for an update a
    staleness policy drops), θ is untouched. Only the repair's replay feeds it (coordinator/verify.py)."""

    peer: str
    lease_id: str


Event = Union[
    SpeedReport, Hello, RequestWork, Fetched, SubmitUpdate, Tick, PeerLeft, Restarted, Admit, Revoke, HoldDropped,
    Verified, Discard, Fingerprint,
]


# --------------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Assign:
    peer: str
    lease: Lease
    reason: str


@dataclass(frozen=True)
class Hold:
    peer: str
    until: float  # math.inf in barrier mode
    waiting_for: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Applied:
    peer: str
    lease_id: str
    version: int  # θ's version after this update
    staleness: int
    steps: int
    shard: int
    moved: bool
    reason: str
    gate: str = ""  # what the update gate did (e.g. "clipped ×0.25: ..."), empty when it is off


@dataclass(frozen=True)
class Duplicate:
    peer: str
    lease_id: str
    version: int  # the version at which it was first applied
    reason: str


@dataclass(frozen=True)
class Rejected:
    peer: str
    lease_id: str
    reason: str
    code: RefusalCode  # the typed reason the peer reacts to (asyncloco/refusals.py)


@dataclass(frozen=True)
class Expired:
    peer: str
    lease_id: str
    shard: int
    steps: int
    reason: str


@dataclass(frozen=True)
class Admitted:
    peer: str
    token_id: str
    name: str
    new: bool  # False: this peer was already admitted by this token (nothing changed)
    reason: str


@dataclass(frozen=True)
class Refused:
    """An admission refused, or an unadmitted peer's request turned away."""

    peer: str
    token_id: str  # the token presented, "" for a request without one
    reason: str
    lease_id: str = ""  # the submission turned away, if it was one
    code: RefusalCode = RefusalCode.NOT_ADMITTED  # or EXPELLED / INCOMPATIBLE (admission_code)


@dataclass(frozen=True)
class Incompatible:
    """``peer`` failed the compatibility check (a :class:`Fingerprint` event); journaled once per change."""

    peer: str
    differing: tuple[str, ...]
    peer_version: str
    reason: str


@dataclass(frozen=True)
class Revoked:
    token_id: str
    peer: str | None  # the peer the token was bound to, if any
    reason: str


@dataclass(frozen=True)
class Quarantined:
    peer: str
    until: float
    reason: str


@dataclass(frozen=True)
class Released:
    """A held request answered without a lease (held longer than the hold limit): the peer asks again."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Left:
    """The logic decided a peer is gone (silent past ``peer_timeout``)."""

    peer: str
    reason: str


@dataclass(frozen=True)
class Notice:
    """Something the organiser should know (e.g. live peers ≠ the outer optimizer's N)."""

    reason: str


@dataclass(frozen=True)
class Verify:
    """Re-run this applied lease (the daemon hands it to its verifier): ``base`` is θ at the lease's base version,
    ``update`` the pseudo-gradient as submitted (before any clipping). Neither tensor changes afterwards."""

    peer: str
    lease: Lease
    base: torch.Tensor
    update: torch.Tensor
    reason: str
    failed: str = ""  # already failed, nothing to re-run (a broken commitment chain): the verdict is this detail
    state_start: str = ""  # the lease's committed inner-state digests ("" without commitments)
    state_end: str = ""


@dataclass(frozen=True)
class Verdict:
    peer: str
    lease_id: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Expelled:
    """``peer`` failed a verification: it is out of the run for good. The daemon repairs θ: the log is replayed
    without its updates (coordinator/verify.py, ``repair``)."""

    peer: str
    lease_id: str
    reason: str
    anchor: int = -1  # the Verified event's: the log record the daemon's repair replays from


Action = Union[
    Assign, Hold, Applied, Duplicate, Rejected, Expired, Admitted, Refused, Revoked, Quarantined, Released, Left, Notice,
    Verify, Verdict, Expelled, Incompatible,
]


# ------------------------------------------------------------------------------------- decisions


def handle(state: CoordinatorState, event: Event, now: float) -> tuple[CoordinatorState, list[Action]]:
    """Decide what ``event`` at time ``now`` does. Mutates and returns ``state``."""
    if isinstance(event, (SpeedReport, Hello, RequestWork, Fetched, SubmitUpdate)) and not is_admitted(state, event.peer, now):
        # admission gate: an unadmitted peer gets nothing and has no say in DyLU
        return state, _turn_away(state, event, now)
    if isinstance(event, Admit):
        return state, _on_admit(state, event, now) + _release_held(state, now)
    if isinstance(event, Revoke):
        return state, _on_revoke(state, event, now) + _release_held(state, now)
    if isinstance(event, Fingerprint):
        return state, _on_fingerprint(state, event) + _release_held(state, now)
    if isinstance(event, SpeedReport):
        actions = _on_speed(state, event, now)
    elif isinstance(event, Hello):
        actions = _on_hello(state, event, now)
    elif isinstance(event, RequestWork):
        actions = _on_request(state, event, now)
    elif isinstance(event, Fetched):
        actions = _on_fetched(state, event, now)
    elif isinstance(event, SubmitUpdate):
        actions = _on_submit(state, event, now)
    elif isinstance(event, Tick):
        actions = _on_tick(state, now)
    elif isinstance(event, PeerLeft):
        actions = _on_peer_left(state, event, now)
    elif isinstance(event, Restarted):
        actions = _on_restarted(state, event, now)
    elif isinstance(event, HoldDropped):
        state.held.pop(event.peer, None)  # nothing to answer: the RPC that waited is gone
        actions = []
    elif isinstance(event, Verified):
        actions = _on_verified(state, event, now)
    elif isinstance(event, Discard):
        actions = _on_discard(state, event)
    else:
        raise TypeError(f"unknown event {event!r}")
    actions += _release_held(state, now)
    actions += _notice_peer_count(state)
    return state, actions


def _on_speed(state: CoordinatorState, event: SpeedReport, now: float) -> list[Action]:
    """Take a throughput claim. The peer smooths its own measurements, so a new report replaces the
    old value (no second smoothing here); a record read again with the same timestamp is no new sample.
    Unless ``trust_speeds`` (the simulator), a DHT record counts only for a peer that said hello over its
    authenticated RPC and only when signed by the key it bound there, and never from the future."""
    speed = float(event.units_per_second)
    if not (math.isfinite(speed) and speed > 0):
        return []  # a bogus report never reaches DyLU; the peer keeps its previous speed
    info = state.peers.get(event.peer)
    if not state.policy.trust_speeds and event.signer is not None:
        if info is None or info.signer is None or info.signer != event.signer:
            return []  # about a peer that never said hello, or signed by a key that is not its own
    if event.reported_at is not None:
        if event.reported_at > now + state.policy.max_clock_skew:
            return []
        if info is not None and info.reported_at is not None and event.reported_at <= info.reported_at:
            return []
    if info is None or not info.alive:
        keep = info if info is not None else PeerInfo(speed, now)
        keep.speed, keep.last_seen, keep.alive, keep.reported_at = speed, now, True, event.reported_at
        state.peers[event.peer] = keep
        _note_speed(state, event.peer)
        return []
    info.speed, info.last_seen = speed, now
    if event.reported_at is not None:
        info.reported_at = event.reported_at
    _note_speed(state, event.peer)
    return []


def _on_hello(state: CoordinatorState, event: Hello, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    speed = event.units_per_second
    if info is None:
        if speed is None or not (math.isfinite(speed) and speed > 0):
            return []  # registered once it reports a usable speed
        info = state.peers[event.peer] = PeerInfo(float(speed), now)
    elif speed is not None and math.isfinite(speed) and speed > 0:
        info.speed = float(speed)
    info.alive, info.last_seen = True, now
    _note_speed(state, event.peer)
    info.signer = event.signer  # the authenticated peer itself re-binds its key (a restart makes a new one)
    info.name = event.name[:64]
    return []


def _effective_speed(state: CoordinatorState, info: PeerInfo) -> float:
    """The claim as DyLU uses it: capped by what the peer delivered, unless speeds are trusted."""
    if state.policy.trust_speeds or info.observed is None:
        return info.speed
    return min(info.speed, info.observed * state.policy.speed_cap_factor)


def _dylu_reference(state: CoordinatorState, now: float) -> float:
    """The fastest speed DyLU scales by. Trusted speeds: the max over alive peers. Otherwise over alive,
    unquarantined peers: a proven peer (one that delivered) counts at its capped claim; an unproven claim
    counts at most 4× the median claim, and only until the peer gives a lease back without delivering — so a
    ghost that never submits moves honest steps by a bounded factor, for at most one lease deadline."""
    if state.policy.trust_speeds:
        return _fastest_alive(state)
    candidates = [
        info for name, info in state.peers.items() if info.alive and not update_gate.is_quarantined(state.gate, name, now)
    ]
    claims = sorted(info.speed for info in candidates) or sorted(info.speed for info in state.peers.values() if info.alive)
    half = len(claims) // 2
    middle = claims[half] if len(claims) % 2 else 0.5 * (claims[half - 1] + claims[half])
    cap = 4.0 * middle
    counted = [
        _effective_speed(state, info) if info.observed is not None else min(info.speed, cap)
        for info in candidates
        if info.observed is not None or not info.failed
    ]
    return max(counted) if counted else min(claims[-1], cap)

def _alive_speeds(state: CoordinatorState) -> dict[str, float]:
    return {name: info.speed for name, info in state.peers.items() if info.alive}


def _on_request(state: CoordinatorState, event: RequestWork, now: float) -> list[Action]:
    peer = event.peer
    info = state.peers.get(peer)
    if info is None or not info.alive:
        return [Rejected(peer, "", "no speed report from this peer yet; it must publish its throughput first", RefusalCode.NO_SPEED)]
    info.last_seen = now
    if update_gate.is_quarantined(state.gate, peer, now):
        until = state.gate.quarantined_until[peer]
        return [Rejected(peer, "", f"quarantined until {until:.0f} after repeated rejected updates", RefusalCode.QUARANTINED)]
    for lease in _peer_leases(state, peer)[:1]:
        # A peer holds one lease at a time: asking again means it abandoned the old one.
        return _give_back(state, lease, "peer asked for new work before submitting") + _on_request(state, event, now)
    if peer in state.held:
        return []
    policy = state.policy
    if policy.barrier:
        if any(lease.base_version < state.version for lease in state.leases.values()):
            state.held[peer] = now
            waiting = tuple(sorted(state.leases))
            return [Hold(peer, math.inf, waiting, f"sync barrier: waiting for {len(waiting)} lease(s) of this round")]
        return [_issue(state, peer, now, "sync round starts")]
    if state.window_end is not None and now <= state.window_end:
        # Inside an open grace window (paper Alg. 2 and Fig. 3, docs/algorithm.md §6): join the held
        # group while updates expected in the window are outstanding; once they are all in, the window
        # is settled and a peer that finished inside it (B in Fig. 3) starts at once from the same θ
        # the group was released with — it never opens a window of its own that would chain to a
        # completion outside this one (C in Fig. 3).
        waiting = _expected_in_window(state, state.window_end)
        if not waiting:
            return [_issue(state, peer, now, "finished inside a settled grace window: starts from its newest θ")]
        state.held[peer] = now
        return [Hold(peer, state.window_end, waiting, "joined the open grace window")]
    soon = _expected_in_window(state, now + policy.grace_period)  # only these can matter: O(k + log n)
    decision = hold_decision(now, ((lid, state.leases[lid].expected_finish) for lid in soon), policy.grace_period)
    if decision.hold_until is None:
        return [_issue(state, peer, now, decision.reason)]
    state.window_end = decision.hold_until
    state.held[peer] = now
    return [Hold(peer, decision.hold_until, decision.waiting_for, decision.reason)]


def _lease_index(state: CoordinatorState, key: str) -> list[tuple[float, str]]:
    """Active leases sorted by ``key`` ("expected_finish" or "deadline"), as (time, lease_id).

    A derived cache kept beside the state (never checkpointed): leases enter it when issued
    (:func:`_index_lease`); leases that left ``state.leases`` (applied, given back) are pruned lazily when
    a query meets them. It is rebuilt when the lease table is replaced (checkpoint load). With k leases
    due before a query's bound, a query costs O(k + log n) instead of a scan over all n leases."""
    caches = state.indexes.lease_indexes
    cached = caches.get(key)
    if cached is None or cached[0] is not state.leases:
        entries = sorted((getattr(lease, key), lease_id) for lease_id, lease in state.leases.items())
        cached = caches[key] = (state.leases, entries)
    return cached[1]


def _index_lease(state: CoordinatorState, lease: Lease) -> None:
    caches = state.indexes.lease_indexes
    for key, (table, entries) in caches.items():
        if table is state.leases:
            bisect.insort(entries, (getattr(lease, key), lease.lease_id))
    _book_issued(state, lease)


# --- per-event indexes of the lease table and of the peers' speeds (issue 9) ---------------------------------


@dataclass
class _LeaseBook:
    """What per-event decisions need to know about the active leases, without a scan over all of them.

    Derived from ``state.leases`` and never checkpointed: rebuilt in O(n) whenever the table it was built
    from is replaced (a checkpoint load, a replay) or its size disagrees with the table's (a change made
    outside :func:`_issue` / :func:`_unindex_lease`), so a state restored from a snapshot answers exactly
    as the state it was taken from. Issuing and removing a lease cost O(1)."""

    table: dict[str, Lease]
    count: int
    by_peer: dict[str, dict[str, None]]  # peer -> its lease ids, in issue order
    by_version: dict[int, dict[str, None]]  # base version -> lease ids that may still need θ(version)
    in_flight: list[int]  # per shard: steps of its active leases (Eq. 2's learned progress = assigned − this)


def _book_add(book: _LeaseBook, lease: Lease) -> None:
    book.count += 1
    book.by_peer.setdefault(lease.peer, {})[lease.lease_id] = None
    book.by_version.setdefault(lease.base_version, {})[lease.lease_id] = None
    book.in_flight[lease.shard] += lease.steps


def _book(state: CoordinatorState) -> _LeaseBook:
    book = state.indexes.lease_book
    if (
        book is None
        or book.table is not state.leases
        or book.count != len(state.leases)
        or len(book.in_flight) != len(state.shards)
    ):
        book = _LeaseBook(state.leases, 0, {}, {}, [0] * len(state.shards))
        for lease in state.leases.values():
            _book_add(book, lease)
        state.indexes.lease_book = book
    return book


def _book_issued(state: CoordinatorState, lease: Lease) -> None:
    """``lease`` was just added to ``state.leases``."""
    book = state.indexes.lease_book
    if book is not None and book.table is state.leases and book.count == len(state.leases) - 1:
        _book_add(book, lease)


def _unindex_lease(state: CoordinatorState, lease: Lease) -> None:
    """``lease`` was just removed from ``state.leases`` (applied, rejected or given back)."""
    book = state.indexes.lease_book
    if book is None:
        return
    mine = book.by_peer.get(lease.peer, {})
    if book.table is not state.leases or book.count != len(state.leases) + 1 or lease.lease_id not in mine:
        state.indexes.lease_book = None  # out of step: rebuilt at the next query
        return
    book.count -= 1
    del mine[lease.lease_id]
    if not mine:
        del book.by_peer[lease.peer]
    version = book.by_version.get(lease.base_version)
    if version is not None:
        version.pop(lease.lease_id, None)
        if not version:
            del book.by_version[lease.base_version]
    book.in_flight[lease.shard] -= lease.steps


def _peer_leases(state: CoordinatorState, peer: str) -> list[Lease]:
    """The active leases of ``peer`` in issue order (normally at most one): O(its leases)."""
    ids = _book(state).by_peer.get(peer, {})
    return [state.leases[lease_id] for lease_id in ids if lease_id in state.leases]


def _version_needed(state: CoordinatorState, version: int) -> bool:
    """Does an active lease still need θ(``version``) (not downloaded yet, or a staleness transform wants the
    base)? Amortised O(1): a lease that no longer needs it (downloaded, and no transform needs bases) never
    will again, so it leaves the version's list at the first query that meets it."""
    book = _book(state)
    ids = book.by_version.get(version)
    if not ids:
        return False
    needs_base = state.needs_base_params
    while ids:
        lease_id = next(iter(ids))
        lease = state.leases.get(lease_id)
        if lease is not None and lease.base_version == version and (needs_base or not lease.fetched or lease.verify):
            return True
        del ids[lease_id]
    del book.by_version[version]
    return False


def _note_speed(state: CoordinatorState, peer: str) -> None:
    """``peer``'s speed or liveness may have changed: record it for :func:`_fastest_alive`."""
    cache = state.indexes.speed_heap
    info = state.peers.get(peer)
    if cache is not None and cache[0] is state.peers and info is not None and info.alive:
        heapq.heappush(cache[1], (-info.speed, peer))


def _fastest_alive(state: CoordinatorState) -> float:
    """max(speed) over the alive peers, amortised O(log n): a max-heap of (−speed, peer) entries, pushed on every
    report (:func:`_note_speed`); entries that no longer match their peer (a newer speed, a peer gone) are
    dropped when they reach the top. Derived, never checkpointed: rebuilt when ``state.peers`` is replaced
    or the heap holds more than 4× as many entries as there are peers."""
    cache = state.indexes.speed_heap
    if cache is None or cache[0] is not state.peers or len(cache[1]) > 4 * len(state.peers) + 64:
        entries = [(-info.speed, name) for name, info in state.peers.items() if info.alive]
        heapq.heapify(entries)
        cache = state.indexes.speed_heap = (state.peers, entries)
    heap = cache[1]
    while heap:
        negative, name = heap[0]
        info = state.peers.get(name)
        if info is not None and info.alive and info.speed == -negative:
            return -negative
        heapq.heappop(heap)
    raise ValueError("no alive peer has reported a speed")


def _leases_due(state: CoordinatorState, key: str, bound: float, strict: bool = False) -> list[str]:
    """Ids of the active leases whose ``key`` time is <= ``bound`` (< with ``strict``), pruning stale entries."""
    entries = _lease_index(state, key)
    end = bisect.bisect_left(entries, (bound, "")) if strict else bisect.bisect_right(entries, (bound, "\U0010ffff"))
    live = [entry for entry in entries[:end] if entry[1] in state.leases]
    if len(live) < end:
        entries[:end] = live
    return [lease_id for _, lease_id in live]


def _expected_in_window(state: CoordinatorState, window_end: float) -> tuple[str, ...]:
    return tuple(sorted(_leases_due(state, "expected_finish", window_end)))


def _release_held(state: CoordinatorState, now: float) -> list[Action]:
    """Answer held requests once their window is settled."""
    closed_short = None
    if state.policy.barrier and not state.leases:
        # A sync round whose leases were given back (expired, peer left) ends with fewer than N
        # arrivals buffered: step on their mean now, or the next round's updates would be averaged
        # into this round's step and every later round would stay misaligned.
        closed_short = state.optimizer.flush(state.params)
    if not state.held:
        if state.window_end is not None and now > state.window_end:
            state.window_end = None
        return []
    pending: tuple[str, ...] = ()
    if state.policy.barrier:
        if state.leases:
            return []
        reason = "sync barrier released: every lease of the round is in"
        if closed_short is not None:
            reason += f" or given back; {closed_short.reason}"
    else:
        window_end = state.window_end if state.window_end is not None else now
        pending = _expected_in_window(state, window_end)
        if pending and now < window_end:
            return []
        reason = (
            "grace window closed" if pending else "every update expected in the grace window has been applied"
        )
    held = sorted(state.held.items(), key=lambda item: (item[1], item[0]))
    state.held.clear()
    if state.policy.barrier or pending:
        state.window_end = None
    # Otherwise the window stays open (settled) until its end, so that peers whose updates were
    # applied inside it and who ask a moment later join this group instead of opening a chained one.
    actions: list[Action] = []
    for peer, _ in held:
        info = state.peers.get(peer)
        if info is None or not info.alive:
            continue
        actions.append(_issue(state, peer, now, reason))
    return actions


def _next_uniform(state: CoordinatorState) -> float:
    # Counter-based: the n-th lease's draw depends only on (seed, n), so a resumed coordinator draws
    # exactly what an uninterrupted one would have.
    return float(np.random.default_rng([state.seed, state.lease_counter]).random())


def _issue(state: CoordinatorState, peer: str, now: float, why: str) -> Assign:
    policy = state.policy
    info = state.peers[peer]
    speed = _effective_speed(state, info)
    if policy.dylu:
        fastest = max(_dylu_reference(state, now), speed)
        steps = dylu_steps({peer: speed, "": fastest}, peer, policy.max_local_steps, policy.min_steps)
        why_steps = f"DyLU: {steps} steps at {speed:.4g} units/s vs fastest {fastest:.4g}"
    else:
        steps = policy.max_local_steps
        why_steps = f"{steps} steps (fixed H)"
    sizes = [s.size for s in state.shards]
    progress = [s.assigned for s in state.shards]
    if policy.shard_progress == "learned":
        # Eq. 2 as the paper counts it: data points learned, i.e. without the steps still in flight
        in_flight = _book(state).in_flight
        progress = [p - f for p, f in zip(progress, in_flight)]
    shard_index = sample_shard(sizes, progress, _next_uniform(state))
    shard = state.shards[shard_index]
    lr_offset = shard.assigned
    if shard.returned:
        start, available = shard.returned.pop(0)
        if available > steps:
            shard.returned.insert(0, (start + steps, available - steps))
        else:
            steps = available
            why_steps += f"; shortened to {steps} to re-train a range given back by an abandoned lease"
    else:
        start = shard.cursor
        shard.cursor += steps
    shard.assigned += steps
    state.lease_counter += 1
    duration = steps * policy.units_per_step / speed
    # The peer's time on the wire, from its last upload as the coordinator measured it, scaled to a download
    # plus an upload (their byte ratio), with a 2× margin — until measured, the configured allowance.
    transfer = (
        policy.transfer_allowance_s if info.transfer_s is None
        else 2.0 * info.transfer_s * (1.0 + policy.download_upload_ratio)
    )
    lease = Lease(
        lease_id=_lease_id(state),
        peer=peer,
        shard=shard_index,
        start_offset=start,
        steps=steps,
        lr_offset=lr_offset,
        base_version=state.version,
        issued_at=now,
        expected_finish=now + duration,
        deadline=now + min(duration * policy.lease_timeout_factor + policy.lease_slack + transfer, policy.max_lease_s),
    )
    if policy.verify is not None:
        lease = dataclasses.replace(lease, verify=verify_reason(state, policy.verify, peer, lease.lease_id))
    state.leases[lease.lease_id] = lease
    _index_lease(state, lease)
    return Assign(peer, lease, f"{why}; {why_steps}; shard {shard_index} sampled by Eq. 2")


def _lease_id(state: CoordinatorState) -> str:
    """The id of lease number ``state.lease_counter``: sequential without a secret (the simulator), else an
    HMAC of the counter — unguessable by other peers, and the same again when a log is replayed."""
    if not state.lease_secret:
        return f"L{state.lease_counter:08d}"
    digest = hmac.new(state.lease_secret, state.lease_counter.to_bytes(8, "big"), hashlib.sha256).hexdigest()
    return "L" + digest[:24]


def base_theta(state: CoordinatorState, version: int) -> torch.Tensor | None:
    """θ at ``version`` (the live tensor for the current version — clone before releasing the lock), or
    None when it is no longer retained."""
    if version == state.version:
        return state.params
    return state.base_params.get(version)


def _retain_before_step(state: CoordinatorState) -> list[Action]:
    """Copy-on-write of θ before the optimizer changes it: keep the current version when a lease still
    needs it (θ not downloaded yet, or a staleness transform wants the base). At most
    ``max_retained_versions`` older versions are kept: past that, the oldest not-yet-downloaded leases are
    given back (their peers ask again and start from the newest θ)."""
    if state.version not in state.base_params and _version_needed(state, state.version):
        state.base_params[state.version] = state.params.clone()
    actions: list[Action] = []
    cap = state.policy.max_retained_versions
    while len(state.base_params) > cap:
        # Versions kept only for a pending verification (the lease downloaded its θ long ago) never cost a peer its
        # lease: up to VERIFY_PIN_FACTOR × cap of them are kept beside the cap, and beyond that the oldest one's checks
        # are dropped (counted as unverifiable), not the leases.
        serving = sorted(v for v in state.base_params if _serves_download(state, v))
        if len(serving) <= cap and len(state.base_params) <= cap * (1 + VERIFY_PIN_FACTOR):
            break
        oldest = serving[0] if len(serving) > cap else min(state.base_params)
        for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
            if lease.base_version != oldest:
                continue
            if lease.fetched and not state.needs_base_params and lease.verify:
                lease.verify = ""  # its check is dropped: the base it would re-run from is gone
                state.verification.unverifiable += 1
            else:
                actions += _give_back(state, lease, f"θ of version {oldest} is no longer retained")
        state.base_params.pop(oldest, None)
    return actions


VERIFY_PIN_FACTOR = 4


def _serves_download(state: CoordinatorState, version: int) -> bool:
    """Does a lease still need θ(``version``) for a download or a staleness transform (not only for its check)?"""
    ids = _book(state).by_version.get(version, {})
    for lease_id in ids:
        lease = state.leases.get(lease_id)
        if lease is not None and lease.base_version == version and (state.needs_base_params or not lease.fetched):
            return True
    return False


def _give_back(state: CoordinatorState, lease: Lease, why: str) -> list[Action]:
    del state.leases[lease.lease_id]
    _unindex_lease(state, lease)
    info = state.peers.get(lease.peer)
    if info is not None and info.observed is None:
        info.failed = True
    shard = state.shards[lease.shard]
    shard.assigned -= lease.steps
    if lease.start_offset + lease.steps == shard.cursor and not shard.returned:
        shard.cursor = lease.start_offset  # the newest range: simply rewind
    else:
        shard.returned.append((lease.start_offset, lease.steps))
        shard.returned.sort()
    _drop_unused_base_params(state)
    return [Expired(lease.peer, lease.lease_id, lease.shard, lease.steps, f"{why}; {lease.steps} steps given back to shard {lease.shard}")]


def _drop_unused_base_params(state: CoordinatorState) -> None:
    if not state.base_params:
        return
    for version in list(state.base_params):  # at most max_retained_versions (+1), each O(1) amortised
        if not _version_needed(state, version):
            del state.base_params[version]


def _expire(state: CoordinatorState, now: float) -> list[Action]:
    actions: list[Action] = []
    for lease_id in sorted(_leases_due(state, "deadline", now, strict=True)):
        lease = state.leases[lease_id]
        actions += _give_back(state, lease, f"lease deadline {lease.deadline:.1f} passed")
    return actions


def _on_tick(state: CoordinatorState, now: float) -> list[Action]:
    actions = _expire(state, now)
    policy = state.policy
    for peer, since in list(state.held.items()):
        if now - since > policy.hold_limit:
            del state.held[peer]
            actions.append(Released(peer, f"held {now - since:.0f} s, longer than the hold limit {policy.hold_limit:g} s; ask again"))
    if math.isfinite(policy.peer_timeout):
        # A peer with a lease in hand or a held request is judged by its lease's deadline (which allows for its
        # measured transfer time), not by its speed reports: those travel through the DHT and may not reach
        # the coordinator over a slow or lossy link (a peer behind a latency spike was declared gone mid-lease
        # over and over when silence counted for it too).
        busy = {lease.peer for lease in state.leases.values()} | set(state.held)
        for peer, info in sorted(state.peers.items()):
            if info.alive and peer not in busy and now - info.last_seen > policy.peer_timeout:
                actions += _on_peer_left(state, PeerLeft(peer), now)
                actions.append(Left(peer, f"no report, request or submission for {now - info.last_seen:.0f} s (limit {policy.peer_timeout:g} s)"))
    return actions


def _on_fetched(state: CoordinatorState, event: Fetched, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    if info is not None:
        info.last_seen = now
    for lease in _peer_leases(state, event.peer):
        if lease.base_version == event.version:
            lease.fetched = True
    _drop_unused_base_params(state)
    return []


def _on_restarted(state: CoordinatorState, event: Restarted, now: float) -> list[Action]:
    state.held.clear()
    state.window_end = None
    for info in state.peers.values():
        info.last_seen = max(info.last_seen, now + event.grace_s)
    return []


def _notice_peer_count(state: CoordinatorState) -> list[Action]:
    """Tell the organiser when the live peers stop matching the outer optimizer's N. N stays as configured
    (changing it mid-run would change the method); fewer peers than N make DN's momentum step rarer (every N
    arrivals), more peers make it more frequent relative to each peer's rounds. docs/algorithm.md."""
    n = state.policy.buffer_size
    if n is None:
        return []
    live = sum(1 for info in state.peers.values() if info.alive)
    if live == state.noticed_peers:
        return []
    previous, state.noticed_peers = state.noticed_peers, live
    if live == n or live == 0 or (previous != n and previous > 0 and (previous < n) == (live < n)):
        return []
    relation = "fewer" if live < n else "more"
    return [Notice(f"{live} live peer(s), {relation} than the outer optimizer's N = {n} (outer.buffer_size): "
                   "the DN buffer steps every N arrivals; set outer.buffer_size to the number of peers you expect")]


def _on_peer_left(state: CoordinatorState, event: PeerLeft, now: float) -> list[Action]:
    info = state.peers.get(event.peer)
    if info is not None:
        info.alive = False
    state.held.pop(event.peer, None)
    actions: list[Action] = []
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == event.peer:
            actions += _give_back(state, lease, "peer left")
    return actions


# ------------------------------------------------------------------------------------ admission


def is_admitted(state: CoordinatorState, peer: str, now: float) -> bool:
    """May ``peer`` (an authenticated libp2p peer id) take part at ``now``? Always True in ``open`` mode for a
    peer that passed the compatibility check (or was not checked)."""
    if peer in state.verification.expelled:
        return False  # failed a verification: out for good, whatever the admission mode
    if peer in state.incompatible:
        return False  # failed the compatibility check (Fingerprint): until a check fits
    mode = state.policy.admission
    if mode == "open":
        return True
    if mode == "allowlist":
        return peer in state.policy.allowlist
    record = state.admitted.get(peer)
    return record is not None and now < record.expires_at and record.token_id not in state.revoked


def admission_code(state: CoordinatorState, peer: str) -> RefusalCode:
    """The typed code of :func:`admission_problem` (for a peer :func:`is_admitted` refuses)."""
    if peer in state.verification.expelled:
        return RefusalCode.EXPELLED
    if peer in state.incompatible:
        return RefusalCode.INCOMPATIBLE
    return RefusalCode.NOT_ADMITTED


def admission_problem(state: CoordinatorState, peer: str, now: float) -> str:
    if peer in state.verification.expelled:
        return f"expelled from this run: {state.verification.expelled[peer]}"
    if peer in state.incompatible:
        return state.incompatible[peer]
    mode = state.policy.admission
    if mode == "allowlist":
        return "this peer id is not in the run's runtime.allowlist; send it to the organiser"
    record = state.admitted.get(peer)
    if record is None:
        return "this run admits peers by token: join with --token (the organiser issues one with `asyncloco coordinator token`)"
    if record.token_id in state.revoked:
        return f"the token {record.token_id} admitting this peer was revoked"
    return f"the token {record.token_id} admitting this peer expired at {record.expires_at:.0f}; ask the organiser for a new one"


def _turn_away(
    state: CoordinatorState, event: SpeedReport | Hello | RequestWork | Fetched | SubmitUpdate, now: float
) -> list[Action]:
    if isinstance(event, (SpeedReport, Hello, Fetched)):
        return []  # no effect on DyLU, and no journal line per DHT read (the request that follows is refused)
    lease_id = event.lease_id if isinstance(event, SubmitUpdate) else ""
    return [Refused(event.peer, "", admission_problem(state, event.peer, now), lease_id, admission_code(state, event.peer))]


MAX_INCOMPATIBLE = 10_000  # refused fingerprints remembered (the oldest is forgotten first)


def _on_fingerprint(state: CoordinatorState, event: Fingerprint) -> list[Action]:
    if not event.reason:
        state.incompatible.pop(event.peer, None)
        return []
    if state.incompatible.get(event.peer) == event.reason:
        return []  # the same refusal again: nothing changed, nothing to journal
    state.incompatible.pop(event.peer, None)
    if len(state.incompatible) >= MAX_INCOMPATIBLE:
        state.incompatible.pop(next(iter(state.incompatible)))
    state.incompatible[event.peer] = event.reason
    state.held.pop(event.peer, None)
    return [Incompatible(event.peer, tuple(event.differing), event.peer_version, event.reason)]


def _on_admit(state: CoordinatorState, event: Admit, now: float) -> list[Action]:
    peer, token_id = event.peer, event.token_id
    if state.policy.admission != "token":
        return [Refused(peer, token_id, f"this run does not admit by token (runtime.admission: {state.policy.admission})")]
    if token_id in state.revoked:
        return [Refused(peer, token_id, f"token {token_id} ({event.name}) was revoked")]
    if now >= event.expires_at:
        return [Refused(peer, token_id, f"token {token_id} ({event.name}) expired at {event.expires_at:.0f}; ask the organiser for a new one")]
    bound = state.token_peers.get(token_id)
    if bound is not None and bound != peer:
        return [
            Refused(
                peer,
                token_id,
                f"token {token_id} ({event.name}) is bound to another peer id ({bound}); a token admits the one "
                "identity that first used it: rejoin with that identity (--identity) or ask for a new token",
            )
        ]
    record = state.admitted.get(peer)
    if record is not None and record.token_id == token_id:
        return [Admitted(peer, token_id, event.name, False, "already admitted by this token")]
    if record is not None:
        state.token_peers.pop(record.token_id, None)  # a renewed token replaces the old binding
    state.admitted[peer] = AdmissionRecord(token_id, event.name, float(event.expires_at), now)
    state.token_peers[token_id] = peer
    return [Admitted(peer, token_id, event.name, True, f"token {token_id} ({event.name}) bound to this peer id until {event.expires_at:.0f}")]


def _on_revoke(state: CoordinatorState, event: Revoke, now: float) -> list[Action]:
    if event.token_id in state.revoked:
        return []
    state.revoked[event.token_id] = float(event.revoked_at)
    peer = state.token_peers.get(event.token_id)
    actions: list[Action] = [Revoked(event.token_id, peer, "revoked by the organiser")]
    if peer is not None:
        record = state.admitted.get(peer)
        if record is not None and record.token_id == event.token_id:
            # the peer loses its leases and its say in DyLU, exactly as if it had left
            actions += _on_peer_left(state, PeerLeft(peer), now)
    return actions


# ---------------------------------------------------------------------------------- verification


def verify_draw(secret: bytes, lease_id: str) -> float:
    """A uniform number in [0, 1) from HMAC-SHA256(run secret, lease id): fixed by the lease, unknowable to a peer
    (it never learns the secret), and the same again when the log is replayed."""
    digest = hmac.new(secret, b"asyncloco-verify:" + lease_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


def verify_reason(state: CoordinatorState, policy: VerifyPolicy, peer: str, lease_id: str) -> str:
    """Why ``peer``'s lease ``lease_id`` is to be re-run, or "" when it is not: every lease while the peer has
    fewer than ``probation_updates`` verified updates, then ``suspect_fraction`` of them while the gate refused one
    of its recent updates, else ``fraction``. Decided when the lease is issued, never told to the peer. Checks on
    their way count toward probation (its leases chosen and still active, its applied updates awaiting a verdict):
    a fast peer's probation is ``probation_updates`` re-runs, not every lease it takes before its first verdicts."""
    passed = state.verification.passed.get(peer, 0)
    if passed < policy.probation_updates:
        on_the_way = sum(1 for owner in state.verification.pending.values() if owner == peer)
        on_the_way += sum(1 for lease in state.leases.values() if lease.peer == peer and lease.verify)
        if passed + on_the_way < policy.probation_updates:
            return f"probation ({passed} of {policy.probation_updates} verified" + (f", {on_the_way} on the way)" if on_the_way else ")")
    draw = verify_draw(state.lease_secret, lease_id)
    suspect = update_gate.suspect(state.gate, peer)  # a counted gate rejection or weak agreement, recently
    if suspect and draw < policy.suspect_fraction:
        return f"sampled at {policy.suspect_fraction:g} ({suspect})"
    if draw < policy.fraction:
        return f"sampled at {policy.fraction:g}"
    return ""


def _on_verified(state: CoordinatorState, event: Verified, now: float) -> list[Action]:
    book = state.verification
    book.pending.pop(event.lease_id, None)
    book.checked += 1
    if event.peer in book.expelled:
        return [Verdict(event.peer, event.lease_id, event.ok, f"{event.detail} (peer already expelled)")]
    if event.ok:
        book.passed[event.peer] = book.passed.get(event.peer, 0) + 1
        return [Verdict(event.peer, event.lease_id, True, event.detail)]
    book.failed += 1
    reason = f"lease {event.lease_id} did not reproduce: {event.detail}"
    book.expelled[event.peer] = reason
    actions: list[Action] = [Verdict(event.peer, event.lease_id, False, event.detail), Expelled(event.peer, event.lease_id, reason, event.anchor)]
    info = state.peers.get(event.peer)
    if info is not None:
        info.alive = False
    state.held.pop(event.peer, None)
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == event.peer:
            actions += _give_back(state, lease, "peer expelled")
    return actions


def _on_discard(state: CoordinatorState, event: Discard) -> list[Action]:
    lease = state.leases.get(event.lease_id)
    if lease is None or lease.peer != event.peer:
        return []
    del state.leases[lease.lease_id]
    _unindex_lease(state, lease)
    state.applied[lease.lease_id] = state.version  # consumed: a resend is a duplicate, its batches count as used
    _drop_unused_base_params(state)
    return [Rejected(event.peer, lease.lease_id, "update discarded: its peer was expelled", RefusalCode.DISCARDED)]


def void_leases(state: CoordinatorState, why: str, keep: Callable[[Lease], bool] | None = None) -> list[Action]:
    """Give back every active lease (but those ``keep`` holds valid) and drop every held request (after a repair
    replaced θ: no lease's base version means the same θ any more). Deterministic, so a replay repeats it."""
    actions: list[Action] = []
    failed = {name: info.failed for name, info in state.peers.items()}
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if keep is not None and keep(lease):
            continue
        actions += _give_back(state, lease, why)
    for name, info in state.peers.items():
        info.failed = failed[name]  # not the peers' doing: their DyLU standing stays
    for peer in sorted(state.held):
        actions.append(Released(peer, why))
    state.held.clear()
    state.window_end = None
    state.base_params.clear()
    return actions


def validate_update(state: CoordinatorState, event: SubmitUpdate, lease: Lease) -> str | None:
    """Why this update must not touch θ, or None if it may."""
    problem = update_problem(state, event, lease)
    return None if problem is None else problem[1]


def update_problem(state: CoordinatorState, event: SubmitUpdate, lease: Lease) -> tuple[RefusalCode, str] | None:
    """:func:`validate_update` with the typed code (STALE for the staleness bound, else INVALID_UPDATE)."""
    update = event.pseudo_gradient
    if lease.peer != event.peer:
        return RefusalCode.INVALID_UPDATE, f"lease {lease.lease_id} belongs to another peer"
    if event.base_version != lease.base_version:
        return RefusalCode.INVALID_UPDATE, f"base_version {event.base_version} does not match the lease's {lease.base_version}"
    if not isinstance(update, torch.Tensor) or update.dtype != torch.float32:
        return RefusalCode.INVALID_UPDATE, "pseudo-gradient must be a float32 tensor"
    if update.shape != state.params.shape:
        return RefusalCode.INVALID_UPDATE, f"pseudo-gradient has shape {tuple(update.shape)}, θ has {tuple(state.params.shape)}"
    staleness = state.version - lease.base_version
    if state.policy.max_staleness is not None and staleness > state.policy.max_staleness:
        return RefusalCode.STALE, f"staleness {staleness} exceeds the bound {state.policy.max_staleness}"
    if state.policy.gate is not None and state.policy.max_update_norm is None:
        return None  # the gate's own pass over Δ finds NaN/Inf and judges the norm
    # One pass: a NaN or Inf anywhere makes the sum of squares non-finite (so do values whose squares
    # overflow float32 — far beyond any honest update).
    squared = float(torch.dot(update, update))
    if not math.isfinite(squared):
        return RefusalCode.INVALID_UPDATE, "pseudo-gradient contains NaN or Inf, or its norm overflows float32"
    if state.policy.max_update_norm is not None and math.sqrt(squared) > state.policy.max_update_norm:
        return RefusalCode.INVALID_UPDATE, f"pseudo-gradient norm {math.sqrt(squared):.4g} exceeds the bound {state.policy.max_update_norm:g}"
    return None


def _on_submit(state: CoordinatorState, event: SubmitUpdate, now: float) -> list[Action]:
    if event.lease_id in state.applied:
        version = state.applied[event.lease_id]
        return [Duplicate(event.peer, event.lease_id, version, f"already applied at version {version}; not applied again")]
    lease = state.leases.get(event.lease_id)
    if lease is None:
        return [Rejected(event.peer, event.lease_id, "unknown or expired lease; its steps were given back", RefusalCode.UNKNOWN_LEASE)]
    problem = update_problem(state, event, lease)
    if problem is not None:
        return [Rejected(event.peer, event.lease_id, problem[1], problem[0])]
    broken = _broken_chain(state, event)
    if broken is not None:
        return broken
    staleness = state.version - lease.base_version
    info = state.peers.get(event.peer)
    if info is not None:
        info.last_seen = now
    update = event.pseudo_gradient
    policy = state.policy
    verdict = None
    # a lease chosen for verification: keep θ at its base version and the update exactly as submitted (the gate may
    # clip it in place, the optimizer step changes θ in place); Verify is emitted only if the update is applied
    check: tuple[torch.Tensor | None, torch.Tensor] | None = None
    if policy.verify is not None and lease.verify:
        base_now = base_theta(state, lease.base_version)
        check = (None if base_now is None else base_now.clone() if base_now is state.params else base_now, update.clone())
    if policy.gate is not None:
        probe = None if event.probe_before is None or event.probe_after is None else (event.probe_before, event.probe_after)
        verdict = update_gate.score(
            policy.gate, state.gate, update, lease.steps, event.peer, policy.norm_bound_per_step, probe
        )
        if verdict.action == "reject":
            # The work is refused and its steps go back to the shard (its batches get trained by someone else).
            quarantine = update_gate.record(policy.gate, state.gate, verdict, None, lease.steps, event.peer, now)
            actions: list[Action] = [Rejected(event.peer, lease.lease_id, f"update gate: {verdict.reason}", RefusalCode.GATE)]
            actions += _give_back(state, lease, "its update was rejected by the gate")
            if quarantine is not None:
                actions += _quarantine(state, event.peer, now, quarantine)
            return actions
        if verdict.action == "clip":
            update.mul_(verdict.scale)
    base = base_theta(state, lease.base_version) if state.needs_base_params else None
    adjusted = apply_transforms(state.transforms, update, staleness, state.params, base)
    del state.leases[lease.lease_id]
    _unindex_lease(state, lease)
    if info is not None and not policy.trust_speeds:
        busy = now - lease.issued_at - max(0.0, event.transfer_s)
        if busy > 0:
            info.observed = ema(info.observed, lease.steps * policy.units_per_step / busy, 0.5)
        info.transfer_s = max(0.0, event.transfer_s)
    if adjusted.pseudo_gradient is None:
        # Dropped by policy (e.g. PolyThres): the work is consumed, θ is untouched, the version stays.
        state.applied[lease.lease_id] = state.version
        _drop_unused_base_params(state)
        return [Rejected(event.peer, lease.lease_id, adjusted.reason, RefusalCode.DROPPED)]
    retained = _retain_before_step(state)
    info_step = state.optimizer.step(state.params, adjusted.pseudo_gradient, adjusted.lr_scale)
    state.version += 1
    state.local_updates += lease.steps
    state.applied[lease.lease_id] = state.version
    if policy.verify is not None and policy.verify.commit and event.state_end is not None:
        state.verification.chain[event.peer] = event.state_end  # the chain advances with applied leases only
    gate_note = ""
    if verdict is not None and policy.gate is not None:
        update_gate.record(policy.gate, state.gate, verdict, update, lease.steps, event.peer, now)
        gate_note = f"clipped ×{verdict.scale:.3g}: {verdict.reason}" if verdict.action == "clip" else verdict.reason
    _drop_unused_base_params(state)
    verify: list[Action] = []
    if check is not None:
        if check[0] is None:
            state.verification.unverifiable += 1
        else:
            state.verification.pending[lease.lease_id] = event.peer
            verify = [Verify(event.peer, lease, check[0], check[1], lease.verify, "", event.state_start or "", event.state_end or "")]
    return retained + verify + [
        Applied(
            event.peer,
            lease.lease_id,
            state.version,
            staleness,
            lease.steps,
            lease.shard,
            info_step.moved,
            f"{info_step.reason}; {adjusted.reason}",
            gate_note,
        )
    ]


def _broken_chain(state: CoordinatorState, event: SubmitUpdate) -> list[Action] | None:
    """With commitments (``VerifyPolicy.commit``): None when the submission's inner-state digests chain — its start
    digest is the peer's end digest of its last *applied* lease, or the fresh state's (a peer resets its inner state
    when it joins, restarts, or a submission of it was not applied). Otherwise the actions: a submission without
    digests is refused; a broken chain is a failed check — the update is refused and a :class:`Verify` that has
    already failed goes to the verifier, whose ``Verified`` expels the peer and repairs θ like any failed re-run."""
    policy = state.policy.verify
    if policy is None or not policy.commit:
        return None
    if event.state_start is None or event.state_end is None:
        return [Rejected(event.peer, event.lease_id, "this run verifies carried inner state: the submission needs "
                         "state_start and state_end digests; upgrade the peer (asyncloco peer join)", RefusalCode.BROKEN_CHAIN)]
    previous = state.verification.chain.get(event.peer, FRESH_STATE_DIGEST)
    if event.state_start in (previous, FRESH_STATE_DIGEST):
        return None
    lease = state.leases[event.lease_id]
    detail = (f"inner-state chain broken: lease starts from state {event.state_start[:16]}…, the peer's last applied "
              f"lease ended at {previous[:16]}… (and it is not the fresh state)")
    state.verification.pending[lease.lease_id] = event.peer
    empty = torch.empty(0)
    actions: list[Action] = [Rejected(event.peer, lease.lease_id, detail, RefusalCode.BROKEN_CHAIN)]
    actions += _give_back(state, lease, "its inner-state commitment did not chain")
    actions.append(Verify(event.peer, lease, empty, empty, "chain check", detail, event.state_start, event.state_end))
    return actions


def _quarantine(state: CoordinatorState, peer: str, now: float, why: str) -> list[Action]:
    actions: list[Action] = [Quarantined(peer, state.gate.quarantined_until[peer], why)]
    state.held.pop(peer, None)
    for lease in sorted(state.leases.values(), key=lambda l: l.lease_id):
        if lease.peer == peer:
            actions += _give_back(state, lease, "peer quarantined")
    return actions


def new_state(
    params: torch.Tensor,
    optimizer: OuterOptimizer,
    transforms: Sequence[StalenessTransform],
    policy: CoordinatorPolicy,
    shard_sizes: Sequence[int],
    seed: int,
    lease_secret: bytes = b"",
) -> CoordinatorState:
    if params.dim() != 1 or params.dtype != torch.float32:
        raise ValueError("θ must be a flat float32 vector")
    if not shard_sizes or any(size <= 0 for size in shard_sizes):
        raise ValueError(f"every shard needs at least one batch, got sizes {list(shard_sizes)}")
    return CoordinatorState(
        params=params,
        optimizer=optimizer,
        transforms=list(transforms),
        policy=policy,
        shards=[ShardState(int(size)) for size in shard_sizes],
        seed=seed,
        lease_secret=lease_secret,
    )
