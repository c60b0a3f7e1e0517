"""The per-connection machine: CONNECT rules, automatic answers, pipelining, violations."""

from __future__ import annotations

import pytest

from mqttring.protocol.codec import PacketDecoder, encode
from mqttring.protocol.connection import (
    ConnectRequested,
    DisconnectRequested,
    PingRequested,
    PublishReceived,
    ServerConnection,
    SubscribeRequested,
)
from mqttring.protocol.errors import MalformedPacket, MQTTError, ProtocolViolation
from mqttring.protocol.message import Message
from mqttring.protocol.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
)
from mqttring.protocol.session import Session, SessionLimits


def read(conn: ServerConnection) -> list:
    decoder = PacketDecoder()
    decoder.feed(conn.data_to_send())
    return list(decoder)


def connected(clean: bool = True) -> ServerConnection:
    conn = ServerConnection()
    [event] = conn.receive_data(encode(Connect("c1", clean_session=clean)))
    assert isinstance(event, ConnectRequested)
    conn.accept(Session("c1", clean), session_present=False)
    assert read(conn) == [ConnAck(False, ConnectReturnCode.ACCEPTED)]
    return conn


def test_first_packet_must_be_connect():
    with pytest.raises(ProtocolViolation) as err:
        ServerConnection().receive_data(encode(PingReq()))
    assert err.value.rule == "MQTT-3.1.0-1"


def test_second_connect_is_a_violation():
    conn = connected()
    with pytest.raises(ProtocolViolation) as err:
        conn.receive_data(encode(Connect("c1")))
    assert err.value.rule == "MQTT-3.1.0-2"


def test_wrong_protocol_level_gets_code_1_and_closes():
    conn = ServerConnection()
    assert conn.receive_data(encode(Connect("c1", protocol_level=3))) == []
    assert read(conn) == [ConnAck(False, ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION)]
    assert conn.closed


def test_empty_client_id_needs_clean_session():
    conn = ServerConnection()
    conn.receive_data(encode(Connect("", clean_session=False)))
    assert read(conn) == [ConnAck(False, ConnectReturnCode.IDENTIFIER_REJECTED)]
    assert conn.closed


def test_session_present_is_never_set_for_a_clean_session():
    conn = ServerConnection()
    conn.receive_data(encode(Connect("c1")))
    conn.accept(Session("c1", True), session_present=True)
    assert read(conn) == [ConnAck(False)]


@pytest.mark.parametrize("name,level,flag", [("MQTT", 4, True), ("MQIsdp", 3, False)])
def test_session_present_is_only_said_to_mqtt_311(name: str, level: int, flag: bool):
    """MQTT 3.1 (MQIsdp, level 3) has no session present flag: the byte is reserved and 0
    (mosquitto's ``03-publish-c2b-disconnect-qos2.py``)."""
    conn = ServerConnection()
    conn.receive_data(encode(Connect("c1", clean_session=False, protocol_name=name,
                                     protocol_level=level)))
    conn.accept(Session("c1", False), session_present=True)
    assert read(conn) == [ConnAck(flag)]


def test_packets_pipelined_behind_connect_wait_for_the_decision():
    conn = ServerConnection()
    data = encode(Connect("c1")) + encode(Subscribe(1, (("a/#", 1),))) + encode(PingReq())
    events = conn.receive_data(data)
    assert [type(e) for e in events] == [ConnectRequested]
    more = conn.accept(Session("c1", True), False)
    assert more[0] == SubscribeRequested(1, (("a/#", 1),))
    assert [type(e) for e in more] == [SubscribeRequested, PingRequested]
    assert read(conn) == [ConnAck(False)]
    conn.send_suback(1, [1])
    conn.send_pingresp(more[1])  # its answer follows the SUBACK: the broker's call
    conn.send_pingresp(more[1])  # once only
    assert read(conn) == [SubAck(1, (1,)), PingResp()]


def test_qos2_redelivery_is_acknowledged_not_routed_again():
    conn = connected()
    first = conn.receive_data(encode(Publish("t", b"x", 2, packet_id=5)))
    assert isinstance(first[0], PublishReceived)
    conn.ack_publish(5, 2)
    assert read(conn) == [PubRec(5)]
    assert conn.receive_data(encode(Publish("t", b"x", 2, dup=True, packet_id=5))) == []
    assert read(conn) == [PubRec(5)]
    conn.receive_data(encode(PubRel(5)))
    assert read(conn) == [PubComp(5)]
    again = conn.receive_data(encode(Publish("t", b"y", 2, packet_id=5)))
    assert isinstance(again[0], PublishReceived), "after PUBREL the id may be reused"


@pytest.mark.parametrize("name,level", [("MQIsdp", 3), ("MQTT", 4)])
def test_an_mqtt31_client_may_resend_pubrel_and_subscribe_with_dup_set(name: str, level: int):
    """MQTT 3.1 sent PUBREL, SUBSCRIBE and UNSUBSCRIBE as QoS 1 packets, DUP set on a resend
    (mosquitto's ``03-publish-c2b-disconnect-qos2.py``); 3.1.1 fixed their flags to 0b0010,
    so the same bytes from a 3.1.1 client break [MQTT-2.2.2-1] and close it."""
    conn = ServerConnection()
    conn.receive_data(encode(Connect("c1", protocol_name=name, protocol_level=level)))
    conn.accept(Session("c1", True), session_present=False)
    read(conn)
    pubrel = bytes([0x6A]) + encode(PubRel(5))[1:]
    subscribe = bytes([0x8A]) + encode(Subscribe(1, (("a/#", 1),)))[1:]
    if level == 4:
        with pytest.raises(MalformedPacket) as err:
            conn.receive_data(pubrel)
        assert err.value.rule == "MQTT-2.2.2-1"
        return
    assert conn.receive_data(pubrel) == []
    assert read(conn) == [PubComp(5)]
    assert conn.receive_data(subscribe) == [SubscribeRequested(1, (("a/#", 1),))]


def test_server_only_packets_from_a_client_are_violations():
    conn = connected()
    with pytest.raises(ProtocolViolation):
        conn.receive_data(encode(ConnAck(False)))


def test_disconnect_closes_cleanly():
    conn = connected()
    assert conn.receive_data(encode(Disconnect())) == [DisconnectRequested()]
    assert conn.closed
    assert conn.receive_data(encode(PingReq())) == []


def test_puback_in_the_same_read_as_publishes_is_applied_and_refills_the_window():
    # The open connection's path: the decoder hands PUBACK and PUBLISH to the connection's
    # handlers; the session must see the same as through packets, in the same read.
    conn = ServerConnection()
    conn.receive_data(encode(Connect("c1")))
    session = Session("c1", True, SessionLimits(max_inflight=1))
    conn.accept(session, session_present=False)
    read(conn)
    for n in range(3):
        session.deliver(Message("t", bytes([n]), 1), 1)
    [first] = read(conn)
    assert isinstance(first, Publish) and first.payload == b"\x00"
    received, published = conn.packets_received, conn.publishes_received
    events = conn.receive_data(encode(Publish("a/b", b"p", 1, packet_id=9))
                               + encode(PubAck(first.packet_id))
                               + encode(PubAck(999))  # unknown id: ignored
                               + encode(Publish("a/c", b"q", 0)))
    assert [(type(e), e.message.topic, e.packet_id) for e in events] == [
        (PublishReceived, "a/b", 9), (PublishReceived, "a/c", None)]
    [second] = read(conn)
    assert second.payload == b"\x01", "the freed slot is refilled once, after the read"
    assert list(session.inflight) == [second.packet_id] and len(session.queue) == 1
    assert (conn.packets_received - received, conn.publishes_received - published) == (4, 2)


@pytest.mark.parametrize(("wire", "rule"), [
    (bytes.fromhex("40 03 00 01 00"), "MQTT-2.2.3"),   # remaining length 3
    (bytes.fromhex("40 02 00 00"), "MQTT-2.3.1-1"),    # packet id 0
    (bytes.fromhex("41 02 00 01"), "MQTT-2.2.2-1"),    # reserved flags set
])
def test_malformed_puback_on_an_open_connection_breaks_its_rule(wire: bytes, rule: str):
    conn = connected()
    with pytest.raises(MQTTError) as info:
        conn.receive_data(encode(Publish("a", b"x", 1, packet_id=1)) + wire)
    assert isinstance(info.value, MalformedPacket)
    assert info.value.rule == rule


def test_a_batch_of_publishes_is_acknowledged_in_order_as_one_by_one():
    """``ack_publishes`` (the core's path for a batch) answers as ``ack_publish`` would for
    each: PUBACK/PUBREC in the PUBLISHes' order, nothing for QoS 0, and a QoS 2 id then
    known as answered (its resend is acknowledged, not routed again)."""
    sent = [Publish("t", b"a", 1, packet_id=3), Publish("t", b"b", 0),
            Publish("u", b"c", 1, packet_id=1), Publish("t", b"d", 2, packet_id=9),
            Publish("t", b"e", 1, packet_id=2)]
    batch, one_by_one = connected(), connected()
    events = batch.receive_data(b"".join(encode(p) for p in sent))
    assert [type(e) for e in events] == [PublishReceived] * 5
    batch.ack_publishes(events)
    for event in one_by_one.receive_data(b"".join(encode(p) for p in sent)):
        one_by_one.ack_publish(event.packet_id, event.message.qos)
    answers = read(batch)
    assert answers == read(one_by_one) == [PubAck(3), PubAck(1), PubRec(9), PubAck(2)]
    assert batch.receive_data(encode(Publish("t", b"d", 2, dup=True, packet_id=9))) == []
    assert read(batch) == [PubRec(9)]
    # Without a QoS 2 among them: the loop of its own.
    plain = connected()
    plain.ack_publishes(plain.receive_data(b"".join(
        encode(Publish("t", bytes([i]), 1, packet_id=i + 1)) for i in range(40))))
    assert read(plain) == [PubAck(i + 1) for i in range(40)]
