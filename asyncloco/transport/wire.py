"""One typed definition per coordinator wire message, used by both ends.

Every message is a frozen dataclass that validates itself on construction (types and bounds of every
field) and converts to and from the msgpack map that travels in a header frame (see
:mod:`asyncloco.transport.framing`): ``to_wire()`` gives the map (optional fields that are ``None`` are
left out), ``from_wire(map)`` refuses a non-map, a missing required field, an unknown field, a value of
the wrong type (``True`` is not an int, ``1`` is not a float) and a value out of bounds, each with a
:class:`~asyncloco.transport.errors.MessageError` (a ProtocolError and a ValueError) that names the field.

| message | RPC, direction | fields |
|---|---|---|
| :class:`AssignRequest` | assign, peer → coordinator | ``kind`` ("config" or "lease"), ``tokens_per_s``?, ``name``?, ``token``?, ``signer``? |
| :class:`HelloReply` | assign (kind "config"), reply | ``config`` (JSON), ``model_numel``, ``codec``, ``download_codec``, ``run_id``, ``software_version`` |
| :class:`LeaseGrant` | inside :class:`LeaseReply` | ``lease_id``, ``base_version``, ``shard``, ``start_offset``, ``steps``, ``lr_offset``, ``batch_size``, ``issued_at``, ``deadline``, ``fresh``?, ``eager_of``?, ``eager_share``? |
| :class:`LeaseReply` | assign (kind "lease"), reply | ``lease``? (a :class:`LeaseGrant` map), ``reason``, ``code``? |
| :class:`ModelRequest` | get_model, peer → coordinator | ``version``?, ``codec``, ``have_version``?, ``anchor_version``? |
| :class:`ModelHeader` | get_model, reply header | ``version``, ``codec``, ``numel``, ``unchanged``, ``delta_from``? |
| :class:`SubmitHeader` | submit, peer → coordinator | ``lease_id``, ``base_version``, ``codec``, ``numel``, ``inner_loss``?, ``state_start``?, ``state_end``?, ``device_class``?, ``theta_codec``?, ``theta_anchor``?, ``theta_digest``?, ``eager_of``? |
| :class:`Ready` | submit, reply to an acceptable header | ``ready`` (always true) |
| :class:`Ack` | submit, final reply | ``accepted``, ``version``, ``reason``, ``duplicate``, ``reveal``?, ``code``?, ``reveal_end``?, ``reveal_start``? |
| :class:`RevealHeader` | reveal, peer → coordinator, then ``size`` bytes | ``lease_id``, ``size`` |
| :class:`RevealReply` | reveal, reply | ``accepted``, ``reason`` |
| :class:`CheckRequest` | verify_task, validator → coordinator | ``wait_s`` |
| :class:`CheckHeader` | verify_task, reply header, then θ_base, the update (fp32) and the revealed state | ``lease_id``?, ``peer``?, lease fields, ``numel``, ``state_start``?, ``state_end``?, ``revealed``?, ``device_class``? |
| :class:`VerdictHeader` | verdict, validator → coordinator | ``lease_id``, ``ok``, ``bitwise``, ``rel_error``?, ``cosine``, ``detail`` |
| :class:`VerdictReply` | verdict, reply | ``accepted``, ``reason`` |

(``?``: optional, may be absent.) Names (:data:`NAME_PATTERN`) are at most 64 characters of
``[A-Za-z0-9_.-]``; ids at most :data:`MAX_ID_CHARS`; reasons at most :data:`MAX_REASON_CHARS`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, Mapping, Optional, Type, TypeVar

from asyncloco.transport.codec_format import CODEC_NAME_MAX
from asyncloco.transport.codecs import CODECS, MAX_NUMEL
from asyncloco.transport.errors import MessageError
from asyncloco.refusals import RefusalCode, code_of

__all__ = [
    "AssignRequest",
    "HelloReply",
    "LeaseGrant",
    "LeaseReply",
    "ModelRequest",
    "ModelHeader",
    "SubmitHeader",
    "Ready",
    "Ack",
    "RevealHeader",
    "RevealReply",
    "CheckRequest",
    "CheckHeader",
    "VerdictHeader",
    "VerdictReply",
    "MAX_REVEAL_BYTES",
    "NAME_PATTERN",
    "DIGEST_PATTERN",
    "MAX_ID_CHARS",
    "MAX_REASON_CHARS",
    "MAX_CONFIG_CHARS",
    "MAX_INNER_LOSS",
]

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")
# a peer's compute class (train/inner.py compute_class: device, model, ISA, torch version) — decides whether a
# verifier compares its lease bitwise or within runtime.verify.cross_device_tolerance
COMPUTE_CLASS_PATTERN = re.compile(r"[A-Za-z0-9 ._+/:()@-]{1,96}")
MAX_ID_CHARS = 128
MAX_REASON_CHARS = 4096
MAX_CONFIG_CHARS = 60_000  # the whole hello reply must fit one 64 KiB header frame
MAX_INNER_LOSS = 1e6
MAX_TOKEN_CHARS = 1024  # admission tokens (coordinator/admission.py) are ~250 characters
MAX_VERSION = 2**62
MAX_COUNT = 2**62
MAX_TOKENS_PER_S = 1e15
MAX_LINK_BYTES_PER_S = 1e15  # as transport/records.py bounds a DHT record's link rates
MAX_REVEAL_BYTES = 2**40  # the wire's own cap; the service bounds each reveal by the model's inner-state size first
MAX_TIME = 1e11  # seconds since the epoch (year ~5138): any real timestamp, no inf
MAX_TRANSFER_S = 1e6  # one body's transfer (the transport's own ceiling per call is hours)

M = TypeVar("M", bound="_Message")


def _check_code(message: Any, name: str) -> None:
    """A reply's optional ``code`` must name a :class:`~asyncloco.refusals.RefusalCode`."""
    code = message.code
    if code is not None and (not isinstance(code, str) or code_of(code) is None):
        raise _fail(name, "code", f"{code!r} is not a refusal code; known: {sorted(c.value for c in RefusalCode)}")


def _fail(message: str, name: str, detail: str) -> MessageError:
    return MessageError(f"{message}.{name}: {detail}")


class _Message:
    """Base of the wire messages: strict ``from_wire`` / ``to_wire`` over the dataclass fields."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()

    def to_wire(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = value.to_wire() if isinstance(value, _Message) else value
        return out

    @classmethod
    def from_wire(cls: Type[M], data: Any) -> M:
        if not isinstance(data, Mapping):
            raise MessageError(f"{cls.__name__} must be a map, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise MessageError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(known)}")
        missing = [name for name in cls.REQUIRED if name not in data]
        if missing:
            raise MessageError(f"{cls.__name__}: missing field(s) {missing}")
        return cls(**cls._convert(dict(data)))

    @classmethod
    def _convert(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return data

    # ---- field checks (raise MessageError naming the message and field)

    def _int(self, name: str, low: int, high: int, optional: bool = False) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(type(self).__name__, name, f"must be an int, got {type(value).__name__}")
        if not low <= value <= high:
            raise _fail(type(self).__name__, name, f"{value} is outside [{low}, {high}]")

    def _float(self, name: str, low: float, high: float, optional: bool = False) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if not isinstance(value, float):
            raise _fail(type(self).__name__, name, f"must be a float, got {type(value).__name__}")
        if not math.isfinite(value) or not low <= value <= high:
            raise _fail(type(self).__name__, name, f"{value!r} is not a finite value in [{low:g}, {high:g}]")

    def _str(self, name: str, max_chars: int, *, pattern: Optional[re.Pattern[str]] = None,
             choices: Optional[tuple[str, ...]] = None, optional: bool = False, empty: bool = True) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if not isinstance(value, str):
            raise _fail(type(self).__name__, name, f"must be a str, got {type(value).__name__}")
        if len(value) > max_chars or (not empty and not value):
            raise _fail(type(self).__name__, name, f"length {len(value)} is outside [{0 if empty else 1}, {max_chars}]")
        if pattern is not None and not pattern.fullmatch(value):
            raise _fail(type(self).__name__, name, f"{value[:80]!r} must match {pattern.pattern}")
        if choices is not None and value not in choices:
            raise _fail(type(self).__name__, name, f"{value[:80]!r} is not one of {choices}")

    def _bool(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise _fail(type(self).__name__, name, f"must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class AssignRequest(_Message):
    """``assign``: ``kind="config"`` asks for the run's :class:`HelloReply`, ``kind="lease"`` for work.
    ``name`` is the volunteer's display name (optional, ≤ 64 chars of ``[A-Za-z0-9_.-]``)."""

    kind: str
    tokens_per_s: Optional[float] = None
    name: Optional[str] = None
    token: Optional[str] = None  # admission token (runtime.admission: token; see coordinator/admission.py)
    signer: Optional[str] = None  # the peer's DHT signing key id, bound to its peer id by the coordinator
    keep: Optional[str] = None  # overlapped rounds: the lease this peer still holds, uploading or training (kept active)
    # the peer's link rates, bytes/s, measured on its real transfers (transport/linkspeed.py), as in its DHT speed
    # record: sent with the request, the lease after a first θ download is sized by them (schedule.local_steps: auto)
    link_up: Optional[float] = None
    link_down: Optional[float] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("kind",)

    def __post_init__(self) -> None:
        self._str("kind", 16, choices=("config", "lease"))
        self._float("tokens_per_s", 0.0, MAX_TOKENS_PER_S, optional=True)
        self._str("name", 64, pattern=NAME_PATTERN, optional=True)
        self._str("token", MAX_TOKEN_CHARS, optional=True)  # admission: format and signature checked by the coordinator
        self._str("signer", MAX_TOKEN_CHARS, optional=True)
        self._str("keep", MAX_ID_CHARS, optional=True)
        self._float("link_up", 0.0, MAX_LINK_BYTES_PER_S, optional=True)
        self._float("link_down", 0.0, MAX_LINK_BYTES_PER_S, optional=True)


@dataclass(frozen=True)
class HelloReply(_Message):
    """The run's description for a joining peer."""

    config: str
    model_numel: int
    codec: str
    download_codec: str
    run_id: str
    software_version: str
    REQUIRED: ClassVar[tuple[str, ...]] = ("config", "model_numel", "codec", "download_codec", "run_id", "software_version")

    def __post_init__(self) -> None:
        self._str("config", MAX_CONFIG_CHARS, empty=False)
        self._int("model_numel", 1, MAX_NUMEL)
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
        self._str("download_codec", CODEC_NAME_MAX, choices=CODECS)
        self._str("run_id", MAX_ID_CHARS, empty=False)
        self._str("software_version", MAX_ID_CHARS)


@dataclass(frozen=True)
class LeaseGrant(_Message):
    """A unit of work: train ``steps`` steps on ``shard`` from θ at ``base_version``. ``fresh`` true (absent
    otherwise): start it from a fresh inner optimizer state and no error-feedback residual — with commitments, the
    coordinator's answer to an uplink that cannot carry a reveal (coordinator/logic/leases.py ``fresh_reason``)."""

    lease_id: str
    base_version: int
    shard: int
    start_offset: int
    steps: int
    lr_offset: int
    batch_size: int
    issued_at: float
    deadline: float
    fresh: Optional[bool] = None
    # the eager start (algo/eager.py): train from θ − eager_share × the update of lease ``eager_of`` (the peer's lease
    # still on its way), as the coordinator decodes it; absent: from θ
    eager_of: Optional[str] = None
    eager_share: Optional[float] = None
    REQUIRED: ClassVar[tuple[str, ...]] = (
        "lease_id", "base_version", "shard", "start_offset", "steps", "lr_offset", "batch_size", "issued_at", "deadline",
    )

    def __post_init__(self) -> None:
        self._str("lease_id", MAX_ID_CHARS, empty=False)
        self._int("base_version", 0, MAX_VERSION)
        self._int("shard", 0, MAX_COUNT)
        self._int("start_offset", 0, MAX_COUNT)
        self._int("steps", 1, MAX_COUNT)
        self._int("lr_offset", 0, MAX_COUNT)
        self._int("batch_size", 1, MAX_COUNT)
        self._float("issued_at", 0.0, MAX_TIME)
        self._float("deadline", 0.0, MAX_TIME)
        if self.fresh is not None:
            self._bool("fresh")
        self._str("eager_of", MAX_ID_CHARS, empty=False, optional=True)
        self._float("eager_share", 0.0, 2.0, optional=True)
        if (self.eager_of is None) != (self.eager_share is None):
            raise _fail("LeaseGrant", "eager_of", "the eager start is eager_of with eager_share, or neither")


@dataclass(frozen=True)
class LeaseReply(_Message):
    """``lease`` or, when there is none, the ``reason``."""

    lease: Optional[LeaseGrant]
    reason: str = ""
    code: Optional[str] = None  # without a lease: a asyncloco/refusals.py RefusalCode value
    REQUIRED: ClassVar[tuple[str, ...]] = ("reason",)

    def __post_init__(self) -> None:
        if self.lease is not None and not isinstance(self.lease, LeaseGrant):
            raise _fail("LeaseReply", "lease", f"must be a LeaseGrant, got {type(self.lease).__name__}")
        self._str("reason", MAX_REASON_CHARS)
        _check_code(self, "LeaseReply")

    @classmethod
    def _convert(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        lease = data.get("lease")
        data["lease"] = None if lease is None else LeaseGrant.from_wire(lease)
        return data


@dataclass(frozen=True)
class ModelRequest(_Message):
    """``get_model``: θ at ``version`` (``None``: the latest) in ``codec``. ``have_version``: the version the
    peer already holds; when it is the one served, the reply carries no body. ``anchor_version``: the
    version whose full encoding in ``codec`` the peer keeps (lossy codecs); the coordinator may answer with
    a delta from it (transport/delta.py)."""

    codec: str
    version: Optional[int] = None
    have_version: Optional[int] = None
    anchor_version: Optional[int] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("codec",)

    def __post_init__(self) -> None:
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
        self._int("version", 0, MAX_VERSION, optional=True)
        self._int("have_version", 0, MAX_VERSION, optional=True)
        self._int("anchor_version", 0, MAX_VERSION, optional=True)


@dataclass(frozen=True)
class ModelHeader(_Message):
    """``get_model`` reply header; ``unchanged=True``: no body follows (the peer holds ``version``),
    else exactly ``wire_bytes(codec, numel)`` body bytes follow: θ at ``version``, or, when ``delta_from``
    is set, θ at ``version`` minus the full encoding of ``delta_from`` (the peer's anchor)."""

    version: int
    codec: str
    numel: int
    unchanged: bool = False
    delta_from: Optional[int] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("version", "codec", "numel", "unchanged")

    def __post_init__(self) -> None:
        self._int("version", 0, MAX_VERSION)
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
        self._int("numel", 1, MAX_NUMEL)
        self._bool("unchanged")
        self._int("delta_from", 0, MAX_VERSION, optional=True)
        if self.delta_from is not None and (self.unchanged or self.codec == "none"):
            raise MessageError("ModelHeader.delta_from: only a body in a lossy codec is a delta")


@dataclass(frozen=True)
class SubmitHeader(_Message):
    """``submit`` header, followed (after :class:`Ready`) by exactly ``wire_bytes(codec, numel)`` bytes.
    ``inner_loss``: the peer's mean inner training loss over the lease (optional, finite, in [0, 1e6]).
    ``state_start`` / ``state_end``: sha256 (hex) of the peer's inner optimizer state before and after the lease
    (train/commitments.py ``inner_state_digest``; optional: peers that do not commit leave them out). ``device_class``: the
    compute class the lease ran on (train/inner.py ``compute_class``; absent: unknown, never compared bitwise)."""

    lease_id: str
    base_version: int
    codec: str
    numel: int
    inner_loss: Optional[float] = None
    state_start: Optional[str] = None
    state_end: Optional[str] = None
    device_class: Optional[str] = None
    # the θ the lease trained from, as the peer decoded it: θ at base_version downloaded in theta_codec, as a delta from
    # the full encoding of theta_anchor (absent: in full), and sha256 (hex) of its fp32 bytes (transport/delta.py
    # decoded_theta, theta_digest); the verifier re-runs a checked lease from that θ (absent: from θ itself)
    theta_codec: Optional[str] = None
    theta_anchor: Optional[int] = None
    theta_digest: Optional[str] = None
    # the lease whose update the start subtracted (LeaseGrant.eager_of; absent: trained from θ itself)
    eager_of: Optional[str] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("lease_id", "base_version", "codec", "numel")

    def __post_init__(self) -> None:
        self._str("lease_id", MAX_ID_CHARS, empty=False)
        self._int("base_version", 0, MAX_VERSION)
        self._str("codec", CODEC_NAME_MAX, choices=CODECS)
        self._int("numel", 1, MAX_NUMEL)
        self._float("inner_loss", 0.0, MAX_INNER_LOSS, optional=True)
        for name in ("state_start", "state_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not DIGEST_PATTERN.fullmatch(value)):
                raise _fail("SubmitHeader", name, f"must be a sha256 digest (64 lowercase hex characters), got {value!r:.80}")
        self._str("device_class", 96, pattern=COMPUTE_CLASS_PATTERN, optional=True)
        self._str("theta_codec", CODEC_NAME_MAX, choices=CODECS, optional=True)
        self._int("theta_anchor", 0, MAX_VERSION, optional=True)
        self._str("theta_digest", 64, pattern=DIGEST_PATTERN, optional=True)
        self._str("eager_of", MAX_ID_CHARS, empty=False, optional=True)
        if (self.theta_codec is None) != (self.theta_digest is None) or (self.theta_anchor is not None and (
                self.theta_codec in (None, "none") or self.theta_anchor == self.base_version)):
            raise _fail("SubmitHeader", "theta_anchor", "θ's provenance is theta_codec with theta_digest, and an anchor "
                        "other than base_version only for a lossy codec")


@dataclass(frozen=True)
class Ready(_Message):
    """The service accepts a submit header; the client may send the body."""

    ready: bool = True
    REQUIRED: ClassVar[tuple[str, ...]] = ("ready",)

    def __post_init__(self) -> None:
        if self.ready is not True:
            raise _fail("Ready", "ready", f"must be true, got {self.ready!r}")


@dataclass(frozen=True)
class Ack(_Message):
    """The coordinator's verdict on a submission (``duplicate``: an already applied lease, resent). ``reveal``
    (commitments): the lease was chosen for verification after its submission — send its start inner state
    with the ``reveal`` RPC (:class:`RevealHeader`) before ``runtime.verify.reveal_timeout``; absent otherwise.
    ``reveal_end`` false: the start state alone (an empty end part) — the coordinator re-runs the check itself on the
    peer's compute class, so its re-run's end state is compared with the committed digest bitwise and the peer's end
    state would be unused bytes; absent: both parts. ``reveal_start`` false: an empty start part — the coordinator
    has that state already (the end state of the peer's previous lease, revealed or re-run for its own check:
    coordinator/chained.py); absent: the start part. ``received_s``: the seconds the body took to arrive, as the
    service measured it (transport/rpc.py; the coordinator's work on it is not in it): the peer's uplink sample."""

    accepted: bool
    version: int
    reason: str
    duplicate: bool = False
    reveal: Optional[bool] = None
    code: Optional[str] = None  # a refused submission: a asyncloco/refusals.py RefusalCode value
    reveal_end: Optional[bool] = None
    reveal_start: Optional[bool] = None
    received_s: Optional[float] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("accepted", "version", "reason", "duplicate")

    def __post_init__(self) -> None:
        self._bool("accepted")
        self._int("version", 0, MAX_VERSION)
        self._str("reason", MAX_REASON_CHARS)
        self._bool("duplicate")
        if self.reveal is not None:
            self._bool("reveal")
        if self.reveal_end is not None:
            self._bool("reveal_end")
        if self.reveal_start is not None:
            self._bool("reveal_start")
        self._float("received_s", 0.0, MAX_TRANSFER_S, optional=True)
        _check_code(self, "Ack")


@dataclass(frozen=True)
class RevealHeader(_Message):
    """``reveal`` header (commitments; docs/threat-model.md): the peer's inner optimizer state at the start
    of lease ``lease_id``, in the canonical layout of train/commitments.py ``inner_state_chunks`` (raw little-endian bytes,
    never unpickled), follows as ``size`` body bytes (0: the fresh state, no body). The service refuses a ``size``
    above the model's inner-state size before reading or allocating anything."""

    lease_id: str
    size: int
    REQUIRED: ClassVar[tuple[str, ...]] = ("lease_id", "size")

    def __post_init__(self) -> None:
        self._str("lease_id", MAX_ID_CHARS, empty=False)
        self._int("size", 0, MAX_REVEAL_BYTES)


@dataclass(frozen=True)
class RevealReply(_Message):
    """The coordinator took the revealed state for verification (``accepted``), or why not (``reason``)."""

    accepted: bool
    reason: str
    REQUIRED: ClassVar[tuple[str, ...]] = ("accepted", "reason")

    def __post_init__(self) -> None:
        self._bool("accepted")
        self._str("reason", MAX_REASON_CHARS)


# --------------------------------------------------------------------------- validator peers

MAX_CHECK_WAIT_S = 600.0


@dataclass(frozen=True)
class CheckRequest(_Message):
    """``verify_task``: a validator peer (asyncloco/validator.py) asks for a pending check, waiting at most ``wait_s``
    seconds for one."""

    wait_s: float
    REQUIRED: ClassVar[tuple[str, ...]] = ("wait_s",)

    def __post_init__(self) -> None:
        self._float("wait_s", 0.0, MAX_CHECK_WAIT_S)


@dataclass(frozen=True)
class CheckHeader(_Message):
    """``verify_task`` reply: a check lent to the validator, or none (``lease_id`` absent: nothing pending). With a
    check, three bodies follow: θ at the lease's base version and the update as submitted (decoded, before any
    clipping), each ``4 × numel`` bytes of little-endian fp32, then ``revealed`` bytes of the peer's revealed start
    inner state (absent: re-run from a fresh state; 0: the committed fresh state). ``device_class``: the compute class
    the peer named for the lease (absent: unknown)."""

    numel: int
    lease_id: Optional[str] = None
    peer: Optional[str] = None
    base_version: Optional[int] = None
    shard: Optional[int] = None
    start_offset: Optional[int] = None
    steps: Optional[int] = None
    lr_offset: Optional[int] = None
    state_start: Optional[str] = None
    state_end: Optional[str] = None
    revealed: Optional[int] = None
    device_class: Optional[str] = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("numel",)

    def __post_init__(self) -> None:
        self._int("numel", 1, MAX_NUMEL)
        self._str("lease_id", MAX_ID_CHARS, optional=True, empty=False)
        self._str("peer", MAX_ID_CHARS, optional=True, empty=False)
        for name in ("base_version", "shard", "start_offset", "lr_offset"):
            self._int(name, 0, MAX_VERSION, optional=True)
        self._int("steps", 1, MAX_COUNT, optional=True)
        for name in ("state_start", "state_end"):
            self._str(name, 64, pattern=DIGEST_PATTERN, optional=True)
        self._int("revealed", 0, MAX_REVEAL_BYTES, optional=True)
        self._str("device_class", 96, pattern=COMPUTE_CLASS_PATTERN, optional=True)
        lease = ("peer", "base_version", "shard", "start_offset", "steps", "lr_offset")
        if self.lease_id is not None and any(getattr(self, name) is None for name in lease):
            raise _fail("CheckHeader", "lease_id", f"a check needs all of {lease}")

    @property
    def empty(self) -> bool:
        return self.lease_id is None


@dataclass(frozen=True)
class VerdictHeader(_Message):
    """``verdict``: the validator's judgement of the check it was lent (coordinator/verify.py ``Comparison``)."""

    lease_id: str
    ok: bool
    bitwise: bool
    cosine: float
    detail: str
    rel_error: Optional[float] = None  # None: infinite (no comparable re-run)
    REQUIRED: ClassVar[tuple[str, ...]] = ("lease_id", "ok", "bitwise", "cosine", "detail")

    def __post_init__(self) -> None:
        self._str("lease_id", MAX_ID_CHARS, empty=False)
        self._bool("ok")
        self._bool("bitwise")
        self._float("cosine", -1.0, 1.0)
        self._str("detail", MAX_REASON_CHARS)
        self._float("rel_error", 0.0, 1e300, optional=True)


@dataclass(frozen=True)
class VerdictReply(_Message):
    """The coordinator took the verdict (``accepted``), or why not (``reason``: not lent to this validator, late)."""

    accepted: bool
    reason: str
    REQUIRED: ClassVar[tuple[str, ...]] = ("accepted", "reason")

    def __post_init__(self) -> None:
        self._bool("accepted")
        self._str("reason", MAX_REASON_CHARS)
