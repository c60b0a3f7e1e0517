"""QoS 0/1/2 end to end (MQTT 3.1.1 sections 3.3-3.7 and 4.3), with paho and a raw client."""

from __future__ import annotations

import pytest

from mqtt_client import (
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    connect,
    puback,
    pubcomp,
    publish,
    pubrec,
    pubrel,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("sub_qos", [0, 1, 2])
def test_delivered_qos_is_min_of_publish_and_granted(paho, uid, sub_qos):
    """[MQTT-3.8.4-6]: delivered QoS = min(published QoS, granted QoS); all 3 x 3 pairs."""
    topic = uid("qos")
    sub = paho(uid("sub"))
    sub.connect()
    granted = sub.subscribe(topic, sub_qos)
    # The server MAY grant less [MQTT-3.9.3], but mqttring grants what was asked (issue 2).
    assert granted == [sub_qos]
    pub = paho(uid("pub"))
    pub.connect()
    for pub_qos in (0, 1, 2):
        pub.publish(topic, f"p{pub_qos}".encode(), qos=pub_qos)
    got = sub.collect(3)
    # One publisher, one topic, each publish completed before the next: [MQTT-4.6.0-6] (every
    # topic is an Ordered Topic by default) fixes the delivery order too.
    delivered = [(m.payload, m.qos) for m in got]
    assert delivered == [(f"p{q}".encode(), min(q, sub_qos)) for q in (0, 1, 2)]
    assert all(not m.retain for m in got), "[MQTT-3.3.1-9] live delivery must have RETAIN=0"
    assert sub.drain(0.3) == [], "a message was delivered more than once"


def test_qos1_inbound_flow_puback_echoes_packet_id(raw, paho, uid):
    """[MQTT-4.3.2-2]/[MQTT-2.3.1-6]: PUBACK carries the PUBLISH's packet id."""
    topic = uid("q1")
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic, 1)
    c = raw()
    assert c.connect(uid("raw")).return_code == 0
    c.send(publish(topic, b"one", qos=1, packet_id=4242))
    ack = c.expect(PUBACK)
    assert ack.flags == 0, "[MQTT-2.2.2-1] PUBACK fixed-header flags are reserved 0"
    assert ack.packet_id == 4242
    msg = sub.get()
    assert (msg.payload, msg.qos) == (b"one", 1)


def test_qos2_inbound_flow_and_duplicate_publish_delivered_once(raw, paho, uid):
    """Section 4.3.3: PUBLISH, PUBREC, PUBREL(flags 0010), PUBCOMP; a DUP re-send of the same
    packet id before PUBREL must not create a second application message [MQTT-4.3.3-2]."""
    topic = uid("q2")
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic, 2)
    c = raw()
    assert c.connect(uid("raw")).return_code == 0
    c.send(publish(topic, b"exactly-once", qos=2, packet_id=7))
    rec = c.expect(PUBREC)
    assert (rec.flags, rec.packet_id) == (0, 7)
    # The sender did not see PUBREC (as far as it knows) and re-sends with DUP=1 [MQTT-3.3.1-1].
    c.send(publish(topic, b"exactly-once", qos=2, packet_id=7, dup=True))
    rec2 = c.expect(PUBREC)
    assert rec2.packet_id == 7, "[MQTT-4.3.3-1] the receiver acknowledges the DUP with PUBREC"
    c.send(pubrel(7))
    comp = c.expect(PUBCOMP)
    assert (comp.flags, comp.packet_id) == (0, 7)
    msgs = sub.collect(1) + sub.drain(1.0)
    assert [(m.payload, m.qos) for m in msgs] == [(b"exactly-once", 2)]
    # After PUBCOMP the packet id is free again: a new message with id 7 is a new message.
    c.send(publish(topic, b"second", qos=2, packet_id=7))
    assert c.expect(PUBREC).packet_id == 7
    c.send(pubrel(7))
    assert c.expect(PUBCOMP).packet_id == 7
    assert sub.get().payload == b"second"
    assert sub.drain(0.5) == []


def test_qos2_outbound_flow_flags_and_exactly_once(raw, paho, uid):
    """Broker -> client at QoS 2: PUBLISH(qos 2) with a non-zero id, PUBREL with flags 0010
    [MQTT-3.6.1-1] carrying the same id [MQTT-2.3.1-6], and no second PUBLISH after PUBREC
    [MQTT-4.3.3-1]."""
    topic = uid("q2out")
    c = raw()
    assert c.connect(uid("raw")).return_code == 0
    assert c.subscribe([(topic, 2)]) == [2]
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"x", qos=2)
    p = c.expect(PUBLISH)
    assert (p.topic, p.payload, p.qos, p.retain, p.dup) == (topic, b"x", 2, False, False)
    assert p.packet_id and 1 <= p.packet_id <= 0xFFFF, "[MQTT-2.3.1-1] non-zero packet id"
    c.send(pubrec(p.packet_id))
    rel = c.expect(PUBREL)
    assert rel.flags == 0x2, "[MQTT-3.6.1-1] PUBREL fixed-header flags must be 0010"
    assert rel.packet_id == p.packet_id
    c.send(pubcomp(p.packet_id))
    assert c.no_packet_within(0.7) is None, "nothing more is owed after PUBCOMP"


def test_qos1_outbound_packet_ids_unique_while_inflight(raw, paho, uid):
    """[MQTT-2.3.1-2]: a new QoS > 0 PUBLISH uses a currently unused packet id; ids of
    unacknowledged messages are distinct and non-zero; PUBACK frees them."""
    topic = uid("ids")
    c = raw()
    assert c.connect(uid("raw")).return_code == 0
    assert c.subscribe([(topic, 1)]) == [1]
    pub = paho(uid("pub"))
    pub.connect()
    for i in range(5):
        pub.publish(topic, f"m{i}".encode(), qos=1)
    got = [c.expect(PUBLISH) for _ in range(5)]
    assert [p.payload for p in got] == [f"m{i}".encode() for i in range(5)], "[MQTT-4.6.0-2]"
    ids = [p.packet_id for p in got]
    assert all(i and 1 <= i <= 0xFFFF for i in ids)
    assert len(set(ids)) == 5, f"packet ids reused while in flight: {ids}"
    for pid in ids:
        c.send(puback(pid))
    assert c.no_packet_within(0.7) is None, "acknowledged messages were re-sent"


def test_qos1_unacked_redelivered_with_dup_after_reconnect(broker, raw, paho, uid):
    """[MQTT-4.4.0-1]: on reconnect with CleanSession=0 the server re-sends unacknowledged
    PUBLISH packets with their original packet ids, and with DUP=1 [MQTT-3.3.1-1]."""
    topic, cid = uid("redeliver"), uid("persist")
    c = raw()
    assert c.connect(cid, clean_session=False).return_code == 0
    assert c.subscribe([(topic, 1)]) == [1]
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"a", qos=1)
    pub.publish(topic, b"b", qos=1)
    first = [c.expect(PUBLISH) for _ in range(2)]
    assert [p.dup for p in first] == [False, False], "first delivery must have DUP=0"
    c.close()  # no PUBACK, no DISCONNECT
    c2 = raw()
    ack = c2.connect(cid, clean_session=False)
    assert (ack.return_code, ack.session_present) == (0, True), "[MQTT-3.2.2-2]"
    again = [c2.expect(PUBLISH) for _ in range(2)]
    assert [(p.payload, p.packet_id) for p in again] == [
        (p.payload, p.packet_id) for p in first
    ], "re-sent with the original packet ids, in order"
    assert [p.dup for p in again] == [True, True], "[MQTT-3.3.1-1] re-delivery must set DUP=1"
    assert all(p.qos == 1 for p in again)
    for p in again:
        c2.send(puback(p.packet_id))
    assert c2.no_packet_within(0.7) is None


def test_qos2_outbound_pubrel_resent_after_reconnect(broker, raw, paho, uid):
    """[MQTT-4.4.0-1]: a PUBREC'd outbound QoS 2 message is resumed after reconnect with a
    PUBREL (not a second PUBLISH), so the application sees it once."""
    topic, cid = uid("q2resume"), uid("persist")
    c = raw()
    assert c.connect(cid, clean_session=False).return_code == 0
    assert c.subscribe([(topic, 2)]) == [2]
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"once", qos=2)
    p = c.expect(PUBLISH)
    c.send(pubrec(p.packet_id))
    assert c.expect(PUBREL).packet_id == p.packet_id
    c.close()  # drop before PUBCOMP
    c2 = raw()
    assert c2.connect(cid, clean_session=False).session_present is True
    rel = c2.expect(PUBREL)
    assert (rel.flags, rel.packet_id) == (0x2, p.packet_id)
    c2.send(pubcomp(p.packet_id))
    assert c2.no_packet_within(0.7) is None, "no PUBLISH may follow a PUBREC'd message"


def test_qos2_inbound_state_survives_reconnect(broker, raw, paho, uid):
    """Section 4.3.3 with CleanSession=0: the broker remembers a PUBREC'd packet id across a
    reconnect, so a DUP re-send followed by PUBREL still delivers exactly once."""
    topic, cid = uid("q2in"), uid("persist")
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic, 2)
    c = raw()
    assert c.connect(cid, clean_session=False).return_code == 0
    c.send(publish(topic, b"only-once", qos=2, packet_id=99))
    assert c.expect(PUBREC).packet_id == 99
    c.close()
    c2 = raw()
    assert c2.connect(cid, clean_session=False).session_present is True
    c2.send(publish(topic, b"only-once", qos=2, packet_id=99, dup=True))
    assert c2.expect(PUBREC).packet_id == 99
    c2.send(pubrel(99))
    assert c2.expect(PUBCOMP).packet_id == 99
    msgs = sub.collect(1) + sub.drain(1.0)
    assert [m.payload for m in msgs] == [b"only-once"]


def test_qos1_order_preserved_many(paho, uid):
    """[MQTT-4.6.0-2..6]: one publisher, one topic, QoS 1: the subscriber sees publish order."""
    topic = uid("order")
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic, 1)
    pub = paho(uid("pub"))
    pub.connect()
    infos = [pub.publish(topic, str(i).encode(), qos=1, wait=False) for i in range(200)]
    for info in infos:
        info.wait_for_publish(timeout=10)
    got = sub.collect(200, timeout=15)
    assert [int(m.payload) for m in got] == list(range(200))
    assert all(m.qos == 1 for m in got)


def test_unsubscribe_stops_delivery(paho, uid):
    """[MQTT-3.10.4-1]/[MQTT-3.10.4-4]: UNSUBACK, and the subscription is gone."""
    topic = uid("unsub")
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic, 1)
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"before", qos=1)
    assert sub.get().payload == b"before"
    sub.unsubscribe(topic)
    pub.publish(topic, b"after", qos=1)
    assert sub.drain(0.7) == []


def test_pubrel_for_unknown_packet_id_gets_pubcomp(raw, uid):
    """4.3.3: the receiver MUST respond to a PUBREL with a PUBCOMP carrying the same packet id
    (a PUBREL may be re-sent after the message was already completed); not a violation."""
    c = raw()
    assert c.connect(uid("rel")).return_code == 0
    c.send(pubrel(555))
    comp = c.expect(PUBCOMP)
    assert (comp.flags, comp.packet_id) == (0, 555)
    c.send(b"\xc0\x00")
    assert c.recv_packet().name == "PINGRESP", "the connection must stay usable"


def test_mixed_qos1_qos2_redelivered_in_order_with_dup(broker, raw, paho, uid):
    """[MQTT-4.4.0-1] and 4.6 ("re-send them in the order in which the original PUBLISH
    packets were sent"): unacknowledged QoS 1 and QoS 2 PUBLISHes come back in order, with
    their ids and DUP=1, after a reconnect."""
    topic, cid = uid("mixed"), uid("persist")
    c = raw()
    assert c.connect(cid, clean_session=False).return_code == 0
    assert c.subscribe([(topic, 2)]) == [2]
    pub = paho(uid("pub"))
    pub.connect()
    for i, q in enumerate((1, 2, 1, 2)):
        pub.publish(topic, f"m{i}".encode(), qos=q)
    first = [c.expect(PUBLISH) for _ in range(4)]
    assert [(p.payload, p.qos) for p in first] == [(b"m0", 1), (b"m1", 2), (b"m2", 1), (b"m3", 2)]
    c.close()
    c2 = raw()
    assert c2.connect(cid, clean_session=False).session_present is True
    again = [c2.expect(PUBLISH) for _ in range(4)]
    assert [(p.payload, p.qos, p.packet_id, p.dup) for p in again] == [
        (p.payload, p.qos, p.packet_id, True) for p in first
    ]
    for p in again:
        c2.send(puback(p.packet_id) if p.qos == 1 else pubrec(p.packet_id))
    rels = [c2.expect(PUBREL) for _ in range(2)]
    assert sorted(r.packet_id for r in rels) == sorted(p.packet_id for p in again if p.qos == 2)
    for r in rels:
        c2.send(pubcomp(r.packet_id))
    assert c2.no_packet_within(0.5) is None


def test_large_payload_and_byte_by_byte_tcp(raw, paho, uid):
    """2.2.3 Remaining Length up to 4 bytes: a 300 kB QoS 2 message round-trips intact; and the
    broker parses a stream fed one byte per TCP segment, and several packets in one segment."""
    topic = uid("big")
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic, 2)
    pub = paho(uid("pub"))
    pub.connect()
    big = bytes(range(256)) * 1200
    pub.publish(topic, big, qos=2)
    m = sub.get()
    assert (m.payload, m.qos) == (big, 2)
    c = raw()
    stream = connect(uid("bytes")) + publish(topic, b"dribble", qos=1, packet_id=3)
    for i in range(len(stream)):
        c.send(stream[i : i + 1])
    assert c.recv_packet().name == "CONNACK"
    assert c.expect(PUBACK).packet_id == 3
    assert sub.get().payload == b"dribble"
    c.send(publish(topic, b"p1") + publish(topic, b"p2", qos=1, packet_id=4) + b"\xc0\x00")
    # 3.1.1 orders PUBACKs among themselves (4.6), not against PINGRESP.
    replies = sorted((p.name, p.packet_id or 0) for p in (c.recv_packet(), c.recv_packet()))
    assert replies == [("PINGRESP", 0), ("PUBACK", 4)]
    assert [x.payload for x in sub.collect(2)] == [b"p1", b"p2"]


def test_acks_sent_in_publish_order(raw, uid):
    """[MQTT-4.6.0-2]: PUBACKs in the order the QoS 1 PUBLISHes were received;
    [MQTT-4.6.0-3]: PUBRECs likewise for QoS 2; [MQTT-4.6.0-4]: PUBRELs in PUBREC order."""
    topic = uid("ackorder")
    c = raw()
    assert c.connect(uid("ack")).return_code == 0
    c.send(b"".join(publish(topic, b"x", qos=1, packet_id=i) for i in range(10, 20)))
    assert [c.expect(PUBACK).packet_id for _ in range(10)] == list(range(10, 20))
    c.send(b"".join(publish(topic, b"y", qos=2, packet_id=i) for i in range(30, 36)))
    assert [c.expect(PUBREC).packet_id for _ in range(6)] == list(range(30, 36))
    c.send(b"".join(pubrel(i) for i in range(30, 36)))
    assert [c.expect(PUBCOMP).packet_id for _ in range(6)] == list(range(30, 36))


def test_zero_length_payload_and_utf8_topic(paho, uid):
    """1.5.3 UTF-8 topic names (multi-byte characters) and a zero-length payload (3.3.3:
    "It is valid for a PUBLISH Packet to contain a zero length payload")."""
    topic = uid("utf8") + "/é/ü☃/日本"
    sub = paho(uid("sub"))
    sub.connect()
    sub.subscribe(topic.split("/")[0] + "/+/ü☃/#", 1)
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"", qos=1)
    m = sub.get()
    assert (m.topic, m.payload) == (topic, b"")


def test_outbound_packet_ids_never_zero_across_wraparound(raw, uid):
    """[MQTT-2.3.1-1]: packet ids are 1..65535.  70 000 QoS 1 deliveries to one subscriber
    (acknowledged as they come) force the broker's id counter past 65535: no id 0, no id
    reused while still unacknowledged, every message delivered in order."""
    topic = uid("wrap")
    sub = raw()
    assert sub.connect(uid("sub")).return_code == 0
    assert sub.subscribe([(topic, 1)]) == [1]
    pub = raw()
    assert pub.connect(uid("pub")).return_code == 0
    # Batches stay under the default max_queued (1000) so nothing is legitimately dropped;
    # every delivery is acknowledged at once, so the default inflight window keeps moving.
    total, batch = 70_000, 500
    expected = 0
    for start in range(0, total, batch):
        pub.send(b"".join(
            publish(topic, str(i).encode(), qos=1, packet_id=(i % 65535) + 1)
            for i in range(start, start + batch)
        ))  # fmt: skip
        for _ in range(batch):
            p = sub.expect(PUBLISH, timeout=10)
            assert p.packet_id and 1 <= p.packet_id <= 0xFFFF, f"bad packet id {p.packet_id}"
            assert int(p.payload) == expected, f"out of order at {expected}: {p!r}"
            expected += 1
            sub.send(puback(p.packet_id))
        for _ in range(batch):
            assert pub.expect(PUBACK, timeout=10)
    assert expected == total
