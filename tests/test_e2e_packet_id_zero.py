"""Packet identifier 0 on a PUBLISH (QoS 1/2), SUBSCRIBE or UNSUBSCRIBE, end to end.

MQTT 5: DISCONNECT with 0x82 Protocol Error [MQTT-2.2.1-3] (section 4.13), as mosquitto
answers, then the connection closes; it was 0x81 Malformed Packet.  MQTT 3.1.1: the
connection just closes, as before.  Nothing is routed either way.
"""

from __future__ import annotations

import pytest

from conftest import BrokerHandle, unique
from mqtt5_support import Raw5
from mqtt_client import connect, mqtt_string, packet
from mqttring.protocol.packets5 import Disconnect5
from mqttring.protocol.properties import PropertyId

#: (first byte, variable header and payload after the packet identifier 0, v5 properties)
ZERO_ID = {
    "publish-qos1": (0x32, lambda topic: mqtt_string(topic) + b"\x00\x00", b"p"),
    "publish-qos2": (0x34, lambda topic: mqtt_string(topic) + b"\x00\x00", b"p"),
    "subscribe": (0x82, lambda topic: b"\x00\x00", mqtt_string("t/#") + b"\x00"),
    "unsubscribe": (0xA2, lambda topic: b"\x00\x00", mqtt_string("t/#")),
}


@pytest.mark.parametrize("name", ZERO_ID)
def test_mqtt5_packet_id_zero_is_a_protocol_error(broker: BrokerHandle, name: str) -> None:
    first, header, payload = ZERO_ID[name]
    client = Raw5(broker.host, broker.port)
    try:
        assert client.connect(unique("zero")).reason_code == 0  # type: ignore[union-attr]
        client.send(packet(first, header(unique("t")) + b"\x00" + payload))  # no properties
        answer = client.recv()
        assert isinstance(answer, Disconnect5) and answer.reason_code == 0x82, answer
        reason = str(answer.properties.get(PropertyId.REASON_STRING))
        assert reason.startswith("[MQTT-2.2.1-3]"), reason
        assert client.closed()
    finally:
        client.close()


@pytest.mark.parametrize("name", ["publish-qos1", "publish-qos2", "subscribe"])
def test_mqtt311_packet_id_zero_still_closes(broker: BrokerHandle, raw, name: str) -> None:
    first, header, payload = ZERO_ID[name]
    client = raw()
    client.send(connect(unique("zero311")))
    client.expect(2)  # CONNACK
    client.send(packet(first, header(unique("t")) + payload))
    packets, closed = client.packets_until_closed()
    assert closed and packets == []
