"""Bad MQTT 5.0 input from a raw socket: the reason code the specification assigns, the
connection closed, nothing routed, and the node still serving everyone else."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import BrokerHandle, unique
from mqtt5_support import Paho5, Raw5
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets5 import (
    ConnAck5,
    Connect5,
    Disconnect5,
    PubAck5,
    Publish5,
    PubRec5,
    PubRel5,
)
from mqttring.protocol.properties import Properties, PropertyId


def _publish(topic: bytes, raw_props: bytes, payload: bytes = b"x", qos: int = 0) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic
    if qos:
        body += b"\x00\x01"
    body += bytes((len(raw_props),)) + raw_props + payload
    return bytes((0x30 | qos << 1, len(body))) + body


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


def _disconnected_with(client: Raw5, code: int) -> None:
    packet = client.recv()
    assert isinstance(packet, Disconnect5) and packet.reason_code == code, packet
    # ... and says which rule was broken, in its reason string.
    assert str(packet.properties.get(PropertyId.REASON_STRING)).startswith("[MQTT-"), packet
    assert client.closed(), "the broker must close after its DISCONNECT"


@pytest.mark.parametrize(("raw_props", "topic", "code"), [
    (b"\x23\x00\x00", b"t", 0x94),  # topic alias 0
    (b"\x23\x00\x11", b"t", 0x94),  # topic alias 17, above the maximum of 16
    (b"\x23\x00\x05", b"", 0x82),  # alias never set, empty topic
    (b"", b"", 0x82),  # empty topic, no alias
    (b"\x03\x00\x01a\x03\x00\x01b", b"t", 0x82),  # content type twice
    (b"\x26\x00\x01k\x00\x02\xc3\x28", b"t", 0x81),  # user property value not UTF-8
    (b"\x0b\x05", b"t", 0x82),  # a client may not send a subscription identifier
    (b"\x11\x00\x00\x00\x01", b"t", 0x81),  # not a PUBLISH property: malformed (2.2.2.2)
], ids=["alias0", "alias-above-max", "alias-unknown", "empty-topic", "duplicate",
        "bad-utf8", "subscription-id", "wrong-packet"])
def test_bad_publish_properties(broker: BrokerHandle, raw5: Callable[[], Raw5],
                                raw_props: bytes, topic: bytes, code: int) -> None:
    watcher = Paho5(broker.host, broker.port)
    watcher.connect()
    watcher.subscribe("#", 0)
    client = raw5()
    assert client.connect(unique("bad")).reason_code == 0  # type: ignore[union-attr]
    client.send(_publish(topic, raw_props))
    _disconnected_with(client, code)
    sentinel = unique("sentinel")
    watcher.publish(sentinel, b"s")
    watcher.nothing_before(sentinel)  # nothing of the bad client was routed
    watcher.disconnect()
    _still_serving(broker)


def test_oversized_packet(broker_factory: Callable[..., BrokerHandle]) -> None:
    broker = broker_factory(max_packet_size=1024)
    client = Raw5(broker.host, broker.port)
    try:
        connack = client.connect(unique("big"))
        assert isinstance(connack, ConnAck5)
        assert connack.properties.get(PropertyId.MAXIMUM_PACKET_SIZE) == 1024
        client.send(encode5(Publish5("t", b"x" * 2000)))
        _disconnected_with(client, 0x95)
    finally:
        client.close()
    _still_serving(broker)


def test_receive_maximum_exceeded(broker: BrokerHandle, raw5: Callable[[], Raw5]) -> None:
    client = raw5()
    connack = client.connect(unique("flood"))
    maximum = connack.properties.get(PropertyId.RECEIVE_MAXIMUM)  # type: ignore[union-attr]
    assert isinstance(maximum, int)
    flood = b"".join(encode5(Publish5("t/flood", b"x", 1, packet_id=i + 1))
                     for i in range(maximum + 1))
    client.send(flood)
    while True:  # acknowledgements may come first; then the DISCONNECT
        packet = client.recv()
        if not isinstance(packet, PubAck5):
            break
    assert isinstance(packet, Disconnect5) and packet.reason_code == 0x93, packet
    assert client.closed()
    _still_serving(broker)


def test_the_reason_arrives_while_the_client_keeps_sending(broker: BrokerHandle,
                                                          raw5: Callable[[], Raw5]) -> None:
    """A QoS 2 client answers each PUBREC with a PUBREL while the broker closes on it for
    exceeding its Receive Maximum (as Paho's ``test_flow_control2`` does): every PUBREL
    must be taken, and the connection end in a close, not a reset: closing a socket with
    unread bytes resets it, and a client whose write then fails (Paho's test client, 4 runs
    in 5) never reads the DISCONNECT 0x93 that says why."""
    for round_ in range(5):
        client = raw5()
        connack = client.connect(unique(f"flood-on-{round_}"))
        maximum = connack.properties.get(PropertyId.RECEIVE_MAXIMUM)  # type: ignore[union-attr]
        assert isinstance(maximum, int)
        for i in range(maximum + 1):  # one write each, so PUBRECs flow back meanwhile
            client.send(encode5(Publish5("t/flood-on", b"x", 2, packet_id=i + 1)))
        packet = client.recv()
        while isinstance(packet, PubRec5):
            client.send(encode5(PubRel5(packet.packet_id)))  # raises if the broker reset us
            packet = client.recv()
        assert isinstance(packet, Disconnect5) and packet.reason_code == 0x93, packet
        assert client.closed()
        client.close()
    _still_serving(broker)


def test_unsupported_authentication_method(broker: BrokerHandle, raw5: Callable[[], Raw5]
                                           ) -> None:
    client = raw5()
    client.send(encode5(Connect5(unique("auth"), properties=Properties(
        [(PropertyId.AUTHENTICATION_METHOD, "SCRAM-SHA-1")]))))
    assert client.recv() == ConnAck5(False, 0x8C, Properties(
        [(PropertyId.REASON_STRING, "no enhanced authentication method is supported")]))
    assert client.closed()
    _still_serving(broker)


@pytest.mark.parametrize(("options", "code"), [
    (0x30, 0x82),  # Retain Handling 3: a Protocol Error (3.8.3.1)
    (0x03, 0x82),  # Maximum QoS 3: a Protocol Error (3.8.3.1)
    (0x40, 0x81),  # a reserved bit: a Malformed Packet [MQTT-3.8.3-5]
])
def test_bad_subscription_options(broker: BrokerHandle, raw5: Callable[[], Raw5],
                                  options: int, code: int) -> None:
    """Retain Handling 3 and QoS 3 are Protocol Errors, a reserved bit a Malformed Packet
    (a probe got 0x81 for Retain Handling 3, as from mosquitto 2.0.11)."""
    client = raw5()
    client.connect(unique("subopt"))
    body = b"\x00\x01\x00" + b"\x00\x01t" + bytes((options,))
    client.send(bytes((0x82, len(body))) + body)
    _disconnected_with(client, code)
    _still_serving(broker)


def test_auth_packet_without_method_is_a_protocol_error(
        broker: BrokerHandle, raw5: Callable[[], Raw5]) -> None:
    client = raw5()
    client.connect(unique("auth"))
    client.send(b"\xf0\x00")
    _disconnected_with(client, 0x82)
    _still_serving(broker)


def test_keep_alive_timeout_says_0x8d(broker: BrokerHandle, raw5: Callable[[], Raw5]) -> None:
    client = raw5()
    client.send(encode5(Connect5(unique("ka"), keepalive=1)))
    assert isinstance(client.recv(), ConnAck5)
    # Silent past 1.5 x the keep-alive: the broker says why, then closes.
    assert client.recv(timeout=10) == Disconnect5(0x8D, Properties(
        [(PropertyId.REASON_STRING, "keep alive timeout")]))
    assert client.closed()


def test_malformed_v5_connect_is_closed(broker: BrokerHandle, raw5: Callable[[], Raw5]) -> None:
    """A CONNECT whose property set repeats a unique property: no session, closed (a
    CONNACK with a reason code is optional before a connection is established)."""
    client = raw5()
    props = b"\x11\x00\x00\x00\x05\x11\x00\x00\x00\x06"  # session expiry interval twice
    body = b"\x00\x04MQTT\x05\x02\x00\x3c" + bytes((len(props),)) + props + b"\x00\x01c"
    client.send(bytes((0x10, len(body))) + body)
    try:
        packet = client.recv()
        assert isinstance(packet, ConnAck5) and packet.reason_code >= 0x80
    except ConnectionError:
        pass  # closed without a CONNACK
    assert client.closed()
    _still_serving(broker)


def test_a_bad_packet_in_the_same_write_as_connect_says_why(broker: BrokerHandle,
                                                           raw5: Callable[[], Raw5]) -> None:
    """A topic alias of 0 sent in the same write as the CONNECT: CONNACK, then DISCONNECT
    0x94 with the rule, as when it comes later [MQTT-4.13.1-1] (it was an internal error,
    a CONNACK and a bare close)."""
    client = raw5()
    client.send(encode5(Connect5(client_id=unique("piped"))) + _publish(b"t", b"\x23\x00\x00"))
    connack = client.recv()
    assert isinstance(connack, ConnAck5) and connack.reason_code == 0, connack
    _disconnected_with(client, 0x94)
    _still_serving(broker)
