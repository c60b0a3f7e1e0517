"""Typed MQTT 5.0 control packets, beside the 3.1.1 ones of ``packets``.

Why separate types rather than optional fields on the 3.1.1 packets: the 3.1.1 decoder
builds ``Publish``/``PubAck`` through their slot descriptors on the hot path, and every
field added there would be paid by every 3.1.1 message.  A v5 connection decodes into these
(``codec5``); PINGREQ/PINGRESP are the same in both versions and reused.

As in ``packets``, numeric rules (QoS, packet id, subscription option bits) are checked in
``__post_init__``; reason codes are checked against Table 2-6 by the codec in both
directions; topics are checked by the codec.
"""

from __future__ import annotations

from dataclasses import dataclass

from mqttring.protocol.errors import MalformedPacket, ProtocolViolation
from mqttring.protocol.packets import PingReq, PingResp, _check_packet_id, _check_qos
from mqttring.protocol.properties import NO_PROPERTIES, Properties, PropertyId

__all__ = [
    "Auth5", "ConnAck5", "Connect5", "Disconnect5", "Packet5", "PubAck5", "PubComp5",
    "PubRec5", "PubRel5", "Publish5", "SubAck5", "SubOptions", "Subscribe5", "UnsubAck5",
    "Unsubscribe5", "Will5",
]


@dataclass(slots=True, frozen=True)
class Will5:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_qos(self.qos, "MQTT-3.1.2-12")

    @property
    def delay(self) -> int:
        """Will Delay Interval in seconds (section 3.1.3.2.2); 0 when absent."""
        return int(self.properties.get(PropertyId.WILL_DELAY_INTERVAL, 0))  # type: ignore[arg-type]


@dataclass(slots=True, frozen=True)
class Connect5:
    client_id: str
    clean_start: bool = True
    keepalive: int = 60
    will: Will5 | None = None
    username: str | None = None
    password: bytes | None = None
    properties: Properties = NO_PROPERTIES
    protocol_name: str = "MQTT"
    protocol_level: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.keepalive <= 0xFFFF:
            raise MalformedPacket("MQTT-3.1.2-10", f"keepalive out of range: {self.keepalive}")
        props = self.properties
        if (PropertyId.AUTHENTICATION_DATA in props
                and PropertyId.AUTHENTICATION_METHOD not in props):
            # What ``decode_connect5`` refuses (CONNACK 0x82) is never built either.
            raise ProtocolViolation("MQTT-3.1.2.11.10", "Authentication Data without an "
                                    "Authentication Method")

    @property
    def session_expiry(self) -> int:
        """Session Expiry Interval in seconds (3.1.2.11.2); absent means 0."""
        return int(self.properties.get(PropertyId.SESSION_EXPIRY_INTERVAL, 0))  # type: ignore[arg-type]

    @property
    def clean_session(self) -> bool:
        """The 3.1.1 view the session layer decides with: a session that ends with its
        connection (expiry 0) or starts afresh (clean start) is "clean" there.  Clean start
        with a non-zero expiry is handled by the broker core (discard, then keep)."""
        return self.session_expiry == 0


@dataclass(slots=True, frozen=True)
class ConnAck5:
    session_present: bool
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True, frozen=True)
class Publish5:
    """``topic`` may be "" when a Topic Alias property names it (section 3.3.2.3.4)."""

    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_qos(self.qos, "MQTT-3.3.1-4")
        if self.qos == 0:
            if self.packet_id is not None:
                raise MalformedPacket("MQTT-2.2.1-2", "QoS 0 PUBLISH must not carry a packet id")
            if self.dup:
                raise MalformedPacket("MQTT-3.3.1-2", "DUP must be 0 for QoS 0 messages")
        else:
            if self.packet_id is None:
                raise MalformedPacket("MQTT-2.2.1-3", "QoS > 0 PUBLISH needs a packet id")
            _check_packet_id(self.packet_id, "MQTT-2.2.1-3")


@dataclass(slots=True, frozen=True)
class _Ack5:
    packet_id: int
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.2.1-3")


@dataclass(slots=True, frozen=True)
class PubAck5(_Ack5):
    pass


@dataclass(slots=True, frozen=True)
class PubRec5(_Ack5):
    pass


@dataclass(slots=True, frozen=True)
class PubRel5(_Ack5):
    pass


@dataclass(slots=True, frozen=True)
class PubComp5(_Ack5):
    pass


@dataclass(slots=True, frozen=True)
class SubOptions:
    """The subscription options byte (section 3.8.3.1)."""

    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0

    def __post_init__(self) -> None:
        _check_qos(self.qos, "MQTT-3.8.3.1")
        if self.retain_handling not in (0, 1, 2):
            raise MalformedPacket("MQTT-3.8.3.1", "retain handling must be 0, 1 or 2")

    def to_byte(self) -> int:
        return (self.qos | (self.no_local << 2) | (self.retain_as_published << 3)
                | (self.retain_handling << 4))

    @classmethod
    def from_byte(cls, byte: int) -> SubOptions:
        if byte & 0xC0:
            raise MalformedPacket("MQTT-3.8.3-5", "reserved subscription option bits set")
        # Both are Protocol Errors by section 3.8.3.1 (0x82), not malformed packets.
        if byte & 0x03 == 3:
            raise ProtocolViolation("MQTT-3.8.3.1", "subscription QoS must not be 3")
        if (byte >> 4) & 0x03 == 3:
            raise ProtocolViolation("MQTT-3.8.3.1", "retain handling must not be 3")
        return cls(byte & 0x03, bool(byte & 0x04), bool(byte & 0x08), (byte >> 4) & 0x03)


@dataclass(slots=True, frozen=True)
class Subscribe5:
    packet_id: int
    topics: tuple[tuple[str, SubOptions], ...]
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.2.1-3")
        if not self.topics:
            raise MalformedPacket("MQTT-3.8.3-2", "SUBSCRIBE must contain at least one filter")

    @property
    def subscription_id(self) -> int | None:
        value = self.properties.get(PropertyId.SUBSCRIPTION_IDENTIFIER)
        return None if value is None else int(value)  # type: ignore[arg-type]


@dataclass(slots=True, frozen=True)
class SubAck5:
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.2.1-3")


@dataclass(slots=True, frozen=True)
class Unsubscribe5:
    packet_id: int
    topics: tuple[str, ...]
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.2.1-3")
        if not self.topics:
            raise MalformedPacket("MQTT-3.10.3-2", "UNSUBSCRIBE must contain at least one filter")


@dataclass(slots=True, frozen=True)
class UnsubAck5:
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = NO_PROPERTIES

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.2.1-3")


@dataclass(slots=True, frozen=True)
class Disconnect5:
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True, frozen=True)
class Auth5:
    reason_code: int = 0
    properties: Properties = NO_PROPERTIES


Packet5 = (
    Connect5 | ConnAck5 | Publish5 | PubAck5 | PubRec5 | PubRel5 | PubComp5 | Subscribe5
    | SubAck5 | Unsubscribe5 | UnsubAck5 | PingReq | PingResp | Disconnect5 | Auth5
)
