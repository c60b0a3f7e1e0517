"""The sans-IO ``ServerConnection`` speaking MQTT 5.0 (``connection5.V5Link``): bytes in,
events and bytes out, no sockets."""

from __future__ import annotations

import pytest

from mqttring.protocol.codec import decode, encode
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
from mqttring.protocol.message import Message
from mqttring.protocol.packets import ConnAck, Connect
from mqttring.protocol.packets5 import (
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
)
from mqttring.protocol.properties import Properties, PropertyId
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import V5Session

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
    # The reason string says which rule was broken.
    assert out_packets(conn) == [Disconnect5(code, Properties(
        [(P.REASON_STRING, str(info.value))]))]
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
    assert out_packets(conn)[-1].reason_code == 0x93


def test_subscribe_options_and_acks() -> None:
    conn = connected()
    conn.data_to_send()
    [event] = conn.receive_data(encode5(Subscribe5(
        7, (("a/#", SubOptions(1, no_local=True, retain_handling=2)),),
        Properties([(P.SUBSCRIPTION_IDENTIFIER, 9)]))))
    assert event == SubscribeRequested(7, (("a/#", 1),), (0x25,), 9)
    conn.send_suback(7, [1, 0x9E])
    conn.send_unsuback(8, [0x11])
    assert out_packets(conn) == [
        SubAck5(7, (1, 0x9E), Properties([(P.REASON_STRING,
                                           "shared subscriptions not supported")])),
        UnsubAck5(8, (0x11,))]  # 0x11 is no failure: no reason string


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
    assert decode5(conn.data_to_send()) == ConnAck5(False, 0x8C, Properties(
        [(P.REASON_STRING, "no enhanced authentication method is supported")]))
    assert conn.closed


# -- Server Keep Alive, Response Information, reason strings, acks, shares ---------------


def test_server_keep_alive_overrides_0_and_too_long() -> None:
    """[MQTT-3.2.2-21/22]: the CONNACK names the keep alive the server holds the client to."""
    for asked, told in ((100, 60), (0, 60), (30, None)):
        conn = ServerConnection(1024, max_keepalive=60)
        conn.receive_data(encode5(Connect5("c", keepalive=asked)))
        conn.accept(Session("c", True), False)
        [connack] = out_packets(conn)
        assert connack.properties.get(P.SERVER_KEEP_ALIVE) == told  # type: ignore[attr-defined]
        assert conn.keepalive == (told if told is not None else asked)
    conn = ServerConnection(1024)  # the default max_keepalive 65535 changes nothing
    conn.receive_data(encode5(Connect5("c", keepalive=0)))
    conn.accept(Session("c", True), False)
    assert P.SERVER_KEEP_ALIVE not in out_packets(conn)[0].properties  # type: ignore[attr-defined]
    assert conn.keepalive == 0


def test_max_keepalive_refuses_a_311_client_as_mosquitto() -> None:
    for asked, refused in ((100, True), (0, True), (60, False)):
        conn = ServerConnection(1024, max_keepalive=60)
        events = conn.receive_data(encode(Connect("c", keepalive=asked)))
        if refused:
            assert events == [] and conn.closed
            assert decode(conn.data_to_send()) == ConnAck(False, 2)
        else:
            assert isinstance(events[0], ConnectRequested)


def test_response_information_only_on_request() -> None:
    limits = ServerLimits5(response_information="replies/")
    asked = connected(limits, request_response_information=1)
    assert out_packets(asked)[0].properties.get(  # type: ignore[attr-defined]
        P.RESPONSE_INFORMATION) == "replies/"
    for conn in (connected(limits), connected(limits, request_response_information=0),
                 connected(request_response_information=1)):  # none configured
        assert P.RESPONSE_INFORMATION not in out_packets(conn)[0].properties  # type: ignore[attr-defined]


def test_reason_strings_follow_request_problem_information() -> None:
    quiet = connected(request_problem_information=0)
    quiet.data_to_send()
    quiet.send_suback(1, [0x87])
    quiet.ack_publish(2, 1, 0x87)
    assert out_packets(quiet) == [SubAck5(1, (0x87,)), PubAck5(2, 0x87)]
    told = connected()
    told.data_to_send()
    told.send_suback(1, [0, 0x87, 0x97])
    told.ack_publish(2, 1, 0x87)
    assert out_packets(told) == [
        SubAck5(1, (0, 0x87, 0x97), Properties(
            [(P.REASON_STRING, "not authorized; quota exceeded")])),
        PubAck5(2, 0x87, Properties([(P.REASON_STRING, "not authorized")]))]
    # DISCONNECT (and CONNACK) carry one whatever the client asked [MQTT-3.1.2-29].
    quiet.disconnect(0x98)
    assert out_packets(quiet) == [Disconnect5(0x98, Properties(
        [(P.REASON_STRING, "disconnected by an administrator")]))]


def test_a_reason_string_never_makes_a_packet_too_large() -> None:
    """[MQTT-3.1.2-25]: the string is left out rather than exceed Maximum Packet Size.
    (16 bytes: the smallest CONNACK this node sends is 13, ``_fitted_connack``.)"""
    conn = connected(maximum_packet_size=16)
    conn.data_to_send()
    conn.send_suback(1, [0x87])
    conn.disconnect(0x98)
    assert out_packets(conn) == [SubAck5(1, (0x87,)), Disconnect5(0x98)]
    refused = ServerConnection()
    refused.receive_data(encode5(Connect5("c", properties=Properties(
        [(P.AUTHENTICATION_METHOD, "x"), (P.MAXIMUM_PACKET_SIZE, 10)]))))
    assert decode5(refused.data_to_send()) == ConnAck5(False, 0x8C)


def test_a_failed_pubrec_from_the_client_ends_the_delivery() -> None:
    conn = connected()
    session = conn.session
    assert session is not None
    session.v5 = V5Session("c")
    session.deliver(Message("t", b"q2", 2), 2)
    [publish] = [p for p in out_packets(conn) if isinstance(p, Publish5)]
    conn.receive_data(encode5(PubRec5(publish.packet_id, 0x80)))  # type: ignore[arg-type]
    assert out_packets(conn) == []  # no PUBREL (section 4.3.3)
    assert not session.inflight


def test_a_failed_puback_from_the_client_completes_the_message() -> None:
    conn = connected()
    session = conn.session
    assert session is not None
    session.v5 = V5Session("c")
    session.deliver(Message("t", b"q1", 1), 1)
    [publish] = [p for p in out_packets(conn) if isinstance(p, Publish5)]
    conn.receive_data(encode5(PubAck5(publish.packet_id, 0x83)))  # type: ignore[arg-type]
    assert not session.inflight


def test_a_pubrel_for_an_unknown_id_is_completed_with_success() -> None:
    """A client that lost our PUBCOMP resends PUBREL on its next connection; the id is free
    by then.  PUBCOMP 0 (as mosquitto), not 0x92, which MQTT.js reports as a failed
    publish of a message delivered once (mosquitto's 03-publish-c2b-disconnect-qos2.py)."""
    conn = connected()
    conn.data_to_send()
    conn.receive_data(encode5(Publish5("t", b"", 2, packet_id=7)))
    conn.ack_publish(7, 2)
    assert out_packets(conn) == [PubRec5(7)]
    conn.receive_data(encode5(PubRel5(7)))
    conn.receive_data(encode5(PubRel5(7)))  # again, as after a lost PUBCOMP
    assert out_packets(conn) == [PubComp5(7), PubComp5(7)]
    assert conn.v5 is not None and conn.v5.inbound == 0


def test_a_failed_pubrec_we_send_frees_the_inbound_id() -> None:
    conn = connected()
    conn.data_to_send()
    [event] = conn.receive_data(encode5(Publish5("t", b"", 2, packet_id=5)))
    assert isinstance(event, PublishReceived)
    conn.ack_publish(5, 2, 0x87)
    assert out_packets(conn)[0] == PubRec5(5, 0x87, Properties(
        [(P.REASON_STRING, "not authorized")]))
    assert conn.session is not None and 5 not in conn.session.inbound_qos2
    assert conn.v5 is not None and conn.v5.inbound == 0


def test_no_local_on_a_shared_subscription_is_a_protocol_error() -> None:
    conn = connected()
    conn.data_to_send()
    with pytest.raises(MQTTError) as info:
        conn.receive_data(encode5(Subscribe5(1, (("$share/g/t", SubOptions(1, True)),))))
    assert info.value.reason_code == 0x82 and "MQTT-3.8.3-4" in str(info.value)
    assert out_packets(conn)[0].reason_code == 0x82  # type: ignore[attr-defined]


def test_outbound_alias_maximum_is_the_smaller_of_both() -> None:
    ours = ServerLimits5(topic_alias_maximum_out=4)
    assert connected(ours, topic_alias_maximum=10).v5.client_alias_max == 4  # type: ignore[union-attr]
    assert connected(ours, topic_alias_maximum=2).v5.client_alias_max == 2  # type: ignore[union-attr]
    assert connected(ours).v5.client_alias_max == 0  # type: ignore[union-attr]
    assert connected(topic_alias_maximum=10).v5.client_alias_max == 0  # type: ignore[union-attr]


def test_a_detail_that_is_not_utf8_leaves_the_reason_string_out() -> None:
    conn = connected()
    conn.data_to_send()
    conn.disconnect(0x82, "bad \ud800 topic")
    assert out_packets(conn) == [Disconnect5(0x82)]
