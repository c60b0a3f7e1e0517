"""One hierarchy for everything that can go wrong between nodes.

Callers in the cluster layer catch ``PeerFailure`` when they only need to know "that peer
did not do it, decide again by the current view"; the subclasses say why, for logs and for
the few places that act differently (a refusal is final for that peer, a missing link may
heal).  ``PeerProtocolError`` is the exception: it means an authenticated peer sent bytes we
cannot read (a version skew or a bug), and it closes that peer's link.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mqttring.broker.refusals import PublishRefused
from mqttring.rpc import ProtocolError


class PeerFailure(PublishRefused):
    """A request to another node did not succeed; re-decide by the current view.

    A ``PublishRefused`` too: one that reaches the broker core withholds the publisher's
    acknowledgement instead of being reported as an internal error.
    """


class PeerProtocolError(ProtocolError):
    """An authenticated peer sent a link frame we cannot read: another frame version, an
    unknown message tag, a field of the wrong type, or a message whose content fails its
    checks.  Not a ``PeerFailure``: nothing is retried; raised from ``Links.serve_stream``
    (a ``ProtocolError``) it closes that peer's link and is counted there."""


class PeerUnavailable(PeerFailure):
    """The peer left the cluster view, its link broke, or it did not answer in time."""


class RemoteError(PeerFailure):
    """The peer answered a request with a refusal."""


class NotOwner(PeerFailure):
    """This node does not own the shard any more and could not pass the message on."""


class ReplicationIncomplete(PeerFailure):
    """A durable write did not reach every replica the current view names."""


class RoutesIncomplete(PeerFailure):
    """This node's route table for a shard is not yet known complete: no acknowledgement."""


class Fenced(PeerFailure):
    """This node cannot prove it is in the majority's view, so it refuses to act."""


@contextlib.contextmanager
def peer_failures_unwrapped() -> Iterator[None]:
    """Around a nursery whose tasks may fail with ``PeerFailure``: re-raise the first one as
    itself.  trio wraps what a nursery's tasks raise in an ``ExceptionGroup``, which the
    callers' ``except PeerFailure`` (a refused publish, a retry by the newer view) would
    otherwise miss, turning a peer's refusal into an internal error."""
    try:
        yield
    except BaseExceptionGroup as group:
        failures, rest = group.split(PeerFailure)
        if failures is None or rest is not None:
            raise
        leaf: BaseException = failures
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        raise leaf from group


__all__ = [
    "Fenced",
    "NotOwner",
    "PeerFailure",
    "PeerProtocolError",
    "PeerUnavailable",
    "RemoteError",
    "ReplicationIncomplete",
    "RoutesIncomplete",
    "peer_failures_unwrapped",
]
