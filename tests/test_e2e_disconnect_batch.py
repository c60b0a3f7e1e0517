"""Packets that arrive in the same read as the client's DISCONNECT are answered before the
connection closes, in order, and the DISCONNECT still means no will (MQTT 5: unless its
reason is 0x04, "disconnect with will message").

Once the protocol machine closed for output as well as input when it decoded the
DISCONNECT: the packets before it took effect (a PUBLISH was routed) but their PUBACK,
PUBREC, SUBACK, UNSUBACK and PINGRESP were dropped, where mosquitto sends them.  Each case
writes its packets and the DISCONNECT with one ``sendall`` (one TCP segment on loopback),
then reads everything until the broker closes.

At the end, two CONNECTs of MQTT 3.1 (``MQIsdp``) that must be answered before the close
as mosquitto answers them: an empty client id (CONNACK 2; 3.1 has no server-assigned ids)
and the name with level 4 (CONNACK 1), which were accepted and closed without a CONNACK.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster_support import HOST, NodeCluster, start_cluster, unique
from conftest import BrokerHandle
from mqtt5_support import Raw5
from mqtt_client import (
    CONNACK,
    DISCONNECT_BYTES,
    PINGREQ_BYTES,
    PINGRESP,
    PUBACK,
    PUBREC,
    SUBACK,
    UNSUBACK,
    RawClient,
    connect,
    mqtt_string,
    packet,
    publish,
    subscribe,
    unsubscribe,
)
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets5 import ConnAck5, Connect5, Will5
from mqttring.protocol.properties import Properties

pytestmark = pytest.mark.timeout(60)


def _cases(root: str) -> dict[str, tuple[bytes, list[tuple[int, int | None]]]]:
    """name -> (the packets sent before the DISCONNECT, the answers due: (type, id))."""
    return {
        "publish-qos1": (publish(f"{root}/q1", b"one", qos=1, packet_id=7), [(PUBACK, 7)]),
        "publish-qos2": (publish(f"{root}/q2", b"two", qos=2, packet_id=8), [(PUBREC, 8)]),
        "subscribe": (subscribe(3, [(f"{root}/s", 1)]), [(SUBACK, 3)]),
        "unsubscribe": (unsubscribe(4, [f"{root}/s"]), [(UNSUBACK, 4)]),
        "pingreq": (PINGREQ_BYTES, [(PINGRESP, None)]),
        "all-in-order": (
            publish(f"{root}/q1", b"three", qos=1, packet_id=9) + PINGREQ_BYTES
            + subscribe(5, [(f"{root}/s", 0)]) + unsubscribe(6, [f"{root}/s"])
            + publish(f"{root}/q2", b"four", qos=2, packet_id=10),
            [(PUBACK, 9), (PINGRESP, None), (SUBACK, 5), (UNSUBACK, 6), (PUBREC, 10)],
        ),
    }


def _no_will_before_marker(watcher, root: str, will_payloads: set[bytes]) -> list[bytes]:
    """Publish a marker after every connection above has closed, and return the payloads
    the watcher got before it: a will owed by one of them would have come first (it is
    routed before the connection's socket is closed, which the test saw)."""
    watcher.publish(f"{root}/marker", b"marker", qos=1)
    payloads: list[bytes] = []
    deadline = time.monotonic() + 10
    while True:
        message = watcher.get(max(deadline - time.monotonic(), 0.01))
        if message.payload == b"marker":
            break
        payloads.append(message.payload)
    assert not will_payloads & set(payloads), f"a will after DISCONNECT: {payloads}"
    return payloads


def _run_batches(port: int, watcher, client_id: Callable[[str], str], clean: bool) -> None:
    """Every case of ``_cases`` on a connection to ``port``; ``watcher`` (subscribed to
    nothing yet, on any node) checks that the publishes were routed and no will was."""
    root = unique("batch")
    watcher.subscribe(f"{root}/#", 1)
    wills = set()
    for name, (sent, due) in _cases(root).items():
        client = RawClient(HOST, port)
        try:
            will = f"will of {name}".encode()
            wills.add(will)
            ack = client.connect(client_id(name), clean_session=clean,
                                 will=(f"{root}/will", will, 1, False))
            assert ack.return_code == 0
            client.send(sent + DISCONNECT_BYTES)
            got, closed = client.packets_until_closed(5)
            assert [(p.type, p.packet_id) for p in got] == due, (name, got)
            assert closed, f"{name}: not closed after DISCONNECT"
        finally:
            client.close()
    routed = _no_will_before_marker(watcher, root, wills)
    # The packets took effect too: the four publishes were routed.
    assert sorted(routed) == [b"four", b"one", b"three", b"two"], routed


def test_answers_before_a_disconnect_in_the_same_segment(broker: BrokerHandle, paho) -> None:
    watcher = paho(unique("watch"))
    watcher.connect()
    _run_batches(broker.port, watcher, unique, True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("discbatch")))
    yield c
    c.close()


def test_answers_before_a_disconnect_through_a_cluster(cluster: NodeCluster, paho_any) -> None:
    """The same through a cluster: connections on node a, persistent sessions homed on b
    (the SUBSCRIBE's answer waits for the home, the PUBLISHes' for their shards' owners),
    the watcher on c."""
    view = cluster.settle(("a", "b", "c"))
    watcher = paho_any(BrokerHandle(HOST, cluster.port("c"), None, cluster.root),
                       unique("watch"))
    watcher.connect()
    _run_batches(cluster.port("a"), watcher,
                 lambda name: view.client_homed_at("b", unique(name)), False)


def _publish5(topic: str, payload: bytes, packet_id: int) -> bytes:
    """An MQTT 5 PUBLISH at QoS 1 with no properties, built by hand."""
    body = mqtt_string(topic) + struct.pack("!H", packet_id) + b"\x00" + payload
    return packet(0x32, body)


@pytest.mark.parametrize(("reason", "will_sent"), [(0x00, False), (0x04, True)],
                         ids=["normal", "with-will"])
def test_mqtt5_answers_before_its_disconnect_and_keeps_its_will_rule(
        broker: BrokerHandle, paho, uid, reason: int, will_sent: bool) -> None:
    """MQTT 5: the PUBACK and PINGRESP due before a DISCONNECT read with them leave first;
    its reason code decides the will as before (0x04 sends it, 0x00 does not)."""
    root = uid("batch5")
    watcher = paho(uid("watch5"))
    watcher.connect()
    watcher.subscribe(f"{root}/#", 1)
    client = Raw5(broker.host, broker.port)
    try:
        will = Will5(f"{root}/will", b"will5", 1, False, Properties([]))
        client.send(encode5(Connect5(uid("v5"), True, 60, will)))
        connack = client.recv()
        assert isinstance(connack, ConnAck5) and connack.reason_code == 0, connack
        client.send(_publish5(f"{root}/p", b"five", 11) + PINGREQ_BYTES
                    + bytes((0xE0, 1, reason)))
        first, second = client.recv(), client.recv()
        assert type(first).__name__ == "PubAck5" and first.packet_id == 11, first
        assert first.reason_code == 0, first
        assert type(second).__name__ == "PingResp", second
        assert client.closed(), "not closed after DISCONNECT"
    finally:
        client.close()
    if will_sent:
        payloads = [watcher.get().payload, watcher.get().payload]
        assert sorted(payloads) == [b"five", b"will5"], payloads
    else:
        assert _no_will_before_marker(watcher, root, {b"will5"}) == [b"five"]


# ------------------------------------------------------------------ MQTT 3.1 CONNECT refusals
#
# Connections that also end with an answer written before the close: a CONNACK refusal.


def test_mqtt31_empty_client_id_is_rejected(raw: Callable[..., RawClient], uid) -> None:
    """MQTT 3.1 (``MQIsdp``, level 3) requires a client id of 1 to 23 characters (3.1.1's
    server-assigned ids are new in 3.1.1): an empty one is answered CONNACK 0x02
    (identifier rejected) and closed, even with CleanSession=1, as mosquitto does; a
    non-empty one is accepted."""
    refused = raw()
    refused.send(connect("", clean_session=True, protocol_name="MQIsdp", protocol_level=3))
    got, closed = refused.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 2)], got
    assert closed, "[MQTT-3.2.2-5] the server must close after a non-zero CONNACK"
    accepted = raw()
    ack = accepted.connect(uid("v31"), protocol_name="MQIsdp", protocol_level=3)
    assert ack.return_code == 0, ack


def test_mqisdp_with_another_level_gets_connack_1(raw: Callable[..., RawClient], uid) -> None:
    """``MQIsdp`` is MQTT 3.1's name, level 3: under it, level 4 is an unacceptable protocol
    version, answered CONNACK 0x01 then closed (as "MQTT" with a level other than 4 or 5,
    and as mosquitto answers it), not closed without a word."""
    client = raw()
    client.send(connect(uid("v31-4"), protocol_name="MQIsdp", protocol_level=4))
    got, closed = client.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 1)], got
    assert got[0].session_present is False, "[MQTT-3.2.2-4] SP=0 with a non-zero return code"
    assert closed, "[MQTT-3.2.2-5] the server must close after a non-zero CONNACK"
