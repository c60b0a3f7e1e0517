"""The per-connection machine: CONNECT rules, automatic answers, pipelining, violations."""

from __future__ import annotations

import pytest

from mqttring.protocol.codec import PacketDecoder, encode
from mqttring.protocol.connection import (
    ConnectRequested,
    DisconnectRequested,
    PublishReceived,
    ServerConnection,
    SubscribeRequested,
)
from mqttring.protocol.errors import ProtocolViolation
from mqttring.protocol.packets import (
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    PingReq,
    PingResp,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
)
from mqttring.protocol.session import Session


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


def test_packets_pipelined_behind_connect_wait_for_the_decision():
    conn = ServerConnection()
    data = encode(Connect("c1")) + encode(Subscribe(1, (("a/#", 1),))) + encode(PingReq())
    events = conn.receive_data(data)
    assert [type(e) for e in events] == [ConnectRequested]
    more = conn.accept(Session("c1", True), False)
    assert more == [SubscribeRequested(1, (("a/#", 1),))]
    assert read(conn) == [ConnAck(False), PingResp()]
    conn.send_suback(1, [1])
    assert read(conn) == [SubAck(1, (1,))]


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


def test_server_only_packets_from_a_client_are_violations():
    conn = connected()
    with pytest.raises(ProtocolViolation):
        conn.receive_data(encode(ConnAck(False)))


def test_disconnect_closes_cleanly():
    conn = connected()
    assert conn.receive_data(encode(Disconnect())) == [DisconnectRequested()]
    assert conn.closed
    assert conn.receive_data(encode(PingReq())) == []
