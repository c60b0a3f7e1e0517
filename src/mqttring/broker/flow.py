"""Flow control: a subscriber that falls behind slows its publishers instead of losing
what they were told was accepted.

A session whose client is connected and has ``max_queued`` messages waiting is
*congested*.  A QoS 1/2 message delivered to it is still queued (past the limit, never
dropped), and whoever delivered it holds back the acknowledgement of the publish that
caused it (``hold_back``) until the session has room again.  The publisher's connection
keeps reading acknowledgements but accepts no further PUBLISH (``ClientHandler``), and a
publish that waits for acceptance on another node waits the same way there: back-pressure
reaches the publisher over any number of hops, and memory stays bounded by the publishers'
windows rather than by how far behind a subscriber is.

A subscriber that makes *no progress* (no acknowledgement lets another queued message out)
for ``slow_subscriber_hold`` seconds is disconnected as a slow consumer (``shed``), once,
however many publishes wait for it: a persistent session keeps its queue and goes on under
the offline rules (oldest dropped past ``max_queued``, counted); a clean session's queue is
lost with it (counted as dropped); the publishers go on.  One that does progress, only
more slowly than its publishers publish, is not: a publish is held at most
``slow_subscriber_hold`` and then goes on (its message is queued already; nothing is lost),
so each publisher is slowed to about one window of publishes per hold.  So that this cannot
grow a queue without bound, a session holding ``HARD_LIMIT_FACTOR`` times ``max_queued``
is shed as well.  Before 2026-11-29 every held publish had its own deadline whatever the
subscriber did: 8,000 publishers of one message each cut off a subscriber reading 1,500
messages/s, losing the 6,000 it had been sent, and logged and counted it 5,000 times.

Held publishes wait for the moment their subscriber stops being congested, not for each
acknowledgement (``room_made`` wakes them only then): thousands held for one subscriber
would otherwise all wake for every acknowledgement it sends.  ``slow_subscriber_hold = 0``
turns flow control off: a full queue drops its oldest message, online or not, as it did
before.

Offline sessions and QoS 0 never hold anyone back: their messages are dropped past the
limits and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from mqttring.broker.metrics import BrokerMetrics
from mqttring.protocol.session import Session

log = logging.getLogger("mqttring.flow")

#: Room is signalled (``room_made``) where acknowledgements are applied; this re-check
#: covers the other ways a queue shrinks (the client left, messages expired).
RECHECK_SECONDS = 1.0

#: A congested session holding this many times ``max_queued`` messages is shed even though
#: it makes progress: the bound on what publishers slower than their deadline can queue.
HARD_LIMIT_FACTOR = 16


class _Congestion:
    """One congested session and what its held publishes share: the event that releases
    them, when it last made progress, and whether it was shed."""

    __slots__ = ("mark", "progress_at", "room", "session", "shed")

    def __init__(self, session: Session, now: float) -> None:
        self.session = session
        self.room = trio.Event()
        self.progress_at = now
        #: ``next_packet_id`` moves whenever a queued message goes out (a slot was freed):
        #: the subscriber's progress, whatever else is queued meanwhile.
        self.mark = session.next_packet_id
        self.shed = False

    def look(self, now: float) -> None:
        mark = self.session.next_packet_id
        if mark != self.mark:
            self.mark, self.progress_at = mark, now


class FlowControl:
    def __init__(self, hold_seconds: float, metrics: BrokerMetrics,
                 shed: Callable[[str], None]) -> None:
        self.hold_seconds = hold_seconds
        self.metrics = metrics
        self._shed = shed
        #: client id -> its congestion, while publishes wait for it.
        self._congested: dict[str, _Congestion] = {}

    def room_made(self, client_id: str) -> None:
        """A session's client acknowledged something (called for every read of it): note
        its progress, and release who waits for it once it is no longer congested."""
        congestion = self._congested.get(client_id)
        if congestion is None:
            return
        congestion.look(trio.current_time())
        if not congestion.session.congested:
            self._release(client_id, congestion)

    def _release(self, client_id: str, congestion: _Congestion) -> None:
        """Release every publish held for ``congestion`` (its session has room, or is gone,
        or was shed), and forget it."""
        if self._congested.get(client_id) is congestion:
            del self._congested[client_id]
        congestion.room.set()

    async def hold_back(self, sessions: Iterable[Session]) -> None:
        """Return once none of ``sessions`` is congested, or ``hold_seconds`` after the
        call (all sessions share the one deadline: a publish waits at most that long in
        all), shedding a session that made no progress for that long."""
        hold = self.hold_seconds
        deadline = trio.current_time() + hold
        held = False
        seen: set[int] = set()
        for session in sessions:
            if id(session) in seen:
                continue  # a batch lists a session once per message that congested it
            seen.add(id(session))
            client_id = session.client_id
            congestion: _Congestion | None = None
            while session.congested:
                held = True
                now = trio.current_time()
                congestion = self._congested.get(client_id)
                if congestion is None or congestion.session is not session:
                    congestion = self._congested[client_id] = _Congestion(session, now)
                if congestion.shed:
                    break
                congestion.look(now)
                stuck = now - congestion.progress_at >= hold
                if stuck or len(session.queue) >= HARD_LIMIT_FACTOR * session.limits.max_queued:
                    self._shed_once(client_id, congestion, stuck)
                    break
                if now >= deadline:
                    break  # it makes progress, more slowly than it is fed: go on
                with trio.move_on_at(min(deadline, congestion.progress_at + hold,
                                         now + RECHECK_SECONDS)):
                    await congestion.room.wait()
            if congestion is not None and not session.congested:
                self._release(client_id, congestion)
        if held:
            self.metrics.publishes_held += 1

    def _shed_once(self, client_id: str, congestion: _Congestion, stuck: bool) -> None:
        session = congestion.session
        congestion.shed = True
        if stuck:
            why = (f"made no room for {self.hold_seconds:.1f}s (slow_subscriber_hold)")
        else:
            why = (f"holds {HARD_LIMIT_FACTOR} times max_queued, more slowly read than "
                   "published")
        log.warning("client %r has %d messages waiting and %s: disconnecting it as a slow "
                    "consumer", client_id, len(session.queue), why)
        self.metrics.slow_subscribers_disconnected += 1
        if session.clean_session:
            # Its session ends with the connection: what it holds is lost, and counted.
            self.metrics.messages_dropped += len(session.queue) + len(session.inflight)
        congestion.room.set()  # the others waiting for it go on (kept: shed once)
        self._shed(client_id)
