"""Starting and stopping a hivemind DHT node so that it never outlives its owner.

``hivemind.DHT`` forks a child process. A fork inherits the parent's signal handlers, and asyncio's
``loop.add_signal_handler`` installs a Python-level handler for SIGTERM that, in the child, does
nothing — so hivemind's own fallback (``terminate()`` after a slow shutdown) is silently ignored
and the owner hangs at exit joining the child. :func:`start_dht` forks with default dispositions
for SIGTERM/SIGINT; :func:`stop_dht` escalates to SIGKILL if the graceful shutdown stalls.

When the owner is killed outright (SIGKILL, the OOM killer), the DHT process gets SIGKILL too: it sets
``PR_SET_PDEATHSIG`` (Linux) when started from the main thread (the signal follows the *thread* that forked
it). Its p2pd, a grandchild, is reaped by the next coordinator start (coordinator/checkpoint.py).

No caller waits forever on a stopped DHT. hivemind's blocking calls (``get``, ``store``,
``run_coroutine``) send a request with an ``MPFuture`` and wait on it without a timeout; the DHT process
answers it only if it runs to completion, and at shutdown it drops every request still running. A thread
blocked on such a future never returns, and an ``asyncio.to_thread`` worker that never returns makes
``asyncio.run`` wait for it forever at exit: the coordinator hung after SIGTERM whenever its silent-peer
ping (coordinator/daemon.py) was dialing a peer behind a NAT — a dial that gets no answer at all until it
times out — at the moment it stopped. :func:`start_dht` notes every request's future;
:func:`stop_dht` fails those still pending with :class:`DHTStopped` once the process is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import weakref
from concurrent.futures import InvalidStateError
from functools import partial
from typing import Any, Iterator

import hivemind

__all__ = ["start_dht", "stop_dht", "ping_peer", "DHTStopped"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _default_signals() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    try:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


_PR_SET_PDEATHSIG = 1
_owner_pid: int | None = None  # set before the fork; the child compares it with its parent after prctl


def _die_with_owner() -> None:
    """In the DHT process: SIGKILL when the owner dies; exit now if it already did (a race with the fork)."""
    if _owner_pid is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
            return
    except (OSError, AttributeError) as error:
        logger.warning("cannot tie the DHT process to its owner: %r", error)
        return
    if os.getppid() != _owner_pid:
        os._exit(1)


class _OwnedDHT(hivemind.DHT):
    def run(self) -> None:
        _die_with_owner()
        super().run()


class DHTStopped(RuntimeError):
    """A request to a DHT process that stopped before answering it."""


class _TrackedPipe:
    """The owner's end of a DHT's request pipe: forwards every request and keeps (weakly) the ``MPFuture``
    each one carries, so that :func:`stop_dht` can fail the ones the stopped process never answered."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()
        self._futures: "weakref.WeakSet[Any]" = weakref.WeakSet()

    def send(self, request: Any) -> None:
        future = request[2].get("future") if isinstance(request, tuple) and len(request) == 3 and isinstance(request[2], dict) else None
        if future is not None:
            with self._lock:
                self._futures.add(future)
        self._pipe.send(request)

    def close(self) -> None:
        self._pipe.close()

    def pending(self) -> list[Any]:
        with self._lock:
            return [future for future in self._futures if not future.done()]

    def __getattr__(self, name: str) -> Any:  # anything else hivemind may use: the real connection's
        return getattr(self._pipe, name)


def _fail_pending(dht: hivemind.DHT) -> int:
    """Fail every request the (stopped) DHT process left unanswered; returns how many."""
    pipe = getattr(dht, "_outer_pipe", None)
    if not isinstance(pipe, _TrackedPipe):
        return 0
    failed = 0
    for future in pipe.pending():
        try:
            future.set_exception(DHTStopped(f"the DHT process {dht.pid} stopped before answering"))
            failed += 1
        except InvalidStateError:  # answered at the last moment
            pass
    if failed:
        logger.debug("failed %d DHT request(s) left unanswered by the stopped DHT process", failed)
    return failed


def start_dht(**kwargs: Any) -> hivemind.DHT:
    """``hivemind.DHT(start=True, **kwargs)`` whose background process obeys SIGTERM and, when started from
    the main thread, dies with its owner."""
    global _owner_pid
    kwargs.setdefault("shutdown_timeout", 10.0)
    # hivemind gives p2pd 15 s to start; on a loaded 2-core machine it took longer ("Daemon failed to start")
    kwargs.setdefault("startup_timeout", 60.0)
    _owner_pid = os.getpid() if threading.current_thread() is threading.main_thread() else None
    with _default_signals():
        dht = _OwnedDHT(start=True, **kwargs)
    dht._outer_pipe = _TrackedPipe(dht._outer_pipe)  # after the fork: the DHT process reads the other end
    return dht


def stop_dht(dht: hivemind.DHT, timeout: float = 10.0) -> None:
    """Graceful shutdown (which also stops its p2pd), then SIGKILL if the process is still there; then
    every request it left unanswered fails with :class:`DHTStopped` (module doc)."""
    try:
        dht.shutdown()
    except (OSError, ValueError) as error:  # the pipe may already be closed
        logger.debug("DHT shutdown: %r", error)
    if dht.is_alive():
        dht.join(timeout)
    if dht.is_alive():
        logger.warning("DHT process %s did not exit; killing it", dht.pid)
        dht.kill()
        dht.join(5.0)
    _fail_pending(dht)


async def _ping(peer_id: str, _dht: Any, node: Any) -> bool:
    from hivemind.p2p import PeerID

    return await node.protocol.call_ping(PeerID.from_base58(peer_id)) is not None


def ping_peer(dht: hivemind.DHT, peer_id: str, timeout: float = 10.0) -> bool:
    """Ping a DHT *server* by peer id (blocking): it goes (back) into this node's routing table.

    A DHT client (a peer behind a NAT) cannot be pinged by the coordinator, and once the coordinator
    restarted — same peer id and port, empty routing table — the client's stores reached nobody: its
    speed reports were stored nowhere. A client calls this before each store; a ping is one small
    round trip over the connection it already has."""
    try:
        return bool(dht.run_coroutine(partial(_ping, peer_id), return_future=True).result(timeout))
    except Exception as error:  # the coordinator may be restarting; the next period tries again
        logger.debug("ping of %s failed: %r", peer_id, error)
        return False

