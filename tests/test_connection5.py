"""The sans-IO ``ServerConnection`` speaking MQTT 5.0 (``connection5.V5Link``): bytes in,
events and bytes out, no sockets."""

from __future__ import annotations

import pytest

from mqttring.protocol.codec5 import PacketDecoder5, decode5, encode5
from mqttring.protocol.connection import (
    ConnectRequested,
    DisconnectRequested,
    PublishReceived,
    ServerConnection,
    SubscribeRequested,
)
from mqttring.protocol.connection5 import ServerLimits5
from mqttring.protocol.errors import MQTTError
from mqttring.protocol.packets5 import (
    ConnAck5,
    Connect5,
    Disconnect5,
    PubAck5,
    Publish5,
    SubAck5,
    SubOptions,
    Subscribe5,
    UnsubAck5,
)
from mqttring.protocol.properties import Properties, PropertyId
from mqttring.protocol.session import Session

P = PropertyId


def connected(limits: ServerLimits5 | None = None, client_id: str = "c",
              **props: int) -> ServerConnection:
    conn = ServerConnection(1024, limits) if limits else ServerConnection(1024)
    items = [(P[k.upper()], v) for k, v in props.items()]
    events = conn.receive_data(encode5(Connect5(client_id, properties=Properties(items))))
    assert isinstance(events[0], ConnectRequested)
    conn.accept(Session(client_id or "auto-1", True), False)
    return conn


def out_packets(conn: ServerConnection) -> list[object]:
    decoder = PacketDecoder5()
    decoder.feed(conn.data_to_send())
    return list(decoder)


def test_connack_v5_and_assigned_identifier() -> None:
    conn = connected(client_id="")
    [connack] = out_packets(conn)
    assert isinstance(connack, ConnAck5) and connack.reason_code == 0
    assert connack.properties.get(P.ASSIGNED_CLIENT_IDENTIFIER) == "auto-1"
    assert connack.properties.get(P.MAXIMUM_PACKET_SIZE) == 1024
    assert connack.properties.get(P.SHARED_SUBSCRIPTION_AVAILABLE) == 1
    assert conn.protocol_level == 5


def test_publish_with_properties_and_alias() -> None:
    conn = connected()
    conn.data_to_send()
    alias = Properties([(P.TOPIC_ALIAS, 2), (P.USER_PROPERTY, ("k", "v"))])
    events = conn.receive_data(encode5(Publish5("a/b", b"1", 1, packet_id=1,
                                                properties=alias))
                               + encode5(Publish5("", b"2", 0,
                                                  properties=Properties([(P.TOPIC_ALIAS, 2)]))))
    assert [type(e) for e in events] == [PublishReceived, PublishReceived]
    first, second = (e.message for e in events)  # type: ignore[union-attr]
    assert (first.topic, second.topic) == ("a/b", "a/b")
    assert first.props is not None and first.props.raw == b"\x26\x00\x01k\x00\x01v"
    assert first.props.origin == "c"
    conn.ack_publish(1, 1)
    assert out_packets(conn) == [PubAck5(1)]


@pytest.mark.parametrize(("props", "topic", "code"), [
    ([(P.TOPIC_ALIAS, 0)], "t", 0x94),
    ([(P.TOPIC_ALIAS, 17)], "t", 0x94),
    ([(P.TOPIC_ALIAS, 3)], "", 0x82),
    ([], "", 0x82),
    ([(P.SUBSCRIPTION_IDENTIFIER, 4)], "t", 0x82),
])
def test_bad_publish_disconnects_with_reason(props: list, topic: str, code: int) -> None:
    conn = connected()
    conn.data_to_send()
    with pytest.raises(MQTTError) as info:
        conn.receive_data(encode5(Publish5(topic, b"", properties=Properties(props))))
    assert info.value.reason_code == code
    assert out_packets(conn) == [Disconnect5(code)]
    assert conn.closed


def test_receive_maximum_exceeded() -> None:
    conn = connected(ServerLimits5(receive_maximum=2))
    conn.data_to_send()
    one = [encode5(Publish5("t", b"", 1, packet_id=i)) for i in (1, 2, 3)]
    assert len(conn.receive_data(one[0] + one[1])) == 2
    conn.ack_publish(1, 1)  # a slot frees up
    assert len(conn.receive_data(one[2])) == 1
    with pytest.raises(MQTTError) as info:
        conn.receive_data(encode5(Publish5("t", b"", 2, packet_id=4)))
    assert info.value.reason_code == 0x93
    assert out_packets(conn)[-1] == Disconnect5(0x93)


def test_subscribe_options_and_acks() -> None:
    conn = connected()
    conn.data_to_send()
    [event] = conn.receive_data(encode5(Subscribe5(
        7, (("a/#", SubOptions(1, no_local=True, retain_handling=2)),),
        Properties([(P.SUBSCRIPTION_IDENTIFIER, 9)]))))
    assert event == SubscribeRequested(7, (("a/#", 1),), (0x25,), 9)
    conn.send_suback(7, [1, 0x9E])
    conn.send_unsuback(8, [0x11])
    assert out_packets(conn) == [SubAck5(7, (1, 0x9E)), UnsubAck5(8, (0x11,))]


def test_disconnect_with_reason_and_expiry() -> None:
    conn = connected(session_expiry_interval=60)
    [event] = conn.receive_data(encode5(Disconnect5(0x04, Properties(
        [(P.SESSION_EXPIRY_INTERVAL, 10)]))))
    assert event == DisconnectRequested(0x04, 10)
    assert conn.v5 is not None and conn.v5.session_expiry == 10


def test_disconnect_may_not_revive_a_zero_expiry() -> None:
    conn = connected()
    conn.data_to_send()
    with pytest.raises(MQTTError) as info:
        conn.receive_data(encode5(Disconnect5(0, Properties(
            [(P.SESSION_EXPIRY_INTERVAL, 10)]))))
    assert info.value.reason_code == 0x82


def test_authentication_method_is_refused_with_0x8c() -> None:
    conn = ServerConnection()
    events = conn.receive_data(encode5(Connect5("c", properties=Properties(
        [(P.AUTHENTICATION_METHOD, "SCRAM-SHA-256")]))))
    assert events == []
    assert decode5(conn.data_to_send()) == ConnAck5(False, 0x8C)
    assert conn.closed
