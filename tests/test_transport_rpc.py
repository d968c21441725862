"""Coordinator RPCs between two real hivemind P2P daemons on 127.0.0.1, with an in-memory handler."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import pytest
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.errors import PeerUnreachable, ProtocolError, RemoteError, RpcTimeout, TransportError
from asyncloco.transport.framing import FRAME_BYTES, chunk_messages, pack_header, stream_bytes
from asyncloco.transport.rpc import CoordinatorClient, CoordinatorService

NUMEL = 100_003  # odd, and not a multiple of any block size
CHUNK = 64 << 10  # several chunks plus a partial one per transfer
RUN = "rpc-test"


class FakeCoordinator:
    """In-memory handler: records what it was given."""

    def __init__(self, numel: int = NUMEL) -> None:
        self.theta = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        self.submitted: list[tuple[str, int, EncodedTensor, str]] = []
        self.assign_gate: Optional[asyncio.Event] = None
        self.ack: dict[str, Any] = {"accepted": True, "version": 8, "reason": "", "duplicate": False}

    async def assign(self, request: dict[str, Any], peer_id: str) -> dict[str, Any]:
        if self.assign_gate is not None:
            await self.assign_gate.wait()
        return {"lease_id": "lease-1", "base_version": 7, "steps": 12, "peer_id": peer_id, "echo": request}

    async def get_model(self, version: Optional[int]) -> tuple[int, torch.Tensor]:
        if version not in (None, 7):
            raise KeyError(f"version {version} is not kept")
        return 7, self.theta

    async def submit(self, lease_id: str, base_version: int, pseudo_gradient: EncodedTensor, peer_id: str) -> dict[str, Any]:
        self.submitted.append((lease_id, base_version, pseudo_gradient, peer_id))
        return self.ack


Body = Callable[[FakeCoordinator, CoordinatorService, CoordinatorClient, P2P], Awaitable[None]]


def run_pair(body: Body, *, client_numel: int = NUMEL, **service_kwargs: Any) -> None:
    """Start a coordinator P2P with the service and a client P2P; always tear both daemons down."""

    async def main() -> None:
        server = client_p2p = None
        try:
            server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            client_p2p = await P2P.create(
                host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs()
            )
            handler = FakeCoordinator()
            service = CoordinatorService(handler, NUMEL, chunk_bytes=CHUNK, **service_kwargs)
            await service.add_p2p_handlers(server, namespace=RUN)
            client = CoordinatorClient(client_p2p, server.peer_id, client_numel, namespace=RUN, chunk_bytes=CHUNK)
            await body(handler, service, client, client_p2p)
        finally:
            for p2p in (client_p2p, server):
                if p2p is not None:
                    await p2p.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_assign_round_trip_uses_authenticated_peer_id() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        lease = await client.assign({"tokens_per_s": 1500.0, "peer_id": "forged"})
        assert lease["peer_id"] == p2p.peer_id.to_base58()  # from the libp2p context, not the payload
        assert lease["echo"] == {"tokens_per_s": 1500.0, "peer_id": "forged"}
        assert (lease["lease_id"], lease["base_version"], lease["steps"]) == ("lease-1", 7, 12)
        sent = runtime_pb2.ExpertRequest(metadata=pack_header({"tokens_per_s": 1500.0, "peer_id": "forged"}))
        assert client.counters.assign.bytes_sent == sent.ByteSize() == service.counters.assign.bytes_received
        assert client.counters.assign.bytes_received == service.counters.assign.bytes_sent > 0

    run_pair(body)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_get_model_streams_theta_with_exact_byte_counts(codec: str) -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        version, theta = await client.get_model(codec=codec)
        assert version == 7
        expected = handler.theta if codec == "none" else handler.theta.bfloat16().float()
        assert torch.equal(theta, expected)
        body_len = wire_bytes(codec, NUMEL)
        header_len = len(pack_header({"version": 7, "codec": codec, "numel": NUMEL}))
        traffic = client.counters.get_model
        assert traffic.payload_bytes_received == body_len == service.counters.get_model.payload_bytes_sent
        assert traffic.bytes_received == stream_bytes(header_len, body_len, CHUNK)
        assert traffic.bytes_received == service.counters.get_model.bytes_sent
        chunks = -(-body_len // CHUNK)
        assert traffic.bytes_received - body_len <= FRAME_BYTES + 3 + header_len + chunks * (FRAME_BYTES + 8)
        assert (await client.get_model(7, codec=codec))[0] == 7
        with pytest.raises(RemoteError, match="not kept"):
            await client.get_model(3, codec=codec)

    run_pair(body)


@pytest.mark.timeout(60)
def test_submit_every_codec_with_exact_byte_counts() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        pseudo_gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
        for codec in CODECS:
            before = client.counters.submit.bytes_sent, client.counters.submit.payload_bytes_sent
            ack = await client.submit(f"lease-{codec}", 5, pseudo_gradient, codec=codec)
            assert ack == handler.ack
            lease_id, base_version, received, peer_id = handler.submitted[-1]
            assert (lease_id, base_version, peer_id) == (f"lease-{codec}", 5, p2p.peer_id.to_base58())
            assert torch.equal(decode(received, NUMEL), decode(encode(codec, pseudo_gradient), NUMEL))
            header = {"lease_id": f"lease-{codec}", "base_version": 5, "codec": codec, "numel": NUMEL}
            body_len = wire_bytes(codec, NUMEL)
            sent = client.counters.submit.bytes_sent - before[0]
            assert client.counters.submit.payload_bytes_sent - before[1] == body_len
            assert sent == stream_bytes(len(pack_header(header)), body_len, CHUNK)
        assert client.counters.submit.bytes_sent == service.counters.submit.bytes_received
        assert client.counters.submit.bytes_received == service.counters.submit.bytes_sent  # ready + ack frames
        assert client.counters.submit.payload_bytes_sent == service.counters.submit.payload_bytes_received
        # A pre-encoded tensor is resent byte for byte.
        encoded = encode("int8", pseudo_gradient)
        await client.submit("lease-resend", 5, encoded)
        assert bytes(handler.submitted[-1][2].to_bytes()) == encoded.to_bytes()

    run_pair(body, submit_codecs=CODECS)


async def _raw_submit(client: CoordinatorClient, messages: list[runtime_pb2.ExpertRequest]) -> None:
    """Send hand-made messages with the real client's handshake: header, wait for ready, the rest."""
    ready = asyncio.Event()

    async def stream() -> AsyncIterator[runtime_pb2.ExpertRequest]:
        yield messages[0]
        await ready.wait()
        for message in messages[1:]:
            yield message

    async def call() -> None:
        responses = await client._stub.rpc_submit(stream())
        async with contextlib.aclosing(responses):
            async for _ in responses:
                ready.set()

    await client._call("submit", call(), timeout=10)


@pytest.mark.timeout(60)
def test_submit_size_and_protocol_violations_are_rejected() -> None:
    def header(**overrides: Any) -> runtime_pb2.ExpertRequest:
        fields = {"lease_id": "x", "base_version": 0, "codec": "none", "numel": NUMEL} | overrides
        return runtime_pb2.ExpertRequest(metadata=pack_header(fields))

    body_ok = bytes(wire_bytes("none", NUMEL))
    chunks_ok = list(chunk_messages(body_ok, runtime_pb2.ExpertRequest, CHUNK))

    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        header_cases = [  # refused at the header, before the body is sent or a buffer allocated
            ([header(numel=NUMEL + 1)] + chunks_ok, "numel"),
            ([header(numel=2**40)], "numel"),
            ([header(codec="int4")] + chunks_ok, "not accepted"),
            ([header(codec="pickle")], "not accepted"),
            ([header(base_version=True)], "base_version"),
            ([runtime_pb2.ExpertRequest(metadata=b"\xc1")], "malformed"),
            ([runtime_pb2.ExpertRequest(metadata=b"\xd4\x05\x00")], "extension"),  # a msgpack ext type
        ]
        for messages, reason in header_cases:
            with pytest.raises(RemoteError, match=reason):
                await _raw_submit(client, messages)
        body_cases = [  # refused mid-body; the service may reset the stream before its error arrives
            [header()] + chunks_ok + chunks_ok[:1],  # one chunk too many
            [header()] + chunks_ok[:-1],  # truncated
            [header(), runtime_pb2.ExpertRequest(metadata=b"\x01")],  # not a chunk
        ]
        for messages in body_cases:
            with pytest.raises((RemoteError, PeerUnreachable)):
                await _raw_submit(client, messages)
        cases = header_cases + body_cases
        assert handler.submitted == []
        assert service.counters.submit.failures == len(cases)
        await _raw_submit(client, [header()] + chunks_ok)  # the well-formed stream still works
        assert len(handler.submitted) == 1

    run_pair(body, submit_codecs=("none", "int8"))


@pytest.mark.timeout(30)
def test_client_checks_sizes_before_sending_or_allocating() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        with pytest.raises(ProtocolError, match="does not match"):  # header says NUMEL, client expects NUMEL-1
            await client.get_model()
        with pytest.raises(TransportError, match="elements"):
            await client.submit("x", 0, torch.zeros(NUMEL), codec="none")
        with pytest.raises(RemoteError, match="not offered"):
            await client.get_model(codec="int8")
        assert handler.submitted == [] and client.counters.get_model.failures == 2

    run_pair(body, client_numel=NUMEL - 1)


@pytest.mark.timeout(30)
def test_bad_ack_and_timeouts_surface_as_transport_errors() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        handler.ack = {"accepted": "yes"}
        with pytest.raises(RemoteError, match="accepted"):
            await client.submit("x", 0, torch.zeros(NUMEL), codec="bf16")
        handler.assign_gate = asyncio.Event()
        with pytest.raises(RpcTimeout):
            await client.assign({}, timeout=0.5)
        assert isinstance(RpcTimeout("x"), TimeoutError)
        handler.assign_gate.set()
        assert (await client.assign({}))["lease_id"] == "lease-1"

    run_pair(body)


@pytest.mark.timeout(30)
def test_missing_service_is_unreachable() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        elsewhere = CoordinatorClient(p2p, client.coordinator_peer_id, NUMEL, namespace="another-run")
        with pytest.raises(PeerUnreachable):
            await elsewhere.get_model(timeout=10)

    run_pair(body)
