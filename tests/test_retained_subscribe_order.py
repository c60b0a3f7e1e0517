"""A SUBSCRIBE's retained messages against the live ones around it: once each, in order.

As from one broker: a message published after the subscriber saw its SUBACK follows the
retained value it replaces, and one published as the subscription is made reaches it
once, live or retained, never both.  A differential probe against mosquitto found both
broken: on a 3-node cluster the retained value came after the live message that replaced
it (6 to 12 rounds of 12), or the new message twice; on one node a QoS 2 message published
with the SUBSCRIBE came twice (20 of 20).  Real sockets, real ``mqttring.node`` processes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster_support import HOST, NodeCluster, start_cluster
from mqtt_client import (
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBACK,
    UNSUBACK,
    Packet,
    RawClient,
    puback,
    pubcomp,
    publish,
    pubrec,
    pubrel,
    subscribe,
    unsubscribe,
)

pytestmark = pytest.mark.timeout(240)

NODES = ("a", "b", "c")
ROUNDS = 8


class Publisher:
    """One publishing connection: each publish waits for its acknowledgement."""

    def __init__(self, client: RawClient) -> None:
        self.client = client
        self.packet_id = 0

    def publish(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        self.packet_id = self.packet_id % 65535 + 1
        pid = self.packet_id
        self.client.send(publish(topic, payload, qos=qos, retain=retain,
                                 packet_id=pid if qos else None))
        if qos == 1:
            assert self.client.expect(PUBACK).packet_id == pid
        elif qos == 2:
            assert self.client.expect(PUBREC).packet_id == pid
            self.client.send(pubrel(pid))
            assert self.client.expect(PUBCOMP).packet_id == pid


def received(client: RawClient, topic: str, seconds: float, *,
             suback: int | None = None) -> list[tuple[bytes, bool]]:
    """(payload, RETAIN) of every PUBLISH on ``topic`` within ``seconds`` (acknowledged,
    QoS 2 carried through: a client that delivers on PUBREL counts it then).  With
    ``suback``, the SUBACK of that packet id must come among them (PUBLISHes before it,
    which the specification allows, count too)."""
    got: list[tuple[bytes, bool]] = []
    held: dict[int, tuple[bytes, bool]] = {}
    acked = suback is None
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        pkt: Packet | None = client.no_packet_within(left)
        if pkt is None:
            break
        if pkt.type == SUBACK:
            assert pkt.packet_id == suback
            acked = True
        elif pkt.type == PUBLISH and pkt.topic == topic:
            assert pkt.payload is not None and pkt.retain is not None
            if pkt.qos == 1:
                assert pkt.packet_id is not None
                client.send(puback(pkt.packet_id))
            if pkt.qos == 2:
                assert pkt.packet_id is not None
                client.send(pubrec(pkt.packet_id))
                held[pkt.packet_id] = (pkt.payload, pkt.retain)  # kept until its PUBREL
            else:
                got.append((pkt.payload, pkt.retain))
        elif pkt.type == PUBREL and pkt.packet_id in held:
            client.send(pubcomp(pkt.packet_id))
            got.append(held.pop(pkt.packet_id))
    assert acked, "no SUBACK"
    return got


def unsubscribed(client: RawClient, topic: str, packet_id: int) -> None:
    """UNSUBSCRIBE ``topic``; what comes before its UNSUBACK (the clearing message) is
    acknowledged and dropped, so that the next round starts clean."""
    client.send(unsubscribe(packet_id, [topic]))
    deadline = time.monotonic() + 10
    while True:
        pkt = client.recv_packet(max(deadline - time.monotonic(), 0.001))
        if pkt.type == UNSUBACK:
            assert pkt.packet_id == packet_id
            return
        if pkt.type == PUBLISH and pkt.qos:
            assert pkt.packet_id is not None
            client.send(puback(pkt.packet_id) if pkt.qos == 1 else pubrec(pkt.packet_id))
        elif pkt.type == PUBREL:
            assert pkt.packet_id is not None
            client.send(pubcomp(pkt.packet_id))


def subscribe_then_publish(publisher: Publisher, subscriber: RawClient, topic: str,
                           qos: int, new_retained: bool) -> list[tuple[bytes, bool]]:
    """'old' retained (acknowledged); SUBSCRIBE, its SUBACK seen; only then 'new'."""
    publisher.publish(topic, b"old", qos, True)
    assert subscriber.subscribe([(topic, qos)]) == [qos]
    publisher.publish(topic, b"new", qos, new_retained)
    got = received(subscriber, topic, 1.0)
    publisher.publish(topic, b"", 1, True)  # cleared for the next round
    unsubscribed(subscriber, topic, 2)
    return got


def published_with_the_subscribe(publisher: Publisher, subscriber: RawClient, topic: str,
                                 qos: int) -> list[tuple[bytes, bool]]:
    """One retained message published at the moment the SUBSCRIBE is sent."""
    sent = threading.Thread(target=publisher.publish, args=(topic, b"once", qos, True))
    sent.start()
    subscriber.send(subscribe(3, [(topic, qos)]))
    sent.join(10)
    got = received(subscriber, topic, 1.0, suback=3)
    publisher.publish(topic, b"", 1, True)
    unsubscribed(subscriber, topic, 4)
    return got


# --------------------------------------------------------------------------- one node


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_one_node_a_message_published_with_the_subscribe_comes_once(raw, qos: int) -> None:
    publisher, subscriber = Publisher(raw()), raw()
    publisher.client.connect(f"race-pub-{qos}")
    subscriber.connect(f"race-sub-{qos}")
    for n in range(ROUNDS * 2):
        topic = f"race/one/{qos}/{n}"
        got = published_with_the_subscribe(publisher, subscriber, topic, qos)
        assert [payload for payload, _ in got] == [b"once"], (n, got)


@pytest.mark.parametrize("new_retained", [False, True], ids=["live", "retained"])
def test_one_node_the_retained_value_comes_before_what_replaced_it(
        raw, new_retained: bool) -> None:
    publisher, subscriber = Publisher(raw()), raw()
    publisher.client.connect("order-pub")
    subscriber.connect("order-sub")
    for n in range(ROUNDS):
        got = subscribe_then_publish(publisher, subscriber, f"order/one/{n}", 1, new_retained)
        assert got == [(b"old", True), (b"new", False)], (n, got)


# --------------------------------------------------------------------------- a cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("retained-order")), NODES)
    yield c
    c.close()


@pytest.fixture
def clients(cluster: NodeCluster) -> Iterator[Callable[[str], RawClient]]:
    made: list[RawClient] = []

    def make(node: str) -> RawClient:
        client = RawClient(HOST, cluster.port(node))
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.mark.parametrize(("qos", "new_retained"), [(1, False), (2, True)],
                         ids=["qos1-live", "qos2-retained"])
def test_cluster_the_retained_value_comes_before_what_replaced_it(
        cluster: NodeCluster, clients: Callable[[str], RawClient], qos: int,
        new_retained: bool) -> None:
    """Publisher on a, subscriber on b, the topic owned by c: the retained value came
    from c after the SUBACK, behind a live message c had routed meanwhile."""
    view = cluster.settle(NODES, timeout=30)
    publisher, subscriber = Publisher(clients("a")), clients("b")
    publisher.client.connect(f"order-pub-{qos}")
    subscriber.connect(f"order-sub-{qos}")
    for n in range(ROUNDS):
        topic = view.topic_owned_by("c", f"order/cluster/{qos}/{n}")
        got = subscribe_then_publish(publisher, subscriber, topic, qos, new_retained)
        assert got == [(b"old", True), (b"new", False)], (n, got)


def test_cluster_a_qos2_message_published_with_the_subscribe_comes_once(
        cluster: NodeCluster, clients: Callable[[str], RawClient]) -> None:
    view = cluster.settle(NODES, timeout=30)
    publisher, subscriber = Publisher(clients("a")), clients("b")
    publisher.client.connect("race-pub-cluster")
    subscriber.connect("race-sub-cluster")
    for n in range(ROUNDS * 2):
        topic = view.topic_owned_by("c", f"race/cluster/{n}")
        got = published_with_the_subscribe(publisher, subscriber, topic, 2)
        assert [payload for payload, _ in got] == [b"once"], (n, got)


@pytest.mark.parametrize("again", ["resubscribe", "unsubscribe-first"])
def test_cluster_a_qos2_message_got_live_comes_again_retained_on_a_new_subscribe(
        cluster: NodeCluster, clients: Callable[[str], RawClient], again: str) -> None:
    """A retained copy carries its message's identity, so that one published with the
    SUBSCRIBE comes once (above); a later SUBSCRIBE must still get it, retained
    [MQTT-3.8.4-3], though the session had it live: it is no retry of that delivery."""
    view = cluster.settle(NODES, timeout=30)
    publisher, subscriber = Publisher(clients("a")), clients("b")
    publisher.client.connect(f"again-pub-{again}")
    subscriber.connect(f"again-sub-{again}")
    for n in range(3):
        topic = view.topic_owned_by("c", f"again/{again}/{n}")
        assert subscriber.subscribe([(topic, 2)], packet_id=5) == [2]
        publisher.publish(topic, b"kept", 2, True)
        assert received(subscriber, topic, 1.0) == [(b"kept", False)]
        if again == "unsubscribe-first":
            unsubscribed(subscriber, topic, 6)
        subscriber.send(subscribe(7, [(topic, 2)]))
        assert received(subscriber, topic, 1.0, suback=7) == [(b"kept", True)], n
        publisher.publish(topic, b"", 1, True)
        unsubscribed(subscriber, topic, 8)
