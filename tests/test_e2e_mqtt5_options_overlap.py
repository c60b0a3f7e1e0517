"""Which subscriptions a message is delivered for, when a client's subscriptions overlap (MQTT 5).

Found by a black-box probe against mosquitto 2.0.11 on 2026-11-29:

* A subscription whose No Local excludes the client's own message is not one the message
  is delivered for [MQTT-3.8.3-3], so it contributes nothing to the copy an overlapping
  subscription brings: not its Subscription Identifier [MQTT-3.3.4-3], not its granted QoS,
  not its Retain As Published.  mqttring sent identifiers [1, 2], QoS 2 and RETAIN 1.
* A retained message sent because of a SUBSCRIBE carries that SUBSCRIBE's identifier, not
  those of the client's older subscriptions that match it too (mqttring sent [1, 2]).

Real sockets against a real node (the in-process ``broker`` fixture), and a 3-node cluster
of ``python -m mqttring.node`` processes, where a persistent session's home (not its edge)
decides and encodes what it gets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster_support import HOST, NodeCluster, start_cluster
from conftest import unique
from mqtt5_support import Paho5, props

SUBSCRIBE, CONNECT, DISCONNECT = 8, 1, 14


def _connected(v5: Callable[..., Paho5], client_id: str = "", **connect: Any) -> Paho5:
    client = v5(client_id or unique("c"))
    client.connect(**connect)
    return client


def _ids(message: Any) -> list[int]:
    value = getattr(message.properties, "SubscriptionIdentifier", [])
    return sorted(value if isinstance(value, list) else [value])


def test_a_no_local_subscription_adds_nothing_to_the_clients_own_message(
        v5: Callable[..., Paho5]) -> None:
    topic = unique("ov")
    client = _connected(v5)
    assert client.subscribe(f"{topic}/#", 2, props(SUBSCRIBE, SubscriptionIdentifier=1),
                            noLocal=True, retainAsPublished=True) == [2]
    assert client.subscribe(f"{topic}/x", 0, props(SUBSCRIBE, SubscriptionIdentifier=2)) == [0]
    client.publish(f"{topic}/x", b"me", 2, retain=True)
    got = client.get()
    # Only the subscription without No Local brings it: its id, its QoS 0, and RETAIN 0
    # (it has no Retain As Published).
    assert (got.payload, _ids(got), got.qos, bool(got.retain)) == (b"me", [2], 0, False)
    # Once: the next thing to arrive is another client's message (through both filters).
    _connected(v5).publish(f"{topic}/x", b"other", 1)
    other = client.get()
    assert (other.payload, _ids(other), other.qos) == (b"other", [1, 2], 1)
    client.publish(f"{topic}/x", b"", 1, retain=True)  # (clears it)


def test_the_no_local_subscriptions_qos_does_not_apply_to_the_clients_own_message(
        v5: Callable[..., Paho5]) -> None:
    """The other way round: the No Local filter grants less; the copy goes at the QoS of
    the one that applies, and other clients' messages at the best of both."""
    topic = unique("ovq")
    client = _connected(v5)
    assert client.subscribe(f"{topic}/+", 0, noLocal=True) == [0]
    assert client.subscribe(f"{topic}/#", 1) == [1]
    client.publish(f"{topic}/x", b"me", 1)
    got = client.get()
    assert (got.payload, got.qos) == (b"me", 1)
    # With No Local on the QoS 2 filter, the own message goes at the other one's QoS 1.
    assert client.subscribe(f"{topic}/+", 2, noLocal=True) == [2]
    client.publish(f"{topic}/x", b"me again", 2)
    got = client.get()
    assert (got.payload, got.qos) == (b"me again", 1)
    _connected(v5).publish(f"{topic}/x", b"other", 2)
    got = client.get()
    assert (got.payload, got.qos) == (b"other", 2)


def test_no_local_on_every_matching_subscription_still_drops_the_own_message(
        v5: Callable[..., Paho5]) -> None:
    topic = unique("ovn")
    client = _connected(v5)
    assert client.subscribe(f"{topic}/#", 1, noLocal=True) == [1]
    assert client.subscribe(f"{topic}/x", 2, noLocal=True) == [2]
    client.publish(f"{topic}/x", b"me", 2)
    _connected(v5).publish(f"{topic}/x", b"other", 1)
    got = client.get()
    assert (got.payload, got.qos) == (b"other", 1)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_retained_message_sent_for_a_subscribe_carries_its_identifier_only(
        v5: Callable[..., Paho5], persistent: bool) -> None:
    topic = unique("rid")
    _connected(v5).publish(f"{topic}/x", b"kept", 1, retain=True)
    connect = {"properties": props(CONNECT, SessionExpiryInterval=60)} if persistent else {}
    client = _connected(v5, **connect)
    assert client.subscribe(f"{topic}/#", 1, props(SUBSCRIBE, SubscriptionIdentifier=1)) == [1]
    first = client.get()
    assert (first.payload, _ids(first), bool(first.retain)) == (b"kept", [1], True)
    assert client.subscribe(f"{topic}/x", 1, props(SUBSCRIBE, SubscriptionIdentifier=2)) == [1]
    again = client.get()
    assert (again.payload, _ids(again), bool(again.retain)) == (b"kept", [2], True)
    # A live message goes for both subscriptions.
    _connected(v5).publish(f"{topic}/x", b"live", 1)
    live = client.get()
    assert (live.payload, _ids(live)) == (b"live", [1, 2])
    _connected(v5).publish(f"{topic}/x", b"", 1, retain=True)  # (clears it)
    if persistent:
        client.disconnect(props(DISCONNECT, SessionExpiryInterval=0))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("overlap")), ("a", "b", "c"))
    yield c
    c.close()


@pytest.mark.timeout(180)
def test_overlapping_options_of_a_session_homed_elsewhere_in_a_cluster(
        cluster: NodeCluster) -> None:
    view = cluster.settle(("a", "b", "c"), timeout=30)
    prefix = unique("cov")
    mine, kept = view.topic_owned_by("a", prefix), view.topic_owned_by("c", prefix)
    cid = view.client_homed_at("c", unique("cov"))
    made: list[Paho5] = []

    def connected(node: str, client_id: str, **connect: Any) -> Paho5:
        client = Paho5(HOST, cluster.port(node), client_id)
        made.append(client)
        client.connect(**connect)
        return client

    try:
        other = connected("a", unique("other"))
        other.publish(kept, b"kept", 1, retain=True)
        client = connected("b", cid, properties=props(CONNECT, SessionExpiryInterval=60))
        assert client.subscribe(f"{prefix}/#", 2, props(SUBSCRIBE, SubscriptionIdentifier=1),
                                noLocal=True, retainAsPublished=True) == [2]
        first = client.get()
        assert (first.payload, _ids(first)) == (b"kept", [1])
        assert client.subscribe(mine, 0, props(SUBSCRIBE, SubscriptionIdentifier=2)) == [0]
        client.publish(mine, b"me", 2, retain=True)
        got = client.get()
        assert (got.payload, _ids(got), got.qos, bool(got.retain)) == (b"me", [2], 0, False)
        assert client.subscribe(kept, 1, props(SUBSCRIBE, SubscriptionIdentifier=3)) == [1]
        again = client.get()
        assert (again.payload, _ids(again), bool(again.retain)) == (b"kept", [3], True)
        for topic in (mine, kept):
            other.publish(topic, b"", 1, retain=True)  # (clears them)
        client.disconnect(props(DISCONNECT, SessionExpiryInterval=0))
    finally:
        for made_client in made:
            made_client.client.loop_stop()
            with contextlib.suppress(Exception):
                made_client.client.disconnect()
