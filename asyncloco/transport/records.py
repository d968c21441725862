"""Signed, schema-checked DHT records of one run: the coordinator announcement and per-peer speeds.

Layout (``run_id`` is the DHT key prefix; hivemind hashes ``f"{run_id}_{field}"`` into the key):

- ``{run_id}_speed``: a dictionary with one subkey per peer; the subkey is that peer's RSA public key
  (``[owner:...]``), so :class:`hivemind.dht.crypto.RSASignatureValidator` accepts a change only when it
  is signed by the owner: nobody can overwrite another peer's report.
- ``{run_id}_coordinator``: same structure, one subkey per announcing key. Anyone *can* announce, so
  :meth:`RunRecords.find_coordinator` keeps only records whose ``peer_id`` equals the pinned coordinator
  peer id (from the run config / initial multiaddr), and optionally only those signed by a pinned key.

Every DHT node of the run must install the same validators (construct :class:`RunRecords` on each; it
is what makes a node refuse forged or schema-invalid stores and drop them from lookups).

Trust note: the RSA key that signs a record is not the libp2p identity, so ``peer_id`` inside a value is
a claim. A key can only overwrite its own record; two keys claiming one peer id are reported (the
freshest wins in :meth:`read_speeds`, a warning is logged). Anything that changes the model uses the
authenticated peer id of the RPC stream (``context.remote_id``), never these claims.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import BaseModel, Extra, ValidationError, StrictFloat, confloat, conint, conlist, constr

from asyncloco.transport.codecs import CODECS

logger = logging.getLogger(__name__)

__all__ = ["SpeedRecord", "CoordinatorAnnouncement", "RunRecords", "key_fingerprint"]

_PEER_ID = constr(strict=True, min_length=1, max_length=128)
_SHORT_TEXT = constr(strict=True, max_length=128)
_CODEC = constr(strict=True, regex="^(" + "|".join(CODECS) + ")$")


# The value schemas use pydantic.v1 (what hivemind's SchemaValidator takes); mypy cannot read v1's
# constr()/conint()/confloat()/conlist() calls as annotations, hence the ignore[valid-type] below.
class _SpeedValue(BaseModel):
    peer_id: _PEER_ID  # type: ignore[valid-type]
    tokens_per_s: confloat(strict=True, ge=0.0, lt=1e15)  # type: ignore[valid-type]  # rejects NaN and inf
    device: _SHORT_TEXT  # type: ignore[valid-type]
    software_version: _SHORT_TEXT  # type: ignore[valid-type]
    last_seen: StrictFloat
    # the peer's link as measured on its real transfers, bytes per second (absent: not measured yet)
    link_up: Optional[confloat(strict=True, gt=0.0, lt=1e15)] = None  # type: ignore[valid-type]
    link_down: Optional[confloat(strict=True, gt=0.0, lt=1e15)] = None  # type: ignore[valid-type]
    # seconds computing, uploading, downloading, and its wall seconds since its first lease request
    time_split: Optional[conlist(confloat(strict=True, ge=0.0, lt=1e12), min_items=4, max_items=4)] = None  # type: ignore[valid-type]

    class Config:
        extra = Extra.forbid


class _CoordinatorValue(BaseModel):
    peer_id: _PEER_ID  # type: ignore[valid-type]
    multiaddrs: conlist(constr(strict=True, min_length=1, max_length=256), min_items=1, max_items=16)  # type: ignore[valid-type]
    run_id: _SHORT_TEXT  # type: ignore[valid-type]
    model_numel: conint(strict=True, ge=1)  # type: ignore[valid-type]
    codec: _CODEC  # type: ignore[valid-type]
    version: conint(strict=True, ge=0)  # type: ignore[valid-type]
    timestamp: StrictFloat

    class Config:
        extra = Extra.forbid


class _RunSchema(BaseModel):
    speed: Dict[BytesWithPublicKey, Optional[_SpeedValue]]
    coordinator: Dict[BytesWithPublicKey, Optional[_CoordinatorValue]]


@dataclass(frozen=True)
class SpeedRecord:
    """One peer's measured throughput. ``last_seen`` is DHT time (``hivemind.utils.get_dht_time()``). ``link_up`` /
    ``link_down``: its link's bytes per second, measured on its real transfers (transport/linkspeed.py);
    ``time_split``: its seconds computing, uploading, downloading and its wall seconds (peer/summary.py ``time_split``)."""

    peer_id: str
    tokens_per_s: float
    device: str
    software_version: str
    last_seen: float
    link_up: Optional[float] = None
    link_down: Optional[float] = None
    time_split: Optional[tuple[float, float, float, float]] = None


@dataclass(frozen=True)
class CoordinatorAnnouncement:
    """Where the coordinator of a run listens and what it serves. ``timestamp`` is DHT time."""

    peer_id: str
    multiaddrs: tuple[str, ...]
    run_id: str
    model_numel: int
    codec: str
    version: int
    timestamp: float


def key_fingerprint(public_key: bytes) -> str:
    """A short, stable name of a DHT signing key (the subkey hivemind's signature validator stores under)."""
    return hashlib.sha256(public_key).hexdigest()[:32]


def _dht_value(model: type[BaseModel], fields: Dict[str, Any]) -> Dict[str, Any]:
    """Validate locally first so a bad value fails here with a readable error, not as a silent False."""
    return model.parse_obj(fields).dict()


class RunRecords:
    """The DHT records of one run as seen from one DHT node (installs the validators on construction).

    :param dht: a started ``hivemind.DHT``.
    :param run_id: the run's name; also the key prefix. Every node of the run must use the same one.
    :param private_key: this node's RSA signing key. Default: hivemind's process-wide key, which is right
        for one peer per process; tests that run several nodes in one process pass distinct keys.
    """

    def __init__(self, dht: DHT, run_id: str, private_key: Optional[RSAPrivateKey] = None) -> None:
        if not run_id or not isinstance(run_id, str):
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        self.dht, self.run_id = dht, run_id
        signature_validator = RSASignatureValidator(private_key)
        self.local_public_key: bytes = signature_validator.local_public_key
        dht.add_validators([SchemaValidator(_RunSchema, prefix=run_id), signature_validator])
        self._speed_key = f"{run_id}_speed"
        self._coordinator_key = f"{run_id}_coordinator"

    # -- speeds -------------------------------------------------------------------------------------

    def publish_speed(self, report: SpeedRecord, ttl_s: float) -> bool:
        """Store (or refresh) this node's speed report for ``ttl_s`` seconds. Returns whether any DHT node
        accepted it. Refresh about every ``ttl_s / 3`` so one lost store does not drop the peer."""
        value = _dht_value(_SpeedValue, asdict(report))
        return bool(
            self.dht.store(
                self._speed_key, value, get_dht_time() + ttl_s, subkey=self.local_public_key
            )
        )

    @property
    def signer(self) -> str:
        """This node's signing-key fingerprint (:func:`key_fingerprint`); a peer sends it to the coordinator
        over its authenticated RPC, binding its DHT records to its libp2p identity."""
        return key_fingerprint(self.local_public_key)

    def read_signed_speeds(self) -> list[tuple[str, SpeedRecord]]:
        """Every unexpired speed report with the fingerprint of the key that signed it. The coordinator
        counts a report only when that key is the one its claimed peer bound over an authenticated RPC."""
        found = self.dht.get(self._speed_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        signed: list[tuple[str, SpeedRecord]] = []
        for owner_key, entry in found.value.items():
            if entry.value is None or not isinstance(owner_key, bytes):
                continue
            try:
                report = SpeedRecord(**_SpeedValue.parse_obj(entry.value).dict())
            except (ValidationError, TypeError):
                continue
            signed.append((key_fingerprint(owner_key), report))
        return signed

    def read_speeds(self) -> Dict[str, SpeedRecord]:
        """All unexpired speed reports of the run, by claimed peer id (see the trust note above)."""
        found = self.dht.get(self._speed_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        reports: Dict[str, SpeedRecord] = {}
        for owner_key, entry in found.value.items():
            if entry.value is None:
                continue
            try:  # every honest node validated it already; a node without validators might not have
                report = SpeedRecord(**_SpeedValue.parse_obj(entry.value).dict())
            except (ValidationError, TypeError):
                logger.debug("run %s: dropping a malformed speed report", self.run_id)
                continue
            previous = reports.get(report.peer_id)
            if previous is not None:
                logger.warning(
                    "run %s: two signing keys claim peer %s; keeping the fresher report",
                    self.run_id, report.peer_id,
                )
                if previous.last_seen >= report.last_seen:
                    continue
            reports[report.peer_id] = report
        return reports

    # -- coordinator ----------------------------------------------------------------------------------

    def announce_coordinator(self, announcement: CoordinatorAnnouncement, ttl_s: float) -> bool:
        """Publish this node as the run's coordinator for ``ttl_s`` seconds; re-announce well before."""
        if announcement.run_id != self.run_id:
            raise ValueError(f"announcement is for run {announcement.run_id!r}, records are for {self.run_id!r}")
        fields = asdict(announcement)
        fields["multiaddrs"] = list(announcement.multiaddrs)
        value = _dht_value(_CoordinatorValue, fields)
        return bool(
            self.dht.store(
                self._coordinator_key, value, get_dht_time() + ttl_s, subkey=self.local_public_key
            )
        )

    def find_coordinator(
        self, pinned_peer_id: str, pinned_public_key: Optional[bytes] = None
    ) -> Optional[CoordinatorAnnouncement]:
        """The freshest announcement that claims ``pinned_peer_id`` (and, if given, is signed by
        ``pinned_public_key``, the coordinator's ``RunRecords.local_public_key``); ``None`` if there is
        none. Records from other peer ids are ignored (logged at debug level). The libp2p connection to
        the returned addresses authenticates ``pinned_peer_id`` itself, so a false claim cannot make a
        peer talk to an impostor; pin the public key too to also trust ``model_numel``/``codec`` here."""
        found = self.dht.get(self._coordinator_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return None
        best: Optional[CoordinatorAnnouncement] = None
        for owner_key, entry in found.value.items():
            if entry.value is None:
                continue
            try:
                parsed = _CoordinatorValue.parse_obj(entry.value)
            except (ValidationError, TypeError):
                logger.debug("run %s: dropping a malformed coordinator announcement", self.run_id)
                continue
            if parsed.peer_id != pinned_peer_id or parsed.run_id != self.run_id:
                logger.debug("run %s: ignoring a coordinator announcement from %s", self.run_id, parsed.peer_id)
                continue
            if pinned_public_key is not None and owner_key != pinned_public_key:
                logger.warning("run %s: ignoring an announcement for %s signed by another key", self.run_id, parsed.peer_id)
                continue
            fields = parsed.dict()
            fields["multiaddrs"] = tuple(fields["multiaddrs"])
            candidate = CoordinatorAnnouncement(**fields)
            if best is None or candidate.timestamp > best.timestamp:
                best = candidate
        return best
