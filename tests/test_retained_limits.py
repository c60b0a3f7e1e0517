"""``limits.max_retained_bytes`` / ``max_retained_messages``: what a node holds in memory for
retained messages is bounded, and what passes the bound is delivered but not retained.

A fuzz probe published 600 retained messages of 500 kB each and grew one node's RSS by 291
MiB with no bound (every one was acknowledged and kept in memory).  Only what *adds* is
refused: a full node can still be updated in place and emptied.
"""

from __future__ import annotations

import pytest

from mqtt_client import PINGREQ_BYTES, PINGRESP, PUBACK, PUBLISH, publish
from mqttring.broker.retained import RetainedStore, make_row
from mqttring.protocol.message import Message

pytestmark = pytest.mark.timeout(90)


def _retain(topic: str, payload: bytes, qos: int = 0) -> Message:
    return Message(topic, payload, qos, True)


async def _update(store: RetainedStore, *messages: Message) -> None:
    await store.update_many(list(messages))


def _held(store: RetainedStore) -> dict[str, bytes]:
    return {m.topic: m.payload for m in store.matching("#")}


async def test_bytes_past_the_limit_are_not_retained_but_updates_in_place_are() -> None:
    store = RetainedStore(None, 16, max_bytes=100)
    await _update(store, _retain("a", b"x" * 40), _retain("b", b"y" * 40))
    assert store.held_bytes == 82
    await _update(store, _retain("c", b"z" * 40))  # 82 + 41 > 100: refused
    assert _held(store) == {"a": b"x" * 40, "b": b"y" * 40}
    assert store.refused == 1
    await _update(store, _retain("a", b"X" * 50))  # grows a's 40 -> 50: 92, fits
    await _update(store, _retain("b", b"Y" * 60))  # grows b's 40 -> 60: 112, refused
    assert _held(store) == {"a": b"X" * 50, "b": b"y" * 40}, "a refused update keeps the old"
    await _update(store, _retain("b", b"Y" * 10))  # smaller: always passes
    await _update(store, _retain("a", b""))  # a clear always passes
    assert _held(store) == {"b": b"Y" * 10}
    assert store.held_bytes == 11
    await _update(store, _retain("c", b"z" * 40))  # room again
    assert set(_held(store)) == {"b", "c"}
    assert store.refused == 2


async def test_new_topics_past_the_count_are_not_retained() -> None:
    store = RetainedStore(None, 16, max_topics=2)
    await _update(store, _retain("a", b"1"), _retain("b", b"2"), _retain("c", b"3"))
    assert set(_held(store)) == {"a", "b"}
    await _update(store, _retain("b", b"22"))  # an existing topic: updated
    assert _held(store)["b"] == b"22"
    # $SYS topics are node-local and count for nothing.
    await store.update(_retain("$SYS/broker/x", b"s"), persist=False)
    await _update(store, _retain("b", b""), _retain("d", b"4"))
    assert set(_held(store)) == {"a", "d"}
    assert store.refused == 1


async def test_held_bytes_follow_replicas_and_forgotten_shards() -> None:
    """Replicated rows follow the owner's decision (no limit on this side), and what a node
    stops holding leaves its count."""
    owner = RetainedStore(None, 16)
    replica = RetainedStore(None, 16, max_bytes=10)
    await _update(owner, _retain("t/1", b"a" * 30), _retain("t/2", b"b" * 30))
    for message in owner.matching("t/#"):
        version = owner.version(message.topic)
        assert version is not None
        replica.apply_row(make_row(message.topic, message.payload, 0, version))
    assert replica.held_bytes == 66, "a replica holds what its owner retained"
    await replica.drop_shards(replica.shards_held())
    assert replica.held_bytes == 0 and len(replica) == 0
    assert owner.held_bytes == 66


def test_a_node_delivers_but_does_not_retain_past_its_bytes(broker_factory, raw, uid) -> None:
    """Real client, real node: past ``max_retained_bytes`` a retained publish is still
    acknowledged and delivered to the subscribers there are, and a later subscriber gets
    only the retained messages that fitted."""
    node = broker_factory(max_retained_bytes=3000)
    prefix = uid("keep")
    live = raw(node)
    assert live.connect(uid("live")).return_code == 0
    assert live.subscribe([(f"{prefix}/#", 0)]) == [0]
    pub = raw(node)
    assert pub.connect(uid("pub")).return_code == 0
    for i in range(5):  # 1 kB each: the first two fit 3000 bytes, the rest do not
        pub.send(publish(f"{prefix}/{i}", bytes([65 + i]) * 1000, qos=1, retain=True,
                         packet_id=i + 1))
        assert pub.expect(PUBACK).packet_id == i + 1, "acknowledged either way"
    got = [live.expect(PUBLISH) for _ in range(5)]
    assert [p.topic for p in got] == [f"{prefix}/{i}" for i in range(5)], "all delivered"
    late = raw(node)
    assert late.connect(uid("late")).return_code == 0
    assert late.subscribe([(f"{prefix}/#", 0)]) == [0]
    kept = [late.expect(PUBLISH) for _ in range(2)]
    assert sorted(p.topic for p in kept) == [f"{prefix}/0", f"{prefix}/1"]
    assert all(p.retain for p in kept)
    late.send(PINGREQ_BYTES)  # answered behind the retained messages the SUBSCRIBE brought
    assert late.expect(PINGRESP), "the ones past the limit were not retained"
