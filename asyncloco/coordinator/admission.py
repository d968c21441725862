"""Admission tokens: who may join a run in ``runtime.admission: token`` mode.

The organiser issues a token per volunteer (``asyncloco coordinator token --checkpoint-dir DIR
--peer-name alice --expires 7d``); the volunteer joins with ``asyncloco peer join ... --token TOKEN``.
A token is a signed statement "``name`` may join until ``expires_at``", with a random id:

    alt1.<base64url(JSON claims)>.<base64url(Ed25519 signature of those JSON bytes)>

The signing key is the run's own (``admission.key`` in the checkpoint directory, created on first use,
mode 0600, never sent anywhere); the coordinator only ever needs its public half to verify. Verifying
a token is pure crypto and lives here; *deciding* is the coordinator logic's business: the daemon turns
a verified token into an :class:`~asyncloco.coordinator.logic.Admit` event, and the logic refuses it if
it expired, was revoked, or is already bound to another libp2p peer id (a token admits exactly one
identity: the first one that uses it). Bindings and revocations are coordinator state, so they are in
every snapshot.

Revocations (``asyncloco coordinator token revoke --checkpoint-dir DIR TOKEN_ID``) are appended to
``revoked.json`` in the checkpoint directory; a running coordinator reads that file every second or so
and feeds each new id to the logic as a :class:`~asyncloco.coordinator.logic.Revoke` event. Issued
tokens are listed (id, name, expiry; never the token itself) in ``tokens.jsonl`` for
``asyncloco coordinator token list``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "AdmissionError",
    "TokenClaims",
    "KEY_FILE",
    "REVOKED_FILE",
    "ISSUED_FILE",
    "MAX_TOKEN_CHARS",
    "parse_duration",
    "load_or_create_key",
    "issue_token",
    "verify_token",
    "revoke_token",
    "read_revoked",
    "list_issued",
]

logger = logging.getLogger(__name__)

KEY_FILE = "admission.key"
REVOKED_FILE = "revoked.json"
ISSUED_FILE = "tokens.jsonl"
TOKEN_PREFIX = "alt1"
MAX_TOKEN_CHARS = 1024  # a real token is ~250 characters; anything longer is refused before decoding
MAX_NAME_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
_TOKEN_ID = re.compile(r"^[0-9a-f]{32}$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


class AdmissionError(ValueError):
    """A token that cannot admit anyone (malformed, forged, wrong run); the message says why."""


@dataclass(frozen=True)
class TokenClaims:
    token_id: str  # 32 hex characters, random: revocation and binding refer to it
    name: str  # the organiser's label for the volunteer ("alice"), for journals and dashboards
    issued_at: float  # unix seconds
    expires_at: float  # unix seconds


def parse_duration(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"`` or a plain number of seconds → seconds (> 0)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*", text)
    if match is None:
        raise ValueError(f"cannot read the duration {text!r}; write e.g. 7d, 12h, 30m or 3600s")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"the duration {text!r} must be positive")
    return seconds


def load_or_create_key(directory: str | Path) -> Ed25519PrivateKey:
    """The run's signing key from ``directory/admission.key``; created (mode 0600) if absent."""
    directory = Path(directory)
    path = directory / KEY_FILE
    if path.is_file():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} is not an Ed25519 private key; move it away and a new one is created")
        return key
    directory.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, path)  # never replace a key another process created meanwhile
    except FileExistsError:
        tmp.unlink()
        return load_or_create_key(directory)
    tmp.unlink()
    logger.info("created the run's admission key %s (keep it private; tokens are signed with it)", path)
    return key


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_token(
    directory: str | Path, name: str, expires_in: float, *, now: float | None = None
) -> tuple[str, TokenClaims]:
    """Sign a new token for ``name`` valid for ``expires_in`` seconds; records it in ``tokens.jsonl``."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"peer name {name!r}: use 1-{MAX_NAME_CHARS} letters, digits or _.@-")
    if not (math.isfinite(expires_in) and expires_in > 0):
        raise ValueError(f"a token must expire: expires_in must be a positive number of seconds, got {expires_in}")
    key = load_or_create_key(directory)
    issued_at = time.time() if now is None else now
    claims = TokenClaims(secrets.token_hex(16), name, issued_at, issued_at + expires_in)
    body = json.dumps(
        {"id": claims.token_id, "name": claims.name, "iat": claims.issued_at, "exp": claims.expires_at},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    token = f"{TOKEN_PREFIX}.{_b64encode(body)}.{_b64encode(key.sign(body))}"
    with (Path(directory) / ISSUED_FILE).open("a") as handle:
        handle.write(json.dumps({"token_id": claims.token_id, "name": name, "issued_at": issued_at, "expires_at": claims.expires_at}) + "\n")
    return token, claims


def verify_token(public_key: Ed25519PublicKey, token: Any) -> TokenClaims:
    """The claims of a token signed by ``public_key``; raises :class:`AdmissionError` otherwise.

    Checks format and signature only: expiry, revocation and binding are decided by the logic."""
    if not isinstance(token, str) or not token:
        raise AdmissionError("the admission token must be a non-empty string")
    if len(token) > MAX_TOKEN_CHARS:
        raise AdmissionError(f"the admission token is longer than {MAX_TOKEN_CHARS} characters")
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise AdmissionError("not an asyncloco admission token (expected alt1.<claims>.<signature>); copy it whole")
    try:
        body, signature = _b64decode(parts[1]), _b64decode(parts[2])
    except (binascii.Error, ValueError):
        raise AdmissionError("the admission token is not valid base64url; copy it whole") from None
    try:
        public_key.verify(signature, body)
    except InvalidSignature:
        raise AdmissionError("the admission token was not signed by this run's coordinator") from None
    try:
        raw = json.loads(body)
    except ValueError:
        raise AdmissionError("the admission token's claims are not JSON") from None
    if not isinstance(raw, dict) or set(raw) != {"id", "name", "iat", "exp"}:
        raise AdmissionError("the admission token's claims have unexpected fields")
    token_id, name, issued_at, expires_at = raw["id"], raw["name"], raw["iat"], raw["exp"]
    if not (isinstance(token_id, str) and _TOKEN_ID.fullmatch(token_id)):
        raise AdmissionError("the admission token's id is malformed")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise AdmissionError("the admission token's name is malformed")
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (issued_at, expires_at)):
        raise AdmissionError("the admission token's times are malformed")
    return TokenClaims(token_id, name, float(issued_at), float(expires_at))


def read_revoked(directory: str | Path) -> dict[str, float]:
    """Revoked token ids → when they were revoked (unix seconds); empty if nothing was revoked."""
    path = Path(directory) / REVOKED_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); restore it or revoke the tokens again") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in raw.items()):
        raise ValueError(f"{path} must map token ids to revocation times")
    return {k: float(v) for k, v in raw.items()}


def revoke_token(directory: str | Path, token_id: str, *, now: float | None = None) -> bool:
    """Add ``token_id`` to ``revoked.json`` (atomically); False if it was already revoked."""
    if not _TOKEN_ID.fullmatch(token_id):
        raise ValueError(f"{token_id!r} is not a token id (32 hex characters; see `asyncloco coordinator token list`)")
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} does not exist; pass the run's --checkpoint-dir")
    revoked = read_revoked(directory)
    if token_id in revoked:
        return False
    revoked[token_id] = time.time() if now is None else now
    tmp = directory / (REVOKED_FILE + ".tmp")
    with tmp.open("w") as handle:
        json.dump(revoked, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / REVOKED_FILE)
    return True


def list_issued(directory: str | Path) -> list[dict[str, Any]]:
    """Every token issued in this run directory (id, name, issued_at, expires_at), oldest first."""
    path = Path(directory) / ISSUED_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
