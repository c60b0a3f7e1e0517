"""Topic wildcards and overlapping subscriptions (MQTT 3.1.1 sections 4.7 and 3.3.5)."""

from __future__ import annotations

import pytest

from mqtt_client import PUBLISH, puback

pytestmark = pytest.mark.timeout(60)

# (filter suffix, topics that match) over a fixed set of topics under a unique root; section
# 4.7.1.2 ("sport/tennis/player1/#" matches "sport/tennis/player1"; "sport/#" matches
# "sport"), 4.7.1.3 ("+" matches exactly one level, including an empty one) and 4.7.3.
TOPICS = ["", "/a", "/a/b", "/a/b/c", "/x/b", "/a/", "/a//c"]
CASES = {
    "/a": ["/a"],
    "/#": ["", "/a", "/a/b", "/a/b/c", "/x/b", "/a/", "/a//c"],
    "/a/#": ["/a", "/a/b", "/a/b/c", "/a/", "/a//c"],
    "/+": ["/a"],
    "/+/b": ["/a/b", "/x/b"],
    "/a/+": ["/a/b", "/a/"],
    "/a/+/c": ["/a/b/c", "/a//c"],
    "/+/+/+": ["/a/b/c", "/a//c"],
    "/a/b/#": ["/a/b", "/a/b/c"],
    "/+/#": ["/a", "/a/b", "/a/b/c", "/x/b", "/a/", "/a//c"],
}


def test_wildcard_matching_table(paho, uid):
    """One subscriber per filter; every topic is published once; each subscriber must receive
    exactly the topics its filter matches (section 4.7)."""
    root = uid("wc")
    subs = {}
    for suffix in CASES:
        s = paho(uid("s"))
        s.connect()
        assert s.subscribe(root + suffix, 1) == [1]
        subs[suffix] = s
    pub = paho(uid("pub"))
    pub.connect()
    for t in TOPICS:
        pub.publish(root + t, t.encode() or b"<root>", qos=1)
    for suffix, expected in CASES.items():
        s = subs[suffix]
        got = s.collect(len(expected)) + s.drain(0.2)
        assert sorted(m.topic for m in got) == sorted(root + t for t in expected), (
            f"filter {root + suffix!r}"
        )


def test_single_level_wildcard_alone(paho, uid):
    """'+' matches a one-level topic; '+/+' matches '/finance' (4.7.1.3: an empty level)."""
    name = uid("lvl")
    s1 = paho(uid("s"))
    s1.connect()
    s1.subscribe("+", 1)
    s2 = paho(uid("s"))
    s2.connect()
    s2.subscribe("+/+", 1)
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(name, b"one-level", qos=1)
    pub.publish("/" + name, b"leading-slash", qos=1)
    assert [m.topic for m in s1.collect(1) + s1.drain(0.3)] == [name]
    assert [m.topic for m in s2.collect(1) + s2.drain(0.3)] == ["/" + name]


def test_dollar_topics_not_matched_by_leading_wildcards(broker_factory, paho_any, uid):
    """[MQTT-4.7.2-1]: filters starting with '#' or '+' do not match topics starting with
    '$'; '$SYS/#' does.  The broker's own $SYS topics (every second) are the '$' topics."""
    b = broker_factory(sys_interval=1.0)
    hash_all = paho_any(b, uid("all"))
    hash_all.connect()
    hash_all.subscribe("#", 0)
    plus = paho_any(b, uid("plus"))
    plus.connect()
    plus.subscribe("+/broker/uptime", 0)
    sys_sub = paho_any(b, uid("sys"))
    sys_sub.connect()
    sys_sub.subscribe("$SYS/#", 0)
    first = sys_sub.get(timeout=4)
    assert first.topic.startswith("$SYS/")
    # Subscribing after the retained $SYS messages exist: they must not be sent to '#' or
    # '+/#' either (the rule applies to retained messages on subscribe as well).
    late = paho_any(b, uid("late"))
    late.connect()
    late.subscribe([("#", 1), ("+/#", 1), ("+/broker/#", 1)])
    sys_sub.drain(1.5)  # let at least one more $SYS cycle pass while '#' listens
    got = hash_all.drain(0.1) + plus.drain(0.1) + late.drain(0.1)
    leaked = [m.topic for m in got if m.topic.startswith("$")]
    assert leaked == []


def test_overlapping_subscriptions_deliver_once_at_highest_qos(raw, paho, uid):
    """[MQTT-3.3.5-1]: with overlapping subscriptions the message is delivered respecting the
    maximum QoS of all matching subscriptions.  3.1.1 also allows extra copies; issue 2 requires
    exactly one copy, checked here on the wire."""
    root = uid("ov")
    c = raw()
    assert c.connect(uid("raw")).return_code == 0
    codes = c.subscribe([(f"{root}/#", 0), (f"{root}/+/c", 2), (f"{root}/b/c", 1)])
    assert codes == [0, 2, 1], "[MQTT-3.8.4-5] one return code per filter, in order"
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(f"{root}/b/c", b"x", qos=2)
    p = c.expect(PUBLISH)
    assert (p.topic, p.payload, p.qos) == (f"{root}/b/c", b"x", 2)
    assert c.no_packet_within(0.7) is None, "overlapping subscriptions delivered twice"
    # Only the '#' filter (QoS 0) matches this one: min(1, 0) = 0.
    pub.publish(f"{root}/z", b"y", qos=1)
    p = c.expect(PUBLISH)
    assert (p.payload, p.qos, p.packet_id) == (b"y", 0, None)
    # '#' (QoS 0) and '+/c' (QoS 2) match, publish QoS 1: delivered at min(1, max(0, 2)) = 1.
    pub.publish(f"{root}/q/c", b"z", qos=1)
    p = c.expect(PUBLISH)
    assert (p.payload, p.qos) == (b"z", 1)
    c.send(puback(p.packet_id))
    assert c.no_packet_within(0.5) is None


def test_overlapping_subscriptions_paho_counts(paho, uid):
    """Same rule seen from paho: three overlapping filters, one message, one delivery."""
    root = uid("ovp")
    s = paho(uid("s"))
    s.connect()
    assert s.subscribe([(f"{root}/#", 1), (f"{root}/+", 0), (f"{root}/a", 2)]) == [1, 0, 2]
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(f"{root}/a", b"once", qos=2)
    got = s.collect(1) + s.drain(0.7)
    assert [(m.payload, m.qos) for m in got] == [(b"once", 2)]


def test_resubscribe_replaces_qos_and_unsubscribe_unknown(raw, paho, uid):
    """[MQTT-3.8.4-3]: an identical filter replaces the subscription (new maximum QoS);
    [MQTT-3.10.4-5]: UNSUBACK even when nothing was unsubscribed."""
    from mqtt_client import UNSUBACK, unsubscribe

    topic = uid("re")
    c = raw()
    assert c.connect(uid("c")).return_code == 0
    assert c.subscribe([(topic, 2)], packet_id=1) == [2]
    assert c.subscribe([(topic, 0)], packet_id=2) == [0]
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"now-qos0", qos=2)
    p = c.expect(PUBLISH)
    assert (p.payload, p.qos) == (b"now-qos0", 0)
    assert c.no_packet_within(0.5) is None, "the old QoS 2 subscription still exists"
    c.send(unsubscribe(77, [uid("never-subscribed")]))
    ack = c.expect(UNSUBACK)
    assert (ack.flags, ack.packet_id) == (0, 77)


def test_unsubscribe_compares_filters_literally(raw, paho, uid):
    """[MQTT-3.10.4-1]: UNSUBSCRIBE filters are compared character by character with the
    existing ones: removing 'a/b' leaves 'a/+' and 'a/#' in place (one delivery, QoS = max of
    the remaining), and removing 'a/#' does not remove 'a/b'."""
    from mqtt_client import UNSUBACK, unsubscribe

    root = uid("lit")
    c = raw()
    assert c.connect(uid("c")).return_code == 0
    assert c.subscribe([(f"{root}/b", 2), (f"{root}/+", 1), (f"{root}/#", 0)]) == [2, 1, 0]
    c.send(unsubscribe(5, [f"{root}/b"]))
    assert c.expect(UNSUBACK).packet_id == 5
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(f"{root}/b", b"1", qos=2)
    p = c.expect(PUBLISH)
    assert (p.payload, p.qos) == (b"1", 1), "'a/+' (QoS 1) must still match"
    c.send(puback(p.packet_id))
    assert c.no_packet_within(0.5) is None
    c.send(unsubscribe(6, [f"{root}/+", f"{root}/#"]))
    assert c.expect(UNSUBACK).packet_id == 6
    pub.publish(f"{root}/b", b"2", qos=2)
    assert c.no_packet_within(0.7) is None, "all matching filters were unsubscribed"


def test_fan_out_to_many_subscribers(raw, paho, uid):
    """One PUBLISH reaches every one of 60 subscribers (via exact, '+' and '#' filters) once."""
    root = uid("fan")
    filters = [f"{root}/x", f"{root}/+", f"{root}/#"]
    subs = []
    for i in range(60):
        c = raw()
        assert c.connect(uid(f"f{i}")).return_code == 0
        assert c.subscribe([(filters[i % 3], 1)]) == [1]
        subs.append(c)
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(f"{root}/x", b"all", qos=1)
    for c in subs:
        p = c.expect(PUBLISH)
        assert (p.payload, p.qos) == (b"all", 1)
    for c in subs[:5]:
        assert c.no_packet_within(0.1) is None
