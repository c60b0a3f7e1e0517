"""$SYS topics (issue 2; names as mosquitto's, MQTT 3.1.1 section 4.7.2 reserves '$')."""

from __future__ import annotations

import contextlib
import time

import pytest

pytestmark = pytest.mark.timeout(60)

SYS_TOPICS = [
    "$SYS/broker/uptime",
    "$SYS/broker/clients/connected",
    "$SYS/broker/messages/received",
    "$SYS/broker/messages/sent",
    "$SYS/broker/bytes/received",
    "$SYS/broker/bytes/sent",
    "$SYS/broker/retained messages/count",
]


def number(payload: bytes) -> int:
    """'123' or mosquitto's '123 seconds' -> 123."""
    text = payload.decode().strip()
    return int(float(text.split()[0]))


def sample(client, topics: list[str], timeout: float = 4.0) -> dict[str, int]:
    """The next value published for each of ``topics`` (live publications only)."""
    values: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while set(topics) - set(values):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no fresh value for {sorted(set(topics) - set(values))}"
        m = client.get(timeout=remaining)
        if m.topic in topics and not m.retain:
            values[m.topic] = number(m.payload)
    return values


def test_sys_topics_present_retained_and_plausible(paho, uid):
    watcher = paho(uid("sys"))
    watcher.connect()
    watcher.subscribe("$SYS/broker/#", 0)
    # First: what a new subscriber gets right away must be retained values (RETAIN=1).
    first: dict[str, object] = {}
    deadline = time.monotonic() + 3.0
    while set(SYS_TOPICS) - set(first) and time.monotonic() < deadline:
        m = watcher.get(timeout=max(deadline - time.monotonic(), 0.05))
        first.setdefault(m.topic, m)
    missing = sorted(set(SYS_TOPICS) - set(first))
    assert missing == [], f"$SYS topics never published: {missing}"
    assert all(first[t].retain for t in SYS_TOPICS), "$SYS topics are published retained"

    before = sample(watcher, SYS_TOPICS)
    assert before["$SYS/broker/clients/connected"] == 1, "only this watcher is connected"
    assert before["$SYS/broker/uptime"] >= 0

    # Traffic: three more clients, 20 messages of 1000 bytes, three retained topics.
    topic = uid("load")
    extra = []
    for _ in range(3):
        c = paho(uid("x"))
        c.connect()
        extra.append(c)
    sink = extra[0]
    sink.subscribe(f"{topic}/#", 0)
    for i in range(20):
        extra[1].publish(f"{topic}/{i}", b"p" * 1000, qos=1)
    for i in range(3):
        extra[2].publish(f"{topic}/r{i}", b"keep", qos=1, retain=True)
    sink.collect(23)
    time.sleep(1.2)  # make sure the next sample is computed after the traffic
    watcher.clear()
    after = sample(watcher, SYS_TOPICS)

    assert after["$SYS/broker/uptime"] > before["$SYS/broker/uptime"], (before, after)
    assert after["$SYS/broker/clients/connected"] == 4, (before, after)
    assert after["$SYS/broker/messages/received"] >= before["$SYS/broker/messages/received"] + 23
    assert after["$SYS/broker/messages/sent"] >= before["$SYS/broker/messages/sent"] + 23
    assert after["$SYS/broker/bytes/received"] >= before["$SYS/broker/bytes/received"] + 20_000
    assert after["$SYS/broker/bytes/sent"] >= before["$SYS/broker/bytes/sent"] + 20_000
    assert (
        after["$SYS/broker/retained messages/count"]
        == before["$SYS/broker/retained messages/count"] + 3
    ), (before, after)

    # Disconnecting clients and clearing the retained topics brings the gauges back down.
    for c in extra:
        c.disconnect()
    cleaner = paho(uid("clean"))
    cleaner.connect()
    for i in range(3):
        cleaner.publish(f"{topic}/r{i}", b"", qos=1, retain=True)
    cleaner.disconnect()
    time.sleep(1.2)
    watcher.clear()
    final = sample(watcher, SYS_TOPICS)
    assert final["$SYS/broker/clients/connected"] == 1, (after, final)
    assert (
        final["$SYS/broker/retained messages/count"]
        == before["$SYS/broker/retained messages/count"]
    ), (before, after, final)
    # Counters never go backwards.
    for name in ("messages/received", "messages/sent", "bytes/received", "bytes/sent"):
        key = f"$SYS/broker/{name}"
        assert final[key] >= after[key], key


SHARED = [f"$SYS/broker/shared/{name}"
          for name in ("groups", "placed", "declined", "redispatched", "untracked")]


def test_shared_subscription_counters(paho, uid):
    """Shares with members here, copies placed, and copies handed back when a member ends
    with them unacknowledged (a raw client that never sends PUBACK)."""
    from mqtt_client import PUBLISH, RawClient

    watcher = paho(uid("sys"))
    watcher.connect()
    watcher.subscribe("$SYS/broker/shared/#", 0)
    before = sample(watcher, SHARED)
    topic = uid("sh")
    share = f"$share/g/{topic}/#"
    steady = paho(uid("steady"))
    steady.connect()
    steady.subscribe(share, 1)
    broker = watcher.broker
    stubborn = RawClient(broker.host, broker.port, timeout=5)
    try:
        assert stubborn.connect(uid("stubborn")).return_code == 0
        assert stubborn.subscribe([(share, 1)]) == [1]
        pub = paho(uid("pub"))
        pub.connect()
        for i in range(10):
            pub.publish(f"{topic}/{i}", b"x", qos=1)
        held = 0
        with contextlib.suppress(TimeoutError):
            while True:
                if stubborn.recv_packet(timeout=1.0).type == PUBLISH:
                    held += 1
        assert held
        time.sleep(1.2)
        watcher.clear()
        during = sample(watcher, SHARED)
        assert during["$SYS/broker/shared/groups"] == before["$SYS/broker/shared/groups"] + 1
        assert during["$SYS/broker/shared/placed"] >= before["$SYS/broker/shared/placed"] + 10
    finally:
        stubborn.close()  # no PUBACK, no DISCONNECT: its copies go back to the share
    steady.collect(10)
    time.sleep(1.2)
    watcher.clear()
    after = sample(watcher, SHARED)
    # What it held, and what it had queued beyond its inflight window (never sent).
    gone = after["$SYS/broker/shared/redispatched"] - before["$SYS/broker/shared/redispatched"]
    assert gone >= held, (before, after)
    assert after["$SYS/broker/shared/placed"] == during["$SYS/broker/shared/placed"] + gone
