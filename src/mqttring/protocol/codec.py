"""Sans-IO MQTT 3.1.1 codec: packets to bytes here, bytes to packets in ``decoder``.

Theory of operation
-------------------
Nothing here does I/O.  A connection adapter calls ``PacketDecoder.feed`` with whatever the
transport delivered and drains ``next_packet`` (or iterates the decoder) until it returns
``None``; to send, it writes ``encode(packet)`` or, on the fan-out hot path, bytes from
``encode_publish`` / ``publish_with_packet_id``.  The same code serves the broker, test clients,
fuzzers and benchmarks.  ``PacketDecoder`` and ``decode`` live in
``mqttring.protocol.decoder`` (their invariants are described there) and are re-exported
here, so ``codec`` stays the one import for both directions.

Encoder invariants: ``encode`` refuses (with the same error family as the decoder) to produce
bytes that the decoder would reject, so ``decode(encode(p)) == p`` for every packet it
accepts.  ``encode_publish`` is the exception by design: it trusts its caller (the router,
which took the topic from an already-validated packet) and only builds bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from struct import Struct
from typing import Any

from mqttring.protocol.decoder import (
    MAX_REMAINING_LENGTH,
    RULE_LENGTH,
    PacketDecoder,
    decode,
)
from mqttring.protocol.errors import MalformedPacket, PacketTooLarge
from mqttring.protocol.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from mqttring.protocol.properties import encode_vbi
from mqttring.protocol.topics import validate_topic_filter, validate_topic_name

__all__ = [
    "MAX_REMAINING_LENGTH",
    "PacketDecoder",
    "decode",
    "encode",
    "encode_publish",
    "encode_remaining_length",
    "publish_with_packet_id",
]

_U16 = Struct(">H")
_pack_u16 = _U16.pack
_pack_bb = Struct(">BB").pack
_pack_bbh = Struct(">BBH").pack


# --------------------------------------------------------------------------------- encoding


def encode_remaining_length(length: int) -> bytes:
    """The variable-length "Remaining Length" field (section 2.2.3)."""
    if length < 128:
        if length < 0:
            raise ValueError(f"negative remaining length {length}")
        return bytes((length,))
    if length > MAX_REMAINING_LENGTH:
        raise PacketTooLarge(
            RULE_LENGTH, f"remaining length {length} exceeds {MAX_REMAINING_LENGTH}"
        )
    return encode_vbi(length)  # the same variable byte integer as MQTT 5's (section 1.5.5)


def _frame(first_byte: int, body: bytes) -> bytes:
    return bytes((first_byte,)) + encode_remaining_length(len(body)) + body


def _encode_str(value: str) -> bytes:
    """A length-prefixed UTF-8 string, refusing what a receiver must reject (section 1.5.3)."""
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedPacket("MQTT-1.5.3-1", f"not well-formed UTF-8: {value!r}") from None
    if "\x00" in value:
        raise MalformedPacket("MQTT-1.5.3-2", f"string must not contain U+0000: {value!r}")
    if len(raw) > 0xFFFF:
        raise MalformedPacket("MQTT-1.5.3", f"string longer than 65535 bytes ({len(raw)})")
    return _pack_u16(len(raw)) + raw


def _encode_bin(value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise MalformedPacket("MQTT-3.1.3", f"binary field longer than 65535 bytes ({len(value)})")
    return _pack_u16(len(value)) + value


def encode_publish(
    topic: bytes,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
) -> bytes:
    """Hot-path PUBLISH encoder; the caller vouches that ``topic`` is a valid UTF-8 name.

    No validation beyond what building the bytes needs: the router encodes each message once
    per QoS from a packet the decoder already checked, and per-call checks would be paid on
    every fan-out.  ``encode(Publish(...))`` is the checked entry point.
    """
    first = 0x30 | (dup << 3) | (qos << 1) | retain
    topic_len = len(topic)
    if qos:
        length = topic_len + len(payload) + 4
        if length < 128:  # one delivery in most: one pack and one join
            return b"".join((_pack_bbh(first, length, topic_len), topic,
                             _pack_u16(packet_id), payload))  # type: ignore[arg-type]
        head = _pack_u16(topic_len) + topic + _pack_u16(packet_id)  # type: ignore[arg-type]
    else:
        length = topic_len + len(payload) + 2
        head = _pack_u16(topic_len) + topic
    if length < 128:
        return _pack_bb(first, length) + head + payload
    # Left to right, so the (large) payload is copied once, by the last concatenation.
    return bytes((first,)) + encode_remaining_length(length) + head + payload


def publish_with_packet_id(
    packet: bytes,
    qos: int,
    packet_id: int | None,
    *,
    dup: bool = False,
    retain: bool | None = None,
) -> bytes:
    """Turn a pre-encoded QoS 0 PUBLISH into the variant one subscriber needs.

    Fan-out encodes a message once at QoS 0 (which every QoS 0 subscriber receives verbatim)
    and stamps QoS 1/2 copies from it: the new fixed header and packet identifier are spliced
    around the untouched topic and payload, so the payload is copied exactly once and never
    re-encoded.  ``retain=None`` keeps the original RETAIN flag; pass ``False`` for live
    forwarding [MQTT-3.3.1-9] or ``True`` when replaying retained messages on subscribe
    [MQTT-3.3.1-8].  With ``qos=0`` only the RETAIN flag can change.

    Misuse (not a QoS 0 PUBLISH, bad QoS/packet id) is our bug, hence ``ValueError``.
    """
    first = packet[0] if packet else 0
    if first & 0xF6 != 0x30:
        raise ValueError("publish_with_packet_id expects an encoded QoS 0 PUBLISH")
    retain_bit = (first & 1) if retain is None else int(retain)
    if qos == 0:
        if packet_id is not None or dup:
            raise ValueError("a QoS 0 PUBLISH carries neither a packet id nor DUP")
        if retain_bit == first & 1:
            return packet
        return bytes((0x30 | retain_bit,)) + packet[1:]
    if qos not in (1, 2) or packet_id is None or not 1 <= packet_id <= 0xFFFF:
        raise ValueError(f"bad qos/packet id for a stamped PUBLISH: {qos}, {packet_id}")
    first_byte = 0x30 | (dup << 3) | (qos << 1) | retain_bit
    length = packet[1]
    if length < 126:
        # Still a one-byte length after adding the packet id: plain slices beat a join here.
        topic_end = 4 + ((packet[2] << 8) | packet[3])
        return (
            _pack_bb(first_byte, length + 2)
            + packet[2:topic_end]
            + _pack_u16(packet_id)
            + packet[topic_end:]
        )
    length = shift = 0
    index = 1
    while packet[index] & 0x80:
        length |= (packet[index] & 0x7F) << shift
        index += 1
        shift += 7
    length |= packet[index] << shift
    index += 1
    topic_end = index + 2 + ((packet[index] << 8) | packet[index + 1])
    view = memoryview(packet)  # slices of a view do not copy; the final concatenation does
    return (
        bytes((first_byte,))
        + encode_remaining_length(length + 2)
        + view[index:topic_end]
        + _pack_u16(packet_id)
        + view[topic_end:]
    )


def _encode_connect(packet: Connect) -> bytes:
    name, level = packet.protocol_name, packet.protocol_level
    if not (name == "MQTT" or (name == "MQIsdp" and level == 3)):
        raise MalformedPacket("MQTT-3.1.2-1", f"unsupported protocol {name!r} level {level}")
    if not 0 <= level <= 0xFF:
        raise MalformedPacket("MQTT-3.1.2-2", f"protocol level out of range: {level}")
    flags = 0x02 if packet.clean_session else 0
    parts = [_encode_str(name), bytes((level,)), b"", _pack_u16(packet.keepalive)]
    parts.append(_encode_str(packet.client_id))
    return _connect_tail(parts, flags, packet.will, None, packet.username, packet.password)


def _connect_tail(parts: list[bytes], flags: int, will: Any, will_properties: bytes | None,
                  username: str | None, password: bytes | None) -> bytes:
    """The rest of a CONNECT after the client id, for 3.1.1 and MQTT 5 alike (5 puts the
    will's encoded properties before its topic); ``parts[2]`` is the connect flags' place."""
    if will is not None:
        validate_topic_name(will.topic)
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
        if will_properties is not None:
            parts.append(will_properties)
        parts.append(_encode_str(will.topic))
        parts.append(_encode_bin(will.payload))
    if username is not None:
        flags |= 0x80
        parts.append(_encode_str(username))
    if password is not None:
        flags |= 0x40
        parts.append(_encode_bin(password))
    parts[2] = bytes((flags,))
    return _frame(0x10, b"".join(parts))


def _encode_connack(packet: ConnAck) -> bytes:
    code = int(packet.return_code)
    if not 0 <= code <= ConnectReturnCode.NOT_AUTHORIZED:
        raise MalformedPacket("MQTT-3.2.2.3", f"reserved CONNACK return code {code}")
    if packet.session_present and code:
        raise MalformedPacket("MQTT-3.2.2-4", "session present must be 0 when refusing")
    return bytes((0x20, 0x02, 0x01 if packet.session_present else 0, code))


def _encode_publish_packet(packet: Publish) -> bytes:
    validate_topic_name(packet.topic)
    topic = packet.topic.encode("utf-8")
    return encode_publish(
        topic, packet.payload, packet.qos, packet.retain, packet.dup, packet.packet_id
    )


def _encode_subscribe(packet: Subscribe) -> bytes:
    parts = [_pack_u16(packet.packet_id)]
    for topic_filter, qos in packet.topics:
        validate_topic_filter(topic_filter)
        parts.append(_encode_str(topic_filter))
        parts.append(bytes((qos,)))
    return _frame(0x82, b"".join(parts))


def _encode_suback(packet: SubAck) -> bytes:
    return _frame(0x90, _pack_u16(packet.packet_id) + bytes(packet.return_codes))


def _encode_unsubscribe(packet: Unsubscribe) -> bytes:
    parts = [_pack_u16(packet.packet_id)]
    for topic_filter in packet.topics:
        validate_topic_filter(topic_filter)
        parts.append(_encode_str(topic_filter))
    return _frame(0xA2, b"".join(parts))


def _ack_encoder(first_byte: int) -> Callable[[PubAck | PubRec | PubRel | PubComp], bytes]:
    prefix = bytes((first_byte, 0x02))
    return lambda packet: prefix + _pack_u16(packet.packet_id)


def _constant_encoder(first_byte: int) -> Callable[[Packet], bytes]:
    frame = bytes((first_byte, 0x00))
    return lambda _packet: frame


_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    Connect: _encode_connect, ConnAck: _encode_connack, Publish: _encode_publish_packet,
    PubAck: _ack_encoder(0x40), PubRec: _ack_encoder(0x50), PubRel: _ack_encoder(0x62),
    PubComp: _ack_encoder(0x70), Subscribe: _encode_subscribe, SubAck: _encode_suback,
    Unsubscribe: _encode_unsubscribe, UnsubAck: _ack_encoder(0xB0),
    PingReq: _constant_encoder(0xC0), PingResp: _constant_encoder(0xD0),
    Disconnect: _constant_encoder(0xE0),
}  # fmt: skip


def encode(packet: Packet) -> bytes:
    """Bytes for any packet; raises the MalformedPacket family rather than emit invalid ones."""
    encoder = _ENCODERS.get(type(packet))
    if encoder is None:
        raise TypeError(f"not an MQTT packet: {packet!r}")
    return encoder(packet)
