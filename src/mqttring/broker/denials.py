"""Publishes and subscriptions the ACL denied: counted, and logged without flooding the log.

A client chooses its topics (up to 64 KB each) and may repeat a denied publish as fast as it
can send: logged whole, one line each, one connection wrote 240 MB of log in 2 s (a black-box
probe), which fills an operator's disk.  So each denial is counted (``acl_denials`` in
``/metrics``), the first of each client id is logged at info with its topic clipped, and the
rest at debug.
"""

from __future__ import annotations

import logging

from mqttring.broker.metrics import BrokerMetrics
from mqttring.logs import clipped

log = logging.getLogger("mqttring.broker")

#: Client ids remembered as having had a denial logged at info (then all forgotten).
LOGGED_CLIENTS = 10_000


class AclDenials:
    """One per node, shared by the publish path and the subscribe path."""

    __slots__ = ("_logged", "_metrics")

    def __init__(self, metrics: BrokerMetrics) -> None:
        self._metrics = metrics
        self._logged: set[str | None] = set()

    def __call__(self, client_id: str | None, what: str, topic: str) -> None:
        """``client_id`` was denied ``what`` ("a publish", "a subscription") on ``topic``."""
        self._metrics.acl_denials += 1
        first = client_id not in self._logged
        if first:
            if len(self._logged) >= LOGGED_CLIENTS:
                self._logged.clear()
            self._logged.add(client_id)
        log.log(logging.INFO if first else logging.DEBUG,
                "denied %s of %r on %r by the ACL%s", what, client_id, clipped(topic),
                " (its later denials are logged at debug)" if first else "",
                extra={"client_id": client_id, "event": "acl-denied"})
