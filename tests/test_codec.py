"""The MQTT 3.1.1 codec: golden bytes, round trips, stream splitting, fuzzing, every rule.

Golden literals were written by hand from the specification's figures (sections 2 and 3),
not captured from the encoder, so they check both directions independently.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mqttring.protocol.codec import (
    MAX_REMAINING_LENGTH,
    PacketDecoder,
    decode,
    encode,
    encode_publish,
    encode_remaining_length,
    publish_with_packet_id,
)
from mqttring.protocol.errors import InvalidTopic, MalformedPacket, MQTTError, PacketTooLarge
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
    Will,
)
from mqttring.protocol.packets5 import Connect5
from mqttring.protocol.properties import Properties, PropertyId


def h(text: str) -> bytes:
    """Hex with spaces and '|' separators for readability."""
    return bytes.fromhex(text.replace("|", " "))


# ------------------------------------------------------------------------------ golden bytes

GOLDEN: list[tuple[str, Packet, bytes]] = [
    (
        "connect-minimal",
        Connect("abc", clean_session=True, keepalive=60),
        h("10 0f | 00 04 4d 51 54 54 | 04 | 02 | 00 3c | 00 03 61 62 63"),
    ),
    (
        "connect-full",
        Connect(
            "c",
            clean_session=False,
            keepalive=10,
            will=Will("w/t", b"bye", qos=2, retain=True),
            username="u",
            password=b"p",
        ),
        # flags: user 0x80 | password 0x40 | will retain 0x20 | will QoS 2 0x10 | will 0x04
        h(
            "10 1d | 00 04 4d 51 54 54 | 04 | f4 | 00 0a | 00 01 63 | 00 03 77 2f 74"
            "| 00 03 62 79 65 | 00 01 75 | 00 01 70"
        ),
    ),
    (
        "connect-mqisdp-3.1",
        Connect("x", keepalive=0, protocol_name="MQIsdp", protocol_level=3),
        h("10 0f | 00 06 4d 51 49 73 64 70 | 03 | 02 | 00 00 | 00 01 78"),
    ),
    (
        "connect-empty-id-username-only",
        Connect("", clean_session=True, keepalive=65535, username="ü"),
        h("10 10 | 00 04 4d 51 54 54 | 04 | 82 | ff ff | 00 00 | 00 02 c3 bc"),
    ),
    ("connack-session-present", ConnAck(True), h("20 02 01 00")),
    (
        "connack-refused",
        ConnAck(False, ConnectReturnCode.NOT_AUTHORIZED),
        h("20 02 00 05"),
    ),
    ("publish-qos0", Publish("a/b", b"hi"), h("30 07 | 00 03 61 2f 62 | 68 69")),
    (
        "publish-qos1-dup-retain",
        Publish("a/b", b"hi", qos=1, retain=True, dup=True, packet_id=10),
        h("3b 09 | 00 03 61 2f 62 | 00 0a | 68 69"),
    ),
    (
        "publish-qos2-empty-payload",
        Publish("a/b", b"", qos=2, packet_id=0xFFFF),
        h("34 07 | 00 03 61 2f 62 | ff ff"),
    ),
    ("publish-utf8-topic", Publish("ü", b""), h("30 04 | 00 02 c3 bc")),
    (
        "publish-two-byte-length",  # 2 + 1 + 200 = 203 = 0x4b + 1 * 128
        Publish("t", b"x" * 200),
        h("30 cb 01 | 00 01 74") + b"x" * 200,
    ),
    ("puback", PubAck(1), h("40 02 00 01")),
    ("pubrec", PubRec(0x1234), h("50 02 12 34")),
    ("pubrel", PubRel(2), h("62 02 00 02")),
    ("pubcomp", PubComp(0xFFFF), h("70 02 ff ff")),
    (
        "subscribe",
        Subscribe(1, (("a/+", 1), ("#", 2))),
        h("82 0c | 00 01 | 00 03 61 2f 2b | 01 | 00 01 23 | 02"),
    ),
    ("suback", SubAck(1, (1, 0x80, 0, 2)), h("90 06 | 00 01 | 01 80 00 02")),
    (
        "unsubscribe",
        Unsubscribe(2, ("a/#", "b")),
        h("a2 0a | 00 02 | 00 03 61 2f 23 | 00 01 62"),
    ),
    ("unsuback", UnsubAck(2), h("b0 02 00 02")),
    ("pingreq", PingReq(), h("c0 00")),
    ("pingresp", PingResp(), h("d0 00")),
    ("disconnect", Disconnect(), h("e0 00")),
]


@pytest.mark.parametrize(("name", "packet", "wire"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_encode(name: str, packet: Packet, wire: bytes) -> None:
    assert encode(packet) == wire


@pytest.mark.parametrize(("name", "packet", "wire"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_decode(name: str, packet: Packet, wire: bytes) -> None:
    assert decode(wire) == packet
    assert type(decode(wire)) is type(packet)


def test_golden_covers_all_fourteen_types() -> None:
    assert {type(packet) for _, packet, _ in GOLDEN} == {
        Connect, ConnAck, Publish, PubAck, PubRec, PubRel, PubComp,
        Subscribe, SubAck, Unsubscribe, UnsubAck, PingReq, PingResp, Disconnect,
    }  # fmt: skip


# Section 2.2.3, Table 2.4, plus the 321 example from the text.
REMAINING_LENGTHS = [
    (0, "00"),
    (127, "7f"),
    (128, "80 01"),
    (321, "c1 02"),
    (16383, "ff 7f"),
    (16384, "80 80 01"),
    (2097151, "ff ff 7f"),
    (2097152, "80 80 80 01"),
    (268435455, "ff ff ff 7f"),
]


@pytest.mark.parametrize(("value", "wire"), REMAINING_LENGTHS)
def test_remaining_length_table(value: int, wire: str) -> None:
    assert encode_remaining_length(value) == h(wire)
    if not value:
        return
    # Declare that length on a PUBLISH header and check the decoder reads the same value
    # (the body is never needed: a limit of value - 1 must trip on the header alone).
    decoder = PacketDecoder(max_packet_size=value - 1)
    decoder.feed(b"\x30" + h(wire))
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()
    decoder = PacketDecoder(max_packet_size=value)
    decoder.feed(b"\x30" + h(wire))
    assert decoder.next_packet() is None  # within the limit: waits for the body


def test_remaining_length_above_maximum_is_refused() -> None:
    with pytest.raises(PacketTooLarge):
        encode_remaining_length(MAX_REMAINING_LENGTH + 1)


def test_non_minimal_remaining_length_is_accepted() -> None:
    # 3.1.1 does not require the shortest encoding; 0x82 0x00 is 2.
    assert decode(h("40 82 00 00 07")) == PubAck(7)


# ------------------------------------------------------------------------------ strategies

strings = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12
)
topic_level = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00/+#"), max_size=6
)
topic_names = st.lists(topic_level, min_size=1, max_size=4).map("/".join).filter(lambda t: t != "")


@st.composite
def topic_filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.one_of(topic_level, st.just("+")), min_size=0, max_size=4))
    if not levels or draw(st.booleans()):
        levels.append("#")
    topic_filter = "/".join(levels)
    return topic_filter or "+"


packet_ids = st.integers(1, 0xFFFF)
qos_values = st.integers(0, 2)
payloads = st.one_of(st.binary(max_size=40), st.binary(min_size=100, max_size=400))


@st.composite
def publishes(draw: st.DrawFn) -> Publish:
    qos = draw(qos_values)
    return Publish(
        draw(topic_names),
        draw(payloads),
        qos,
        draw(st.booleans()),
        draw(st.booleans()) if qos else False,
        draw(packet_ids) if qos else None,
    )


@st.composite
def connects(draw: st.DrawFn) -> Connect:
    name, level = draw(st.sampled_from([("MQTT", 4), ("MQIsdp", 3)]))
    will = draw(
        st.none() | st.builds(Will, topic_names, st.binary(max_size=20), qos_values, st.booleans())
    )
    username = draw(st.none() | strings)
    password = draw(st.none() | st.binary(max_size=20)) if username is not None else None
    return Connect(
        draw(strings),
        draw(st.booleans()),
        draw(st.integers(0, 0xFFFF)),
        will,
        username,
        password,
        name,
        level,
    )


@st.composite
def connacks(draw: st.DrawFn) -> ConnAck:
    code = draw(st.sampled_from(ConnectReturnCode))
    return ConnAck(draw(st.booleans()) if code == 0 else False, code)


# Other revisions under the name "MQTT" decode to their level alone (plus the flags and
# keep-alive that every revision places identically), so only that shape round-trips.
# Level 5 is decoded in full, as a ``Connect5`` (tests/test_codec5.py).
other_level_connects = st.builds(
    Connect,
    st.just(""),
    st.booleans(),
    st.integers(0, 0xFFFF),
    protocol_level=st.integers(0, 255).filter(lambda level: level not in (4, 5)),
)

packets_by_type: dict[type, st.SearchStrategy[Packet]] = {
    Connect: connects() | other_level_connects,
    ConnAck: connacks(),
    Publish: publishes(),
    PubAck: st.builds(PubAck, packet_ids),
    PubRec: st.builds(PubRec, packet_ids),
    PubRel: st.builds(PubRel, packet_ids),
    PubComp: st.builds(PubComp, packet_ids),
    Subscribe: st.builds(
        Subscribe,
        packet_ids,
        st.lists(st.tuples(topic_filters(), qos_values), min_size=1, max_size=4).map(tuple),
    ),
    SubAck: st.builds(
        SubAck, packet_ids, st.lists(st.sampled_from([0, 1, 2, 0x80]), max_size=5).map(tuple)
    ),
    Unsubscribe: st.builds(
        Unsubscribe, packet_ids, st.lists(topic_filters(), min_size=1, max_size=4).map(tuple)
    ),
    UnsubAck: st.builds(UnsubAck, packet_ids),
    PingReq: st.just(PingReq()),
    PingResp: st.just(PingResp()),
    Disconnect: st.just(Disconnect()),
}
any_packet = st.one_of(*packets_by_type.values())


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("packet_type", list(packets_by_type), ids=lambda t: t.__name__)
@given(data=st.data())
@settings(max_examples=150)
def test_round_trip_each_type(packet_type: type, data: st.DataObject) -> None:
    packet = data.draw(packets_by_type[packet_type])
    wire = encode(packet)
    assert decode(wire) == packet
    assert encode(decode(wire)) == wire


@given(st.lists(any_packet, max_size=12), st.data())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_split_stream_anywhere(packets: list[Packet], data: st.DataObject) -> None:
    stream = b"".join(encode(p) for p in packets)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    # A lazy consumer takes at most one packet per feed instead of draining.
    lazy = data.draw(st.booleans())
    decoder = PacketDecoder()
    decoded: list[Packet] = []
    previous = 0
    for cut in [*cuts, len(stream)]:
        decoder.feed(stream[previous:cut])
        if lazy:
            packet = decoder.next_packet()
            if packet is not None:
                decoded.append(packet)
        else:
            decoded.extend(decoder)
        previous = cut
    decoded.extend(decoder)
    assert decoded == packets
    assert decoder.buffered == 0
    assert decoder.next_packet() is None


def test_byte_at_a_time_then_all_at_once() -> None:
    stream = b"".join(wire for _, _, wire in GOLDEN)
    expected = [packet for _, packet, _ in GOLDEN]
    decoder = PacketDecoder()
    decoded = []
    for byte in stream:
        decoder.feed(bytes((byte,)))
        packet = decoder.next_packet()
        if packet is not None:
            decoded.append(packet)
    assert decoded == expected
    decoder.feed(stream)
    assert list(decoder) == expected


def test_large_packet_trickling_in_is_parked_then_joined_once() -> None:
    packet = Publish("big/topic", bytes(range(256)) * 40, qos=2, packet_id=9)  # 10 KiB
    wire = encode(packet)
    decoder = PacketDecoder()
    fed = 0
    while len(wire) - fed > 100:
        decoder.feed(wire[fed : fed + 100])
        fed += 100
        if fed > 100:
            # Header known and packet incomplete: chunks are parked, not concatenated.
            assert len(decoder._chunks) == fed // 100 - 1
        assert decoder.next_packet() is None
        assert decoder.buffered == fed
    decoder.feed(wire[fed:] + encode(PingReq()))
    assert not decoder._chunks
    assert list(decoder) == [packet, PingReq()]
    assert decoder.buffered == 0


def test_feed_copies_mutable_buffers() -> None:
    """A transport may reuse its receive buffer: parked data must not change under us."""
    wire = encode(Publish("t", b"abcdefgh" * 20))
    decoder = PacketDecoder()
    scratch = bytearray(wire[:50])
    decoder.feed(scratch)
    assert decoder.next_packet() is None
    for part in (wire[50:100], wire[100:]):
        scratch[:] = part
        decoder.feed(memoryview(scratch))
        scratch[:] = b"\xff" * len(scratch)  # clobber after feeding
    assert decoder.next_packet() == Publish("t", b"abcdefgh" * 20)
    decoder.feed(bytearray(encode(PubAck(3))))
    assert decoder.next_packet() == PubAck(3)
    decoder.feed(b"")
    assert decoder.next_packet() is None


@given(publishes())
def test_encode_publish_matches_encode(packet: Publish) -> None:
    fast = encode_publish(
        packet.topic.encode(),
        packet.payload,
        packet.qos,
        packet.retain,
        packet.dup,
        packet.packet_id,
    )
    assert fast == encode(packet)


@given(
    topic_names,
    st.one_of(st.binary(max_size=200), st.binary(min_size=16370, max_size=16400)),
    st.booleans(),
    qos_values,
    packet_ids,
    st.booleans(),
    st.none() | st.booleans(),
)
# Remaining lengths around the points where the length field grows by a byte.
@example("t", b"x" * 122, False, 1, 5, False, None)  # 125 -> 127: still one byte
@example("t", b"x" * 123, True, 2, 5, True, None)  # 126 -> 128: one byte -> two
@example("t", b"x" * 124, False, 1, 5, False, False)  # 127 -> 129
@example("t", b"x" * 16380, False, 1, 5, False, None)  # 16383 -> 16385: two -> three
@settings(max_examples=200)
def test_publish_with_packet_id_equals_fresh_encoding(
    topic: str,
    payload: bytes,
    retain0: bool,
    qos: int,
    packet_id: int,
    dup: bool,
    retain: bool | None,
) -> None:
    qos0 = encode_publish(topic.encode(), payload, 0, retain0, False, None)
    want_retain = retain0 if retain is None else retain
    if qos == 0:
        stamped = publish_with_packet_id(qos0, 0, None, retain=retain)
        assert stamped == encode(Publish(topic, payload, 0, want_retain))
        return
    stamped = publish_with_packet_id(qos0, qos, packet_id, dup=dup, retain=retain)
    assert stamped == encode(Publish(topic, payload, qos, want_retain, dup, packet_id))


@pytest.mark.parametrize(
    ("packet", "qos", "packet_id", "dup"),
    [
        (encode(Publish("a", b"", 1, packet_id=1)), 2, 2, False),  # not QoS 0
        (encode(PubAck(1)), 1, 1, False),  # not a PUBLISH
        (b"", 1, 1, False),
        (encode(Publish("a", b"")), 3, 1, False),
        (encode(Publish("a", b"")), 1, 0, False),
        (encode(Publish("a", b"")), 1, None, False),
        (encode(Publish("a", b"")), 0, 5, False),
        (encode(Publish("a", b"")), 0, None, True),
    ],
)
def test_publish_with_packet_id_misuse_is_a_value_error(
    packet: bytes, qos: int, packet_id: int | None, dup: bool
) -> None:
    with pytest.raises(ValueError):
        publish_with_packet_id(packet, qos, packet_id, dup=dup)


def test_publish_with_packet_id_returns_qos0_unchanged_without_copy() -> None:
    qos0 = encode(Publish("a/b", b"payload"))
    assert publish_with_packet_id(qos0, 0, None) is qos0
    assert publish_with_packet_id(qos0, 0, None, retain=False) is qos0


# ------------------------------------------------------------------------------ fuzzing


def _drain(data: bytes, max_packet_size: int = MAX_REMAINING_LENGTH) -> list[Packet]:
    decoder = PacketDecoder(max_packet_size)
    decoder.feed(data)
    return list(decoder)


def _assert_only_mqtt_errors(data: bytes, max_packet_size: int = MAX_REMAINING_LENGTH) -> None:
    try:
        packets = _drain(data, max_packet_size)
    except MQTTError as exc:
        assert exc.rule.startswith("MQTT-")
        return
    # Whatever the decoder accepted must be a packet our encoder can reproduce.
    for packet in packets:
        assert decode(encode(packet)) == packet


@given(st.binary(max_size=300))
@settings(max_examples=3000)
def test_random_bytes_only_raise_mqtt_errors(data: bytes) -> None:
    _assert_only_mqtt_errors(data)
    _assert_only_mqtt_errors(data, max_packet_size=16)


@given(st.integers(0, 15), st.integers(0, 15), st.binary(max_size=60))
@settings(max_examples=3000)
def test_well_framed_random_bodies_only_raise_mqtt_errors(
    packet_type: int, flags: int, body: bytes
) -> None:
    # Random bytes rarely get past the fixed header; framing them exercises every body parser.
    _assert_only_mqtt_errors(bytes(((packet_type << 4) | flags, len(body))) + body)


def _outcome(chunks: list[bytes], max_packet_size: int) -> tuple[list[Packet], str | None]:
    decoder = PacketDecoder(max_packet_size)
    packets: list[Packet] = []
    try:
        for chunk in chunks:
            decoder.feed(chunk)
            packets.extend(decoder)
    except MQTTError as exc:
        return packets, exc.rule
    return packets, None


@st.composite
def mutated_packets(draw: st.DrawFn) -> bytes:
    wire = bytearray(encode(draw(any_packet)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not wire:
            wire.append(draw(st.integers(0, 255)))
            continue
        index = draw(st.integers(0, len(wire) - 1))
        if kind == "flip":
            wire[index] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            wire[index] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x23, 0x2B, 0xC0]))
        elif kind == "insert":
            wire.insert(index, draw(st.integers(0, 255)))
        elif kind == "delete":
            del wire[index]
        else:
            del wire[index:]
    return bytes(wire)


@given(mutated_packets())
@settings(max_examples=3000)
def test_mutated_packets_only_raise_mqtt_errors(data: bytes) -> None:
    _assert_only_mqtt_errors(data)


#: Byte streams to decode: random bytes, mutated packets, valid packets (up to four).
byte_streams = st.one_of(
    st.binary(max_size=200),
    st.lists(mutated_packets(), max_size=4).map(b"".join),
    st.lists(any_packet, max_size=4).map(lambda ps: b"".join(map(encode, ps))),
)
packet_limits = st.sampled_from([16, 200, MAX_REMAINING_LENGTH])


def _cut(data: bytes, draw: st.DataObject | None) -> list[bytes]:
    """``data`` sliced where a transport might slice it (whole when ``draw`` is None)."""
    if draw is None:
        return [data]
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(data)), max_size=8)))
    return [data[a:b] for a, b in pairwise([0, *cuts, len(data)])]


@given(byte_streams, st.data(), packet_limits)
@settings(max_examples=1000)
def test_outcome_does_not_depend_on_chunking(
    data: bytes, draw: st.DataObject, max_packet_size: int
) -> None:
    """Same packets and the same rule broken, however the transport slices the bytes."""
    assert _outcome(_cut(data, draw), max_packet_size) == _outcome([data], max_packet_size)


def _outcome_via_handlers(chunks: list[bytes], max_packet_size: int,
                          ) -> tuple[list[object], str | None]:
    """``_outcome`` through ``next_packet``'s PUBLISH/PUBACK handlers (a server
    connection's path), with both packet kinds written as the handlers receive them."""
    decoder = PacketDecoder(max_packet_size)
    items: list[object] = []

    def on_publish(topic: str, payload: bytes, qos: int, retain: bool,
                   packet_id: int | None) -> tuple[object, ...]:
        return ("publish", topic, payload, qos, retain, packet_id)

    def on_puback(packet_id: int) -> tuple[object, ...]:
        return ("puback", packet_id)

    try:
        for chunk in chunks:
            decoder.feed(chunk)
            while (item := decoder.next_packet(on_publish, on_puback)) is not None:
                items.append(item)
    except MQTTError as exc:
        return items, exc.rule
    return items, None


def _as_handled(packet: Packet) -> object:
    if type(packet) is Publish:
        return ("publish", packet.topic, packet.payload, packet.qos, packet.retain,
                packet.packet_id)
    if type(packet) is PubAck:
        return ("puback", packet.packet_id)
    return packet


@given(byte_streams, st.data(), packet_limits)
@settings(max_examples=1000)
@example(h("40 03 00 01 00"), None, MAX_REMAINING_LENGTH)  # PUBACK: length 3
@example(h("40 02 00 00"), None, MAX_REMAINING_LENGTH)  # PUBACK: packet id 0
@example(h("41 02 00 01"), None, MAX_REMAINING_LENGTH)  # PUBACK: reserved flags
@example(h("38 07 00 03 61 2f 62 00 07"), None, MAX_REMAINING_LENGTH)  # QoS 0 with DUP
def test_handlers_see_what_packets_would_say(
    data: bytes, draw: st.DataObject | None, max_packet_size: int
) -> None:
    """The connection's handler path accepts exactly the packets, and breaks exactly the
    rules, of the plain path: its checks are the same, only nothing is built twice."""
    chunks = _cut(data, draw)
    packets, rule = _outcome(chunks, max_packet_size)
    assert _outcome_via_handlers(chunks, max_packet_size) == (
        [_as_handled(p) for p in packets], rule)


# ------------------------------------------------------------------------------ malformed

# fmt: off
MALFORMED: list[tuple[str, bytes, type[MQTTError], str]] = [
    # Fixed header.
    ("length-5-bytes", h("30 80 80 80 80 01"), MalformedPacket, "MQTT-2.2.3"),
    ("length-5-bytes-zero", h("c0 80 80 80 80 00"), MalformedPacket, "MQTT-2.2.3"),
    ("type-0", h("00 00"), MalformedPacket, "MQTT-2.2.1"),
    ("type-15", h("f0 00"), MalformedPacket, "MQTT-2.2.1"),
    ("connect-flags", h("11 0f 00 04 4d 51 54 54 04 02 00 3c 00 03 61 62 63"), MalformedPacket,
     "MQTT-2.2.2-1"),
    ("connack-flags", h("28 02 00 00"), MalformedPacket, "MQTT-2.2.2-1"),
    ("puback-flags", h("42 02 00 01"), MalformedPacket, "MQTT-2.2.2-1"),
    ("pubrec-flags", h("52 02 00 01"), MalformedPacket, "MQTT-2.2.2-1"),
    ("pubrel-flags-0", h("60 02 00 01"), MalformedPacket, "MQTT-2.2.2-1"),
    ("pubrel-flags-3", h("63 02 00 01"), MalformedPacket, "MQTT-2.2.2-1"),
    ("pubcomp-flags", h("71 02 00 01"), MalformedPacket, "MQTT-2.2.2-1"),
    ("subscribe-flags", h("80 06 00 01 00 01 61 00"), MalformedPacket, "MQTT-2.2.2-1"),
    ("suback-flags", h("92 03 00 01 00"), MalformedPacket, "MQTT-2.2.2-1"),
    ("unsubscribe-flags", h("a0 05 00 01 00 01 61"), MalformedPacket, "MQTT-2.2.2-1"),
    ("unsuback-flags", h("b2 02 00 01"), MalformedPacket, "MQTT-2.2.2-1"),
    ("pingreq-flags", h("c1 00"), MalformedPacket, "MQTT-2.2.2-1"),
    ("pingresp-flags", h("d8 00"), MalformedPacket, "MQTT-2.2.2-1"),
    ("disconnect-flags", h("e4 00"), MalformedPacket, "MQTT-2.2.2-1"),
    # PUBLISH.
    ("publish-qos3", h("36 05 00 01 61 00 01"), MalformedPacket, "MQTT-3.3.1-4"),
    ("publish-qos3-id-0", h("3e 05 00 01 61 00 00"), MalformedPacket, "MQTT-3.3.1-4"),
    ("publish-dup-qos0", h("38 03 00 01 61"), MalformedPacket, "MQTT-3.3.1-2"),
    ("publish-packet-id-0", h("32 05 00 01 61 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("publish-wildcard-plus", h("30 05 00 03 61 2f 2b"), InvalidTopic, "MQTT-3.3.2-2"),
    ("publish-wildcard-hash", h("30 03 00 01 23"), InvalidTopic, "MQTT-3.3.2-2"),
    ("publish-empty-topic", h("30 04 00 00 68 69"), InvalidTopic, "MQTT-4.7.3-1"),
    ("publish-invalid-utf8", h("30 03 00 01 ff"), MalformedPacket, "MQTT-1.5.3-1"),
    ("publish-surrogate", h("30 05 00 03 ed a0 80"), MalformedPacket, "MQTT-1.5.3-1"),
    ("publish-overlong", h("30 04 00 02 c0 af"), MalformedPacket, "MQTT-1.5.3-1"),
    ("publish-nul", h("30 05 00 03 61 00 62"), MalformedPacket, "MQTT-1.5.3-2"),
    ("publish-no-topic-length", h("30 01 00"), MalformedPacket, "MQTT-2.2.3"),
    ("publish-topic-past-end", h("30 04 00 05 61 62"), MalformedPacket, "MQTT-2.2.3"),
    ("publish-missing-packet-id", h("32 03 00 01 61"), MalformedPacket, "MQTT-2.2.3"),
    ("publish-half-packet-id", h("32 04 00 01 61 00"), MalformedPacket, "MQTT-2.2.3"),
    # Acks and empty packets: exact lengths.
    ("puback-packet-id-0", h("40 02 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("pubrec-packet-id-0", h("50 02 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("pubrel-packet-id-0", h("62 02 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("pubcomp-packet-id-0", h("70 02 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("unsuback-packet-id-0", h("b0 02 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("puback-trailing", h("40 03 00 01 00"), MalformedPacket, "MQTT-2.2.3"),
    ("pubrel-short", h("62 01 00"), MalformedPacket, "MQTT-2.2.3"),
    ("pingreq-trailing", h("c0 01 00"), MalformedPacket, "MQTT-2.2.3"),
    ("disconnect-trailing", h("e0 02 00 00"), MalformedPacket, "MQTT-2.2.3"),
    # CONNACK.
    ("connack-short", h("20 01 00"), MalformedPacket, "MQTT-2.2.3"),
    ("connack-trailing", h("20 03 00 00 00"), MalformedPacket, "MQTT-2.2.3"),
    ("connack-reserved-flags", h("20 02 02 00"), MalformedPacket, "MQTT-3.2.2.1"),
    ("connack-reserved-code", h("20 02 00 06"), MalformedPacket, "MQTT-3.2.2.3"),
    ("connack-present-refused", h("20 02 01 01"), MalformedPacket, "MQTT-3.2.2-4"),
    # SUBSCRIBE / SUBACK / UNSUBSCRIBE.
    ("subscribe-packet-id-0", h("82 06 00 00 00 01 61 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("subscribe-empty", h("82 02 00 01"), MalformedPacket, "MQTT-3.8.3-3"),
    ("subscribe-no-packet-id", h("82 01 00"), MalformedPacket, "MQTT-2.2.3"),
    ("subscribe-qos3", h("82 06 00 01 00 01 61 03"), MalformedPacket, "MQTT-3-8.3-4"),
    ("subscribe-reserved-bits", h("82 06 00 01 00 01 61 04"), MalformedPacket, "MQTT-3-8.3-4"),
    ("subscribe-reserved-high", h("82 06 00 01 00 01 61 81"), MalformedPacket, "MQTT-3-8.3-4"),
    ("subscribe-missing-qos", h("82 05 00 01 00 01 61"), MalformedPacket, "MQTT-2.2.3"),
    ("subscribe-filter-past-end", h("82 06 00 01 00 09 61 00"), MalformedPacket, "MQTT-2.2.3"),
    ("subscribe-hash-middle", h("82 0a 00 01 00 05 61 2f 23 2f 62 00"), InvalidTopic,
     "MQTT-4.7.1-2"),
    ("subscribe-hash-suffix", h("82 07 00 01 00 02 23 61 00"), InvalidTopic, "MQTT-4.7.1-2"),
    ("subscribe-plus-suffix", h("82 07 00 01 00 02 61 2b 00"), InvalidTopic, "MQTT-4.7.1-3"),
    ("subscribe-empty-filter", h("82 05 00 01 00 00 00"), InvalidTopic, "MQTT-4.7.3-1"),
    ("subscribe-filter-utf8", h("82 06 00 01 00 01 80 00"), MalformedPacket, "MQTT-1.5.3-1"),
    ("suback-bad-code", h("90 03 00 01 03"), MalformedPacket, "MQTT-3.9.3-2"),
    ("suback-packet-id-0", h("90 03 00 00 00"), MalformedPacket, "MQTT-2.3.1-1"),
    ("unsubscribe-empty", h("a2 02 00 01"), MalformedPacket, "MQTT-3.10.3-2"),
    ("unsubscribe-packet-id-0", h("a2 05 00 00 00 01 61"), MalformedPacket, "MQTT-2.3.1-1"),
    ("unsubscribe-bad-filter", h("a2 06 00 01 00 02 23 61"), InvalidTopic, "MQTT-4.7.1-2"),
    ("unsubscribe-truncated", h("a2 05 00 01 00 05 61"), MalformedPacket, "MQTT-2.2.3"),
    ("unsubscribe-nul", h("a2 05 00 01 00 01 00"), MalformedPacket, "MQTT-1.5.3-2"),
]
# fmt: on

# CONNECT variants are built from a template to keep each case's one deviation visible.
_CONNECT_HEAD = h("00 04 4d 51 54 54")  # "MQTT"


def _connect(flags: int, payload: bytes, head: bytes = _CONNECT_HEAD, level: int = 4) -> bytes:
    body = head + bytes((level, flags)) + h("00 3c") + payload
    return bytes((0x10, len(body))) + body


_ID = h("00 01 63")  # client id "c"
# fmt: off
MALFORMED += [
    ("connect-protocol-name", _connect(0x02, _ID, head=h("00 04 4d 51 54 58")), MalformedPacket,
     "MQTT-3.1.2-1"),
    ("connect-mqisdp-level-4", _connect(0x02, _ID, head=h("00 06 4d 51 49 73 64 70")),
     MalformedPacket, "MQTT-3.1.2-1"),
    ("connect-reserved-flag", _connect(0x03, _ID), MalformedPacket, "MQTT-3.1.2-3"),
    ("connect-will-qos-no-will", _connect(0x0A, _ID), MalformedPacket, "MQTT-3.1.2-13"),
    ("connect-will-retain-no-will", _connect(0x22, _ID), MalformedPacket, "MQTT-3.1.2-15"),
    ("connect-will-qos3", _connect(0x1E, _ID + h("00 01 74 00 00")), MalformedPacket,
     "MQTT-3.1.2-14"),
    ("connect-password-no-user", _connect(0x42, _ID + h("00 01 70")), MalformedPacket,
     "MQTT-3.1.2-22"),
    ("connect-will-wildcard", _connect(0x06, _ID + h("00 01 23 00 00")), InvalidTopic,
     "MQTT-3.3.2-2"),
    ("connect-client-id-utf8", _connect(0x02, h("00 01 ff")), MalformedPacket, "MQTT-1.5.3-1"),
    ("connect-client-id-nul", _connect(0x02, h("00 01 00")), MalformedPacket, "MQTT-1.5.3-2"),
    ("connect-username-utf8", _connect(0x82, _ID + h("00 02 ed b0")), MalformedPacket,
     "MQTT-1.5.3-1"),
    ("connect-trailing", _connect(0x02, _ID + h("00")), MalformedPacket, "MQTT-2.2.3"),
    ("connect-missing-will", _connect(0x06, _ID), MalformedPacket, "MQTT-2.2.3"),
    ("connect-missing-username", _connect(0x82, _ID), MalformedPacket, "MQTT-2.2.3"),
    ("connect-missing-password", _connect(0xC2, _ID + h("00 01 75")), MalformedPacket,
     "MQTT-2.2.3"),
    ("connect-client-id-past-end", _connect(0x02, h("00 05 63")), MalformedPacket,
     "MQTT-2.2.3"),
    ("connect-no-header", h("10 06 00 04 4d 51 54 54"), MalformedPacket, "MQTT-2.2.3"),
    ("connect-empty", h("10 00"), MalformedPacket, "MQTT-2.2.3"),
]
# fmt: on


@pytest.mark.parametrize(
    ("name", "wire", "error", "rule"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
@pytest.mark.parametrize("followed", [False, True], ids=["alone", "followed"])
def test_malformed_rule(
    name: str, wire: bytes, error: type[MQTTError], rule: str, followed: bool
) -> None:
    decoder = PacketDecoder()
    # Followed by more valid packets in the same buffer: a field that runs past its packet's
    # end must be caught against the declared length, not against the end of the buffer.
    decoder.feed(wire + (encode(Publish("x/y", bytes(64))) * 3 if followed else b""))
    with pytest.raises(MQTTError) as info:
        decoder.next_packet()
    assert type(info.value) is error
    assert info.value.rule == rule
    assert str(info.value).startswith(f"[{rule}] ")
    assert isinstance(info.value, MalformedPacket)


def test_malformed_cases_differ_from_a_valid_packet_only_where_intended() -> None:
    # Sanity check of the CONNECT template: with valid flags it decodes.
    assert decode(_connect(0x02, _ID)) == Connect("c", keepalive=60)
    # Other revisions of "MQTT" decode only as far as the level: the session answers code 1.
    assert decode(_connect(0x02, _ID, level=3)) == Connect("", protocol_level=3)
    # Level 5 is MQTT 5.0, decoded in full: the property length 0 comes before the id.
    assert decode(_connect(0x02, h("00") + _ID, level=5)) == Connect5("c", keepalive=60)
    mqisdp = _connect(0x02, _ID, head=h("00 06 4d 51 49 73 64 70"), level=3)
    assert decode(mqisdp) == Connect("c", keepalive=60, protocol_name="MQIsdp", protocol_level=3)
    assert decode(_connect(0xC2, _ID + h("00 01 75 00 00"))) == Connect(
        "c", keepalive=60, username="u", password=b""
    )


def test_bom_is_kept_not_stripped() -> None:
    # [MQTT-1.5.3-3]: 0xEF 0xBB 0xBF is U+FEFF and must not be skipped or stripped.
    assert decode(h("30 05 00 03 ef bb bf")) == Publish("\ufeff", b"")
    assert decode(h("82 08 00 01 00 03 ef bb bf 00")) == Subscribe(1, (("\ufeff", 0),))


def test_over_size_packet_is_refused_from_the_fixed_header_alone() -> None:
    decoder = PacketDecoder(max_packet_size=1000)
    decoder.feed(h("30 e9 07"))  # 1001, no body at all
    with pytest.raises(PacketTooLarge) as info:
        decoder.next_packet()
    assert info.value.rule == "MQTT-2.2.3"
    assert isinstance(info.value, MalformedPacket)


def test_over_size_detected_from_partial_length_field() -> None:
    # "ff" alone says: at least 127, more length bytes follow.  That already breaks a limit
    # of 100, so the decoder refuses before the rest of the field (or any body) arrives.
    decoder = PacketDecoder(max_packet_size=100)
    decoder.feed(h("30 ff"))
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()
    # Under a limit of 200 the same prefix is still undecided ...
    decoder = PacketDecoder(max_packet_size=200)
    decoder.feed(h("30 ff"))
    assert decoder.next_packet() is None
    # ... until the next byte makes it 127 + 127 * 128.
    decoder.feed(h("7f"))
    with pytest.raises(PacketTooLarge):
        decoder.next_packet()


def test_exact_limit_is_accepted() -> None:
    packet = Publish("t", b"x" * 7)  # remaining length 10
    decoder = PacketDecoder(max_packet_size=10)
    decoder.feed(encode(packet))
    assert decoder.next_packet() == packet


def test_incomplete_and_leftover_input_to_decode() -> None:
    with pytest.raises(MalformedPacket):
        decode(h("40 02 00"))
    with pytest.raises(MalformedPacket):
        decode(h("40 02 00 01 c0"))
    with pytest.raises(MalformedPacket):
        decode(b"")


# ------------------------------------------------------------------------------ encode side


@pytest.mark.parametrize(
    ("packet", "error", "rule"),
    [
        (Publish("a/+", b""), InvalidTopic, "MQTT-3.3.2-2"),
        (Publish("", b""), InvalidTopic, "MQTT-4.7.3-1"),
        (Publish("a\x00", b""), InvalidTopic, "MQTT-4.7.3-2"),
        (Subscribe(1, (("a#", 0),)), InvalidTopic, "MQTT-4.7.1-2"),
        (Unsubscribe(1, ("a/+b",)), InvalidTopic, "MQTT-4.7.1-3"),
        (Connect("c", protocol_name="MQTX"), MalformedPacket, "MQTT-3.1.2-1"),
        (Connect("c", protocol_name="MQIsdp", protocol_level=4), MalformedPacket, "MQTT-3.1.2-1"),
        (Connect("c", protocol_level=256), MalformedPacket, "MQTT-3.1.2-2"),
        (Connect("c\x00"), MalformedPacket, "MQTT-1.5.3-2"),
        (Connect("\ud800"), MalformedPacket, "MQTT-1.5.3-1"),
        (Connect("x" * 65536), MalformedPacket, "MQTT-1.5.3"),
        (Connect("c", username="u", password=b"p" * 65536), MalformedPacket, "MQTT-3.1.3"),
        (Connect("c", will=Will("a/#", b"")), InvalidTopic, "MQTT-3.3.2-2"),
        (ConnAck(True, ConnectReturnCode.SERVER_UNAVAILABLE), MalformedPacket, "MQTT-3.2.2-4"),
        (ConnAck(False, 6), MalformedPacket, "MQTT-3.2.2.3"),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses_what_decode_would_reject(
    packet: Packet, error: type[MQTTError], rule: str
) -> None:
    with pytest.raises(error) as info:
        encode(packet)
    assert info.value.rule == rule


wild_text = st.text(st.sampled_from(["a", "/", "+", "#", "\x00", "\ud800", "ü", "$"]), max_size=6)


@st.composite
def anything_constructible(draw: st.DrawFn) -> Packet:
    """Packets built from unrestricted text: whatever the dataclasses let through."""
    build = draw(
        st.sampled_from(
            [
                lambda: Publish(draw(wild_text), b"p"),
                lambda: Subscribe(1, ((draw(wild_text), draw(qos_values)),)),
                lambda: Unsubscribe(1, (draw(wild_text),)),
                lambda: Connect(
                    draw(wild_text),
                    will=Will(draw(wild_text), b"w"),
                    username=draw(st.none() | wild_text),
                    protocol_name=draw(st.sampled_from(["MQTT", "MQIsdp", "MQTX"])),
                    protocol_level=draw(st.sampled_from([3, 4])),
                ),
            ]
        )
    )
    return build()


@given(anything_constructible())
@settings(max_examples=1000)
def test_encode_either_refuses_or_round_trips(packet: Packet) -> None:
    """The encoder never emits bytes that the decoder (a peer) would reject."""
    try:
        wire = encode(packet)
    except MalformedPacket:
        return
    if (
        isinstance(packet, Connect)
        and packet.protocol_name == "MQTT"
        and packet.protocol_level != 4
    ):
        if packet.protocol_level == 5:
            return  # a 3.1.1 Connect at level 5 is not a v5 CONNECT (no properties)
        # By design another revision decodes to its level only (the session refuses it).
        packet = Connect(
            "", packet.clean_session, packet.keepalive, protocol_level=packet.protocol_level
        )
    assert decode(wire) == packet


def test_encode_rejects_non_packets() -> None:
    with pytest.raises(TypeError):
        encode("PINGREQ")  # type: ignore[arg-type]


def test_large_publish_uses_four_byte_length() -> None:
    payload = bytes(range(256)) * 8200  # ~2 MiB: remaining length needs 4 bytes
    wire = encode(Publish("big", payload, qos=1, packet_id=3))
    assert wire[1] & 0x80 and wire[2] & 0x80 and wire[3] & 0x80 and not wire[4] & 0x80
    decoder = PacketDecoder()
    for i in range(0, len(wire), 65536):
        decoder.feed(wire[i : i + 65536])
    assert decoder.next_packet() == Publish("big", payload, qos=1, packet_id=3)


def test_mqtt5_connect_with_properties_decodes_as_v5() -> None:
    # An MQTT 5 CONNECT (paho with protocol=MQTTv5): properties length 5, session expiry
    # interval property (0x11) = 0, then client id "c".  The 3.1.1 layout would misparse it.
    data = h("10 13 00 04 4d 51 54 54 05 02 00 3c 05 11 00 00 00 00 00 01 63")
    packet = decode(data)
    assert isinstance(packet, Connect5)
    assert packet.protocol_level == 5
    assert packet == Connect5("c", clean_start=True, keepalive=60, properties=Properties(
        [(PropertyId.SESSION_EXPIRY_INTERVAL, 0)]))
    # The protocol name is still checked first, and level 4 is still parsed in full.
    with pytest.raises(MalformedPacket) as info:
        decode(_connect(0x02, _ID, head=h("00 04 4d 51 54 58"), level=5))
    assert info.value.rule == "MQTT-3.1.2-1"
    with pytest.raises(MalformedPacket) as info:
        decode(data[:8] + b"\x04" + data[9:])
    assert info.value.rule == "MQTT-2.2.3"
