"""An in-memory stand-in for the part of ``hivemind.P2P`` the coordinator's RPCs use: binary stream handlers and
the streams between nodes, in one event loop ("the network double below the real code").

The real :class:`~asyncloco.transport.rpc_client.CoordinatorClient` and
:class:`~asyncloco.transport.rpc.CoordinatorService` run on it unchanged — framing, bounds, error frames, traffic
counters and all — so the in-process tests (asyncloco/testing/memory.py) exercise the same code as a real run;
only libp2p and p2pd are replaced. What a node offers is what those classes call: ``add_binary_stream_handler``,
``remove_binary_stream_handler``, ``call_binary_stream_handler`` and ``list_peers``.

A stream is two byte pipes (:class:`Pipe`), each an :class:`asyncio.StreamReader` on the receiving side and a writer
with the ``asyncio.StreamWriter`` methods the framing layer uses. Faults are injected *at the stream*: a connect
hook may delay or refuse a call, and a pipe can be told to drop what is written to it (a lost answer) or to reset
after a given number of writes and bytes (a connection cut mid-body). A node going down cuts every stream it holds.

The handler of a stream runs in a task started from the caller's context, so a test's clock actor (asyncloco/clock.py
``ACTOR``) follows a call into the handler: a coordinator holding a lease request sleeps as the peer that asked.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

__all__ = ["MemoryNetwork", "MemoryP2P", "MemoryPeerID", "Pipe", "StreamInfo", "CURRENT_PIPES"]

logger = logging.getLogger(__name__)

Handler = Callable[[Any, asyncio.StreamReader, Any], Awaitable[None]]

CURRENT_PIPES: contextvars.ContextVar[Optional[tuple["Pipe", "Pipe"]]] = contextvars.ContextVar(
    "asyncloco_memory_pipes", default=None
)
"""(request pipe, reply pipe) of the stream whose handler runs in this context: fault injection above the stream
(a lost answer once the coordinator has decided) reaches its pipes through it."""


class MemoryPeerID:
    """A node's id: ``to_base58()`` is its plain name (the coordinator keys its peers by it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def to_base58(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryPeerID) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("MemoryPeerID", self.name))

    def __repr__(self) -> str:
        return f"MemoryPeerID({self.name!r})"

    __str__ = to_base58


@dataclass(frozen=True)
class StreamInfo:
    """What a stream handler learns of its caller (hivemind's ``StreamInfo``: the authenticated peer id)."""

    peer_id: MemoryPeerID


class Pipe:
    """One direction of a stream: what is written arrives at :attr:`reader`.

    ``drop()``: the next write vanishes and the connection dies with it (the reader sees the stream end; a server
    that waits for its caller to hang up after answering must not wait for a caller that never got the answer);
    ``reset_after(writes, fraction)``: let ``writes`` more writes through whole, then ``fraction`` of the next
    one, and reset — the reader sees the stream end early, the writer a :class:`ConnectionResetError`."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self.closed = False
        self.dropping = False
        self._reset_plan: Optional[tuple[int, float]] = None
        self.written = 0  # bytes that arrived

    def drop(self) -> None:
        self.dropping = True

    def reset_after(self, writes: int, fraction: float) -> None:
        self._reset_plan = (writes, fraction)

    # --- the asyncio.StreamWriter surface the framing layer uses

    def write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the stream was reset")
        if self.dropping:  # the answer is lost with the connection: the reader sees the stream end
            self.cut()
            return
        if self._reset_plan is not None:
            writes, fraction = self._reset_plan
            if writes <= 0:
                part = bytes(data[: int(len(data) * fraction)])
                if part:
                    self.reader.feed_data(part)
                    self.written += len(part)
                self.cut()
                raise ConnectionResetError(f"connection reset after {self.written} bytes (injected)")
            self._reset_plan = (writes - 1, fraction)
        if data:
            self.reader.feed_data(bytes(data))
            self.written += len(data)

    async def drain(self) -> None:
        if self.closed and not self.dropping:
            raise ConnectionResetError("the stream was reset")
        await asyncio.sleep(0)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()

    async def wait_closed(self) -> None:
        return None

    def cut(self) -> None:
        """The connection died: the reader sees the end of the stream, further writes fail."""
        self.close()


ConnectHook = Callable[[str, str, str], Awaitable[Optional[Callable[[Pipe, Pipe], None]]]]


class MemoryNetwork:
    """The nodes of one in-memory network, by name. ``connect_hook(caller, target, handle_name)`` runs before each
    stream opens (the caller's context): it may sleep (a delay), raise :class:`ConnectionError` (a lost request),
    or return a function that rigs the new stream's (request, reply) pipes (e.g. a reset mid-body)."""

    def __init__(self, connect_hook: Optional[ConnectHook] = None) -> None:
        self.nodes: dict[str, MemoryP2P] = {}
        self.connect_hook = connect_hook

    def node(self, name: str) -> "MemoryP2P":
        """The node called ``name`` (created on first use)."""
        if name not in self.nodes:
            self.nodes[name] = MemoryP2P(self, name)
        return self.nodes[name]


class MemoryP2P:
    """One node of a :class:`MemoryNetwork`: ``hivemind.P2P``'s binary stream handlers, in memory."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self.network, self.peer_id = network, MemoryPeerID(name)
        self.up = True
        self._handlers: dict[str, Handler] = {}
        self._streams: set[tuple[Pipe, Pipe]] = set()
        self._tasks: set["asyncio.Task[None]"] = set()
        self.on_handler_error: Optional[Callable[[BaseException], bool]] = None

    async def add_binary_stream_handler(self, name: str, handler: Handler) -> None:
        if name in self._handlers:
            raise ValueError(f"handler {name!r} is already registered")
        self._handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def list_peers(self) -> list[StreamInfo]:
        """The nodes this one can reach now (every other node that is up)."""
        return [StreamInfo(node.peer_id) for node in self.network.nodes.values() if node is not self and node.up]

    async def call_binary_stream_handler(self, peer_id: Any, handle_name: str) -> tuple[StreamInfo, asyncio.StreamReader, Pipe]:
        target = self.network.nodes.get(peer_id.to_base58())
        rig = None
        if self.network.connect_hook is not None:
            rig = await self.network.connect_hook(self.peer_id.name, peer_id.to_base58(), handle_name)
        if target is None or not target.up:
            raise ConnectionRefusedError(f"{peer_id.to_base58()} is not reachable")
        handler = target._handlers.get(handle_name)
        if handler is None:
            raise ConnectionRefusedError(f"{peer_id.to_base58()} has no handler {handle_name!r}")
        request, reply = Pipe(), Pipe()
        if rig is not None:
            rig(request, reply)
        target._streams.add((request, reply))

        async def serve() -> None:
            CURRENT_PIPES.set((request, reply))
            try:
                await handler(StreamInfo(self.peer_id), request.reader, reply)
            except asyncio.CancelledError:
                pass
            except BaseException as error:  # noqa: BLE001 — a test's kill point, or a bug: the stream dies with it
                if target.on_handler_error is None or not target.on_handler_error(error):
                    logger.error("stream handler %s failed: %r", handle_name, error)
            finally:
                reply.close()
                target._streams.discard((request, reply))

        task = asyncio.ensure_future(serve())  # the caller's context: its clock actor follows the call
        target._tasks.add(task)
        task.add_done_callback(target._tasks.discard)
        return StreamInfo(target.peer_id), reply.reader, request

    def go_down(self) -> None:
        """The node dies: every stream it serves is cut and every handler task cancelled (the current task's
        own handler excepted: it is the one dying)."""
        self.up = False
        current = asyncio.current_task()
        for request, reply in list(self._streams):
            request.cut()
            reply.cut()
        for task in list(self._tasks):
            if task is not current and not task.done():
                task.cancel()

    def go_up(self) -> None:
        self.up = True

    async def drain(self) -> None:
        """Wait for the handler tasks still running (after :meth:`go_down`, their cancellation)."""
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        self.go_down()
        await self.drain()
