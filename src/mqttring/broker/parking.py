"""Idle TCP connections without a task: one epoll set and one task for all of them.

Why: an idle connection served the trio way is a task suspended in ``recv``, and that task
(its coroutine frames, its nursery, trio's wait registration) is most of what a connection
costs, about 4.5 of 7 KB.  A fleet of devices that send a reading a minute is almost all
idle connections.  So a connection with nothing to do for ``park_idle_after`` seconds hands
its socket to the parking lot and its task ends; the connection itself (protocol machine,
session, socket) stays as it was.  The lot watches every parked socket in one epoll set,
itself waited on by one trio task, and resumes a connection (a fresh task running
``ClientHandler.run``) when:

* its socket is readable (a packet, or the peer closed it);
* the broker has output for it (``ClientHandler.wake``: a delivery) or closes it
  (``ClientHandler.kick``: takeover, shutdown);
* its keepalive runs out (it resumes, finds its deadline passed, and closes).

Only what the kernel can watch parks: TCP connections on Linux (``select.epoll``), after
CONNECT, with nothing read ahead, being accepted or being written.  WebSocket connections
are never parked (their bytes pass through a WebSocket library that owns the socket), nor
are TLS connections (the TLS layer may hold decrypted bytes epoll cannot see).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import select
from typing import TYPE_CHECKING

import trio

from mqttring.broker.arrival import ArrivalTurns

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler
    from mqttring.broker.metrics import BrokerMetrics

log = logging.getLogger("mqttring.broker.parking")

#: epoll events that resume a parked connection: bytes, the peer's close, an error.
_EVENTS = (getattr(select, "EPOLLIN", 1) | getattr(select, "EPOLLRDHUP", 0x2000)
           | getattr(select, "EPOLLERR", 8) | getattr(select, "EPOLLHUP", 16))


def parking_supported() -> bool:
    return hasattr(select, "epoll")


class ParkingLot:
    """Owned by the node; ``run`` is its one task, ``nursery`` where resumed connections run
    (the node's connection nursery, so shutdown finds and closes them like any other)."""

    def __init__(self, nursery: trio.Nursery, metrics: BrokerMetrics) -> None:
        self._nursery = nursery
        self._metrics = metrics
        self._epoll = select.epoll()
        #: fd -> (handler, its keepalive deadline when it parked).
        self._parked: dict[int, tuple[ClientHandler, float]] = {}
        #: (keepalive deadline, order, fd, handler): soonest first; stale entries (resumed
        #: since) are skipped when they come up.
        self._deadlines: list[tuple[float, int, int, ClientHandler]] = []
        self._order = itertools.count()
        self._wait: trio.CancelScope | None = None
        self._closed = False
        #: Arrival order across the resume (``mqttring.broker.arrival``): a connection
        #: resumed for its bytes takes a turn here, in the pass the lot noticed them.
        self.turns = ArrivalTurns()

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, handler: ClientHandler, fd: int, deadline: float) -> bool:
        """Watch ``fd`` for ``handler``; False if the lot is closed (keep the task)."""
        if self._closed:
            return False
        try:
            self._epoll.register(fd, _EVENTS)
        except OSError as exc:  # the socket was closed under us: let the task find out
            log.debug("could not park fd %d: %s", fd, exc)
            return False
        self._parked[fd] = (handler, deadline)
        self._metrics.clients_parked += 1
        if deadline < math.inf:
            heapq.heappush(self._deadlines, (deadline, next(self._order), fd, handler))
            if self._wait is not None and deadline < self._wait.deadline:
                self._wait.deadline = deadline
        return True

    def holds(self, handler: ClientHandler, fd: int) -> bool:
        """``handler`` is parked on ``fd`` (not resumed or withdrawn since)."""
        entry = self._parked.get(fd)
        return entry is not None and entry[0] is handler

    def withdraw(self, handler: ClientHandler, fd: int) -> bool:
        """Stop watching ``fd`` for ``handler``; False if it was not parked (idempotent)."""
        if not self.holds(handler, fd):
            return False
        del self._parked[fd]
        self._metrics.clients_parked -= 1
        # A closed descriptor or a closed lot: nothing is watched any more.
        with contextlib.suppress(OSError, ValueError):
            self._epoll.unregister(fd)
        return True

    def resume(self, handler: ClientHandler, fd: int) -> None:
        """Give a parked connection its task back (idempotent).

        A connection is parked from the moment the timers decide it (``ClientHandler``'s
        ``on_timer``), while its task is still stopping: if that task has not ended yet,
        it serves on by itself (``ClientHandler.has_task``), and no second one starts."""
        if not self.withdraw(handler, fd):
            return
        self._metrics.connections_resumed += 1
        if handler.has_task:
            return
        try:
            self._nursery.start_soon(handler.run)
        except RuntimeError:
            # The node's nursery has closed: the node is gone, and its sockets with it.
            self.turns.end(handler)
            log.debug("connection on fd %d not resumed: the node is shutting down", fd)

    async def run(self) -> None:
        """Resume connections whose socket became readable or whose keepalive ran out."""
        epoll = self._epoll
        try:
            while True:
                deadline = self._deadlines[0][0] if self._deadlines else math.inf
                with trio.CancelScope(deadline=deadline) as wait:
                    self._wait = wait
                    await trio.lowlevel.wait_readable(epoll.fileno())
                self._wait = None
                for fd, _ in epoll.poll(0, 1024):
                    entry = self._parked.get(fd)
                    if entry is not None:
                        self.turns.take(entry[0])  # its bytes came before later readers'
                        self.resume(entry[0], fd)
                now = trio.current_time()
                heap = self._deadlines
                while heap and heap[0][0] <= now:
                    deadline, _, fd, handler = heapq.heappop(heap)
                    if self._parked.get(fd) == (handler, deadline):  # else resumed since
                        self.resume(handler, fd)
                if len(heap) > 64 and len(heap) > 4 * len(self._parked):
                    # Entries of connections that resumed meanwhile: drop them in one pass.
                    self._deadlines = [e for e in heap if self._parked.get(e[2]) == (e[3], e[0])]
                    heapq.heapify(self._deadlines)
        finally:
            self._closed = True
            # Shutdown: every parked connection gets a task back to close itself.
            for fd, (handler, _) in list(self._parked.items()):
                self.resume(handler, fd)
            epoll.close()
