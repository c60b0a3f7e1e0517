"""A Message Expiry Interval of 0 (MQTT 5): delivered at once, never kept for later.

Found by a black-box probe on 2026-11-29: a v5 PUBLISH (or will) with a Message Expiry
Interval of 0 got its PUBACK and reached 3.1.1 subscribers, but never a v5 subscriber, live
or retained: its deadline was the moment it was received, so every v5 copy was "expired".
The interval counts whole seconds (``session5`` module docstring): a copy whose onward
delivery starts less than a second past its deadline goes with an interval of 0
[MQTT-3.3.2-6], so a subscriber that gets the message at once gets it, v5 and 3.1.1 alike;
a stored copy is expired from its deadline on, so it is not replayed as a retained message
nor kept in an offline session's queue.  (mosquitto 2.0.11 takes 0 for no expiry at all.)

Real sockets against a real node (the in-process ``broker`` fixture), and a 3-node cluster
of ``python -m mqttring.node`` processes, where a copy crosses a node or two first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster_support import HOST, Clients, NodeCluster, start_cluster
from conftest import PahoClient, unique
from mqtt5_support import Paho5, props

PUBLISH, CONNECT, DISCONNECT, WILL = 3, 1, 14, 99


def _connected(v5: Callable[..., Paho5], client_id: str = "", **connect: Any) -> Paho5:
    client = v5(client_id or unique("c"))
    client.connect(**connect)
    return client


def _expiry(message: Any) -> int | None:
    return getattr(message.properties, "MessageExpiryInterval", None)


def _zero() -> Any:
    return props(PUBLISH, MessageExpiryInterval=0)


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_a_live_message_with_expiry_0_reaches_v5_and_311_subscribers(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient], qos: int) -> None:
    topic = unique("mei0")
    sub5 = _connected(v5)
    assert sub5.subscribe(f"{topic}/#", 2) == [2]
    sub3 = paho(unique("old"))
    sub3.connect()
    assert sub3.subscribe(f"{topic}/#", 2) == [2]
    _connected(v5).publish(f"{topic}/z", b"now", qos, properties=_zero())
    got = sub5.get()
    assert (got.topic, got.payload, got.qos, _expiry(got)) == (f"{topic}/z", b"now", qos, 0)
    got3 = sub3.get()
    assert (got3.payload, got3.qos) == (b"now", qos)


def test_a_retained_message_with_expiry_0_is_delivered_live_but_not_kept(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient]) -> None:
    topic = unique("mei0r")
    publisher = _connected(v5)
    publisher.publish(f"{topic}/r", b"old", 1, retain=True)
    publisher.publish(f"{topic}/s", b"sentinel", 1, retain=True)
    sub5 = _connected(v5)
    assert sub5.subscribe(f"{topic}/#", 1, retainAsPublished=True) == [1]
    assert sorted(m.payload for m in (sub5.get(), sub5.get())) == [b"old", b"sentinel"]
    publisher.publish(f"{topic}/r", b"brief", 1, retain=True, properties=_zero())
    live = sub5.get()
    assert (live.payload, bool(live.retain), _expiry(live)) == (b"brief", True, 0)
    # It replaced "old" [MQTT-3.3.1-5], and has expired for later subscribers, 3.1.1 too.
    late5 = _connected(v5)
    assert late5.subscribe(f"{topic}/#", 1) == [1]
    assert late5.get().payload == b"sentinel"
    late3 = paho(unique("late"))
    late3.connect()
    assert late3.subscribe(f"{topic}/#", 1) == [1]
    assert late3.get().payload == b"sentinel"
    assert late5.messages.empty() and not late3.drain(0.3)
    for t in ("r", "s"):
        publisher.publish(f"{topic}/{t}", b"", 1, retain=True)  # (clears them)


def test_a_will_with_expiry_0_reaches_v5_and_311_subscribers(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient]) -> None:
    topic = unique("mei0w")
    sub5 = _connected(v5)
    assert sub5.subscribe(topic, 1) == [1]
    sub3 = paho(unique("old"))
    sub3.connect()
    assert sub3.subscribe(topic, 1) == [1]
    dying = v5(unique("dying"))
    dying.connect(will=(topic, b"gone", 1, False, props(WILL, MessageExpiryInterval=0)))
    dying.drop()
    got = sub5.get()
    assert (got.payload, _expiry(got)) == (b"gone", 0)
    assert sub3.get().payload == b"gone"


def test_an_offline_session_does_not_keep_a_message_with_expiry_0(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient]) -> None:
    """Onward delivery to a session without a connection cannot start at once: expired by
    the time it reconnects, for v5 and 3.1.1 sessions alike."""
    topic = unique("mei0q")
    cid5, cid3 = unique("s5"), unique("s3")
    session = props(CONNECT, SessionExpiryInterval=60)
    sub5 = _connected(v5, cid5, properties=session)
    assert sub5.subscribe(topic, 1) == [1]
    sub5.disconnect()
    sub3 = paho(cid3, clean_session=False)
    sub3.connect()
    assert sub3.subscribe(topic, 1) == [1]
    sub3.disconnect()
    publisher = _connected(v5)
    publisher.publish(topic, b"brief", 1, properties=_zero())
    publisher.publish(topic, b"kept", 1, properties=props(PUBLISH, MessageExpiryInterval=60))
    back5 = _connected(v5, cid5, clean_start=False, properties=session)
    got = back5.get()
    assert (got.payload, _expiry(got) is not None and 0 < _expiry(got) <= 60) == (b"kept", True)
    back3 = paho(cid3, clean_session=False)
    assert back3.connect()
    assert back3.get().payload == b"kept"
    assert back5.messages.empty() and not back3.drain(0.3)
    back5.disconnect(props(DISCONNECT, SessionExpiryInterval=0))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("mei0")), ("a", "b", "c"))
    yield c
    c.close()


@pytest.mark.timeout(180)
def test_expiry_0_across_a_cluster(cluster: NodeCluster, clients: Clients) -> None:
    """Published on A to topics each node owns: v5 (B) and 3.1.1 (C) subscribers get every
    one, at QoS 0 and 1; the owner does not replay a retained one to a later subscriber."""
    view = cluster.settle(("a", "b", "c"), timeout=30)
    prefix = unique("cmei0")
    topics = [view.topic_owned_by(node, prefix) for node in ("a", "b", "c")]
    made: list[Paho5] = []
    try:
        sub5 = Paho5(HOST, cluster.port("b"), unique("s5"))
        made.append(sub5)
        sub5.connect()
        assert sub5.subscribe(f"{prefix}/#", 1) == [1]
        sub3 = clients.connected(cluster.port("c"), name="v311@c")
        assert sub3.subscribe(f"{prefix}/#", 1) == [1]
        pub = Paho5(HOST, cluster.port("a"), unique("p"))
        made.append(pub)
        pub.connect()
        sent = [(t, qos) for t in topics for qos in (0, 1)]
        for topic, qos in sent:
            pub.publish(topic, f"{topic}@{qos}".encode(), qos, properties=_zero())
        got = [sub5.get() for _ in sent]
        assert sorted((m.payload, m.qos, _expiry(m)) for m in got) == sorted(
            (f"{t}@{q}".encode(), q, 0) for t, q in sent)
        assert sorted(d.payload for d in sub3.collect(len(sent))) == sorted(
            f"{t}@{q}".encode() for t, q in sent)
        pub.publish(topics[2], b"brief", 1, retain=True, properties=_zero())
        pub.publish(topics[1], b"sentinel", 1, retain=True)
        assert sub5.get().payload == b"brief" and sub5.get().payload == b"sentinel"
        late = Paho5(HOST, cluster.port("b"), unique("late"))
        made.append(late)
        late.connect()
        assert late.subscribe(f"{prefix}/#", 1) == [1]
        assert late.get().payload == b"sentinel"
        with pytest.raises(AssertionError, match="no message"):
            late.get(0.5)
        for topic in topics[1:]:
            pub.publish(topic, b"", 1, retain=True)  # (clears them)
    finally:
        for client in made:
            client.client.loop_stop()
            with contextlib.suppress(Exception):
                client.client.disconnect()
