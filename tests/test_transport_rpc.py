"""Coordinator RPCs between two real hivemind P2P daemons on 127.0.0.1, with an in-memory handler."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable, Optional, Union

import pytest
import torch
from hivemind.p2p import P2P

from asyncloco.transport.codecs import CODECS, EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.errors import PeerUnreachable, ProtocolError, RemoteError, RpcTimeout, TransportError
from asyncloco.transport.framing import CHUNK, ERROR, FRAME_BYTES, HEADER, FrameReader, pack_header, stream_bytes
from asyncloco.transport.linkspeed import LinkSpeed
from asyncloco.transport.rpc import CoordinatorClient, CoordinatorService, ServiceLimits, handle_name
from asyncloco.transport.wire import Ack, AssignRequest, HelloReply, LeaseGrant, LeaseReply, ModelRequest, SubmitHeader

NUMEL = 100_003  # odd, and not a multiple of any block size
CHUNK_SIZE = 64 << 10  # several chunks plus a partial one per transfer
RUN = "rpc-test"
LEASE = LeaseGrant("lease-1", 7, 2, 64, 12, 30, 8, 1000.0, 1060.0)


class FakeCoordinator:
    """In-memory handler: records what it was given."""

    def __init__(self, numel: int = NUMEL) -> None:
        self.version = 7
        self.theta = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        self.submitted: list[tuple[SubmitHeader, EncodedTensor, str]] = []
        self.requests: list[tuple[AssignRequest, str]] = []
        self.assign_gate: Optional[asyncio.Event] = None
        self.submit_gate: Optional[asyncio.Event] = None
        self.ack: Any = Ack(True, 8, "applied", False)

    async def assign(self, request: AssignRequest, peer_id: str) -> Union[HelloReply, LeaseReply]:
        self.requests.append((request, peer_id))
        if request.kind == "config":
            return HelloReply("{}", NUMEL, "int8", "int8", RUN, "test")
        if self.assign_gate is not None:
            await self.assign_gate.wait()
        return LeaseReply(LEASE, f"for {peer_id}")

    async def get_model(self, version: Optional[int], peer_id: str) -> tuple[int, torch.Tensor]:
        if version not in (None, self.version):
            raise KeyError(f"version {version} is not kept")
        return self.version, self.theta

    async def submit(self, header: SubmitHeader, pseudo_gradient: EncodedTensor, peer_id: str, upload_seconds: float = 0.0) -> Ack:
        self.submitted.append((header, pseudo_gradient, peer_id))
        if self.submit_gate is not None:
            await self.submit_gate.wait()
        return self.ack  # type: ignore[no-any-return]


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
            service = CoordinatorService(handler, NUMEL, chunk_bytes=CHUNK_SIZE, **service_kwargs)
            await service.add_p2p_handlers(server, namespace=RUN)
            client = CoordinatorClient(client_p2p, server.peer_id, client_numel, namespace=RUN, chunk_bytes=CHUNK_SIZE)
            await body(handler, service, client, client_p2p)
        finally:
            for p2p in (client_p2p, server):
                if p2p is not None:
                    await p2p.shutdown()

    asyncio.run(main())


async def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.02)


@pytest.mark.timeout(30)
def test_assign_round_trip_uses_authenticated_peer_id() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        me = p2p.peer_id.to_base58()
        hello = await client.hello(name="alice_01")
        assert hello == HelloReply("{}", NUMEL, "int8", "int8", RUN, "test")
        reply = await client.assign(1500.0, name="alice_01")
        assert reply == LeaseReply(LEASE, f"for {me}")  # peer id from the libp2p stream, not the payload
        assert handler.requests == [
            (AssignRequest("config", name="alice_01"), me),
            (AssignRequest("lease", tokens_per_s=1500.0, name="alice_01"), me),
        ]
        sent = sum(FRAME_BYTES + len(pack_header(request.to_wire())) for request, _ in handler.requests)
        received = FRAME_BYTES * 2 + len(pack_header(hello.to_wire())) + len(pack_header(reply.to_wire()))
        # the service counts a call's bytes when its handler returns, which can come after the caller has the reply
        await wait_until(lambda: (service.counters.assign.bytes_received, service.counters.assign.bytes_sent) == (sent, received))
        assert client.counters.assign.bytes_sent == sent == service.counters.assign.bytes_received
        assert client.counters.assign.bytes_received == received == service.counters.assign.bytes_sent
        with pytest.raises(ValueError, match="name"):  # refused before sending
            await client.assign(1.0, name="no spaces")

    run_pair(body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["none", "bf16", "int8"])
def test_get_model_with_exact_byte_counts_and_no_body_for_a_held_version(codec: str) -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        version, theta = await client.get_model(codec=codec)
        assert version == 7
        assert torch.equal(theta, decode(encode(codec, handler.theta), NUMEL))
        body_len = wire_bytes(codec, NUMEL)
        request = len(pack_header(ModelRequest(codec).to_wire()))
        header = len(pack_header({"version": 7, "codec": codec, "numel": NUMEL, "unchanged": False}))
        traffic = client.counters.get_model
        served = service.counters.get_model  # counted when the handler returns: maybe after the caller has the reply
        await wait_until(lambda: (served.bytes_sent, served.bytes_received) == (traffic.bytes_received, traffic.bytes_sent))
        assert traffic.payload_bytes_received == body_len == service.counters.get_model.payload_bytes_sent
        assert traffic.bytes_received == stream_bytes(header, body_len, CHUNK_SIZE) == service.counters.get_model.bytes_sent
        assert traffic.bytes_sent == FRAME_BYTES + request == service.counters.get_model.bytes_received
        # The client holds v7: asking again moves the two headers only, and returns the held tensor.
        before = traffic.bytes_received
        again_version, again = await client.get_model(7, codec=codec)
        assert again_version == 7 and again is theta
        unchanged = len(pack_header({"version": 7, "codec": codec, "numel": NUMEL, "unchanged": True}))
        assert traffic.bytes_received - before == FRAME_BYTES + unchanged
        assert traffic.payload_bytes_received == body_len
        with pytest.raises(RemoteError, match="not kept"):
            await client.get_model(3, codec=codec)
        assert service.protocol_errors == {}  # a refusal by the handler is not the peer's fault

    run_pair(body)


# int8 downloads over many rounds (full θ, then deltas from the peer's anchor): tests/test_delta_downloads.py


@pytest.mark.timeout(60)
def test_submit_every_codec_with_exact_byte_counts() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        pseudo_gradient = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
        for codec in CODECS:
            before = client.counters.submit.bytes_sent, client.counters.submit.payload_bytes_sent
            ack = await client.submit(f"lease-{codec}", 5, pseudo_gradient, codec=codec, inner_loss=2.5)
            # the handler's ack, with the body's arrival time as the service measured it (the peer's uplink sample)
            assert replace(ack, received_s=None) == handler.ack and ack.received_s is not None and ack.received_s >= 0
            header, received, peer_id = handler.submitted[-1]
            assert header == SubmitHeader(f"lease-{codec}", 5, codec, NUMEL, 2.5)
            assert peer_id == p2p.peer_id.to_base58()
            assert torch.equal(decode(received, NUMEL), decode(encode(codec, pseudo_gradient), NUMEL))
            body_len = wire_bytes(codec, NUMEL)
            sent = client.counters.submit.bytes_sent - before[0]
            assert client.counters.submit.payload_bytes_sent - before[1] == body_len
            assert sent == stream_bytes(len(pack_header(header.to_wire())), body_len, CHUNK_SIZE)
        mine, served = client.counters.submit, service.counters.submit  # the service counts when a handler returns
        await wait_until(lambda: (served.bytes_received, served.bytes_sent) == (mine.bytes_sent, mine.bytes_received))
        assert client.counters.submit.bytes_sent == service.counters.submit.bytes_received
        ready_and_ack = 2 * FRAME_BYTES + len(pack_header({"ready": True})) + len(pack_header(replace(handler.ack, received_s=0.5).to_wire()))
        assert client.counters.submit.bytes_received == service.counters.submit.bytes_sent == len(CODECS) * ready_and_ack
        assert client.counters.submit.payload_bytes_sent == service.counters.submit.payload_bytes_received
        # A pre-encoded tensor is resent byte for byte; no inner loss is fine.
        encoded = encode("int8", pseudo_gradient)
        await client.submit("lease-resend", 5, encoded)
        assert bytes(handler.submitted[-1][1].to_bytes()) == encoded.to_bytes()
        assert handler.submitted[-1][0].inner_loss is None

    run_pair(body, submit_codecs=CODECS)


@pytest.mark.timeout(60)
def test_the_uplink_sample_is_the_bodys_arrival_without_the_coordinators_work() -> None:
    # the coordinator holds the submission 3 s after its body arrived (its decode, gate, lock wait, decision): the
    # peer's uplink sample is the body's arrival as the service measured it — a fast link on loopback, not 3 s
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        client.link = LinkSpeed()
        handler.submit_gate = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(3.0, handler.submit_gate.set)
        started = time.monotonic()
        ack = await client.submit("lease-up", 5, torch.ones(NUMEL), codec="none")
        took = time.monotonic() - started
        nbytes = wire_bytes("none", NUMEL)
        assert ack.received_s is not None and took >= 3.0 > ack.received_s
        assert client.link.samples["up"] == 1 and client.link.measured["up"] == nbytes / ack.received_s

    run_pair(body)


def frame(kind: int, data: bytes, declared: Optional[int] = None) -> bytes:
    return bytes((kind,)) + (len(data) if declared is None else declared).to_bytes(4, "big") + data


async def raw_call(p2p: P2P, server: Any, rpc: str, data: bytes, *, read_ready: bool = False) -> str:
    """Send hand-made bytes on a raw stream; return what the service answered: its ERROR text,
    'closed' when it closed the stream without one, or 'ok:<kind>' for a normal frame."""
    _, reader, writer = await p2p.call_binary_stream_handler(server, handle_name(RUN, rpc))
    try:
        writer.write(data)
        await writer.drain()
        frames = FrameReader(reader, idle_timeout=20.0)
        kinds = {HEADER: 1 << 16, ERROR: 1 << 16}
        try:
            kind, payload = await frames.read_frame(kinds)
            if read_ready and kind == HEADER:
                kind, payload = await frames.read_frame(kinds)
        except RemoteError as error:
            return error.message
        except PeerUnreachable:
            return "closed"
        return f"ok:{kind}"
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_protocol_violations_are_refused_before_reading_and_counted() -> None:
    good_header = SubmitHeader("x", 0, "none", NUMEL).to_wire()
    body_ok = bytes(wire_bytes("none", NUMEL))

    def header(**overrides: Any) -> bytes:
        return frame(HEADER, pack_header(good_header | overrides))

    def chunks(data: bytes) -> bytes:
        return b"".join(frame(CHUNK, data[i : i + CHUNK_SIZE]) for i in range(0, len(data), CHUNK_SIZE))

    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        server = client.coordinator_peer_id
        cases = [  # (rpc, bytes, expected answer)
            ("submit", header(numel=NUMEL + 1), "numel"),
            ("submit", header(numel=2**40), "outside"),
            ("submit", header(codec="int4"), "not accepted"),
            ("submit", header(codec="pickle"), "not one of"),
            ("submit", header(base_version=True), "must be an int"),
            ("submit", header(inner_loss=float("nan")), "inner_loss"),
            ("submit", header(extra=1), "unknown field"),
            ("submit", frame(HEADER, b"\xc1"), "malformed"),
            ("submit", frame(HEADER, b"\xd4\x05\x00"), "extension"),
            ("submit", frame(HEADER, b"", declared=2**31), "more than the 65536 allowed"),  # nothing else sent
            ("submit", frame(CHUNK, b"abc"), "unexpected frame kind 2"),
            ("submit", frame(7, b""), "unexpected frame kind 7"),
            ("submit", header() + frame(CHUNK, b"", declared=CHUNK_SIZE * 100), "more than the 400012 allowed"),
            ("submit", header() + chunks(body_ok) + chunks(b"x"), "ok:1"),  # extra chunk after the body: not read
            ("get_model", frame(HEADER, pack_header({"codec": "int4"})), "not offered"),
            ("get_model", frame(HEADER, pack_header({"codec": "none", "version": -1})), "outside"),
            ("assign", frame(HEADER, pack_header({"kind": "lease", "tokens_per_s": 10})), "must be a float"),
            ("assign", frame(HEADER, pack_header({"kind": "config", "name": "x" * 65})), "name"),
            ("assign", frame(HEADER, b"\x92\x01\x02"), "must be a map"),  # msgpack [1, 2]
        ]
        for rpc, data, expected in cases:
            answer = await raw_call(p2p, server, rpc, data, read_ready=rpc == "submit")
            assert expected in answer, (rpc, data[:40], answer)
        refused = len(cases) - 1
        assert service.protocol_errors == {p2p.peer_id.to_base58(): refused}
        assert [h.lease_id for h, _, _ in handler.submitted] == ["x"]  # only the well-formed body arrived
        assert all(request.kind != "config" for request, _ in handler.requests) and not handler.requests
        await client.submit("y", 0, torch.zeros(NUMEL), codec="none")  # the service still works
        assert len(handler.submitted) == 2

    run_pair(body, submit_codecs=("none", "int8"))


@pytest.mark.timeout(60)
def test_idle_and_half_open_streams_time_out() -> None:
    limits = ServiceLimits(idle_timeout=1.0, header_timeout=2.0, transfer_base_s=3.0)

    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        server = client.coordinator_peer_id
        me = p2p.peer_id.to_base58()
        started = time.monotonic()
        # (a) a stream opened and never written to
        assert await raw_call(p2p, server, "assign", b"") == "closed"
        # (b) half a header prefix, then silence
        assert await raw_call(p2p, server, "get_model", b"\x01\x00") == "closed"
        # (c) a good submit header, then half the body, then silence: the body slot is given back
        good = frame(HEADER, pack_header(SubmitHeader("x", 0, "none", NUMEL).to_wire()))
        assert await raw_call(p2p, server, "submit", good + frame(CHUNK, bytes(1000)), read_ready=True) == "closed"
        elapsed = time.monotonic() - started
        assert elapsed < 3 * (limits.header_timeout + limits.idle_timeout) + 10, elapsed
        await wait_until(lambda: service.active_calls == 0)
        assert service.protocol_errors == {me: 3} and handler.submitted == [] and not handler.requests
        await client.submit("y", 0, torch.zeros(NUMEL), codec="none")  # all slots were released
        assert [h.lease_id for h, _, _ in handler.submitted] == ["y"]

    run_pair(body, limits=ServiceLimits(**{**limits.__dict__, "max_submit_bodies": 1}))


@pytest.mark.timeout(180)
def test_calls_in_flight_are_limited_per_peer() -> None:
    """Every refusal arrives as the refusal. The service refuses a call before reading its request; it used to
    close the stream with the request unread, p2pd then reset the libp2p stream, and the reset could overtake
    the ERROR frame: the caller got "stream closed after 0 of 90 bytes" (about 1 refusal in 5 in a loop on a
    busy machine). Twenty refusals in a row catch that race almost surely (0.8^20 ≈ 1 %)."""
    refusals = 20

    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        handler.assign_gate = asyncio.Event()
        held = [asyncio.create_task(client.assign(1.0, timeout=150)) for _ in range(2)]
        await wait_until(lambda: len(handler.requests) == 2, timeout=60.0)
        for _ in range(refusals):
            with pytest.raises(RemoteError, match=r"too many calls in flight \(2 from this peer, at most 2; 2 in all"):
                await client.assign(1.0, timeout=60)
        assert len(handler.requests) == 2 and service.protocol_errors == {p2p.peer_id.to_base58(): refusals}
        request = FRAME_BYTES + len(pack_header(AssignRequest("lease", tokens_per_s=1.0).to_wire()))
        assert client.counters.assign.bytes_sent == refusals * request  # (the held calls count when they end)
        handler.assign_gate.set()
        assert [reply.lease for reply in await asyncio.gather(*held)] == [LEASE, LEASE]
        await wait_until(lambda: service.active_calls == 0, timeout=60.0)
        assert (await client.assign(1.0)).lease == LEASE
        assert client.counters.assign.bytes_sent == (refusals + 3) * request
        assert service.counters.assign.failures == refusals and client.counters.assign.failures == refusals
        assert service.counters.assign.calls == client.counters.assign.calls == refusals + 3

    run_pair(body, limits=ServiceLimits(max_calls_per_peer=2))


@pytest.mark.timeout(60)
def test_one_peer_sends_one_body_at_a_time() -> None:
    """A peer holds at most ``max_bodies_per_peer`` (1) of the submit body slots: a second submission while its first is
    still in the service is refused as busy (a slow sender cannot take every slot), and taken once the first is done."""

    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        handler.submit_gate = asyncio.Event()
        first = asyncio.create_task(client.submit("a", 0, torch.zeros(NUMEL), codec="int8"))
        await wait_until(lambda: len(handler.submitted) == 1)
        with pytest.raises(RemoteError, match=r"this peer already sends 1 body \(a submission or a reveal\); at most 1"):
            await client.submit("b", 0, torch.zeros(NUMEL), codec="int8")
        assert [h.lease_id for h, _, _ in handler.submitted] == ["a"]  # the second body was never read
        handler.submit_gate.set()
        assert (await first).accepted
        assert (await client.submit("b", 0, torch.zeros(NUMEL), codec="int8")).accepted
        assert [h.lease_id for h, _, _ in handler.submitted] == ["a", "b"]

    run_pair(body, limits=ServiceLimits(max_submit_bodies=4, max_bodies_per_peer=1))


@pytest.mark.timeout(30)
def test_client_checks_sizes_before_sending_or_allocating() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        with pytest.raises(ProtocolError, match="does not match"):  # header says NUMEL, client expects NUMEL-1
            await client.get_model()
        with pytest.raises(TransportError, match="elements"):
            await client.submit("x", 0, torch.zeros(NUMEL), codec="none")
        with pytest.raises(RemoteError, match="not offered"):
            await client.get_model(codec="int4")
        assert handler.submitted == [] and client.counters.get_model.failures == 2

    run_pair(body, client_numel=NUMEL - 1)


@pytest.mark.timeout(30)
def test_bad_ack_and_timeouts_surface_as_transport_errors() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        handler.ack = {"accepted": "yes"}  # a handler bug: the caller gets a one-line internal error
        with pytest.raises(RemoteError, match="internal error: TypeError"):
            await client.submit("x", 0, torch.zeros(NUMEL), codec="bf16")
        handler.assign_gate = asyncio.Event()
        with pytest.raises(RpcTimeout):
            await client.assign(1.0, timeout=0.5)
        assert isinstance(RpcTimeout("x"), TimeoutError)
        handler.assign_gate.set()
        await wait_until(lambda: service.active_calls == 0)
        assert (await client.assign(1.0)).lease == LEASE

    run_pair(body)


@pytest.mark.timeout(30)
def test_missing_service_is_unreachable() -> None:
    async def body(handler: FakeCoordinator, service: CoordinatorService, client: CoordinatorClient, p2p: P2P) -> None:
        elsewhere = CoordinatorClient(p2p, client.coordinator_peer_id, NUMEL, namespace="another-run")
        with pytest.raises(PeerUnreachable):
            await elsewhere.get_model(timeout=10)

    run_pair(body)
