"""Arrival order across connections: trio's run queue taken first in, first out.

Why this exists
---------------
trio runs the tasks that became runnable together (one epoll wake-up) as a batch, and
reverses each batch with probability 1/2, on purpose, so that programs cannot come to depend
on scheduling order.  A broker's clients do depend on it, though nothing in MQTT promises it:
client B sends SUBSCRIBE to ``t`` and, a moment later, client A PUBLISHes to ``t``; both
packets arrive in the same wake-up, and half of the time A's task ran first and B missed a
message that mosquitto (one thread, handling sockets in the order epoll reports them) gives
it every time.  Eclipse Paho's interoperability suite (``client_test5.py``:
``test_request_response``, ``test_subscribe_options``) does exactly this and failed about one
run in two against mqttring.

What it does
------------
``keep_arrival_order()`` makes trio's batch order the order in which tasks were made
runnable: epoll's order of ready sockets, which is the order bytes arrived in.  Packets of
one connection were always handled in order (one reader); this extends the same courtesy
across connections on one node.  Across nodes of a cluster no such order exists (two
clients on two nodes are two machines), and it is not promised.

How: trio draws ``_r.random() < 0.5`` for each batch from its module-level ``random.Random``
``_r``; this swaps in one whose ``random()`` is always 0.0, so every batch is reversed, and
trio pops tasks from the end of the reversed batch: first made runnable, first run.  The
same generator gives trio's virtual clock offset (``uniform(10000, 200000)``, then always
10,000 s: an arbitrary constant either way).  pytest-trio, when hypothesis is installed,
sets trio's ``_ALLOW_DETERMINISTIC_SCHEDULING``, under which trio sorts each batch by task
creation and shuffles it with a seeded generator instead: this turns that off again, so
tests see the order production sees (FIFO is as reproducible as hypothesis wants).  It
touches private names, so it checks what it finds and does nothing (logged at debug) if
trio changed; it costs nothing per batch.

It is process-wide: an application embedding the broker in its own trio program gets FIFO
batches too, which no correct trio program can notice.
"""

from __future__ import annotations

import logging
import random

log = logging.getLogger("mqttring.broker")


class _FirstInFirstOut(random.Random):
    """trio's ``_r``: ``random()`` always 0.0, so trio always reverses (see module doc)."""

    def random(self) -> float:
        return 0.0


def keep_arrival_order() -> bool:
    """Make trio run each batch of runnable tasks in the order they became runnable.

    Idempotent.  Returns whether it is in effect (False if trio's internals changed).
    """
    try:
        from trio._core import _run
    except ImportError:  # pragma: no cover - trio reorganised
        log.debug("trio internals changed: scheduling order left as trio's")
        return False
    current = getattr(_run, "_r", None)
    if isinstance(current, _FirstInFirstOut):
        return True
    if not isinstance(current, random.Random):  # pragma: no cover - trio changed
        log.debug("trio internals changed: scheduling order left as trio's")
        return False
    _run._r = _FirstInFirstOut()
    _run._ALLOW_DETERMINISTIC_SCHEDULING = False  # type: ignore[misc]
    return True


__all__ = ["keep_arrival_order"]
