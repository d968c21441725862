"""Render the tables the docs show from the JSON files in docs/results/.

Every figure in docs/ cites the results file it comes from; this script turns those files back into markdown
tables, one per file, by the kind of file (its name's prefix: ``bench-attacks-``, ``repair-quality-``,
``verify-tolerance-``, ...). A file of a kind it does not know is printed as its top-level numbers.

Usage::

    python scripts/render_results.py                          # every file in docs/results/
    python scripts/render_results.py docs/results/bench-attacks-all-live-decisions-2026-11-27.json
    python scripts/render_results.py --check                  # every results file cited by a doc, every cited one present

``--check`` exits 1 naming each results file no doc cites (drop it, or cite it next to its figure) and each
``results/...json`` a doc cites that is missing. ``tests/test_docs.py`` runs the same check.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
CITING = ("README.md", "docs")  # where a results file may be cited


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def _table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in row) + " |")
    return "\n".join(lines)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def bench_attacks(data: dict[str, Any]) -> str:
    """scripts/bench_attacks.py --json: one row per attack, over its interleaved repeats."""
    by_attack: dict[str, list[dict[str, Any]]] = {}
    for run in data["runs"]:
        by_attack.setdefault(run["attack"], []).append(run)
    rows = []
    for attack, runs in by_attack.items():
        ratios = [r["ratio"] for r in runs]
        verification = "; ".join(
            f"{v['failed']}/{v['checked']}, {v['expelled']} expelled"
            for v in (r.get("verification") or {} for r in runs) if v
        ) or "—"
        honest = f"{sum(r['honest']['rejected'] for r in runs)} of {sum(r['honest']['applied'] + r['honest']['rejected'] for r in runs)}"
        triggers = [r["trigger_loss"] for r in runs if r.get("trigger_loss") is not None]
        rows.append([
            attack, len(runs), _geomean(ratios), ", ".join(_fmt(x) for x in ratios),
            max(abs(r["hidden_cosine"]) for r in runs) if runs[0].get("hidden_cosine") is not None else None,
            min(triggers) if triggers else None, verification, honest,
        ])
    header = ["extra peer", "runs", "× clean (geo. mean)", "× clean per run", "max \\|cos(θ−θ₀, hidden)\\|",
              "min trigger loss", "verification per run: failed/checked, expelled", "honest refused"]
    verdicts = "\n".join(f"    {line}" for line in data.get("acceptance_issue16", []) + data.get("acceptance", []))
    return _table(header, rows) + ("\n\n" + verdicts if verdicts else "")


def repair_quality(data: dict[str, Any]) -> str:
    """scripts/repair_quality.py: validation perplexity of θ repaired by `discard` and by `rerun`."""
    runs = data.get("runs", [data])
    rows = []
    for run in runs:
        discards = run.get("discards") or []
        discard = next((d for d in discards if d.get("expelled")), discards[0] if discards else {})
        rerun = run.get("rerun") if isinstance(run.get("rerun"), dict) else {}
        rows.append([
            "/".join(Path(str(run.get("run", ""))).parts[-2:]), discard.get("updates_discarded"),
            rerun.get("updates_replaced"), rerun.get("refused_as_sent"), run.get("live_perplexity"),
            discard.get("perplexity"), rerun.get("perplexity"), rerun.get("seconds"),
        ])
    return _table(["run", "expelled peer's submissions", "replaced by re-runs", "refused as sent", "live θ",
                   "`discard`", "`rerun`", "re-run s"], rows)


def verify_tolerance(data: dict[str, Any]) -> str:
    """scripts/verify_tolerance.py --json: how exactly a lease reproduces."""
    rows = []
    for name in ("rerun", "rerun_deterministic", "deterministic_vs_default", "other_lease"):
        cmp = data.get(name)
        if cmp:
            rows.append([name, cmp.get("bitwise"), cmp.get("rel_error"), cmp.get("cosine"), cmp.get("max_abs_diff")])
    for other in data.get("cross_cpu") or []:
        if other.get("bitwise") is None:
            rows.append([f"{other.get('class')}, {other.get('threads')} thread(s): the reference", "", "", "", ""])
            continue
        codec = other.get("after_codec") or {}
        rows.append([f"vs {other.get('class')}, {other.get('threads')} threads", other.get("bitwise"),
                     f"{_fmt(other.get('rel_error'))} / int8 {_fmt((codec.get('int8') or {}).get('rel_error'))} / "
                     f"sgn15of16 {_fmt((codec.get('sgn15of16') or {}).get('rel_error'))}",
                     other.get("cosine"), other.get("max_abs_diff")])
    title = (f"`{data.get('model')}` ({_fmt(data.get('parameters'))} parameters), {data.get('precision')}, "
             f"{data.get('steps')} steps, {data.get('device_name') or data.get('device')}, torch {data.get('torch')}")
    out = title + "\n\n" + _table(["comparison", "bitwise", "relative L2 error (before / after the codec)", "cosine", "max \\|diff\\|"], rows)
    # the lease's end inner state against the reference's, where measured
    states = [other for other in data.get("cross_cpu") or [] if other.get("end_state_carried")]
    if states:
        out += "\n\n" + _table(
            ["end inner state vs", "m / v / AdamW step / step size (fresh start)", "(carried start)",
             "residual of the upload's norm: int8 / sgn15of16"],
            [[f"{o.get('class')}, {o.get('threads')} threads",
              " / ".join(_fmt(o["end_state_fresh"].get(k)) for k in ("m", "v", "u", "precond")),
              " / ".join(_fmt(o["end_state_carried"].get(k)) for k in ("m", "v", "u", "precond")),
              " / ".join(_fmt((o.get("residual_after_codec") or {}).get(c, {}).get("rel_to_upload")) for c in ("int8", "sgn15of16"))]
             for o in states])
    return out


def bench_swarm(data: dict[str, Any]) -> str:
    """scripts/bench_swarm.py --json: what the coordinator sent per θ version, without and with the swarm."""
    key = "coordinator_egress_per_version_over_encoding"
    rows = []
    for row in data["rows"]:
        today, swarm = row.get("today") or {}, row.get("swarm") or {}
        rows.append([row["clients"], today.get(key), swarm.get(key), (today.get("download_s") or {}).get("max"),
                     (swarm.get("download_s") or {}).get("max")])
    return _table(["clients", "coordinator sent θ encodings per version (plain)", "(swarm)",
                   "slowest download, s (plain)", "(swarm)"], rows)


def bench_coordinator(data: dict[str, Any]) -> str:
    """scripts/bench_coordinator.py --json: per size, the coordinator's per-submission and per-lease costs and its
    sustained updates (the capacity table of docs/guide/organiser.md); with ``--codecs``, per size and codec."""
    if not any("codecs" in entry for entry in data.values()):
        return _capacity(data)
    rows = []
    for size, entry in data.items():
        for codec, figures in (entry.get("codecs") or {}).items():
            if isinstance(figures, dict):
                cells = ", ".join(f"{k} {_fmt(v)}" for k, v in figures.items() if isinstance(v, (int, float)))
            else:
                cells = _fmt(figures)
            rows.append([size, _fmt(entry.get("numel")), _fmt(entry.get("memcpy_s")), codec, cells])
    return _table(["size", "θ values", "memcpy θ, s", "codec", "seconds"], rows)


def _capacity(data: dict[str, Any]) -> str:
    def ms(seconds: Any) -> str:
        return "—" if seconds is None else f"{1000 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"

    rows = []
    for size, r in data.items():
        v = r.get("verification") or {}
        checks = f"{v['passed']}/{v['checked']}, {v['failed']} failed" if v else "off"
        rows.append([size, f"{r['numel'] / 1e6:.1f} M", ms(r["memcpy_s"]), ms(r["fsync_update_s"]), ms(r["decode_s"]),
                     ms(r["validate_s"]), ms(r["apply_s"]), ms(r["wal_append_s"]), ms(r["ack_latency_s"]),
                     ms(r.get("ack_during_snapshot_s")), ms(r["lease_latency_s"]), ms(r["snapshot_copy_s"]),
                     ms(r["snapshot_s"]), _fmt(r["updates_per_s"]), _fmt(r["peers_at_60s_round"]),
                     f"{r['peak_rss_mb'] / 1024:.1f} GB", _fmt((r.get("verify") or {}).get("fraction")), checks])
    return _table(["size", "θ", "memcpy θ", "fsync of the int8 update", "decode", "validate", "apply (DN)",
                   "log append + fsync", "ack", "ack during a snapshot", "lease", "snapshot copy (under the lock)",
                   "background snapshot", "updates/s sustained", "peers at a 60 s round", "peak RSS",
                   "verify.fraction", "checks passed/re-run"], rows)


def compression(data: dict[str, Any]) -> str:
    """scripts/compression_study.py --json: final loss / perplexity per task, seed and codec."""
    rows = [[r["task"], r["seed"], r["method"], r["codec"], r["loss"], r.get("time")] for r in data["runs"]]
    return _table(["task", "seed", "method", "codec", "final loss", "sim. time"], rows)


def demo_gate(data: dict[str, Any]) -> str:
    """Demo runs with a given upload codec: what the gate applied and refused."""
    rows = [[r["upload"], r.get("applied"), r.get("refused"), r.get("weak_agreement"), r.get("final_eval")]
            for r in data["runs"]]
    return _table(["upload", "applied", "refused", "weak agreement", "final evaluation"], rows)


def upload_quality(data: dict[str, Any]) -> str:
    """scripts/download_quality.py --direction upload: perplexity at equal applied updates per codec."""
    rows = [[r["codec"], ", ".join(_fmt(p) for p in r["perplexity"]) if isinstance(r["perplexity"], list) else r["perplexity"],
             r.get("mean"), r.get("vs_reference"), r.get("upload_fraction_per_round")] for r in data["rows"]]
    return f"at version {data.get('version')}\n\n" + _table(
        ["codec", "perplexity per run", "mean", "vs reference", "upload / fp32 per round"], rows)


def demo_verify(data: dict[str, Any]) -> str:
    """The demo with verification on (the default) and off, back to back."""
    rows = []
    for name, run in data["runs"].items():
        status = run["summary"]["status"]
        verification = status.get("verification") or {}
        rows.append([name, status.get("version"), status.get("local_updates"), verification.get("checked"),
                     verification.get("failed"), verification.get("compute_fraction"),
                     verification.get("latency_median_s")])
    return _table(["verification", "updates applied", "local steps", "checks", "failed",
                   "re-run share of inner steps", "verdict latency median, s"], rows)


def _scalars(data: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _scalars(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, (int, float, str, bool)) or data is None:
        if not (isinstance(data, str) and len(data) > 120):
            yield prefix, data


def generic(data: Any) -> str:
    """Any other file: its numbers and short strings, flattened (lists left out)."""
    return _table(["key", "value"], ([k, v] for k, v in _scalars(data)))


KINDS: list[tuple[str, Callable[[Any], str]]] = [
    ("bench-attacks-", bench_attacks),
    ("repair-quality-", repair_quality),
    ("verify-tolerance-", verify_tolerance),
    ("bench-swarm-", bench_swarm),
    ("bench-coordinator-", bench_coordinator),
    ("compression-", compression),
    ("demo-gate-", demo_gate),
    ("upload-quality-", upload_quality),
    ("demo-verify-", demo_verify),
]


def render(path: Path) -> str:
    """The markdown table(s) of one results file."""
    data = json.loads(path.read_text())
    for prefix, renderer in KINDS:
        if path.name.startswith(prefix):
            try:
                return renderer(data)
            except (KeyError, TypeError, ValueError) as error:  # a file of the kind in an older layout
                return f"(not rendered as {prefix}*: {error!r})\n\n" + generic(data)
    return generic(data)


def results_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md")


def _doc_texts() -> dict[Path, str]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {f: f.read_text() for f in files if f.exists()}


_CITED = re.compile(r"results/([A-Za-z0-9_./-]+\.(?:json|tar\.gz))")


def check() -> list[str]:
    """Problems: results files no doc cites, and cited results files that are missing."""
    texts = _doc_texts()
    everything = "\n".join(texts.values())
    problems = []
    for path in results_files():
        rel = path.relative_to(RESULTS).as_posix()
        if f"results/{rel}" not in everything:
            problems.append(f"docs/results/{rel} is cited by no doc: cite it next to its figure, or git rm it")
    for doc, text in texts.items():
        for rel in sorted(set(_CITED.findall(text))):
            if not (RESULTS / rel).exists():
                problems.append(f"{doc.relative_to(ROOT)} cites results/{rel}, which does not exist")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="results files (default: all of docs/results/)")
    parser.add_argument("--check", action="store_true", help="only check that results files and citations match")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path in args.files or [p for p in results_files() if p.suffix == ".json"]:
        shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        print(f"### {shown}\n\n{render(path)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
