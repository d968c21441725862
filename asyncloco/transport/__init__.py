"""Transport: tensor codecs, signed DHT run records, and the coordinator RPCs over hivemind P2P.

The only package layer that imports hivemind. See docs/transport.md for the wire format and figures.
"""

from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.errors import (
    CodecError,
    PeerUnreachable,
    ProtocolError,
    RemoteError,
    RpcTimeout,
    TransportError,
)
from asyncloco.transport.records import CoordinatorAnnouncement, RunRecords, SpeedRecord
from asyncloco.transport.rpc import (
    CoordinatorClient,
    CoordinatorHandler,
    CoordinatorService,
    RpcTraffic,
    TrafficCounters,
)

__all__ = [
    "CODECS",
    "EncodedTensor",
    "encode",
    "decode",
    "wire_bytes",
    "TransportError",
    "CodecError",
    "ProtocolError",
    "RemoteError",
    "RpcTimeout",
    "PeerUnreachable",
    "SpeedRecord",
    "CoordinatorAnnouncement",
    "RunRecords",
    "CoordinatorHandler",
    "CoordinatorService",
    "CoordinatorClient",
    "RpcTraffic",
    "TrafficCounters",
]
