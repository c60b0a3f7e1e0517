"""What an MQTT 5.0 session adds to delivery: message properties and subscription options.

Theory of operation
-------------------
``PublishProps`` is what a v5 PUBLISH carries end to end, attached to a ``Message`` as its
optional ``props`` (None for every 3.1.1 message, which therefore pays nothing):

* ``raw``: the property bytes forwarded verbatim, already encoded in wire order (payload
  format indicator, content type, response topic, correlation data, user properties).  The
  topic alias and subscription identifiers are per connection and never forwarded
  [MQTT-3.3.2-7, MQTT-3.3.4-6]; the message expiry interval is rewritten per delivery.
* ``expires_at``: the message expiry deadline as wall-clock UNIX seconds (0: none), so that
  any node, and a restarted one, forwards the *remaining* interval [MQTT-3.3.2-6] and drops
  an expired copy instead of sending it.  The interval counts whole seconds, as mosquitto
  counts it (a message expires when now is past its deadline in seconds): a copy whose
  onward delivery starts (``V5Session.send``) less than a second past the deadline goes out
  with a remaining interval of 0, never a negative one; a later one is dropped.  So a
  message published with a Message Expiry Interval of 0 (deadline: the moment it was
  received) reaches the subscribers it is delivered to at once, with an interval of 0, on
  one node or across a cluster, as it reaches 3.1.1 subscribers; it is not kept for later:
  a stored copy is expired from its deadline on (``expired``), so it is never replayed as a
  retained message, an offline session's queue drops it at reconnect (``Session.expire``),
  and a v5 copy held behind a full inflight window is dropped once that second has passed.
  (Before 2026-11-29 v5 subscribers never got such a message, live, retained or a will,
  while 3.1.1 subscribers did; mosquitto 2.0.11 takes an interval of 0 for none.)
* ``origin``: the publishing client's id, for No Local [MQTT-3.8.3-3].

A 3.1.1 subscriber gets ``Message.encode*``, which ignores ``props`` (properties stripped);
a v5 subscriber's session has a ``V5Session`` and encodes through ``V5Session.send``.

``V5Session`` is the v5 side of one ``Session``: the client's Maximum Packet Size (a PUBLISH
larger than it is dropped as if sent [MQTT-3.1.2-24/25]) and the options of its
subscriptions (No Local, Retain As Published, Subscription Identifier), keyed by filter.

It is rebuilt at every CONNECT (``BrokerCore.bind_protocol``, on the node that encodes the
session's PUBLISHes: the edge, or a persistent session's home in a cluster), so what it
holds besides the options belongs to the current network connection:

* Outbound topic aliases (section 3.3.2.3.4): topic -> alias, at most ``alias_max`` (the
  smaller of the client's Topic Alias Maximum and ``limits.topic_alias_maximum_out``).  The
  first PUBLISH of a topic carries the topic and sets up an alias, later ones carry the
  alias and an empty topic.  Aliases are handed out first come, first served and never
  reassigned: the map is written in the order the bytes leave (``send`` appends to the
  connection's output at once), and a connection's aliases die with it, as the client's do
  [MQTT-3.3.2-10].  With ``alias_max`` 0 (the default, and every 3.1.1 client, which has no
  ``V5Session``) ``send`` pays one attribute test.
* Whether the client wants reason strings on failures (Request Problem Information), for
  the SUBACK/UNSUBACK a cluster home encodes (``encode_ack``).
Options are checked against the session's filters at delivery, because the router hands a
session one copy per message (``LocalRouter._targets``) without saying which filter matched;
only sessions that have options pay for the loop, and only v5 sessions have any.  A
subscription whose No Local excludes the client's own message is not one it is delivered
for: it adds no identifier, no Retain As Published, and not its granted QoS (``own_grant``,
asked by the router only when the subscriber is the publisher) [MQTT-3.8.3-3, MQTT-3.3.4-3].
A retained message sent because of a SUBSCRIBE names that SUBSCRIBE's filters
(``replay_for``, set by ``Subscriptions._send_retained``): only their identifiers go with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from struct import Struct

from mqttring.protocol.codec5 import encode_publish5
from mqttring.protocol.packets5 import SubAck5, UnsubAck5
from mqttring.protocol.properties import (
    Properties,
    PropertyId,
    encode_property_body,
    encode_vbi,
)
from mqttring.protocol.reasons5 import encode_with_reason
from mqttring.protocol.topics import topic_matches

_U32 = Struct(">I")
_U16 = Struct(">H")

#: Inbound properties that stay with the connection they arrived on.
_NOT_FORWARDED = (PropertyId.TOPIC_ALIAS, PropertyId.SUBSCRIPTION_IDENTIFIER,
                  PropertyId.MESSAGE_EXPIRY_INTERVAL, PropertyId.WILL_DELAY_INTERVAL)

#: Subscription option bits as kept in ``V5Session.options`` (the SUBSCRIBE byte's layout,
#: with the subscription identifier above bit 8).
NO_LOCAL = 0x04
RETAIN_AS_PUBLISHED = 0x08


class PublishProps:
    """See the module docstring.  Immutable by convention (shared by every copy)."""

    __slots__ = ("expires_at", "origin", "raw")

    def __init__(self, raw: bytes = b"", expires_at: float = 0.0, origin: str = "") -> None:
        self.raw = raw
        self.expires_at = expires_at
        self.origin = origin

    @classmethod
    def from_properties(cls, props: Properties, origin: str, now: float) -> PublishProps:
        """From an inbound v5 PUBLISH (or will) of client ``origin``, received at ``now``."""
        expiry = props.get(PropertyId.MESSAGE_EXPIRY_INTERVAL)
        forwarded = props.without(*_NOT_FORWARDED)
        raw = encode_property_body(forwarded, "PUBLISH") if forwarded else b""
        deadline = now + int(expiry) if expiry is not None else 0.0  # type: ignore[arg-type]
        return cls(raw, deadline, origin)

    def expired(self, now: float) -> bool:
        """For a stored copy (a retained message to replay): its deadline is reached, so an
        interval of 0 has always expired here."""
        return 0 < self.expires_at <= now

    def to_wire(self) -> tuple[bytes, float, str]:
        """For the session store and cluster messages: ``(raw, expires_at, origin)``."""
        return (self.raw, self.expires_at, self.origin)

    @classmethod
    def from_wire(cls, value: Sequence[object] | None) -> PublishProps | None:
        if value is None:
            return None
        raw, expires_at, origin = value
        return cls(bytes(raw), float(expires_at), str(origin))  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PublishProps):
            return NotImplemented
        return (self.raw, self.expires_at, self.origin) == (
            other.raw, other.expires_at, other.origin)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PublishProps({self.raw!r}, {self.expires_at}, {self.origin!r})"


@dataclass(slots=True, frozen=True)
class ClientLimits5:
    """What a v5 client's CONNECT says about delivering to it (``bind_protocol``)."""

    #: Maximum Packet Size (0: none).
    max_packet_size: int = 0
    #: Receive Maximum: the inflight window towards the client.
    receive_maximum: int = 65535
    #: Outbound topic aliases allowed on this connection (already capped by the node's).
    topic_alias_maximum: int = 0
    #: Request Problem Information.
    problem_info: bool = True


class V5Session:
    """The v5 delivery state of one session (see the module docstring)."""

    __slots__ = ("alias_max", "aliases", "client_id", "clock", "max_packet_size", "options",
                 "problem_info")

    def __init__(self, client_id: str, max_packet_size: int = 0,
                 options: dict[str, int] | None = None,
                 clock: Callable[[], float] = time.time, alias_max: int = 0,
                 problem_info: bool = True) -> None:
        self.client_id = client_id
        #: The client's Maximum Packet Size (whole packet, bytes); 0: no limit.
        self.max_packet_size = max_packet_size
        #: filter -> option bits | subscription identifier << 8, for filters that have any.
        self.options: dict[str, int] = options if options is not None else {}
        #: Wall clock for the remaining message expiry interval (injectable for tests).
        self.clock = clock
        #: Outbound topic aliases this connection may use (0: none) and those in use.
        self.alias_max = alias_max
        self.aliases: dict[bytes, int] = {}
        #: The client's Request Problem Information (reason strings on failed acks).
        self.problem_info = problem_info

    def set_options(self, topic_filter: str, options_byte: int, subscription_id: int) -> None:
        bits = (options_byte & (NO_LOCAL | RETAIN_AS_PUBLISHED)) | (subscription_id << 8)
        if bits:
            self.options[topic_filter] = bits
        else:
            self.options.pop(topic_filter, None)

    def retain_flag(self, message: object, retain: bool,
                    subscriptions: dict[str, int]) -> bool | None:
        """The RETAIN flag this session sends ``message`` with, or None: not at all (it is
        the client's own message and every matching subscription says No Local)."""
        return retain_flag(self.client_id, self.options, message, retain, subscriptions)

    def _subscription_ids(self, message: object) -> bytes:
        """The Subscription Identifiers of the subscriptions ``message`` is delivered for:
        the share's own for a shared subscription's copy (its filter never matches a topic:
        before 2026-11-28 such a copy carried the ids of the client's other subscriptions,
        or none); for a retained message sent because of a SUBSCRIBE, those of that
        SUBSCRIBE's filters (``replay_for``); else those of every ordinary subscription that
        matches [MQTT-3.3.4-3], less those whose No Local excludes the client's own message
        (before 2026-11-29 they were sent too)."""
        share = getattr(message, "share", None)
        if share is not None:
            sid = self.options.get(share, 0) >> 8
            return b"\x0b" + encode_vbi(sid) if sid else b""
        topic: str = message.topic  # type: ignore[attr-defined]
        options = self.options
        replay_for = getattr(message, "replay_for", None)
        if replay_for is not None:
            out = b""
            for f in replay_for:
                sid = options.get(f, 0) >> 8
                if sid:
                    out += b"\x0b" + encode_vbi(sid)
            return out
        props = message.props  # type: ignore[attr-defined]
        skip = NO_LOCAL if props is not None and props.origin == self.client_id else 0
        out = b""
        for f, bits in options.items():
            sid = bits >> 8
            if sid and not bits & skip and topic_matches(f, topic):
                out += b"\x0b" + encode_vbi(sid)
        return out

    def send(self, out: bytearray, message: object, qos: int, retain: bool, dup: bool,
             packet_id: int | None, resend: bool = False) -> bool:
        """Append the v5 PUBLISH to ``out``; False if it was not sent (expired, or larger
        than the client accepts: dropped as if delivered [MQTT-3.1.2-25]).

        Expiry counts whole seconds (module docstring): a copy less than a second past its
        deadline goes with a remaining interval of 0 (an interval of 0 delivered at once),
        an older one is dropped.  ``resend``: the inflight copy goes again after a
        reconnect.  Its onward delivery started before the deadline, so it is sent even when
        expired [MQTT-3.3.2-5], with a remaining interval of 0 rather than a negative one.
        """
        props: PublishProps | None = message.props  # type: ignore[attr-defined]
        body = b""
        if props is not None:
            body = props.raw
            if props.expires_at:
                remaining = math.ceil(props.expires_at - self.clock())
                if remaining <= 0:
                    if remaining and not resend:
                        return False  # a second or more past its deadline
                    remaining = 0
                body += b"\x02" + _U32.pack(remaining)
        if self.options:
            body += self._subscription_ids(message)
        topic: bytes = message.topic_bytes  # type: ignore[attr-defined]
        new_alias = False
        if self.alias_max:
            aliases = self.aliases
            alias = aliases.get(topic)
            if alias is not None:
                body += b"\x23" + _U16.pack(alias)
                topic = b""  # the client knows the alias [MQTT-3.3.2-12]
            elif len(aliases) < self.alias_max:
                alias = aliases[topic] = len(aliases) + 1
                body += b"\x23" + _U16.pack(alias)
                new_alias = True
        data = encode_publish5(topic, message.payload,  # type: ignore[attr-defined]
                               qos, retain, dup, packet_id, body)
        if self.max_packet_size and len(data) > self.max_packet_size:
            if new_alias:
                del self.aliases[topic]  # never reached the client
            return False
        out += data
        return True

    def encode_ack(self, packet: SubAck5 | UnsubAck5) -> bytes:
        """A SUBACK/UNSUBACK for this client, with a reason string on failure codes when
        it asked for them and they fit (``reasons5.encode_with_reason``)."""
        return encode_with_reason(packet, self.problem_info, self.max_packet_size)


def retain_flag(client_id: str, options: dict[str, int], message: object, retain: bool,
                subscriptions: dict[str, int]) -> bool | None:
    """``V5Session.retain_flag`` for given options: also what a 3.1.1 client that resumed
    a v5 session gets (its filters were subscribed with those options)."""
    if not options:
        return retain
    share = getattr(message, "share", None)
    if share is not None:
        # A shared subscription's copy (``broker.shared.SharedMessage``) goes by the share's
        # own options.  No Local cannot be set on one [MQTT-3.8.3-4]: before 2026-11-28 the
        # No Local of the client's ordinary subscription dropped its share's copy, and a
        # message acknowledged to its publisher reached no member.
        if (not retain and message.retain  # type: ignore[attr-defined]
                and options.get(share, 0) & RETAIN_AS_PUBLISHED):
            return True
        return retain
    props = message.props  # type: ignore[attr-defined]
    topic: str = message.topic  # type: ignore[attr-defined]
    own = props is not None and props.origin == client_id
    if own and all(
            options.get(f, 0) & NO_LOCAL for f in subscriptions if topic_matches(f, topic)):
        return None
    if not retain and message.retain:  # type: ignore[attr-defined]
        # Only subscriptions the message is delivered for: not one whose No Local excludes
        # the client's own message (before 2026-11-29 its Retain As Published applied).
        skip = NO_LOCAL if own else 0
        for f, bits in options.items():
            if bits & RETAIN_AS_PUBLISHED and not bits & skip and topic_matches(f, topic):
                return True
    return retain


def own_grant(options: dict[str, int] | None, subscriptions: dict[str, int], topic: str,
              granted: int) -> int:
    """The QoS granted for the client's own message on ``topic``: the best of its matching
    subscriptions that have no No Local (-1: none, it does not get it) [MQTT-3.8.3-3].
    ``granted`` is the best of all of them, the answer when no option says No Local.  For
    the router, only when the subscriber is the message's publisher (``origin``): before
    2026-11-29 a No Local subscription's QoS still applied to the copy another,
    overlapping subscription brought."""
    if not options or not any(bits & NO_LOCAL for bits in options.values()):
        return granted
    best = -1
    for f, qos in subscriptions.items():
        if qos > best and not options.get(f, 0) & NO_LOCAL and topic_matches(f, topic):
            best = qos
    return best


def props_to_wire(props: PublishProps | None) -> tuple[bytes, float, str] | None:
    """``message.props`` as a cluster message or store row field (None stays None)."""
    return None if props is None else props.to_wire()


def retained_wanted(session: object, topics: Sequence[tuple[str, int]],
                    options: Sequence[int] | None) -> list[bool] | None:
    """MQTT 5 Retain Handling (3.8.3.1) per filter of a SUBSCRIBE: 0 send retained
    messages, 1 only for a subscription that does not exist yet, 2 never.  Asked before
    the subscriptions are (re)registered.  None (3.1.1, no options): always."""
    if options is None:
        return None
    existing: dict[str, int] = session.subscriptions  # type: ignore[attr-defined]
    return [o >> 4 & 3 == 0 or (o >> 4 & 3 == 1 and f not in existing)
            for (f, _), o in zip(topics, options, strict=True)]
