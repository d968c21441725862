"""Transport errors: one small tree, so callers can decide per branch (retry, give up, report).

```
TransportError                      base of everything raised by asyncloco.transport
├── CodecError (also ValueError)    bad codec name, wrong numel, wrong payload length, bad tensor
├── ProtocolError                   the remote side sent something malformed (bad header, size mismatch,
│   │                               too many bytes, missing fields); retrying the same call will not help
│   └── MessageError (also ValueError)  a wire message field is missing, unknown, mistyped or out of
│                                   bounds (raised on receipt, and when building a message locally)
├── RemoteError                     the remote handler refused or failed; ``message`` carries its reason
├── RpcTimeout (also TimeoutError)  no complete answer within the per-call timeout; safe to retry
└── PeerUnreachable                 could not open a stream to the peer (daemon error, connection reset)
```

Operating advice: ``RpcTimeout`` and ``PeerUnreachable`` are transient (retry with backoff; a submit is
idempotent by ``lease_id`` on the coordinator). ``ProtocolError`` and ``CodecError`` indicate a version or
configuration mismatch between peers (different model size or codec): fix the config, do not retry.
``RemoteError`` is whatever the coordinator said; read ``message``.
"""

from __future__ import annotations

__all__ = [
    "TransportError",
    "CodecError",
    "ProtocolError",
    "MessageError",
    "RemoteError",
    "RpcTimeout",
    "PeerUnreachable",
    "VersionGone",
]


class TransportError(Exception):
    """Base class of all transport errors."""


class CodecError(TransportError, ValueError):
    """A tensor could not be encoded or an encoded payload failed validation."""


class ProtocolError(TransportError):
    """The remote side violated the wire protocol (malformed or oversized message)."""


class MessageError(ProtocolError, ValueError):
    """A wire message (asyncloco.transport.wire) has a missing, unknown, mistyped or out-of-bounds field."""


class RemoteError(TransportError):
    """The remote handler raised or refused the call; ``message`` is the remote's text. ``code``: the typed
    :class:`~asyncloco.refusals.RefusalCode` of a refusal (parsed from the text's ``[code]`` prefix), else None."""

    def __init__(self, message: str) -> None:
        from asyncloco.refusals import parse_frame

        super().__init__(message)
        self.message = message
        self.code = parse_frame(message)[0]


class RpcTimeout(TransportError, TimeoutError):
    """The call did not complete within its timeout."""


class VersionGone(TransportError):
    """The swarm's seed no longer holds the version being downloaded (newer versions replaced it in its store):
    the download stops at once instead of waiting out its timeout; ask for a newer version or the coordinator."""


class PeerUnreachable(TransportError):
    """No stream could be opened to the peer, or it broke mid-call."""
