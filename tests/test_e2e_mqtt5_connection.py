"""MQTT 5.0 connection-level features end to end on one node, real sockets and clients.

Outbound topic aliases (on the wire, reset with each connection, and how paho-mqtt and
mosquitto_sub take them: why ``limits.topic_alias_maximum_out`` defaults to 0), Server Keep
Alive (``limits.max_keepalive``, announced and enforced; 3.1.1 refused), Response
Information, reason strings, failure codes in the client's PUBACK/PUBREC, No Local on a
shared subscription, and an expired inflight message resent after a reconnect.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import BrokerHandle, PahoClient, unique
from mqtt5_support import WAIT, Paho5, Raw5, props
from mqttring.protocol.codec import decode, encode
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets import ConnAck, Connect
from mqttring.protocol.packets5 import (
    ConnAck5,
    Connect5,
    Disconnect5,
    PubAck5,
    Publish5,
    PubRec5,
    SubAck5,
    SubOptions,
    Subscribe5,
)
from mqttring.protocol.properties import Properties, PropertyId

P = PropertyId
PUBLISH, CONNECT = 3, 1


def subscribed(client: Raw5, topic_filter: str, qos: int = 1) -> None:
    client.send(encode5(Subscribe5(1, ((topic_filter, SubOptions(qos)),))))
    assert client.recv() == SubAck5(1, (qos,))


def publishes(client: Raw5, count: int) -> list[Publish5]:
    """The next ``count`` PUBLISHes (acknowledged: QoS 1 PUBACK)."""
    got = []
    while len(got) < count:
        packet = client.recv()
        assert isinstance(packet, Publish5), packet
        if packet.qos == 1:
            client.send(encode5(PubAck5(packet.packet_id)))  # type: ignore[arg-type]
        got.append(packet)
    return got


def alias_of(packet: Publish5) -> tuple[str, object]:
    return packet.topic, packet.properties.get(P.TOPIC_ALIAS)


# -- outbound topic aliases ---------------------------------------------------------------


def test_outbound_aliases_on_the_wire_reset_with_each_connection(
        broker_factory: Callable[..., BrokerHandle], raw5: Callable[[BrokerHandle], Raw5],
        paho_any: Callable[..., PahoClient]) -> None:
    node = broker_factory(topic_alias_maximum_out=2)
    root, cid = unique("al"), unique("al-sub")
    sub = raw5(node)
    connack = sub.connect(cid, topic_alias_maximum=10, session_expiry_interval=60)
    assert isinstance(connack, ConnAck5) and connack.reason_code == 0
    subscribed(sub, f"{root}/#")
    pub = paho_any(node)
    pub.connect()
    for leaf in ("a", "a", "b", "c", "a"):
        pub.publish(f"{root}/{leaf}", leaf, 1)
    got = publishes(sub, 5)
    assert [alias_of(p) for p in got] == [
        (f"{root}/a", 1), ("", 1), (f"{root}/b", 2), (f"{root}/c", None), ("", 1)]
    assert [p.payload for p in got] == [b"a", b"a", b"b", b"c", b"a"]
    sub.close()
    pub.publish(f"{root}/a", "queued", 1)  # for the session, while it is away
    again = raw5(node)
    connack = again.connect(cid, clean_start=False, topic_alias_maximum=10)
    assert isinstance(connack, ConnAck5) and connack.session_present
    [queued] = publishes(again, 1)
    # A new connection: the aliases of the old one are gone, the topic goes in full.
    assert alias_of(queued) == (f"{root}/a", 1) and queued.payload == b"queued"


def test_no_aliases_by_default_even_when_the_client_allows_them(
        broker: BrokerHandle, raw5: Callable[[BrokerHandle], Raw5],
        paho_any: Callable[..., PahoClient]) -> None:
    root = unique("noal")
    sub = raw5(broker)
    sub.connect(unique("c"), topic_alias_maximum=10)
    subscribed(sub, f"{root}/#")
    pub = paho_any(broker)
    pub.connect()
    for _ in range(2):
        pub.publish(f"{root}/t", "x", 1)
    assert [alias_of(p) for p in publishes(sub, 2)] == [(f"{root}/t", None)] * 2


def test_paho_announcing_aliases_cannot_resolve_them(
        broker_factory: Callable[..., BrokerHandle], paho_any: Callable[..., PahoClient]
) -> None:
    """paho-mqtt 2.x sends a Topic Alias Maximum when told to, but hands the application
    an aliased PUBLISH with an empty topic: why ``topic_alias_maximum_out`` defaults to 0.
    (If this starts failing, paho resolves aliases now: revisit the default.)"""
    node = broker_factory(topic_alias_maximum_out=4)
    topic = unique("paho-al")
    sub = Paho5(node.host, node.port)
    try:
        sub.connect(properties=props(CONNECT, TopicAliasMaximum=4))
        sub.subscribe(topic, 1)
        pub = paho_any(node)
        pub.connect()
        pub.publish(topic, "1", 1)
        pub.publish(topic, "2", 1)
        first, second = sub.get(), sub.get()
        assert first.topic == topic and second.payload == b"2"
        assert second.topic == ""  # paho 2.2 does not look the alias up
    finally:
        sub.client.loop_stop()
        with contextlib.suppress(Exception):
            sub.client.disconnect()


def test_mosquitto_sub_announcing_aliases_cannot_resolve_them(
        broker_factory: Callable[..., BrokerHandle], paho_any: Callable[..., PahoClient]
) -> None:
    """libmosquitto 2.0 (mosquitto_sub -D connect topic-alias-maximum N) takes the first
    PUBLISH, which names the topic, and calls the aliased one (empty topic) a protocol
    error: the second reason ``topic_alias_maximum_out`` defaults to 0.  MQTT.js resolves
    them (``test_e2e_mqttjs.py``)."""
    node = broker_factory(topic_alias_maximum_out=4)
    topic = unique("mq-al")
    sub = subprocess.Popen(
        ["mosquitto_sub", "-V", "mqttv5", "-h", node.host, "-p", str(node.port),
         "-t", topic, "-q", "1", "-C", "3", "-F", "%t|%p", "-W", "20",
         "-D", "connect", "topic-alias-maximum", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pub = paho_any(node)
    pub.connect()
    deadline = time.monotonic() + 20
    try:
        # Publish until the subscriber ends (it subscribes right after connecting).
        while sub.poll() is None and time.monotonic() < deadline:
            pub.publish(topic, "m", 1)
            with contextlib.suppress(subprocess.TimeoutExpired):
                sub.wait(0.3)
        out = sub.communicate(timeout=WAIT)[0].decode()
    finally:
        if sub.poll() is None:
            sub.kill()
    lines = out.splitlines()
    assert lines[0] == f"{topic}|m", out
    assert sub.returncode != 0 and "protocol error" in out, out


# -- keep alive, response information -----------------------------------------------------


def test_server_keep_alive_is_announced_and_enforced(
        broker_factory: Callable[..., BrokerHandle], raw5: Callable[[BrokerHandle], Raw5]
) -> None:
    """A client asking for 100 s is told 2 s [MQTT-3.2.2-21] and closed as for 2 s:
    DISCONNECT 0x8D after 1.5 x 2 s of silence, long before its own 100 s."""
    node = broker_factory(max_keepalive=2)
    client = raw5(node)
    connack = client.connect(unique("ka"), keepalive=100)
    assert isinstance(connack, ConnAck5)
    assert connack.properties.get(P.SERVER_KEEP_ALIVE) == 2
    started = time.monotonic()
    goodbye = client.recv(timeout=15)
    assert isinstance(goodbye, Disconnect5) and goodbye.reason_code == 0x8D
    assert 2.5 <= time.monotonic() - started < 15
    assert client.closed()


def test_paho_v5_gets_server_keep_alive_and_311_is_refused(
        broker_factory: Callable[..., BrokerHandle]) -> None:
    node = broker_factory(max_keepalive=30)
    client = Paho5(node.host, node.port)
    try:
        _, connack = client.connect(keepalive=0)  # "never" is more than 30 s
        assert connack.ServerKeepAlive == 30
    finally:
        client.client.loop_stop()
        client.client.disconnect()
    # 3.1.1 cannot be told: CONNACK 2 (identifier rejected), as mosquitto's max_keepalive.
    for asked in (60, 0):
        with socket.create_connection((node.host, node.port), timeout=WAIT) as sock:
            sock.sendall(encode(Connect(unique("ka311"), keepalive=asked)))
            assert decode(sock.recv(4)) == ConnAck(False, 2)


def test_response_information_on_request_only(
        broker_factory: Callable[..., BrokerHandle]) -> None:
    node = broker_factory(settings={"response_information": "replies/"})
    for request, expected in ((1, "replies/"), (0, None)):
        client = Paho5(node.host, node.port)
        try:
            _, connack = client.connect(properties=props(
                CONNECT, RequestResponseInformation=request))
            assert getattr(connack, "ResponseInformation", None) == expected
        finally:
            client.client.loop_stop()
            client.client.disconnect()


# -- reason strings, failure codes ----------------------------------------------------------


def test_reason_strings_on_failures_when_asked(
        broker_factory: Callable[..., BrokerHandle], raw5: Callable[[BrokerHandle], Raw5],
        tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite open/#\n")
    node = broker_factory(settings={"acl_file": acl}, max_subscriptions=1)
    told = raw5(node)
    told.connect(unique("rs"))
    told.send(encode5(Subscribe5(1, (("open/a", SubOptions(1)), ("open/b", SubOptions(1))))))
    assert told.recv() == SubAck5(1, (1, 0x97), Properties(
        [(P.REASON_STRING, "quota exceeded")]))
    # A publish the ACL denies: 0x87 (mosquitto's answer to a v5 client), not routed.
    told.send(encode5(Publish5("closed/x", b"no", 1, packet_id=2)))
    assert told.recv() == PubAck5(2, 0x87, Properties([(P.REASON_STRING, "not authorized")]))
    told.send(encode5(Publish5("closed/x", b"no", 2, packet_id=3)))
    assert told.recv() == PubRec5(3, 0x87, Properties([(P.REASON_STRING, "not authorized")]))
    # $SYS is no exception: the ACL denies it, so the client is told (it was PUBACK 0).
    told.send(encode5(Publish5("$SYS/broker/fake", b"no", 1, packet_id=4)))
    assert told.recv() == PubAck5(4, 0x87, Properties([(P.REASON_STRING, "not authorized")]))
    quiet = raw5(node)
    quiet.connect(unique("rs"), request_problem_information=0)
    quiet.send(encode5(Subscribe5(1, (("open/a", SubOptions(1)), ("open/b", SubOptions(1))))))
    assert quiet.recv() == SubAck5(1, (1, 0x97))  # [MQTT-3.1.2-29]
    quiet.send(encode5(Publish5("closed/x", b"no", 1, packet_id=2)))
    assert quiet.recv() == PubAck5(2, 0x87)


def test_no_local_on_a_shared_subscription_is_disconnect_0x82(
        broker: BrokerHandle, raw5: Callable[[BrokerHandle], Raw5]) -> None:
    client = raw5(broker)
    client.connect(unique("nl"))
    client.send(encode5(Subscribe5(1, (("$share/g/t", SubOptions(1, no_local=True)),))))
    goodbye = client.recv()
    assert isinstance(goodbye, Disconnect5) and goodbye.reason_code == 0x82
    assert "MQTT-3.8.3-4" in str(goodbye.properties.get(P.REASON_STRING))
    assert client.closed()


@pytest.mark.parametrize("failure", [PubAck5, PubRec5])
def test_a_failed_ack_from_the_subscriber_completes_the_message(
        broker_factory: Callable[..., BrokerHandle], raw5: Callable[[BrokerHandle], Raw5],
        paho_any: Callable[..., PahoClient], failure: type) -> None:
    """With one inflight slot: a PUBACK/PUBREC >= 0x80 frees it (for QoS 2 no PUBREL
    follows, section 4.3.3), so the next message comes at once."""
    node = broker_factory(max_inflight=1)
    topic, qos = unique("fail"), 1 if failure is PubAck5 else 2
    sub = raw5(node)
    sub.connect(unique("sub"))
    subscribed(sub, topic, qos)
    pub = paho_any(node)
    pub.connect()
    pub.publish(topic, "first", qos)
    pub.publish(topic, "second", qos)
    first = sub.recv()
    assert isinstance(first, Publish5) and first.payload == b"first"
    sub.send(encode5(failure(first.packet_id, 0x80)))
    second = sub.recv()  # not a PUBREL
    assert isinstance(second, Publish5) and second.payload == b"second", second


def test_an_expired_inflight_message_is_resent_with_expiry_0(
        broker: BrokerHandle, raw5: Callable[[BrokerHandle], Raw5]) -> None:
    """Its onward delivery started before it expired, so it goes again after the
    reconnect [MQTT-3.3.2-5], with a remaining interval of 0, not a negative one."""
    topic, cid = unique("exp"), unique("exp-sub")
    sub = raw5(broker)
    sub.connect(cid, session_expiry_interval=60)
    subscribed(sub, topic)
    pub = Paho5(broker.host, broker.port)
    try:
        pub.connect()
        pub.publish(topic, b"soon", 1, properties=props(PUBLISH, MessageExpiryInterval=1))
    finally:
        pub.client.loop_stop()
        pub.client.disconnect()
    first = sub.recv()
    assert isinstance(first, Publish5) and first.payload == b"soon"  # not acknowledged
    sub.close()
    time.sleep(1.5)  # the message's wall-clock deadline passes
    again = raw5(broker)
    assert again.connect(cid, clean_start=False).session_present  # type: ignore[attr-defined]
    resent = again.recv()
    assert isinstance(resent, Publish5) and resent.dup and resent.payload == b"soon"
    assert resent.packet_id == first.packet_id
    assert resent.properties.get(P.MESSAGE_EXPIRY_INTERVAL) == 0


def test_the_connack_fits_the_clients_maximum_packet_size(
        broker: BrokerHandle, raw5: Callable[[BrokerHandle], Raw5]) -> None:
    """[MQTT-3.1.2-24] covers the CONNACK too: within a small Maximum Packet Size it leaves
    out what the client assumes anyway (a probe's 20-byte limit got a 24-byte CONNACK);
    when what it must say (an assigned client id) cannot fit, the client gets no CONNACK
    and the connection closes, as with mosquitto."""
    small = raw5(broker)
    small.send(encode5(Connect5(unique("mps"), True, 60, properties=Properties(
        [(P.MAXIMUM_PACKET_SIZE, 20)]))))
    data = b""
    small.sock.settimeout(WAIT)
    while len(data) < 2 or len(data) < 2 + data[1]:
        chunk = small.sock.recv(256)
        assert chunk, "closed before the CONNACK"
        data += chunk
    assert len(data) <= 20, f"{len(data)}-byte CONNACK for a 20-byte limit"
    small.decoder.feed(data)
    connack = small.recv()
    assert isinstance(connack, ConnAck5) and connack.reason_code == 0
    assert connack.properties.get(P.RECEIVE_MAXIMUM) is not None, "what it must say stays"
    small.send(encode5(Subscribe5(1, (("mps/t", SubOptions(0)),))))
    assert isinstance(small.recv(), SubAck5), "a usable connection"
    assigned = raw5(broker)
    assigned.send(encode5(Connect5("", True, 60, properties=Properties(
        [(P.MAXIMUM_PACKET_SIZE, 24)]))))
    assigned.sock.settimeout(WAIT)
    received = b""
    while chunk := assigned.sock.recv(256):
        received += chunk
    assert received == b"", "an assigned id does not fit 24 bytes: no CONNACK, just the close"
