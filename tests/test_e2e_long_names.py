"""Topic names and client ids longer than what an LMDB key holds (511 bytes).

MQTT allows topic names of 65,535 bytes, so a retained message on any of them must be
stored, acknowledged and survive a restart like any other (``retained.topic_key`` keys the
long ones by a digest).  Client ids are bounded by ``limits.max_client_id_bytes`` (at most
what a persistent session's keys can hold): up to the bound a persistent session works and
survives a restart; past it the CONNECT is refused with CONNACK 2 (MQTT 5: 0x85), as the
spec allows [MQTT-3.1.3-5], never with an internal error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mqtt5_support import Raw5
from mqtt_client import CONNACK, PUBACK, PUBLISH, SUBACK, connect, puback, publish, subscribe
from mqttring.broker.retained import NAMED_TOPIC_BYTES, RetainedStore, topic_key
from mqttring.config import MAX_CLIENT_ID_BYTES
from mqttring.lsm import Delete, LsmStore, Put
from mqttring.protocol.message import Message

pytestmark = pytest.mark.timeout(90)


def long_topics(base: str) -> dict[str, bytes]:
    """Topic -> payload: one at the named-key limit, three past it (ASCII, 2-byte UTF-8,
    and the protocol's 65,535-byte maximum)."""
    at_limit = f"{base}/" + "a" * (NAMED_TOPIC_BYTES - len(base) - 1)
    assert len(at_limit.encode()) == NAMED_TOPIC_BYTES
    return {
        at_limit: b"at-limit",
        f"{base}/" + "b" * 600: b"ascii-600",
        f"{base}/" + "é" * 400: b"utf8-800-bytes",
        f"{base}/" + "c" * (65535 - len(base) - 1): b"max",
    }


def retained_under(client, topic_filter: str, expect: int) -> dict[str, bytes]:
    """Subscribe and take the SUBACK and ``expect`` retained messages (then nothing more
    within half a second); topic -> payload."""
    client.send(subscribe(1, [(topic_filter, 1)]))
    got: dict[str, bytes] = {}
    acked = False
    while len(got) < expect or not acked:
        pkt = client.recv_packet(10)
        if pkt.type == SUBACK:
            assert pkt.return_codes == [1], pkt
            acked = True
        else:
            assert pkt.type == PUBLISH and pkt.retain, pkt
            assert pkt.topic not in got, f"{pkt.topic[:40]}... sent twice"
            got[pkt.topic] = pkt.payload
            client.send(puback(pkt.packet_id))
    assert client.no_packet_within(0.5) is None, "more retained messages than stored"
    return got


def test_retained_on_long_topics_is_acknowledged_stored_and_cleared(node_factory, raw, uid):
    node = node_factory()
    handle = node.start()
    base = uid("long")
    topics = long_topics(base)
    pub = raw(handle)
    assert pub.connect(uid("pub")).return_code == 0
    for pid, (topic, payload) in enumerate(topics.items(), start=1):
        pub.send(publish(topic, payload, qos=1, retain=True, packet_id=pid))
        ack = pub.expect(PUBACK, 10)
        assert ack.packet_id == pid, f"PUBACK for the retained message on {len(topic)} chars"
    sub = raw(handle)
    assert sub.connect(uid("sub")).return_code == 0
    assert retained_under(sub, f"{base}/#", len(topics)) == topics

    # Stored, not just held in memory: a restart reads every one of them back.
    assert node.terminate() == 0
    handle = node.start()
    again = raw(handle)
    assert again.connect(uid("again")).return_code == 0
    assert retained_under(again, f"{base}/#", len(topics)) == topics

    # A clear of a digest-keyed topic is stored too.
    cleared = next(t for t in topics if len(t.encode()) > NAMED_TOPIC_BYTES)
    pub = raw(handle)
    assert pub.connect(uid("pub2")).return_code == 0
    pub.send(publish(cleared, b"", qos=1, retain=True, packet_id=9))
    assert pub.expect(PUBACK, 10).packet_id == 9
    assert node.terminate() == 0
    handle = node.start()
    last = raw(handle)
    assert last.connect(uid("last")).return_code == 0
    left = {t: p for t, p in topics.items() if t != cleared}
    assert retained_under(last, f"{base}/#", len(left)) == left, "cleared, and stays so"
    assert "Traceback" not in node.log_path.read_text(errors="replace")


def test_client_id_at_the_limit_keeps_a_persistent_session_across_a_restart(
        node_factory, raw, uid):
    node = node_factory()
    handle = node.start()
    cid = uid("cid")
    cid += "x" * (MAX_CLIENT_ID_BYTES - len(cid))
    topic = uid("q")
    owner = raw(handle)
    assert owner.connect(cid, clean_session=False).return_code == 0
    assert owner.subscribe([(topic, 1)]) == [1]
    owner.close()
    pub = raw(handle)
    assert pub.connect(uid("pub")).return_code == 0
    pub.send(publish(topic, b"queued", qos=1, packet_id=1))
    assert pub.expect(PUBACK).packet_id == 1
    assert node.terminate() == 0
    handle = node.start()
    back = raw(handle)
    ack = back.connect(cid, clean_session=False)
    assert (ack.return_code, ack.session_present) == (0, True)
    got = back.expect(PUBLISH, 10)
    assert (got.topic, got.payload, got.qos) == (topic, b"queued", 1)


def test_client_id_past_the_limit_is_refused_by_either_protocol(node_factory, raw, uid):
    node = node_factory()
    handle = node.start()
    too_long = "y" * (MAX_CLIENT_ID_BYTES + 1)
    for clean in (True, False):
        client = raw(handle)
        client.send(connect(too_long, clean_session=clean))
        got, closed = client.packets_until_closed(5)
        assert [(p.type, p.return_code) for p in got] == [(CONNACK, 2)], got
        assert closed
    # Multi-byte: the limit is in UTF-8 bytes, not characters.
    wide = raw(handle)
    wide.send(connect("é" * (MAX_CLIENT_ID_BYTES // 2 + 1)))
    got, closed = wide.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 2)], got
    v5 = Raw5(handle.host, handle.port)
    try:
        ack = v5.connect(too_long)
        assert ack.reason_code == 0x85, ack
        assert v5.closed()
    finally:
        v5.close()
    ok = raw(handle)
    assert ok.connect(uid("ok")).return_code == 0, "the node is unaffected"
    assert "Traceback" not in node.log_path.read_text(errors="replace")


def test_a_lower_client_id_limit_is_applied(broker_factory, raw):
    b = broker_factory(max_client_id_bytes=23)
    assert raw(b).connect("c" * 23).return_code == 0
    refused = raw(b)
    refused.send(connect("c" * 24))
    got, _ = refused.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 2)]


async def test_a_replicated_delete_of_a_digest_keyed_topic_forgets_it(tmp_path: Path) -> None:
    """A shard dropped on a replica deletes its rows by key alone: a digest key must still
    find the topic it stands for (``RetainedStore.topic_of_key``)."""
    long_topic = "t/" + "d" * 700
    with LsmStore(tmp_path / "store") as lsm:
        retained = RetainedStore(lsm, 8)
        await retained.update_many([Message(long_topic, b"v", 1, True),
                                    Message("t/short", b"s", 1, True)])
        assert sorted(m.topic for m in retained.matching("t/#")) == [long_topic, "t/short"]
        key = topic_key(retained.shard_for_topic(long_topic), long_topic)
        assert len(key) == 2 + 1 + 32
        assert await lsm.get("retained", key) is not None, "stored under its digest key"
        retained.apply_ops([Delete("retained", key)])
        assert [m.topic for m in retained.matching("t/#")] == ["t/short"]
        assert retained.version(long_topic) is None
        # Unknown digests (a topic this node never held) are ignored, not misread.
        retained.apply_ops([Delete("retained", key)])
        retained.apply_ops([Put("retained", key, [long_topic, b"w", 1, 5, 1])])
        assert [m.payload for m in retained.matching(long_topic)] == [b"w"]
