"""QoS 2 answers in the order of a broker that handles one packet at a time.

A client that writes PUBLISH and its PUBREL at once (before our PUBREC: a raw-packet test,
a client pipelining its flow) must get PUBREC, then PUBCOMP, and the message once; the
node accepts a QoS 2 PUBLISH asynchronously (its owner, a group commit) while it already
reads the next packets, and answered that PUBREL at once: PUBCOMP came first.  Likewise
the PUBREC of a resent PUBLISH (its first PUBREC lost) read behind a new one must not
overtake that one's PUBREC [MQTT-4.6.0-3].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from conftest import BrokerHandle, unique
from mqtt5_support import Raw5
from mqtt_client import PUBCOMP, PUBLISH, PUBREC, publish, pubrel
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets5 import PubComp5, Publish5, PubRec5, PubRel5


def _subscriber(raw: Callable[..., Any], topic: str) -> Any:
    sub = raw()
    sub.connect(unique("sub"))
    assert sub.subscribe([(topic, 0)]) == [0]
    return sub


def test_mqtt311_publish_and_pubrel_written_at_once(broker: BrokerHandle,
                                                    raw: Callable[..., Any]) -> None:
    topic = unique("q2order/a")
    sub = _subscriber(raw, topic)
    pub = raw()
    pub.connect(unique("pub"))
    pub.send(publish(topic, b"one", qos=2, packet_id=1) + pubrel(1))
    first, second = pub.recv_packet(), pub.recv_packet()
    assert (first.type, first.packet_id) == (PUBREC, 1), first
    assert (second.type, second.packet_id) == (PUBCOMP, 1), second
    assert sub.expect(PUBLISH).payload == b"one"
    # The id is free again: a new message with it is a new message, routed.
    pub.send(publish(topic, b"two", qos=2, packet_id=1))
    assert pub.expect(PUBREC).packet_id == 1
    pub.send(pubrel(1))
    assert pub.expect(PUBCOMP).packet_id == 1
    assert sub.expect(PUBLISH).payload == b"two"
    assert sub.no_packet_within(0.3) is None  # "one" came once


def test_mqtt311_resent_publish_answered_behind_a_new_one(broker: BrokerHandle,
                                                          raw: Callable[..., Any]) -> None:
    topic = unique("q2order/b")
    sub = _subscriber(raw, topic)
    pub = raw()
    pub.connect(unique("pub"))
    pub.send(publish(topic, b"five", qos=2, packet_id=5))
    assert pub.expect(PUBREC).packet_id == 5
    # As if that PUBREC were lost: 5 again (DUP) behind a new 6, in one write.
    pub.send(publish(topic, b"six", qos=2, packet_id=6)
             + publish(topic, b"five", qos=2, packet_id=5, dup=True))
    answers = [pub.recv_packet() for _ in range(2)]
    assert [(p.type, p.packet_id) for p in answers] == [(PUBREC, 6), (PUBREC, 5)], answers
    pub.send(pubrel(5) + pubrel(6))
    assert [pub.expect(PUBCOMP).packet_id for _ in range(2)] == [5, 6]
    assert [sub.expect(PUBLISH).payload for _ in range(2)] == [b"five", b"six"]
    assert sub.no_packet_within(0.3) is None  # "five" was not routed again


@pytest.mark.parametrize("pipelined", [1, 3])
def test_mqtt5_publish_and_pubrel_written_at_once(broker: BrokerHandle,
                                                  raw: Callable[..., Any],
                                                  pipelined: int) -> None:
    topic = unique("q2order/c")
    sub = _subscriber(raw, topic)
    client = Raw5(broker.host, broker.port)
    try:
        assert client.connect(unique("pub5"), receive_maximum=10).reason_code == 0  # type: ignore[union-attr]
        ids = range(1, pipelined + 1)
        client.send(b"".join(encode5(Publish5(topic, b"m%d" % i, 2, False, False, i))
                             + encode5(PubRel5(i)) for i in ids))
        answers = [client.recv() for _ in range(2 * pipelined)]
        seen = [(type(p).__name__, p.packet_id, p.reason_code) for p in answers]  # type: ignore[union-attr]
        expected = []
        for i in ids:
            expected += [("PubRec5", i, 0), ("PubComp5", i, 0)]
        assert sorted(seen, key=lambda s: (s[1], s[0] != "PubRec5")) == expected, seen
        for i in ids:  # each PUBCOMP after its own PUBREC, PUBRECs in order
            assert seen.index(("PubRec5", i, 0)) < seen.index(("PubComp5", i, 0)), seen
        assert [s[1] for s in seen if s[0] == "PubRec5"] == list(ids), seen
        assert [sub.expect(PUBLISH).payload for _ in ids] == [b"m%d" % i for i in ids]
        # The Receive Maximum count was given back: 10 more in flight are allowed.
        client.send(b"".join(encode5(Publish5(topic, b"x", 2, False, False, 100 + i))
                             for i in range(10)))
        again = [client.recv() for _ in range(10)]
        assert all(isinstance(p, PubRec5) and p.reason_code == 0 for p in again), again
        client.send(b"".join(encode5(PubRel5(100 + i)) for i in range(10)))
        done = [client.recv() for _ in range(10)]
        assert all(isinstance(p, PubComp5) for p in done), done
    finally:
        client.close()
