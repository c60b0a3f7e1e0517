"""Packets of different clients are handled in the order they arrive at one node.

MQTT orders the packets of one connection, and says nothing across connections; but clients
rely on it (Eclipse Paho's interoperability suite subscribes with one client and publishes
with another without waiting for the SUBACK), and mosquitto, one thread handling sockets in
the order epoll reports them, always delivers.  trio reverses a batch of runnable tasks half
of the time; ``mqttring.broker.scheduling`` turns that off.  Without it this test misses
about half of the messages.
"""

from __future__ import annotations

import pytest

from mqtt_client import CONNACK, PUBLISH, SUBACK, connect, publish, subscribe

pytestmark = pytest.mark.timeout(60)

ROUNDS = 60


def test_a_subscribe_is_handled_before_a_later_publish_of_another_client(raw, uid):
    """B's SUBSCRIBE, then at once A's PUBLISH to that topic: B gets the message, every time."""
    # The publisher connects first: its tasks are the older ones, so an order by task age
    # (trio's test-only deterministic mode) would fail this test too.
    pub = raw()
    pub.send(connect(uid("order-pub")))
    pub.expect(CONNACK)
    sub = raw()
    sub.send(connect(uid("order-sub")))
    sub.expect(CONNACK)
    barrier = uid("order-barrier")
    sub.send(subscribe(1, [(barrier, 0)]))
    sub.expect(SUBACK)

    topics = [uid(f"order-{i}") for i in range(ROUNDS)]
    topics_seen: list[str] = []
    for i, topic in enumerate(topics):
        # Back to back, no wait between: the two packets usually reach the node in one
        # epoll wake-up.  Waiting for the SUBACK before the next round keeps rounds apart.
        sub.send(subscribe(i + 2, [(topic, 0)]))
        pub.send(publish(topic, f"m{i}".encode()))
        got = sub.recv_packet()
        while got.type == PUBLISH:  # the previous round's message may come first
            assert got.topic in topics
            topics_seen.append(got.topic)
            got = sub.recv_packet()
        assert got.type == SUBACK and got.packet_id == i + 2, got
    # A's packets are handled in order and its messages reach B in order [MQTT-4.6.0-6]:
    # once the barrier message arrives, every earlier one that was delivered has arrived.
    pub.send(publish(barrier, b"end"))
    while True:
        got = sub.expect(PUBLISH)
        if got.topic == barrier:
            break
        topics_seen.append(got.topic)
    missed = [t for t in topics if t not in topics_seen]
    assert not missed, f"{len(missed)} of {ROUNDS} messages missed: {missed[:5]}"

