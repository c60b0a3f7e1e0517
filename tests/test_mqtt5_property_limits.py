"""MQTT 5.0 property sets the sans-IO decoder must refuse: too many User Properties (an
implementation limit, 0x97, checked while reading so that a refused packet costs at most the
limit), a Response Topic that is empty or holds a wildcard (0x82), Authentication Data
without an Authentication Method (0x82) and Variable Byte Integers not in their shortest
encoding (0x81).  No sockets: bytes in, packets, errors or bytes out."""

from __future__ import annotations

import pytest

from mqttring.protocol.codec import PacketDecoder
from mqttring.protocol.codec5 import PacketDecoder5, decode5, encode5
from mqttring.protocol.connection import ConnectRequested, ServerConnection
from mqttring.protocol.connection5 import ServerLimits5
from mqttring.protocol.errors import MQTTError
from mqttring.protocol.packets5 import ConnAck5, Connect5, Disconnect5, Publish5, Will5
from mqttring.protocol.properties import (
    Properties,
    PropertyId,
    decode_properties,
    decode_vbi,
    encode_properties,
    encode_vbi,
)
from mqttring.protocol.session import Session

P = PropertyId

#: ``limits.max_user_properties``' default.
LIMIT = 128


def _user_props(count: int) -> bytes:
    """``count`` User Properties k=v, without the set's length."""
    return b"\x26\x00\x01k\x00\x01v" * count


def _set(body: bytes) -> bytes:
    return encode_vbi(len(body)) + body


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_vbi(len(body)) + body


def _connect(props: bytes, will: bytes | None = None, client_id: bytes = b"c") -> bytes:
    """A v5 CONNECT with the raw property set body ``props`` (and a will with ``will``)."""
    flags = 0x02 | (0x04 if will is not None else 0)
    body = b"\x00\x04MQTT\x05" + bytes((flags,)) + b"\x00\x3c" + _set(props)
    body += len(client_id).to_bytes(2, "big") + client_id
    if will is not None:
        body += _set(will) + b"\x00\x03w/t" + b"\x00\x01x"
    return _packet(0x10, body)


def _publish(props: bytes, topic: bytes = b"t") -> bytes:
    return _packet(0x30, len(topic).to_bytes(2, "big") + topic + _set(props) + b"x")


def _refused(data: bytes, code: int, **decoder: int) -> MQTTError:
    with pytest.raises(MQTTError) as info:
        decode5(data, **decoder)
    assert info.value.reason_code == code, info.value
    return info.value


# -- user properties ----------------------------------------------------------------------


def test_user_properties_up_to_the_limit_decode() -> None:
    packet = decode5(_publish(_user_props(LIMIT)))
    assert isinstance(packet, Publish5)
    assert packet.properties.get_all(P.USER_PROPERTY) == [("k", "v")] * LIMIT


@pytest.mark.parametrize(("name", "data"), [
    ("PUBLISH", _publish(_user_props(LIMIT + 1))),
    ("PUBACK", _packet(0x40, b"\x00\x01\x00" + _set(_user_props(LIMIT + 1)))),
    ("PUBREC", _packet(0x50, b"\x00\x01\x00" + _set(_user_props(LIMIT + 1)))),
    ("PUBREL", _packet(0x62, b"\x00\x01\x00" + _set(_user_props(LIMIT + 1)))),
    ("PUBCOMP", _packet(0x70, b"\x00\x01\x00" + _set(_user_props(LIMIT + 1)))),
    ("SUBSCRIBE", _packet(0x82, b"\x00\x01" + _set(_user_props(LIMIT + 1)) + b"\x00\x01a\x00")),
    ("UNSUBSCRIBE", _packet(0xA2, b"\x00\x01" + _set(_user_props(LIMIT + 1)) + b"\x00\x01a")),
    ("DISCONNECT", _packet(0xE0, b"\x00" + _set(_user_props(LIMIT + 1)))),
    ("AUTH", _packet(0xF0, b"\x00" + _set(_user_props(LIMIT + 1)))),
    ("CONNECT", _connect(_user_props(LIMIT + 1))),
    ("WILL", _connect(b"", will=_user_props(LIMIT + 1))),
    ("CONNACK", _packet(0x20, b"\x00\x00" + _set(_user_props(LIMIT + 1)))),
], ids=lambda value: value if isinstance(value, str) else "")
def test_one_user_property_past_the_limit_is_quota_exceeded(name: str, data: bytes) -> None:
    """Every packet that may carry user properties, and the will: 0x97 [section 2.4]."""
    _refused(data, 0x97)


def test_a_connect_and_its_will_are_counted_apart() -> None:
    packet = decode5(_connect(_user_props(LIMIT), will=_user_props(LIMIT)))
    assert isinstance(packet, Connect5) and packet.will is not None
    assert len(packet.properties) == len(packet.will.properties) == LIMIT


def test_the_count_is_checked_while_reading() -> None:
    """What follows the property past the limit is never read: a refused set costs at most
    the limit's worth of work, not the packet's (140,000 of them fit 1 MiB)."""
    garbage = b"\x26\xff\xff" + b"\xff" * 64  # a user property running past the set
    with pytest.raises(MQTTError) as info:
        decode_properties(_set(_user_props(LIMIT + 1) + garbage), 0, 10**6, "PUBLISH",
                          LIMIT)
    assert info.value.reason_code == 0x97
    # Without the limit the same set is read to its end, and the garbage found.
    with pytest.raises(MQTTError) as info:
        decode_properties(_set(_user_props(LIMIT + 1) + garbage), 0, 10**6, "PUBLISH")
    assert info.value.reason_code == 0x81


def test_the_limit_is_the_decoders() -> None:
    _refused(_publish(_user_props(5)), 0x97, max_user_properties=4)
    assert len(decode5(_publish(_user_props(500)), max_user_properties=500).properties) == 500
    decoder = PacketDecoder(max_user_properties=4)  # the 3.1.1 decoder reads every CONNECT
    decoder.feed(_connect(_user_props(5)))
    with pytest.raises(MQTTError) as info:
        decoder.next_packet()
    assert info.value.reason_code == 0x97


def test_subscription_identifiers_in_a_publish_are_bounded_too() -> None:
    """The other property a PUBLISH may repeat (one per matching subscription)."""
    assert len(decode5(_publish(b"\x0b\x01" * LIMIT)).properties) == LIMIT
    _refused(_publish(b"\x0b\x01" * (LIMIT + 1)), 0x97)


def _connection(limits: ServerLimits5 | None = None) -> ServerConnection:
    return ServerConnection(10**6, limits) if limits else ServerConnection(10**6)


def _sent(conn: ServerConnection) -> list[object]:
    decoder = PacketDecoder5()
    decoder.feed(conn.data_to_send())
    return list(decoder)


def test_connection_refuses_a_connect_over_the_limit_with_connack_0x97() -> None:
    conn = _connection()
    with pytest.raises(MQTTError):
        conn.receive_data(_connect(_user_props(LIMIT + 1)))
    [connack] = _sent(conn)
    assert isinstance(connack, ConnAck5) and connack.reason_code == 0x97, connack
    assert "user properties" in str(connack.properties.get(P.REASON_STRING))


def test_connection_disconnects_a_publish_over_the_configured_limit_with_0x97() -> None:
    conn = _connection(ServerLimits5(max_user_properties=4))
    events = conn.receive_data(_connect(_user_props(4), will=_user_props(4)))
    assert isinstance(events[0], ConnectRequested)
    conn.accept(Session("c", True), False)
    _sent(conn)  # the CONNACK
    conn.receive_data(_publish(_user_props(4)))
    with pytest.raises(MQTTError):
        conn.receive_data(_publish(_user_props(5)))
    [disconnect] = _sent(conn)
    assert isinstance(disconnect, Disconnect5) and disconnect.reason_code == 0x97


# -- response topic ------------------------------------------------------------------------


@pytest.mark.parametrize("topic", [b"r/+", b"r/#", b"+", b"#", b"a/+/b", b""],
                         ids=["r/+", "r/#", "+", "#", "a/+/b", "empty"])
def test_a_response_topic_must_be_a_topic_name(topic: bytes) -> None:
    """No wildcards [MQTT-3.3.2-14], at least one character [MQTT-4.7.3-1]: 0x82."""
    prop = b"\x08" + len(topic).to_bytes(2, "big") + topic
    _refused(_publish(prop), 0x82)
    with pytest.raises(MQTTError) as info:  # in a will: no session, no CONNACK
        decode5(_connect(b"", will=prop))
    assert info.value.reason_code == 0x82
    with pytest.raises(MQTTError):  # nor does the encoder write one
        encode_properties(Properties([(P.RESPONSE_TOPIC, topic.decode())]), "PUBLISH")


def test_a_response_topic_without_wildcards_decodes() -> None:
    packet = decode5(_publish(b"\x08\x00\x07reply/x"))
    assert packet.properties.get(P.RESPONSE_TOPIC) == "reply/x"  # type: ignore[union-attr]


# -- authentication data -------------------------------------------------------------------


def test_authentication_data_without_a_method_is_a_protocol_error() -> None:
    """Section 3.1.2.11.10: a Protocol Error, answered CONNACK 0x82."""
    data = _connect(b"\x16\x00\x06secret")
    _refused(data, 0x82)
    conn = _connection()
    with pytest.raises(MQTTError):
        conn.receive_data(data)
    [connack] = _sent(conn)
    assert isinstance(connack, ConnAck5) and connack.reason_code == 0x82, connack
    with pytest.raises(MQTTError):  # and such a CONNECT is never built
        Connect5("c", properties=Properties([(P.AUTHENTICATION_DATA, b"x")]))


def test_authentication_data_with_a_method_decodes() -> None:
    packet = decode5(_connect(b"\x15\x00\x01m\x16\x00\x01d"))
    assert isinstance(packet, Connect5)
    assert packet.properties.get(P.AUTHENTICATION_DATA) == b"d"


# -- variable byte integers ----------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"\x80\x00", b"\x81\x00", b"\xff\x80\x00", b"\x80\x80\x80\x00"],
                         ids=["0-in-2", "1-in-2", "127-in-3", "0-in-4"])
def test_a_variable_byte_integer_must_be_minimal(raw: bytes) -> None:
    with pytest.raises(MQTTError) as info:
        decode_vbi(raw, 0, len(raw), "test")
    assert info.value.reason_code == 0x81 and "MQTT-1.5.5-1" in str(info.value)


@pytest.mark.parametrize(("raw", "value"), [(b"\x00", 0), (b"\x7f", 127), (b"\x80\x01", 128),
                                            (b"\xff\xff\xff\x7f", 268_435_455)])
def test_minimal_variable_byte_integers_decode(raw: bytes, value: int) -> None:
    assert decode_vbi(raw, 0, len(raw), "test") == (value, len(raw))


@pytest.mark.parametrize(("name", "data"), [
    ("PUBLISH property length", _packet(0x30, b"\x00\x01t\x80\x00x")),
    ("CONNECT property length",
     _packet(0x10, b"\x00\x04MQTT\x05\x02\x00\x3c\x80\x00\x00\x01c")),
    ("subscription identifier", _packet(0x82, b"\x00\x01\x03\x0b\x81\x00\x00\x01a\x00")),
], ids=lambda value: value if isinstance(value, str) else "")
def test_non_minimal_variable_byte_integers_are_malformed(name: str, data: bytes) -> None:
    """[MQTT-1.5.5-1], as the Remaining Length already was: 0x81."""
    _refused(data, 0x81)


def test_round_trip_of_a_valid_will_with_response_topic() -> None:
    will = Will5("w/t", b"x", 1, False, Properties([(P.RESPONSE_TOPIC, "r/t")]))
    packet = Connect5("c", will=will)
    assert decode5(encode5(packet)) == packet
