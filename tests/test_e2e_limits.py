"""Configured limits (issue 2, ``mqttring.config.Limits``), each with its documented outcome.

MQTT 3.1.1 leaves these to the server; what is checked is the contract in the Limits docstrings
plus the spec rules they interact with (CONNACK 0x03 "Server unavailable", 3.2.2.3; message
ordering, 4.6).
"""

from __future__ import annotations

import time

import pytest

from mqtt_client import (
    CONNACK,
    DISCONNECT_BYTES,
    PINGREQ_BYTES,
    PINGRESP,
    PUBLISH,
    ConnectionClosed,
    connect,
    puback,
    publish,
)

pytestmark = pytest.mark.timeout(90)


def test_packet_over_max_packet_size_closes_connection(broker_factory, raw, paho_any, uid):
    b = broker_factory(max_packet_size=1024)
    topic = uid("big")
    sub = paho_any(b, uid("sub"))
    sub.connect()
    sub.subscribe(topic, 0)
    ok = raw(b)
    assert ok.connect(uid("ok")).return_code == 0
    ok.send(publish(topic, b"s" * 900))
    assert sub.get().payload == b"s" * 900, "a packet under the limit must pass"
    big = raw(b)
    assert big.connect(uid("big")).return_code == 0
    big.send(publish(topic, b"B" * 2000))
    assert big.wait_closed(5), "a packet over max_packet_size must close the connection"
    assert sub.drain(0.5) == [], "the oversized message must not be delivered"
    # The limit is enforced from the header: a 100 MB announcement is refused without the
    # broker waiting for (or buffering) the body.
    huge = raw(b)
    assert huge.connect(uid("huge")).return_code == 0
    huge.send(b"\x30\x80\x80\x80\x30" + b"\x00\x01t")
    assert huge.wait_closed(3), "oversized remaining length must close before the body arrives"
    ok.send(PINGREQ_BYTES)
    assert ok.expect(PINGRESP), "other connections are unaffected"


def test_connect_timeout_closes_silent_socket(broker_factory, raw, uid):
    b = broker_factory(connect_timeout=1.0)
    silent = raw(b)
    partial = raw(b)
    partial.send(connect(uid("p"))[:5])  # started a CONNECT, never finished it
    t0 = time.monotonic()
    assert silent.wait_closed(4), "a socket that never sends CONNECT must be closed"
    assert partial.wait_closed(1.5), "a half-sent CONNECT must not hold the socket open"
    assert time.monotonic() - t0 >= 0.5, "closed long before connect_timeout=1.0"
    # A connected client is not subject to connect_timeout (keepalive 0 = no keepalive).
    ok = raw(b)
    assert ok.connect(uid("ok"), keepalive=0).return_code == 0
    assert not ok.wait_closed(2.0)


def test_max_connections_connack_3(broker_factory, raw, uid):
    b = broker_factory(max_connections=2)
    first, second = raw(b), raw(b)
    assert first.connect(uid("c1")).return_code == 0
    assert second.connect(uid("c2")).return_code == 0
    third = raw(b)
    third.send(connect(uid("c3")))
    got, closed = third.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 3)], got
    assert closed, "[MQTT-3.2.2-5] close after a non-zero CONNACK"
    # Existing clients are unaffected, and a freed slot can be reused.
    second.send(PINGREQ_BYTES)
    assert second.expect(PINGRESP)
    first.close()
    deadline = time.monotonic() + 5
    while True:
        again = raw(b)
        ack = again.connect(uid("c4"))
        if ack.return_code == 0:
            break
        assert ack.return_code == 3
        assert time.monotonic() < deadline, "slot of a closed connection never freed"
        again.close()
        time.sleep(0.1)


def test_max_queued_drops_oldest_qos0_first_then_oldest(broker_factory, raw, paho_any, uid):
    """Limits.max_queued: when an offline session's queue is full, the oldest QoS 0 message is
    dropped first, then the oldest QoS 1/2 message.  (The sequence is chosen so the expected
    result is the same whether or not QoS 0 messages are queued for offline clients, which
    MQTT 3.1.1 leaves optional.)  The session client is a raw one that sends DISCONNECT and
    waits for the broker to close the socket, so the session is known to be offline before
    anything is published."""
    b = broker_factory(max_queued=3)
    topic, cid = uid("queue"), uid("persist")

    def go_offline(client) -> None:
        client.send(DISCONNECT_BYTES)
        assert client.wait_closed(5), "3.14.4: the server SHOULD close after DISCONNECT"

    def come_back() -> list[bytes]:
        c = raw(b)
        ack = c.connect(cid, clean_session=False)
        assert (ack.return_code, ack.session_present) == (0, True)
        got = []
        while (p := c.no_packet_within(0.7)) is not None:
            assert p.type == PUBLISH, p
            got.append(p.payload)
            if p.qos == 1:
                c.send(puback(p.packet_id))
        go_offline(c)
        return got

    s = raw(b)
    assert s.connect(cid, clean_session=False).return_code == 0
    assert s.subscribe([(topic, 1)]) == [1]
    go_offline(s)
    pub = paho_any(b, uid("pub"))
    pub.connect()
    pub.publish(topic, b"m1", qos=1)
    pub.publish(topic, b"m2-qos0", qos=0)
    pub.publish(topic, b"m3", qos=1)
    pub.publish(topic, b"m4", qos=1)  # full: the QoS 0 message goes, not m1
    assert come_back() == [b"m1", b"m3", b"m4"]
    for i in range(1, 6):
        pub.publish(topic, f"n{i}".encode(), qos=1)  # n1, n2 dropped (oldest first)
    assert come_back() == [b"n3", b"n4", b"n5"]


def test_max_inflight_window(broker_factory, raw, paho_any, uid):
    """Limits.max_inflight: at most N unacknowledged QoS 1 messages per client; the rest wait
    in order (4.6) and flow as PUBACKs free the window."""
    b = broker_factory(max_inflight=2)
    topic = uid("win")
    c = raw(b)
    assert c.connect(uid("slow")).return_code == 0
    assert c.subscribe([(topic, 1)]) == [1]
    pub = paho_any(b, uid("pub"))
    pub.connect()
    for i in range(5):
        pub.publish(topic, f"w{i}".encode(), qos=1)
    window = [c.expect(PUBLISH), c.expect(PUBLISH)]
    assert [p.payload for p in window] == [b"w0", b"w1"]
    assert c.no_packet_within(0.7) is None, "more than max_inflight=2 messages in flight"
    c.send(puback(window[0].packet_id))
    nxt = c.expect(PUBLISH)
    assert nxt.payload == b"w2"
    assert c.no_packet_within(0.5) is None
    received = [window[1], nxt]
    for p in received:
        c.send(puback(p.packet_id))
    rest = [c.expect(PUBLISH), c.expect(PUBLISH)]
    assert [p.payload for p in rest] == [b"w3", b"w4"]


def test_slow_subscriber_does_not_stall_others(broker_factory, raw, paho_any, uid):
    """A subscriber that never reads its socket must not stall publishers or other
    subscribers (issue 2).  Two stuck readers (QoS 0 and QoS 1) with a tiny receive buffer;
    ~6 MB flows to a normal subscriber, whose QoS 1 stream must arrive complete and in order."""
    b = broker_factory(max_outgoing_buffer=64 * 1024)
    topic = uid("flood")
    stuck = []
    for qos in (0, 1):
        s = raw(b, rcvbuf=4096)
        assert s.connect(uid("stuck")).return_code == 0
        assert s.subscribe([(topic, qos)]) == [qos]
        stuck.append(s)
    fast = paho_any(b, uid("fast"))
    fast.connect()
    fast.subscribe(topic, 1)
    pub = paho_any(b, uid("pub"))
    pub.connect()
    payload = b"x" * 16 * 1024
    count = 600  # ~10 MB: more than a stuck socket's kernel buffers can absorb
    t0 = time.monotonic()
    infos = [pub.publish(topic, payload + str(i).encode(), qos=1, wait=False) for i in range(count)]
    for info in infos:
        info.wait_for_publish(timeout=max(30 - (time.monotonic() - t0), 0.1))
        assert info.is_published(), "publisher stalled: no PUBACK within 30 s"
    got = fast.collect(count, timeout=30)
    assert [int(m.payload[len(payload) :]) for m in got] == list(range(count))
    # The node still answers a brand-new client promptly.
    probe = raw(b)
    t1 = time.monotonic()
    assert probe.connect(uid("probe")).return_code == 0
    probe.send(PINGREQ_BYTES)
    assert probe.expect(PINGRESP)
    assert time.monotonic() - t1 < 2.0


def test_inflight_then_queued_order_after_reconnect(broker_factory, raw, paho_any, uid):
    """With max_inflight=2 and 5 messages: after a reconnect the 2 in-flight ones are re-sent
    first with DUP=1 (original ids), then the 3 that waited in the queue with DUP=0, in publish
    order (4.6)."""
    b = broker_factory(max_inflight=2)
    topic, cid = uid("order"), uid("persist")
    c = raw(b)
    assert c.connect(cid, clean_session=False).return_code == 0
    assert c.subscribe([(topic, 1)]) == [1]
    pub = paho_any(b, uid("pub"))
    pub.connect()
    for i in range(5):
        pub.publish(topic, f"o{i}".encode(), qos=1)
    window = [c.expect(PUBLISH), c.expect(PUBLISH)]
    c.close()
    c2 = raw(b)
    assert c2.connect(cid, clean_session=False).session_present is True
    got = []
    for _ in range(5):
        p = c2.expect(PUBLISH)
        got.append(p)
        c2.send(puback(p.packet_id))
    assert [p.payload for p in got] == [f"o{i}".encode() for i in range(5)]
    assert [p.dup for p in got] == [True, True, False, False, False]
    assert [p.packet_id for p in got[:2]] == [p.packet_id for p in window]
    assert c2.no_packet_within(0.5) is None


def test_stuck_qos0_subscriber_is_bounded(broker_factory, raw, paho_any, uid):
    """Limits.max_outgoing_buffer: a connection that does not read does not make the node
    buffer without bound; QoS 0 deliveries over the limit are dropped (or the client is
    disconnected).  10 MB of QoS 0 is sent to a stuck reader with a 64 kB limit; when it
    finally reads it must not get all of it, and it must then either get a fresh message or
    find its connection closed, never a wedged connection."""
    b = broker_factory(max_outgoing_buffer=64 * 1024)
    topic = uid("stuck")
    stuck = raw(b, rcvbuf=4096)
    assert stuck.connect(uid("stuck"), keepalive=0).return_code == 0
    assert stuck.subscribe([(topic, 0)]) == [0]
    pub = paho_any(b, uid("pub"))
    pub.connect()
    chunk = b"z" * 32 * 1024
    for _ in range(320):  # 10 MB
        pub.publish(topic, chunk, qos=1)
    received = 0
    try:
        while stuck.no_packet_within(1.0) is not None:  # drain what the node kept for it
            received += 1
    except ConnectionClosed:
        return  # disconnected: an accepted outcome (and nothing was buffered without bound)
    assert received < 320, "all 10 MB were buffered for a reader that was not reading"
    # Now that it reads again, it gets new messages: the connection is not wedged.
    pub.publish(topic, b"fresh", qos=1)
    p = stuck.recv_packet(timeout=5)
    assert p.payload == b"fresh"


def test_max_subscriptions_suback_failure(broker_factory, raw, uid):
    """Limits.max_subscriptions: filters beyond the limit get SUBACK 0x80 [MQTT-3.9.3-2 allows
    0x80 per filter]; the connection stays usable."""
    b = broker_factory(max_subscriptions=2)
    c = raw(b)
    assert c.connect(uid("subs")).return_code == 0
    assert c.subscribe([("a/1", 0), ("a/2", 1), ("a/3", 2)]) == [0, 1, 0x80]
    # Replacing an existing filter is not a new subscription.
    assert c.subscribe([("a/2", 2)], packet_id=2) == [2]
    c.send(PINGREQ_BYTES)
    assert c.expect(PINGRESP)
