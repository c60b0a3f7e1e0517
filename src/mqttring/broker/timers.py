"""The receive timeouts of every connection with a task, kept by one task.

Why not a trio deadline per connection: a connection's timeouts (``connect_timeout`` until
CONNECT, 1.5 x keepalive after it, ``park_idle_after`` of quiet before it parks) restart on
every read (the keepalive only on a read that completes a packet), and restarting a trio
deadline is not cheap: two deadline updates and a cancel scope per read cost 8.5 us on the
2-core VM, a fifth of what a single node spends between reading a QoS 0 PUBLISH and writing
its delivery (measured: 39 us from epoll's return to the delivery on the wire).  Here a
read only notes the time (``ClientHandler._arm``), and a connection is looked at when its
earliest timeout could be due: a heap entry per connection, pushed again (lazily) only when
it comes up and the connection was busy meanwhile.  An active connection costs at most one
look per ``park_idle_after``, however fast it sends.

A look (``ClientHandler.on_timer``) acts only while the connection's reader waits for bytes
and no events of its own wait to be handled, the same moments a deadline on the receive
would have fired in: it cancels the connection's scope (timed out), or hands it to the
parking lot.  An entry the connection no longer wants (it armed an earlier one, or ended)
is skipped when it comes up; entries hold connections weakly, so one that ended is freed at
once, and they are dropped in one pass when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
import weakref
from typing import Protocol

import trio


class Timed(Protocol):
    def on_timer(self, at: float, now: float) -> float:
        """The entry for ``at`` came up at ``now``: act, and say when to look again (inf:
        not until the connection arms a new entry)."""
        ...

    def wants_timer(self, at: float) -> bool:
        """Whether the entry for ``at`` is still the one this connection waits for."""
        ...


class ConnectionTimers:
    """Owned by the node: ``run`` is its task, started before the first connection."""

    #: Dropping stale entries starts past this many (and past twice the live ones after the
    #: last drop): amortised O(1) per entry, and never for a handful of connections.
    COMPACT_AFTER = 1024

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, weakref.ref[Timed]]] = []
        self._order = itertools.count()
        self._wait: trio.CancelScope | None = None
        self._live_after_compaction = 0

    def __len__(self) -> int:
        return len(self._heap)

    def watch(self, connection: Timed, at: float) -> None:
        """Look at ``connection`` at ``at`` (trio time)."""
        heapq.heappush(self._heap, (at, next(self._order), weakref.ref(connection)))
        wait = self._wait
        if wait is not None and at < wait.deadline:
            wait.deadline = at
        if len(self._heap) > self.COMPACT_AFTER + 2 * self._live_after_compaction:
            self._compact()

    def _compact(self) -> None:
        live = []
        for entry in self._heap:
            connection = entry[2]()
            if connection is not None and connection.wants_timer(entry[0]):
                live.append(entry)
        heapq.heapify(live)
        self._heap[:] = live  # in place: ``run`` holds the list
        self._live_after_compaction = len(live)

    async def run(self) -> None:
        while True:
            with trio.CancelScope(deadline=self._heap[0][0] if self._heap else math.inf) as wait:
                self._wait = wait
                await trio.sleep_forever()
            self._wait = None
            now = trio.current_time()
            heap = self._heap
            while heap and heap[0][0] <= now:
                at, _, ref = heapq.heappop(heap)
                connection = ref()
                if connection is None:
                    continue
                again = connection.on_timer(at, now)
                if again < math.inf:
                    heapq.heappush(heap, (again, next(self._order), ref))
