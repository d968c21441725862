"""The update gate and error feedback: each update's cosine with the gate's reference, with and without its sender's
last update in it (docs/compression.md, "The gate and the sign code").

With error feedback a peer's upload carries ``+β·e``, its last upload's coding error, and its last upload carried
``−e``; the gate's reference holds that last upload, so each upload agrees less with the reference than its honest
direction does. Since a596964 the gate judges an update against the reference without its sender's last update
(asyncloco/coordinator/gate_state.py ``others_reference``). This script measures what that changes, on the same
updates:

* from a finished demo run (``asyncloco demo --out DIR`` with a sign codec): the applied updates, decoded from the
  coordinator's write-ahead log in order, the reference rebuilt from them as the gate builds it (weakly agreeing
  updates, marked so in the journal, kept out); per update the cosine with the whole reference and with the
  reference without its sender's last update; the share below ``cosine_cap`` (the gate's bar never lies above it);
* ``--sim VARIANT:STEPS``: the updates a ``scripts/slow_link_sim.py`` variant's coordinator receives at leases of
  ``STEPS`` local steps for the fastest worker (no live gate there: none is kept out);
* ``--smoke``: synthetic peers (a shared descent direction, each peer's own noise) sign-coded with decayed error
  feedback through the project's own codec (train/feedback.py), the same measurement in seconds.

``--memory-steps H,...`` measures the same updates against a reference whose memory is counted in local steps, not
updates: an update of ``h > H`` steps joins with weight ``1 − d^(h/H)`` instead of ``1 − d`` (the rule
``outer.long_lease_momentum: scaled`` applies to the outer momentum); it shortens the memory on long leases.
Each measurement also gives the median cosine per third of the run and per peer (docs/wan.md, "The gate on long
leases").

    python -m asyncloco demo --duration 90 --out runs/demo-sgn --set runtime.codec=sgn15of16 \\
        --set runtime.error_feedback=true --set runtime.error_feedback_decay=0.5
    python scripts/gate_own_update.py runs/demo-sgn --json out.json
    python scripts/gate_own_update.py --smoke --json out.json
    python scripts/gate_own_update.py --sim upload_scaled_30_sign_ef_carry_eager_lr:440 --memory-steps 30,120
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's asyncloco, installed or not

import torch  # noqa: E402

from asyncloco.coordinator.gate_state import GatePolicy, GateState, reference_weight  # noqa: E402


class Reference:
    """The gate's reference (gate_state.py ``join_reference``) and each peer's last update's part in it."""

    def __init__(self, policy: GatePolicy, memory_steps: int | None = None) -> None:
        self.policy = policy
        self.memory_steps = memory_steps  # H: memory counted in local steps (module docstring); None: in updates
        self.gate = GateState()
        self.last: dict[str, torch.Tensor] = {}

    def cosines(self, peer: str, update: torch.Tensor) -> tuple[float, float | None] | None:
        """(with the whole reference, without ``peer``'s last update), or None before the first update."""
        reference = self.gate.reference
        if reference is None:
            return None
        norm = float(update.norm())
        whole = float(update @ reference) / (norm * float(reference.norm()))
        part = self.last.get(peer)
        if part is None:
            return whole, None
        rest = reference - part
        rest_norm = float(rest.norm())
        return whole, (float(update @ rest) / (norm * rest_norm) if rest_norm > 0 else None)

    def join(self, peer: str, update: torch.Tensor, steps: int = 1) -> None:
        unit = update / float(update.norm())
        weight = reference_weight(self.policy, self.gate, peer)
        if self.memory_steps is not None and self.gate.reference is not None:
            decay = self.policy.reference_decay
            weight *= (1.0 - decay ** max(1.0, steps / self.memory_steps)) / (1.0 - decay)
        if self.gate.reference is None:
            self.gate.reference = unit.clone()
        else:
            self.gate.reference.mul_(1.0 - weight).add_(unit, alpha=weight)
            for other in self.last:
                self.last[other].mul_(1.0 - weight)
        self.last[peer] = unit * weight
        for other in list(self.gate.shares):
            self.gate.shares[other] *= 1.0 - weight
        self.gate.shares[peer] = self.gate.shares.get(peer, 0.0) + weight
        self.gate.present.append(peer)
        del self.gate.present[: max(0, len(self.gate.present) - self.policy.window)]


Update = tuple[str, torch.Tensor, bool, int]  # (peer, the update as decoded, taken with weak agreement, its local steps)


def run_updates(run: Path) -> Iterator[Update]:
    """A demo run's applied updates in order."""
    from asyncloco.coordinator.daemon import EVENT_TYPES
    from asyncloco.coordinator.logic import SubmitUpdate
    from asyncloco.coordinator.repair import log_events

    coordinator = run / "coordinator"
    applied, steps = {}, {}
    for line in (coordinator / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "applied":
            applied[record["lease_id"]] = "weak agreement" in (record.get("gate") or "")
            steps[record["lease_id"]] = int(record["steps"])
    numel = int(json.loads((coordinator / "status.json").read_text())["parameters"])
    events = log_events(coordinator / "wal", 0, 1 << 62, EVENT_TYPES, numel)
    try:
        for event, _ in events:
            if isinstance(event, SubmitUpdate) and event.lease_id in applied:
                yield (event.peer, event.pseudo_gradient.to(torch.float32), applied[event.lease_id],
                       steps[event.lease_id])
    except ValueError:  # the log ends before the (open-ended) range asked for: every record was read
        return


def journal_counts(run: Path) -> dict[str, Any]:
    """What the live gate did in the run: updates applied, of them taken with weak agreement, refused by the gate,
    and the last evaluation's perplexity."""
    records = [json.loads(line) for line in (run / "coordinator" / "events.jsonl").read_text().splitlines()]
    applied = [r for r in records if r.get("type") == "applied"]
    evals = [r for r in records if r.get("type") == "eval" and "perplexity" in r]
    return {
        "applied": len(applied),
        "weak_agreement": sum("weak agreement" in (r.get("gate") or "") for r in applied),
        "refused_by_the_gate": sum(r.get("type") == "rejected" and "gate" in (r.get("reason") or "") for r in records),
        "final_perplexity": round(float(evals[-1]["perplexity"]), 1) if evals else None,
    }


def sim_updates(spec: str) -> list[Update]:
    """The updates the coordinator of ``scripts/slow_link_sim.py``'s variant receives, ``spec`` = ``VARIANT:STEPS``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import slow_link_sim

    from asyncloco.sim.engine import Simulation

    variant, _, steps = spec.partition(":")
    if variant not in slow_link_sim.VARIANTS or not steps.isdigit():
        raise ValueError(f"--sim {spec!r}: want VARIANT:STEPS, a variant of {', '.join(slow_link_sim.VARIANTS)}")
    seen: list[Update] = []
    arrive = Simulation._arrive

    def capture(self: Simulation, name: str, submit: Any, lease_steps: int, now: float) -> bool:
        seen.append((name, submit.pseudo_gradient.to(torch.float32).clone(), False, int(lease_steps)))
        return arrive(self, name, submit, lease_steps, now)

    args = slow_link_sim.arguments().parse_args(["--steps", steps])  # the variant at the script's own defaults
    setattr(Simulation, "_arrive", capture)
    try:
        slow_link_sim.run_variant(args, variant)
    finally:
        setattr(Simulation, "_arrive", arrive)
    return seen


def synthetic_updates(peers: int = 3, rounds: int = 40, numel: int = 4096, seed: int = 0) -> Iterator[Update]:
    """Honest peers: a shared direction that turns slowly plus each update's own noise, sign-coded (sgn15of16) with
    error feedback at decay 0.5, as the coordinator decodes them."""
    from asyncloco.train.feedback import ErrorFeedback

    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(numel, generator=generator)
    feedback = {f"peer{i}": ErrorFeedback("sgn15of16", True, 0.5) for i in range(peers)}
    for _ in range(rounds):
        direction = direction + 0.2 * torch.randn(numel, generator=generator)
        for name, coder in feedback.items():
            honest = direction / direction.norm() + 1.5 * torch.randn(numel, generator=generator) / numel ** 0.5
            decoded = coder.roundtrip(honest)
            coder.settle(True)
            yield name, decoded, False, 2  # leases of 2 local steps: --memory-steps 1 shortens the memory, 2 keeps it


def measure(updates: Iterable[Update], warmup: int, memory_steps: int | None = None) -> dict[str, Any]:
    policy = GatePolicy()
    reference = Reference(policy, memory_steps)
    # (whole, without the sender's last update) and its sender, per update judged without its sender's last one
    rows: list[tuple[float, float]] = []
    peers: list[str] = []
    for peer, update, weak, steps in updates:
        if not float(update.norm()) > 0:
            continue
        cosines = reference.cosines(peer, update)
        if cosines is not None and cosines[1] is not None:
            rows.append((cosines[0], cosines[1]))
            peers.append(peer)
        if not weak:  # a weakly agreeing update stays out of the reference (gate.py record)
            reference.join(peer, update, steps)
    rows, peers = rows[warmup:], peers[warmup:]
    whole = [w for w, _ in rows]
    without = [o for _, o in rows]
    cap = policy.cosine_cap
    third = max(1, len(without) // 3)
    by_peer: dict[str, list[float]] = {}
    for peer, (_, other) in zip(peers, rows):
        by_peer.setdefault(peer, []).append(other)
    return {
        "updates": len(rows), "cosine_cap": cap, "memory_steps": memory_steps,
        # the gate's cosine (without the sender's last update) per third of the run and per peer
        "median_by_third": [round(statistics.median(without[k * third:(k + 1) * third]), 4)
                            for k in range(3) if without[k * third:(k + 1) * third]],
        "median_by_peer": {p: round(statistics.median(c), 4) for p, c in sorted(by_peer.items())},
        "whole_reference": {"median": round(statistics.median(whole), 4),
                            "below_cap": round(sum(c < cap for c in whole) / len(whole), 4)},
        "without_the_senders_last_update": {"median": round(statistics.median(without), 4),
                                            "below_cap": round(sum(c < cap for c in without) / len(without), 4)},
    }


def summary(name: str, r: dict[str, Any]) -> str:
    w, o = r["whole_reference"], r["without_the_senders_last_update"]
    live = (f"; live: {r['applied']} applied, {r['weak_agreement']} with weak agreement, {r['refused_by_the_gate']} "
            f"refused" if "applied" in r else "")
    memory = "updates" if r["memory_steps"] is None else f"{r['memory_steps']} local steps"
    return (f"{name} (memory in {memory}): {r['updates']} updates; cosine median {w['median']:.3f} → {o['median']:.3f}, "
            f"below the cap {100 * w['below_cap']:.1f} % → {100 * o['below_cap']:.1f} %; by third "
            + " / ".join(f"{c:.3f}" for c in r["median_by_third"]) + live)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="*", help="demo output directories (asyncloco demo --out)")
    parser.add_argument("--sim", action="append", default=[], metavar="VARIANT:STEPS",
                        help="a scripts/slow_link_sim.py variant's updates at leases of STEPS (repeatable; minutes each)")
    parser.add_argument("--memory-steps", default="", help="comma-separated H: also measure with memory in local steps")
    parser.add_argument("--warmup", type=int, default=6, help="first updates left out (the gate's warm-up)")
    parser.add_argument("--smoke", action="store_true", help="synthetic sign-coded peers instead of runs (seconds)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if not args.runs and not args.smoke and not args.sim:
        parser.error("give demo run directories, --sim VARIANT:STEPS, or --smoke")
    try:
        memories = [int(h) for h in args.memory_steps.split(",") if h]
    except ValueError:
        parser.error(f"--memory-steps {args.memory_steps!r}: want comma-separated local step counts, e.g. 30,120")
    if any(h < 1 for h in memories):
        parser.error("--memory-steps: each H must be >= 1")
    sources: dict[str, tuple[list[Update], dict[str, Any]]] = {}
    if args.smoke:
        sources["synthetic"] = (list(synthetic_updates()), {})
    for spec in args.sim:
        try:
            sources[f"sim:{spec}"] = (sim_updates(spec), {})
        except ValueError as error:
            parser.error(str(error))
    for run in args.runs:
        if not (run / "coordinator" / "events.jsonl").is_file():
            parser.error(f"{run} is not a demo output directory (no coordinator/events.jsonl): run asyncloco demo --out {run}")
        sources[str(run)] = (list(run_updates(run)), journal_counts(run))
    results: dict[str, Any] = {}
    for name, (updates, counts) in sources.items():
        try:
            results[name] = {**measure(updates, args.warmup), **counts,
                             "memory_in_steps": {str(h): measure(updates, args.warmup, h) for h in memories}}
        except statistics.StatisticsError:
            parser.error(f"{name}: too few applied updates in its write-ahead log — the log before its last snapshot is "
                         "pruned; run the demo with --set runtime.wal_archive=true to keep all of it")
        print(summary(name, results[name]))
        for h, r in results[name]["memory_in_steps"].items():
            print("    " + summary(name, r))
    if args.json:
        Path(args.json).write_text(json.dumps({"script": "scripts/gate_own_update.py", "argv": sys.argv[1:],
                                               "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
