"""DHT records on three real hivemind DHT nodes on 127.0.0.1: signed, schema-checked, pinned."""

from __future__ import annotations

from typing import Iterator

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from asyncloco.transport.records import CoordinatorAnnouncement, RunRecords, SpeedRecord

RUN = "testrun"


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    """Three DHT nodes. The third installs no validators and plays the attacker; it runs in client mode
    so that it holds no replicas and every store result below is decided by the two validating nodes."""
    nodes: list[hivemind.DHT] = []
    try:
        nodes.append(hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True))
        for client_mode in (False, True):
            nodes.append(
                hivemind.DHT(
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=nodes[0].get_visible_maddrs(),
                    client_mode=client_mode,
                    start=True,
                )
            )
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


@pytest.fixture(scope="module")
def records(swarm: list[hivemind.DHT]) -> list[RunRecords]:
    return [RunRecords(swarm[0], RUN, RSAPrivateKey()), RunRecords(swarm[1], RUN, RSAPrivateKey())]


def _report(dht: hivemind.DHT, tokens_per_s: float) -> SpeedRecord:
    return SpeedRecord(str(dht.peer_id), tokens_per_s, "cpu", "0.1.0", get_dht_time())


@pytest.mark.timeout(60)
def test_speed_report_is_readable_by_others_and_cannot_be_overwritten(
    swarm: list[hivemind.DHT], records: list[RunRecords]
) -> None:
    mine, other = records
    report = _report(swarm[0], 1234.5)
    assert mine.publish_speed(report, ttl_s=60)
    assert other.publish_speed(_report(swarm[1], 99.0), ttl_s=60)
    seen = other.read_speeds()
    assert seen[str(swarm[0].peer_id)] == report
    assert seen[str(swarm[1].peer_id)].tokens_per_s == 99.0

    forged = dict(peer_id=report.peer_id, tokens_per_s=1.0, device="cpu", software_version="x", last_seen=1.0)
    # A validating node refuses to sign for someone else's key (no signature -> rejected everywhere).
    assert not swarm[1].store(f"{RUN}_speed", forged, get_dht_time() + 60, subkey=mine.local_public_key)
    # A node without validators sends it unsigned, or with a made-up signature: every validating node
    # rejects the store.
    assert not swarm[2].store(f"{RUN}_speed", forged, get_dht_time() + 60, subkey=mine.local_public_key)
    signed_blob = forged | {"device": "cpu[signature:" + "A" * 64 + "]"}
    assert not swarm[2].store(f"{RUN}_speed", signed_blob, get_dht_time() + 60, subkey=mine.local_public_key)
    for reader in records:
        assert reader.read_speeds()[report.peer_id] == report


@pytest.mark.timeout(60)
def test_schema_invalid_records_are_rejected(swarm: list[hivemind.DHT], records: list[RunRecords]) -> None:
    mine = records[0]
    report = _report(swarm[0], 7.0)
    assert mine.publish_speed(report, ttl_s=60)
    good = dict(peer_id="p", tokens_per_s=1.0, device="cpu", software_version="v", last_seen=1.0)
    for bad in (
        {**good, "tokens_per_s": 5},  # int where a float is required: no silent conversion
        {**good, "tokens_per_s": -1.0},
        {**good, "tokens_per_s": float("nan")},
        {**good, "extra": 1},
        {key: value for key, value in good.items() if key != "device"},
    ):
        assert not swarm[0].store(f"{RUN}_speed", bad, get_dht_time() + 60, subkey=mine.local_public_key), bad
    assert records[1].read_speeds()[report.peer_id] == report
    with pytest.raises(ValueError):  # the typed API refuses locally with a readable error
        mine.publish_speed(SpeedRecord("p", float("inf"), "cpu", "v", 1.0), ttl_s=60)


@pytest.mark.timeout(60)
def test_find_coordinator_ignores_impostors(swarm: list[hivemind.DHT], records: list[RunRecords]) -> None:
    coordinator, impostor = records
    now = get_dht_time()
    real = CoordinatorAnnouncement(
        str(swarm[0].peer_id), tuple(map(str, swarm[0].get_visible_maddrs())), RUN, 1000, "int8", 3, now
    )
    assert coordinator.announce_coordinator(real, ttl_s=60)
    # An impostor announces itself (newer timestamp), and also claims the real peer id.
    fake_self = CoordinatorAnnouncement(str(swarm[1].peer_id), ("/ip4/127.0.0.1/tcp/1",), RUN, 5, "none", 9, now + 5)
    fake_claim = CoordinatorAnnouncement(real.peer_id, ("/ip4/127.0.0.1/tcp/1",), RUN, 5, "none", 9, now + 10)
    assert impostor.announce_coordinator(fake_self, ttl_s=60)
    assert impostor.find_coordinator(real.peer_id) == real  # a fresher record from another peer id is ignored
    assert impostor.announce_coordinator(fake_claim, ttl_s=60)  # same signing key: replaces fake_self
    assert impostor.find_coordinator(real.peer_id, pinned_public_key=coordinator.local_public_key) == real
    assert impostor.find_coordinator("12D3KooWNobodyAnnouncedThis") is None
    # Without a pinned key, the claim of the pinned id is returned; libp2p still authenticates the id.
    assert impostor.find_coordinator(real.peer_id) == fake_claim
    with pytest.raises(ValueError, match="run"):
        coordinator.announce_coordinator(CoordinatorAnnouncement(real.peer_id, real.multiaddrs, "other", 1, "none", 0, now), 60)
