"""Shared subscriptions: ``$share/{group}/{filter}``, one member of a group per message.

Theory of operation
-------------------
A shared subscription (MQTT 5 section 4.8.2, which mosquitto and EMQX also offer to MQTT
3.1.1 clients) names a *group* and an *inner filter*.  Every session subscribed with the same
full filter string ``$share/{group}/{filter}`` (the *share*) is a member of one group; a
message whose topic matches the inner filter goes to exactly one member of each matching
share, and, independently, to every ordinary subscriber.  Nothing here depends on the
protocol version: a share is recognised by its filter string alone.

This module keeps the parts a single node needs and a cluster reuses:

* ``parse_shared`` checks a share filter's own rules (a group of one or more characters
  without ``/``, ``+`` or ``#``, followed by ``/`` and a non-empty filter), which the packet
  decoder's generic filter syntax does not know; the broker answers SUBACK 0x80 for a
  malformed one.
* ``SharedGroups``: the members of each share on this node, matched by the inner filter
  (``TopicTrie``, so ``$share/g/#`` obeys the ``$`` rule exactly like ``#``).
* ``Chooser``: the order in which candidates are tried for one message of one share
  (``round_robin``, ``random``; ``local_first`` is a cluster matter: it orders *nodes*).
* ``SharedMessage``: the copy a member gets remembers its share, so that when the member's
  session ends with that copy unacknowledged (queued or in flight), the copy can be
  dispatched again to another member (``orphans``): at-least-once for the group.

Which member takes a message: members that are online first, in the chooser's order; a
persistent member that is offline is chosen only when no member is online (its session
queues the message until it reconnects).  A member whose ACL does not let it read the topic
is never chosen.  With no shares at all, publishing costs one ``len`` check.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from enum import IntEnum, StrEnum
from typing import NamedTuple, TypeVar

from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.message import Message
from mqttring.protocol.session import OutState, Session
from mqttring.protocol.topics import TopicTrie, validate_topic_filter

__all__ = [
    "Chooser",
    "CopyWatch",
    "Placed",
    "Placement",
    "SharedFilter",
    "SharedGroups",
    "SharedMessage",
    "Strategy",
    "inner_filter",
    "is_shared",
    "orphans",
    "parse_shared",
]

SHARE_LEVEL = "$share"
SHARE_PREFIX = "$share/"

T = TypeVar("T")


class SharedFilter(NamedTuple):
    group: str
    #: The inner topic filter, the part after ``$share/{group}/``.
    filter: str


def is_shared(topic_filter: str) -> bool:
    """Is this a share filter (well-formed or not)?  Its first level is ``$share``."""
    return topic_filter.startswith(SHARE_PREFIX) or topic_filter == SHARE_LEVEL


def parse_shared(topic_filter: str) -> SharedFilter:
    """The group and inner filter of ``$share/{group}/{filter}``; ``InvalidTopic`` if the
    share's own rules are broken (the caller answers SUBACK 0x80)."""
    parts = topic_filter.split("/", 2)
    if len(parts) < 2 or not parts[1]:
        raise InvalidTopic("MQTT-4.8.2-1",
                           f"a shared subscription needs a group name: {topic_filter!r}")
    group = parts[1]
    if "+" in group or "#" in group:
        raise InvalidTopic("MQTT-4.8.2-2", f"a share group name must not contain '+' or '#': "
                                           f"{topic_filter!r}")
    if len(parts) < 3 or not parts[2]:
        raise InvalidTopic("MQTT-4.8.2-2", f"a share group must be followed by '/' and a "
                                           f"topic filter: {topic_filter!r}")
    validate_topic_filter(parts[2])
    return SharedFilter(group, parts[2])


def inner_filter(topic_filter: str) -> str:
    """The filter that decides which topics a (well-formed) filter matches: the inner
    filter of a share, the filter itself otherwise."""
    if topic_filter.startswith(SHARE_PREFIX):
        return topic_filter.split("/", 2)[2]
    return topic_filter


class Strategy(StrEnum):
    """``shared_subscription_strategy``: how one member of a share is chosen per message."""

    #: Each member in turn (per share, on the node that chooses).
    ROUND_ROBIN = "round_robin"
    #: Uniformly at random.
    RANDOM = "random"
    #: A cluster chooses members on the node that owns the topic's shard first (no
    #: inter-node message), then round robin over the rest; one node: round robin.
    LOCAL_FIRST = "local_first"


class Chooser:
    """The order in which a message's candidates are tried, per share.

    ``order`` puts the chosen candidate first and the others after it, so a caller whose
    first choice turns out to be gone (offline, unsubscribed, its node dead) goes on down the
    same list instead of choosing again.
    """

    __slots__ = ("_counters", "_rng", "strategy")

    #: Shares whose round-robin position is kept (cleared when full: a share only loses its
    #: place in the rotation).
    MAX_COUNTERS = 100_000

    def __init__(self, strategy: Strategy = Strategy.ROUND_ROBIN,
                 rng: random.Random | None = None) -> None:
        self.strategy = strategy
        self._rng = rng or random.Random()
        self._counters: dict[str, int] = {}

    def order(self, share: str, candidates: Sequence[T]) -> list[T]:
        n = len(candidates)
        if n <= 1:
            return list(candidates)
        if self.strategy is Strategy.RANDOM:
            start = self._rng.randrange(n)
        else:
            counters = self._counters
            start = counters.get(share, 0)
            if len(counters) >= self.MAX_COUNTERS:
                counters.clear()
            counters[share] = start + 1
            start %= n
        return [*candidates[start:], *candidates[:start]]


class Placement(IntEnum):
    """What happened when a node was asked to give a message to one member of a share."""

    SERVED = 0
    #: No member of the share here (it unsubscribed or ended in the meantime).
    NO_MEMBER = 1
    #: Only offline (persistent) members here, and the caller asked for an online one.
    OFFLINE_ONLY = 2
    #: The node left the view before it answered (cluster only).
    NODE_GONE = 3


class Placed(NamedTuple):
    """What giving a message to one member of a share here did."""

    placement: Placement
    #: The member that got it (SERVED).
    session: Session | None = None
    #: How many members could have taken it, online: a cluster weighs this node's turn by it.
    online: int = 0


class SharedMessage(Message):
    """The copy of a message one member of a share gets: it remembers the share, so that
    the copy can go to another member if this one's session ends without acknowledging it,
    and so that the member's session applies the share's own subscription options to it
    (``session5.retain_flag``, its Subscription Identifier).  A live delivery carries RETAIN
    only for a member that subscribed with Retain As Published: the copy keeps the
    publish's flag for that."""

    __slots__ = ("__weakref__", "share")

    def __init__(self, message: Message, share: str) -> None:
        super().__init__(message.topic, message.payload, message.qos, message.retain,
                         message.props, message.mid)
        self.share = share


class CopyWatch:
    """Tells the node that placed a copy here when the copy is gone.

    A cluster's dispatcher keeps each copy it placed with a clean member until it hears the
    copy is gone, so it can place it again if the member's node dies first (a copy with a
    member on the dispatcher's own node is kept at a witness node too, which the dispatcher
    tells in turn: ``mqttring.cluster.shared``, ``mqttring.cluster.witness``).  A copy is
    gone when its session lets go of it: the client acknowledged it (PUBACK, PUBCOMP), or
    the session ended (its copies were handed back to the share then).  The ``Session``
    machine has no hooks, and must not get a callback per acknowledgement for the sake of
    shares, so this watches the copy itself: a weak reference whose finalizer notes
    ``(dispatcher, token)`` when CPython frees the copy, which happens at once when the
    session drops its last reference.  The finalizer only appends to a list; the cluster
    sends what ``take`` returns, batched, on a timer.
    """

    __slots__ = ("_gone", "_witnessed")

    def __init__(self) -> None:
        self._gone: dict[str, list[int]] = {}
        self._witnessed: dict[tuple[str, str], list[int]] = {}

    def watch(self, copy: SharedMessage, origin: str, token: int, witness: str = "") -> None:
        weakref.finalize(copy, self.note, origin, token, witness).atexit = False

    def note(self, origin: str, token: int, witness: str = "") -> None:
        """The copy ``(origin, token)`` is gone, or was never watched here (it went to a
        persistent member, whose copies are stored): the origin need not keep it, nor the
        ``witness`` that also records it (if any)."""
        self._gone.setdefault(origin, []).append(token)
        if witness:
            self._witnessed.setdefault((witness, origin), []).append(token)

    def take_witnessed(self) -> dict[tuple[str, str], list[int]]:
        """(witness, dispatcher) -> tokens of the dispatcher's copies gone since the last
        call, which that witness records too."""
        gone, self._witnessed = self._witnessed, {}
        return gone

    def take(self) -> dict[str, list[int]]:
        """Dispatcher -> tokens of its copies gone since the last call."""
        gone, self._gone = self._gone, {}
        return gone


def orphans(session: Session) -> list[SharedMessage]:
    """The QoS 1/2 copies a session got through shares and has not acknowledged, oldest
    first: what must go to other members when the session ends.  A QoS 2 copy whose PUBREC
    came is left out (the client has it; sending it elsewhere would deliver it twice)."""
    found: list[SharedMessage] = []
    for entry in (*session.inflight.values(), *session.queue):
        message = entry.message
        if (entry.qos and type(message) is SharedMessage
                and entry.state is not OutState.AWAIT_PUBCOMP):
            found.append(message)
    return found


class SharedGroups:
    """This node's members of each share: share filter -> {client id: granted QoS}, found by
    the inner filter of the share."""

    __slots__ = ("_trie", "members")

    def __init__(self) -> None:
        #: inner filter -> {share filter: None}
        self._trie: TopicTrie[str, None] = TopicTrie()
        #: share filter -> {client id: granted QoS}, in subscription order.
        self.members: dict[str, dict[str, int]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def add(self, share: str, client_id: str, qos: int) -> None:
        members = self.members.get(share)
        if members is None:
            members = self.members[share] = {}
            self._trie.add(inner_filter(share), share, None)
        members[client_id] = qos

    def remove(self, share: str, client_id: str) -> bool:
        members = self.members.get(share)
        if members is None or members.pop(client_id, None) is None:
            return False
        if not members:
            del self.members[share]
            self._trie.remove(inner_filter(share), share)
        return True

    def match(self, topic: str) -> list[str]:
        """The shares whose inner filter matches ``topic``."""
        return [share for share, _ in self._trie.match(topic)]
