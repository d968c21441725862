"""Attack benchmark: final validation perplexity of the demo run under each attack, gate on and off.

Every run is the demo config (``configs/demo.yaml``: tiny Llama, embedded corpus, async DN + DyLU, its upload codec)
with three honest peers at slowdowns 1, 1.5 and 4 as real processes on 127.0.0.1, plus for each attack
one extra peer — :mod:`asyncloco.testing.hostile`, admitted (the demo's admission is ``open``: an
insider, so admission is no defence here) — for the same wall time (``--duration`` seconds from the
moment the three honest peers have joined; the extra peer is started then). The clean run (the three honest peers alone) is measured in the same
invocation, with the gate on and with it off (``runtime.gate.enabled``), as the reference. After each
run the coordinator is stopped (its final snapshot) and θ is evaluated here on the run's validation
set, so "final perplexity" is exactly the model the run ended with.

Rows (the gate's table): ``clean``, ``honest`` (a 4th honest peer), ``huge`` (one update ×1e30,
then honest work), ``signflip`` (×1000), ``signflip-honest`` (at its honest norm), ``random`` (random
direction at its honest norm), ``ghost`` (only a DHT speed record claiming 1e12 tokens/s); ``--attacks``
adds others of the hostile peer (``nan``, ``replay``, ``other-lease``, ``ghost-forge``).

``--updates N`` ends every run instead when θ has had N applied updates (``--duration`` then caps it):
on a machine shared with other work, equal wall time is not equal compute — in one gate-off invocation
at 40 s the clean run got 58 updates and the ghost run 26, so the load decided, not the attack. At an
equal number of applied updates an attack still shows its harm: a clipped or accepted hostile update is
one of the N, and shortened leases (the ghost) bring less training per update. ``--honest-updates N`` ends a
run when the honest peers' applied updates (the journal's ``applied`` lines) reach N — with ``--verify`` a repair
discards an expelled attacker's updates, so equal θ versions are not equal useful work.

Verification rows (``--attacks ... --gate on``): ``hidden:S`` (honest work plus S × its norm along a fixed hidden
direction), ``poison`` (AdamW on batches half replaced by one trigger sequence), ``alie`` (μ − z·σ from the θ
versions it downloads), ``tailored`` (just inside the cosine bar at the median norm, the rest along the hidden
direction), ``freeride`` (echoes the newest θ difference). A row ``NAME[:S]xK`` runs K colluding identities
(one direction seed), ``--colluders K`` makes it the default; a row ending in ``@foreign`` names another compute
class than the coordinator's in its submissions (its checks get the cross-device tolerance instead of bitwise
equality: ``hidden:0.009@foreign`` hides just inside the fp32 default of 0.01). ``--verify`` keeps verification
(on by default: the carried inner state checked through the reveal RPC) in every run; without it every run sets
``runtime.verify.enabled: false`` and the gate is measured alone. Per run it also reports the cosine of θ − θ₀ with the
hidden direction, the loss on the trigger sequence (the backdoor metric; the clean runs give its spread), and
how many of the attackers' updates verification failed and whether they were expelled; ``--new`` runs
the verification rows.

Usage::

    python scripts/bench_attacks.py                                  # the whole table, ~35 min
    nice -n 10 python scripts/bench_attacks.py --gate on --updates 45 --duration 240 --json runs/bench-attacks-on.json
    nice -n 10 python scripts/bench_attacks.py --gate off --duration 40       # the damage without the gate
    nice -n 10 python scripts/bench_attacks.py --duration 30 --attacks signflip --gate on   # a quick check

Prints per run: final perplexity, its ratio to the clean run of the same gate setting, and the
coordinator's verdicts (applied / rejected / clipped updates of the hostile and of the honest peers); then
the gate's acceptance checks for the gate-on runs (every attack ≤ 1.25 × clean; the clean run's gate
rejected or clipped ≤ 2 % of the honest updates).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncloco.local_cluster import ClusterError, LocalCluster  # noqa: E402

logger = logging.getLogger("bench_attacks")

TABLE = ["honest", "huge", "signflip", "signflip-honest", "random", "ghost"]
NEW = ["hidden:0.5", "hidden:1", "hidden:2", "poison", "sandbag", "sleeper", "forge-state", "forge-state@foreign", "alie",
       "tailored", "freeride", "hidden:2x3"]
DIRECTION_SEED, TRIGGER_SEED = 1234, 4321  # asyncloco.testing.hostile's defaults
SLOWDOWNS: tuple[float, ...] = (1.0, 1.5, 4.0)


@dataclass
class Result:
    attack: str
    gate: bool
    duration_s: float  # wall seconds the run had (from when the honest peers had joined)
    perplexity: float
    version: int
    local_updates: int
    hostile: dict[str, int] = field(default_factory=dict)  # applied / rejected / clipped of the extra peer
    honest: dict[str, int] = field(default_factory=dict)  # the same, summed over the honest peers
    ratio: Optional[float] = None  # perplexity / the clean run's with the same gate setting
    max_abs_theta: float = 0.0
    hidden_cosine: float = math.nan  # cosine of θ − θ₀ with the hidden direction
    trigger_loss: float = math.nan  # the loss on the poisoner's trigger sequence
    identities: int = 0  # hostile processes
    verification: dict[str, int] = field(default_factory=dict)  # the attackers': checked / failed / expelled
    honest_steps: int = 0  # local steps of the honest peers' applied leases (applied_steps)
    # the run's repairs: the remedy installed and the validation loss of the θ it replaced and of the θ it installed
    repairs: list[dict[str, Any]] = field(default_factory=list)
    caught_after: Optional[int] = None  # tampered submissions the coordinator took from an attacker before its expulsion
    caught_on: Optional[int] = None  # which of its tampered leases (1 = the first) the failed check was drawn on
    honest_suspect: int = 0  # honest leases re-run because the update sketch made their peer a suspect
    # how far each peer's updates rise against its own history (own_history_rises): honest vs tampered
    rises: dict[str, Any] = field(default_factory=dict)
    held_staleness: float = math.nan  # mean staleness of the updates that waited for their check (all peers)
    staleness: float = math.nan  # mean staleness of the other applied updates
    # the perplexity of the θ this same run would have had without the attackers' submissions (its log replayed with
    # them discarded, every other decision as live: without_attackers), and this run's × that (its trace on θ)
    without_perplexity: Optional[float] = None
    trace: Optional[float] = None


# the compute class a row ending in "@foreign" claims (its checks then get the cross-device tolerance, not bitwise)
FOREIGN_CLASS = "cuda/NVIDIA H100 80GB HBM3 cuda 13.0/torch 2.11.0+cu130"


def parse_row(row: str, colluders: int) -> tuple[str, Optional[float], int]:
    """``NAME[:SCALE][xK][@foreign]`` → (attack, scale or None, identities)."""
    row = row.removesuffix("@foreign")
    name, count = row, colluders
    if "x" in row.rsplit(":", 1)[-1] and row.rsplit("x", 1)[-1].isdigit():
        name, k = row.rsplit("x", 1)
        count = int(k)
    attack, _, scale = name.partition(":")
    return attack, (float(scale) if scale else None), max(1, count)


def write_config(base: Path, directory: Path, gate: bool, verify: bool = False, run_id: Optional[str] = None) -> Path:
    config = yaml.safe_load(base.read_text())
    runtime = config.setdefault("runtime", {})
    runtime["run_id"] = run_id or f"bench-{uuid.uuid4().hex[:10]}"
    runtime.setdefault("gate", {})["enabled"] = gate
    # verification is on by default (the carried inner state); without --verify the gate is measured alone
    runtime["verify"] = {**runtime.get("verify", {}), "enabled": verify}
    runtime["wal_archive"] = True  # the whole log stays: without_attackers replays it from the run's start
    # the base config's upload codec stands: the hostile client (asyncloco/testing/hostile.py) keeps an error-feedback
    # residual as a peer does, committed and revealed with its inner state
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def verdicts(events: list[dict[str, Any]], peers: set[str]) -> dict[str, int]:
    out = {"applied": 0, "rejected": 0, "clipped": 0}
    for event in events:
        if event.get("peer") not in peers:
            continue
        if event.get("type") == "applied":
            out["applied"] += 1
            out["clipped"] += int("clipped" in str(event.get("gate", "")) or "clipped" in str(event.get("reason", "")))
        elif event.get("type") == "rejected" and event.get("lease_id"):
            out["rejected"] += 1
    return out


def applied_steps(events: list[dict[str, Any]], peers: set[str]) -> int:
    """Local steps of ``peers``' applied leases (their leases' ``steps`` in the journal's ``assign`` records), less
    those a repair discarded: the useful compute a run's θ holds, to read its perplexity against (DyLU gives each
    lease steps by the peers' measured speeds, so equal updates are not equal compute)."""
    steps = {e["lease_id"]: int(e.get("steps", 0)) for e in events if e.get("type") == "assign" and e.get("lease_id")}
    return sum(steps.get(e.get("lease_id", ""), 0) for e in events
               if e.get("type") == "applied" and e.get("peer") in peers)


def verification(events: list[dict[str, Any]], peers: set[str]) -> dict[str, int]:
    """The attackers' verification verdicts in the journal (coordinator/verify.py writes ``verdict`` and ``expelled``)."""
    mine = [e for e in events if e.get("peer") in peers]
    return {"checked": sum(e.get("type") == "verdict" for e in mine),
            "failed": sum(e.get("type") == "verdict" and e.get("ok") is False for e in mine),
            "expelled": len({e["peer"] for e in mine if e.get("type") == "expelled"})}


def signal_marks(events: list[dict[str, Any]], hostile: set[str]) -> dict[str, dict[str, int]]:
    """The cheap signals' marks (coordinator/gate.py ``suspect``) on the run's honest and hostile updates, from its
    journal: ``refused`` (a counted rejection), ``weak`` (applied with weak agreement), ``close`` (applied at cosine
    >= the smallest close bar, ``GatePolicy.suspect_cosine``: an upper bound on the close marks, whose bar can be
    higher where the consensus is tight), ``any`` (an update with at least one)."""
    import re

    from asyncloco.coordinator.gate import GatePolicy

    bar = GatePolicy().suspect_cosine
    out = {who: {"updates": 0, "refused": 0, "weak": 0, "close": 0, "any": 0} for who in ("honest", "hostile")}
    for event in events:
        kind = event.get("type")
        if kind not in ("applied", "rejected") or not event.get("peer") or (kind == "rejected" and not event.get("lease_id")):
            continue
        row = out["hostile" if event["peer"] in hostile else "honest"]
        text = str(event.get("gate", "")) if kind == "applied" else str(event.get("reason", ""))
        found = re.search(r"cosine (-?[0-9.]+)", text)
        refused = kind == "rejected" and "not counted" not in text
        weak = kind == "applied" and "weak agreement" in text
        close = kind == "applied" and found is not None and float(found.group(1)) >= bar
        row["updates"] += 1
        row["refused"] += refused
        row["weak"] += weak
        row["close"] += close
        row["any"] += refused or weak or close
    return out


def repairs_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's repairs (the journal's ``repaired`` records): whose, the remedy, the losses before and after."""
    return [{"peer": e.get("peer", "")[-8:], "remedy": e.get("remedy", ""), "loss_before": e.get("loss_before"),
             "loss_after": e.get("loss_after"), "losses": e.get("losses", {}), "substituted": e.get("substituted", 0),
             "discarded": e.get("discarded", 0)} for e in events if e.get("type") == "repaired"]


def tampered_before_caught(summaries: list[Path], events: list[dict[str, Any]]) -> Optional[int]:
    """For attackers that were expelled: the most tampered submissions the coordinator accepted from one of them
    (its ``submit`` calls whose round attack was not honest work; a sleeper's honest leases do not count); None when
    none was expelled."""
    expelled = {e.get("peer") for e in events if e.get("type") == "expelled"}
    counts = []
    for path in summaries:
        summary = json.loads(path.read_text())
        if summary.get("peer_id") not in expelled:
            continue
        counts.append(sum(1 for c in summary.get("calls", []) if c.get("call") == "submit" and c.get("accepted")
                          and not c.get("duplicate") and c.get("attack") not in ("honest", None)))
    return max(counts) if counts else None


RISE_SKIP = 3  # a peer's first updates (probation, a fresh AdamW state) have no history to rise against
RISE_WINDOW = 4  # the median of the peer's last 4 updates is its own history


def own_history_rises(run: Path, hostile: set[str]) -> dict[str, Any]:
    """The candidate sleeper signals, measured on a finished run: for each submission in the write-ahead log (past a
    peer's first ``RISE_SKIP``), the log-ratio of its per-step norm to the median of the peer's last ``RISE_WINDOW``,
    and the rise of its sketch score (coordinator/sketch.py: its residual against the consensus, cosine with its
    previous residual) over the median of its last scores. Returns the honest updates' count, maxima and 98th
    percentiles, and the rises of the attackers' tampered submissions (their ``hostile*.json`` rounds)."""
    from statistics import median

    from asyncloco.coordinator.logic.events import SubmitUpdate
    from asyncloco.coordinator.node import EVENT_TYPES
    from asyncloco.coordinator.repair import log_events
    from asyncloco.coordinator.sketch import SketchState, Sketcher, observe

    coordinator = run / "coordinator"
    numel = int(json.loads((coordinator / "events.jsonl").open().readline()).get("numel", 0))
    steps = {e["lease_id"]: int(e.get("steps", 1)) for e in map(json.loads, (coordinator / "events.jsonl").open())
             if e.get("type") == "assign" and e.get("lease_id")}
    tampered = {c.get("lease_id") for p in run.glob("hostile*.json") for c in json.loads(p.read_text()).get("calls", [])
                if c.get("call") == "submit" and c.get("attack") not in ("honest", None)}
    sketcher, sketches = Sketcher(b"bench", numel), SketchState()
    history: dict[str, list[tuple[float, float | None]]] = {}
    rises: dict[str, list[tuple[float, float]]] = {"honest": [], "tampered": []}

    def events() -> Any:
        try:
            yield from log_events(coordinator / "wal", 0, 1 << 62, EVENT_TYPES, numel)
        except ValueError:  # the end of the log
            return

    for event, _ in events():
        if not isinstance(event, SubmitUpdate) or event.lease_id not in steps:
            continue
        per_step = float(event.pseudo_gradient.norm()) / max(1, steps[event.lease_id])
        score = observe(sketches, sketcher(event.pseudo_gradient), event.peer, set(history) | {event.peer}, 1.0, 0)
        past = history.setdefault(event.peer, [])
        if len(past) >= RISE_SKIP and per_step > 0:
            norms = [math.log(n) for n, _ in past[-RISE_WINDOW:] if n > 0]
            scores = [s for _, s in past[-RISE_WINDOW:] if s is not None]
            rise = (math.log(per_step) - median(norms), (score - median(scores)) if score is not None and scores else 0.0)
            who = "tampered" if event.lease_id in tampered else "honest" if event.peer not in hostile else ""
            if who:
                rises[who].append(rise)
        past.append((per_step, score))

    def spread(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"max": ordered[-1], "p98": ordered[min(len(ordered) - 1, int(0.98 * len(ordered)))]} if ordered else {}

    return {"honest_updates": len(rises["honest"]),
            "honest_norm_rise": spread([math.exp(n) for n, _ in rises["honest"]]),
            "honest_score_rise": spread([s for _, s in rises["honest"]]),
            "tampered_norm_rise": [round(math.exp(n), 3) for n, _ in rises["tampered"][:5]],
            "tampered_score_rise": [round(s, 3) for _, s in rises["tampered"][:5]]}


def caught_and_repaired(events: list[dict[str, Any]]) -> bool:
    """A failed check, and the repair its expulsion asked for (if any) done: the run may end there (ending it between
    the two leaves the attacker's unchecked updates in θ, which the repair would have taken out)."""
    if not any(e.get("type") == "verdict" and e.get("ok") is False for e in events):
        return False
    asked = {e.get("peer") for e in events if e.get("type") == "expelled" and str(e.get("repair")) == "True"}
    return asked <= {e.get("peer") for e in events if e.get("type") == "repaired"}


def tampered_caught_on(summaries: list[Path], events: list[dict[str, Any]]) -> Optional[int]:
    """For attackers that were expelled: the position, among its accepted tampered submissions (1 = the first), of the
    lease whose failed check expelled it — the sampling's catch, apart from the tampered leases the attacker got in
    while that check was still running (``tampered_before_caught`` counts those too); the latest over attackers."""
    failed = {e.get("lease_id") for e in events if e.get("type") == "verdict" and e.get("ok") is False}
    positions = []
    for path in summaries:
        summary = json.loads(path.read_text())
        tampered = [c.get("lease_id") for c in summary.get("calls", []) if c.get("call") == "submit" and c.get("accepted")
                    and not c.get("duplicate") and c.get("attack") not in ("honest", None)]
        caught = [i + 1 for i, lease_id in enumerate(tampered) if lease_id in failed]
        if caught:
            positions.append(caught[0])
    return max(positions) if positions else None


def holding(events: list[dict[str, Any]], honest: set[str]) -> dict[str, float]:
    """Honest leases re-run as suspects of the update sketch, and the mean staleness of held vs other applied updates."""
    held = {e["lease_id"] for e in events if e.get("type") == "held"}
    applied = [e for e in events if e.get("type") == "applied"]
    waited = [float(e.get("staleness", 0)) for e in applied if e.get("lease_id") in held]
    other = [float(e.get("staleness", 0)) for e in applied if e.get("lease_id") not in held]
    return {
        "honest_suspect": float(sum(1 for e in events if e.get("type") == "assign" and e.get("peer") in honest
                                    and str(e.get("verify", "")).startswith("suspect: its updates"))),
        "held_staleness": sum(waited) / len(waited) if waited else math.nan,
        "staleness": sum(other) / len(other) if other else math.nan,
    }


def verification_cost(events: list[dict[str, Any]]) -> dict[str, float]:
    """From a run's journal with ``runtime.verify`` on: the steps re-run (leases with a verdict) and the steps of
    every applied update (the run's training), and the seconds from an update's application to its verdict."""
    applied = {e["lease_id"]: e for e in events if e.get("type") == "applied" and e.get("lease_id")}
    # a checked lease is held from its submission until its verdict (the journal's held record), then applied
    submitted = {**applied, **{e["lease_id"]: e for e in events if e.get("type") == "held" and e.get("lease_id")}}
    verdicts = [e for e in events if e.get("type") == "verdict" and e.get("lease_id") in applied]
    latency = sorted(float(v["time"]) - float(submitted[v["lease_id"]]["time"]) for v in verdicts)
    return {
        "rerun_steps": float(sum(int(applied[v["lease_id"]].get("steps", 0)) for v in verdicts)),
        "trained_steps": float(sum(int(e.get("steps", 0)) for e in applied.values())),
        "verdicts": float(len(verdicts)),
        "latency_median_s": latency[len(latency) // 2] if latency else math.nan,
        "latency_max_s": latency[-1] if latency else math.nan,
    }


def signals_table(directories: list[Path]) -> list[str]:
    """``--signals``: every finished run under ``directories`` (their ``*/run`` folders), the signals' marks on honest
    updates (the false positives) and on the attackers', per row."""
    rows: dict[str, dict[str, dict[str, int]]] = {}
    for directory in directories:
        for run in sorted(directory.glob("*/run")):
            journal = run / "coordinator" / "events.jsonl"
            if not journal.exists():
                continue
            hostile = {json.loads(p.read_text()).get("peer_id", "") for p in run.glob("hostile*.json")} - {""}
            events = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
            row = run.parent.name.split("-gate-")[0]
            total = rows.setdefault(row, {who: {} for who in ("honest", "hostile")})
            for who, counts in signal_marks(events, hostile).items():
                for key, value in counts.items():
                    total[who][key] = total[who].get(key, 0) + value
    lines = ["| row | who | updates | refused (counted) | weak agreement | close to an echo (≤) | any mark |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row, whos in rows.items():
        for who, c in whos.items():
            if c.get("updates"):
                lines.append(f"| {row} | {who} | {c['updates']} | {c['refused']} | {c['weak']} | {c['close']} | "
                             f"{c['any']} ({100 * c['any'] / c['updates']:.1f} %) |")
    costs: dict[str, list[dict[str, float]]] = {}
    for directory in directories:
        for run in sorted(directory.glob("*/run")):
            journal = run / "coordinator" / "events.jsonl"
            if journal.exists():
                cost = verification_cost([json.loads(x) for x in journal.read_text().splitlines() if x.strip()])
                if cost["verdicts"]:
                    costs.setdefault(run.parent.name.split("-gate-")[0], []).append(cost)
    if costs:
        lines += ["", "| row | runs | verdicts | re-run steps / trained steps | verdict latency median / max (s) |",
                  "|---|---:|---:|---:|---|"]
        for row, group in costs.items():
            rerun, trained = sum(c["rerun_steps"] for c in group), sum(c["trained_steps"] for c in group)
            lines.append(f"| {row} | {len(group)} | {sum(c['verdicts'] for c in group):.0f} | "
                         f"{rerun:.0f} / {trained:.0f} ({100 * rerun / max(trained, 1):.0f} %) | "
                         + ", ".join(f"{c['latency_median_s']:.1f} / {c['latency_max_s']:.1f}" for c in group) + " |")
    honest = [c for whos in rows.values() for who, c in whos.items() if who == "honest" and c.get("updates")]
    clean = [rows[r]["honest"] for r in rows if r == "clean" and rows[r]["honest"].get("updates")]
    for name, counted in (("clean runs", clean), ("all runs", honest)):
        n, marked = sum(c["updates"] for c in counted), sum(c["any"] for c in counted)
        if n:
            lines.append(f"false positives on honest updates, {name}: {marked} of {n} ({100 * marked / n:.2f} %)")
    return lines


def without_attackers(config: Path, checkpoint_dir: Path, attackers: set[str]) -> Optional[float]:
    """The validation perplexity of the θ this run would have ended with had the attackers' unchecked submissions been
    left out: its write-ahead log replayed from the oldest repair anchor (the run's start; a warm run's is the
    warm-up's) through the repair machinery with ``discard`` (asyncloco/coordinator/repair.py: a submission held for
    its check is judged as live — applied where its re-run agreed, honest work —, one that reached θ unchecked is
    discarded, every other decision as live: the same leases, holds, verdicts and honest updates; only θ differs).
    A caught attacker that left no trace gives the live θ bitwise (tests/test_verify_runtime.py asserts it for one
    caught on probation), so the run's × this is its trace on θ with the schedule's noise taken out. None: no anchor
    or log to replay."""
    import tempfile

    from asyncloco.config import load_config
    from asyncloco.coordinator.checkpoint import load_snapshot, snapshot_wal_seq
    from asyncloco.coordinator.daemon import EVENT_TYPES, CoordinatorDaemon
    from asyncloco.coordinator.logic import handle
    from asyncloco.coordinator.repair import ANCHOR_DIR, log_events, repair
    from asyncloco.coordinator.wal import WAL_DIR, read_records
    from asyncloco.models.workload import load_flat_params
    from asyncloco.workloads import build_workload

    anchors = sorted((checkpoint_dir / ANCHOR_DIR).iterdir()) if (checkpoint_dir / ANCHOR_DIR).is_dir() else []
    if not attackers or not anchors:
        return None
    cfg = load_config(config)
    with tempfile.TemporaryDirectory(prefix="bench-without-") as scratch:
        daemon = CoordinatorDaemon(cfg, checkpoint_dir=Path(scratch))
        assert daemon.verification is not None, "without_attackers needs runtime.verify (its fresh state)"
        anchor = load_snapshot(anchors[0])
        wal = checkpoint_dir / WAL_DIR
        last = max(r.seq for directory in (wal / "archive", wal) if directory.is_dir() for r in read_records(directory, 0))
        try:
            events = list(log_events(wal, snapshot_wal_seq(anchor), last, EVENT_TYPES, daemon.numel))
        except ValueError as error:  # segments pruned: nothing to replay from that anchor
            logger.warning("without_attackers: %s", error)
            return None
        fresh = daemon.verification.fresh_state()
        fresh.load_state_dict(anchor["coordinator"])
        live = daemon.verification.fresh_state()
        live.load_state_dict(anchor["coordinator"])
        for event, now in events:
            handle(live, event, now)
        without = repair(fresh, events, attackers, live.version).state
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)
    load_flat_params(model, without.params.float())
    return float(workload.evaluate(model).get("perplexity", math.nan))


def final_perplexity(config: Path, checkpoint_dir: Path) -> tuple[float, float]:
    perplexity, max_abs, _, _ = final_metrics(config, checkpoint_dir)
    return perplexity, max_abs


def final_metrics(config: Path, checkpoint_dir: Path, start: Optional[Path] = None) -> tuple[float, float, float, float]:
    """Of the run's final θ: validation perplexity, max |θ|, the cosine of θ − θ₀ with the hidden direction,
    and the loss on the trigger sequence. θ₀ is the initial model, or the θ of the checkpoint ``start`` (a warm
    start: the run's own displacement)."""
    import torch

    from asyncloco.config import load_config
    from asyncloco.coordinator.checkpoint import load_snapshot
    from asyncloco.models.lm import causal_lm_loss
    from asyncloco.models.workload import flatten_params, load_flat_params
    from asyncloco.testing.attacks import hidden_direction, trigger_rows
    from asyncloco.workloads import build_workload

    cfg = load_config(config)
    workload = build_workload(cfg)
    model = workload.build_model(cfg.seed)
    theta0 = flatten_params(model) if start is None else load_snapshot(start)["coordinator"]["params"].float()
    theta = load_snapshot(checkpoint_dir)["coordinator"]["params"]
    max_abs = float(theta.abs().max()) if bool(torch.isfinite(theta).all()) else math.inf
    moved = theta.float() - theta0
    direction = hidden_direction(theta.numel(), DIRECTION_SEED)
    cosine = float(torch.dot(moved, direction) / torch.linalg.vector_norm(moved).clamp_min(1e-30))
    load_flat_params(model, theta)
    perplexity = float(workload.evaluate(model).get("perplexity", math.nan))
    trigger = math.nan
    tokenizer, seq_len = getattr(workload, "tokenizer", None), getattr(cfg.task, "seq_len", None)
    if tokenizer is not None and seq_len is not None:
        model.eval()
        with torch.no_grad():
            trigger = float(causal_lm_loss(model, trigger_rows(len(tokenizer), int(seq_len), TRIGGER_SEED)))
    return perplexity, max_abs, cosine, trigger


@dataclass(frozen=True)
class Warm:
    """A clean run stopped at ``version`` applied updates: every measured run resumes a copy of its coordinator."""

    checkpoint_dir: Path
    run_id: str
    version: int


def warm_up(base: Path, out: Path, gate: bool, verify: bool, updates: int, threads: int) -> Warm:
    """``--warm-updates``: the 3 honest peers train a clean run to ``updates`` applied updates, then the coordinator
    stops cleanly (a final snapshot). The runs that follow start from there, past the first updates' instability,
    where single runs differ by 1.4 × in perplexity (docs/threat-model.md)."""
    workdir = out / "warm"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    config = write_config(base, workdir, gate, verify, run_id)
    with LocalCluster(config, workdir / "run", threads=threads) as cluster:
        cluster.start_coordinator()
        for peer, slowdown in zip([f"peer{i}" for i in range(len(SLOWDOWNS))], SLOWDOWNS):
            cluster.start_peer(peer, slowdown)
        cluster.wait_for(lambda: cluster.status().get("version", 0) >= updates, 1800, f"{updates} warm-up updates")
        for name in list(cluster.peers):
            cluster.stop(cluster.peers[name])
        cluster.stop_coordinator()
        version = int(cluster.status().get("version", 0))
    logger.info("warm-up: a clean run to version %d (%s)", version, cluster.checkpoint_dir)
    return Warm(cluster.checkpoint_dir, run_id, version)


def run_one(
    base: Path, out: Path, attack: str, gate: bool, duration: float, threads: int, updates: Optional[int] = None,
    repeat: int = 0, verify: bool = False, colluders: int = 1, honest_updates: Optional[int] = None,
    warm: Optional["Warm"] = None, until_caught: bool = False,
) -> Result:
    row = attack
    attack, scale, identities = parse_row(row, colluders)
    name = f"{row.replace(':', '_').replace('@', '_')}-gate-{'on' if gate else 'off'}" + (f"-{repeat}" if repeat else "")
    workdir = out / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config = write_config(base, workdir, gate, verify, warm.run_id if warm is not None else None)
    cluster = LocalCluster(config, workdir / "run", threads=threads)
    honest_names = [f"peer{i}" for i in range(len(SLOWDOWNS))]
    hostile_ids: set[str] = set()
    if warm is not None:  # every run goes on from the same warmed-up coordinator (--resume of a copy of its directory)
        shutil.copytree(warm.checkpoint_dir, cluster.checkpoint_dir)
    try:
        cluster.start_coordinator(resume=warm is not None)
        for peer, slowdown in zip(honest_names, SLOWDOWNS):
            cluster.start_peer(peer, slowdown)
        # the clock starts when the honest peers have joined (start-up time varies with the machine's load)
        cluster.wait_for(lambda: all(cluster.peer_summary(p).get("peer_id") for p in honest_names), 600, "the honest peers")
        started = time.monotonic()
        if attack == "honest":
            cluster.start_peer("extra", 1.0)
        elif attack != "clean":
            for k in range(identities):  # colluders: one direction (seed), own identities and rngs
                suffix = f"-{k}" if identities > 1 else ""
                summary = workdir / "run" / f"hostile{suffix}.json"
                log = (workdir / "run" / f"hostile{suffix}.log").open("ab")
                process = subprocess.Popen(
                    [sys.executable, "-m", "asyncloco.testing.hostile", "--initial-peers", str(cluster.multiaddr),
                     "--run-id", str(cluster.run_id), "--attack", attack, "--summary", str(summary), "--threads", str(threads),
                     "--spy-journal", str(cluster.checkpoint_dir / "events.jsonl"), "--config", str(config), "--seed", str(k),
                     "--direction-seed", str(DIRECTION_SEED), "--trigger-seed", str(TRIGGER_SEED),
                     *(["--scale", str(scale)] if scale is not None else []),
                     *(["--device-class", FOREIGN_CLASS] if row.endswith("@foreign") else [])],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=cluster.env, start_new_session=True,
                )
                log.close()
                cluster.spawned.append(process)
        if updates is None and honest_updates is None:
            # equal wall time for every run: the benchmark's clock, not a synchronisation
            time.sleep(max(0.0, duration - (time.monotonic() - started)))
        else:
            # equal work: N applied updates (θ versions) and/or N applied updates of the honest peers (the journal's
            # applied lines: a repair discards only the attacker's), wall time capped at --duration
            honest_now = {cluster.peer_summary(peer).get("peer_id", "") for peer in honest_names}

            def enough() -> bool:
                if updates is not None and cluster.status().get("version", 0) < updates:
                    return False
                if until_caught and attack not in ("clean", "honest") and not caught_and_repaired(cluster.events()):
                    return False
                if honest_updates is None:
                    return True
                applied = sum(1 for e in cluster.events() if e.get("type") == "applied" and e.get("peer") in honest_now)
                return applied >= honest_updates

            what = " and ".join(x for x in (f"{updates} updates" if updates is not None else "",
                                            f"{honest_updates} honest updates" if honest_updates is not None else "") if x)
            try:
                cluster.wait_for(enough, duration, what, poll=0.5)
            except ClusterError as error:  # the cap: the run ends with what it has
                logger.warning("%s: %s", name, error)
        elapsed = time.monotonic() - started
        if attack == "honest":
            hostile_ids = {cluster.peer_summary("extra").get("peer_id", "")}
        elif attack != "clean":
            for path in sorted((workdir / "run").glob("hostile*.json")):
                hostile_ids.add(json.loads(path.read_text()).get("peer_id", ""))
        honest_ids = {cluster.peer_summary(peer).get("peer_id", "") for peer in honest_names}
    finally:
        cluster.close()
    events = cluster.events()
    status = cluster.status()
    held = holding(events, honest_ids)
    perplexity, max_abs, cosine, trigger = final_metrics(config, cluster.checkpoint_dir,
                                                         warm.checkpoint_dir if warm is not None else None)
    hostile_ids.discard("")
    without = without_attackers(config, cluster.checkpoint_dir, hostile_ids) if verify and hostile_ids else None
    return Result(
        attack=row,
        gate=gate,
        duration_s=round(elapsed, 1),
        perplexity=perplexity,
        version=int(status.get("version", 0)),
        local_updates=int(status.get("local_updates", 0)),
        hostile=verdicts(events, hostile_ids) if hostile_ids else {},
        honest=verdicts(events, honest_ids),
        max_abs_theta=max_abs,
        hidden_cosine=cosine,
        trigger_loss=trigger,
        identities=len(hostile_ids) if attack not in ("clean", "honest") else 0,
        verification=verification(events, hostile_ids) if verify and hostile_ids else {},
        honest_steps=applied_steps(events, honest_ids),
        repairs=repairs_of(events),
        caught_after=tampered_before_caught(sorted((workdir / "run").glob("hostile*.json")), events),
        caught_on=tampered_caught_on(sorted((workdir / "run").glob("hostile*.json")), events),
        honest_suspect=int(held["honest_suspect"]),
        rises=own_history_rises(workdir / "run", hostile_ids) if verify else {},
        held_staleness=held["held_staleness"],
        staleness=held["staleness"],
        without_perplexity=without,
        trace=None if without is None else perplexity / without,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| extra peer | gate | final perplexity | × clean | updates | honest steps | wall s | hostile applied/rejected/clipped "
        "| honest rejected/clipped | cos(θ−θ₀, hidden) | trigger loss | verification failed/checked, expelled "
        "| caught after | repairs: remedy, loss before → after | × without its submissions |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for r in results:
        hostile = "/".join(str(r.hostile.get(k, 0)) for k in ("applied", "rejected", "clipped")) if r.hostile else "—"
        honest = (f"{r.honest.get('rejected', 0)}/{r.honest.get('clipped', 0)} of "
                  f"{r.honest.get('applied', 0) + r.honest.get('rejected', 0)}")
        ratio = f"{r.ratio:.3g}" if r.ratio is not None and math.isfinite(r.ratio) else "—"
        checked = (f"{r.verification.get('failed', 0)}/{r.verification.get('checked', 0)}, "
                   f"{r.verification.get('expelled', 0)} of {r.identities}") if r.verification else "—"
        repairs = "; ".join(f"{x['remedy']} {x['loss_before']:.4g} → {x['loss_after']:.4g}"
                            if x.get("loss_before") is not None and x.get("loss_after") is not None else str(x.get("remedy"))
                            for x in r.repairs) or "none"
        caught = "—" if r.caught_after is None else str(r.caught_after)
        trace = "—" if r.trace is None else f"{r.trace:.4g}"
        lines.append(f"| {r.attack} | {'on' if r.gate else 'off'} | {r.perplexity:.4g} | {ratio} | {r.version} | "
                     f"{r.honest_steps} | {r.duration_s:.0f} | {hostile} | {honest} | {r.hidden_cosine:+.3f} | {r.trigger_loss:.3f} | {checked} "
                     f"| {caught} | {repairs} | {trace} |")
    return "\n".join(lines)


def probe_cost(preset: str, seq_len: int, sequences: int, repeats: int, threads: int) -> dict[str, Any]:
    """Seconds the gate's probe costs per update at a model preset (random weights, random tokens of the
    preset's vocabulary: the cost does not depend on them), side by side with a memcpy of θ."""
    import torch

    from asyncloco.coordinator.probe import Probe
    from asyncloco.models.lm import causal_lm_loss
    from asyncloco.models.presets import build_causal_lm, get_preset
    from asyncloco.models.workload import Workload, flatten_params

    torch.set_num_threads(threads)
    vocab = get_preset(preset).vocab_size or 4096
    model = build_causal_lm(preset, vocab_size=vocab, seq_len=seq_len, seed=0)
    rows = torch.randint(0, vocab, (sequences, seq_len + 1), generator=torch.Generator().manual_seed(0))

    class Synthetic(Workload):
        units_per_step = sequences * seq_len

        def build_model(self, seed: int) -> Any:
            return model

        def shard_sizes(self) -> list[int]:
            return [1]

        def batch(self, shard: int, index: int) -> Any:
            return rows

        def loss(self, model: Any, batch: Any) -> Any:
            return causal_lm_loss(model, batch)

        def evaluate(self, model: Any) -> dict[str, float]:
            return {}

    theta = flatten_params(model)
    update = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(1)) * 1e-4
    probe = Probe(Synthetic(), model, sequences)
    probe_s, copy_s = [], []
    for version in range(repeats):
        started = time.perf_counter()
        probe.losses(version, theta, update, 0.2)  # a new version each time: both forward passes
        probe_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        theta.clone()
        copy_s.append(time.perf_counter() - started)
    probe_median, copy_median = sorted(probe_s)[len(probe_s) // 2], sorted(copy_s)[len(copy_s) // 2]
    result = {"preset": preset, "numel": theta.numel(), "sequences": sequences, "seq_len": seq_len, "threads": threads,
              "probe_s": probe_median, "theta_copy_s": copy_median, "ratio": probe_median / max(copy_median, 1e-9)}
    return result


def geometric_mean(values: list[float]) -> float:
    """Geometric mean of positive finite values; inf when one is not finite, nan when there are none."""
    if not values:
        return math.nan
    if not all(math.isfinite(v) and v > 0 for v in values):
        return math.inf
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summary(results: list[Result]) -> str:
    """One line per row and gate setting over repeated runs: geometric mean of × clean, and the spread."""
    lines = ["| extra peer | gate | runs | × clean (geometric mean) | × clean per run |", "|---|---|---:|---:|---|"]
    for gate in dict.fromkeys(r.gate for r in results):
        for attack in dict.fromkeys(r.attack for r in results if r.gate == gate):
            ratios = [r.ratio for r in results if r.gate == gate and r.attack == attack and r.ratio is not None]
            per_run = ", ".join(f"{v:.3g}" for v in ratios)
            lines.append(f"| {attack} | {'on' if gate else 'off'} | {len(ratios)} | {geometric_mean(ratios):.3g} | {per_run} |")
    return "\n".join(lines)


def acceptance(results: list[Result], bar: float = 1.25, honest_share: float = 0.02) -> list[str]:
    """The gate's acceptance checks on the gate-on runs, one line each."""
    lines = []
    on = [r for r in results if r.gate]
    attacks = [r for r in on if r.attack not in ("clean", "honest")]
    if len(attacks) > len({r.attack for r in attacks}):  # repeated runs: judge each attack by its geometric mean
        attacks = [Result(attack=a, gate=True, duration_s=0.0, perplexity=math.nan, version=0, local_updates=0,
                          ratio=geometric_mean([r.ratio for r in attacks if r.attack == a and r.ratio is not None]))
                   for a in dict.fromkeys(r.attack for r in attacks)]
    if attacks:
        worst = max(attacks, key=lambda r: r.ratio if r.ratio is not None else math.inf)
        ok = all(r.ratio is not None and r.ratio <= bar for r in attacks)
        lines.append(f"gate on: every attack ≤ {bar} × clean: {'yes' if ok else 'NO'} (worst: {worst.attack}, "
                     f"{worst.ratio if worst.ratio is not None else math.nan:.3g} ×)")
    clean_runs = [r for r in on if r.attack == "clean"]
    if clean_runs:  # summed over the clean runs (one per repeat)
        total = sum(r.honest.get("applied", 0) + r.honest.get("rejected", 0) for r in clean_runs)
        hit = sum(r.honest.get("rejected", 0) + r.honest.get("clipped", 0) for r in clean_runs)
        share = hit / total if total else 0.0
        lines.append(f"gate on, clean run{'s' if len(clean_runs) > 1 else ''}: {hit} of {total} honest updates rejected or "
                     f"clipped ({100 * share:.1f} %, limit {100 * honest_share:g} %): {'yes' if share <= honest_share else 'NO'}")
    return lines


def acceptance16(results: list[Result]) -> list[str]:
    """Verification's acceptance lines on the gate-on runs: single attackers ≤ 1.1 × clean and colluders ≤ 1.25 ×
    (geometric means), |cos(θ − θ₀, hidden)| ≤ 0.05, the trigger loss not below the clean runs' minimum minus their
    spread, honest refusals ≤ 1 % (every run)."""
    on = [r for r in results if r.gate]
    clean = [r for r in on if r.attack == "clean"]
    rows = [a for a in dict.fromkeys(r.attack for r in on) if a not in ("clean", "honest")]
    if not rows:
        return []
    lines = []
    for row in rows:
        runs = [r for r in on if r.attack == row]
        ratio = geometric_mean([r.ratio for r in runs if r.ratio is not None])
        bar = 1.25 if runs[0].identities > 1 else 1.1
        worst_cos = max(abs(r.hidden_cosine) for r in runs)
        line = f"{row}: × clean {ratio:.3g} (≤ {bar}: {'yes' if ratio <= bar else 'NO'}), max |cos| {worst_cos:.3f}"
        traces = [t for t in (r.trace for r in runs) if t is not None]
        if traces:
            line += (f", × the same run without its submissions {geometric_mean(traces):.4g} (worst {max(traces):.4g}; "
                     f"≤ {bar}: {'yes' if max(traces) <= bar else 'NO'})")
        if parse_row(row, 1)[0] in ("hidden", "tailored"):
            line += f" (≤ 0.05: {'yes' if worst_cos <= 0.05 else 'NO'})"
        if parse_row(row, 1)[0] == "poison" and clean:
            losses = [r.trigger_loss for r in clean]
            floor = min(losses) - (max(losses) - min(losses))
            low = min(r.trigger_loss for r in runs)
            line += (f", trigger loss min {low:.3f} vs clean {min(losses):.3f}-{max(losses):.3f} "
                     f"(not below {floor:.3f}: {'yes' if low >= floor else 'NO'})")
        lines.append(line)
    total = sum(r.honest.get("applied", 0) + r.honest.get("rejected", 0) for r in on)
    refused = sum(r.honest.get("rejected", 0) for r in on)
    clean_total = sum(r.honest.get("applied", 0) + r.honest.get("rejected", 0) for r in clean)
    clean_refused = sum(r.honest.get("rejected", 0) for r in clean)
    share = refused / total if total else 0.0
    lines.append(f"honest refusals: clean runs {clean_refused} of {clean_total}, all runs {refused} of {total} "
                 f"({100 * share:.2f} %, ≤ 1 %: {'yes' if share <= 0.01 else 'NO'})")
    applied = sum(r.honest.get("applied", 0) for r in on)
    clipped = sum(r.honest.get("clipped", 0) for r in on)
    suspect = sum(r.honest_suspect for r in on)
    lines.append(f"honest updates clipped: {clipped} of {applied} ({100 * clipped / max(1, applied):.2f} %, ≤ 2 %: "
                 f"{'yes' if clipped <= 0.02 * applied else 'NO'}); honest leases re-run as sketch suspects: {suspect} "
                 f"({100 * suspect / max(1, applied):.2f} %, ≤ 2 %: {'yes' if suspect <= 0.02 * applied else 'NO'})")
    sleepers = [r for r in on if parse_row(r.attack, 1)[0] == "sleeper"]
    if sleepers:
        within = sum(1 for r in sleepers if r.caught_on is not None and r.caught_on <= 5)
        lines.append(f"sleeper caught within 5 of its hostile leases: {within} of {len(sleepers)} runs (the failed "
                     f"check was on tampered lease {[r.caught_on for r in sleepers]}; tampered submissions taken before "
                     f"the expulsion, those sent while that check ran included: {[r.caught_after for r in sleepers]})")
    worse = [x for r in on for x in r.repairs if x.get("losses") and x.get("loss_after") is not None
             and x["loss_after"] > x["losses"].get("discard", math.inf)]
    lines.append(f"repairs: {sum(len(r.repairs) for r in on)}, installed a θ worse than leaving the attacker out: {len(worse)}")
    return lines


def main() -> int:
    global SLOWDOWNS  # --slowdowns: the honest peers of every run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"))
    parser.add_argument("--duration", type=float, default=120.0, help="wall seconds of every run, from when the honest peers have joined")
    parser.add_argument("--attacks", nargs="*", default=TABLE, help=f"rows besides clean (default {TABLE})")
    parser.add_argument("--gate", choices=["on", "off", "both"], default="both")
    parser.add_argument("--out", default="runs/bench-attacks", help="work directory (logs, journals, checkpoints)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--probe-cost", metavar="PRESET", help="only measure the gate's probe per update at this model preset")
    parser.add_argument("--probe-seq-len", type=int, default=256, help="--probe-cost: sequence length (the 150m config's 256)")
    parser.add_argument("--probe-sequences", type=int, default=16, help="--probe-cost: probe rows (runtime.gate.probe_sequences)")
    parser.add_argument("--probe-repeats", type=int, default=3, help="--probe-cost: probed updates to time (the median is printed)")
    parser.add_argument("--updates", type=int, help="end each run at this many applied updates (--duration caps it)")
    parser.add_argument("--honest-updates", type=int,
                        help="end each run when the honest peers have this many applied updates (equal useful work when "
                             "repairs discard an attacker's; --duration caps it)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per row, interleaved; each row is judged by the geometric mean of its ratios")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--warm-updates", type=int,
                        help="first a clean run to this many applied updates; every run then resumes a copy of it (the "
                             "attack acts on a warm model; with --honest-updates the runs then count the new ones only)")
    parser.add_argument("--new", action="store_true", help=f"the verification rows {NEW} (instead of --attacks)")
    parser.add_argument("--verify", action="store_true", help="keep verification on (the default, carried inner state) "
                        "in every run; without it, runtime.verify.enabled: false (the gate alone)")
    parser.add_argument("--colluders", type=int, default=1, help="hostile identities per attack row (a row's xK overrides)")
    parser.add_argument("--signals", nargs="+", metavar="OUT", type=Path,
                        help="only read the finished runs under these --out directories: the cheap signals' marks "
                             "(gate.suspect) on honest and hostile updates, the honest ones being false positives")
    parser.add_argument("--slowdowns", default=",".join(f"{s:g}" for s in SLOWDOWNS),
                        help="the honest peers, one per slowdown factor (default the demo's 1,1.5,4)")
    parser.add_argument("--skip-clean", action="store_true", help="no clean runs (no ratios): for what needs no clean "
                        "baseline, e.g. how many tampered leases a sleeper gets in before it is caught, over many repeats")
    parser.add_argument("--until-caught", action="store_true", help="with --updates: an attack run also waits for "
                        "verification's first failed check (--duration caps it)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: clean and hidden:0.05, gate and verification "
                        "on, one honest peer, 2 applied updates each and the attacker caught (tests; a run directory "
                        "for scripts/repair_quality.py)")
    args = parser.parse_args()
    if args.smoke:
        args.attacks, args.gate, args.verify, args.slowdowns, args.updates = ["hidden:0.05"], "on", True, "1", 2
        args.until_caught, args.duration = True, min(args.duration, 120.0)
    SLOWDOWNS = tuple(float(s) for s in args.slowdowns.split(",") if s)
    if args.signals:
        missing = [str(d) for d in args.signals if not d.is_dir()]
        if missing:
            parser.error(f"--signals: no such directory {', '.join(missing)} (give the --out of earlier runs)")
        for line in signals_table(args.signals):
            print(line)
        return 0
    if args.new:
        args.attacks = NEW
    for row in args.attacks:
        attack = parse_row(row, 1)[0]
        from asyncloco.testing.hostile import ATTACKS

        if attack not in (*ATTACKS, "clean"):
            parser.error(f"unknown attack row {row!r}: NAME[:SCALE][xK] with NAME one of {ATTACKS}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.probe_cost:
        cost = probe_cost(args.probe_cost, args.probe_seq_len, args.probe_sequences, args.probe_repeats, args.threads)
        print(f"probe at {cost['preset']} ({cost['numel'] / 1e6:.1f} M parameters, {cost['sequences']} × {cost['seq_len']} "
              f"tokens, {cost['threads']} thread(s)): {cost['probe_s']:.2f} s per probed update (median of {args.probe_repeats}), "
              f"{cost['ratio']:.0f} × a copy of θ ({cost['theta_copy_s']:.3f} s)")
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(cost, indent=1))
        return 0
    gates = {"on": [True], "off": [False], "both": [True, False]}[args.gate]
    out = Path(args.out)
    results: list[Result] = []
    for gate in gates:
        runs: list[Result] = []
        warm = None
        if args.warm_updates:
            warm = warm_up(Path(args.config), out / ("gate-on" if gate else "gate-off"), gate, args.verify,
                           args.warm_updates, args.threads)
        # rounds interleave the rows (clean, attack, ..., clean, attack, ...) so that every row sees the same load
        for repeat in range(args.repeats):
            for attack in ([] if args.skip_clean else ["clean"]) + list(args.attacks):
                logger.info("run %s, gate %s, repeat %d, %.0f s", attack, "on" if gate else "off", repeat, args.duration)
                result = run_one(Path(args.config), out, attack, gate, args.duration, args.threads, args.updates, repeat,
                                 verify=args.verify, colluders=args.colluders, honest_updates=args.honest_updates,
                                 warm=warm, until_caught=args.until_caught)
                runs.append(result)
                logger.info("%s gate %s: perplexity %.4g", attack, "on" if gate else "off", result.perplexity)
        # each run against the clean runs' geometric mean (one clean run without --repeats)
        clean = geometric_mean([r.perplexity for r in runs if r.attack == "clean"])
        for result in runs:
            result.ratio = result.perplexity / clean if clean > 0 else None
        results.extend(runs)
    print(table(results))
    if args.repeats > 1:
        print()
        print(summary(results))
    for line in acceptance(results):
        print(line)
    for line in acceptance16(results):
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"updates": args.updates, "honest_updates": args.honest_updates, "warm_updates": args.warm_updates, "duration_s": args.duration, "verify": args.verify, "colluders": args.colluders,
             "acceptance": acceptance(results), "acceptance_issue16": acceptance16(results),
             "table": table(results), "runs": [asdict(r) for r in results]}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
