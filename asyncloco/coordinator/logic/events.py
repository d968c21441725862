"""The events ``handle`` takes and the actions it returns: one frozen dataclass each. The write-ahead log
stores events by class name and field (coordinator/wal.py); the daemon carries out the actions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from asyncloco.coordinator.logic.state import Lease
from asyncloco.refusals import RefusalCode


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
    # the peer's link, measured on its real transfers (θ downloads, pseudo-gradient uploads: transport/linkspeed.py),
    # and its wall seconds since its first lease request split by what it did (peer/summary.py): computing, uploading,
    # downloading, wall (None: not reported). Link rates size leases (schedule.local_steps: auto); the split is shown
    link_up: float | None = None  # bytes per second
    link_down: float | None = None
    time_split: tuple[float, float, float, float] | None = None


@dataclass(frozen=True)
class Hello:
    """A peer introduces itself over its authenticated RPC: binds its DHT signing key and name."""

    peer: str
    signer: str | None = None
    name: str = ""
    units_per_second: float | None = None


@dataclass(frozen=True)
class RequestWork:
    """A peer asks for a lease. ``keep``: the one lease it still holds — its update uploading (overlapped rounds: it
    asks for its next lease when training ends, before its upload completes), or still training (asking ahead on a
    slow link: peer/pipeline.py) — that lease stays active and the peer is never held for its own update; any other
    lease of the peer is given back as abandoned."""

    peer: str
    keep: str = ""
    # the peer's link rates (bytes/s) as its request stated them, like a speed report's (None: not stated)
    link_up: float | None = None
    link_down: float | None = None


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
    # lease's start and end (train/commitments.py inner_state_digest); None from peers that do not commit
    state_start: str | None = None
    state_end: str | None = None
    # the compute class the peer says the lease ran on (train/inner.py compute_class): a verifier of the same class
    # compares bitwise, of another within runtime.verify.cross_device_tolerance; None: unknown (another class)
    device_class: str | None = None
    # the θ the lease trained from, as the peer says it decoded it (transport/wire.py SubmitHeader): θ at base_version
    # downloaded in theta_codec, a delta from the full encoding of theta_anchor (None: in full), with the sha256 of its
    # fp32 bytes; a check re-runs from that θ (coordinator/rerun.py start_theta). None: from θ itself
    theta_codec: str | None = None
    theta_anchor: int | None = None
    theta_digest: str | None = None
    # the eager start (algo/eager.py): the lease whose update the peer's start subtracted (Lease.eager_of); None: it
    # trained from θ itself
    eager_of: str | None = None


@dataclass(frozen=True)
class Restarted:
    """The coordinator restarted (``--resume``): held requests died with their RPCs, and the peers get
    ``grace_s`` to call again before their silence counts; a lease whose θ was not downloaded gets its whole time
    again from the restart, any other its slack and transfer allowance again (at least ``grace_s``) to be delivered."""

    grace_s: float


@dataclass(frozen=True)
class Reconfigured:
    """A ``--resume`` under a config that decides differently (its policy, the outer optimizer's or the staleness
    transforms' hyper-parameters): ``decisions`` (state.py ``decision_record``, as JSON) decide from here on. The log
    before this record is replayed with what decided it, recorded in the snapshots and in earlier such records."""

    decisions: str


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
class Unverified:
    """The check of lease ``lease_id`` of ``peer`` ends without a verdict (coordinator/verify.py): the verification
    queue was full, the re-run failed, or a coordinator restart lost the ack that asked for the peer's reveal.
    Counted as unverifiable; the check no longer counts toward the peer's probation as one on its way. A held update
    (logic/submit.py) is dropped — no verdict, no application — unless ``apply``: the coordinator's own restart lost
    the check, which the peer cannot cause (its honest work is not thrown away for it)."""

    peer: str
    lease_id: str
    reason: str
    apply: bool = False


@dataclass(frozen=True)
class Discard:
    """Void ``peer``'s update for ``lease_id``: the lease is consumed (its batches count as used, as for an update a
    staleness policy drops), θ is untouched. Only the repair's replay feeds it (coordinator/verify.py)."""

    peer: str
    lease_id: str
    # the submission's committed end state: the peer's commitment chain advances as it did when the live run took the
    # submission (else its next lease would not chain in the replay)
    state_end: str | None = None


@dataclass(frozen=True)
class Repaired:
    """What the repair after an expulsion (``expelled``: every peer expelled so far) decided beyond the replay itself (coordinator/repair.py): which
    leases stayed valid (``kept``, each at the live base version ``kept_versions`` its peer names; every other one
    is given back), θ's version after the jump, the lease counter, and the inner-state commitment chain of the peers
    not expelled (``chain_peers`` → ``chain_digests``). The daemon logs it after the ``Verified`` that expelled the
    peer: a *later* repair, replaying the log across this point, must give back the same leases and jump at the same
    place — without it the later replay kept leases the live run had voided, numbered the leases their peers asked for
    again differently and refused honest updates the live run had applied. Handling it twice changes nothing."""

    expelled: tuple[str, ...]
    version: int
    lease_counter: int
    kept: tuple[str, ...]
    kept_versions: tuple[int, ...]
    chain_peers: tuple[str, ...]
    chain_digests: tuple[str, ...]
    # live leases the replay never issued (its grace windows held their requests instead), each as ADOPTED_FIELDS:
    # adopted with the work its peer has when its shard range is still free after the give-backs (absent in older logs)
    adopted: tuple[tuple[Any, ...], ...] = ()
    # the remedy the live repair installed ("rerun": honest re-runs in the expelled peer's place, "discard": left
    # out), chosen by validation loss (coordinator/verify.py); a --resume replay repeats it ("": older logs)
    remedy: str = ""


ADOPTED_FIELDS = ("lease_id", "peer", "shard", "start_offset", "steps", "lr_offset", "base_version", "issued_at",
                  "expected_finish", "deadline", "fetched", "held", "fetched_at")  # (older logs: without fetched_at)


Event = Union[
    SpeedReport, Hello, RequestWork, Fetched, SubmitUpdate, Tick, PeerLeft, Restarted, Admit, Revoke, HoldDropped,
    Verified, Unverified, Discard, Fingerprint, Repaired, Reconfigured,
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
    sketch: float | None = None  # the update's persistent-residual score (coordinator/sketch.py), None when not scored


@dataclass(frozen=True)
class Held:
    """A submission of a lease chosen for a check is accepted but held until its re-run agrees (logic/submit.py): it
    is applied (an :class:`Applied` from the :class:`Verified` event) only then, and never if the check fails. The peer
    is told it was accepted; ``version`` is θ's version now (unchanged by it)."""

    peer: str
    lease_id: str
    version: int
    reason: str
    sketch: float | None = None  # the update's persistent-residual score (coordinator/sketch.py)


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
    device_class: str = ""  # the compute class the peer named ("" unknown): decides the comparison's tolerance
    # the θ the peer says it decoded (SubmitUpdate's theta_*; "" codec: θ itself), and — attached by the daemon when the
    # check is queued (coordinator/verify.py), not by the logic — the full encoding of theta_anchor that a delta was
    # added to: the re-run starts from that θ, rebuilt bit for bit (transport/delta.py decoded_theta)
    theta_codec: str = ""
    theta_anchor: int | None = None
    theta_digest: str = ""
    anchor_body: bytes | None = None
    # the eager start (algo/eager.py): with ``lease.eager_of`` set the peer started from θ − lease.eager_share × this,
    # the update of that lease as submitted; the re-run does the same (rerun.py start_theta). None with eager_of set:
    # not at hand (a restart, a repair): the check ends unverified
    eager: torch.Tensor | None = None


@dataclass(frozen=True)
class Verdict:
    peer: str
    lease_id: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Expelled:
    """``peer`` failed a verification: it is out of the run for good. Where θ holds updates of it applied without a
    check (``repair``), the daemon repairs θ: the log is replayed without them (coordinator/verify.py, ``repair``);
    its held updates are never applied."""

    peer: str
    lease_id: str
    reason: str
    anchor: int = -1  # the Verified event's: the log record the daemon's repair replays from
    # whether θ holds an update of the peer that was applied without a check (a held update never counts): only then
    # is there anything for a repair to take out
    repair: bool = True


Action = Union[
    Assign, Hold, Applied, Held, Duplicate, Rejected, Expired, Admitted, Refused, Revoked, Quarantined, Released, Left, Notice,
    Verify, Verdict, Expelled, Incompatible,
]
