"""Sans-IO MQTT 3.1.1 decoder: bytes, in arbitrary chunks, to packets.

A level-5 CONNECT is handed to ``decoder5.decode_connect5``; the connection then continues
on ``decoder5.PacketDecoder5`` (MQTT 5.0), so nothing below pays for the other version.

Decoder invariants:

* One immutable ``bytes`` buffer holds unconsumed input and ``_pos`` marks where the next
  packet starts; decoding a packet copies nothing but its topic and payload slices.  A feed
  that cannot complete the pending packet is parked without copying and joined once the
  packet is complete (see ``PacketDecoder``), so no input is copied more than twice.
* The size limit is enforced from the fixed header alone: a peer announcing a packet larger
  than ``max_packet_size`` is rejected before a single byte of its body is buffered (even a
  partially received remaining-length field is checked against the limit).
* Every way the bytes can be wrong raises a member of the ``MalformedPacket`` family naming
  the conformance statement; no ``IndexError``, ``UnicodeDecodeError`` or ``struct.error`` can
  escape, because every read is bounds-checked against the packet's declared end first.  Rules
  without a numbered statement cite their section: ``MQTT-2.2.1`` (reserved packet type) and
  ``MQTT-2.2.3`` (remaining length: too long a field, or contents that do not fill the
  declared length exactly).  After an error the caller closes the connection; the decoder
  makes no attempt to resynchronise.
* PUBLISH, the only packet whose rate matters, is decoded inline in ``next_packet`` and built
  without the dataclass constructor; other packet types go through a dispatch table and the
  ordinary, validating constructors.  A server connection passes handlers for PUBLISH and
  PUBACK (one each per QoS 1 delivery), which get the checked fields instead of a packet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Protocol, TypeVar

from mqttring.protocol.errors import InvalidTopic, MalformedPacket, PacketTooLarge
from mqttring.protocol.packets import (
    SUBACK_FAILURE,
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
    Will,
)
from mqttring.protocol.topics import validate_topic_filter, validate_topic_name

__all__ = ["MAX_REMAINING_LENGTH", "RULE_FLAGS", "RULE_LENGTH", "PacketDecoder", "decode"]

MAX_REMAINING_LENGTH = 268_435_455
"""Largest value four remaining-length bytes can carry (0xFF 0xFF 0xFF 0x7F)."""

#: Conformance statements cited by both directions of the codec.
RULE_LENGTH = "MQTT-2.2.3"
RULE_FLAGS = "MQTT-2.2.2-1"


# --------------------------------------------------------------------------------- decoding
#
# Readers take the shared buffer plus the packet's [offset, stop) window and return the value
# with the next offset.  They check bounds against ``stop`` themselves so that a field can
# never run into the following packet.


def _truncated(what: str) -> MalformedPacket:
    return MalformedPacket(RULE_LENGTH, f"{what} runs past the packet's remaining length")


def _read_u16(buf: bytes, offset: int, stop: int, what: str) -> int:
    if offset + 2 > stop:
        raise _truncated(what)
    return (buf[offset] << 8) | buf[offset + 1]


def _read_str(buf: bytes, offset: int, stop: int, what: str) -> tuple[str, int]:
    end = offset + 2 + _read_u16(buf, offset, stop, what)
    if end > stop:
        raise _truncated(what)
    try:
        value = buf[offset + 2 : end].decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPacket("MQTT-1.5.3-1", f"{what} is not well-formed UTF-8") from None
    if "\x00" in value:
        raise MalformedPacket("MQTT-1.5.3-2", f"{what} must not contain U+0000: {value!r}")
    return value, end


def _read_bin(buf: bytes, offset: int, stop: int, what: str) -> tuple[bytes, int]:
    end = offset + 2 + _read_u16(buf, offset, stop, what)
    if end > stop:
        raise _truncated(what)
    return buf[offset + 2 : end], end


def _expect_end(offset: int, stop: int, what: str) -> None:
    if offset != stop:
        raise MalformedPacket(RULE_LENGTH, f"{stop - offset} trailing bytes after {what}")


def _decode_connect(flags: int, buf: bytes, start: int, stop: int,
                    max_user_properties: int | None = None) -> Packet:
    name, offset = _read_str(buf, start, stop, "CONNECT protocol name")
    if offset + 4 > stop:
        raise _truncated("CONNECT variable header")
    level = buf[offset]
    connect_flags = buf[offset + 1]
    keepalive = (buf[offset + 2] << 8) | buf[offset + 3]
    offset += 4
    # Level != 4 under the name "MQTT" is decoded so that the session can answer it with
    # CONNACK code 1 [MQTT-3.1.2-2]; "MQIsdp" is the name MQTT 3.1 clients use.
    if not (name == "MQTT" or (name == "MQIsdp" and level == 3)):
        # Another level under "MQIsdp" is an unacceptable protocol version too: the reason
        # code 0x84 has the connection answer CONNACK 1 before it closes, as mosquitto does
        # (``ServerConnection.receive_data``); any other name closes without a CONNACK.
        raise MalformedPacket("MQTT-3.1.2-1", f"unsupported protocol {name!r} level {level}",
                              0x84 if name == "MQIsdp" else None)
    if name == "MQTT" and level == 5:
        # MQTT 5.0: its own module (imported here, once per connection, so that the 3.1.1
        # decoder does not depend on the v5 one at import time).
        from mqttring.protocol.decoder5 import decode_connect5

        if max_user_properties is None:
            return decode_connect5(connect_flags, keepalive, buf, offset, stop)  # type: ignore[return-value]
        return decode_connect5(connect_flags, keepalive, buf, offset, stop,  # type: ignore[return-value]
                               max_user_properties)
    if name == "MQTT" and level != 4:
        # Another revision (MQTT 5 puts properties here): its payload is not ours to parse.
        # The session only needs the level to refuse it with CONNACK 1 [MQTT-3.1.2-2]; flags
        # and keep-alive sit at the same offsets in every revision and are kept for logging.
        return Connect(
            client_id="",
            clean_session=bool(connect_flags & 0x02),
            keepalive=keepalive,
            protocol_name=name,
            protocol_level=level,
        )
    if connect_flags & 0x01:
        raise MalformedPacket("MQTT-3.1.2-3", "reserved CONNECT flag must be 0")
    will_flag = connect_flags & 0x04
    will_qos = (connect_flags >> 3) & 0x03
    will_retain = bool(connect_flags & 0x20)
    if not will_flag:
        if will_qos:
            raise MalformedPacket("MQTT-3.1.2-13", "will QoS must be 0 without the will flag")
        if will_retain:
            raise MalformedPacket("MQTT-3.1.2-15", "will retain must be 0 without the will flag")
    elif will_qos == 3:
        raise MalformedPacket("MQTT-3.1.2-14", "will QoS must not be 3")
    has_username = connect_flags & 0x80
    has_password = connect_flags & 0x40
    if has_password and not has_username:
        raise MalformedPacket("MQTT-3.1.2-22", "password flag set without the user name flag")
    client_id, offset = _read_str(buf, offset, stop, "client identifier")
    will = None
    if will_flag:
        will_topic, offset = _read_str(buf, offset, stop, "will topic")
        validate_topic_name(will_topic)
        will_payload, offset = _read_bin(buf, offset, stop, "will message")
        will = Will(will_topic, will_payload, will_qos, will_retain)
    username = password = None
    if has_username:
        username, offset = _read_str(buf, offset, stop, "user name")
    if has_password:
        password, offset = _read_bin(buf, offset, stop, "password")
    _expect_end(offset, stop, "CONNECT payload")
    clean_session = bool(connect_flags & 0x02)
    return Connect(client_id, clean_session, keepalive, will, username, password, name, level)


def _decode_connack(flags: int, buf: bytes, start: int, stop: int) -> Packet:
    if stop - start != 2:
        raise MalformedPacket(
            RULE_LENGTH, f"CONNACK remaining length must be 2, not {stop - start}"
        )
    ack_flags, code = buf[start], buf[start + 1]
    if ack_flags & 0xFE:
        raise MalformedPacket("MQTT-3.2.2.1", "reserved CONNACK acknowledge flags must be 0")
    if code > ConnectReturnCode.NOT_AUTHORIZED:
        raise MalformedPacket("MQTT-3.2.2.3", f"reserved CONNACK return code {code}")
    if ack_flags and code:
        raise MalformedPacket("MQTT-3.2.2-4", "session present must be 0 when refusing")
    return ConnAck(bool(ack_flags), ConnectReturnCode(code))


def _ack_decoder(cls: type[PubAck | PubRec | PubRel | PubComp | UnsubAck]) -> _Decoder:
    name = cls.__name__.upper()

    def decode_ack(flags: int, buf: bytes, start: int, stop: int) -> Packet:
        if stop - start != 2:
            raise MalformedPacket(
                RULE_LENGTH, f"{name} remaining length must be 2, not {stop - start}"
            )
        packet_id = (buf[start] << 8) | buf[start + 1]
        if not packet_id:  # the check of ``_Ack.__post_init__``, which is bypassed below
            raise MalformedPacket("MQTT-2.3.1-1",
                                  "packet identifier must be 1..65535, got 0")
        # One per delivered QoS >= 1 message: built like the PUBLISH fast path (below),
        # without the frozen dataclass ``__init__``.
        packet = _new_ack(cls)
        _set_ack_id(packet, packet_id)
        return packet

    return decode_ack


def _decode_subscribe(flags: int, buf: bytes, start: int, stop: int) -> Packet:
    packet_id = _read_u16(buf, start, stop, "SUBSCRIBE packet identifier")
    offset = start + 2
    topics: list[tuple[str, int]] = []
    while offset < stop:
        topic_filter, offset = _read_str(buf, offset, stop, "SUBSCRIBE topic filter")
        if offset >= stop:
            raise _truncated("SUBSCRIBE requested QoS")
        qos = buf[offset]
        offset += 1
        if qos > 2:
            raise MalformedPacket("MQTT-3-8.3-4", f"invalid requested QoS byte {qos:#04x}")
        validate_topic_filter(topic_filter)
        topics.append((topic_filter, qos))
    if not topics:
        raise MalformedPacket("MQTT-3.8.3-3", "SUBSCRIBE must contain at least one filter")
    return Subscribe(packet_id, tuple(topics))


def _decode_suback(flags: int, buf: bytes, start: int, stop: int) -> Packet:
    packet_id = _read_u16(buf, start, stop, "SUBACK packet identifier")
    codes = tuple(buf[start + 2 : stop])
    for code in codes:
        if code > 2 and code != SUBACK_FAILURE:
            raise MalformedPacket("MQTT-3.9.3-2", f"invalid SUBACK return code {code:#04x}")
    return SubAck(packet_id, codes)


def _decode_unsubscribe(flags: int, buf: bytes, start: int, stop: int) -> Packet:
    packet_id = _read_u16(buf, start, stop, "UNSUBSCRIBE packet identifier")
    offset = start + 2
    topics: list[str] = []
    while offset < stop:
        topic_filter, offset = _read_str(buf, offset, stop, "UNSUBSCRIBE topic filter")
        validate_topic_filter(topic_filter)
        topics.append(topic_filter)
    if not topics:
        raise MalformedPacket("MQTT-3.10.3-2", "UNSUBSCRIBE must contain at least one filter")
    return Unsubscribe(packet_id, tuple(topics))


def _empty_decoder(cls: type[PingReq | PingResp | Disconnect]) -> _Decoder:
    name = cls.__name__.upper()
    instance = cls()

    def decode_empty(flags: int, buf: bytes, start: int, stop: int) -> Packet:
        if stop != start:
            raise MalformedPacket(RULE_LENGTH, f"{name} remaining length must be 0")
        return instance

    return decode_empty


_Decoder = Callable[[int, bytes, int, int], Packet]

# Index = packet type; PUBLISH (3) is handled inline, 0 and 15 are reserved.
_DECODERS: list[_Decoder | None] = [
    None, _decode_connect, _decode_connack, None,
    _ack_decoder(PubAck), _ack_decoder(PubRec), _ack_decoder(PubRel), _ack_decoder(PubComp),
    _decode_subscribe, _decode_suback, _decode_unsubscribe, _ack_decoder(UnsubAck),
    _empty_decoder(PingReq), _empty_decoder(PingResp), _empty_decoder(Disconnect), None,
]  # fmt: skip
# Required low nibble of the first byte per packet type (Table 2.2); PUBLISH's is free.
_FIXED_FLAGS = (0, 0, 0, -1, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0, 0)


# The PUBLISH fast path builds ``Publish`` values through the slot descriptors instead of the
# frozen dataclass ``__init__`` (which goes through ``object.__setattr__`` and
# ``__post_init__``): it is about three times cheaper and a third of the per-packet cost.  The
# decoder performs the same checks itself just before.  If packets.py ever changes the fields,
# fail at import rather than build half-initialised packets.
_PUBLISH_FIELDS = ("topic", "payload", "qos", "retain", "dup", "packet_id")
if tuple(f.name for f in fields(Publish)) != _PUBLISH_FIELDS:  # pragma: no cover
    raise RuntimeError("decoder.py's PUBLISH fast path is out of date with packets.Publish")
_new_publish = Publish.__new__
# The same for the acknowledgements (one field, checked by ``decode_ack``).
if tuple(f.name for f in fields(PubAck)) != ("packet_id",):  # pragma: no cover
    raise RuntimeError("decoder.py's acknowledgement fast path is out of date with packets")
_new_ack = PubAck.__new__
_set_ack_id = PubAck.__mro__[1].__dict__["packet_id"].__set__
_set_topic, _set_payload, _set_qos, _set_retain, _set_dup, _set_packet_id = (
    Publish.__dict__[name].__set__ for name in _PUBLISH_FIELDS
)


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class OnPublish(Protocol[T_co]):
    """What ``next_packet`` hands a decoded PUBLISH to, instead of building a ``Publish``
    (the DUP flag is checked, then dropped: a receiver has no use for it)."""

    def __call__(self, topic: str, payload: bytes, qos: int, retain: bool,
                 packet_id: int | None) -> T_co: ...


class PacketDecoder:
    """Incremental decoder for one connection's inbound byte stream.

    ``max_packet_size`` bounds the *remaining length* (everything after the fixed header),
    matching ``PacketTooLarge``; the default is the protocol maximum.

    Buffering: ``_buf`` is an immutable ``bytes`` so that topic and payload come out of it
    with a single slice each.  When a feed cannot complete the pending packet (``_need`` says
    how many bytes it takes), the chunk is parked in ``_chunks`` without copying and all of
    them are joined once when enough has arrived, so a large packet trickling in costs one
    copy, not one per chunk.
    """

    __slots__ = ("_buf", "_chunks", "_max", "_max_user", "_mqtt31", "_need", "_parked",
                 "_pos")

    def __init__(self, max_packet_size: int = MAX_REMAINING_LENGTH,
                 max_user_properties: int | None = None) -> None:
        #: User properties a v5 CONNECT (and its will) may carry (``decoder5``); None: its
        #: default, ``properties.DEFAULT_MAX_USER_PROPERTIES``.
        self._max_user = max_user_properties
        self._buf = b""
        self._pos = 0
        self._max = max_packet_size
        self._chunks: list[bytes] = []
        self._parked = 0
        self._need = 0
        self._mqtt31 = False

    def speak_mqtt31(self) -> None:
        """The client connected with MQTT 3.1 (MQIsdp), whose PUBREL, SUBSCRIBE and
        UNSUBSCRIBE were QoS 1 packets that a client resends with DUP set (flags 0b1010);
        3.1.1 fixed those flags to 0b0010 [MQTT-3.6.1-1, MQTT-3.8.1-1, MQTT-3.10.1-1]."""
        self._mqtt31 = True

    @property
    def max_packet_size(self) -> int:
        """The limit on a packet's remaining length (what a v5 CONNACK announces)."""
        return self._max

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded (at most one partial packet after draining)."""
        return len(self._buf) - self._pos + self._parked

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes from the transport, in chunks of any size.

        The decoder never keeps a reference to a caller's mutable buffer (a transport may
        reuse it for the next read); only immutable ``bytes`` are parked as they are.
        """
        if not data:
            return
        buf = self._buf
        pos = self._pos
        if len(buf) - pos + self._parked + len(data) < self._need:
            if type(data) is not bytes:
                data = bytes(data)
            self._chunks.append(data)
            self._parked += len(data)
            return
        if self._chunks:
            self._chunks.append(data)
            self._buf = b"".join([memoryview(buf)[pos:], *self._chunks])
            self._chunks.clear()
            self._parked = 0
        elif pos >= len(buf):
            self._buf = bytes(data)  # no copy when it already is bytes
        else:
            self._buf = buf[pos:] + data
        self._pos = 0
        self._need = 0  # met; next_packet states the next requirement when it runs dry

    def __iter__(self) -> Iterator[Packet]:
        """Decoded packets until more data is needed."""
        next_packet = self.next_packet
        while (packet := next_packet()) is not None:
            yield packet

    def next_packet(self, on_publish: OnPublish[T] | None = None,
                    on_puback: Callable[[int], T] | None = None) -> Packet | T | None:
        """The next complete packet, or ``None`` if more bytes are needed.

        ``on_publish`` / ``on_puback``: a server connection's handlers for the two packets
        of every QoS 1 delivery (its client's PUBLISH, and the PUBACK of ours).  Given, the
        decoder hands them the checked fields and returns what they return, instead of
        building a ``Publish`` or ``PubAck`` that would be taken apart again at once: about
        a quarter of a QoS 1 message's protocol cost.  Every check is the same either way.
        """
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
        if first >> 4 != 3:
            if first == 0x40 and on_puback is not None:
                if length != 2:
                    raise MalformedPacket(RULE_LENGTH,
                                          f"PUBACK remaining length must be 2, not {length}")
                packet_id = (buf[start] << 8) | buf[start + 1]
                if not packet_id:
                    raise MalformedPacket("MQTT-2.3.1-1",
                                          "packet identifier must be 1..65535, got 0")
                return on_puback(packet_id)
            return self._decode_other(first, buf, start, stop)

        # PUBLISH fast path.  The bounds checks come first so that no index below can fail.
        qos = (first >> 1) & 0x03
        if length < 2:
            raise _truncated("PUBLISH topic name")
        topic_end = start + 2 + ((buf[start] << 8) | buf[start + 1])
        if qos:
            if qos == 3:
                raise MalformedPacket("MQTT-3.3.1-4", "PUBLISH QoS must not be 3")
            payload_start = topic_end + 2
            if payload_start > stop:
                raise _truncated("PUBLISH topic name and packet identifier")
            packet_id: int | None = (buf[topic_end] << 8) | buf[topic_end + 1]
            if not packet_id:
                raise MalformedPacket("MQTT-2.3.1-1", "PUBLISH packet identifier must not be 0")
        else:
            payload_start = topic_end
            if payload_start > stop:
                raise _truncated("PUBLISH topic name")
            if first & 0x08:
                raise MalformedPacket("MQTT-3.3.1-2", "DUP must be 0 for QoS 0 messages")
            packet_id = None
        try:
            topic = buf[start + 2 : topic_end].decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPacket("MQTT-1.5.3-1", "topic name is not well-formed UTF-8") from None
        if not topic:
            raise InvalidTopic("MQTT-4.7.3-1", "PUBLISH topic name must not be empty")
        if "+" in topic or "#" in topic:
            raise InvalidTopic("MQTT-3.3.2-2", f"topic name must not contain wildcards: {topic!r}")
        if "\x00" in topic:
            raise MalformedPacket("MQTT-1.5.3-2", f"topic name must not contain U+0000: {topic!r}")
        if on_publish is not None:
            return on_publish(topic, buf[payload_start:stop], qos, first & 0x01 == 1, packet_id)
        packet = _new_publish(Publish)
        _set_topic(packet, topic)
        _set_payload(packet, buf[payload_start:stop])
        _set_qos(packet, qos)
        _set_retain(packet, first & 0x01 == 1)
        _set_dup(packet, first & 0x08 == 8)
        _set_packet_id(packet, packet_id)
        return packet

    def _decode_other(self, first: int, buf: bytes, start: int, stop: int) -> Packet:
        packet_type = first >> 4
        decoder = _DECODERS[packet_type]
        if decoder is None:
            raise MalformedPacket("MQTT-2.2.1", f"reserved packet type {packet_type}")
        if first & 0x0F != _FIXED_FLAGS[packet_type] and not (
                self._mqtt31 and first & 0x0F == 0x0A and _FIXED_FLAGS[packet_type] == 2):
            raise MalformedPacket(
                RULE_FLAGS,
                f"invalid fixed header flags {first & 0x0F:#06b} for type {packet_type}",
            )
        if decoder is _decode_connect:
            return _decode_connect(first & 0x0F, buf, start, stop, self._max_user)
        return decoder(first & 0x0F, buf, start, stop)

    def _long_length(self, buf: bytes, pos: int, end: int) -> tuple[int, int]:
        """Multi-byte remaining length: ``(length, body_start)``, or ``(-1, -1)`` if partial.

        A partial field is still checked against the limit: its value so far is a lower bound
        on the final one, so an over-size announcement is refused before more is buffered.
        """
        length = 0
        multiplier = 1
        index = pos + 1
        for _ in range(4):
            if index >= end:
                if length > self._max:
                    raise PacketTooLarge(
                        RULE_LENGTH,
                        f"remaining length >= {length} exceeds the limit of {self._max}",
                    )
                return -1, -1
            byte = buf[index]
            index += 1
            length += (byte & 0x7F) * multiplier
            if byte < 128:
                return length, index
            multiplier <<= 7
        raise MalformedPacket(RULE_LENGTH, "remaining length field longer than 4 bytes")


def decode(data: bytes, max_packet_size: int = MAX_REMAINING_LENGTH) -> Packet:
    """Exactly one packet from ``data``; incomplete input or leftovers are malformed."""
    decoder = PacketDecoder(max_packet_size)
    decoder.feed(data)
    packet = decoder.next_packet()
    if packet is None:
        raise MalformedPacket(RULE_LENGTH, f"incomplete packet ({len(data)} bytes)")
    if decoder.buffered:
        raise MalformedPacket(RULE_LENGTH, f"{decoder.buffered} bytes after the packet")
    return packet
