"""Waking callers from the flusher thread: plain threads directly, trio tasks via their token.

A trio task waiting on the store parks on a ``trio.Event`` owned by its own run; the flusher
thread may only touch that event through ``TrioToken.run_sync_soon``.  The token is captured
when the waiter is made, so the run that waits can differ from the one that started the store
(the broker may run trio in a background thread; tests run several).  Wakeups for one run are
sent as one ``run_sync_soon`` call, so an fsync that releases 1,000 writers costs one
cross-thread hop, not 1,000.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable

import trio


class ThreadWaiter:
    """Blocks a plain thread (sync API) until woken."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def wait(self) -> None:
        self._event.wait()


class TrioWaiter:
    """Parks a trio task until woken; must be made inside the trio run that will wait."""

    __slots__ = ("event", "token")

    def __init__(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.event = trio.Event()

    async def wait(self) -> None:
        await self.event.wait()


Waiter = ThreadWaiter | TrioWaiter


def _set_all(events: list[trio.Event]) -> None:
    for event in events:
        event.set()


def wake_all(waiters: Iterable[Waiter]) -> None:
    """Wake every waiter; safe to call from any thread, and never raises for a trio run that
    has already finished (its tasks are gone, there is nobody left to tell)."""
    by_token: dict[trio.lowlevel.TrioToken, list[trio.Event]] = {}
    for waiter in waiters:
        if isinstance(waiter, ThreadWaiter):
            waiter._event.set()
        else:
            by_token.setdefault(waiter.token, []).append(waiter.event)
    for token, events in by_token.items():
        # A finished run has no tasks left to tell.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(_set_all, events)
