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

A subscriber that does not make room within ``slow_subscriber_hold`` seconds is
disconnected as a slow consumer (``shed``): a persistent session keeps its queue and goes
on under the offline rules (oldest dropped past ``max_queued``, counted); the publishers go
on.  ``slow_subscriber_hold = 0`` turns flow control off: a full queue drops its oldest
message, online or not, as it did before.

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
RECHECK_SECONDS = 0.05


class FlowControl:
    def __init__(self, hold_seconds: float, metrics: BrokerMetrics,
                 shed: Callable[[str], None]) -> None:
        self.hold_seconds = hold_seconds
        self.metrics = metrics
        self._shed = shed
        #: client id -> set when its session may have room again.
        self._room: dict[str, trio.Event] = {}

    def room_made(self, client_id: str) -> None:
        """A congested session's client acknowledged something: wake who waits for it."""
        event = self._room.pop(client_id, None)
        if event is not None:
            event.set()

    async def hold_back(self, sessions: Iterable[Session]) -> None:
        """Return once none of ``sessions`` is congested, shedding any that stays so for
        ``hold_seconds`` (all sessions share the one deadline: a publish waits at most
        that long in all)."""
        deadline = trio.current_time() + self.hold_seconds
        held = False
        seen: set[int] = set()
        for session in sessions:
            if id(session) in seen:
                continue  # a batch lists a session once per message that congested it
            seen.add(id(session))
            while session.congested:
                held = True
                now = trio.current_time()
                if now >= deadline:
                    log.warning("client %r has %d messages waiting and made no room for "
                                "%.1fs (slow_subscriber_hold): disconnecting it as a slow "
                                "consumer", session.client_id, len(session.queue),
                                self.hold_seconds)
                    self.metrics.slow_subscribers_disconnected += 1
                    self._shed(session.client_id)
                    break
                event = self._room.get(session.client_id)
                if event is None:
                    event = self._room[session.client_id] = trio.Event()
                with trio.move_on_at(min(deadline, now + RECHECK_SECONDS)):
                    await event.wait()
        if held:
            self.metrics.publishes_held += 1
