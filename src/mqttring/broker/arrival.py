"""Turns: bytes that reached a parked (or parking) connection are handled before bytes that
reached another connection after them.

Why this exists
---------------
``broker/scheduling.py`` keeps packets of different connections in arrival order on one
node: client B SUBSCRIBEs, client A PUBLISHes just after, B gets the message, as from
mosquitto.  That holds between connections that have a task waiting for bytes.  A connection
that moves in or out of the parking lot at that moment has none for a few scheduler passes:

* it sat in the lot, and the lot's task, woken by B's bytes, starts a fresh task for it;
* it was parking (quiet ``park_idle_after``): the timers cancelled its reader just as B's
  bytes came, and it serves on in the same task instead of parking.

Either way A's reader, woken in the same epoll wake-up, could handle A's PUBLISH first, and
B missed the message (one round in 60 of ``tests/test_e2e_ordering.py`` on a loaded CI
runner; 3 in 300 with B's pauses near ``park_idle_after``).  Counting passes to make the two
paths equal proved brittle, so the order is made explicit instead.

How
---
The lot watches a connection's socket from the moment the timers decide to park it, before
its reader is cancelled (``ClientHandler._enter_lot``), so no byte ever arrives unwatched:
bytes that reached it before are reported to its reader in their order (it then does not
park), bytes after are reported by the lot's epoll, itself watched by trio's, in their
order.  Whoever learns that such a connection has bytes and no task to handle them yet (the
lot, woken by its bytes; its reader, if it read them just as it was cancelled to park)
takes a *turn* for it, numbered in the order taken.  A connection ends its turn once its
first bytes are handed to the core (or it finds none, or it ends).  Every reader, before
handing bytes it read to the core, waits while a turn taken before that moment is still
open.  A turn never waits for a later one, so there is no cycle; and what a connection does
before ending its turn is only what a connection with a task does with its bytes (the
inline handling of a SUBSCRIBE or a QoS 0 PUBLISH, or starting its acceptor), none of which
waits for another client.  No turn is open almost always: the readers' cost is one attribute
test per read.

Until 2026-11-29 a connection being parked took a turn as its reader was cancelled, bytes
or not, and the lot watched it only once its task had stopped: a publisher parking just as
it sent had its PUBLISH handled before the SUBSCRIBE a parked subscriber sent before it (3
rounds in 150; once in 200 in CI).
"""

from __future__ import annotations

from typing import Any

import trio


class ArrivalTurns:
    """The open turns of one node's connections (one instance per parking lot)."""

    __slots__ = ("_ended", "_next", "_open")

    def __init__(self) -> None:
        #: connection -> the number of its open turn.
        self._open: dict[Any, int] = {}
        #: The number the next turn gets.
        self._next = 0
        #: Set when a turn ends, for the readers waiting for one.
        self._ended: trio.Event | None = None

    def __bool__(self) -> bool:
        """Some turn is open (the readers' fast test)."""
        return bool(self._open)

    def __len__(self) -> int:
        return len(self._open)

    def take(self, connection: object) -> None:
        """``connection`` has bytes that no task of it is handling yet (idempotent)."""
        if connection not in self._open:
            self._open[connection] = self._next
            self._next += 1

    def end(self, connection: object) -> None:
        """``connection`` handed its first bytes on (or has none); idempotent."""
        if self._open.pop(connection, None) is not None:
            ended, self._ended = self._ended, None
            if ended is not None:
                ended.set()

    def holds(self, connection: object) -> bool:
        return connection in self._open

    async def wait(self, connection: object) -> None:
        """Until every turn taken before ``connection``'s own (before now, if it holds none)
        has ended."""
        mine = self._open.get(connection, self._next)
        while self._open and min(self._open.values()) < mine:
            if self._ended is None:
                self._ended = trio.Event()
            await self._ended.wait()
