"""Sans-IO MQTT 5.0 decoder: what a connection uses once its CONNECT said level 5.

Why a second decoder rather than a version flag in ``PacketDecoder``: the 3.1.1 PUBLISH fast
path is inline in ``PacketDecoder.next_packet`` and must not pay a branch per packet for a
protocol it does not speak.  A connection starts with the 3.1.1 decoder (every CONNECT has
the protocol level at the same offset); ``decoder._decode_connect`` hands a level-5 CONNECT
to ``decode_connect5`` here, and ``ServerConnection`` then swaps in ``PacketDecoder5``, which
takes over the buffered bytes (``PacketDecoder5.take_over``): packets pipelined behind the
CONNECT are decoded as v5.

Framing (fixed header, remaining length, size limit, buffering) is the 3.1.1 decoder's,
inherited; ``next_packet`` repeats its few lines of framing and dispatches every type through
``_DECODERS5``.  The invariants of ``decoder`` hold: no input is copied more than twice, and
every way the bytes can be wrong raises the ``MQTTError`` family, whose ``reason_code`` is
what the connection puts in its DISCONNECT.  One more bound is ours, not the protocol's:
``max_user_properties`` (``limits.max_user_properties``) is handed to every property set
and checked as it is read, so no packet costs more to refuse than that many properties.
"""

from __future__ import annotations

from collections.abc import Callable

from mqttring.protocol.decoder import (
    RULE_FLAGS,
    RULE_LENGTH,
    PacketDecoder,
    _expect_end,
    _read_bin,
    _read_str,
    _read_u16,
    _truncated,
)
from mqttring.protocol.errors import InvalidTopic, MalformedPacket, MQTTError, PacketTooLarge
from mqttring.protocol.packets import PingReq, PingResp
from mqttring.protocol.packets5 import (
    Auth5,
    ConnAck5,
    Connect5,
    Disconnect5,
    Packet5,
    PubAck5,
    PubComp5,
    Publish5,
    PubRec5,
    PubRel5,
    SubAck5,
    SubOptions,
    Subscribe5,
    UnsubAck5,
    Unsubscribe5,
    Will5,
)
from mqttring.protocol.properties import (
    DEFAULT_MAX_USER_PROPERTIES,
    PropertyId,
    QuotaExceeded,
    check_reason,
    decode_properties,
)
from mqttring.protocol.topics import validate_topic_filter, validate_topic_name

__all__ = ["ConnectRefused5", "PacketDecoder5", "decode5", "decode_connect5"]


class ConnectRefused5(MQTTError):
    """A v5 CONNECT refused while it is decoded, for a reason its client is told in a
    CONNACK (``reason_code``) before the close, as section 3.1.4 allows: too many user
    properties (0x97, ``limits.max_user_properties``) or Authentication Data without an
    Authentication Method (0x82).  Other faults of a CONNECT close without a CONNACK, as
    mosquitto does; these two are ours to explain (a limit the client cannot know of) or
    named by the specification as a Protocol Error of the CONNECT."""


def decode_connect5(connect_flags: int, keepalive: int, buf: bytes, offset: int, stop: int,
                    max_user_properties: int = DEFAULT_MAX_USER_PROPERTIES) -> Connect5:
    """The rest of a v5 CONNECT, from just after the keep-alive (section 3.1.2.11 on).

    ``max_user_properties`` bounds the CONNECT's and the will's user properties each
    (``limits.max_user_properties``); more raises ``ConnectRefused5`` with 0x97.
    """
    if connect_flags & 0x01:
        raise MalformedPacket("MQTT-3.1.2-3", "reserved CONNECT flag must be 0")
    will_flag = connect_flags & 0x04
    will_qos = (connect_flags >> 3) & 0x03
    will_retain = bool(connect_flags & 0x20)
    if not will_flag:
        if will_qos:
            raise MalformedPacket("MQTT-3.1.2-11", "will QoS must be 0 without the will flag")
        if will_retain:
            raise MalformedPacket("MQTT-3.1.2-13", "will retain must be 0 without the will flag")
    elif will_qos == 3:
        raise MalformedPacket("MQTT-3.1.2-12", "will QoS must not be 3")
    try:
        properties, offset = decode_properties(buf, offset, stop, "CONNECT",
                                               max_user_properties)
        if (PropertyId.AUTHENTICATION_DATA in properties
                and PropertyId.AUTHENTICATION_METHOD not in properties):
            raise ConnectRefused5("MQTT-3.1.2.11.10", "Authentication Data without an "
                                  "Authentication Method", 0x82)
        client_id, offset = _read_str(buf, offset, stop, "client identifier")
        will = None
        if will_flag:
            will_props, offset = decode_properties(buf, offset, stop, "WILL",
                                                   max_user_properties)
    except QuotaExceeded as exc:
        raise ConnectRefused5(exc.rule, exc.detail, exc.reason_code) from None
    if will_flag:
        will_topic, offset = _read_str(buf, offset, stop, "will topic")
        validate_topic_name(will_topic)
        will_payload, offset = _read_bin(buf, offset, stop, "will payload")
        will = Will5(will_topic, will_payload, will_qos, will_retain, will_props)
    username = password = None
    # v5 allows a password without a user name (section 3.1.2.9).
    if connect_flags & 0x80:
        username, offset = _read_str(buf, offset, stop, "user name")
    if connect_flags & 0x40:
        password, offset = _read_bin(buf, offset, stop, "password")
    _expect_end(offset, stop, "CONNECT payload")
    return Connect5(client_id, bool(connect_flags & 0x02), keepalive, will, username,
                    password, properties)


def _decode_connect(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
    name, offset = _read_str(buf, start, stop, "CONNECT protocol name")
    if offset + 4 > stop:
        raise _truncated("CONNECT variable header")
    if name != "MQTT" or buf[offset] != 5:
        raise MalformedPacket("MQTT-3.1.2-1", f"not an MQTT 5 CONNECT: {name!r}")
    keepalive = (buf[offset + 2] << 8) | buf[offset + 3]
    return decode_connect5(buf[offset + 1], keepalive, buf, offset + 4, stop, max_user)


def _decode_connack(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
    if stop - start < 2:
        raise _truncated("CONNACK variable header")
    ack_flags, code = buf[start], buf[start + 1]
    if ack_flags & 0xFE:
        raise MalformedPacket("MQTT-3.2.2-1", "reserved CONNACK acknowledge flags must be 0")
    check_reason("CONNACK", code)
    if ack_flags and code:
        raise MalformedPacket("MQTT-3.2.2-6", "session present must be 0 when refusing")
    props, offset = decode_properties(buf, start + 2, stop, "CONNACK", max_user)
    _expect_end(offset, stop, "CONNACK")
    return ConnAck5(bool(ack_flags), code, props)


def _decode_publish(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("MQTT-3.3.1-4", "PUBLISH QoS must not be 3")
    dup = bool(flags & 0x08)
    if not qos and dup:
        raise MalformedPacket("MQTT-3.3.1-2", "DUP must be 0 for QoS 0 messages")
    topic, offset = _read_str(buf, start, stop, "PUBLISH topic name")
    if topic and ("+" in topic or "#" in topic):
        raise InvalidTopic("MQTT-3.3.2-2", f"topic name must not contain wildcards: {topic!r}",
                           0x90)
    packet_id = None
    if qos:
        packet_id = _read_u16(buf, offset, stop, "PUBLISH packet identifier")
        if not packet_id:
            raise ProtocolError5("MQTT-2.2.1-3", "PUBLISH packet identifier must not be 0")
        offset += 2
    props, offset = decode_properties(buf, offset, stop, "PUBLISH", max_user)
    return Publish5(topic, buf[offset:stop], qos, bool(flags & 0x01), dup, packet_id, props)


def _ack_decoder(cls: type[PubAck5 | PubRec5 | PubRel5 | PubComp5]) -> _Decoder:
    name = cls.__name__[:-1].upper()

    def decode_ack(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
        packet_id = _read_u16(buf, start, stop, f"{name} packet identifier")
        if not packet_id:
            raise ProtocolError5("MQTT-2.2.1-3", "packet identifier must not be 0")
        if stop - start == 2:  # the short form: success, no properties (3.4.2.1)
            return cls(packet_id)
        code = buf[start + 2]
        check_reason(name, code)
        if stop - start == 3:
            return cls(packet_id, code)
        props, offset = decode_properties(buf, start + 3, stop, name, max_user)
        _expect_end(offset, stop, name)
        return cls(packet_id, code, props)

    return decode_ack


def _decode_subscribe(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
    packet_id = _read_u16(buf, start, stop, "SUBSCRIBE packet identifier")
    props, offset = decode_properties(buf, start + 2, stop, "SUBSCRIBE", max_user)
    topics: list[tuple[str, SubOptions]] = []
    while offset < stop:
        topic_filter, offset = _read_str(buf, offset, stop, "SUBSCRIBE topic filter")
        if offset >= stop:
            raise _truncated("SUBSCRIBE options")
        options = SubOptions.from_byte(buf[offset])
        offset += 1
        validate_topic_filter(topic_filter)
        topics.append((topic_filter, options))
    if not topics:
        raise ProtocolError5("MQTT-3.8.3-2", "SUBSCRIBE must contain at least one filter")
    return Subscribe5(packet_id or _zero_id(), tuple(topics), props)


def _zero_id() -> int:
    raise ProtocolError5("MQTT-2.2.1-3", "packet identifier must not be 0")


def _decode_suback_like(name: str, cls: type[SubAck5 | UnsubAck5]) -> _Decoder:
    def decode(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
        packet_id = _read_u16(buf, start, stop, f"{name} packet identifier")
        props, offset = decode_properties(buf, start + 2, stop, name, max_user)
        codes = tuple(buf[offset:stop])
        for code in codes:
            check_reason(name, code)
        return cls(packet_id or _zero_id(), codes, props)

    return decode


def _decode_unsubscribe(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
    packet_id = _read_u16(buf, start, stop, "UNSUBSCRIBE packet identifier")
    props, offset = decode_properties(buf, start + 2, stop, "UNSUBSCRIBE", max_user)
    topics: list[str] = []
    while offset < stop:
        topic_filter, offset = _read_str(buf, offset, stop, "UNSUBSCRIBE topic filter")
        validate_topic_filter(topic_filter)
        topics.append(topic_filter)
    if not topics:
        raise ProtocolError5("MQTT-3.10.3-2", "UNSUBSCRIBE must contain at least one filter")
    return Unsubscribe5(packet_id or _zero_id(), tuple(topics), props)


def _reason_and_props(name: str, cls: type[Disconnect5 | Auth5]) -> _Decoder:
    def decode(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
        if stop == start:  # remaining length 0: success/normal, no properties
            return cls()
        code = buf[start]
        check_reason(name, code)
        if stop - start == 1:
            return cls(code)
        props, offset = decode_properties(buf, start + 1, stop, name, max_user)
        _expect_end(offset, stop, name)
        return cls(code, props)

    return decode


def _empty(cls: type[PingReq | PingResp]) -> _Decoder:
    instance = cls()

    def decode(flags: int, buf: bytes, start: int, stop: int, max_user: int) -> Packet5:
        if stop != start:
            raise MalformedPacket(RULE_LENGTH, f"{cls.__name__.upper()} must be empty")
        return instance

    return decode


class ProtocolError5(MalformedPacket):
    """A rule whose violation v5 classes as a protocol error (0x82) rather than malformed.

    Among them packet identifier 0 on a PUBLISH (QoS > 0), SUBSCRIBE, UNSUBSCRIBE or an
    acknowledgement [MQTT-2.2.1-3]: the packet is well formed, its identifier is just not
    one the protocol allows (section 4.13 says Protocol Error; mosquitto sends 0x82).  It
    was 0x81 before 2026-11-29.  MQTT 3.1.1 has no reason codes: the connection closes."""

    default_reason_code = 0x82


#: ``(flags, buf, start, stop, max_user)``: the last bounds each property set's user
#: properties (``PacketDecoder5.max_user_properties``).
_Decoder = Callable[[int, bytes, int, int, int], Packet5]

_DECODERS5: list[_Decoder | None] = [
    None, _decode_connect, _decode_connack, _decode_publish,
    _ack_decoder(PubAck5), _ack_decoder(PubRec5), _ack_decoder(PubRel5),
    _ack_decoder(PubComp5), _decode_subscribe, _decode_suback_like("SUBACK", SubAck5),
    _decode_unsubscribe, _decode_suback_like("UNSUBACK", UnsubAck5),
    _empty(PingReq), _empty(PingResp), _reason_and_props("DISCONNECT", Disconnect5),
    _reason_and_props("AUTH", Auth5),
]  # fmt: skip
_FIXED_FLAGS5 = (0, 0, 0, -1, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0, 0)


class PacketDecoder5(PacketDecoder):
    """``PacketDecoder`` for a connection that negotiated MQTT 5.0.

    ``max_packet_size`` bounds the remaining length, as in the 3.1.1 decoder; exceeding it
    raises ``PacketTooLarge`` (reason code 0x95).  ``max_user_properties`` bounds the user
    properties of each property set (``limits.max_user_properties``); one more raises
    ``QuotaExceeded`` (0x97) before the rest of the set is read.
    """

    __slots__ = ("max_user_properties",)

    def __init__(self, max_packet_size: int = 268_435_455,
                 max_user_properties: int = DEFAULT_MAX_USER_PROPERTIES) -> None:
        super().__init__(max_packet_size)
        self.max_user_properties = max_user_properties

    @classmethod
    def take_over(cls, old: PacketDecoder,
                  max_user_properties: int = DEFAULT_MAX_USER_PROPERTIES) -> PacketDecoder5:
        """A v5 decoder continuing exactly where ``old`` stopped (bytes after CONNECT)."""
        new = cls(old._max, max_user_properties)
        new._buf, new._pos, new._chunks = old._buf, old._pos, old._chunks
        new._parked, new._need = old._parked, old._need
        return new

    def next_packet(self) -> Packet5 | None:  # type: ignore[override]
        buf = self._buf
        pos = self._pos
        end = len(buf)
        if end - pos < 2:
            self._need = end - pos + 1
            return None
        first = buf[pos]
        length = buf[pos + 1]
        if length < 128:
            start = pos + 2
        else:
            length, start = self._long_length(buf, pos, end)
            if start < 0:
                self._need = end - pos + 1
                return None
        if length > self._max:
            raise PacketTooLarge(
                RULE_LENGTH, f"remaining length {length} exceeds the limit of {self._max}"
            )
        stop = start + length
        if stop > end:
            self._need = stop - pos
            return None
        self._pos = stop
        packet_type = first >> 4
        decoder = _DECODERS5[packet_type]
        if decoder is None:
            raise MalformedPacket("MQTT-2.1.2", f"reserved packet type {packet_type}")
        fixed = _FIXED_FLAGS5[packet_type]
        if fixed >= 0 and first & 0x0F != fixed:
            raise MalformedPacket(
                RULE_FLAGS, f"invalid fixed header flags {first & 0x0F:#06b} for type "
                            f"{packet_type}")
        return decoder(first & 0x0F, buf, start, stop, self.max_user_properties)


def decode5(data: bytes, max_packet_size: int = 268_435_455,
            max_user_properties: int = DEFAULT_MAX_USER_PROPERTIES) -> Packet5:
    """Exactly one v5 packet from ``data``; incomplete input or leftovers are malformed."""
    decoder = PacketDecoder5(max_packet_size, max_user_properties)
    decoder.feed(data)
    packet = decoder.next_packet()
    if packet is None:
        raise MalformedPacket(RULE_LENGTH, f"incomplete packet ({len(data)} bytes)")
    if decoder.buffered:
        raise MalformedPacket(RULE_LENGTH, f"{decoder.buffered} bytes after the packet")
    return packet

