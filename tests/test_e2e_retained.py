"""Retained messages (MQTT 3.1.1 section 3.3.1.3)."""

from __future__ import annotations

import pytest

from mqtt_client import PUBLISH, publish

pytestmark = pytest.mark.timeout(60)


def test_retained_set_late_subscriber_replace_clear(paho, uid):
    """[MQTT-3.3.1-5] stored; [MQTT-3.3.1-6]/[MQTT-3.3.1-8] sent to a new subscriber with
    RETAIN=1; [MQTT-3.3.1-7] replaced; [MQTT-3.3.1-10]/[MQTT-3.3.1-11] cleared by an empty
    payload and not stored."""
    topic = uid("ret")
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"v1", qos=1, retain=True)

    late = paho(uid("late"))
    late.connect()
    late.subscribe(topic, 1)
    m = late.get()
    assert (m.topic, m.payload, m.retain, m.qos) == (topic, b"v1", True, 1)
    assert late.drain(0.3) == []

    # A live delivery to an established subscription carries RETAIN=0 [MQTT-3.3.1-9].
    pub.publish(topic, b"v2", qos=1, retain=True)
    live = late.get()
    assert (live.payload, live.retain) == (b"v2", False)

    later = paho(uid("later"))
    later.connect()
    later.subscribe(topic, 1)
    m2 = later.get()
    assert (m2.payload, m2.retain) == (b"v2", True), "v2 replaced v1 [MQTT-3.3.1-7]"
    assert later.drain(0.3) == [], "only the last retained message per topic is kept"

    # Clear: the empty retained PUBLISH is still forwarded to current subscribers as a normal
    # message (3.3.1.3), but nothing is retained afterwards.
    pub.publish(topic, b"", qos=1, retain=True)
    cleared = late.get()
    assert (cleared.payload, cleared.retain) == (b"", False)
    last = paho(uid("last"))
    last.connect()
    last.subscribe(topic, 1)
    assert last.drain(0.7) == [], "[MQTT-3.3.1-10] the retained message must be gone"


def test_retained_delivered_at_min_qos_and_via_wildcard(paho, uid):
    """[MQTT-3.8.4-6] applies to retained messages too; a wildcard subscription receives
    the retained message of every matching topic [MQTT-3.3.1-6]."""
    base = uid("retq")
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(f"{base}/a", b"qa2", qos=2, retain=True)
    pub.publish(f"{base}/b", b"qb1", qos=1, retain=True)
    pub.publish(f"{base}/c/d", b"qc0", qos=0, retain=True)
    pub.publish(base, b"parent", qos=1, retain=True)  # 'base/#' matches 'base' too (4.7.1.2)

    for sub_qos in (0, 1, 2):
        s = paho(uid("s"))
        s.connect()
        s.subscribe(f"{base}/#", sub_qos)
        got = {m.topic: (m.payload, m.qos, m.retain) for m in s.collect(4)}
        assert got == {
            base: (b"parent", min(1, sub_qos), True),
            f"{base}/a": (b"qa2", min(2, sub_qos), True),
            f"{base}/b": (b"qb1", min(1, sub_qos), True),
            f"{base}/c/d": (b"qc0", 0, True),
        }
        assert s.drain(0.2) == []
        s.disconnect()
    narrow = paho(uid("n"))
    narrow.connect()
    narrow.subscribe(f"{base}/+", 2)
    got = sorted(m.topic for m in narrow.collect(2))
    assert got == [f"{base}/a", f"{base}/b"]
    assert narrow.drain(0.3) == []


def test_resubscribe_resends_retained(raw, paho, uid):
    """[MQTT-3.8.4-3]: a SUBSCRIBE with an identical filter replaces the subscription and the
    matching retained messages MUST be re-sent."""
    topic = uid("resub")
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"keep", qos=1, retain=True)
    c = raw()
    assert c.connect(uid("raw")).return_code == 0
    assert c.subscribe([(topic, 0)], packet_id=1) == [0]
    first = c.expect(PUBLISH)
    assert (first.payload, first.retain, first.qos) == (b"keep", True, 0)
    assert c.subscribe([(topic, 0)], packet_id=2) == [0]
    again = c.expect(PUBLISH)
    assert (again.payload, again.retain) == (b"keep", True)


def test_raw_retain_flag_on_wire(raw, uid):
    """Exact flags: retained delivery has RETAIN bit set, live one has it clear, QoS 0 has
    no packet id and DUP=0 [MQTT-3.3.1-2]."""
    topic = uid("flags")
    pub = raw()
    assert pub.connect(uid("pub")).return_code == 0
    pub.send(publish(topic, b"r", qos=0, retain=True))
    sub = raw()
    assert sub.connect(uid("sub")).return_code == 0
    # The PUBLISH above is processed before this SUBSCRIBE only if the broker handled it;
    # a PINGREQ/PINGRESP round trip on the publisher's connection proves it was read.
    pub.send(b"\xc0\x00")
    assert pub.recv_packet().name == "PINGRESP"
    assert sub.subscribe([(topic, 1)]) == [1]
    p = sub.expect(PUBLISH)
    assert (p.flags, p.payload, p.packet_id) == (0x01, b"r", None), f"got {p!r}"
    pub.send(publish(topic, b"live", qos=0, retain=True))
    p2 = sub.expect(PUBLISH)
    assert (p2.flags, p2.payload) == (0x00, b"live"), f"[MQTT-3.3.1-9] got {p2!r}"
