"""Retained tombstones are collected once they are ``retained_tombstone_seconds`` old.

A clear leaves a versioned tombstone (``mqttring.broker.retained``) so that an older write
arriving late cannot bring the topic back; kept for ever, as before 2026-11-29, every
cleared topic cost a row and its version in memory for the node's life.  A real store,
a clock the test sets; and a real node process, seen through ``/metrics``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from http_support import HOST, HttpNode, scrape, wait_for
from mqtt_client import PUBACK, RawClient, publish
from mqttring.broker.retained import RetainedStore, make_row, topic_key
from mqttring.lsm import LsmStore, Put
from mqttring.protocol.message import Message

pytestmark = pytest.mark.timeout(60)

NUM_SHARDS = 4
S = 10**9  # ns per second: a version's seq is the owner's wall clock in ns


async def test_tombstones_past_their_age_are_collected_and_no_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000 * S]
    monkeypatch.setattr("mqttring.broker.retained.time.time_ns", lambda: clock[0])
    with LsmStore(tmp_path / "s") as store:
        retained = RetainedStore(store, NUM_SHARDS)
        for topic in ("a/1", "a/2", "a/3"):
            await retained.update(Message(topic, b"v", 1, True))
        await retained.update(Message("a/1", b"", 1, True))  # cleared at 1000 s
        clock[0] = 1010 * S
        await retained.update(Message("a/2", b"", 1, True))  # cleared at 1010 s
        await retained.update(Message("a/3", b"", 1, True))
        await retained.update(Message("a/3", b"back", 1, True))  # set again: no tombstone
        assert retained.tombstones == 2
        stale_a2 = retained.version("a/2")
        assert await retained.collect_tombstones(1005 * S, slice_size=1) == 1
        assert retained.tombstones == 1
        assert retained.version("a/1") is None and retained.version("a/2") is not None
        rows = {row[0]: row for _, row in await store.scan("retained", b"")}
        assert set(rows) == {"a/2", "a/3"} and rows["a/2"][1] is None
        again = RetainedStore(store, NUM_SHARDS)
        assert await again.load() == 1 and again.tombstones == 1  # a restart holds a/2's
        # While its tombstone is held, an older write of a/2 arriving late is refused ...
        assert stale_a2 is not None
        older = make_row("a/2", b"old", 1, (stale_a2[0], stale_a2[1] - 1))
        shard = retained.shard_for_topic("a/2")
        assert retained.accept_ops([Put("retained", topic_key(shard, "a/2"), older)]) == []
        # ... and a collected topic takes a new message as any new topic does.
        await retained.update(Message("a/1", b"new", 1, True))
        assert [m.payload for m in retained.matching("a/1")] == [b"new"]


def test_a_node_collects_its_tombstones_after_the_configured_age(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MQTTRING_RETAINED_TOMBSTONE_SECONDS", "1")
    node = HttpNode(tmp_path)
    gauge = ("mqttring_retained_tombstones", ())
    try:
        client = RawClient(HOST, node.port)
        try:
            client.connect("clearer")
            for pid, payload in ((1, b"on"), (2, b"")):  # retain, then clear
                client.send(publish("dev/7/state", payload, qos=1, retain=True,
                                    packet_id=pid))
                client.expect(PUBACK)
        finally:
            client.close()
        with node.http() as http:
            assert scrape(http)[gauge] == 1, "the clear left no tombstone"
            wait_for(lambda: scrape(http)[gauge] == 0, 20, "the tombstone collected")
            assert scrape(http)[("mqttring_retained_messages", ())] == 0
    finally:
        node.stop()
