"""MQTT 5.0 property sets a node refuses, over a real socket: more User Properties than
``limits.max_user_properties`` (0x97; 140,000 of them in one PUBLISH held the event loop for
seconds), a wildcard or empty Response Topic (0x82, never relayed), Authentication Data
without a method (CONNACK 0x82) and non-minimal Variable Byte Integers (0x81).  Each time the
node goes on serving everyone else."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import BrokerHandle, unique
from mqtt5_support import Paho5, Raw5, props
from mqttring.protocol.packets5 import ConnAck5, Disconnect5
from mqttring.protocol.properties import PropertyId

LIMIT = 128  # the default of limits.max_user_properties


def _vbi(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | 0x80 if value else byte)
        if not value:
            return bytes(out)


def _packet(first: int, body: bytes) -> bytes:
    return bytes((first,)) + _vbi(len(body)) + body


def _user_props(count: int) -> bytes:
    return b"\x26\x00\x01k\x00\x01v" * count


def _publish(topic: str, raw_props: bytes, payload: bytes = b"x") -> bytes:
    name = topic.encode()
    return _packet(0x30, len(name).to_bytes(2, "big") + name + _vbi(len(raw_props))
                   + raw_props + payload)


def _connect(client_id: str, raw_props: bytes, will: bytes | None = None) -> bytes:
    cid = client_id.encode()
    body = (b"\x00\x04MQTT\x05" + bytes((0x06 if will is not None else 0x02,)) + b"\x00\x3c"
            + _vbi(len(raw_props)) + raw_props + len(cid).to_bytes(2, "big") + cid)
    if will is not None:
        body += _vbi(len(will)) + will + b"\x00\x03w/t" + b"\x00\x01x"
    return _packet(0x10, body)


def _disconnected_with(client: Raw5, code: int) -> None:
    packet = client.recv()
    assert isinstance(packet, Disconnect5) and packet.reason_code == code, packet
    assert str(packet.properties.get(PropertyId.REASON_STRING)).startswith("[MQTT-"), packet
    assert client.closed(), "the broker must close after its DISCONNECT"


def _refused_connect(client: Raw5, code: int) -> None:
    packet = client.recv()
    assert isinstance(packet, ConnAck5) and packet.reason_code == code, packet
    assert client.closed(), "the broker must close after refusing the CONNECT"


def _still_serving(broker: BrokerHandle) -> None:
    topic = unique("alive")
    client = Paho5(broker.host, broker.port)
    try:
        client.connect()
        client.subscribe(topic, 1)
        client.publish(topic, b"ok", 1)
        assert client.get().payload == b"ok"
    finally:
        client.disconnect()


def _watcher(broker: BrokerHandle) -> Paho5:
    watcher = Paho5(broker.host, broker.port)
    watcher.connect()
    watcher.subscribe("#", 0)
    return watcher


def _nothing_routed(watcher: Paho5) -> None:
    sentinel = unique("sentinel")
    watcher.publish(sentinel, b"s")
    watcher.nothing_before(sentinel)
    watcher.disconnect()


def test_a_publish_with_140000_user_properties_is_refused(broker: BrokerHandle,
                                                          raw5: Callable[[], Raw5]) -> None:
    """The fuzz probe's packet: it fits the default 1 MiB, and decoding it whole held the
    event loop for seconds.  Now it is refused at the 129th property with 0x97."""
    watcher = _watcher(broker)
    client = raw5()
    assert client.connect(unique("flood")).reason_code == 0  # type: ignore[union-attr]
    client.send(_publish("junk/t", _user_props(140_000)))
    _disconnected_with(client, 0x97)
    _nothing_routed(watcher)
    _still_serving(broker)


def test_user_properties_up_to_the_limit_are_relayed(broker: BrokerHandle,
                                                     raw5: Callable[[], Raw5]) -> None:
    topic = unique("many")
    watcher = Paho5(broker.host, broker.port)
    watcher.connect()
    watcher.subscribe(topic, 0)
    client = raw5()
    assert client.connect(unique("pub")).reason_code == 0  # type: ignore[union-attr]
    client.send(_publish(topic, _user_props(LIMIT)))
    message = watcher.get()
    assert message.topic == topic and message.properties.UserProperty == [("k", "v")] * LIMIT
    watcher.disconnect()


def test_the_limit_is_configurable(broker_factory: Callable[..., BrokerHandle]) -> None:
    broker = broker_factory(max_user_properties=4)
    topic = unique("four")
    watcher = _watcher(broker)
    client = Raw5(broker.host, broker.port)
    try:
        assert client.connect(unique("cfg")).reason_code == 0  # type: ignore[union-attr]
        client.send(_publish(topic, _user_props(4), b"four"))
        assert watcher.get().payload == b"four"
        client.send(_publish(topic, _user_props(5), b"five"))
        _disconnected_with(client, 0x97)
    finally:
        client.close()
    refused = Raw5(broker.host, broker.port)
    try:  # the CONNECT is decoded before the connection knows it speaks v5: limited too
        refused.send(_connect(unique("cfgc"), _user_props(5)))
        _refused_connect(refused, 0x97)
    finally:
        refused.close()
    sentinel = unique("sentinel")
    watcher.publish(sentinel, b"s")
    watcher.nothing_before(sentinel)
    watcher.disconnect()


@pytest.mark.parametrize("where", ["connect", "will"])
def test_a_connect_over_the_limit_gets_connack_0x97(broker: BrokerHandle,
                                                    raw5: Callable[[], Raw5],
                                                    where: str) -> None:
    client = raw5()
    if where == "connect":
        client.send(_connect(unique("big"), _user_props(LIMIT + 1)))
    else:
        client.send(_connect(unique("bigwill"), b"", will=_user_props(LIMIT + 1)))
    _refused_connect(client, 0x97)
    _still_serving(broker)


@pytest.mark.parametrize(("name", "packet"), [
    ("subscribe", _packet(0x82, b"\x00\x01" + _vbi(7 * (LIMIT + 1)) + _user_props(LIMIT + 1)
                          + b"\x00\x01a\x00")),
    ("disconnect", _packet(0xE0, b"\x00" + _vbi(7 * (LIMIT + 1)) + _user_props(LIMIT + 1))),
])
def test_other_packets_over_the_limit_get_disconnect_0x97(
        broker: BrokerHandle, raw5: Callable[[], Raw5], name: str, packet: bytes) -> None:
    client = raw5()
    assert client.connect(unique(name)).reason_code == 0  # type: ignore[union-attr]
    client.send(packet)
    _disconnected_with(client, 0x97)


@pytest.mark.parametrize("topic", [b"r/#/+", b"r/+", b"#", b""],
                         ids=["both", "plus", "hash", "empty"])
def test_a_response_topic_that_is_not_a_topic_name_is_a_protocol_error(
        broker: BrokerHandle, raw5: Callable[[], Raw5], topic: bytes) -> None:
    """[MQTT-3.3.2-14] no wildcards, [MQTT-4.7.3-1] not empty: DISCONNECT 0x82, and the
    message is not relayed (it was, to every subscriber)."""
    watcher = _watcher(broker)
    client = raw5()
    assert client.connect(unique("resp")).reason_code == 0  # type: ignore[union-attr]
    client.send(_publish("l/t", b"\x08" + len(topic).to_bytes(2, "big") + topic))
    _disconnected_with(client, 0x82)
    _nothing_routed(watcher)


def test_a_will_with_a_wildcard_response_topic_is_refused(broker: BrokerHandle,
                                                          raw5: Callable[[], Raw5]) -> None:
    """A protocol error of the CONNECT: closed without a session (mosquitto 2.0.11 closes
    without a CONNACK too), and no will is ever published."""
    watcher = _watcher(broker)
    client = raw5()
    client.send(_connect(unique("willresp"), b"", will=b"\x08\x00\x03r/+"))
    try:
        packet = client.recv()
        assert isinstance(packet, ConnAck5) and packet.reason_code >= 0x80, packet
    except ConnectionError:
        pass  # closed without a CONNACK
    assert client.closed()
    _nothing_routed(watcher)


def test_a_valid_response_topic_is_relayed(broker: BrokerHandle) -> None:
    topic = unique("req")
    watcher = Paho5(broker.host, broker.port)
    watcher.connect()
    watcher.subscribe(topic, 0)
    publisher = Paho5(broker.host, broker.port)
    publisher.connect()
    publisher.publish(topic, b"q", 0, properties=props(3, ResponseTopic="reply/x"))
    assert watcher.get().properties.ResponseTopic == "reply/x"
    publisher.disconnect()
    watcher.disconnect()


def test_authentication_data_without_a_method_gets_connack_0x82(
        broker: BrokerHandle, raw5: Callable[[], Raw5]) -> None:
    """Section 3.1.2.11.10 makes it a Protocol Error; it was CONNACK 0 (mosquitto 2.0.11
    accepts it too)."""
    client = raw5()
    client.send(_connect(unique("authdata"), b"\x16\x00\x06secret"))
    _refused_connect(client, 0x82)
    _still_serving(broker)


def test_a_non_minimal_property_length_is_malformed(broker: BrokerHandle,
                                                    raw5: Callable[[], Raw5]) -> None:
    """``80 00`` for a property length of 0 [MQTT-1.5.5-1]: DISCONNECT 0x81, as mosquitto,
    and as the same encoding in the Remaining Length already was."""
    client = raw5()
    assert client.connect(unique("vbi")).reason_code == 0  # type: ignore[union-attr]
    client.send(_packet(0x30, b"\x00\x03l/t\x80\x00x"))
    _disconnected_with(client, 0x81)


def test_a_non_minimal_subscription_identifier_is_malformed(broker: BrokerHandle,
                                                            raw5: Callable[[], Raw5]) -> None:
    client = raw5()
    assert client.connect(unique("subid")).reason_code == 0  # type: ignore[union-attr]
    client.send(_packet(0x82, b"\x00\x01\x03\x0b\x81\x00\x00\x03a/b\x00"))
    _disconnected_with(client, 0x81)


def test_a_connect_with_a_non_minimal_property_length_is_closed(
        broker: BrokerHandle, raw5: Callable[[], Raw5]) -> None:
    client = raw5()
    client.send(_packet(0x10, b"\x00\x04MQTT\x05\x02\x00\x3c\x80\x00\x00\x02lx"))
    try:
        packet = client.recv()
        assert isinstance(packet, ConnAck5) and packet.reason_code >= 0x80, packet
    except ConnectionError:
        pass  # closed without a CONNACK, as mosquitto closes it
    assert client.closed()
    _still_serving(broker)
