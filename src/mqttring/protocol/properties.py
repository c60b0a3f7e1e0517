"""MQTT 5.0 properties (section 2.2.2) and reason codes (section 2.4), without I/O.

Theory of operation
-------------------
A v5 packet carries a *property set*: a Variable Byte Integer length, then identifier/value
pairs.  ``PROPERTY_SPECS`` is Table 2-4 of the specification as data: each identifier's
type, the packets (and the will) that may carry it, and whether it may appear more than
once.  ``decode_properties`` checks every rule that depends only on the set itself (unknown
identifier, wrong packet, duplicate of a unique property, value out of range, malformed
UTF-8 or a length running past the set, a wildcard or empty Response Topic) and raises the
codec's own ``MalformedPacket`` / ``ProtocolViolation`` carrying the reason code the
specification assigns (0x81 malformed, 0x82 protocol error).  It also enforces the one
limit of ours on a set, ``max_user`` (``limits.max_user_properties``), while reading, so
that no packet costs more to refuse than that many properties (``QuotaExceeded``, 0x97).
Rules that need connection state (a topic alias above the maximum the server announced)
belong to ``mqttring.protocol.connection``.

``Properties`` keeps identifier/value pairs in wire order (user properties are ordered and
repeatable [MQTT-3.3.2-18]); it is immutable and compares by value, so packets holding it
stay frozen values.  ``encode_properties`` is the inverse and refuses what the decoder
would refuse, so ``decode(encode(p)) == p``.

Nothing here is on the MQTT 3.1.1 path: a 3.1.1 connection never builds a property set.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from struct import Struct

from mqttring.protocol.errors import MalformedPacket, MQTTError, ProtocolViolation

_U16 = Struct(">H")
_U32 = Struct(">I")

#: Largest value of a Variable Byte Integer (section 1.5.5).
MAX_VBI = 268_435_455


class ReasonCode(IntEnum):
    """Section 2.4, Table 2-6 (codes < 0x80 succeed, >= 0x80 fail)."""

    SUCCESS = 0x00  # also "normal disconnection" and "granted QoS 0"
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


def _codes(*values: int) -> frozenset[int]:
    return frozenset(values)


#: Reason codes each packet may carry (the "Packets" column of Table 2-6).
VALID_REASONS: dict[str, frozenset[int]] = {
    "CONNACK": _codes(0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89,
                      0x8A, 0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F),
    "PUBACK": _codes(0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99),
    "PUBREC": _codes(0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99),
    "PUBREL": _codes(0x00, 0x92),
    "PUBCOMP": _codes(0x00, 0x92),
    "SUBACK": _codes(0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2),
    "UNSUBACK": _codes(0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91),
    "DISCONNECT": _codes(0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E,
                         0x8F, 0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B,
                         0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2),
    "AUTH": _codes(0x00, 0x18, 0x19),
}


def check_reason(packet: str, code: int) -> None:
    """Refuse a reason code the packet may not carry [MQTT-2.4] (malformed, 0x81)."""
    if code not in VALID_REASONS[packet]:
        raise MalformedPacket("MQTT-2.4", f"reason code {code:#04x} is not valid in {packet}")


class PropertyId(IntEnum):
    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


class PropType(IntEnum):
    BYTE = 1
    U16 = 2
    U32 = 3
    VBI = 4
    STRING = 5
    BINARY = 6
    STRING_PAIR = 7


#: Where a property may appear: packet names, plus "WILL" for the will properties.
_ALL_WITH_USER = frozenset({
    "CONNECT", "CONNACK", "PUBLISH", "WILL", "PUBACK", "PUBREC", "PUBREL", "PUBCOMP",
    "SUBSCRIBE", "SUBACK", "UNSUBSCRIBE", "UNSUBACK", "DISCONNECT", "AUTH",
})
_PUB_WILL = frozenset({"PUBLISH", "WILL"})
_REASON_STRING_IN = frozenset({
    "CONNACK", "PUBACK", "PUBREC", "PUBREL", "PUBCOMP", "SUBACK", "UNSUBACK", "DISCONNECT",
    "AUTH",
})

P = PropertyId
T = PropType

#: Table 2-4: identifier -> (type, packets that may carry it, may repeat).  Only user
#: properties repeat everywhere; subscription identifiers repeat in PUBLISH only
#: [MQTT-3.3.4-3/3.8.2.1.2], which ``decode_properties`` special-cases.
PROPERTY_SPECS: dict[int, tuple[PropType, frozenset[str], bool]] = {
    P.PAYLOAD_FORMAT_INDICATOR: (T.BYTE, _PUB_WILL, False),
    P.MESSAGE_EXPIRY_INTERVAL: (T.U32, _PUB_WILL, False),
    P.CONTENT_TYPE: (T.STRING, _PUB_WILL, False),
    P.RESPONSE_TOPIC: (T.STRING, _PUB_WILL, False),
    P.CORRELATION_DATA: (T.BINARY, _PUB_WILL, False),
    P.SUBSCRIPTION_IDENTIFIER: (T.VBI, frozenset({"PUBLISH", "SUBSCRIBE"}), False),
    P.SESSION_EXPIRY_INTERVAL: (T.U32, frozenset({"CONNECT", "CONNACK", "DISCONNECT"}), False),
    P.ASSIGNED_CLIENT_IDENTIFIER: (T.STRING, frozenset({"CONNACK"}), False),
    P.SERVER_KEEP_ALIVE: (T.U16, frozenset({"CONNACK"}), False),
    P.AUTHENTICATION_METHOD: (T.STRING, frozenset({"CONNECT", "CONNACK", "AUTH"}), False),
    P.AUTHENTICATION_DATA: (T.BINARY, frozenset({"CONNECT", "CONNACK", "AUTH"}), False),
    P.REQUEST_PROBLEM_INFORMATION: (T.BYTE, frozenset({"CONNECT"}), False),
    P.WILL_DELAY_INTERVAL: (T.U32, frozenset({"WILL"}), False),
    P.REQUEST_RESPONSE_INFORMATION: (T.BYTE, frozenset({"CONNECT"}), False),
    P.RESPONSE_INFORMATION: (T.STRING, frozenset({"CONNACK"}), False),
    P.SERVER_REFERENCE: (T.STRING, frozenset({"CONNACK", "DISCONNECT"}), False),
    P.REASON_STRING: (T.STRING, _REASON_STRING_IN, False),
    P.RECEIVE_MAXIMUM: (T.U16, frozenset({"CONNECT", "CONNACK"}), False),
    P.TOPIC_ALIAS_MAXIMUM: (T.U16, frozenset({"CONNECT", "CONNACK"}), False),
    P.TOPIC_ALIAS: (T.U16, frozenset({"PUBLISH"}), False),
    P.MAXIMUM_QOS: (T.BYTE, frozenset({"CONNACK"}), False),
    P.RETAIN_AVAILABLE: (T.BYTE, frozenset({"CONNACK"}), False),
    P.USER_PROPERTY: (T.STRING_PAIR, _ALL_WITH_USER, True),
    P.MAXIMUM_PACKET_SIZE: (T.U32, frozenset({"CONNECT", "CONNACK"}), False),
    P.WILDCARD_SUBSCRIPTION_AVAILABLE: (T.BYTE, frozenset({"CONNACK"}), False),
    P.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (T.BYTE, frozenset({"CONNACK"}), False),
    P.SHARED_SUBSCRIPTION_AVAILABLE: (T.BYTE, frozenset({"CONNACK"}), False),
}

#: ``PROPERTY_SPECS`` as the decoder reads it: identifier -> (member, type, packets, may
#: repeat), so that decoding a property builds no ``PropertyId`` from an int.
_DECODE_SPECS: dict[int, tuple[PropertyId, PropType, frozenset[str], bool]] = {
    int(ident): (PropertyId(ident), *spec) for ident, spec in PROPERTY_SPECS.items()
}

#: Default of ``limits.max_user_properties`` (``mqttring.config.Limits``): User
#: Properties accepted in one packet (or will).  The specification sets no bound, yet
#: each costs the decoder a few microseconds and a tuple: 140,000 of them fit the default
#: 1 MiB packet and held the event loop for seconds.  Clients seen in practice send a
#: handful (tracing ids, content metadata); 128 leaves room for that many times over and
#: bounds a refused packet's cost to well under a millisecond.
DEFAULT_MAX_USER_PROPERTIES = 128


class QuotaExceeded(MQTTError):
    """An implementation limit of this broker, not a rule of the protocol, refused the
    packet: the peer is told Quota exceeded (0x97), which section 2.4 defines as "an
    implementation or administrative imposed limit has been exceeded"; 0x95 (Packet too
    large) would be wrong, since the packet fits the Maximum Packet Size we announced."""

    default_reason_code = 0x97


#: Byte properties whose value must be 0 or 1 (a 2 is a protocol error, section 3.x).
_BOOLEAN_BYTES = frozenset({
    P.PAYLOAD_FORMAT_INDICATOR, P.REQUEST_PROBLEM_INFORMATION, P.REQUEST_RESPONSE_INFORMATION,
    P.MAXIMUM_QOS, P.RETAIN_AVAILABLE, P.WILDCARD_SUBSCRIPTION_AVAILABLE,
    P.SUBSCRIPTION_IDENTIFIER_AVAILABLE, P.SHARED_SUBSCRIPTION_AVAILABLE,
})
#: Properties for which 0 is a protocol error.
_NONZERO = frozenset({P.RECEIVE_MAXIMUM, P.MAXIMUM_PACKET_SIZE, P.SUBSCRIPTION_IDENTIFIER})

PropValue = int | str | bytes | tuple[str, str]


class Properties:
    """An immutable property set: ``(PropertyId, value)`` pairs in wire order."""

    __slots__ = ("items",)

    items: tuple[tuple[PropertyId, PropValue], ...]

    def __init__(self, items: Iterable[tuple[PropertyId | int, PropValue]] = ()) -> None:
        object.__setattr__(self, "items", tuple((PropertyId(k), v) for k, v in items))

    @classmethod
    def _trusted(cls, items: tuple[tuple[PropertyId, PropValue], ...]) -> Properties:
        """A set over pairs whose keys are ``PropertyId`` already (``decode_properties``):
        ``__init__`` would convert each key again, a cost per property."""
        self = object.__new__(cls)
        object.__setattr__(self, "items", items)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Properties is immutable")

    def get(self, prop: PropertyId, default: PropValue | None = None) -> PropValue | None:
        """The first value of ``prop`` (the only one for a unique property)."""
        for key, value in self.items:
            if key == prop:
                return value
        return default

    def get_all(self, prop: PropertyId) -> list[PropValue]:
        return [value for key, value in self.items if key == prop]

    def without(self, *props: PropertyId) -> Properties:
        return Properties((k, v) for k, v in self.items if k not in props)

    def __contains__(self, prop: object) -> bool:
        return any(key == prop for key, _ in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Properties):
            return NotImplemented
        return self.items == other.items

    def __hash__(self) -> int:
        return hash(self.items)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k.name}={v!r}" for k, v in self.items)
        return f"Properties({inner})"


NO_PROPERTIES = Properties()


# ------------------------------------------------------------------ variable byte integers


def encode_vbi(value: int) -> bytes:
    """Section 1.5.5; values past ``MAX_VBI`` are our bug (ValueError)."""
    if not 0 <= value <= MAX_VBI:
        raise ValueError(f"variable byte integer out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_vbi(buf: bytes, offset: int, stop: int, what: str) -> tuple[int, int]:
    """``(value, next offset)``; at most 4 bytes, never past ``stop``.

    The encoding must be the shortest one [MQTT-1.5.5-1]: a last byte of 0 after a
    continuation byte (``80 00`` for 0) is refused as malformed, as the decoder already
    refuses it in the Remaining Length, so that one value has one encoding everywhere.
    """
    value = 0
    shift = 0
    for _ in range(4):
        if offset >= stop:
            raise MalformedPacket("MQTT-2.2.3", f"{what} runs past the packet's end")
        byte = buf[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if byte < 128:
            if not byte and shift:
                raise MalformedPacket("MQTT-1.5.5-1", f"{what}: variable byte integer not "
                                                      "in its shortest encoding")
            return value, offset
        shift += 7
    raise MalformedPacket("MQTT-1.5.5-1", f"{what}: variable byte integer longer than 4 bytes")


# ------------------------------------------------------------------------------- encoding


def _enc_str(value: str, what: str) -> bytes:
    if "\x00" in value:
        raise MalformedPacket("MQTT-1.5.4-2", f"{what} must not contain U+0000")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedPacket("MQTT-1.5.4-1", f"{what} is not well-formed UTF-8") from None
    if len(raw) > 0xFFFF:
        raise MalformedPacket("MQTT-1.5.4", f"{what} longer than 65535 bytes")
    return _U16.pack(len(raw)) + raw


def _enc_value(prop: PropertyId, kind: PropType, value: PropValue) -> bytes:
    name = prop.name
    if kind is T.STRING_PAIR:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(f"{name} wants a (name, value) pair, got {value!r}")
        return _enc_str(value[0], name) + _enc_str(value[1], name)
    if kind is T.STRING:
        if not isinstance(value, str):
            raise TypeError(f"{name} wants a str, got {value!r}")
        return _enc_str(value, name)
    if kind is T.BINARY:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"{name} wants bytes, got {value!r}")
        if len(value) > 0xFFFF:
            raise MalformedPacket("MQTT-1.5.6", f"{name} longer than 65535 bytes")
        return _U16.pack(len(value)) + bytes(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} wants an int, got {value!r}")
    _check_int(prop, value)
    if kind is T.BYTE:
        if not 0 <= value <= 0xFF:
            raise ValueError(f"{name} out of range: {value}")
        return bytes((value,))
    if kind is T.U16:
        if not 0 <= value <= 0xFFFF:
            raise ValueError(f"{name} out of range: {value}")
        return _U16.pack(value)
    if kind is T.U32:
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{name} out of range: {value}")
        return _U32.pack(value)
    return encode_vbi(value)


def encode_properties(props: Properties, packet: str) -> bytes:
    """The property set of ``packet`` (a Table 2-4 name or "WILL"), length first.

    Refuses, with the decoder's errors, a property the packet may not carry or a repeated
    unique one, so that whatever it encodes decodes back to the same value.
    """
    if not props.items:
        return b"\x00"
    body = encode_property_body(props, packet)
    return encode_vbi(len(body)) + body


def encode_property_body(props: Properties, packet: str) -> bytes:
    """``encode_properties`` without the length in front (for splicing sets together)."""
    parts: list[bytes] = []
    seen: set[int] = set()
    for prop, value in props.items:
        kind, where, repeats = PROPERTY_SPECS[prop]
        _check_place(prop, where, repeats, packet, seen)
        if prop is P.RESPONSE_TOPIC and isinstance(value, str):
            _check_response_topic(value)
        parts.append(bytes((prop,)))
        parts.append(_enc_value(prop, kind, value))
    return b"".join(parts)


# ------------------------------------------------------------------------------- decoding


def _check_place(prop: PropertyId, where: frozenset[str], repeats: bool, packet: str,
                 seen: set[int]) -> None:
    if packet not in where:
        raise MalformedPacket("MQTT-2.2.2.2", f"{prop.name} is not allowed in {packet}")
    if prop in seen and not repeats and not (
            prop == P.SUBSCRIPTION_IDENTIFIER and packet == "PUBLISH"):
        raise ProtocolViolation("MQTT-2.2.2.2", f"{prop.name} must not appear twice")
    seen.add(prop)


def _check_int(prop: PropertyId, value: int) -> None:
    if prop in _BOOLEAN_BYTES and value > 1:
        raise ProtocolViolation("MQTT-2.2.2.2", f"{prop.name} must be 0 or 1, got {value}")
    if prop in _NONZERO and value == 0:
        raise ProtocolViolation("MQTT-2.2.2.2", f"{prop.name} must not be 0")


def _dec_str(buf: bytes, offset: int, stop: int, what: str) -> tuple[str, int]:
    if offset + 2 > stop:
        raise MalformedPacket("MQTT-2.2.2", f"{what} runs past the property set")
    end = offset + 2 + ((buf[offset] << 8) | buf[offset + 1])
    if end > stop:
        raise MalformedPacket("MQTT-2.2.2", f"{what} runs past the property set")
    try:
        value = buf[offset + 2:end].decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedPacket("MQTT-1.5.4-1", f"{what} is not well-formed UTF-8") from None
    if "\x00" in value:
        raise MalformedPacket("MQTT-1.5.4-2", f"{what} must not contain U+0000")
    return value, end


def _check_response_topic(topic: str) -> None:
    """A Response Topic is a topic name that a responder will publish to: never empty
    [MQTT-4.7.3-1], never a wildcard [MQTT-3.3.2-14].  The client broke a rule of the
    protocol, so both are a Protocol Error (0x82); mosquitto 2.0.11 relays them."""
    if not topic:
        raise ProtocolViolation("MQTT-4.7.3-1", "the Response Topic must not be empty")
    if "+" in topic or "#" in topic:
        raise ProtocolViolation("MQTT-3.3.2-14", "the Response Topic must not contain "
                                                 f"wildcards: {topic!r}")


def decode_properties(buf: bytes, offset: int, stop: int, packet: str,
                      max_user: int | None = None) -> tuple[Properties, int]:
    """The property set at ``offset`` of ``packet``: ``(properties, offset after it)``.

    ``max_user``: the most User Properties (and, in a PUBLISH, Subscription Identifiers,
    the other property that may repeat) accepted in the set; one more raises
    ``QuotaExceeded`` (0x97) as soon as it is read, so a refused set costs at most
    ``max_user`` properties' work, however many the packet holds.  None: no limit (for
    sets this node encoded itself, such as a stored will's).

    The loop is the hot path of every v5 packet and of an attacker's 100,000-property
    PUBLISH alike: identifiers come from ``_DECODE_SPECS`` (no enum built per property),
    a one-byte identifier skips ``decode_vbi``, a user property is decoded inline, and the
    result is wrapped without re-checking each identifier (``Properties._trusted``).
    """
    length, offset = decode_vbi(buf, offset, stop, f"{packet} property length")
    end = offset + length
    if end > stop:
        raise MalformedPacket("MQTT-2.2.2", f"{packet} property length {length} runs past "
                                            "the packet's end")
    if not length:
        return NO_PROPERTIES, end
    limit = MAX_VBI if max_user is None else max_user
    users = sub_ids = 0
    items: list[tuple[PropertyId, PropValue]] = []
    append = items.append
    seen: set[int] = set()
    specs = _DECODE_SPECS
    while offset < end:
        # The identifier is a Variable Byte Integer, but every defined one fits a byte.
        ident = buf[offset]
        if ident < 0x80:
            offset += 1
        else:
            ident, offset = decode_vbi(buf, offset, end, "property identifier")
        spec = specs.get(ident)
        if spec is None:
            raise MalformedPacket("MQTT-2.2.2.2", f"unknown property identifier {ident:#x}")
        prop, kind, where, repeats = spec
        value: PropValue
        if kind is T.STRING_PAIR:
            # User Property (every packet and the will may carry it, any number of times).
            users += 1
            if users > limit:
                raise QuotaExceeded("MQTT-2.2.2.2", f"more than {limit} user properties in "
                                                    f"{packet} (limits.max_user_properties)")
            if packet not in where:
                raise MalformedPacket("MQTT-2.2.2.2", f"{prop.name} is not allowed in {packet}")
            if offset + 2 > end:
                raise MalformedPacket("MQTT-2.2.2", "user property name runs past the "
                                                    "property set")
            mid = offset + 2 + ((buf[offset] << 8) | buf[offset + 1])
            if mid + 2 > end:
                raise MalformedPacket("MQTT-2.2.2", "user property runs past the property set")
            after = mid + 2 + ((buf[mid] << 8) | buf[mid + 1])
            if after > end:
                raise MalformedPacket("MQTT-2.2.2", "user property value runs past the "
                                                    "property set")
            try:
                key = buf[offset + 2:mid].decode("utf-8")
                val = buf[mid + 2:after].decode("utf-8")
            except UnicodeDecodeError:
                raise MalformedPacket("MQTT-1.5.4-1", "user property is not well-formed "
                                                      "UTF-8") from None
            if "\x00" in key or "\x00" in val:
                raise MalformedPacket("MQTT-1.5.4-2", "user property must not contain U+0000")
            append((prop, (key, val)))
            offset = after
            continue
        _check_place(prop, where, repeats, packet, seen)
        if kind is T.BYTE:
            if offset >= end:
                raise MalformedPacket("MQTT-2.2.2", f"{prop.name} runs past the property set")
            value = buf[offset]
            offset += 1
            _check_int(prop, value)
        elif kind is T.U16:
            if offset + 2 > end:
                raise MalformedPacket("MQTT-2.2.2", f"{prop.name} runs past the property set")
            value = (buf[offset] << 8) | buf[offset + 1]
            offset += 2
            _check_int(prop, value)
        elif kind is T.U32:
            if offset + 4 > end:
                raise MalformedPacket("MQTT-2.2.2", f"{prop.name} runs past the property set")
            value = _U32.unpack_from(buf, offset)[0]
            offset += 4
            _check_int(prop, value)
        elif kind is T.VBI:
            # Subscription Identifier, the one repeatable property besides User Property
            # (in a PUBLISH: one per matching subscription).
            sub_ids += 1
            if sub_ids > limit:
                raise QuotaExceeded("MQTT-2.2.2.2", f"more than {limit} subscription "
                                    f"identifiers in {packet} (limits.max_user_properties)")
            value, offset = decode_vbi(buf, offset, end, prop.name)
            _check_int(prop, value)
        elif kind is T.STRING:
            value, offset = _dec_str(buf, offset, end, prop.name)
            if prop is P.RESPONSE_TOPIC:
                _check_response_topic(value)
        else:  # T.BINARY
            if offset + 2 > end:
                raise MalformedPacket("MQTT-2.2.2", f"{prop.name} runs past the property set")
            stop_bin = offset + 2 + ((buf[offset] << 8) | buf[offset + 1])
            if stop_bin > end:
                raise MalformedPacket("MQTT-2.2.2", f"{prop.name} runs past the property set")
            value = bytes(buf[offset + 2:stop_bin])
            offset = stop_bin
        append((prop, value))
    return Properties._trusted(tuple(items)), end
