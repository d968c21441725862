"""Validator peers (asyncloco/validator.py, coordinator/validators.py; docs/threat-model.md "Who verifies").

1. The lending desk on its own (a fake clock, no network): a check lent to a validator that does not answer within
   ``validator_timeout`` goes back to the queue and to the next validator; the first one's late verdict is refused;
   the second one's becomes the ``Verified`` decision, naming it; only listed peers are served.
2. Over real hivemind peers in real processes: with ``runtime.verify.local: false`` every check of the run is re-run
   by a validator peer (`asyncloco validator join`), which catches the hostile client's hidden direction: the
   attacker is expelled on the validator's verdict and θ repaired; an unlisted validator is refused and exits,
   naming the fix.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from asyncloco.clock import FakeClock
from asyncloco.config import RunConfig
from asyncloco.coordinator.logic import Lease, Verify
from asyncloco.coordinator.validators import ValidatorDesk
from asyncloco.coordinator.verify import Verifier
from asyncloco.local_cluster import LocalCluster
from asyncloco.refusals import Refusal, RefusalCode
from asyncloco.transport.wire import VerdictHeader
from asyncloco.validator import identity_peer_id

sys.path.insert(0, str(Path(__file__).parent))
from test_attacks import assert_all_gone, read_json, start_hostile  # noqa: E402
from test_verify_hostile import write_config as verify_config  # noqa: E402

V1, V2, OUTSIDER = "Qm" + "a" * 44, "Qm" + "b" * 44, "Qm" + "c" * 44


class _Verification:
    """What the desk reads of coordinator/verify.py's DaemonVerification."""

    def __init__(self, clock: FakeClock) -> None:
        self.knobs = SimpleNamespace(validators=[V1, V2], validator_timeout=30.0, local=False)
        self.port = SimpleNamespace(node=SimpleNamespace(clock=clock, state=SimpleNamespace(params=torch.zeros(6))))
        self.verifier = Verifier(None, self._never, capacity=4, clock=clock.monotonic)  # type: ignore[arg-type]
        self.decided: list[tuple[str, bool, str]] = []
        self.unverified: list[str] = []

    async def _never(self, task: Any, comparison: Any) -> None:
        raise AssertionError("the local worker does not run here")

    async def judged(self, task: Verify, ok: bool, bitwise: bool, rel: float, cosine: float, detail: str,
                     revealed: Optional[bytes] = None) -> None:
        self.decided.append((task.lease.lease_id, ok, detail))

    def unverified_later(self, task: Verify, reason: str) -> None:
        self.unverified.append(reason)


def _check(lease_id: str) -> Verify:
    lease = Lease(lease_id, "QmPeer", 1, 4, 3, 7, 2, 0.0, 0.0, 0.0)
    return Verify("QmPeer", lease, torch.arange(6.0), torch.full((6,), 0.5), "probation", state_start="", state_end="")


@pytest.mark.timeout(60)
def test_a_check_a_validator_sits_on_goes_to_the_next_one_and_the_late_verdict_is_refused() -> None:
    async def main() -> None:
        clock = FakeClock()
        verification = _Verification(clock)
        desk = ValidatorDesk(verification)
        assert verification.verifier.offer(_check("L1"))
        with pytest.raises(Refusal) as refused:
            await desk.lend(0.0, OUTSIDER)
        assert refused.value.code == RefusalCode.NOT_ADMITTED and "runtime.verify.validators" in str(refused.value)

        header, bodies = await desk.lend(5.0, V1)
        assert (header.lease_id, header.peer, header.base_version, header.shard, header.start_offset, header.steps,
                header.lr_offset, header.numel, header.revealed) == ("L1", "QmPeer", 2, 1, 4, 3, 7, 6, None)
        assert bytes(bodies[0]) == torch.arange(6.0).numpy().tobytes() and bytes(bodies[1]) == torch.full((6,), 0.5).numpy().tobytes()
        empty, nothing = await desk.lend(0.0, V2)  # the only check is lent out
        assert empty.empty and nothing == [] and desk.status()["out"] == 1

        await clock.wait_for_sleeper()  # the loan's expiry
        await clock.advance(30.0)  # V1's time runs out: the check goes back to the queue
        for _ in range(100):
            if desk.stats.returned:
                break
            await asyncio.sleep(0)
        assert desk.stats.returned == 1 and desk.lent == {} and verification.verifier.queue.qsize() == 1
        again, _ = await desk.lend(5.0, V2)
        assert again.lease_id == "L1"

        late = await desk.take_verdict(VerdictHeader("L1", False, False, 0.0, "relative error 2"), V1)
        assert not late.accepted and "not lent to this validator" in late.reason and verification.decided == []
        taken = await desk.take_verdict(VerdictHeader("L1", True, True, 1.0, "bitwise equal to the re-run", 0.0), V2)
        assert taken.accepted and verification.decided == [("L1", True, f"bitwise equal to the re-run (validator {V2[-8:]})")]
        assert desk.status() == {"lent": 2, "judged": 1, "returned": 1, "by": {V2: 1}, "out": 0, "local": False, "listed": 2}
        assert verification.verifier.stats.rerun_steps == 3 and verification.verifier.stats.queued == 1
        assert verification.verifier.idle.is_set() and verification.unverified == []
        desk.close()

    asyncio.run(main())


def test_check_and_verdict_messages_refuse_bad_fields() -> None:
    from asyncloco.transport.errors import MessageError
    from asyncloco.transport.wire import CheckHeader, CheckRequest

    full = {"numel": 6, "lease_id": "L1", "peer": "QmPeer", "base_version": 2, "shard": 1, "start_offset": 4,
            "steps": 3, "lr_offset": 7, "device_class": "cpu/AVX2/torch 2.13.0+cpu"}
    assert CheckHeader.from_wire(full).to_wire() == full and CheckHeader.from_wire({"numel": 6}).empty
    for bad, field in [({**full, "steps": 0}, "steps"), ({k: v for k, v in full.items() if k != "shard"}, "lease_id"),
                       ({**full, "numel": 0}, "numel"), ({**full, "revealed": -1}, "revealed"),
                       ({**full, "state_start": "xyz"}, "state_start"), ({**full, "device_class": "a\nb"}, "device_class")]:
        with pytest.raises(MessageError, match=f"CheckHeader.{field}"):
            CheckHeader.from_wire(bad)
    with pytest.raises(MessageError, match="CheckRequest.wait_s"):
        CheckRequest.from_wire({"wait_s": 601.0})
    with pytest.raises(MessageError, match="VerdictHeader.cosine"):
        VerdictHeader.from_wire({"lease_id": "L1", "ok": True, "bitwise": True, "cosine": 1.5, "detail": ""})
    with pytest.raises(MessageError, match="VerdictHeader.ok"):
        VerdictHeader.from_wire({"lease_id": "L1", "ok": 1, "bitwise": True, "cosine": 1.0, "detail": ""})


def test_config_names_the_validator_fix() -> None:
    base = {"name": "v", "runtime": {"verify": {"enabled": True, "local": False}}}
    with pytest.raises(ValueError, match="nobody would re-run the checks"):
        RunConfig.model_validate(base)
    with pytest.raises(ValueError, match="is not a libp2p peer id"):
        RunConfig.model_validate({"name": "v", "runtime": {"verify": {"validators": ["not-an-id"]}}})
    cfg = RunConfig.model_validate({"name": "v", "runtime": {"verify": {"enabled": True, "local": False, "validators": [V1]}}})
    assert cfg.runtime.verify.validators == [V1]
    # a re-run starts from the θ the peer decoded (coordinator/rerun.py start_theta): a lossy θ download goes with
    # verification, which is on by default, and int8 is the default download
    for verify in ({"enabled": True}, {}, {"enabled": False}):
        assert RunConfig.model_validate({"name": "v", "runtime": {"verify": verify}}).runtime.download_codec == "int8"
        assert RunConfig.model_validate({"name": "v", "runtime": {"download_codec": "bf16", "verify": verify}})


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_validator_peer_reruns_every_check_and_its_verdict_expels_the_attacker(tmp_path: Path) -> None:
    key, outsider_key = tmp_path / "validator.key", tmp_path / "outsider.key"
    validator_id = identity_peer_id(str(key))
    assert identity_peer_id(str(key)) == validator_id != identity_peer_id(str(outsider_key))
    cluster = LocalCluster(verify_config(tmp_path, local=False, validators=[validator_id]), tmp_path / "run", threads=1)
    try:
        cluster.start_coordinator()
        cluster.start_validator("validator", key)
        outsider = cluster.start_validator("outsider", outsider_key)
        cluster.start_peer("honest", 1.0)
        hostile, summary_path = start_hostile(cluster, "mallory", "honest,hidden", "--rounds", "10000")
        cluster.wait_for(lambda: [e for e in cluster.events() if e.get("type") == "expelled"], 300, "the expulsion")
        cluster.wait_for(lambda: hostile.poll() is not None, 120, "the hostile client to stop")
        version = cluster.status().get("version", 0)
        cluster.wait_for(lambda: cluster.status().get("version", 0) >= version + 2, 120, "2 more honest updates")
        cluster.wait_for(lambda: outsider.poll() is not None, 120, "the unlisted validator to exit")
        cluster.wait_for(lambda: read_json(cluster.workdir / "validator.json").get("checks", 0) >= 4, 120,
                         "the validator's summary of 4 verdicts")
    finally:
        cluster.close()
    assert_all_gone(cluster)

    assert outsider.returncode != 0
    assert "not a validator of this run" in (cluster.workdir / "outsider.log").read_text()
    mallory = read_json(summary_path)["peer_id"]
    submits = [c for c in read_json(summary_path)["calls"] if c["call"] == "submit" and c["ok"]]
    assert [c["attack"] for c in submits[:2]] == ["honest", "hidden"], submits
    hidden_lease = submits[1]["lease_id"]
    events = cluster.events()
    verdicts = [e for e in events if e.get("type") == "verdict"]
    # local: false — every check was re-run by the validator peer, and its verdict names it
    assert verdicts and all(v["detail"].endswith(f"(validator {validator_id[-8:]})") for v in verdicts), verdicts
    bad = [v for v in verdicts if not v["ok"]]
    assert [(v["peer"], v["lease_id"]) for v in bad] == [(mallory, hidden_lease)], bad
    assert bad[0]["detail"].startswith("relative error 2 (cosine "), bad[0]
    assert all(v["ok"] for v in verdicts if v["peer"] != mallory)
    out = [e for e in events if e.get("type") == "expelled"]
    assert [(e["peer"], e["lease_id"]) for e in out] == [(mallory, hidden_lease)], out
    # caught on its probation: its later leases waited for those checks, so nothing of it reached θ unchecked and the
    # expulsion asks for no repair — or, had one of them been applied before its verdict, exactly one repair ran
    repairs = [e for e in events if e.get("type") == "repaired"]
    assert len(repairs) == (1 if out[0]["repair"] else 0), (out, repairs)
    summary = read_json(cluster.workdir / "validator.json")
    assert summary["peer_id"] == validator_id and summary["failed"] == 1 and summary["errors"] == 0
    assert summary["checks"] == summary["passed"] + 1 and {v["lease_id"] for v in summary["verdicts"]} <= {v["lease_id"] for v in verdicts}
    status = json.loads((cluster.checkpoint_dir / "status.json").read_text())["verification"]
    assert status["validators"]["judged"] == len(verdicts) == status["validators"]["by"][validator_id]
    assert status["validators"]["local"] is False and status["failed"] == 1 and mallory in status["expelled"]
