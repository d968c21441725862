"""The coordinator's state: leases, shards, peers, the policy, verification and admission records, and the
derived indexes (rebuilt, never checkpointed). Part of the pure logic (coordinator/logic/__init__.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from asyncloco.algo.outer import OuterOptimizer
from asyncloco.algo.staleness import StalenessTransform
from asyncloco.coordinator.gate import GatePolicy, GateState
from asyncloco.coordinator.gate_state import OWN_BUCKETS, OWN_PARTS_MAX, OWN_SAMPLED
from asyncloco.coordinator.sketch import Sketcher, SketchState


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
    # the peer held θ(base_version) when the lease was issued (its prefetch of the newest θ): it may train without a
    # download, so a repair keeps it like a fetched one. Not ``fetched``: θ stays retained in case it downloads anyway
    held: bool = False
    # when the peer's download of θ(base_version) completed (None: not seen): its training starts no earlier, so the
    # observed speed counts from then — on a slow link the download is not compute (leases were sized 2.6× short)
    fetched_at: float | None = None
    # starts from a fresh inner state and no error-feedback residual (VerifyPolicy.fresh_below: its peer's uplink
    # cannot carry a reveal): its check re-runs from θ and the data, nothing revealed; sent to the peer
    fresh: bool = False
    # the eager start (algo/eager.py): the peer's lease still out at this one's issue (its update is not in this lease's
    # θ) and the share s of it the start subtracts; sent to the peer. ``eager_ready``: the coordinator accepted that
    # lease's update (applied, or held for its check) — a submission that used the shift is refused until then
    eager_of: str = ""
    eager_share: float = 0.0
    eager_ready: bool = False

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
    fetched_version: int = -1  # the newest θ version it downloaded (its prefetch included): a lease at it is fetched
    # its link as it measured it (bytes per second up and down, SpeedReport) and its time split (seconds computing,
    # uploading, downloading, and its wall seconds): status.json's per-peer "time_split"
    link_up: float | None = None
    link_down: float | None = None
    time_split: tuple[float, float, float, float] | None = None
    # when its last upload began (its submission's arrival less the upload's seconds): a lease asked for ahead, while
    # the previous one still trained, starts training no earlier (the observed speed counts from then)
    upload_started: float | None = None
    # the compute class its last submission named (train/inner.py compute_class; "" none yet), and whether its next
    # lease carries its inner state despite a slow uplink: the last one granted is re-run here (leases.draw_carry)
    device_class: str = ""
    carry_next: bool = False


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
    # schedule.local_steps: auto sizes a lease from the claim capped at this × the delivered throughput: a pipelined peer
    # on a slow link delivers at its link's pace, not its device's (home150: 0.38 × its compute), so the 1.5 cap made
    # leases too short to cover the transfers, and shorter leases lowered the delivered pace further. A liar gains
    # at most this factor in its own lease's steps (bounded by max_auto_steps; the gate clips the update's norm)
    link_speed_cap_factor: float = 4.0
    max_clock_skew: float = 5.0  # a speed report stamped further in the future than this is refused
    peer_timeout: float = math.inf  # a peer without lease that is silent this long has left
    hold_limit: float = math.inf  # a request held longer than this is answered "ask again"
    max_lease_s: float = math.inf  # cap on a lease's deadline: a peer claiming to be slow holds nothing for years
    transfer_allowance_s: float = 0.0  # added to a lease's deadline for θ down + Δ up, until measured per peer
    download_upload_ratio: float = 1.0  # bytes of a θ download ÷ bytes of an upload (the two codecs)
    # schedule.local_steps: auto — leases sized so that a peer's compute covers its transfers (algo/dylu.py link_steps)
    link_steps: bool = False
    transfer_cover: float = 1.0  # k
    max_auto_steps: int = 0  # H_max
    # schedule.eager_start: s; a lease granted while its peer's previous lease is still out starts from θ − s × that
    # lease's update (algo/eager.py); 0: off
    eager_share: float = 0.0
    upload_bytes: int = 0  # bytes of one upload and of one θ download (the codecs' sizes for the model)
    download_bytes: int = 0
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
    sketch_threshold: float = 1.0  # a persistent residual beyond this cosine makes a suspect (coordinator/sketch.py; 1: off)
    sketch_checks: int = 2  # its next leases re-run, this many
    # a sampled (drawn) check holds its update only while fewer checks than this await their verdicts; otherwise the
    # update is applied at once and checked later (a failed check then repairs θ). 0 (config.py's default): drawn checks
    # are applied first. Probation and suspects' checks are always held.
    hold_backlog: int = 0
    # a peer with a probation or suspect update held gets no further lease until its verdict (leases.held_untrusted)
    serial_probation: bool = False
    # a peer's held updates that reach θ at one verdict each take 1/k of an outer step (submit.release_at_verdict)
    average_released: bool = True
    # with commit: a peer whose reported uplink (bytes/s) is below this gets leases that start fresh (Lease.fresh) —
    # max(2 × the RPC floor, one inner state's bytes / runtime.verify.fresh_start_reveal_s), set by the daemon; 0: never
    fresh_below: float = 0.0
    # the compute class of this coordinator's own re-runs when it keeps their end states (runtime.verify.local, no
    # validators, a state within keep_states_mb; set by the daemon), "" otherwise: a slow-uplink peer of that class
    # carries its inner state into a lease after one that is re-run here (leases.carries_checked)
    keep_class: str = ""
    # runtime.verify.slow_uplink_carry: the share of such a peer's leases, drawn, that carry its state (its previous
    # lease then re-run whether drawn or not)
    slow_carry: float = 0.0
    # runtime.verify.carry_backlog_mb: no carry drawn while the updates and base θs kept for the peer's checks awaiting
    # their verdicts take this many bytes or more
    carry_backlog_bytes: int = 4096 << 20
    # runtime.verify.eager_keep_mb: no eager start granted while the updates kept for checked leases' eager starts take
    # this many bytes (VerificationState.eager)
    eager_keep_bytes: int = 4096 << 20


FRESH_STATE_DIGEST = hashlib.sha256(b"asyncloco inner state v1: fresh").hexdigest()
"""The commitment to a fresh inner optimizer state; the same value as train/commitments.py's (which computes the digests)."""


@dataclass(eq=False)
class HeldUpdate:
    """A submission of a lease chosen for a check, accepted but held until its verdict (:class:`VerificationState`
    ``held``): applied to θ when its re-run agrees, never when it does not. ``update`` is the pseudo-gradient as
    submitted, ``scale`` the gate's clip factor (1.0 without a gate), ``verdict`` the gate's verdict as a dict of its
    fields (recorded into the gate's statistics only when the update is applied), ``base`` θ at the lease's base
    version (what a staleness transform that needs θ_base reads at application)."""

    lease: Lease
    update: torch.Tensor
    base: torch.Tensor
    scale: float
    submitted_at: float
    verdict: dict[str, Any] | None = None
    # what its check needs besides the tensors (a check a restart finds unjudged is rebuilt from them)
    state_start: str = ""
    state_end: str = ""
    device_class: str = ""
    # the θ the peer says it decoded (SubmitUpdate's theta_*): "" codec for θ itself
    theta_codec: str = ""
    theta_anchor: int | None = None
    theta_digest: str = ""
    eager: torch.Tensor | None = None  # the update its eager start subtracted (events.py Verify.eager)

    def state_dict(self) -> dict[str, Any]:
        return {"lease": self.lease.to_dict(), "update": self.update, "base": self.base, "scale": self.scale,
                "submitted_at": self.submitted_at, "verdict": None if self.verdict is None else dict(self.verdict),
                "state_start": self.state_start, "state_end": self.state_end, "device_class": self.device_class,
                "theta_codec": self.theta_codec, "theta_anchor": self.theta_anchor, "theta_digest": self.theta_digest,
                "eager": self.eager}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "HeldUpdate":
        verdict = state.get("verdict")
        return cls(Lease(**state["lease"]), state["update"], state["base"], float(state["scale"]),
                   float(state["submitted_at"]), None if verdict is None else dict(verdict),
                   str(state.get("state_start", "")), str(state.get("state_end", "")), str(state.get("device_class", "")),
                   str(state.get("theta_codec", "")), state.get("theta_anchor"), str(state.get("theta_digest", "")),
                   state.get("eager"))


@dataclass
class VerificationState:
    """Verdicts so far (checkpointed with the state)."""

    passed: dict[str, int] = field(default_factory=dict)  # peer -> its updates whose re-run matched
    expelled: dict[str, str] = field(default_factory=dict)  # peer -> why (the failed lease and the comparison)
    pending: dict[str, str] = field(default_factory=dict)  # lease id -> peer: applied, re-run not yet judged
    checked: int = 0
    failed: int = 0
    unverifiable: int = 0  # chosen leases never judged: base θ no longer retained, queue full, re-run failed, restart (Unverified)
    chain: dict[str, str] = field(default_factory=dict)  # peer -> inner-state digest at the end of its last accepted lease
    # lease id -> a checked lease's update, accepted and held until its verdict (applied only if its re-run agrees)
    held: dict[str, HeldUpdate] = field(default_factory=dict)
    # peer -> its updates applied to θ without a check before them: what a repair has to take out if it is expelled
    unchecked: dict[str, int] = field(default_factory=dict)
    dropped: int = 0  # held updates never applied: their check failed, or ended without a verdict
    sketch: SketchState = field(default_factory=SketchState)  # per peer: its updates' residual sketch (sleepers)
    # lease id -> a drawn check's update applied before its verdict (the verifier was behind: submit.py
    # _apply_then_check), with θ at its base: kept until the verdict, so a restart re-runs the check from the snapshot
    applied_first: dict[str, HeldUpdate] = field(default_factory=dict)
    # lease id -> the accepted update that a live checked lease's eager start subtracts (submit.py _note_eager): one
    # θ-sized tensor per such lease, kept until its submission takes it into its check (or the lease ends)
    eager: dict[str, torch.Tensor] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "passed": dict(self.passed), "expelled": dict(self.expelled), "pending": dict(self.pending),
            "checked": self.checked, "failed": self.failed, "unverifiable": self.unverifiable, "chain": dict(self.chain),
            "held": {k: v.state_dict() for k, v in self.held.items()}, "unchecked": dict(self.unchecked),
            "dropped": self.dropped, "sketch": self.sketch.state_dict(),
            "applied_first": {k: v.state_dict() for k, v in self.applied_first.items()},
            "eager": dict(self.eager),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "VerificationState":
        return cls(
            {k: int(v) for k, v in state["passed"].items()}, {k: str(v) for k, v in state["expelled"].items()},
            {k: str(v) for k, v in state["pending"].items()}, int(state["checked"]), int(state["failed"]),
            int(state["unverifiable"]), {k: str(v) for k, v in state.get("chain", {}).items()},
            {k: HeldUpdate.from_state_dict(v) for k, v in state.get("held", {}).items()},
            {k: int(v) for k, v in state.get("unchecked", {}).items()}, int(state.get("dropped", 0)),
            SketchState.from_state_dict(state.get("sketch", {})),
            {k: HeldUpdate.from_state_dict(v) for k, v in state.get("applied_first", {}).items()},
            dict(state.get("eager", {})),
        )


@dataclass
class AdmissionRecord:
    """A peer admitted by a token (``runtime.admission: token``), bound on first use."""

    token_id: str
    name: str
    expires_at: float
    admitted_at: float


@dataclass
class LeaseBook:
    """What per-event decisions need to know about the active leases, without a scan over all of them.

    Derived from ``state.leases`` and never checkpointed: rebuilt in O(n) whenever the table it was built
    from is replaced (a checkpoint load, a replay) or its size disagrees with the table's (a change made
    outside indexes.py's :func:`index_lease` / :func:`unindex_lease`), so a state restored from a snapshot
    answers exactly as the state it was taken from. Issuing and removing a lease cost O(1)."""

    table: dict[str, Lease]
    count: int
    by_peer: dict[str, dict[str, None]]  # peer -> its lease ids, in issue order
    by_version: dict[int, dict[str, None]]  # base version -> lease ids that may still need θ(version)
    in_flight: list[int]  # per shard: steps of its active leases (Eq. 2's learned progress = assigned − this)


@dataclass
class DerivedIndexes:
    """The logic's derived indexes of a :class:`CoordinatorState` (never checkpointed, never compared): the sorted lease
    indexes, the lease book and the speed heap (indexes.py). Each remembers the table it was built from and is rebuilt
    when that table is replaced (a checkpoint load, a replay)."""

    lease_indexes: dict[str, tuple[dict[str, Lease], list[tuple[float, str]]]] = field(default_factory=dict)
    lease_book: "LeaseBook | None" = None
    speed_heap: tuple[dict[str, PeerInfo], list[tuple[float, str]]] | None = None
    sketcher: Sketcher | None = None  # the run's update sketch (coordinator/sketch.py), built on first use
    own_sketcher: Sketcher | None = None  # the gate's sketch of each peer's last update (CoordinatorState.own_sketcher)


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

    def own_sketcher(self) -> Sketcher | None:
        """The gate's secret sketch of each peer's last update in its reference, for θ above ``OWN_PARTS_MAX`` values
        (gate_state.py :func:`own_cosine`; below, the parts are kept whole: None). Derived from the run secret, like
        the lease ids: a peer cannot aim at its buckets; a replay builds the same one."""
        numel = self.params.numel()
        if numel <= OWN_PARTS_MAX:
            return None
        sketcher = self.indexes.own_sketcher
        if sketcher is None or sketcher.numel != numel:
            secret = self.lease_secret + b"/gate-own/" + str(self.seed).encode()
            sketcher = self.indexes.own_sketcher = Sketcher(secret, numel, OWN_BUCKETS, OWN_SAMPLED)
        return sketcher

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
            "decisions": decision_record(self),
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
        if "decisions" in state:  # the log after this snapshot was decided with these (older snapshots: the config's)
            install_decisions(self, state["decisions"])
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


# ------------------------------------------------------------------------------------ what decides


def _plain(value: Any) -> Any:
    """``value`` as JSON would give it back (tuples as lists, ∞ kept): records compare equal however they were made."""
    return json.loads(json.dumps(value))


def policy_record(policy: CoordinatorPolicy) -> dict[str, Any]:
    """The policy as plain values: its gate and verification policies as dicts, the allowlist sorted."""
    record = dataclasses.asdict(policy)
    record["allowlist"] = sorted(policy.allowlist)
    return _plain(record)


def policy_from_record(record: dict[str, Any]) -> CoordinatorPolicy:
    """:func:`policy_record` back as the policy (a field this version does not know is refused)."""
    values = dict(record)
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(CoordinatorPolicy)})
    if unknown:
        raise ValueError(f"a recorded coordinator policy has fields this version does not know: {unknown}")
    gate, verify = values.get("gate"), values.get("verify")
    values["gate"] = None if gate is None else GatePolicy(**gate)
    values["verify"] = None if verify is None else VerifyPolicy(**verify)
    values["allowlist"] = frozenset(values.get("allowlist", ()))
    return CoordinatorPolicy(**values)


def decision_record(state: CoordinatorState) -> dict[str, Any]:
    """What decides besides the state's own values, as plain values: the policy and the hyper-parameters of the outer
    optimizer and of the staleness transforms. A snapshot records it, so that the log after it is replayed as it was
    decided (a ``--resume``, a repair's replay); a change at a ``--resume`` is a ``Reconfigured`` event."""
    return _plain({
        "policy": policy_record(state.policy),
        "optimizer": {"name": state.optimizer.name, "settings": state.optimizer.settings()},
        "transforms": [{"name": t.name, "settings": t.settings()} for t in state.transforms],
    })


def decision_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``"path: old -> new"`` for each value that differs between two :func:`decision_record`\\ s."""
    changes: list[str] = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            a, b = dict(enumerate(a)), dict(enumerate(b))
        if isinstance(a, dict) and isinstance(b, dict):
            changes += decision_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {json.dumps(a)} -> {json.dumps(b)}")
    return changes


def install_decisions(state: CoordinatorState, record: dict[str, Any]) -> list[str]:
    """Make ``record`` (a :func:`decision_record`) what decides for ``state``: a snapshot's at a load, a
    ``Reconfigured`` event's at a ``--resume`` that changed them. The optimizer and transforms keep their state (rebuilt
    with the recorded hyper-parameters); their kinds cannot change within a run. Returns what changed."""
    current = decision_record(state)
    kinds = (record["optimizer"]["name"], [t["name"] for t in record["transforms"]])
    if kinds != (state.optimizer.name, [t.name for t in state.transforms]):
        raise ValueError(
            f"this run's outer optimizer and staleness transforms are {kinds[0]!r} {kinds[1]}; the config makes them "
            f"{state.optimizer.name!r} {[t.name for t in state.transforms]}. They cannot change within a run: resume "
            "with the run's schedule.method and staleness settings, or start a new run (asyncloco export keeps θ)"
        )
    if record["optimizer"] != current["optimizer"]:
        optimizer = type(state.optimizer)(**record["optimizer"]["settings"])
        optimizer.load_state_dict(state.optimizer.state_dict())
        state.optimizer = optimizer
    for i, (transform, wanted) in enumerate(zip(list(state.transforms), record["transforms"])):
        if wanted != current["transforms"][i]:
            rebuilt = type(transform)(**wanted["settings"])
            rebuilt.load_state_dict(transform.state_dict())
            state.transforms[i] = rebuilt
    state.policy = policy_from_record(record["policy"])
    return decision_changes(current, decision_record(state))
