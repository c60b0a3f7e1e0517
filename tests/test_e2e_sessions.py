"""Clean and persistent sessions (MQTT 3.1.1 sections 3.1.2.4, 3.2.2.2, 4.1, 4.4)."""

from __future__ import annotations

import pytest

from mqtt_client import PUBLISH, puback

pytestmark = pytest.mark.timeout(90)


def test_session_present_flags(paho, uid):
    """[MQTT-3.2.2-1] clean session -> SP=0; [MQTT-3.2.2-3] no stored session -> SP=0;
    [MQTT-3.2.2-2] stored session -> SP=1; [MQTT-3.1.2-6] CleanSession=1 discards it."""
    cid = uid("sp")
    a = paho(cid, clean_session=False)
    assert a.connect() is False, "no session stored yet"
    a.disconnect()
    b = paho(cid, clean_session=False)
    assert b.connect() is True
    b.disconnect()
    c = paho(cid, clean_session=True)
    assert c.connect() is False, "[MQTT-3.2.2-1] SP must be 0 with CleanSession=1"
    c.disconnect()
    d = paho(cid, clean_session=False)
    assert d.connect() is False, "[MQTT-3.1.2-6] the clean session discarded the old one"
    d.disconnect()


def test_offline_messages_delivered_in_order_on_return(paho, uid):
    """[MQTT-3.1.2-4]/[MQTT-3.1.2-5]: subscriptions and QoS 1/2 messages of a
    CleanSession=0 client are kept while it is away, and delivered in order (4.6) when it
    returns with session-present=1."""
    topic, cid = uid("offline"), uid("persist")
    s = paho(cid, clean_session=False)
    s.connect()
    s.subscribe([(topic, 2)])
    s.disconnect()
    pub = paho(uid("pub"))
    pub.connect()
    for i in range(20):
        pub.publish(topic, f"q1-{i}".encode(), qos=1)
    for i in range(5):
        pub.publish(topic, f"q2-{i}".encode(), qos=2)
    back = paho(cid, clean_session=False)
    assert back.connect() is True, "[MQTT-3.2.2-2] session-present must be 1"
    got = back.collect(25, timeout=10)
    expected = [f"q1-{i}".encode() for i in range(20)] + [f"q2-{i}".encode() for i in range(5)]
    assert [m.payload for m in got] == expected
    assert [m.qos for m in got] == [1] * 20 + [2] * 5
    assert back.drain(0.5) == []
    # The subscription itself survived: live messages keep flowing without re-subscribing.
    pub.publish(topic, b"live", qos=1)
    assert back.get().payload == b"live"


def test_queued_messages_within_their_ttl_are_delivered_on_return(broker_factory, paho, uid):
    """With ``queued_message_ttl`` set, messages queued for an offline client are stamped and
    judged on the same wall clock: an hour's TTL does not drop a message that waited a moment
    (a monotonic deadline judged against wall time would drop every one on return)."""
    broker = broker_factory(ws=False, queued_message_ttl=3600.0)
    topic, cid = uid("ttl"), uid("ttl")
    s = paho(cid, clean_session=False, target=broker)
    s.connect()
    s.subscribe([(topic, 1)])
    s.disconnect()
    pub = paho(uid("pub"), target=broker)
    pub.connect()
    for i in range(3):
        pub.publish(topic, f"m{i}".encode(), qos=1)
    back = paho(cid, clean_session=False, target=broker)
    assert back.connect() is True
    assert [m.payload for m in back.collect(3, timeout=10)] == [b"m0", b"m1", b"m2"]


def test_clean_session_client_gets_nothing_queued(paho, uid):
    """[MQTT-3.1.2-6]: a CleanSession=1 session ends with the connection; nothing is queued."""
    topic, cid = uid("clean"), uid("clean")
    s = paho(cid, clean_session=True)
    s.connect()
    s.subscribe(topic, 1)
    s.disconnect()
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"lost", qos=1)
    again = paho(cid, clean_session=True)
    assert again.connect() is False
    assert again.drain(0.7) == []


def _publish_and_check_restart(node, paho_any, uid, restart, qos: int = 1):
    """Shared body: queue QoS ``qos`` messages for an offline persistent session, restart the
    node (clean or crash), and check what must survive: the session and its subscription, its
    queue in order, a retained message; and what must stay gone: an unsubscribed filter and a
    cleared retained message."""
    topic, cid = uid("persist"), uid("persist")
    handle = node.start()
    s = paho_any(handle, cid, clean_session=False)
    s.connect()
    s.subscribe([(topic, qos), (f"{topic}/unsubscribed", qos)])
    s.unsubscribe(f"{topic}/unsubscribed")
    s.disconnect()
    pub = paho_any(handle, uid("pub"))
    pub.connect()
    pub.publish(f"{topic}/cleared", b"old", qos=1, retain=True)
    pub.publish(f"{topic}/cleared", b"", qos=1, retain=True)
    pub.publish(f"{topic}/unsubscribed", b"not-for-you", qos=1)
    for i in range(10):
        pub.publish(topic, f"m{i}".encode(), qos=qos)  # waits for PUBACK / PUBCOMP
    pub.publish(f"{topic}/retained", b"kept", qos=qos, retain=True)
    pub.close()
    restart()
    handle = node.start()
    back = paho_any(handle, cid, clean_session=False)
    assert back.connect() is True, "the persistent session did not survive the restart"
    got = back.collect(10, timeout=10)
    assert [(m.payload, m.qos) for m in got] == [(f"m{i}".encode(), qos) for i in range(10)]
    assert back.drain(0.5) == [], "more than the queued messages (unsubscribed filter back?)"
    pub2 = paho_any(handle, uid("pub2"))
    pub2.connect()
    pub2.publish(topic, b"live-after-restart", qos=1)
    assert back.get().payload == b"live-after-restart", "subscription lost in restart"
    late = paho_any(handle, uid("late"))
    late.connect()
    late.subscribe(f"{topic}/retained", 1)
    m = late.get()
    assert (m.payload, m.retain) == (b"kept", True), "retained message lost in restart"
    late.subscribe(f"{topic}/cleared", 1)
    assert late.drain(0.5) == [], "a cleared retained message came back after restart"
    for c in (back, late, pub2):
        c.disconnect()


def test_persistent_session_survives_clean_node_restart(node_factory, paho_any, uid):
    """Issue 2: sessions, queued messages and retained messages live in the data dir and
    survive a SIGTERM restart; the node exits 0 on SIGTERM."""
    node = node_factory()

    def restart() -> None:
        assert node.terminate() == 0, f"node exit code on SIGTERM:\n{node.log_tail()}"

    _publish_and_check_restart(node, paho_any, uid, restart)
    assert node.terminate() == 0


def test_pubacked_qos1_survives_kill9_of_node(node_factory, paho_any, uid):
    """Issue 2 durability contract: anything PUBACKed survives kill -9 of the node. (MQTT
    4.3.2: after PUBACK the sender has discarded the message, so the broker owns it.)"""
    node = node_factory()
    _publish_and_check_restart(node, paho_any, uid, node.kill9, qos=1)
    node.kill9()


def test_completed_qos2_survives_kill9_of_node(node_factory, paho_any, uid):
    """The QoS 2 analogue: after PUBREC the sender discards the message (4.3.3), so a
    PUBREC'd (here even PUBCOMP'd) message belongs to the broker and must survive kill -9."""
    node = node_factory()
    _publish_and_check_restart(node, paho_any, uid, node.kill9, qos=2)
    node.kill9()


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_unacked_outbound_redelivered_after_node_restart(node_factory, paho_any, uid, how):
    """[MQTT-4.4.0-1] across a node restart: a QoS 1 message sent but not PUBACKed by the
    subscriber is re-sent with DUP=1 when it reconnects to the restarted node."""
    from mqtt_client import RawClient

    topic, cid = uid("inflight"), uid("persist")
    node = node_factory()
    handle = node.start()
    c = RawClient(handle.host, handle.port)
    try:
        assert c.connect(cid, clean_session=False).return_code == 0
        assert c.subscribe([(topic, 1)]) == [1]
        pub = paho_any(handle, uid("pub"))
        pub.connect()
        pub.publish(topic, b"unacked", qos=1)
        first = c.expect(PUBLISH)
        assert first.payload == b"unacked"
        pub.close()
    finally:
        c.close()
    if how == "kill9":
        node.kill9()
    else:
        assert node.terminate() == 0
    handle = node.start()
    c2 = RawClient(handle.host, handle.port)
    try:
        ack = c2.connect(cid, clean_session=False)
        assert (ack.return_code, ack.session_present) == (0, True)
        again = c2.expect(PUBLISH)
        assert (again.payload, again.qos, again.dup) == (b"unacked", 1, True)
        assert again.packet_id == first.packet_id, "[MQTT-4.4.0-1] original packet id"
        c2.send(puback(again.packet_id))
    finally:
        c2.close()
    assert node.terminate() == 0


def test_qos2_pubrec_state_survives_kill9(node_factory, paho_any, uid):
    """Exactly once across a crash (4.3.3 + 4.4): a QoS 2 PUBLISH that the node PUBREC'd is
    owned by the node (the sender has discarded it).  After kill -9 and restart, the
    publisher resumes with PUBREL (4.4: it re-sends PUBREL, not PUBLISH), gets PUBCOMP, and
    the offline persistent subscriber receives the message exactly once."""
    from mqtt_client import PUBCOMP, PUBREC, RawClient, publish, pubrel

    topic, sub_id, pub_id = uid("eo"), uid("sub"), uid("pub")
    node = node_factory()
    handle = node.start()
    s = paho_any(handle, sub_id, clean_session=False)
    s.connect()
    s.subscribe([(topic, 2)])
    s.disconnect()
    p = RawClient(handle.host, handle.port)
    try:
        assert p.connect(pub_id, clean_session=False).return_code == 0
        p.send(publish(topic, b"exactly-once", qos=2, packet_id=5))
        assert p.expect(PUBREC).packet_id == 5
    finally:
        p.close()
    node.kill9()
    handle = node.start()
    p2 = RawClient(handle.host, handle.port)
    try:
        ack = p2.connect(pub_id, clean_session=False)
        assert (ack.return_code, ack.session_present) == (0, True)
        p2.send(pubrel(5))
        comp = p2.expect(PUBCOMP)
        assert comp.packet_id == 5
    finally:
        p2.close()
    back = paho_any(handle, sub_id, clean_session=False)
    assert back.connect() is True
    got = back.collect(1, timeout=5) + back.drain(1.0)
    assert [(m.payload, m.qos) for m in got] == [(b"exactly-once", 2)]
    node.kill9()


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_qos2_outbound_pubrel_state_survives_restart(node_factory, paho_any, uid, how):
    """4.3.3/4.4 across a restart: a subscriber that PUBREC'd a QoS 2 message gets a PUBREL
    (same id, flags 0010) after reconnecting to the restarted node, and no second PUBLISH
    of that message.

    ``kill9``: exactly once across a crash.  A PUBREL reaches the client only once the
    PUBREC that caused it is stored durably; the client got it (paho, MQTT.js and
    libmosquitto hand the message to the application then) and the node dies before the
    PUBCOMP, at once, well inside the lazy flusher's interval (``lazy_sync_ms``): a PUBREL
    sent ahead of its record made the restarted node send the PUBLISH again, which the
    client takes for a new message, every time."""
    from mqtt_client import PUBREL, RawClient, pubcomp, pubrec

    topic, cid = uid("rel"), uid("persist")
    node = node_factory()
    handle = node.start()
    c = RawClient(handle.host, handle.port)
    try:
        assert c.connect(cid, clean_session=False).return_code == 0
        assert c.subscribe([(topic, 2)]) == [2]
        pub = paho_any(handle, uid("pub"))
        pub.connect()
        pub.publish(topic, b"q2", qos=2)
        pub.close()
        p = c.expect(PUBLISH)
        c.send(pubrec(p.packet_id))
        assert c.expect(PUBREL).packet_id == p.packet_id
        if how == "kill9":
            node.kill9()  # no PUBCOMP: lost with the crash
    finally:
        c.close()
    if how == "sigterm":
        assert node.terminate() == 0
    handle = node.start()
    c2 = RawClient(handle.host, handle.port)
    try:
        assert c2.connect(cid, clean_session=False).session_present is True
        rel = c2.expect(PUBREL)
        assert (rel.flags, rel.packet_id) == (0x2, p.packet_id)
        c2.send(pubcomp(p.packet_id))
        assert c2.no_packet_within(0.7) is None, "the PUBREC'd message was published again"
    finally:
        c2.close()
    assert node.terminate() == 0


def test_a_disconnect_sent_with_the_connect_closes_the_connection(raw, uid):
    """CONNECT and DISCONNECT in one write, the socket left open: the node answers CONNACK
    and closes [MQTT-3.14.4]; it kept the connection until the keepalive ran out (the
    DISCONNECT was taken by the CONNECT's acceptance, behind the reader's back)."""
    from mqtt_client import CONNACK, DISCONNECT_BYTES, connect

    client = raw()
    client.send(connect(uid("conndisc"), keepalive=60) + DISCONNECT_BYTES)
    assert client.expect(CONNACK).return_code == 0
    client.sock.settimeout(5)
    assert client.sock.recv(1) == b"", "the node should close the connection"
