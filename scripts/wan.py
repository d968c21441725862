#!/usr/bin/env python
"""Run asyncloco over emulated wide-area links (network namespaces, root): see docs/wan.md.

    python scripts/wan.py profiles                       # the link profiles
    python scripts/wan.py check --profile far            # set one link up and measure it (rates, RTT)
    python scripts/wan.py run --config configs/demo.yaml --peers home:1,far:4,campus:1.5 --budget 120 --out runs/wan
    python scripts/wan.py compare runs/home runs/lan      # a run against its twin at equal local steps

``run``: the coordinator in its own namespace, each peer in its own behind its profile's link (tbf
bandwidth each way, userspace latency/loss), training for ``--budget`` seconds from the first lease; prints
perplexity vs wall time and writes ``<out>/result.json``. Everything it made (namespaces, veths, qdiscs,
bridge, processes) is removed on exit, on an error and on Ctrl+C/SIGTERM. Exits 2 with the reason when
namespaces are unavailable (not root, no ``ip netns``). ``compare``: two runs' ``--out`` directories, the first
against the second at equal local steps (asyncloco/wan/compare.py): over the last third, at the end, and the lag.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from typing import Any
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncloco.wan.compare import compare, read_curve  # noqa: E402
from asyncloco.wan.netns import PROFILES, WanNetwork, namespaces_unavailable, wait_for_port_file  # noqa: E402
from asyncloco.wan.run import _rate_args, parse_peers, run_wan  # noqa: E402


def check(profile_name: str) -> dict[str, object]:
    profile = PROFILES[profile_name]
    python = sys.executable
    with tempfile.TemporaryDirectory() as scratch, WanNetwork() as net:
        server = net.add_node("srv")
        client = net.add_node("cli", profile)
        net.spawn(server, [python, "-m", "asyncloco.wan.probe", "serve", "--host", "127.0.0.1", "--port", "5201"])
        port_file = str(Path(scratch) / "port")
        net.spawn(
            server,
            [python, "-m", "asyncloco.wan.proxy", "--listen", f"{server.address}:0", "--target", "127.0.0.1:5201",
             "--latency-ms", str(profile.latency_ms), "--loss", str(profile.loss * 100), "--port-file", port_file,
             *_rate_args(profile)],
        )  # fmt: skip
        port = wait_for_port_file(port_file)
        up = int((profile.up_mbit or 100) * 1e6 / 8 * 2)  # ~2 s at the nominal rate
        down = int((profile.down_mbit or 100) * 1e6 / 8 * 2)
        out = net.run(
            client,
            [python, "-m", "asyncloco.wan.probe", "measure", "--host", server.address, "--port", str(port),
             "--up-bytes", str(up), "--down-bytes", str(down)],
            timeout=300,
        )  # fmt: skip
    return json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("profiles", help="list the link profiles")
    c = sub.add_parser("check", help="measure one emulated link")
    c.add_argument("--profile", default="home", choices=sorted(PROFILES))
    c.add_argument("--json", type=Path, help="also write the measurement here")
    r = sub.add_parser("run", help="a coordinator and peers over emulated links")
    r.add_argument("--config", help="run config (required, but for --smoke: the demo's)")
    r.add_argument("--peers", default="home:1,far:4,campus:1.5", help="profile:slowdown per peer")
    r.add_argument("--budget", type=float, default=120.0, help="seconds of training from the first lease")
    r.add_argument("--out", default="runs/wan")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--seed", type=int, default=0, help="seeds the proxies' loss draws")
    r.add_argument("--smoke", action="store_true", help="seconds of work: the demo, one campus peer, 8 s (tests)")
    q = sub.add_parser("compare", help="a run against its twin at equal local steps")
    q.add_argument("run", type=Path, help="the --out directory of the run")
    q.add_argument("twin", type=Path, help="the --out directory of its twin (e.g. the same config over loopback)")
    q.add_argument("--json", type=Path, help="also write the comparison here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    if args.command == "run":
        if args.smoke:
            args.config = args.config or str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
            args.peers, args.budget = "campus:1", 8.0
        if not args.config:
            parser.error("run: --config is required")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    if args.command == "profiles":
        for profile in PROFILES.values():
            print(profile.describe())
        return 0
    if args.command == "compare":
        try:
            compared = compare(read_curve(args.run), read_curve(args.twin))
        except ValueError as error:
            print(f"scripts/wan.py: {error}", file=sys.stderr)
            return 2
        print(f"{'local steps':>12} {'perplexity':>11} {'twin reached it at':>19} {'lag (steps)':>12}")
        for row in compared["lag"]:
            print(f"{row['local_steps']:12} {row['perplexity']:11.2f} {row['twin_reached_it_at']:19} {row['lag_steps']:12}")
        end = compared["at_end"]
        print(f"× the twin over the last third of {compared['common_local_steps']} common local steps: "
              f"{compared['last_third']:.3f} ({compared['last_third_evaluations']} evaluations); "
              f"at {end['local_steps']} steps: {end['ratio']:.3f}")
        if args.json:
            args.json.write_text(json.dumps(compared, indent=1))
        return 0
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"scripts/wan.py: network namespaces are unavailable: {reason}", file=sys.stderr)
        return 2
    try:
        if args.command == "check":
            profile = PROFILES[args.profile]
            checked = check(args.profile)
            rtt = min(checked["rtt_s"])  # type: ignore[call-overload]
            print(f"{profile.describe()}: measured up {checked['up_mbit']:.1f} Mbit/s, down {checked['down_mbit']:.1f} Mbit/s, "
                  f"RTT {rtt * 1000:.0f} ms (configured {2 * profile.latency_ms:.0f} ms)")  # fmt: skip
            if args.json:
                args.json.write_text(json.dumps({"profile": args.profile, "up_mbit_configured": profile.up_mbit,
                                                 "down_mbit_configured": profile.down_mbit,
                                                 "latency_ms_configured": profile.latency_ms, **checked}, indent=1))
            return 0
        peers = parse_peers(args.peers)
        result: Any = run_wan(Path(args.config), peers, args.budget, Path(args.out), threads=args.threads, seed=args.seed)
    except KeyboardInterrupt:
        print("interrupted; everything was removed", file=sys.stderr)
        return 130
    except ValueError as error:
        print(f"scripts/wan.py: {error}", file=sys.stderr)
        return 2
    print(f"{'t (s)':>8} {'version':>8} {'val ppl':>10}")
    for e in result["evals"]:
        print(f"{e['t']:8.1f} {e['version']:8} {e['perplexity']:10.2f}")
    for spec, share in zip(result["peers"], result["utilisation"]):
        print(f"{spec['profile']} ×{spec['slowdown']:g}: computing {share['computing']} of its wall time "
              f"({share['computing_to_stop']} up to the stop)")
    print(f"applied {result['applied']}, expired {result['expired']}; details in {Path(args.out) / 'result.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
