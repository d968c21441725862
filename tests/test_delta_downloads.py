"""θ downloads that send only what the peer lacks (transport/delta.py).

A lossy download is a full encoding (the peer's anchor) or a delta from the anchor the peer holds; the θ
a peer trains from is the coordinator's θ up to one encoding's error of that delta, over any number of
rounds. The P2P tests run two real hivemind daemons on 127.0.0.1 with an in-memory handler.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Optional

import pytest
import torch
from hivemind.p2p import P2P

from asyncloco.transport.codecs import EncodedTensor, decode, encode, wire_bytes
from asyncloco.transport.delta import AnchorStore, apply_delta, error_bound
from asyncloco.transport.errors import CodecError, MessageError
from asyncloco.transport.framing import FRAME_BYTES, pack_header, stream_bytes
from asyncloco.transport.rpc import CoordinatorClient, CoordinatorService, ServiceLimits
from asyncloco.transport.wire import ModelHeader, ModelRequest

NUMEL = 100_003  # odd, not a multiple of a block
CHUNK = 64 << 10
RUN = "delta-test"


def widest_step(codec: str) -> float:
    """The widest step of the codec's code book, relative to the block absmax (closed form; bitsandbytes'
    CPU int8 lookup is not exactly round-to-nearest, its worst case is just over half a step)."""
    import bitsandbytes.functional as bnbf

    code = (bnbf.create_dynamic_map() if codec == "int8" else bnbf.get_4bit_type("nf4", device="cpu")).double().sort().values
    return max(float(code.diff().max()), 1 + float(code[0]), 1 - float(code[-1]))


def blockwise_bound(codec: str, delta: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Per element: block absmax of ``delta`` × the widest code step, plus the fp32 addition's rounding."""
    block = 4096 if codec == "int8" else 256
    padded = torch.nn.functional.pad(delta.abs(), (0, (-delta.numel()) % block)).reshape(-1, block)
    per_block = padded.max(dim=1).values.repeat_interleave(block)[: delta.numel()]
    return per_block * widest_step(codec) * (1 + 1e-5) + 2.0**-23 * theta.abs()


class Coordinator:
    """In-memory handler: θ per version, every version kept."""

    def __init__(self) -> None:
        self.version = 0
        self.generator = torch.Generator().manual_seed(0)
        self.thetas = {0: torch.randn(NUMEL, generator=self.generator)}

    def step(self, scale: float = 0.01) -> None:
        theta = self.thetas[self.version] - scale * torch.randn(NUMEL, generator=self.generator)
        self.version += 1
        self.thetas[self.version] = theta

    async def assign(self, request: Any, peer_id: str) -> Any:
        raise NotImplementedError

    async def submit(self, header: Any, pseudo_gradient: Any, peer_id: str, upload_seconds: float = 0.0) -> Any:
        raise NotImplementedError

    async def get_model(self, version: Optional[int], peer_id: str) -> tuple[int, torch.Tensor]:
        version = self.version if version is None else version
        return version, self.thetas[version]


Body = Callable[[Coordinator, CoordinatorService, P2P, P2P], Awaitable[None]]


def run(body: Body, **limits: Any) -> None:
    async def main() -> None:
        server = client_p2p = None
        try:
            server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            client_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
            handler = Coordinator()
            service = CoordinatorService(handler, NUMEL, chunk_bytes=CHUNK, model_codecs=("none", "bf16", "int8"),
                                         limits=ServiceLimits(**limits))
            await service.add_p2p_handlers(server, namespace=RUN)
            await body(handler, service, server, client_p2p)
        finally:
            for p2p in (client_p2p, server):
                if p2p is not None:
                    await p2p.shutdown()

    asyncio.run(main())


def client_for(server: P2P, p2p: P2P, codec: str = "int8") -> CoordinatorClient:
    return CoordinatorClient(p2p, server.peer_id, NUMEL, namespace=RUN, chunk_bytes=CHUNK, download_codec=codec)


def header_len(version: int, codec: str, unchanged: bool = False, delta_from: Optional[int] = None) -> int:
    return len(pack_header(ModelHeader(version, codec, NUMEL, unchanged, delta_from).to_wire()))


def request_len(codec: str, version: int, have: Optional[int], anchor: Optional[int]) -> int:
    return len(pack_header(ModelRequest(codec, version, have, anchor).to_wire()))


@pytest.mark.timeout(240)
def test_int8_over_60_rounds_one_delta_error_not_growing_and_exact_bytes() -> None:
    """≥ 50 rounds: the peer's θ is within the closed-form bound of one encoding of its delta every round;
    the first download is full, all later ones deltas from it; bytes on the wire exact, including the
    rounds where nothing was applied (no body)."""

    async def body(coordinator: Coordinator, service: CoordinatorService, server: P2P, p2p: P2P) -> None:
        client = client_for(server, p2p)
        errors: list[float] = []
        full_errors: list[float] = []
        sent = received = 0
        have: Optional[int] = None
        anchor: Optional[int] = None
        unchanged = 0
        for round_ in range(60):
            if round_ % 5 == 4:  # nothing applied since the last download
                unchanged += 1
            else:
                coordinator.step()
            v = coordinator.version
            theta_v = coordinator.thetas[v]
            version, theta = await client.get_model(v)
            assert version == v
            sent += FRAME_BYTES + request_len("int8", v, have, anchor)
            if have == v:
                received += FRAME_BYTES + header_len(v, "int8", unchanged=True)
                assert client.held is not None and theta is client.held[2]
            else:
                delta_from = None if anchor is None else anchor
                received += stream_bytes(header_len(v, "int8", delta_from=delta_from), wire_bytes("int8", NUMEL), CHUNK)
            assert client.anchor is not None
            anchor_values = decode(EncodedTensor.from_bytes("int8", NUMEL, client.anchor[2]), NUMEL)
            if round_ == 0:
                assert client.anchor[0] == 0 + 1 and torch.equal(theta, anchor_values)  # full: F_v itself
                bound = blockwise_bound("int8", theta_v, theta_v)
            else:
                assert client.anchor[0] == 1  # every later download is a delta from the first one
                bound = blockwise_bound("int8", theta_v - anchor_values, theta_v)
            error = (theta - theta_v).abs()
            assert bool((error <= bound).all()), (round_, float((error - bound).max()))
            errors.append(float(error.max()))
            full_errors.append(float((decode(encode("int8", theta_v), NUMEL) - theta_v).abs().max()))
            have, anchor = v, client.anchor[0]
        downloads = 60 - unchanged
        assert (service.downloads.full_sent, service.downloads.deltas_sent) == (1, downloads - 1)
        assert max(errors[-10:]) <= 1.1 * max(errors[:10])  # bounded, not growing
        # the gain: a delta is small, so its error is far below a full encoding's (same bytes)
        assert max(errors[1:]) < 0.2 * min(full_errors)
        traffic = client.counters.get_model
        served = service.counters.get_model  # counted when a handler returns: maybe after the client has the reply
        deadline = time.monotonic() + 20.0
        while (served.bytes_received, served.bytes_sent) != (sent, received) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert traffic.payload_bytes_received == downloads * wire_bytes("int8", NUMEL) == service.counters.get_model.payload_bytes_sent
        assert traffic.bytes_sent == sent == service.counters.get_model.bytes_received
        assert traffic.bytes_received == received == service.counters.get_model.bytes_sent

    run(body)


@pytest.mark.timeout(120)
def test_an_anchor_no_longer_kept_or_a_delta_too_large_gets_full_theta() -> None:
    async def body(coordinator: Coordinator, service: CoordinatorService, server: P2P, p2p: P2P) -> None:
        alice, bob = client_for(server, p2p), client_for(server, p2p)
        await alice.get_model(0)  # anchor v0 for alice
        coordinator.step()
        await bob.get_model(1)  # anchor v1 evicts v0 (one anchor kept)
        assert service.downloads.anchors() == [("int8", 1)]
        coordinator.step()
        _, theta = await alice.get_model(2)
        assert torch.equal(theta, decode(encode("int8", coordinator.thetas[2]), NUMEL))  # full θ
        assert alice.anchor is not None and alice.anchor[0] == 2
        assert (service.downloads.full_sent, service.downloads.deltas_sent) == (3, 0)
        # bob's anchor (v1) is gone too; a request naming a version never served is a full θ as well
        coordinator.step()
        _, theta = await bob.get_model(3)
        assert torch.equal(theta, decode(encode("int8", coordinator.thetas[3]), NUMEL))
        # a jump whose delta would be coarser than a full encoding: θ shrinks to a tenth
        coordinator.version += 1
        coordinator.thetas[coordinator.version] = 0.1 * coordinator.thetas[3]
        _, theta = await bob.get_model(4)
        assert torch.equal(theta, decode(encode("int8", coordinator.thetas[4]), NUMEL))
        assert (service.downloads.full_sent, service.downloads.deltas_sent) == (5, 0)
        # and the next small step is a delta again, from v4
        coordinator.step(0.001)
        _, theta = await bob.get_model(5)
        assert service.downloads.deltas_sent == 1
        anchor_values = decode(encode("int8", coordinator.thetas[4]), NUMEL)
        assert torch.equal(theta, apply_delta("int8", NUMEL, encode("int8", coordinator.thetas[4]).to_bytes(),
                                              encode("int8", coordinator.thetas[5] - anchor_values).to_bytes()))

    run(body, download_anchors=1)


@pytest.mark.timeout(120)
def test_fp32_is_always_full_and_bf16_uses_deltas() -> None:
    async def body(coordinator: Coordinator, service: CoordinatorService, server: P2P, p2p: P2P) -> None:
        exact, half = client_for(server, p2p, "none"), client_for(server, p2p, "bf16")
        for _ in range(3):
            coordinator.step()
            v = coordinator.version
            _, theta = await exact.get_model(v)
            assert torch.equal(theta, coordinator.thetas[v]) and exact.anchor is None
            _, theta = await half.get_model(v)
            assert half.anchor is not None
            anchor = decode(EncodedTensor.from_bytes("bf16", NUMEL, half.anchor[2]), NUMEL)
            # bf16 rounds to nearest: half an ulp, ≤ 2⁻⁸ of the value encoded (θ, or the delta from the
            # anchor), plus the fp32 addition
            encoded = coordinator.thetas[v] if half.anchor[0] == v else coordinator.thetas[v] - anchor
            assert bool(((theta - coordinator.thetas[v]).abs() <= encoded.abs() * 2.0**-8 + 2.0**-23 * theta.abs()).all())
        assert (service.downloads.full_sent, service.downloads.deltas_sent) == (1, 2)
        assert exact.counters.get_model.payload_bytes_received == 3 * wire_bytes("none", NUMEL)
        assert half.counters.get_model.payload_bytes_received == 3 * wire_bytes("bf16", NUMEL)

    run(body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_store_chain_of_deltas_telescopes_to_one_error_unlike_naive_deltas(codec: str) -> None:
    """In-process: 50 rounds through the store. A naive delta chain (add Q(θ_v − θ_u) to what the peer
    holds) accumulates error; the anchored one stays at one delta encoding's error."""
    generator = torch.Generator().manual_seed(1)
    numel = 20_000
    theta = torch.randn(numel, generator=generator)
    store = AnchorStore(numel)
    served = store.serve(0, codec, theta, None)
    assert served.delta_from is None
    anchor_body, anchor = served.body, 0
    held = naive = decode(EncodedTensor.from_bytes(codec, numel, served.body), numel)
    previous = theta
    anchored_errors = [float((held - theta).abs().max())]  # round 0: the full download
    naive_errors = [anchored_errors[0]]
    for version in range(1, 51):
        theta = previous - 0.002 * torch.randn(numel, generator=generator)
        served = store.serve(version, codec, theta, anchor)
        assert served.delta_from == anchor == 0
        held = apply_delta(codec, numel, anchor_body, served.body)
        naive = naive + decode(encode(codec, theta - previous), numel)
        error = float((held - theta).abs().max())
        assert error <= served.bound <= error_bound(codec, float(theta.abs().max()))  # ≤ one full encoding's
        anchor_values = decode(EncodedTensor.from_bytes(codec, numel, anchor_body), numel)
        assert served.bound == pytest.approx(
            error_bound(codec, float((theta - anchor_values).abs().max())), rel=1e-3, abs=4 * 2.0**-23 * float(theta.abs().max()))
        anchored_errors.append(error)
        naive_errors.append(float((naive - theta).abs().max()))
        previous = theta
    assert max(anchored_errors[-10:]) <= 1.5 * max(anchored_errors[:10])
    # a naive chain keeps the first full encoding's error and adds one delta error per round; the anchored
    # one carries only the latest delta's
    assert naive_errors[-1] > 4 * max(anchored_errors[1:])
    assert store.serve(50, codec, theta, anchor) is store.serve(50, codec, theta, anchor)  # cached body


def test_messages_and_store_refuse_bad_input() -> None:
    with pytest.raises(MessageError, match="anchor_version"):
        ModelRequest("int8", anchor_version=-1)
    with pytest.raises(MessageError, match="anchor_version"):
        ModelRequest("int8", anchor_version=2**63)
    with pytest.raises(MessageError, match="delta_from"):
        ModelHeader(3, "int8", 10, unchanged=True, delta_from=2)
    with pytest.raises(MessageError, match="delta_from"):
        ModelHeader(3, "none", 10, delta_from=2)
    assert ModelHeader.from_wire(ModelHeader(3, "int8", 10, delta_from=2).to_wire()).delta_from == 2
    store = AnchorStore(10, max_anchors=2)
    with pytest.raises(CodecError, match="in full"):
        store.serve(0, "none", torch.zeros(10), None)
    with pytest.raises(CodecError, match="elements"):
        store.serve(0, "int8", torch.zeros(11), None)
    # a hostile anchor number costs a dictionary lookup: unknown anchors get the full θ, memory stays bounded
    theta = torch.randn(10)
    for anchor in (None, 5, 2**62, 7):
        assert store.serve(1, "int8", theta, anchor).delta_from is None
    for version in range(2, 10):
        store.serve(version, "int8", theta + version, version - 1)
    assert len(store.anchors()) == 2
