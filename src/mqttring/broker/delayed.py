"""Wills that wait: the MQTT 5.0 Will Delay Interval (section 3.1.3.2.2).

A v5 client may ask for its will to be published only after a delay, so that a brief
network blip followed by a reconnect does not tell the world it died.  ``DelayedWills``
holds such wills by client id with a wall-clock deadline; ``cancel`` (called for every
CONNECT of that id, on the node that decides the id) drops one [MQTT-3.1.3-9], and ``run``
(one task of the node's nursery) publishes those whose deadline passed through the
``publish`` callable it was built with (the router, like any will).

The effective delay is the smaller of the will delay and the session expiry interval: a
will is published when the session ends if that comes first.  The broker core decides that
and schedules with the result.

What is held is how to *make* the message, not the message: a will's Message Expiry
Interval is its lifetime from when it is published [3.1.3.2.4], so the message (whose
expiry deadline is set when it is made) is made when the will falls due.  Made at the
close, a will delayed 3 s with an expiry of 2 s had expired before it went out, and was
never published.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import trio

from mqttring.broker.refusals import PublishRefused
from mqttring.protocol.message import Message

#: Whether a will may still go out when it falls due (its client's ACL as it is then).
Allowed = Callable[[Message], bool]

log = logging.getLogger("mqttring.broker")


class DelayedWills:
    def __init__(self, publish: Callable[[Message], Awaitable[None]],
                 connected: Callable[[str], bool]) -> None:
        self._publish = publish
        #: Whether a client id has a live connection now: a will falling due then is
        #: dropped (it reconnected; the cancel may have come before the old connection's
        #: cleanup scheduled the will).
        self._connected = connected
        #: client id -> (trio deadline, what makes the will's message, its ACL check).
        self._pending: dict[str, tuple[float, Callable[[], Message], Allowed | None]] = {}
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._pending)

    def schedule(self, client_id: str, make: Callable[[], Message], delay: float,
                 allowed: Allowed | None = None) -> None:
        """``make``: the will's message, made when it falls due (see the module
        docstring).  ``allowed``: asked then too (an ACL reload may have revoked its topic
        meanwhile); None: no ACL."""
        self._pending[client_id] = (trio.current_time() + delay, make, allowed)
        self._changed.set()

    def cancel(self, client_id: str) -> bool:
        """The client reconnected within the delay: its will is not published."""
        return self._pending.pop(client_id, None) is not None

    async def run(self) -> None:
        """Publish wills as they fall due; runs until cancelled (node shutdown)."""
        while True:
            self._changed = trio.Event()
            now = trio.current_time()
            due = [cid for cid, (deadline, _, _) in self._pending.items() if deadline <= now]
            for cid in due:
                _, make, allowed = self._pending.pop(cid)
                message = make()
                if self._connected(cid):
                    log.info("delayed will of %r not published: it reconnected", cid)
                    continue
                if allowed is not None and not allowed(message):
                    continue  # (``allowed`` said why)
                log.info("publishing the delayed will of %r on %r", cid, message.topic)
                try:
                    await self._publish(message)
                except PublishRefused as exc:  # as for an undelayed will (``publish_will``)
                    log.warning("delayed will of %r on %r handed to its subscribers, but not "
                                "confirmed stored: %s", cid, message.topic, exc)
                except Exception:
                    log.exception("delayed will of %r on %r not published", cid,
                                  message.topic)
            nearest = min((d for d, _, _ in self._pending.values()), default=math.inf)
            with trio.move_on_at(nearest):
                await self._changed.wait()
