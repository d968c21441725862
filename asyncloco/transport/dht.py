"""Starting and stopping a hivemind DHT node so that it never outlives its owner.

``hivemind.DHT`` forks a child process. A fork inherits the parent's signal handlers, and asyncio's
``loop.add_signal_handler`` installs a Python-level handler for SIGTERM that, in the child, does
nothing — so hivemind's own fallback (``terminate()`` after a slow shutdown) is silently ignored
and the owner hangs at exit joining the child. :func:`start_dht` forks with default dispositions
for SIGTERM/SIGINT; :func:`stop_dht` escalates to SIGKILL if the graceful shutdown stalls.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import Any, Iterator

import hivemind

__all__ = ["start_dht", "stop_dht"]

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


def start_dht(**kwargs: Any) -> hivemind.DHT:
    """``hivemind.DHT(start=True, **kwargs)`` whose background process obeys SIGTERM."""
    kwargs.setdefault("shutdown_timeout", 10.0)
    with _default_signals():
        return hivemind.DHT(start=True, **kwargs)


def stop_dht(dht: hivemind.DHT, timeout: float = 10.0) -> None:
    """Graceful shutdown (which also stops its p2pd), then SIGKILL if the process is still there."""
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
