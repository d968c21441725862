"""The clock the coordinator daemon and the peer runner read.

Every decision that depends on time (lease deadlines, holds and grace windows, a peer's resend until its
lease's deadline, its backoff) reads a :class:`Clock` instead of :mod:`time` directly, so the same code runs
under :data:`SYSTEM_CLOCK` in real runs and under a :class:`FakeClock` in the in-process tests
(asyncloco/testing/memory.py), where time moves only when the test moves it.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import time
from typing import Optional, Protocol

__all__ = ["Clock", "SystemClock", "SYSTEM_CLOCK", "FakeClock", "ACTOR", "pause"]

# Who is sleeping on a FakeClock: the value in the sleeping task's context (tasks it starts inherit it).
ACTOR: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("asyncloco_clock_actor", default=None)


class Clock(Protocol):
    """Wall time (``time``: seconds since the epoch, what leases and the log carry), a monotonic time for
    durations, and a sleep on the same clock."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: :func:`time.time`, :func:`time.monotonic`, :func:`asyncio.sleep`."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()


async def pause(clock: Clock, stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` on ``clock`` unless ``stop`` is set first (then the sleep is cancelled at once, a
    :class:`FakeClock` one included). Returns whether ``stop`` is set. The coordinator's timed loops pause
    with it (asyncloco/coordinator/loops.py)."""
    if stop.is_set():
        return True
    sleeping = asyncio.ensure_future(clock.sleep(seconds))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((sleeping, stopped), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in (sleeping, stopped):
            waiter.cancel()
    return stop.is_set()


class FakeClock:
    """A clock that moves only when :meth:`advance` (or :meth:`advance_to`) is called.

    ``sleep(s)`` waits until the fake time has advanced ``s`` seconds; each sleeper remembers its actor (the
    :data:`ACTOR` of its context), so a test can move time exactly when the actor it drives waits on the
    clock (:meth:`wake_time_of`) and never while that actor computes (e.g. trains in a thread).

    :param start: the wall time (``time()``) at the start; ``monotonic()`` starts at 0.
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        if start < 0:
            raise ValueError(f"FakeClock(start={start}) must be a time >= 0 (seconds since the epoch)")
        self._start = float(start)
        self._now = float(start)
        self._sleepers: list[tuple[float, int, "asyncio.Future[None]", Optional[str]]] = []
        self._order = itertools.count()
        self._changed: Optional[asyncio.Event] = None

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now - self._start

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future, ACTOR.get()))
        self._event().set()
        try:
            await future
        finally:
            if not future.done():
                future.cancel()  # a cancelled sleeper leaves the heap at the next advance

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    @property
    def sleepers(self) -> int:
        """Sleepers still waiting."""
        return sum(1 for _, _, future, _ in self._sleepers if not future.done())

    def next_wakeup(self) -> Optional[float]:
        """The earliest wake-up time (wall) of a waiting sleeper, or None."""
        pending = [when for when, _, future, _ in self._sleepers if not future.done()]
        return min(pending) if pending else None

    def wake_time_of(self, actor: str) -> Optional[float]:
        """The earliest wake-up of ``actor``'s sleepers, if one sleeps on this clock now (else None)."""
        times = [when for when, _, future, owner in self._sleepers if owner == actor and not future.done()]
        return min(times) if times else None

    async def wait_for_sleeper(self) -> None:
        """Return once a sleep started after the last call (or at once, if one did since)."""
        event = self._event()
        await event.wait()
        event.clear()

    async def advance(self, seconds: float) -> None:
        """Move time ``seconds`` forward, waking each due sleeper in order of its wake-up time (at its own
        time, with the event loop run in between, so that what it starts sees that time)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back: advance({seconds})")
        await self.advance_to(self._now + seconds)

    async def advance_to(self, when: float) -> None:
        if when < self._now:
            raise ValueError(f"a clock cannot go back: advance_to({when}) < now {self._now}")
        while self._sleepers and self._sleepers[0][0] <= when:
            due, _, future, _ = heapq.heappop(self._sleepers)
            if future.done():
                continue
            self._now = max(self._now, due)
            future.set_result(None)
            for _ in range(5):  # let the woken task run up to its next wait
                await asyncio.sleep(0)
        self._now = when
