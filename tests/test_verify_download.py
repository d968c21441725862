"""Compressed θ downloads with verification on (docs/design.md, "Compressed downloads and verification").

A peer on a lossy download (``runtime.download_codec: int8``, the default) trains from the θ it decoded — a full
encoding of θ_v, or its anchor's full encoding plus the encoded delta θ_v − F_a — not from θ_v. Its submission names
that θ (codec, anchor, sha256 of its fp32 bytes: transport/wire.py SubmitHeader ``theta_*``) and the verifier re-runs
from it, rebuilt with the coordinator's own encoding (transport/delta.py ``decoded_theta``). Pinned here:

* the rebuild is bit for bit what the peer's client decodes, full and delta (:func:`decoded_theta` vs
  :class:`AnchorStore` + :func:`apply_delta`), and :func:`start_theta` refuses a digest that is not that θ's;
* end to end (the real daemon and peer runners over the in-memory transport, every lease checked): honest peers with
  the default config — int8 deltas, verification on, carried and reset inner state — pass every check bitwise;
* a peer that names another θ than the one it decoded (a delta claimed as a full download) fails its check on the
  first delta, naming the digest, and is expelled.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.daemon import JOURNAL_FILE
from asyncloco.coordinator.logic import Lease, Verify
from asyncloco.coordinator.rerun import start_theta
from asyncloco.peer.runner import InnerTrainer, PeerError, PeerOptions, PeerRunner  # (train/inner.py)
from asyncloco.testing.memory import MemoryClient, MemoryTransport, as_actor, drive
from asyncloco.transport.codecs import EncodedTensor, decode
from asyncloco.transport.delta import AnchorStore, apply_delta, decoded_theta, theta_digest
from asyncloco.transport.rpc import TrafficCounters

pytestmark = pytest.mark.timeout(240)


def test_decoded_theta_is_what_the_client_decodes_bit_for_bit() -> None:
    numel = 10_007
    generator = torch.Generator().manual_seed(0)
    theta0 = torch.randn(numel, generator=generator)
    theta1 = theta0 + 0.01 * torch.randn(numel, generator=generator)
    store = AnchorStore(numel)
    full = store.serve(0, "int8", theta0, None)
    assert full.delta_from is None
    peer0 = decode(EncodedTensor.from_bytes("int8", numel, full.body), numel)
    assert torch.equal(peer0, decoded_theta("int8", theta0, None)) and not torch.equal(peer0, theta0)
    delta = store.serve(1, "int8", theta1, 0)
    assert delta.delta_from == 0
    peer1 = apply_delta("int8", numel, full.body, delta.body)
    assert torch.equal(peer1, decoded_theta("int8", theta1, store.anchor_body("int8", 0)))
    assert store.anchor_body("int8", 1) is None and decoded_theta("none", theta1, None) is theta1
    # start_theta: the rebuilt θ when the peer's digest is its digest, None naming the mismatch otherwise
    lease = Lease("l1", "p", 0, 0, 5, 0, 1, 0.0, 0.0, 100.0)
    empty = torch.empty(0)
    task = Verify("p", lease, theta1, empty, "probation", theta_codec="int8", theta_anchor=0,
                  theta_digest=theta_digest(peer1), anchor_body=store.anchor_body("int8", 0))
    rebuilt, why = start_theta(task)
    assert rebuilt is not None and torch.equal(rebuilt, peer1) and why == ""
    claimed_full = Verify("p", lease, theta1, empty, "probation", theta_codec="int8", theta_digest=theta_digest(peer1))
    rebuilt, why = start_theta(claimed_full)
    assert rebuilt is None and "is not θ v1 as the coordinator sent it in int8, in full" in why
    assert start_theta(Verify("p", lease, theta1, empty, "probation"))[0] is theta1  # no claim: θ itself


def test_anchors_kept_on_disk_rebuild_the_same_theta_after_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The download service's anchors outlive its process (AnchorStore.persist, the daemon's ``download-anchors/``): a
    store that loads them rebuilds, bit for bit, the θ a peer decoded from a delta served before the restart; the files
    follow the store's LRU (an evicted anchor's file is deleted); a short, corrupt, surplus or stray file is ignored and
    removed, never loaded; a new run clears the directory."""
    numel, directory = 10_007, tmp_path / "download-anchors"
    generator = torch.Generator().manual_seed(1)
    theta = [torch.randn(numel, generator=generator)]
    for _ in range(3):
        theta.append(theta[-1] + 0.01 * torch.randn(numel, generator=generator))
    before = AnchorStore(numel, max_anchors=2)
    assert before.persist(directory, load=False) == 0
    full = before.serve(0, "int8", theta[0], None)
    delta = before.serve(1, "int8", theta[1], 0)
    assert delta.delta_from == 0
    peer1 = apply_delta("int8", numel, full.body, delta.body)
    rebuilt_before = decoded_theta("int8", theta[1], before.anchor_body("int8", 0))
    assert torch.equal(rebuilt_before, peer1)
    before.serve(2, "int8", theta[2], None)  # a second anchor
    assert sorted(p.name for p in directory.iterdir()) == ["int8-0.bin", "int8-2.bin"]
    del before  # the process and its memory are gone; the files stay

    after = AnchorStore(numel, max_anchors=2)
    assert after.persist(directory, load=True) == 2
    assert after.anchors() == [("int8", 0), ("int8", 2)]  # the newest most recently used
    assert after.anchor_body("int8", 0) == full.body
    rebuilt_after = decoded_theta("int8", theta[1], after.anchor_body("int8", 0))
    assert torch.equal(rebuilt_after, rebuilt_before) and theta_digest(rebuilt_after) == theta_digest(peer1)
    lease = Lease("l1", "p", 0, 0, 5, 0, 1, 0.0, 0.0, 100.0)
    task = Verify("p", lease, theta[1], torch.empty(0), "probation", theta_codec="int8", theta_anchor=0,
                  theta_digest=theta_digest(peer1), anchor_body=after.anchor_body("int8", 0))
    assert torch.equal(start_theta(task)[0], peer1)
    # a reloaded anchor serves deltas as before; a new one evicts the oldest, file and all
    assert after.serve(3, "int8", theta[3], 0).delta_from == 0
    after.serve(3, "int8", theta[3], None)
    assert after.anchors() == [("int8", 0), ("int8", 3)]
    assert sorted(p.name for p in directory.iterdir()) == ["int8-0.bin", "int8-3.bin"]

    # bounded and robust: a short file, a flipped byte, a stray temporary, an anchor beyond max_anchors
    (directory / "int8-3.bin").write_bytes((directory / "int8-3.bin").read_bytes()[:-1])
    flipped = bytearray((directory / "int8-0.bin").read_bytes())
    flipped[-1] ^= 0xFF
    (directory / "int8-5.bin").write_bytes(bytes(flipped))
    (directory / ".int8-6.bin.tmp").write_bytes(b"x")
    (directory / "notes.txt").write_text("not an anchor")  # not the store's: left alone
    with caplog.at_level("WARNING", logger="asyncloco.transport.delta"):
        one = AnchorStore(numel, max_anchors=1)
        assert one.persist(directory, load=True) == 1
    assert one.anchors() == [("int8", 0)] and one.anchor_body("int8", 0) == full.body
    assert "int8-5.bin ignored: its body does not match its digest" in caplog.text
    assert "int8-3.bin ignored:" in caplog.text and "bytes, expected" in caplog.text
    assert sorted(p.name for p in directory.iterdir()) == ["int8-0.bin", "notes.txt"]
    # a new run (no --resume) starts with none
    assert AnchorStore(numel).persist(directory, load=False) == 0
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]


def config(inner_state: str) -> RunConfig:
    return RunConfig.model_validate({
        "task": {"kind": "toy", "dim": 8, "hidden": 4, "points": 512, "eval_points": 64, "num_shards": 2, "batch_size": 8},
        "inner": {"lr": 1e-2},
        "schedule": {"method": "async_dn_dylu", "max_local_steps": 5, "grace_period": 0.0},
        "outer": {"buffer_size": 3},
        "sim": {"workers": 3},
        "runtime": {  # the default download (int8) and verification on, every lease checked
            "snapshot_every": 4, "eval_every": 100000, "lease_slack": 30.0, "speed_report_period": 600.0,
            "gate": {"enabled": False},
            "verify": {"enabled": True, "inner_state": inner_state, "fraction": 1.0, "probation_updates": 2,
                       "horizon": 100000, "queue": 256, "sketch_threshold": 1.0},
        },
    })


class ClaimsFullClient(MemoryClient):
    """Names every θ it decoded as a full download — a delta included: it points the re-run at another θ."""

    def note_decoded(self, version: int, codec: str, anchor: Optional[int], theta: torch.Tensor) -> None:
        self.deltas = getattr(self, "deltas", 0) + (anchor is not None)
        super().note_decoded(version, codec, None, theta)


def start_peer(transport: MemoryTransport, name: str, rounds: int, client_cls: Any = MemoryClient) -> tuple[Any, "asyncio.Task[Any]"]:
    cfg = transport.cfg
    options = PeerOptions(initial_peers=["in-memory"], coordinator_id="coordinator", run_id=cfg.runtime.run_id,
                          progress=False, max_rounds=rounds)
    runner = PeerRunner(options, clock=transport.clock)
    runner.summary.peer_id = name
    runner.speed = 1000.0
    counters = TrafficCounters()
    client = client_cls(transport, name, counters=counters, download_codec=cfg.runtime.download_codec)
    trainer = InnerTrainer.from_config(cfg, transport.workload)
    task = as_actor(name, runner.serve(client, transport.publisher(name, signer=f"key-{name}"), cfg, transport.workload,
                                       trainer, cfg.runtime.codec, counters))
    return client, task


def run(tmp_path: Path, inner_state: str, liar: bool) -> dict[str, Any]:
    cfg = config(inner_state)
    assert cfg.runtime.download_codec == "int8" and cfg.runtime.verify.enabled  # the defaults
    clock = FakeClock()

    async def scenario() -> dict[str, Any]:
        transport = MemoryTransport(cfg, tmp_path / "run", clock=clock)
        await transport.start()
        try:
            peers = {name: start_peer(transport, name, rounds=6) for name in ("h0", "h1")}
            if liar:
                peers["liar"] = start_peer(transport, "liar", rounds=20, client_cls=ClaimsFullClient)
            await drive(clock, {name: task for name, (_, task) in peers.items()}, real_timeout=150.0)
            daemon = transport.daemon
            assert daemon is not None and daemon.verification is not None
            await asyncio.wait_for(daemon.verification.drain(), timeout=60.0)
            service = daemon.serving.service
            return {"state": daemon.node.state, "verification": daemon.verification.status(), "peers": peers,
                    "deltas_sent": service.downloads.deltas_sent, "full_sent": service.downloads.full_sent,
                    "journal": (tmp_path / "run" / JOURNAL_FILE).read_text()}
        finally:
            if transport.daemon is not None and transport.daemon.verification is not None:
                await transport.daemon.verification.close()
            await transport.close()

    return asyncio.run(asyncio.wait_for(scenario(), timeout=200.0))


@pytest.mark.parametrize("inner_state", ["carry", "reset"])
def test_honest_peers_on_the_default_compressed_download_pass_every_check(tmp_path: Path, inner_state: str) -> None:
    import json

    out = run(tmp_path, inner_state, liar=False)
    verdicts = [json.loads(line) for line in out["journal"].splitlines() if '"verdict"' in line]
    verdicts = [v for v in verdicts if v["type"] == "verdict"]
    assert out["deltas_sent"] > 0  # int8 deltas from the peers' anchors were served and checked
    # every lease re-run but those a peer took while its probation checks were on their way (held until they agreed)
    waited = [line for line in out["journal"].splitlines() if '"assign"' in line and "not re-run" in line]
    assert len(verdicts) == 12 - len(waited) >= 4 and all(v["ok"] for v in verdicts), verdicts  # (≥ 2 × probation)
    assert all("bitwise" in v["detail"] for v in verdicts)
    status = out["verification"]
    assert status["failed"] == 0 and status["unverifiable"] == 0 and status["passed"] == len(verdicts)
    for _, task in out["peers"].values():
        assert task.result().rounds == 6


def test_a_peer_naming_another_theta_than_it_decoded_fails_its_check(tmp_path: Path) -> None:
    out = run(tmp_path, "reset", liar=True)
    client, task = out["peers"]["liar"]
    assert client.deltas > 0
    with pytest.raises(PeerError, match="expelled from this run"):
        task.result()
    assert list(out["state"].verification.expelled) == ["liar"]
    assert "is not θ v" in out["state"].verification.expelled["liar"]
    assert out["verification"]["failed"] == 1


def test_the_submit_header_carries_the_decoded_theta_bounded() -> None:
    from asyncloco.transport.errors import MessageError
    from asyncloco.transport.wire import SubmitHeader

    digest = "a" * 64
    # a delta's anchor may be newer than the lease's base (a prefetched newest θ, then the lease's older one)
    for anchor in (None, 3, 7):
        header = SubmitHeader("l", 5, "int8", 10, theta_codec="int8", theta_anchor=anchor, theta_digest=digest)
        assert SubmitHeader.from_wire(header.to_wire()) == header
    assert SubmitHeader("l", 5, "int8", 10).theta_codec is None  # a peer that names nothing: re-run from θ itself
    for bad in ({"theta_codec": "int8", "theta_anchor": 5, "theta_digest": digest},  # its own version is no anchor
                {"theta_codec": "none", "theta_anchor": 3, "theta_digest": digest},  # fp32 is never a delta
                {"theta_codec": "int8"}, {"theta_digest": digest},  # codec and digest together
                {"theta_codec": "int8", "theta_digest": "A" * 64}, {"theta_codec": "zip", "theta_digest": digest}):
        with pytest.raises(MessageError):
            SubmitHeader("l", 5, "int8", 10, **bad)
