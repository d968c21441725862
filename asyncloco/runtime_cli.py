"""Networked entry points: ``asyncloco coordinator``, ``asyncloco peer join``, ``asyncloco demo``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    from asyncloco.peer.runner import PeerOptions

__all__ = ["add_commands"]

logger = logging.getLogger(__name__)


def _run_until_signal(
    main: Callable[[asyncio.Event], Awaitable[Any]], on_again: Callable[[], None] | None = None
) -> Any:
    """Run ``main(stop)`` on a fresh loop; SIGINT/SIGTERM set ``stop``; a second one calls ``on_again``."""

    async def runner() -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if stop.is_set() and on_again is not None:
                on_again()
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        return await main(stop)

    return asyncio.run(runner())


def _limit_threads(threads: int | None) -> None:
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from asyncloco.shipped import resolve_config
    from asyncloco.config import load_config
    from asyncloco.coordinator.daemon import CoordinatorDaemon

    if args.config is None:
        raise ValueError("asyncloco coordinator needs --config (a YAML path or a shipped config's name, e.g. demo)")
    _limit_threads(args.threads)
    overrides: dict[str, Any] = {}
    if args.port is not None:
        overrides["runtime.port"] = args.port
    if args.host is not None:
        overrides["runtime.host"] = args.host
    if args.checkpoint_dir is not None:
        overrides["runtime.checkpoint_dir"] = args.checkpoint_dir
    # --- dashboard (coordinator/dashboard.py) ---
    if args.dashboard_port is not None:
        overrides["runtime.dashboard_port"] = args.dashboard_port
    if args.dashboard_host is not None:
        overrides["runtime.dashboard_host"] = args.dashboard_host
    # --- reach (transport/reach.py) ---
    if args.announce_addr is not None:
        from asyncloco.transport.reach import validate_announce_addr

        overrides["runtime.announce_addr"] = validate_announce_addr(args.announce_addr)
    from asyncloco.overrides import overrides_from_args

    overrides.update(overrides_from_args(args))
    cfg = load_config(resolve_config(args.config), overrides)
    daemon = CoordinatorDaemon(cfg, resume=args.resume, initial_peers=tuple(args.initial_peers or ()))

    async def main(stop: asyncio.Event) -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop, ready))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            address = daemon.multiaddrs[0] if daemon.multiaddrs else "?"
            print(f"Coordinator of run '{cfg.runtime.run_id}' is up ({daemon.numel / 1e6:.1f} M-parameter model). "
                  f"Peer id: {daemon.peer_id}", flush=True)
            print(f"Join it from another terminal with:\n  asyncloco peer join --initial-peers {address} --run-id {cfg.runtime.run_id}", flush=True)
            if daemon.reach_problem:
                print(f"WARNING: {daemon.reach_problem}", flush=True)
            if daemon.monitoring.stats.dashboard_url:
                print(f"Dashboard: {daemon.monitoring.stats.dashboard_url}  (or: asyncloco status --url {daemon.monitoring.stats.dashboard_url})", flush=True)
        else:
            ready_wait.cancel()
        await task

    _run_until_signal(main)
    return 0


def peer_options(args: argparse.Namespace) -> PeerOptions:
    """The :class:`~asyncloco.peer.runner.PeerOptions` of ``asyncloco peer join``'s arguments."""
    from asyncloco.peer.runner import PeerOptions

    return PeerOptions(
        initial_peers=list(args.initial_peers),
        coordinator_id=args.coordinator_id,
        run_id=args.run_id,
        host=args.host,
        slowdown=args.slowdown,
        max_rounds=args.max_rounds,
        device=args.device,
        summary_path=Path(args.summary) if args.summary else None,
        progress=not args.no_progress and sys.stderr.isatty(),
        connect_timeout=args.connect_timeout,
        prefetch=args.prefetch,
        token=_read_token(args.token),  # admission
        identity_path=args.identity,  # admission: a token binds to this identity
        dht_server=args.dht_server,  # reach
        name=args.name,
        swarm=args.swarm,  # θ from other peers (transport/swarm.py)
        serve=args.serve,
        serve_bandwidth=None if args.serve_bandwidth is None else args.serve_bandwidth * 125_000.0,
        overlap=args.overlap,  # None: the run's runtime.overlap; --no-overlap: serial rounds
    )


def cmd_peer_join(args: argparse.Namespace) -> int:
    from asyncloco.peer.runner import PeerError, PeerRunner

    # --- device check and torch.distributed group (peer/distributed.py) ---
    from asyncloco.peer import distributed

    distributed.validate_device(args.device, args.nproc_per_node)  # before anything slow
    if args.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        return distributed.launch_torchrun(args.nproc_per_node, sys.argv[1:], args.threads)
    group = distributed.init_group(args.device)
    if group is not None and not group.is_leader:
        _limit_threads(args.threads)
        return distributed.follow(group, args.device)
    if group is not None:
        distributed.write_leader_pidfile()
    # --- end device check and group ---
    _limit_threads(args.threads)
    options = peer_options(args)
    try:
        runner = PeerRunner(options, group=group)
    except PeerError as error:
        raise ValueError(str(error)) from None

    async def main(stop: asyncio.Event) -> Any:
        task = asyncio.create_task(runner.run())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            logger.info("stopping: finishing the current lease and submitting it (Ctrl+C again to leave at once)")
            runner.stop()
        else:
            stopper.cancel()
        return await task

    def leave_now() -> None:
        logger.info("leaving at once")
        runner.abort()

    try:
        summary = _run_until_signal(main, on_again=leave_now)
    except PeerError as error:
        raise ValueError(str(error)) from None
    print(
        f"peer {summary.peer_id}: {summary.rounds} rounds, {summary.steps} steps, {summary.accepted} accepted "
        f"({summary.duplicates} duplicates), {summary.rejected} rejected",
        flush=True,
    )
    return 0


# ---- validator peers (asyncloco/validator.py; docs/threat-model.md "Who verifies") ----


def cmd_validator_id(args: argparse.Namespace) -> int:
    from asyncloco.validator import identity_peer_id

    print(identity_peer_id(args.identity), flush=True)
    return 0


def cmd_validator_join(args: argparse.Namespace) -> int:
    from asyncloco.peer.joining import PeerError
    from asyncloco.validator import Validator, ValidatorOptions

    _limit_threads(args.threads)
    options = ValidatorOptions(
        initial_peers=list(args.initial_peers), run_id=args.run_id, coordinator_id=args.coordinator_id, host=args.host,
        identity_path=args.identity, device=args.device, connect_timeout=args.connect_timeout,
        max_checks=args.max_checks, summary_path=Path(args.summary) if args.summary else None,
    )
    try:
        validator = Validator(options)
    except PeerError as error:
        raise ValueError(str(error)) from None

    async def main(stop: asyncio.Event) -> Any:
        task = asyncio.create_task(validator.run())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            validator.stop()
        else:
            stopper.cancel()
        return await task

    try:
        summary = _run_until_signal(main)
    except PeerError as error:
        raise ValueError(str(error)) from None
    print(f"validator {summary.peer_id}: {summary.checks} checks ({summary.passed} passed, {summary.failed} failed), "
          f"{summary.rerun_steps} steps re-run", flush=True)
    return 0


def _add_validator_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    validator = sub.add_parser("validator", help="organiser-run peers that re-run checks for the coordinator (verified work)")
    validator_sub = validator.add_subparsers(dest="validator_command", required=True)
    ident = validator_sub.add_parser("id", help="print the peer id of a key file (created if missing): list it in "
                                     "runtime.verify.validators")
    ident.add_argument("--identity", required=True, help="the validator's libp2p key file")
    ident.set_defaults(func=cmd_validator_id)
    join = validator_sub.add_parser("join", help="join a run as a validator and re-run checks until Ctrl+C")
    join.add_argument("--initial-peers", nargs="+", required=True, help="the multiaddr the coordinator printed")
    join.add_argument("--run-id", default="asyncloco-demo", help="run id (printed by the coordinator)")
    join.add_argument("--coordinator-id", help="coordinator peer id to pin (default: from the first initial peer)")
    join.add_argument("--identity", required=True, help="the key file whose peer id is in runtime.verify.validators")
    join.add_argument("--host", default="127.0.0.1", help="address this validator listens on")
    join.add_argument("--device", default="cpu", help="torch device for the re-runs (the peers' device type)")
    join.add_argument("--threads", type=int, help="torch CPU threads")
    join.add_argument("--max-checks", type=int, help="leave after this many verdicts")
    join.add_argument("--summary", help="write a JSON summary (checks, verdicts) here")
    join.add_argument("--join-timeout", dest="connect_timeout", type=float, default=600.0, metavar="SECONDS",
                      help="how long to wait for an unreachable or restarting coordinator (default 600)")
    join.set_defaults(func=cmd_validator_join)


# ---- admission tokens (asyncloco/coordinator/admission.py) ----


def _positive_mbit(text: str) -> float:
    """``--serve-bandwidth``: a positive number of Mbit/s."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of Mbit/s (e.g. 20)") from None
    if not 0 < value < 1e7:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of Mbit/s (e.g. 20)")
    return value


def _read_token(value: str | None) -> str | None:
    """``--token TOKEN`` or ``--token @FILE`` (keeps the token out of the shell history and ``ps``)."""
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:])
    if not path.is_file():
        raise ValueError(f"--token {value}: {path} does not exist; pass the token itself or @FILE of a file holding it")
    return path.read_text().strip()


def cmd_token(args: argparse.Namespace) -> int:
    from asyncloco.coordinator.admission import issue_token, parse_duration

    if args.checkpoint_dir is None:
        raise ValueError("give --checkpoint-dir DIR: the run's runtime.checkpoint_dir, which holds its signing key")
    if args.peer_name is None:
        raise ValueError("give --peer-name NAME (a label for the volunteer this token admits, e.g. alice)")
    token, claims = issue_token(args.checkpoint_dir, args.peer_name, parse_duration(args.expires))
    print(
        f"token {claims.token_id} for {claims.name!r}, valid until "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(claims.expires_at))}; the volunteer joins with "
        f"`asyncloco peer join ... --token TOKEN --identity peer.key`; revoke it with "
        f"`asyncloco coordinator token revoke --checkpoint-dir {args.checkpoint_dir} {claims.token_id}`",
        file=sys.stderr,
    )
    print(token, flush=True)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    from asyncloco.coordinator.admission import revoke_token

    if revoke_token(args.checkpoint_dir, args.token_id):
        print(f"revoked {args.token_id}; a running coordinator applies it within a few seconds")
    else:
        print(f"{args.token_id} was already revoked")
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    from asyncloco.coordinator.admission import list_issued, read_revoked

    revoked = read_revoked(args.checkpoint_dir)
    now = time.time()
    print(f"{'token id':32s} {'name':16s} {'expires (UTC)':19s} state")
    for item in list_issued(args.checkpoint_dir):
        state = "revoked" if item["token_id"] in revoked else ("expired" if item["expires_at"] <= now else "valid")
        expires = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(item["expires_at"]))
        print(f"{item['token_id']:32s} {item['name']:16s} {expires:19s} {state}")
    return 0


def _add_token_commands(coordinator: argparse.ArgumentParser) -> None:
    commands = coordinator.add_subparsers(dest="coordinator_command", required=False)
    token = commands.add_parser(
        "token", help="issue an admission token (runtime.admission: token); `token revoke`, `token list`"
    )
    token.add_argument("--checkpoint-dir", help="the run's runtime.checkpoint_dir (holds its signing key)")
    token.add_argument("--peer-name", help="label of the volunteer this token admits, e.g. alice")
    token.add_argument("--expires", default="7d", help="validity: 7d, 12h, 30m, 3600s (default 7d)")
    token.set_defaults(func=cmd_token)
    token_commands = token.add_subparsers(dest="token_command", required=False)
    revoke = token_commands.add_parser("revoke", help="revoke a token (a running coordinator picks it up in seconds)")
    revoke.add_argument("--checkpoint-dir", required=True, help="the run's runtime.checkpoint_dir")
    revoke.add_argument("token_id", help="the token's id (see `token list`)")
    revoke.set_defaults(func=cmd_token_revoke)
    listing = token_commands.add_parser("list", help="tokens issued in this run: id, name, expiry, state")
    listing.add_argument("--checkpoint-dir", required=True, help="the run's runtime.checkpoint_dir")
    listing.set_defaults(func=cmd_token_list)


def cmd_demo(args: argparse.Namespace) -> int:
    from asyncloco.demo import DemoOptions, run_demo
    from asyncloco.local_cluster import ClusterError
    from asyncloco.overrides import overrides_from_args

    options = DemoOptions(
        config=args.config,
        overrides=overrides_from_args(args),
        duration=args.duration,
        slowdowns=[float(x) for x in args.slowdowns.split(",")],
        out=Path(args.out),
        swarm=args.swarm,
    )
    try:
        return run_demo(options)
    except ClusterError as error:  # one line, not a traceback: the coordinator's own error is in it
        print(f"asyncloco: error: {error}", file=sys.stderr)
        return 2 if error.exit_code == 2 else 1


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from asyncloco.overrides import add_override_arguments

    coordinator = sub.add_parser("coordinator", help="run a coordinator daemon (holds θ, applies updates)")
    coordinator.add_argument("--config", help="run config: a YAML path or a shipped config's name, e.g. demo")
    coordinator.add_argument("--resume", action="store_true", help="continue the run in runtime.checkpoint_dir")
    coordinator.add_argument("--checkpoint-dir", help="override runtime.checkpoint_dir")
    coordinator.add_argument("--host", help="override runtime.host (address to listen on)")
    coordinator.add_argument("--port", type=int, help="override runtime.port (0: chosen by the OS)")
    coordinator.add_argument("--initial-peers", nargs="*", help="other DHT nodes to join (optional)")
    coordinator.add_argument(
        "--announce-addr",
        help="public IP or DNS name volunteers dial (sets runtime.announce_addr); the join line uses it and a "
        "start-up check says whether it is reachable and which port to open",
    )
    coordinator.add_argument("--threads", type=int, help="torch CPU threads")
    coordinator.add_argument("--dashboard-port", type=int, help="serve the live web dashboard on this port (0: any free port)")
    coordinator.add_argument("--dashboard-host", help="dashboard address (default 127.0.0.1; a public one only on purpose)")
    add_override_arguments(coordinator)
    coordinator.set_defaults(func=cmd_coordinator)
    _add_token_commands(coordinator)

    peer = sub.add_parser("peer", help="volunteer commands")
    peer_sub = peer.add_subparsers(dest="peer_command", required=True)
    join = peer_sub.add_parser("join", help="join a run and train leases until Ctrl+C")
    join.add_argument("--initial-peers", nargs="+", required=True, help="the multiaddr the coordinator printed")
    join.add_argument("--run-id", default="asyncloco-demo", help="run id (printed by the coordinator)")
    join.add_argument("--coordinator-id", help="coordinator peer id to pin (default: from the first initial peer)")
    join.add_argument("--host", default="127.0.0.1", help="address this peer listens on (0.0.0.0 for public runs)")
    join.add_argument("--slowdown", type=float, default=1.0, help="emulate a device this many times slower")
    join.add_argument("--max-rounds", type=int, help="leave after this many rounds")
    join.add_argument("--device", default="cpu", help="torch device for training, e.g. cuda")
    join.add_argument("--summary", help="write a JSON summary (rounds, bytes) here")
    join.add_argument("--no-progress", action="store_true", help="no progress bar")
    join.add_argument("--threads", type=int, help="torch CPU threads")
    join.add_argument("--join-timeout", "--connect-timeout", dest="connect_timeout", type=float, default=600.0,
                      metavar="SECONDS",
                      help="how long to wait for an unreachable or restarting coordinator, retrying with backoff "
                      "(default 600)")
    join.add_argument("--nproc-per-node", type=int, default=1,
                      help="train as a torch.distributed group of this many ranks (launches torchrun; one GPU per rank on cuda)")
    join.add_argument(
        "--no-overlap", dest="overlap", action="store_false", default=None,
        help="serial rounds: ask for the next lease only once the last update is acknowledged (default: the run's "
        "runtime.overlap, on unless the organiser turned it off)",
    )
    join.add_argument(
        "--prefetch", action="store_true",
        help="download the newest θ while asking for the next lease (saves a little idle time; costs a second "
        "download when the lease starts from a newer version)",
    )
    # --- admission (coordinator/admission.py)
    join.add_argument("--token", help="admission token from the organiser (or @FILE to read it from a file)")
    join.add_argument(
        "--identity", help="file holding this peer's libp2p key (created if missing): the same peer id, statistics and token binding "
        "across restarts"
    )
    # --- reach (transport/reach.py; README "Behind a NAT")
    join.add_argument(
        "--dht-server", action="store_true",
        help="also serve the DHT (needs inbound connections); default: a DHT client that only dials out, "
        "which works behind a home NAT",
    )
    join.add_argument("--name", help="a name for this peer in the organiser's status table (1-64 of A-Z a-z 0-9 _ . -)")
    # --- swarm downloads (transport/swarm.py; docs/transport.md "Swarm downloads")
    join.add_argument("--swarm", action="store_true",
                      help="download θ from other peers (every chunk checked against the coordinator's signed digests; "
                      "the coordinator is the seed and the fallback)")
    join.add_argument("--serve", dest="serve", action="store_true", default=None,
                      help="with --swarm: serve the versions this peer holds (default: only with --dht-server, i.e. when reachable)")
    join.add_argument("--no-serve", dest="serve", action="store_false", help="with --swarm: download only, serve nothing")
    join.add_argument("--serve-bandwidth", type=_positive_mbit, metavar="MBIT",
                      help="with --swarm: cap the upload of served chunks at this many Mbit/s (default: no cap)")
    join.set_defaults(func=cmd_peer_join)

    _add_validator_commands(sub)

    _add_demo_command(sub)


def _add_demo_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from asyncloco.overrides import add_override_arguments

    demo = sub.add_parser("demo", help="coordinator + heterogeneous peers on this machine, then a summary")
    demo.add_argument("--config", default="demo", help="run config: a YAML path or a shipped config's name (default demo)")
    demo.add_argument("--duration", type=float, default=150.0, help="seconds of training")
    demo.add_argument("--slowdowns", default="1,1.5,4", help="comma-separated slowdown factor of each peer")
    demo.add_argument("--out", default="runs/demo", help="output directory")
    demo.add_argument("--swarm", action="store_true",
                      help="peers download θ from each other and serve what they hold (peer join --swarm --serve)")
    add_override_arguments(demo)
    demo.set_defaults(func=cmd_demo)
