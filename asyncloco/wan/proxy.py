"""A userspace TCP proxy that makes a loopback (or LAN) link look like a wide-area one.

Put it in front of the coordinator's libp2p port and give peers its address instead: every byte between
a peer and the coordinator then crosses :class:`FaultProxy`, which emulates, per direction
(``up`` = client → server, i.e. a peer's uploads; ``down`` = server → client):

* **one-way latency** — each chunk is delivered ``latency_s`` after it left (a pipe, not stop-and-wait:
  many chunks are in flight at once, as on a real path);
* **bandwidth** — chunks leave at most at ``bandwidth_bps`` (shared by every connection through this
  proxy, as a peer's access link is);
* **loss** — TCP hides loss from applications, so loss is emulated by its effect: each 1448-byte segment
  is lost with probability ``loss`` and every lost segment stalls the stream by ``loss_stall_s`` (default:
  one round trip, the time a fast retransmit takes). Draws come from a ``random.Random`` seeded per
  (proxy seed, connection number, direction): the same seed and traffic give the same stalls;
* **connection resets** — :meth:`FaultProxy.arm_reset` resets (TCP RST on both sides) the connection that
  carries the n-th byte from now in one direction, after forwarding exactly those n bytes;
* **partitions** — :meth:`FaultProxy.partition` freezes every connection (nothing is forwarded either way,
  new connections are accepted but not forwarded); :meth:`FaultProxy.heal` lets traffic flow again and, by
  default, resets the connections that were open during the partition (a real partition longer than TCP's
  and libp2p's keep-alive timeouts kills them; the endpoints must notice and reconnect);
* **latency spikes** — :meth:`FaultProxy.set_shape` changes a direction's shape at run time (chunks already
  in flight keep their delivery times).

The proxy runs on an asyncio loop; :class:`ProxyThread` runs one in a background thread for synchronous
callers (tests, the WAN harness) and marshals every control call onto its loop. ``python -m
asyncloco.wan.proxy --help`` runs one as a process (used inside network namespaces by ``scripts/wan.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import enum
import logging
import math
import random
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Optional, TypeVar

__all__ = ["Direction", "LinkShape", "FaultProxy", "ProxyThread", "ResetEvent", "SEGMENT_BYTES"]

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 1448  # a TCP segment on an Ethernet path (MSS with timestamps)
CHUNK_BYTES = 16384  # read size: small enough that bandwidth and resets are exact to the chunk
MIN_BUFFER_BYTES = 256 * 1024
T = TypeVar("T")


class Direction(str, enum.Enum):
    UP = "up"  # client -> server (a peer's uploads when the proxy fronts the coordinator)
    DOWN = "down"  # server -> client


@dataclass(frozen=True)
class LinkShape:
    """The emulated path in one direction. ``bandwidth_bps`` in bits per second, None = unlimited."""

    latency_s: float = 0.0
    bandwidth_bps: Optional[float] = None
    loss: float = 0.0
    loss_stall_s: Optional[float] = None  # default: 2 x latency_s (one round trip), at least 10 ms

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if self.bandwidth_bps is not None and self.bandwidth_bps <= 0:
            raise ValueError(f"bandwidth_bps must be > 0 or None (unlimited), got {self.bandwidth_bps}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be a probability in [0, 1), got {self.loss}")
        if self.loss_stall_s is not None and self.loss_stall_s < 0:
            raise ValueError(f"loss_stall_s must be >= 0, got {self.loss_stall_s}")

    @property
    def stall_s(self) -> float:
        return self.loss_stall_s if self.loss_stall_s is not None else max(0.01, 2.0 * self.latency_s)

    def buffer_bytes(self) -> int:
        """Bytes the proxy may hold in flight in this direction: the bandwidth-delay product plus headroom."""
        if self.bandwidth_bps is None:
            return max(MIN_BUFFER_BYTES, 4 * 1024 * 1024)
        bdp = self.bandwidth_bps / 8.0 * (self.latency_s + self.stall_s)
        return int(max(MIN_BUFFER_BYTES, 2 * bdp))


@dataclass
class ResetEvent:
    time: float  # time.time() when the connection was reset
    direction: str
    connection: int
    at_byte: int  # bytes of that direction forwarded through the proxy, all connections, when it fired


@dataclass
class _Counters:
    bytes: dict[str, int] = field(default_factory=lambda: {d.value: 0 for d in Direction})
    connections: int = 0
    active: int = 0
    resets: list[ResetEvent] = field(default_factory=list)
    stalls: int = 0  # emulated segment losses


class _Connection:
    def __init__(self, number: int, client: asyncio.StreamWriter) -> None:
        self.number = number
        self.client = client
        self.server: Optional[asyncio.StreamWriter] = None
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.stale = False  # open during a partition: reset on heal(reset=True)

    def abort(self) -> None:
        """Reset both sides (RST, no FIN)."""
        if self.closed:
            return
        self.closed = True
        for writer in (self.client, self.server):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            try:
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            writer.transport.abort()
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()


_RESET = object()  # queue sentinel: reset the connection after the bytes before it


class FaultProxy:
    """See the module doc. Control methods must be called on the proxy's loop (or through :class:`ProxyThread`)."""

    def __init__(
        self,
        target_host: Optional[str] = None,
        target_port: Optional[int] = None,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        up: LinkShape = LinkShape(),
        down: LinkShape = LinkShape(),
        seed: int = 0,
    ) -> None:
        self.target: Optional[tuple[str, int]] = None
        if target_host is not None and target_port is not None:
            self.target = (target_host, target_port)
        self.target_unix: Optional[str] = None  # forward to a unix socket instead (see wan.cluster)
        self.listen_host, self.listen_port = listen_host, listen_port
        self.listen_unix: Optional[str] = None  # listen on a unix socket instead
        self.shapes: dict[str, LinkShape] = {Direction.UP.value: up, Direction.DOWN.value: down}
        self.seed = seed
        self.counters = _Counters()
        self._next_free: dict[str, float] = {d.value: 0.0 for d in Direction}
        self._reset_at: dict[str, Optional[int]] = {d.value: None for d in Direction}
        self._connections: dict[int, _Connection] = {}
        self._server: Optional[asyncio.base_events.Server] = None
        self._open: Optional[asyncio.Event] = None
        self._partitioned_since: Optional[float] = None

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self) -> int:
        """Start listening; returns the bound port."""
        self._open = asyncio.Event()
        self._open.set()
        if self.listen_unix is not None:
            self._server = await asyncio.start_unix_server(self._handle, self.listen_unix)
            logger.info("relay listening on %s → %s", self.listen_unix, self.target)
            return 0
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        logger.info("fault proxy listening on %s:%d → %s", self.listen_host, self.listen_port, self.target or self.target_unix)
        return self.listen_port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections.values()):
            connection.abort()
        tasks = [t for c in self._connections.values() for t in c.tasks]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._connections.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> "FaultProxy":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -------------------------------------------------------------------------------- control

    def set_target(self, host: str, port: int) -> None:
        self.target, self.target_unix = (host, port), None

    def set_target_unix(self, path: str) -> None:
        self.target, self.target_unix = None, path

    def set_shape(self, direction: Direction | str, shape: LinkShape) -> None:
        self.shapes[Direction(direction).value] = shape

    def arm_reset(self, direction: Direction | str, after_bytes: int) -> None:
        """Reset the connection that carries the ``after_bytes``-th byte from now in ``direction``, once exactly
        ``after_bytes`` more bytes (all connections) were forwarded that way. One-shot."""
        if after_bytes < 1:
            raise ValueError(f"after_bytes must be >= 1, got {after_bytes}")
        key = Direction(direction).value
        self._reset_at[key] = self.counters.bytes[key] + after_bytes

    def partition(self) -> None:
        assert self._open is not None, "start the proxy first"
        if self._partitioned_since is None:
            self._partitioned_since = time.time()
            for connection in self._connections.values():
                connection.stale = True
            self._open.clear()
            logger.info("partition on")

    def heal(self, reset: bool = True) -> None:
        """End a partition; with ``reset`` the connections open during it are reset (module doc)."""
        assert self._open is not None, "start the proxy first"
        if reset:
            for connection in list(self._connections.values()):
                if connection.stale:
                    connection.abort()
        self._partitioned_since = None
        self._open.set()
        logger.info("partition healed%s", " (stale connections reset)" if reset else "")

    @property
    def partitioned(self) -> bool:
        return self._partitioned_since is not None

    def snapshot(self) -> dict[str, Any]:
        """Counters as plain data."""
        return {
            "bytes_up": self.counters.bytes[Direction.UP.value],
            "bytes_down": self.counters.bytes[Direction.DOWN.value],
            "connections": self.counters.connections,
            "active": self.counters.active,
            "stalls": self.counters.stalls,
            "resets": [dataclasses.asdict(r) for r in self.counters.resets],
            "partitioned": self.partitioned,
        }

    # ------------------------------------------------------------------------------- forwarding

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        self.counters.active += 1
        connection = _Connection(self.counters.connections, client_writer)
        self._connections[connection.number] = connection
        try:
            assert self._open is not None
            await self._open.wait()  # a connection opened during a partition waits for the heal
            if self.target is not None:
                server_reader, server_writer = await asyncio.open_connection(*self.target)
            elif self.target_unix is not None:
                server_reader, server_writer = await asyncio.open_unix_connection(self.target_unix)
            else:
                raise ConnectionRefusedError("the proxy has no target yet")
            connection.server = server_writer
            if connection.closed:
                server_writer.transport.abort()
                return
            connection.tasks = [
                asyncio.create_task(self._pump(connection, Direction.UP.value, client_reader, server_writer)),
                asyncio.create_task(self._pump(connection, Direction.DOWN.value, server_reader, client_writer)),
            ]
            await asyncio.gather(*connection.tasks, return_exceptions=True)
        except (OSError, asyncio.CancelledError) as error:
            logger.debug("connection %d: %r", connection.number, error)
        finally:
            if not connection.closed:  # both directions ended with EOF: close politely (FIN)
                connection.closed = True
                for writer in (connection.client, connection.server):
                    if writer is not None:
                        writer.close()
            self.counters.active -= 1
            self._connections.pop(connection.number, None)

    def _schedule(self, direction: str, size: int, rng: random.Random, offset: int = 0) -> float:
        """Delivery time (loop clock) of a chunk of ``size`` bytes read now, ``offset`` bytes into its stream.

        One loss draw per segment that starts in the chunk, in stream order: the stalls depend on the seed and
        the bytes sent, not on how the reads happened to split them."""
        shape = self.shapes[direction]
        now = asyncio.get_running_loop().time()
        depart = max(now, self._next_free[direction])
        if shape.bandwidth_bps is not None:
            depart += size * 8.0 / shape.bandwidth_bps
        if shape.loss > 0:
            segments = math.ceil((offset + size) / SEGMENT_BYTES) - math.ceil(offset / SEGMENT_BYTES)
            lost = sum(1 for _ in range(segments) if rng.random() < shape.loss)
            if lost:
                self.counters.stalls += lost
                depart += lost * shape.stall_s
        self._next_free[direction] = depart
        return depart + shape.latency_s

    async def _pump(
        self, connection: _Connection, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        rng = random.Random(f"{self.seed}/{connection.number}/{direction}")
        queue: Deque[tuple[float, Any]] = collections.deque()
        queued = [0]
        offset = 0  # bytes of this connection and direction read so far
        changed = asyncio.Event()

        async def deliver() -> None:
            while True:
                while not queue:
                    changed.clear()
                    await changed.wait()
                at, item = queue[0]
                delay = at - asyncio.get_running_loop().time()
                if delay > 0:
                    await asyncio.sleep(delay)
                assert self._open is not None
                if not self._open.is_set():
                    await self._open.wait()
                    if connection.closed:
                        return
                queue.popleft()
                if item is None:  # EOF from the sender: half-close
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                if item is _RESET:
                    connection.abort()
                    return
                writer.write(item)
                await writer.drain()
                self.counters.bytes[direction] += len(item)
                queued[0] -= len(item)
                changed.set()

        sender = asyncio.create_task(deliver())
        try:
            while not sender.done():
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    queue.append((self._schedule(direction, 0, rng), None))
                    changed.set()
                    break
                armed = self._reset_at[direction]
                counted = self.counters.bytes[direction] + queued[0]
                if armed is not None and counted + len(data) >= armed:
                    head = data[: max(0, armed - counted)]
                    self._reset_at[direction] = None
                    self.counters.resets.append(ResetEvent(time.time(), direction, connection.number, armed))
                    if head:
                        queue.append((self._schedule(direction, len(head), rng, offset), head))
                        queued[0] += len(head)
                    queue.append((self._schedule(direction, 0, rng), _RESET))
                    changed.set()
                    logger.info("reset armed in %s fires on connection %d at byte %d", direction, connection.number, armed)
                    break
                queue.append((self._schedule(direction, len(data), rng, offset), data))
                offset += len(data)
                queued[0] += len(data)
                changed.set()
                while queued[0] > self.shapes[direction].buffer_bytes() and not sender.done():
                    changed.clear()
                    await changed.wait()
            await sender
        except (OSError, asyncio.IncompleteReadError) as error:
            logger.debug("connection %d %s: %r", connection.number, direction, error)
            connection.abort()
        finally:
            if not sender.done():
                sender.cancel()
            # always collect the sender: a write that failed after the reader stopped is expected here, not news
            await asyncio.gather(sender, return_exceptions=True)


class ProxyThread:
    """A :class:`FaultProxy` on its own event loop in a daemon thread, controlled synchronously.

    ``with ProxyThread(FaultProxy(...)) as proxy: proxy.call(lambda p: p.partition())``."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fault-proxy", daemon=True)
        self.port = 0

    def start(self) -> int:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(timeout=30)
        return self.port

    def call(self, function: Callable[[FaultProxy], T]) -> T:
        """Run ``function(proxy)`` on the proxy's loop and return its result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(function(self.proxy))
            except BaseException as error:
                future.set_exception(error)

        self.loop.call_soon_threadsafe(run)
        return future.result(timeout=30)

    def snapshot(self) -> dict[str, Any]:
        return self.call(lambda p: p.snapshot())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()

    def __enter__(self) -> "ProxyThread":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------- CLI


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _shape(latency_ms: float, mbit: Optional[float], loss_percent: float) -> LinkShape:
    return LinkShape(
        latency_s=latency_ms / 1000.0,
        bandwidth_bps=None if not mbit else mbit * 1e6,
        loss=loss_percent / 100.0,
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncloco.wan.proxy", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", type=_address, help="HOST:PORT to listen on (PORT 0: any)")
    where.add_argument("--listen-unix", help="a unix socket path to listen on instead")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency, each direction")
    parser.add_argument("--up-mbit", type=float, default=None, help="client→server bandwidth cap (default none)")
    parser.add_argument("--down-mbit", type=float, default=None, help="server→client bandwidth cap (default none)")
    parser.add_argument("--loss", type=float, default=0.0, help="segment loss in percent, emulated as stalls")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s proxy %(levelname)s %(message)s")

    async def run() -> None:
        listen = args.listen or ("127.0.0.1", 0)
        proxy = FaultProxy(
            *args.target,
            listen_host=listen[0],
            listen_port=listen[1],
            up=_shape(args.latency_ms, args.up_mbit, args.loss),
            down=_shape(args.latency_ms, args.down_mbit, args.loss),
            seed=args.seed,
        )
        proxy.listen_unix = args.listen_unix
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with proxy:
            if args.port_file:
                with open(args.port_file, "w") as handle:
                    handle.write(str(proxy.listen_port))
            await stop.wait()
        logger.info("proxy stopped: %s", proxy.snapshot())

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
