"""Sans-IO MQTT 5.0 codec: v5 packets to bytes here, bytes to packets in ``decoder5``.

As ``codec`` for 3.1.1: ``encode5`` refuses (with the decoder's error family) what the
decoder would refuse, so ``decode5(encode5(p)) == p``; acknowledgements and DISCONNECT use
the short forms the specification allows (reason 0 without properties: no reason byte)
so that what we send is what a careful peer would send.

``encode_publish5`` is the delivery path's encoder: the broker keeps a message's forwardable
properties pre-encoded (``mqttring.protocol.message.Message.props``) and splices them in,
together with what differs per subscriber (subscription identifiers, the remaining message
expiry interval), without building a ``Properties`` per delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from struct import Struct
from typing import Any

from mqttring.protocol.codec import _connect_tail, _encode_str, _frame
from mqttring.protocol.decoder5 import PacketDecoder5, decode5
from mqttring.protocol.errors import MalformedPacket
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
    Subscribe5,
    UnsubAck5,
    Unsubscribe5,
)
from mqttring.protocol.properties import (
    check_reason,
    encode_properties,
    encode_vbi,
)
from mqttring.protocol.topics import validate_topic_filter, validate_topic_name

__all__ = ["PacketDecoder5", "decode5", "encode5", "encode_publish5"]

_pack_u16 = Struct(">H").pack


def encode_publish5(topic: bytes, payload: bytes, qos: int, retain: bool, dup: bool,
                    packet_id: int | None, props: bytes) -> bytes:
    """A v5 PUBLISH from pre-encoded parts; ``props`` is the property *body* (no length).

    The caller vouches for the topic and the properties (they came from a decoded packet or
    from our own encoder), as for ``codec.encode_publish``.
    """
    first = 0x30 | (dup << 3) | (qos << 1) | retain
    head = _pack_u16(len(topic)) + topic
    if qos:
        head += _pack_u16(packet_id)  # type: ignore[arg-type]
    head += encode_vbi(len(props)) + props
    return _frame(first, head + payload)


def _encode_connect(packet: Connect5) -> bytes:
    flags = 0x02 if packet.clean_start else 0
    parts = [_encode_str("MQTT"), b"\x05", b"", _pack_u16(packet.keepalive),
             encode_properties(packet.properties, "CONNECT"), _encode_str(packet.client_id)]
    will = packet.will
    return _connect_tail(parts, flags, will,
                         None if will is None else encode_properties(will.properties, "WILL"),
                         packet.username, packet.password)


def _encode_connack(packet: ConnAck5) -> bytes:
    check_reason("CONNACK", packet.reason_code)
    if packet.session_present and packet.reason_code:
        raise MalformedPacket("MQTT-3.2.2-6", "session present must be 0 when refusing")
    return _frame(0x20, bytes((int(packet.session_present), packet.reason_code))
                  + encode_properties(packet.properties, "CONNACK"))


def _encode_publish(packet: Publish5) -> bytes:
    if packet.topic:
        validate_topic_name(packet.topic)
    props = encode_properties(packet.properties, "PUBLISH")
    body = _pack_u16(packet.packet_id) if packet.qos else b""  # type: ignore[arg-type]
    first = 0x30 | (packet.dup << 3) | (packet.qos << 1) | packet.retain
    return _frame(first, _encode_str(packet.topic) + body + props + packet.payload)


def _ack_encoder(first_byte: int, name: str) -> Callable[[Any], bytes]:
    def encode(packet: PubAck5 | PubRec5 | PubRel5 | PubComp5) -> bytes:
        check_reason(name, packet.reason_code)
        pid = _pack_u16(packet.packet_id)
        if not packet.properties:
            if not packet.reason_code:
                return bytes((first_byte, 2)) + pid
            return bytes((first_byte, 3)) + pid + bytes((packet.reason_code,))
        return _frame(first_byte, pid + bytes((packet.reason_code,))
                      + encode_properties(packet.properties, name))

    return encode


def _encode_subscribe(packet: Subscribe5) -> bytes:
    parts = [_pack_u16(packet.packet_id), encode_properties(packet.properties, "SUBSCRIBE")]
    for topic_filter, options in packet.topics:
        validate_topic_filter(topic_filter)
        parts.append(_encode_str(topic_filter))
        parts.append(bytes((options.to_byte(),)))
    return _frame(0x82, b"".join(parts))


def _suback_like(first_byte: int, name: str) -> Callable[[Any], bytes]:
    def encode(packet: SubAck5 | UnsubAck5) -> bytes:
        for code in packet.reason_codes:
            check_reason(name, code)
        return _frame(first_byte, _pack_u16(packet.packet_id)
                      + encode_properties(packet.properties, name) + bytes(packet.reason_codes))

    return encode


def _encode_unsubscribe(packet: Unsubscribe5) -> bytes:
    parts = [_pack_u16(packet.packet_id), encode_properties(packet.properties, "UNSUBSCRIBE")]
    for topic_filter in packet.topics:
        validate_topic_filter(topic_filter)
        parts.append(_encode_str(topic_filter))
    return _frame(0xA2, b"".join(parts))


def _reason_encoder(first_byte: int, name: str) -> Callable[[Any], bytes]:
    def encode(packet: Disconnect5 | Auth5) -> bytes:
        check_reason(name, packet.reason_code)
        if not packet.properties:
            if not packet.reason_code:
                return bytes((first_byte, 0))
            return bytes((first_byte, 1, packet.reason_code))
        return _frame(first_byte, bytes((packet.reason_code,))
                      + encode_properties(packet.properties, name))

    return encode


_ENCODERS5: dict[type, Callable[[Any], bytes]] = {
    Connect5: _encode_connect, ConnAck5: _encode_connack, Publish5: _encode_publish,
    PubAck5: _ack_encoder(0x40, "PUBACK"), PubRec5: _ack_encoder(0x50, "PUBREC"),
    PubRel5: _ack_encoder(0x62, "PUBREL"), PubComp5: _ack_encoder(0x70, "PUBCOMP"),
    Subscribe5: _encode_subscribe, SubAck5: _suback_like(0x90, "SUBACK"),
    Unsubscribe5: _encode_unsubscribe, UnsubAck5: _suback_like(0xB0, "UNSUBACK"),
    PingReq: lambda _p: b"\xc0\x00", PingResp: lambda _p: b"\xd0\x00",
    Disconnect5: _reason_encoder(0xE0, "DISCONNECT"), Auth5: _reason_encoder(0xF0, "AUTH"),
}  # fmt: skip


def encode5(packet: Packet5) -> bytes:
    """Bytes for any v5 packet; raises the MalformedPacket family rather than emit invalid
    ones (and ``ProtocolViolation`` for a property the packet may not carry)."""
    encoder = _ENCODERS5.get(type(packet))
    if encoder is None:
        raise TypeError(f"not an MQTT 5 packet: {packet!r}")
    return encoder(packet)
