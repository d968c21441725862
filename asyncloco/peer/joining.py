"""How a volunteer peer joins a run over hivemind, before its first lease (the rounds are peer/runner.py's).

:class:`RunJoiner` starts the DHT, waiting for a coordinator that is restarting or not up yet with backoff
(``--join-timeout``); asks which run the coordinator serves (a wrong ``--run-id`` fails at once, naming the right
one); fetches the run's config with ``hello``; and sends the model/tokenizer/data/codec fingerprint for the
compatibility check. Every wait and deadline here is on the runner's :class:`~asyncloco.clock.Clock`. Beside it: the
``assign`` request as the peer sends it each round, how a refusal that no retry can help is recognised (a FATAL code
of asyncloco/refusals.py), the reaping of failed DHT starts' p2pd children, and :class:`PeerError`, the error whose
message tells the volunteer what to fix (re-exported by peer/runner.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol

from asyncloco import __version__
from asyncloco.clock import SYSTEM_CLOCK, Clock
from asyncloco.config import RunConfig
from asyncloco.peer.waits import pause
from asyncloco.refusals import FATAL

if TYPE_CHECKING:  # the transport package imports hivemind: the peer imports it where it joins (runner.run)
    from asyncloco.transport.wire import HelloReply, LeaseReply

__all__ = [
    "JoinOptions", "PeerError", "RunJoiner", "ask_for_lease", "coordinator_id_from", "reap_p2pd_zombies",
    "refused_admission",
]

logger = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A condition the volunteer must fix (the message says how)."""


class JoinOptions(Protocol):
    """What joining reads of the peer's options (peer/runner.py ``PeerOptions``)."""

    initial_peers: list[str]
    host: str
    identity_path: Optional[str]
    dht_server: bool
    connect_timeout: float
    name: Optional[str]
    token: Optional[str]


async def ask_for_lease(
    client: Any, tokens_per_s: float, token: Optional[str] = None, name: Optional[str] = None, signer: Optional[str] = None,
    keep: Optional[str] = None,
) -> LeaseReply:
    """``assign`` with this peer's speed, its admission token and ``--name`` (if it has them), and the
    fingerprint of its DHT signing key: the coordinator binds it to this peer id, so only this peer's own
    speed records count for it. ``keep``: the lease whose update is still uploading (overlapped rounds)."""
    if keep is not None:
        return await client.assign(tokens_per_s, token=token, name=name, signer=signer, keep=keep)
    return await client.assign(tokens_per_s, token=token, name=name, signer=signer)


def refused_admission(error: Exception) -> bool:
    """The coordinator refused this peer (admission, expelled, incompatible: a FATAL code of
    asyncloco/refusals.py): retrying cannot help; the message says what to do."""
    return getattr(error, "code", None) in FATAL


def reap_p2pd_zombies() -> None:
    """Collect exited p2pd children (a failed DHT start leaves its daemon unreaped): retries must not pile up
    zombies. Only this process's own exited ``p2pd`` children are touched."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if name == "p2pd" and fields[0] == "Z" and int(fields[1]) == os.getpid():
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(int(entry.name), os.WNOHANG)


def coordinator_id_from(multiaddr: str) -> str:
    if "/p2p/" not in multiaddr:
        raise PeerError(
            f"initial peer {multiaddr!r} has no /p2p/<peer id> part; copy the full address the coordinator "
            "printed (it ends with /p2p/Qm... or /p2p/12D3...)"
        )
    return multiaddr.rsplit("/p2p/", 1)[1].split("/")[0]


class RunJoiner:
    """The steps of joining the run of coordinator ``coordinator_id``, as the peer's ``options`` say.

    :param stop: set when the volunteer asks to leave (the runner's first Ctrl+C): it ends the waits here.
    :param clock: what the deadlines (``--join-timeout``) and the pauses between attempts are measured on.
    """

    def __init__(
        self, options: JoinOptions, coordinator_id: str, stop: asyncio.Event, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.options = options
        self.coordinator_id = coordinator_id
        self._stop = stop
        self.clock = clock

    def start_dht(self) -> Any:
        from asyncloco.transport.dht import start_dht

        try:
            if self.options.identity_path is not None:  # hivemind creates the key file, not its folder
                Path(self.options.identity_path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            # A DHT client by default: it dials out only and answers no DHT requests, so a volunteer behind a
            # home NAT or firewall takes part (its stores and lookups go through DHT servers such as the
            # coordinator). Relays on: should someone have to dial this peer, libp2p can go through a relay.
            return start_dht(
                initial_peers=self.options.initial_peers,
                host_maddrs=[f"/ip4/{self.options.host}/tcp/0"],
                identity_path=self.options.identity_path,
                client_mode=not self.options.dht_server,
                use_relay=True,
                use_auto_relay=not self.options.dht_server,
            )
        except Exception as error:  # hivemind raises several types when bootstrap fails
            raise PeerError(
                f"could not join the DHT through {self.options.initial_peers}: {error}. Check that the coordinator "
                "is running, that the address is the one it printed (including /p2p/...), and that its port is "
                "reachable from this machine"
            ) from error

    async def join_dht(self) -> Any:
        """:meth:`start_dht`, retried with backoff (1, 2, 4 ... 15 s) until ``connect_timeout`` (``--join-timeout``):
        a coordinator that is restarting, or not up yet, is waited for, saying so; Ctrl+C stops the wait."""
        deadline = self.clock.monotonic() + self.options.connect_timeout
        delay, attempt = 1.0, 0
        while True:
            attempt += 1
            try:
                return self.start_dht()
            except PeerError as error:
                reap_p2pd_zombies()  # the failed attempt's p2pd
                left = deadline - self.clock.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise PeerError(f"{error} (gave up after {attempt} attempts in {self.options.connect_timeout:.0f} s, "
                                    "--join-timeout)") from None
                wait = min(delay, left)
                logger.warning("waiting for the coordinator at %s: not reachable yet (attempt %d; next in %.0f s, "
                               "giving up in %.0f s: --join-timeout)", " ".join(self.options.initial_peers), attempt, wait, left)
                await pause(self.clock, wait, self._stop)  # ends early on Ctrl+C
                if self._stop.is_set():
                    raise PeerError("stopped while waiting for the coordinator") from None
                delay = min(2 * delay, 15.0)

    async def check_run_id(self, p2p: Any, namespace: str, deadline: float) -> None:
        """Ask the coordinator which run it serves (asyncloco/transport/discovery.py): a wrong ``--run-id``
        fails at once, naming the right one, instead of waiting out the connect timeout (``deadline``: on
        ``self.clock.monotonic()``)."""
        from asyncloco.transport.discovery import ask_run_info
        from asyncloco.transport.errors import TransportError

        while True:
            try:
                info = await ask_run_info(p2p, self.coordinator_id, timeout=10.0)
                break
            except TransportError as error:
                if "protocols not supported" in str(error):
                    return  # a coordinator without run info (older version): the config request will tell
                if self.clock.monotonic() > deadline:
                    raise PeerError(
                        f"the coordinator {self.coordinator_id} did not answer within {self.options.connect_timeout:.0f}s "
                        f"({error}); is it running, is its address the one it printed, and is its port reachable?"
                    ) from error
                await self.clock.sleep(1.0)
        if info.run_id != namespace:
            raise PeerError(
                f"the coordinator {self.coordinator_id} serves run {info.run_id!r}, not {namespace!r}: "
                f"join with --run-id {info.run_id}"
            )

    async def check_fingerprint(self, p2p: Any, cfg: RunConfig, workload: Any, model: Any) -> None:
        """Send this peer's model/tokenizer/data/codec fingerprint (asyncloco/fingerprint.py); the coordinator
        compares it with its own and refuses a peer whose updates would not fit its model."""
        from asyncloco.fingerprint import run_fingerprint
        from asyncloco.transport.discovery import ask_run_info
        from asyncloco.transport.errors import TransportError

        fingerprint = await asyncio.to_thread(run_fingerprint, cfg, workload, model)
        deadline = self.clock.monotonic() + self.options.connect_timeout
        while True:  # a coordinator restarting meanwhile is waited for (--join-timeout), like at the first contact
            try:
                info = await ask_run_info(
                    p2p, self.coordinator_id, timeout=30.0, fingerprint=fingerprint, software_version=__version__
                )
                break
            except TransportError as error:
                if "protocols not supported" in str(error):
                    return  # an older coordinator: it does not check fingerprints
                if self.clock.monotonic() > deadline or self._stop.is_set():
                    raise PeerError(f"the coordinator did not answer the compatibility check: {error}") from error
                logger.warning("waiting for the coordinator's compatibility check: %s", error)
                await self.clock.sleep(2.0)
        if info.refused:
            raise PeerError(f"the coordinator refused this peer: {info.refused}")

    async def fetch_config(self, p2p: Any, namespace: str) -> tuple[RunConfig, HelloReply]:
        """The run's config and the coordinator's ``hello`` reply (model size, codecs, software version)."""
        from asyncloco.transport.errors import TransportError
        from asyncloco.transport.rpc import CoordinatorClient

        probe = CoordinatorClient(p2p, self.coordinator_id, 1, namespace=namespace)
        deadline = self.clock.monotonic() + self.options.connect_timeout
        await self.check_run_id(p2p, namespace, deadline)
        while True:
            try:
                reply = await probe.hello(name=self.options.name, token=self.options.token, timeout=10.0)
                break
            except TransportError as error:
                if refused_admission(error):
                    raise PeerError(f"the coordinator refused this peer: {error}") from error
                if self.clock.monotonic() > deadline:
                    raise PeerError(
                        f"the coordinator {self.coordinator_id} did not answer within {self.options.connect_timeout:.0f}s "
                        f"({error}); is it running, and is this the run's coordinator id?"
                    ) from error
                await self.clock.sleep(1.0)
        try:
            cfg = RunConfig.model_validate(json.loads(reply.config))
        except (KeyError, ValueError) as error:
            raise PeerError(f"the coordinator sent a config this version ({__version__}) cannot read: {error}") from error
        return cfg, reply
