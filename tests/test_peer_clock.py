"""The peer's waits before its first lease run on the injected clock (asyncloco/clock.py, the Clock seam).

:meth:`asyncloco.peer.joining.RunJoiner.join_dht` retries an unreachable coordinator with backoff (1, 2, 4, 8, then
15 s) until ``--join-timeout``; on a :class:`~asyncloco.clock.FakeClock` the attempts land at exact fake times, and
no real second passes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncloco.clock import FakeClock
from asyncloco.peer.joining import PeerError, RunJoiner
from asyncloco.peer.runner import PeerOptions


class FlakyJoiner(RunJoiner):
    """A DHT start that fails ``failures`` times, then succeeds; remembers when (fake monotonic time) it was tried."""

    def __init__(self, failures: int, timeout: float, clock: FakeClock, stop: asyncio.Event) -> None:
        options = PeerOptions(initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/QmCoordinator"], connect_timeout=timeout)
        super().__init__(options, "QmCoordinator", stop, clock)
        self.failures = failures
        self.attempts: list[float] = []

    def start_dht(self) -> Any:
        self.attempts.append(self.clock.monotonic())
        if len(self.attempts) <= self.failures:
            raise PeerError("could not join the DHT: connection refused")
        return "dht"


async def drive(joiner: FlakyJoiner, clock: FakeClock, stop_at: float | None = None) -> Any:
    """Run ``join_dht``, moving the fake clock to each wake-up (setting ``stop`` once the clock reaches ``stop_at``)."""
    task = asyncio.ensure_future(joiner.join_dht())
    while True:
        waiter = asyncio.ensure_future(clock.wait_for_sleeper())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED, timeout=30.0)
        waiter.cancel()
        if task.done():
            return task.result()
        wake = clock.next_wakeup()
        assert wake is not None
        epoch = clock.time() - clock.monotonic()  # wake-ups are wall times; attempts and stop_at monotonic ones
        if stop_at is not None and wake - epoch > stop_at:
            joiner._stop.set()
            await asyncio.wait_for(asyncio.shield(task), timeout=30.0)
        await clock.advance_to(wake)


def test_join_retries_with_backoff_on_the_clock_until_the_coordinator_answers() -> None:
    async def scenario() -> tuple[Any, list[float]]:
        clock = FakeClock()
        joiner = FlakyJoiner(3, 600.0, clock, asyncio.Event())
        return await drive(joiner, clock), joiner.attempts

    dht, attempts = asyncio.run(asyncio.wait_for(scenario(), timeout=60.0))
    assert dht == "dht" and attempts == [0.0, 1.0, 3.0, 7.0]


def test_join_gives_up_at_the_join_timeout_and_a_stop_ends_the_wait() -> None:
    async def scenario(stop_at: float | None) -> tuple[str, list[float]]:
        clock = FakeClock()
        joiner = FlakyJoiner(100, 20.0, clock, asyncio.Event())
        with pytest.raises(PeerError) as info:
            await drive(joiner, clock, stop_at)
        return str(info.value), joiner.attempts

    error, attempts = asyncio.run(asyncio.wait_for(scenario(None), timeout=60.0))
    # backoff 1, 2, 4, 8, then the 5 s left of the 20 s --join-timeout: the sixth attempt is the last
    assert attempts == [0.0, 1.0, 3.0, 7.0, 15.0, 20.0]
    assert error.endswith("(gave up after 6 attempts in 20 s, --join-timeout)")
    error, attempts = asyncio.run(asyncio.wait_for(scenario(2.0), timeout=60.0))
    assert attempts == [0.0, 1.0] and error == "stopped while waiting for the coordinator"
