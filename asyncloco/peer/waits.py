"""Waits a volunteer can cut short (peer/runner.py): its second Ctrl+C ends any of them at once.

The runner's first Ctrl+C (``stop``) lets the current lease finish; the second (``abort``) must not wait for a held
``assign``, a download, a resend's backoff or the emulated slowdown. Each such wait is :func:`race` of the call
against the abort event: the call is cancelled and :class:`Aborted` raised when the event comes first.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from asyncloco.clock import Clock

__all__ = ["Aborted", "Leave", "pause", "race"]

T = TypeVar("T")


class Aborted(Exception):
    """A wait ended because the volunteer asked to leave."""


class Leave(Exception):
    """The rounds end: the volunteer asked to leave at once (the step that raised it logged what is dropped)."""


async def race(call: Awaitable[T], event: asyncio.Event) -> T:
    """Await ``call`` unless ``event`` is set first (then cancel it and raise :class:`Aborted`)."""
    task = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise Aborted()
    finally:
        for pending in (task, waiter):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending


async def pause(clock: Clock, seconds: float, abort: asyncio.Event) -> None:
    """Wait ``seconds`` (emulated device time, backoff) on ``clock`` unless ``abort`` is set first."""
    with contextlib.suppress(Aborted):
        await race(clock.sleep(seconds), abort)
