"""The demo's validation perplexity with lossy θ downloads (or pseudo-gradient uploads) vs a reference codec, at
equal applied updates.

``python scripts/download_quality.py [--duration 150] [--repeats 2] [--codecs none,int8] [--json out.json]``
runs ``asyncloco demo`` (configs/demo.yaml, three peers on this machine) once per download codec and
repeat, alternating the codecs, each with ``runtime.download_codec`` set; then compares the coordinator's
validation perplexity at the largest version (= applied updates) every run reached and evaluated, and
reports the peers' downloaded payload per round as a fraction of θ's fp32 size. ``--direction upload`` varies
``runtime.codec`` instead (error feedback on for the codecs below int8, ``--feedback-decay`` its decay;
docs/compression.md) and reports the uploaded payload per round. ``--reuse`` reads runs
already under ``--out`` (e.g. to add repeats). The first codec is the
reference. Runs are asynchronous (timing decides which peer's update lands when), so repeats differ:
compare the spread across repeats with the difference between codecs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import yaml

REPO = Path(__file__).resolve().parent.parent


FEEDBACK_FREE = ("none", "fp16", "bf16", "int8", "int4")  # uploads sent without error feedback in --direction upload


def run_one(codec: str, duration: float, out: Path, reuse: bool = False, direction: str = "download",
            decay: float = 0.5, slowdowns: str = "") -> Dict[str, Any]:
    if reuse and (out / "summary.json").exists():
        return read_run(codec, out)
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    if direction == "download":
        config["runtime"]["download_codec"] = codec
    else:
        feedback = codec not in FEEDBACK_FREE
        config["runtime"].update(codec=codec, error_feedback=feedback, error_feedback_decay=decay if feedback else 1.0)
    out.mkdir(parents=True, exist_ok=True)
    path = out.with_name(out.name + ".yaml")
    path.write_text(yaml.safe_dump(config))
    log = out.with_name(out.name + ".log")
    with open(log, "w") as handle:
        subprocess.run(
            [sys.executable, "-m", "asyncloco", "demo", "--config", str(path), "--duration", str(duration), "--out", str(out)]
            + (["--slowdowns", slowdowns] if slowdowns else []),
            cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, check=True,
        )
    return read_run(codec, out)


def read_run(codec: str, out: Path) -> Dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    evals = {int(e["version"]): float(e["perplexity"]) for e in summary["status"].get("evals", []) if "perplexity" in e}
    peers = {}
    for name, peer in summary["peers"].items():
        traffic = peer.get("traffic", {}).get("get_model", {})
        submits = peer.get("traffic", {}).get("submit", {})
        peers[name] = {"rounds": peer.get("rounds", 0), "downloads": traffic.get("calls", 0),
                       "download_payload_bytes": traffic.get("payload_bytes_received", 0),
                       "uploads": submits.get("calls", 0), "upload_payload_bytes": submits.get("payload_bytes_sent", 0)}
    with open(out / "coordinator" / "events.jsonl") as journal:
        numel = int(json.loads(journal.readline())["numel"])  # the "start" record
    return {"codec": codec, "version": int(summary["status"].get("version", 0)), "evals": evals, "peers": peers,
            "numel": numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=150.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--codecs", default="none,int8")
    parser.add_argument("--out", default="runs/download_quality")
    parser.add_argument("--json", default=None)
    parser.add_argument("--direction", choices=("download", "upload"), default="download",
                        help="vary runtime.download_codec (default) or runtime.codec, the uploads")
    parser.add_argument("--feedback-decay", type=float, default=0.5, help="--direction upload: error_feedback_decay")
    parser.add_argument("--reuse", action="store_true", help="read runs already in --out instead of running them again")
    parser.add_argument("--slowdowns", default="", help="the demo's peers (default: the demo's three)")
    parser.add_argument("--smoke", action="store_true", help="seconds of work: one demo run with int8 downloads, one "
                        "peer, 6 s (tests)")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.codecs, args.duration, args.slowdowns = 1, "int8", 6.0, "1"
    codecs = args.codecs.split(",")
    runs: List[Dict[str, Any]] = []
    for repeat in range(args.repeats):
        for codec in codecs:
            key = "download_codec" if args.direction == "download" else "codec"
            print(f"repeat {repeat + 1}/{args.repeats}: demo with {key}={codec}, {args.duration:g} s ...", flush=True)
            run = run_one(codec, args.duration, REPO / args.out / f"{codec}-{repeat}", args.reuse, args.direction,
                          args.feedback_decay, args.slowdowns)
            run["repeat"] = repeat
            runs.append(run)
            print(f"  {run['version']} updates applied; last eval {max(run['evals'].items(), default=None)}", flush=True)
    common = set.intersection(*(set(run["evals"]) for run in runs))
    if not common:
        raise SystemExit("no evaluated version common to every run; run longer (--duration)")
    version = max(common)
    last = sorted(common)[-5:]  # the last five evaluations every run made: less noisy than one
    print(f"\nvalidation perplexity at version {version} (= applied updates), every run:")
    print(f"(geo. mean: over versions {', '.join(map(str, last))} of each run, then the mean over repeats)")
    what = args.direction
    print(f"| {what} | perplexity per repeat | mean | vs " + codecs[0] + " | geo. mean, last 5 evals | vs " + codecs[0]
          + f" | {what} payload per round / fp32 θ |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rows = []
    def smoothed(run: Dict[str, Any]) -> float:
        return math.exp(statistics.mean(math.log(run["evals"][v]) for v in last))

    reference = statistics.mean(run["evals"][version] for run in runs if run["codec"] == codecs[0])
    reference_smoothed = statistics.mean(smoothed(run) for run in runs if run["codec"] == codecs[0])
    for codec in codecs:
        mine = [run for run in runs if run["codec"] == codec]
        ppl = [run["evals"][version] for run in mine]
        payload = sum(p[f"{what}_payload_bytes"] for run in mine for p in run["peers"].values())
        rounds = sum(p["rounds" if what == "download" else "uploads"] for run in mine for p in run["peers"].values())
        numel = mine[0]["numel"]
        fraction = payload / rounds / (4 * numel) if rounds and numel else float("nan")
        mean = statistics.mean(ppl)
        smooth = statistics.mean(smoothed(run) for run in mine)
        rows.append({"codec": codec, "perplexity": ppl, "mean": mean, "vs_reference": mean / reference,
                     "smoothed": smooth, "smoothed_vs_reference": smooth / reference_smoothed,
                     f"{what}_fraction_per_round": fraction})
        print(f"| {codec} | {', '.join(f'{p:.1f}' for p in ppl)} | {mean:.1f} | {mean / reference:.4f} | {smooth:.1f} | "
              f"{smooth / reference_smoothed:.4f} | {fraction:.4f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"direction": what, "version": version, "last_versions": last, "duration": args.duration, "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
