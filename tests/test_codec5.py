"""The MQTT 5.0 codec (``codec5``, ``decoder5``, ``properties``): golden bytes for every
packet and every property, round trips, and bad input raising only the codec's errors with
the reason code the specification assigns."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqttring.protocol.codec import PacketDecoder, decode
from mqttring.protocol.codec5 import PacketDecoder5, decode5, encode5
from mqttring.protocol.errors import MalformedPacket, MQTTError, ProtocolViolation
from mqttring.protocol.packets import PingReq, PingResp
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
    SubAck5,
    SubOptions,
    Subscribe5,
    UnsubAck5,
    Unsubscribe5,
    Will5,
)
from mqttring.protocol.properties import (
    PROPERTY_SPECS,
    Properties,
    PropertyId,
    PropType,
    decode_properties,
    encode_properties,
)

P = PropertyId


def props(*items: tuple[PropertyId, object]) -> Properties:
    return Properties(items)  # type: ignore[arg-type]


GOLDEN: list[tuple[object, str]] = [
    (Connect5("c1", True, 30, Will5("w/t", b"bye", 1, False, props((P.WILL_DELAY_INTERVAL, 5))),
              "u", b"p", props((P.SESSION_EXPIRY_INTERVAL, 60), (P.USER_PROPERTY, ("a", "b")))),
     "103100044d51545405ce001e0c110000003c2600016100016200026331051800000005"
     "0003772f740003627965000175000170"),
    (Connect5("", False, 0), "100d00044d51545405000000000000"),
    (ConnAck5(True, 0, props((P.RECEIVE_MAXIMUM, 10))), "200601000321000a"),
    (ConnAck5(False, 0x8C), "2003008c00"),
    (Publish5("a/b", b"x", 1, False, False, 7,
              props((P.CONTENT_TYPE, "t"), (P.USER_PROPERTY, ("k", "v")))),
     "32140003612f6200070b030001742600016b00017678"),
    (Publish5("a", b"", 0, True), "3104000161" "00"),
    (Publish5("", b"p", 0, False, False, None, props((P.TOPIC_ALIAS, 3))),
     "3007" "0000" "03230003" "70"),
    (PubAck5(1), "40020001"),
    (PubAck5(2, 0x10), "4003000210"),
    (PubRec5(2, 0x80, props((P.REASON_STRING, "no"))), "5009000280051f00026e6f"),
    (PubRel5(3, 0, props((P.REASON_STRING, "r"))), "6208000300041f000172"),
    (PubComp5(4, 0x92), "7003000492"),
    (Subscribe5(1, (("a/#", SubOptions(1, True, True, 2)),),
                props((P.SUBSCRIPTION_IDENTIFIER, 300))),
     "820c0001030bac020003612f232d"),
    (SubAck5(1, (0, 1, 0x80)), "9006000100000180"),
    (Unsubscribe5(2, ("a",)), "a206000200000161"),
    (UnsubAck5(1, (0x11,)), "b00400010011"),
    (PingReq(), "c000"),
    (PingResp(), "d000"),
    (Disconnect5(), "e000"),
    (Disconnect5(0x94), "e00194"),
    (Disconnect5(0x04, props((P.SESSION_EXPIRY_INTERVAL, 0))), "e00704051100000000"),
    (Auth5(0x18, props((P.AUTHENTICATION_METHOD, "x"))), "f006180415000178"),
]


@pytest.mark.parametrize(("packet", "golden"), GOLDEN, ids=lambda v: type(v).__name__)
def test_golden_packets(packet: object, golden: str) -> None:
    assert encode5(packet).hex() == golden  # type: ignore[arg-type]
    assert decode5(bytes.fromhex(golden)) == packet


#: One golden encoding per property identifier: (property, value, packet, bytes after length).
PROPERTY_GOLDEN = [
    (P.PAYLOAD_FORMAT_INDICATOR, 1, "PUBLISH", "0101"),
    (P.MESSAGE_EXPIRY_INTERVAL, 70000, "PUBLISH", "0200011170"),
    (P.CONTENT_TYPE, "a", "PUBLISH", "03000161"),
    (P.RESPONSE_TOPIC, "r/t", "PUBLISH", "080003722f74"),
    (P.CORRELATION_DATA, b"\x00\x01", "PUBLISH", "0900020001"),
    (P.SUBSCRIPTION_IDENTIFIER, 128, "PUBLISH", "0b8001"),
    (P.SESSION_EXPIRY_INTERVAL, 0xFFFFFFFF, "CONNECT", "11ffffffff"),
    (P.ASSIGNED_CLIENT_IDENTIFIER, "id", "CONNACK", "1200026964"),
    (P.SERVER_KEEP_ALIVE, 30, "CONNACK", "13001e"),
    (P.AUTHENTICATION_METHOD, "m", "AUTH", "1500016d"),
    (P.AUTHENTICATION_DATA, b"d", "CONNECT", "16000164"),
    (P.REQUEST_PROBLEM_INFORMATION, 0, "CONNECT", "1700"),
    (P.WILL_DELAY_INTERVAL, 9, "WILL", "1800000009"),
    (P.REQUEST_RESPONSE_INFORMATION, 1, "CONNECT", "1901"),
    (P.RESPONSE_INFORMATION, "x", "CONNACK", "1a000178"),
    (P.SERVER_REFERENCE, "h", "DISCONNECT", "1c000168"),
    (P.REASON_STRING, "why", "SUBACK", "1f0003776879"),
    (P.RECEIVE_MAXIMUM, 20, "CONNECT", "210014"),
    (P.TOPIC_ALIAS_MAXIMUM, 10, "CONNACK", "22000a"),
    (P.TOPIC_ALIAS, 1, "PUBLISH", "230001"),
    (P.MAXIMUM_QOS, 1, "CONNACK", "2401"),
    (P.RETAIN_AVAILABLE, 0, "CONNACK", "2500"),
    (P.USER_PROPERTY, ("k", "v"), "UNSUBSCRIBE", "2600016b000176"),
    (P.MAXIMUM_PACKET_SIZE, 1024, "CONNACK", "2700000400"),
    (P.WILDCARD_SUBSCRIPTION_AVAILABLE, 1, "CONNACK", "2801"),
    (P.SUBSCRIPTION_IDENTIFIER_AVAILABLE, 0, "CONNACK", "2900"),
    (P.SHARED_SUBSCRIPTION_AVAILABLE, 0, "CONNACK", "2a00"),
]


def test_every_property_has_a_golden_case() -> None:
    assert {p for p, *_ in PROPERTY_GOLDEN} == set(PROPERTY_SPECS)


@pytest.mark.parametrize(("prop", "value", "packet", "golden"), PROPERTY_GOLDEN,
                         ids=[p.name for p, *_ in PROPERTY_GOLDEN])
def test_golden_properties(prop: PropertyId, value: object, packet: str, golden: str) -> None:
    body = bytes.fromhex(golden)
    encoded = encode_properties(props((prop, value)), packet)
    assert encoded == bytes((len(body),)) + body
    decoded, end = decode_properties(encoded, 0, len(encoded), packet)
    assert decoded == props((prop, value)) and end == len(encoded)


# -- errors carry the v5 reason code ----------------------------------------------------------


def _publish_with_props(raw: bytes) -> bytes:
    body = b"\x00\x01a" + bytes((len(raw),)) + raw + b"pay"
    return bytes((0x30, len(body))) + body


@pytest.mark.parametrize(("raw", "error", "code"), [
    (bytes.fromhex("0101" "0100"), ProtocolViolation, 0x82),  # duplicate payload format
    (bytes.fromhex("2300012300 02"), ProtocolViolation, 0x82),  # duplicate topic alias
    (bytes.fromhex("0102"), ProtocolViolation, 0x82),  # payload format indicator 2
    # An identifier not valid for the packet type is a Malformed Packet (2.2.2.2; mosquitto's
    # 13-malformed-subscribe-v5.py): 0x82 before 2026-11-25.
    (bytes.fromhex("1100000000"), MalformedPacket, 0x81),  # session expiry not in PUBLISH
    (bytes.fromhex("0300 02ff fe"), MalformedPacket, 0x81),  # invalid UTF-8 content type
    (bytes.fromhex("2600016b0002c328"), MalformedPacket, 0x81),  # invalid UTF-8 user value
    (bytes.fromhex("0300050000"), MalformedPacket, 0x81),  # string runs past the set
    (bytes.fromhex("7f00"), MalformedPacket, 0x81),  # unknown identifier
    (bytes.fromhex("0b00"), ProtocolViolation, 0x82),  # subscription identifier 0
])
def test_bad_properties_raise_with_reason_code(raw: bytes, error: type, code: int) -> None:
    with pytest.raises(error) as info:
        decode5(_publish_with_props(raw))
    assert info.value.reason_code == code


def test_property_length_past_the_packet_is_malformed() -> None:
    data = bytes.fromhex("3006" "000161" "20" "0101")
    with pytest.raises(MalformedPacket) as info:
        decode5(data)
    assert info.value.reason_code == 0x81


def test_oversized_packet_is_packet_too_large() -> None:
    decoder = PacketDecoder5(16)
    decoder.feed(encode5(Publish5("a", b"x" * 40)))
    with pytest.raises(MalformedPacket) as info:
        decoder.next_packet()
    assert info.value.reason_code == 0x95


def test_invalid_reason_code_is_malformed() -> None:
    with pytest.raises(MalformedPacket):
        decode5(bytes.fromhex("4003000199"[:8] + "05"))  # PUBACK reason 0x05


def test_subscription_option_reserved_bits_are_malformed() -> None:
    with pytest.raises(MalformedPacket):
        decode5(bytes.fromhex("8207000100000161c0"[:16] + "40"))


def test_encoder_refuses_what_the_decoder_refuses() -> None:
    with pytest.raises(MalformedPacket):
        encode5(Publish5("a", b"", properties=props((P.SESSION_EXPIRY_INTERVAL, 1))))
    with pytest.raises(ProtocolViolation):
        encode5(Publish5("a", b"", properties=props((P.TOPIC_ALIAS, 1), (P.TOPIC_ALIAS, 2))))
    with pytest.raises(MalformedPacket):
        encode5(PubAck5(1, 0x05))


def test_connect5_through_the_311_decoder_then_take_over() -> None:
    """A connection starts on the 3.1.1 decoder; a v5 CONNECT decodes in full and the v5
    decoder continues with what was pipelined behind it."""
    connect = Connect5("c", properties=props((P.RECEIVE_MAXIMUM, 5)))
    publish = Publish5("t", b"v", properties=props((P.USER_PROPERTY, ("a", "b"))))
    decoder = PacketDecoder()
    decoder.feed(encode5(connect) + encode5(publish)[:5])
    assert decoder.next_packet() == connect
    v5 = PacketDecoder5.take_over(decoder)
    assert v5.next_packet() is None
    v5.feed(encode5(publish)[5:])
    assert v5.next_packet() == publish
    assert decode(encode5(connect)) == connect


# -- hypothesis -------------------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                max_size=8)
_topic = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"),
                 min_size=1, max_size=8)


def _value(kind: PropType) -> st.SearchStrategy[object]:
    return {
        PropType.BYTE: st.integers(0, 1), PropType.U16: st.integers(1, 0xFFFF),
        PropType.U32: st.integers(1, 0xFFFFFFFF), PropType.VBI: st.integers(1, 268_435_455),
        PropType.STRING: _text, PropType.BINARY: st.binary(max_size=8),
        PropType.STRING_PAIR: st.tuples(_text, _text),
    }[kind]


def _props_for(packet: str) -> st.SearchStrategy[Properties]:
    allowed = [p for p, (_, where, _) in PROPERTY_SPECS.items() if packet in where]

    @st.composite
    def build(draw: st.DrawFn) -> Properties:
        chosen = draw(st.lists(st.sampled_from(allowed), unique=True, max_size=4))
        if packet == "CONNECT" and P.AUTHENTICATION_DATA in chosen \
                and P.AUTHENTICATION_METHOD not in chosen:
            chosen.remove(P.AUTHENTICATION_DATA)  # a Protocol Error (3.1.2.11.10)
        # A Response Topic is a topic name: not empty, no wildcards [MQTT-3.3.2-14].
        items = [(PropertyId(p), draw(_topic if p == P.RESPONSE_TOPIC
                                      else _value(PROPERTY_SPECS[p][0]))) for p in chosen]
        items += [(P.USER_PROPERTY, draw(st.tuples(_text, _text)))
                  for _ in range(draw(st.integers(0, 2)))]
        return Properties(items)

    return build()


_packets = st.one_of(
    st.builds(Publish5, _topic, st.binary(max_size=16), st.just(0), st.booleans(),
              st.just(False), st.none(), _props_for("PUBLISH")),
    st.builds(Publish5, _topic, st.binary(max_size=16), st.sampled_from([1, 2]),
              st.booleans(), st.booleans(), st.integers(1, 0xFFFF), _props_for("PUBLISH")),
    st.builds(PubAck5, st.integers(1, 0xFFFF), st.sampled_from([0, 0x10, 0x80, 0x97]),
              _props_for("PUBACK")),
    st.builds(PubRel5, st.integers(1, 0xFFFF), st.sampled_from([0, 0x92]),
              _props_for("PUBREL")),
    st.builds(Subscribe5, st.integers(1, 0xFFFF),
              st.lists(st.tuples(_topic, st.builds(SubOptions, st.integers(0, 2), st.booleans(),
                                                   st.booleans(), st.integers(0, 2))),
                       min_size=1, max_size=3).map(tuple), _props_for("SUBSCRIBE")),
    st.builds(SubAck5, st.integers(1, 0xFFFF),
              st.lists(st.sampled_from([0, 1, 2, 0x80, 0x87, 0xA1]), max_size=3).map(tuple),
              _props_for("SUBACK")),
    st.builds(Disconnect5, st.sampled_from([0, 0x04, 0x81, 0x94]), _props_for("DISCONNECT")),
    st.builds(Auth5, st.sampled_from([0, 0x18, 0x19]), _props_for("AUTH")),
    st.builds(Connect5, _text, st.booleans(), st.integers(0, 0xFFFF),
              st.none() | st.builds(Will5, _topic, st.binary(max_size=8), st.integers(0, 2),
                                    st.booleans(), _props_for("WILL")),
              st.none() | _text, st.none() | st.binary(max_size=8), _props_for("CONNECT")),
    st.builds(ConnAck5, st.booleans(), st.just(0), _props_for("CONNACK")),
)


@settings(max_examples=300, deadline=None)
@given(_packets)
def test_round_trip(packet: object) -> None:
    assert decode5(encode5(packet)) == packet  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.lists(_packets, min_size=1, max_size=4), st.integers(1, 7))
def test_split_anywhere(packets: list[object], chunk: int) -> None:
    stream = b"".join(encode5(p) for p in packets)  # type: ignore[arg-type]
    decoder = PacketDecoder5()
    out = []
    for i in range(0, len(stream), chunk):
        decoder.feed(stream[i:i + chunk])
        out.extend(decoder)
    assert out == packets


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_codec_errors(data: bytes) -> None:
    decoder = PacketDecoder5()
    decoder.feed(data)
    try:
        list(decoder)
    except MQTTError as exc:
        assert 0x80 <= exc.reason_code <= 0xA2


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=48))
def test_random_property_sets_raise_only_codec_errors(raw: bytes) -> None:
    data = bytes((len(raw),)) + raw
    for packet in ("PUBLISH", "CONNECT", "WILL", "DISCONNECT"):
        try:
            decode_properties(data, 0, len(data), packet)
        except MQTTError as exc:
            assert exc.reason_code in (0x81, 0x82)


# Packet identifier 0 where one is required [MQTT-2.2.1-3]: a Protocol Error (0x82) in
# MQTT 5, as mosquitto answers it; 0x81 (Malformed Packet) before 2026-11-29.
_ZERO_ID_PACKETS = {
    "publish-qos1": bytes.fromhex("3206" "000174" "0000" "00"),
    "publish-qos2": bytes.fromhex("3406" "000174" "0000" "00"),
    "subscribe": bytes.fromhex("8207" "0000" "00" "000174" "00"),
    "unsubscribe": bytes.fromhex("a206" "0000" "00" "000174"),
    "puback": bytes.fromhex("40020000"),
    "pubrec": bytes.fromhex("50020000"),
    "pubrel": bytes.fromhex("62020000"),
    "pubcomp": bytes.fromhex("70020000"),
}


@pytest.mark.parametrize("data", _ZERO_ID_PACKETS.values(), ids=_ZERO_ID_PACKETS.keys())
def test_packet_identifier_zero_is_a_protocol_error(data: bytes) -> None:
    with pytest.raises(MQTTError) as info:
        decode5(data)
    assert info.value.reason_code == 0x82
    assert info.value.rule == "MQTT-2.2.1-3"
    # Still one of the codec's own errors, which the connection closes on.
    assert isinstance(info.value, MalformedPacket)
    # The same identifier in the same bytes with 1 instead decodes: the 0 is the fault.
    fixed = data.replace(b"\x00\x00", b"\x00\x01", 1) if data[0] >> 4 in (8, 10) else None
    if fixed is not None:
        assert decode5(fixed).packet_id == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["publish-qos1", "publish-qos2", "puback", "pubrec"])
def test_packet_identifier_zero_in_311_is_still_malformed(name: str) -> None:
    """MQTT 3.1.1 has no reason codes: its decoder's error (and the close) is unchanged."""
    data = _ZERO_ID_PACKETS[name]
    if data[0] >> 4 == 3:  # 3.1.1 has no properties: drop the v5 property length
        data = bytes((data[0], data[1] - 1)) + data[2:-1]
    with pytest.raises(MalformedPacket) as info:
        decode(data)
    assert info.value.reason_code == 0x81
