"""The MQTT 5.0 half of ``ServerConnection``: what a v5 connection adds, without I/O.

Theory of operation
-------------------
``ServerConnection`` stays the one protocol machine per connection.  When a CONNECT says
level 5 it builds a ``V5Link`` (this module), swaps in the v5 decoder, and from then on
hands every packet type the 3.1.1 path does not know (``Publish5``, ``PubAck5``,
``Subscribe5``, ``Disconnect5``, ``Auth5``...) to ``V5Link.on_packet``.  A 3.1.1
connection never reaches this module, so its per-packet cost is unchanged.

What the link keeps (all per network connection, never part of the session):

* Topic aliases the client set up (section 3.3.2.3.4): alias -> topic.  An alias of 0 or
  above the Topic Alias Maximum we announced is a protocol error with reason 0x94
  [MQTT-3.2.2-17/18]; an unknown alias with an empty topic is 0x82.
* Inbound flow control: QoS 1/2 PUBLISHes received and not yet fully acknowledged (PUBACK
  sent, or PUBCOMP sent for QoS 2).  More than our Receive Maximum is 0x93
  [MQTT-3.3.4-9].
* What the client announced: its Receive Maximum (bounds our inflight window to it, applied
  by the broker core to the session), its Maximum Packet Size and Topic Alias Maximum
  (``V5Session``, which encodes our PUBLISHes, with outbound aliases up to the smaller of
  it and ``ServerLimits5.topic_alias_maximum_out``), whether it wants reason strings on
  failures (Request Problem Information) and Response Information in the CONNACK.
* The keep alive in force: the client's, or ``max_keepalive`` when it asked for 0 or more;
  the CONNACK then says Server Keep Alive and we hold the client to it [MQTT-3.2.2-21/22].

Errors raise the ``MQTTError`` family with the reason code; ``ServerConnection`` turns that
into a DISCONNECT with that reason before closing [MQTT-4.13.1-1].
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mqttring.protocol.codec5 import encode5
from mqttring.protocol.errors import ProtocolViolation
from mqttring.protocol.events import (
    DisconnectRequested,
    Event,
    PublishReceived,
    SubscribeRequested,
    UnsubscribeRequested,
)
from mqttring.protocol.message import Message
from mqttring.protocol.packets5 import (
    Auth5,
    ConnAck5,
    Connect5,
    Disconnect5,
    PubAck5,
    PubComp5,
    Publish5,
    PubRec5,
    PubRel5,
    Subscribe5,
    Unsubscribe5,
)
from mqttring.protocol.properties import (
    DEFAULT_MAX_USER_PROPERTIES,
    Properties,
    PropertyId,
    PropValue,
)
from mqttring.protocol.session5 import PublishProps

if TYPE_CHECKING:
    from mqttring.protocol.connection import ServerConnection


@dataclass(slots=True, frozen=True)
class ServerLimits5:
    """What this server announces in a v5 CONNACK (section 3.2.2.3)."""

    #: QoS 1/2 PUBLISHes a client may have unacknowledged towards us.
    receive_maximum: int = 64
    #: Topic aliases a client may set up on one connection (0: none).
    topic_alias_maximum: int = 16
    #: Subscription identifiers are supported (``session5.V5Session``).
    subscription_identifiers: bool = True
    #: Shared subscriptions (``$share/{group}/{filter}``, ``mqttring.broker.shared``).
    shared_subscriptions: bool = True
    #: Topic aliases we may set up towards a client (``limits.topic_alias_maximum_out``),
    #: at most what its CONNECT allows; 0: never.
    topic_alias_maximum_out: int = 0
    #: Response Information for clients that request it (``response_information``); "":
    #: never sent.
    response_information: str = ""
    #: User Properties accepted in one packet or will (``limits.max_user_properties``):
    #: enforced while decoding (``decoder5``), more is refused with 0x97 (Quota exceeded).
    max_user_properties: int = DEFAULT_MAX_USER_PROPERTIES


DEFAULT_LIMITS5 = ServerLimits5()


#: CONNACK properties at the value a client assumes when they are absent (section 3.2.2.3):
#: left out first when the CONNACK must shrink to the client's Maximum Packet Size
#: (``V5Link.connack``).
_CONNACK_DEFAULTS: dict[PropertyId, PropValue] = {
    PropertyId.RETAIN_AVAILABLE: 1,
    PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE: 1,
    PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE: 1,
    PropertyId.SHARED_SUBSCRIPTION_AVAILABLE: 1,
}


class V5Link:
    """See the module docstring."""

    __slots__ = ("aliases", "client_alias_max", "client_max_packet", "client_receive_max",
                 "clock", "inbound", "keepalive", "limits", "problem_info", "response_wanted",
                 "server_keepalive", "session_expiry")

    def __init__(self, connect: Connect5, limits: ServerLimits5,
                 clock: Callable[[], float] = time.time, max_keepalive: int = 65535) -> None:
        props = connect.properties
        self.limits = limits
        self.aliases: dict[int, str] = {}
        self.inbound = 0
        self.client_receive_max = int(props.get(PropertyId.RECEIVE_MAXIMUM, 65535))  # type: ignore[arg-type]
        self.client_max_packet = int(props.get(PropertyId.MAXIMUM_PACKET_SIZE, 0))  # type: ignore[arg-type]
        #: Aliases we may use towards the client: its maximum, capped by ours.
        self.client_alias_max = min(
            int(props.get(PropertyId.TOPIC_ALIAS_MAXIMUM, 0)),  # type: ignore[arg-type]
            limits.topic_alias_maximum_out)
        #: Request Problem Information: absent means 1 (section 3.1.2.11.7).
        self.problem_info = props.get(PropertyId.REQUEST_PROBLEM_INFORMATION, 1) != 0
        self.response_wanted = props.get(PropertyId.REQUEST_RESPONSE_INFORMATION, 0) == 1
        #: The session expiry interval in force (CONNECT, possibly changed by DISCONNECT).
        self.session_expiry = connect.session_expiry
        self.keepalive, self.server_keepalive = server_keepalive(connect.keepalive,
                                                                 max_keepalive)
        self.clock = clock

    def connack(self, present: bool, connect: Connect5, client_id: str,
                max_packet_size: int) -> bytes | None:
        """The CONNACK accepting ``connect``, within the client's Maximum Packet Size
        [MQTT-3.1.2-24], or None.

        Too big, it first leaves out what the client assumes anyway (availabilities at
        their default, 1), then what it may do without: Response Information (optional
        for a server) and Topic Alias Maximum (absent means 0: the client sends no
        aliases).  What it must say (Receive Maximum and Maximum Packet Size below the
        defaults, an assigned client id, a changed expiry or keep alive) stays: if that
        does not fit either, None.  A probe's CONNECT with a maximum of 20 bytes got a
        24-byte CONNACK."""
        props = self._connack_properties(connect, client_id, max_packet_size)
        data = encode5(ConnAck5(present, 0, props))
        limit = self.client_max_packet
        if not limit or len(data) <= limit:
            return data
        items = [item for item in props.items if _CONNACK_DEFAULTS.get(item[0]) != item[1]]
        for optional in (PropertyId.RESPONSE_INFORMATION, PropertyId.TOPIC_ALIAS_MAXIMUM):
            data = encode5(ConnAck5(present, 0, Properties(items)))
            if len(data) <= limit:
                return data
            items = [item for item in items if item[0] is not optional]
        data = encode5(ConnAck5(present, 0, Properties(items)))
        return data if len(data) <= limit else None

    def _connack_properties(self, connect: Connect5, client_id: str,
                            max_packet_size: int) -> Properties:
        """What a v5 CONNACK tells the client about this server (section 3.2.2.3)."""
        limits = self.limits
        items: list[tuple[PropertyId, PropValue]] = [
            (PropertyId.RECEIVE_MAXIMUM, limits.receive_maximum),
            # A whole packet within this limit has a remaining length below it too.
            (PropertyId.MAXIMUM_PACKET_SIZE, max_packet_size),
            (PropertyId.TOPIC_ALIAS_MAXIMUM, limits.topic_alias_maximum),
            (PropertyId.RETAIN_AVAILABLE, 1),
            (PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE, 1),
            (PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE, int(limits.subscription_identifiers)),
            (PropertyId.SHARED_SUBSCRIPTION_AVAILABLE, int(limits.shared_subscriptions)),
        ]
        if self.session_expiry != connect.session_expiry:
            # The server overrode the client's Session Expiry Interval [MQTT-3.2.2-21].
            items.append((PropertyId.SESSION_EXPIRY_INTERVAL, self.session_expiry))
        if not connect.client_id:
            items.append((PropertyId.ASSIGNED_CLIENT_IDENTIFIER, client_id))
        if self.server_keepalive is not None:
            items.append((PropertyId.SERVER_KEEP_ALIVE, self.server_keepalive))
        if self.response_wanted and limits.response_information:
            # Only on request [MQTT-3.1.2-28]; what it means is the operator's convention.
            items.append((PropertyId.RESPONSE_INFORMATION, limits.response_information))
        return Properties(items)

    def on_publish(self, conn: ServerConnection, packet: Publish5) -> PublishReceived | None:
        props = packet.properties
        topic = packet.topic
        if props:
            alias = props.get(PropertyId.TOPIC_ALIAS)
            if alias is not None:
                if not 0 < alias <= self.limits.topic_alias_maximum:  # type: ignore[operator]
                    raise ProtocolViolation(
                        "MQTT-3.3.2-8", f"topic alias {alias} is 0 or above the maximum "
                        f"{self.limits.topic_alias_maximum}", 0x94)
                if topic:
                    self.aliases[alias] = topic  # type: ignore[index]
                else:
                    found = self.aliases.get(alias)  # type: ignore[arg-type]
                    if found is None:
                        raise ProtocolViolation("MQTT-3.3.4", f"unknown topic alias {alias}")
                    topic = found
            if PropertyId.SUBSCRIPTION_IDENTIFIER in props:
                raise ProtocolViolation(
                    "MQTT-3.3.4-6", "a client's PUBLISH must not carry a subscription identifier")
        if not topic:
            raise ProtocolViolation("MQTT-3.3.2-1", "empty topic name without a topic alias",
                                    0x82)
        qos = packet.qos
        mid = 0
        if qos:
            session = conn.session
            assert session is not None
            if qos == 2:
                mid = session.begin_inbound_qos2(packet.packet_id)  # type: ignore[arg-type]
                if not mid:  # its PUBREC was sent: answer again, route nothing
                    if not conn.hold(packet.packet_id, False):  # type: ignore[arg-type]
                        conn.output.extend(bytes((0x50, 2, packet.packet_id >> 8,  # type: ignore[operator]
                                                  packet.packet_id & 0xFF)))  # type: ignore[operator]
                    return None
            self.inbound += 1
            if self.inbound > self.limits.receive_maximum:
                raise ProtocolViolation(
                    "MQTT-3.3.4-9", f"more than {self.limits.receive_maximum} QoS 1/2 "
                    "publishes unacknowledged", 0x93)
            if qos == 2:
                conn.qos2_read(packet.packet_id)  # type: ignore[arg-type]
        message_props = PublishProps.from_properties(props, conn.client_id or "", self.clock())
        return PublishReceived(
            Message(topic, packet.payload, qos, packet.retain, message_props, mid),
            packet.packet_id)

    def on_packet(self, conn: ServerConnection, packet: object) -> Event | None:
        session = conn.session
        assert session is not None
        kind = type(packet)
        if kind is Publish5:
            return conn.count_publish(self.on_publish(conn, packet))  # type: ignore[arg-type]
        if kind is PubAck5:
            if session.on_puback(packet.packet_id, pump=False):  # type: ignore[attr-defined]
                conn.freed()
        elif kind is PubRec5:
            if packet.reason_code < 0x80:  # type: ignore[attr-defined]
                session.on_pubrec(packet.packet_id)  # type: ignore[attr-defined]
            elif session.on_pubrec_failed(packet.packet_id):  # type: ignore[attr-defined]
                conn.freed()  # the delivery ends here: no PUBREL (section 4.3.3)
        elif kind is PubComp5:
            if session.on_pubcomp(packet.packet_id, pump=False):  # type: ignore[attr-defined]
                conn.freed()
        elif kind is PubRel5:
            pid = packet.packet_id  # type: ignore[attr-defined]
            if conn.hold(pid, True):
                return None  # its PUBLISH is still being accepted: PUBCOMP after its PUBREC
            if pid in session.inbound_qos2:
                self.inbound = max(0, self.inbound - 1)
                session.release_inbound_qos2(pid)
            # An unknown id answers success too, not 0x92 (Packet Identifier not found): it
            # is nearly always a client resending PUBREL after losing our PUBCOMP across a
            # reconnect, which 3.7.2.1 calls "not an error during recovery", yet MQTT.js
            # fails the publish on any code >= 0x80 although it was delivered once.
            # mosquitto answers 0 as well.
            conn.output.extend(bytes((0x70, 2, pid >> 8, pid & 0xFF)))
        elif kind is Subscribe5:
            sub: Subscribe5 = packet  # type: ignore[assignment]
            sid = sub.subscription_id or 0
            for topic_filter, options in sub.topics:
                if options.no_local and topic_filter.startswith("$share/"):
                    raise ProtocolViolation(
                        "MQTT-3.8.3-4", f"No Local on the shared subscription {topic_filter!r}")
            if sid and not self.limits.subscription_identifiers:
                raise ProtocolViolation("MQTT-3.8.2.1.2", "subscription identifiers are not "
                                        "supported", 0xA1)
            return SubscribeRequested(
                sub.packet_id, tuple((f, o.qos) for f, o in sub.topics),
                tuple(o.to_byte() for _, o in sub.topics), sid)
        elif kind is Unsubscribe5:
            return UnsubscribeRequested(packet.packet_id, packet.topics)  # type: ignore[attr-defined]
        elif kind is Disconnect5:
            disc: Disconnect5 = packet  # type: ignore[assignment]
            expiry = disc.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL)
            if expiry is not None:
                if self.session_expiry == 0 and expiry:
                    # [MQTT-3.14.2-2]: a session that was to end cannot be revived here.
                    raise ProtocolViolation("MQTT-3.14.2-2", "DISCONNECT may not set a "
                                            "session expiry when CONNECT had 0")
                self.session_expiry = int(expiry)  # type: ignore[arg-type]
            conn.closed_by_client()
            return DisconnectRequested(disc.reason_code, None if expiry is None
                                       else int(expiry))  # type: ignore[arg-type]
        elif kind is Auth5:
            raise ProtocolViolation("MQTT-4.12.0-1", "AUTH without an authentication method "
                                    "in use")
        elif kind is Connect5:
            raise ProtocolViolation("MQTT-3.1.0-2", "a second CONNECT on one connection")
        else:
            raise ProtocolViolation("MQTT-4.8.0-1",
                                    f"{kind.__name__} is not a client-to-server v5 packet")
        return None

    def acked(self) -> None:
        """A QoS 1 PUBACK or QoS 2 PUBREC went out: for QoS 1 the slot is free."""
        self.inbound = max(0, self.inbound - 1)


#: ``max_keepalive`` at this value changes nothing (as mosquitto's default).
NO_KEEPALIVE_LIMIT = 65535


def server_keepalive(asked: int, max_keepalive: int) -> tuple[int, int | None]:
    """``(keep alive in force, Server Keep Alive to announce or None)`` for a v5 client.

    Below ``NO_KEEPALIVE_LIMIT`` a client asking for 0 (no keep alive) or for more than
    ``max_keepalive`` gets ``max_keepalive``, told in the CONNACK; the server then uses that
    value [MQTT-3.2.2-21], otherwise the client's [MQTT-3.2.2-22].
    """
    if max_keepalive < NO_KEEPALIVE_LIMIT and (asked == 0 or asked > max_keepalive):
        return max_keepalive, max_keepalive
    return asked, None


def keepalive_refused(asked: int, max_keepalive: int) -> bool:
    """A 3.1.1 client cannot be told another keep alive: one asking for what
    ``server_keepalive`` would override is refused (CONNACK 2, as mosquitto does)."""
    return server_keepalive(asked, max_keepalive)[1] is not None
