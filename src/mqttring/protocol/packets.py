"""Typed MQTT 3.1.1 control packets as small immutable values.

Packets are plain data: the codec (``codec.py``) turns bytes into these and back, and the
session machine reasons about them.  Validation that depends only on numbers in the packet
(QoS range, packet id 0, return codes, flag combinations) happens in ``__post_init__`` so an
invalid packet cannot exist, whichever side built it.  Topic names and filters are checked
by the codec (``topics.validate_*``) in both directions instead: doing it here too would
cost a second pass over every topic on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from mqttring.protocol.errors import MalformedPacket


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14


class ConnectReturnCode(IntEnum):
    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USERNAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


SUBACK_FAILURE = 0x80


def _check_qos(qos: int, rule: str = "MQTT-3.3.1-4") -> None:
    if qos not in (0, 1, 2):
        raise MalformedPacket(rule, f"QoS must be 0, 1 or 2, got {qos}")


def _check_packet_id(packet_id: int, rule: str) -> None:
    if not 1 <= packet_id <= 0xFFFF:
        raise MalformedPacket(rule, f"packet identifier must be 1..65535, got {packet_id}")


@dataclass(slots=True, frozen=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False

    def __post_init__(self) -> None:
        _check_qos(self.qos, "MQTT-3.1.2-14")


@dataclass(slots=True, frozen=True)
class Connect:
    client_id: str
    clean_session: bool = True
    keepalive: int = 60
    will: Will | None = None
    username: str | None = None
    password: bytes | None = None
    protocol_name: str = "MQTT"
    protocol_level: int = 4

    def __post_init__(self) -> None:
        if self.password is not None and self.username is None:
            raise MalformedPacket("MQTT-3.1.2-22", "password given without a username")
        if not 0 <= self.keepalive <= 0xFFFF:
            raise MalformedPacket("MQTT-3.1.2-10", f"keepalive out of range: {self.keepalive}")


@dataclass(slots=True, frozen=True)
class ConnAck:
    session_present: bool
    return_code: ConnectReturnCode = ConnectReturnCode.ACCEPTED


@dataclass(slots=True, frozen=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None

    def __post_init__(self) -> None:
        _check_qos(self.qos)
        if self.qos == 0:
            if self.packet_id is not None:
                raise MalformedPacket("MQTT-2.3.1-5", "QoS 0 PUBLISH must not carry a packet id")
            if self.dup:
                raise MalformedPacket("MQTT-3.3.1-2", "DUP must be 0 for QoS 0 messages")
        else:
            if self.packet_id is None:
                raise MalformedPacket("MQTT-2.3.1-1", "QoS > 0 PUBLISH needs a packet id")
            _check_packet_id(self.packet_id, "MQTT-2.3.1-1")


@dataclass(slots=True, frozen=True)
class _Ack:
    packet_id: int

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.3.1-1")


@dataclass(slots=True, frozen=True)
class PubAck(_Ack):
    pass


@dataclass(slots=True, frozen=True)
class PubRec(_Ack):
    pass


@dataclass(slots=True, frozen=True)
class PubRel(_Ack):
    pass


@dataclass(slots=True, frozen=True)
class PubComp(_Ack):
    pass


@dataclass(slots=True, frozen=True)
class UnsubAck(_Ack):
    pass


@dataclass(slots=True, frozen=True)
class Subscribe:
    packet_id: int
    topics: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.3.1-1")
        if not self.topics:
            raise MalformedPacket("MQTT-3.8.3-3", "SUBSCRIBE must contain at least one filter")
        for _, qos in self.topics:
            _check_qos(qos, "MQTT-3-8.3-4")


@dataclass(slots=True, frozen=True)
class SubAck:
    packet_id: int
    return_codes: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.3.1-1")
        for code in self.return_codes:
            if code not in (0, 1, 2, SUBACK_FAILURE):
                raise MalformedPacket("MQTT-3.9.3-2", f"invalid SUBACK return code {code:#x}")


@dataclass(slots=True, frozen=True)
class Unsubscribe:
    packet_id: int
    topics: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_packet_id(self.packet_id, "MQTT-2.3.1-1")
        if not self.topics:
            raise MalformedPacket("MQTT-3.10.3-2", "UNSUBSCRIBE must contain at least one filter")


@dataclass(slots=True, frozen=True)
class PingReq:
    pass


@dataclass(slots=True, frozen=True)
class PingResp:
    pass


@dataclass(slots=True, frozen=True)
class Disconnect:
    pass


Packet = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
)
