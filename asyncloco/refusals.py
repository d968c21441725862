"""The typed refusal codes, one enum both ends import (the coordinator decides them in
``handle`` (coordinator/logic/); the peer in peer/runner.py and peer/joining.py reacts to them, never to the text).

A refusal travels in two ways:

- inside a reply: :class:`~asyncloco.transport.wire.LeaseReply` and :class:`~asyncloco.transport.wire.Ack`
  carry an optional ``code`` (the value of a :class:`RefusalCode`) beside their human ``reason``;
- as an ERROR frame (the call itself is refused, e.g. an unadmitted peer): the service raises
  :class:`Refusal`, whose text goes out as ``"[code] reason"`` (:func:`frame_text`); the client's
  :class:`~asyncloco.transport.errors.RemoteError` parses it back into ``.code`` (:func:`parse_frame`).

Which codes end a peer's participation (it must fix something first) is :data:`FATAL`.
"""

from __future__ import annotations

import enum
import re
from typing import Optional

__all__ = ["RefusalCode", "Refusal", "FATAL", "frame_text", "parse_frame", "code_of"]


class RefusalCode(str, enum.Enum):
    """Why the coordinator turned a request or a submission away."""

    # --- the peer may not take part (fatal for it: retrying cannot help)
    NOT_ADMITTED = "not_admitted"  # admission: no or wrong token, not in the allowlist, token revoked/expired/bound elsewhere
    EXPELLED = "expelled"  # failed a verification (coordinator/verify.py): out for good
    INCOMPATIBLE = "incompatible"  # model/tokenizer/data/codec differ from the run's (asyncloco/fingerprint.py)
    # --- a lease request not answered with a lease (ask again)
    NO_SPEED = "no_speed"  # no throughput report from this peer yet
    QUARANTINED = "quarantined"  # repeated rejected updates: back off
    HELD_TOO_LONG = "held_too_long"  # the held request reached the hold limit
    SUPERSEDED = "superseded"  # a newer request of the same peer replaced this one
    # --- a submission rejected
    UNKNOWN_LEASE = "unknown_lease"  # unknown or expired lease (its steps were given back)
    INVALID_UPDATE = "invalid_update"  # wrong owner, base version, dtype, shape, NaN/Inf, norm bound
    STALE = "stale"  # staleness above the bound
    GATE = "gate"  # refused by the update gate (coordinator/gate.py)
    DROPPED = "dropped"  # dropped by the staleness policy (e.g. PolyThres): the work is consumed, θ untouched
    DISCARDED = "discarded"  # the peer was expelled before its update was applied
    BROKEN_CHAIN = "broken_chain"  # carried inner state does not chain (runtime.verify)


FATAL = frozenset({RefusalCode.NOT_ADMITTED, RefusalCode.EXPELLED, RefusalCode.INCOMPATIBLE})

_FRAME = re.compile(r"\[([a-z_]{1,32})\] ")


class Refusal(PermissionError):
    """Raised by a service handler to refuse a call with a typed code; the text is for humans."""

    def __init__(self, code: RefusalCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def frame_text(code: RefusalCode, text: str) -> str:
    """The ERROR frame's text for a refusal: ``"[code] text"``."""
    return f"[{code.value}] {text}"


def code_of(value: Optional[str]) -> Optional[RefusalCode]:
    """The :class:`RefusalCode` named ``value`` (None: absent or unknown to this version)."""
    if value is None:
        return None
    try:
        return RefusalCode(value)
    except ValueError:
        return None


def parse_frame(text: str) -> tuple[Optional[RefusalCode], str]:
    """``(code, text without the prefix)`` of an ERROR frame's text; ``(None, text)`` if it carries no known code."""
    match = _FRAME.match(text)
    code = code_of(match.group(1)) if match else None
    return (code, text[match.end():]) if (match and code is not None) else (None, text)
