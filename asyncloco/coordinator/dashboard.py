"""The coordinator's live web dashboard: one static page and the status document, over the standard library.

``asyncloco coordinator --dashboard-port 8080`` (or ``runtime.dashboard_port``) serves

* ``/`` — a single HTML page (no external resources: it works on a machine without internet) whose
  inline script fetches ``status.json`` every 2 s and draws validation perplexity against time and
  against applied updates, updates/s over time, and per-peer speed, DyLU steps per lease and mean
  staleness as inline SVG, above the table of peers;
* ``/status.json`` — the coordinator's status document, byte for byte what it wrote to
  ``<checkpoint_dir>/status.json`` (``asyncloco status --url http://HOST:PORT`` reads it).

The server binds 127.0.0.1 unless told otherwise (``--dashboard-host``): the page shows peer ids and
addresses, so put it on a public interface only on purpose (or reach it through ``ssh -L``).
It runs in a daemon thread with its own socket, so a slow browser never blocks the coordinator.
"""

from __future__ import annotations

import http.server
import ipaddress
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from asyncloco.coordinator.dashboard_page import PAGE

__all__ = ["DashboardServer", "file_source"]

logger = logging.getLogger(__name__)


def file_source(path: Path) -> Callable[[], bytes]:
    """A status source that re-reads a ``status.json`` on every request (for a stopped run, or a fixture)."""

    def read() -> bytes:
        return path.read_bytes()

    return read


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        route = self.path.split("?", 1)[0]
        if route in ("/", "/index.html"):
            self._reply(200, "text/html; charset=utf-8", PAGE.encode("utf-8"))
        elif route == "/status.json":
            try:
                body = self.server.source()
            except OSError as error:
                self._reply(503, "text/plain; charset=utf-8", f"status unavailable: {error}".encode("utf-8"))
                return
            self._reply(200, "application/json", body)
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found: the dashboard serves / and /status.json")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.debug("dashboard %s: " + format, self.client_address[0], *args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], source: Callable[[], bytes]) -> None:
        self.source = source
        super().__init__(address, _Handler)


class DashboardServer:
    """``server = DashboardServer(source); url = server.start(); ...; server.stop()``.

    ``source`` returns the status document as JSON bytes; it is called from the server's threads, so
    it must only read (the daemon hands over immutable ``bytes`` it serialised on its own loop).
    """

    def __init__(self, source: Callable[[], bytes], host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"dashboard port must be in 0..65535 (0: chosen by the OS), got {port}")
        self.source = source
        self.host = host
        self.port = port
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the dashboard is not running")
        host, port = self._server.server_address[:2]
        shown = str(host)
        if shown in ("0.0.0.0", "::"):
            shown = "127.0.0.1"
        elif ":" in shown:
            shown = f"[{shown}]"
        return f"http://{shown}:{port}/"

    def start(self) -> str:
        """Bind and serve in a background thread; returns the URL to open."""
        try:
            self._server = _Server((self.host, self.port), self.source)
        except OSError as error:
            raise ValueError(
                f"cannot serve the dashboard on {self.host}:{self.port} ({error.strerror or error}); "
                "choose another --dashboard-port (0 lets the OS pick one)"
            ) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        if not _is_loopback(self.host):
            logger.warning("the dashboard on %s is visible to every machine that can reach this address", self.host)
        logger.info("dashboard at %s", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = None
        self._thread = None

    def __enter__(self) -> "DashboardServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
