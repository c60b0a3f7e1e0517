"""Why a message was not accepted with the guarantees its QoS asks for.

Apart from the router because the session store, below it, raises one too: a durable
write cancelled under the callers whose changes it carried.
"""

from __future__ import annotations


class PublishRefused(Exception):
    """The router could not accept a message with the guarantees its QoS asks for.

    Raised by a clustered router when a fault leaves it unable to prove delivery (an owner
    unreachable past its patience, routes not known complete, a replica silent); the
    publisher then gets no acknowledgement and its connection is closed, so it resends.
    """


class WriteCancelled(PublishRefused):
    """The durable write that carried these changes was cancelled (its caller's task
    ended: a connection closed, a session moved) before it was known durable.

    The other callers waiting on the same write must not take their changes as stored: a
    delivery is then answered as not accepted, and a publisher is not acknowledged, so the
    sender resends, as after any refusal."""
