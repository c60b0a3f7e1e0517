"""MQTT 5.0 across a real 3-node cluster (``python -m mqttring.node`` processes).

A v5 publisher on one node, v5 and 3.1.1 subscribers on the others: properties and
subscription identifiers arrive whichever node owns the topic, at QoS 0 (which would
otherwise travel in packed 3.1.1 frames) and QoS 1; retained properties come back from the
owner; wills keep their properties and their delay at the client id's home.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster_support import HOST, Clients, NodeCluster, ViewInfo, start_cluster, unique
from mqtt5_support import WAIT, Paho5, props

pytestmark = pytest.mark.timeout(180)

NODES = ("a", "b", "c")
PUBLISH, SUBSCRIBE, CONNECT, WILL = 3, 8, 1, 99


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("mqtt5")), NODES)
    yield c
    c.close()


@pytest.fixture
def view(cluster: NodeCluster) -> ViewInfo:
    return cluster.settle(NODES, timeout=30)


@pytest.fixture
def v5(cluster: NodeCluster) -> Iterator[Callable[..., Paho5]]:
    made: list[Paho5] = []

    def make(node: str, client_id: str = "") -> Paho5:
        client = Paho5(HOST, cluster.port(node), client_id)
        made.append(client)
        return client

    yield make
    for client in made:
        client.client.loop_stop()
        with contextlib.suppress(Exception):
            client.client.disconnect()


def one_topic_per_owner(view: ViewInfo, prefix: str) -> dict[str, str]:
    out = {}
    for node in NODES:
        for n in range(10_000):
            topic = f"{prefix}/{n}"
            if view.owner_of_topic(topic) == node:
                out[node] = topic
                break
    return out


@pytest.mark.parametrize("qos", [0, 1])
def test_properties_and_subscription_ids_across_nodes(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5], clients: Clients,
        qos: int) -> None:
    prefix = unique("c5")
    topics = one_topic_per_owner(view, prefix)
    sub_b = v5("b")
    sub_b.connect()
    assert sub_b.subscribe(f"{prefix}/#", 1, props(SUBSCRIBE, SubscriptionIdentifier=7)) == [1]
    sub_c = v5("c")
    sub_c.connect()
    assert sub_c.subscribe(f"{prefix}/+", 1, props(SUBSCRIBE, SubscriptionIdentifier=9)) == [1]
    old_c = clients.connected(cluster.port("c"), name="v311@c")
    assert old_c.subscribe(f"{prefix}/#", 1) == [1]
    pub = v5("a")
    pub.connect()
    for owner, topic in topics.items():
        pub.publish(topic, owner.encode(), qos, properties=props(
            PUBLISH, UserProperty=[("owner", owner)], ContentType="c/t",
            CorrelationData=b"id-" + owner.encode(), ResponseTopic=f"{prefix}/reply",
            MessageExpiryInterval=600))
    for sub, sid in ((sub_b, 7), (sub_c, 9)):
        got = {m.payload.decode(): m for m in (sub.get() for _ in topics)}
        assert set(got) == set(NODES)
        for owner, m in got.items():
            p = m.properties
            assert p.UserProperty == [("owner", owner)] and p.ContentType == "c/t"
            assert p.CorrelationData == b"id-" + owner.encode()
            assert p.ResponseTopic == f"{prefix}/reply"
            assert 0 < p.MessageExpiryInterval <= 600
            assert p.SubscriptionIdentifier == [sid]
    plain = old_c.collect(len(topics))
    assert sorted(d.payload for d in plain) == sorted(n.encode() for n in NODES)


@pytest.mark.parametrize("qos", [0, 1])
def test_311_publishes_reach_v5_subscribers_on_other_nodes(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5], clients: Clients,
        qos: int) -> None:
    """A 3.1.1 QoS 0 publish crosses in packed 3.1.1 frames; a v5 subscriber's node
    re-encodes it as v5 (no properties but the subscription identifier)."""
    prefix = unique("c3")
    topics = one_topic_per_owner(view, prefix)
    subs = []
    for node, sid in (("b", 3), ("c", 4)):
        sub = v5(node)
        sub.connect()
        sub.subscribe(f"{prefix}/#", 1, props(SUBSCRIBE, SubscriptionIdentifier=sid))
        subs.append((sub, sid))
    pub = clients.connected(cluster.port("a"), name="v311@a")
    for owner, topic in topics.items():
        pub.publish(topic, owner, qos)
    for sub, sid in subs:
        got = [sub.get() for _ in topics]
        assert sorted(m.payload for m in got) == sorted(n.encode() for n in NODES)
        assert all(m.properties.SubscriptionIdentifier == [sid] for m in got)
        assert not any(hasattr(m.properties, "UserProperty") for m in got)


def test_retain_as_published_for_311_qos0_retained_across_nodes(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5], clients: Clients
        ) -> None:
    """A 3.1.1 QoS 0 retained publish reaches a v5 Retain As Published subscriber on
    another node with RETAIN 1, as on one broker (the packed QoS 0 frames carry RETAIN 0,
    so the owner must send it otherwise), and a plain subscriber with RETAIN 0."""
    prefix = unique("rap")
    topics = one_topic_per_owner(view, prefix)
    subs = []
    for node in ("b", "c"):
        rap = v5(node)
        rap.connect()
        assert rap.subscribe(f"{prefix}/#", 1, retainAsPublished=True) == [1]
        plain = v5(node)
        plain.connect()
        assert plain.subscribe(f"{prefix}/#", 1) == [1]
        subs.append((rap, True))
        subs.append((plain, False))
    pub = clients.connected(cluster.port("a"), name="v311@a")
    for owner, topic in topics.items():
        pub.publish(topic, owner, 0, retain=True)
        pub.publish(topic, owner + "-live", 0)
    for sub, retained in subs:
        got = {m.payload.decode(): m.retain for m in (sub.get() for _ in range(2 * len(topics)))}
        assert got == {**{n: retained for n in NODES}, **{n + "-live": False for n in NODES}}


def test_retained_properties_from_the_owner(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5]) -> None:
    prefix = unique("r5")
    topic = one_topic_per_owner(view, prefix)["b"]
    pub = v5("a")
    pub.connect()
    pub.publish(topic, b"kept", 1, retain=True,
                properties=props(PUBLISH, UserProperty=[("k", "v")]))
    sub = v5("c")
    sub.connect()
    sub.subscribe(topic, 1)
    got = sub.get()
    assert (got.payload, got.retain) == (b"kept", True)
    assert got.properties.UserProperty == [("k", "v")]


def test_will_delay_at_a_remote_home(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5]) -> None:
    """The will of a client connected to A whose home is B waits at B for its delay and
    is cancelled by a reconnect on C; without one it goes out with its properties."""
    topic = unique("w5")
    watcher = v5("c")
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    cid = view.client_homed_at("b", unique("wd"))
    session = props(CONNECT, SessionExpiryInterval=60)
    client = v5("a", cid)
    client.connect(properties=session, will=(f"{topic}/cancelled", b"x", 1, False,
                                             props(WILL, WillDelayInterval=2)))
    client.drop()
    again = v5("c", cid)
    again.connect(clean_start=False, properties=session)
    time.sleep(3)  # past the delay: the will would be out by now
    again.publish(f"{topic}/sentinel", b"s", 1)
    watcher.nothing_before(f"{topic}/sentinel")

    other = v5("a", view.client_homed_at("b", unique("wd")))
    other.connect(properties=session, will=(f"{topic}/sent", b"gone", 1, False,
                                            props(WILL, WillDelayInterval=1,
                                                  ContentType="x/y")))
    dropped = time.monotonic()
    other.drop()
    got = watcher.get(timeout=15)
    assert (got.topic, got.payload) == (f"{topic}/sent", b"gone")
    assert got.properties.ContentType == "x/y"
    assert time.monotonic() - dropped >= 0.9


@pytest.mark.parametrize("home", ["a", "b"], ids=["home-at-edge", "home-elsewhere"])
def test_persistent_v5_session_wherever_it_lives(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5], home: str) -> None:
    """A v5 session with a Session Expiry Interval, connected through A, homed at A or at
    B: v5 SUBACK/UNSUBACK from its home, queued QoS 1 with properties and subscription
    identifier on reconnect, and its expiry (by wall clock, at its home)."""
    cid, topic = view.client_homed_at(home, unique("ps")), unique("ps")
    client = v5("a", cid)
    client.connect(properties=props(CONNECT, SessionExpiryInterval=300))
    assert client.subscribe(topic, 1, props(SUBSCRIBE, SubscriptionIdentifier=5)) == [1]
    assert client.unsubscribe(unique("none")) == [0x11]
    client.disconnect()
    pub = v5("c")
    pub.connect()
    pub.publish(topic, b"queued", 1, properties=props(PUBLISH, UserProperty=[("q", "1")]))
    again = v5("a", cid)
    present, _ = again.connect(clean_start=False,
                               properties=props(CONNECT, SessionExpiryInterval=1))
    assert present
    got = again.get()
    assert got.payload == b"queued" and got.properties.UserProperty == [("q", "1")]
    assert got.properties.SubscriptionIdentifier == [5]
    again.disconnect()
    time.sleep(1.5)  # the wall clock is what expires it
    present, _ = v5("a", cid).connect(clean_start=False)
    assert not present


@pytest.mark.parametrize("home", ["a", "b"], ids=["home-at-edge", "home-elsewhere"])
def test_clean_start_0_with_expiry_0_resumes_the_kept_session(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5], home: str) -> None:
    """[MQTT-3.1.2-4] in a cluster: the session left at its home by a connection with a
    Session Expiry Interval is resumed by Clean Start 0 without one (through another edge),
    and ends when that connection closes [MQTT-3.1.2-23]."""
    cid, topic = view.client_homed_at(home, unique("rs")), unique("rs")
    client = v5("c", cid)
    client.connect(properties=props(CONNECT, SessionExpiryInterval=60))
    assert client.subscribe(topic, 1, props(SUBSCRIBE, SubscriptionIdentifier=3)) == [1]
    client.disconnect()
    pub = v5("c")
    pub.connect()
    for payload in (b"one", b"two"):
        pub.publish(topic, payload, 1)
    again = v5("a", cid)
    present, _ = again.connect(clean_start=False)  # no Session Expiry Interval: 0
    assert present
    got = [again.get() for _ in range(2)]
    assert [m.payload for m in got] == [b"one", b"two"]
    assert all(m.properties.SubscriptionIdentifier == [3] for m in got)
    pub.publish(topic, b"live", 1)
    assert again.get().payload == b"live"
    again.disconnect()
    pub.publish(topic, b"after", 1)
    last = v5("b", cid)
    present, _ = last.connect(clean_start=False)
    assert not present
    last.subscribe(f"{topic}/sentinel", 1)
    pub.publish(f"{topic}/sentinel", b"s", 1)
    last.nothing_before(f"{topic}/sentinel")


@pytest.mark.parametrize("home", ["a", "b"], ids=["home-at-edge", "home-elsewhere"])
def test_a_311_client_resuming_a_v5_session_keeps_its_subscription_options(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5], clients: Clients,
        home: str) -> None:
    """The home keeps a v5 session's subscription options while a 3.1.1 client (through
    A) holds it: No Local (the edge tags the client's publishes with its id, as the home
    told it) and Retain As Published apply; a v5 client resuming later (through C) has
    its subscription identifiers again."""
    cid, topic = view.client_homed_at(home, unique("ko")), unique("ko")
    first = v5("c", cid)
    first.connect(properties=props(CONNECT, SessionExpiryInterval=300))
    first.subscribe(f"{topic}/own", 1, props(SUBSCRIBE, SubscriptionIdentifier=4), noLocal=True)
    first.subscribe(f"{topic}/rap", 1, props(SUBSCRIBE, SubscriptionIdentifier=5),
                    retainAsPublished=True)
    first.disconnect()
    other = v5("c")
    other.connect()
    old = clients.connected(cluster.port("a"), cid, clean_session=False, name="v311@a")
    old.publish(f"{topic}/own", "mine", 1)  # not echoed back: No Local
    other.publish(f"{topic}/rap", b"kept", 1, retain=True)
    [got] = old.collect(1)
    assert (got.topic, got.payload, got.retain) == (f"{topic}/rap", b"kept", True)
    old.disconnect()
    again = v5("c", cid)
    present, _ = again.connect(clean_start=False,
                               properties=props(CONNECT, SessionExpiryInterval=300))
    assert present
    again.publish(f"{topic}/own", b"mine again", 1)
    other.publish(f"{topic}/rap", b"again", 1, retain=True)
    got = again.get()
    assert (got.topic, got.payload, got.retain) == (f"{topic}/rap", b"again", True)
    assert got.properties.SubscriptionIdentifier == [5]


def test_takeover_through_another_node_says_0x8e(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5]) -> None:
    cid = view.client_homed_at("b", unique("to"))
    first = v5("a", cid)
    first.connect()
    v5("c", cid).connect()
    assert first.disconnects.get(timeout=15) == 0x8E


def test_a_takeover_through_another_node_publishes_the_will_only_if_the_session_ends(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5]) -> None:
    """Homed at b, connected at a, taken over at c: resuming the session publishes no will
    [MQTT-3.1.3-9]; a Clean Start then ends the session and publishes the will of the
    connection it takes over (as on one node, ``test_e2e_mqtt5.py``)."""
    cid, topic = view.client_homed_at("b", unique("tw")), unique("tw")
    watcher = v5("b")
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    session = props(CONNECT, SessionExpiryInterval=300)
    first = v5("a", cid)
    first.connect(properties=session, will=(f"{topic}/first", b"gone", 1, False, None))
    second = v5("c", cid)
    present, _ = second.connect(clean_start=False, properties=session,
                                will=(f"{topic}/second", b"gone", 1, False, None))
    assert present and first.disconnects.get(timeout=15) == 0x8E
    second.publish(f"{topic}/sentinel", b"s", 1)
    watcher.nothing_before(f"{topic}/sentinel")
    present, _ = v5("a", cid).connect(clean_start=True, properties=session)
    assert not present and second.disconnects.get(timeout=15) == 0x8E
    assert watcher.get().topic == f"{topic}/second"


@pytest.mark.parametrize(("home", "old", "new"), [("a", "a", "c"), ("c", "a", "c"),
                                                 ("a", "a", "a")])
def test_a_will_of_delay_0_stays_unpublished_when_the_takeover_resumes_the_session(
        cluster: NodeCluster, view: ViewInfo, v5: Callable[..., Paho5],
        home: str, old: str, new: str) -> None:
    """Wherever the session's home is (the old connection's node, the new one's, both on
    one node), a takeover that resumes the session publishes no will of delay 0, as on one
    node and as mosquitto.  The home decided after it had closed the old connection, whose
    close had started the session's expiry, and counted the session as not resumed: the
    will went out (MQTT 5 probe)."""
    cid, topic = view.client_homed_at(home, unique("tw0")), unique("tw0")
    watcher = v5("b")
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    session = props(CONNECT, SessionExpiryInterval=60)
    first = v5(old, cid)
    first.connect(properties=session, will=(f"{topic}/will", b"gone", 1, False, None))
    second = v5(new, cid)
    present, _ = second.connect(clean_start=False, properties=session)
    assert present and first.disconnects.get(timeout=15) == 0x8E
    second.publish(f"{topic}/sentinel", b"s", 1)
    watcher.nothing_before(f"{topic}/sentinel")


def test_a_node_leaving_on_sigterm_says_0x8b(fresh_cluster: Callable[..., NodeCluster]
                                             ) -> None:
    """SIGTERM makes a node leave the cluster, then stop: its v5 clients (clean sessions,
    homed anywhere) are told 0x8B "server shutting down" as their connections close."""
    cluster = fresh_cluster(NODES)
    view = cluster.settle(NODES)
    clients = [Paho5(HOST, cluster.port("c"), view.client_homed_at(home, unique("bye")))
               for home in NODES]
    try:
        for client in clients:
            client.connect()
        assert cluster.sigterm("c") == 0
        for client in clients:
            assert client.disconnects.get(timeout=WAIT) == 0x8B
    finally:
        for client in clients:
            client.client.loop_stop()


def test_a_slow_consumer_shed_by_its_remote_home_is_told_0x97(
        tmp_path: Path, clients: Clients) -> None:
    """A v5 subscriber on A whose persistent session lives at B reads nothing; B sheds it
    after ``slow_subscriber_hold``, and A tells the client 0x97 (quota exceeded), not the
    0x8E of a takeover that a ``SessionKick`` meant before it carried a reason."""
    from mqtt5_support import Raw5
    from mqttring.protocol.codec5 import encode5
    from mqttring.protocol.packets5 import Disconnect5, SubAck5, SubOptions, Subscribe5
    from mqttring.protocol.properties import Properties, PropertyId

    cluster = NodeCluster(tmp_path / "slow")
    cluster.extra_toml = "[limits]\nmax_inflight = 2\nmax_queued = 5\nslow_subscriber_hold = 1.0\n"
    try:
        cluster.form_sync(*NODES)
        view = cluster.settle(NODES)
        topic = unique("slow5")
        sub = Raw5(HOST, cluster.port("a"))
        try:
            cid = view.client_homed_at("b", unique("sub5"))
            assert sub.connect(cid, session_expiry_interval=300).reason_code == 0
            sub.send(encode5(Subscribe5(1, ((topic, SubOptions(1)),))))
            assert sub.recv() == SubAck5(1, (1,))
            pub = clients.connected(cluster.port("c"), unique("pub"))
            infos = [pub.publish_nowait(topic, f"m{i}", 1) for i in range(20)]
            assert all(pub.ack_within(info, 15) for info in infos)
            received = []
            with contextlib.suppress(ConnectionError):
                while True:
                    received.append(sub.recv(timeout=15))
            assert received and received[-1] == Disconnect5(0x97, Properties(
                [(PropertyId.REASON_STRING, "quota exceeded")])), received[-3:]
        finally:
            sub.close()
    finally:
        cluster.close()


def test_outbound_aliases_and_reason_strings_from_a_remote_home(
        tmp_path: Path, clients: Clients) -> None:
    """A persistent v5 session homed at B, its client on A: B encodes the PUBLISHes, with
    topic aliases (``limits.topic_alias_maximum_out``) kept for this connection only, and
    the SUBACK with a reason string; the edge answers CONNACK with Response Information.
    Reconnected through C, the aliases start afresh."""
    from mqtt5_support import Raw5
    from mqttring.protocol.codec5 import encode5
    from mqttring.protocol.packets5 import (
        ConnAck5,
        Connect5,
        PubAck5,
        Publish5,
        SubAck5,
        SubOptions,
        Subscribe5,
    )
    from mqttring.protocol.properties import Properties, PropertyId

    def publishes(client: Raw5, count: int) -> list[tuple[str, object, bytes]]:
        got = []
        while len(got) < count:
            packet = client.recv(timeout=15)
            assert isinstance(packet, Publish5), packet
            client.send(encode5(PubAck5(packet.packet_id)))  # type: ignore[arg-type]
            got.append((packet.topic, packet.properties.get(PropertyId.TOPIC_ALIAS),
                        packet.payload))
        return got

    cluster = NodeCluster(tmp_path / "alias")
    cluster.extra_toml = ('response_information = "replies/"\n'
                          "[limits]\ntopic_alias_maximum_out = 2\n")
    try:
        cluster.form_sync(*NODES)
        view = cluster.settle(NODES)
        root, cid = unique("cal"), view.client_homed_at("b", unique("cal"))
        sub = Raw5(HOST, cluster.port("a"))
        try:
            connack = sub.connect(cid, topic_alias_maximum=8, session_expiry_interval=300,
                                  request_response_information=1)
            assert isinstance(connack, ConnAck5) and connack.reason_code == 0
            assert connack.properties.get(PropertyId.RESPONSE_INFORMATION) == "replies/"
            sub.send(encode5(Subscribe5(1, ((f"{root}/#", SubOptions(1)),
                                            ("$share//bad", SubOptions(1))))))
            assert sub.recv(timeout=15) == SubAck5(1, (1, 0x8F), Properties(
                [(PropertyId.REASON_STRING, "topic filter invalid")]))
            pub = clients.connected(cluster.port("c"), unique("pub"))
            for leaf in ("x", "x", "y", "z", "y"):
                pub.publish(f"{root}/{leaf}", leaf, 1)
            assert publishes(sub, 5) == [
                (f"{root}/x", 1, b"x"), ("", 1, b"x"), (f"{root}/y", 2, b"y"),
                (f"{root}/z", None, b"z"), ("", 2, b"y")]
        finally:
            sub.close()
        pub.publish(f"{root}/y", "queued", 1)
        again = Raw5(HOST, cluster.port("c"))
        try:
            again.send(encode5(Connect5(cid, False, properties=Properties(
                [(PropertyId.TOPIC_ALIAS_MAXIMUM, 8)]))))
            connack = again.recv(timeout=15)
            assert isinstance(connack, ConnAck5) and connack.session_present
            assert PropertyId.RESPONSE_INFORMATION not in connack.properties  # not asked
            # Acknowledgements the old connection sent just before it closed may not have
            # reached B: those messages come again (DUP) before the queued one.
            got = publishes(again, 1)
            while got[-1][2] != b"queued":
                got += publishes(again, 1)
            assert got[0][0] and got[0][1] == 1, got  # a fresh alias map: topic in full
            known: dict[object, str] = {}
            for topic, alias, payload in got:
                if topic:
                    known[alias] = topic
                leaf = "y" if payload == b"queued" else payload.decode()
                assert (topic or known[alias]) == f"{root}/{leaf}", got
        finally:
            again.close()
    finally:
        cluster.close()


def test_a_pubrec_refusal_ends_the_delivery_at_a_remote_home(
        cluster: NodeCluster, view: ViewInfo, clients: Clients) -> None:
    """A persistent v5 session homed at B, its client on A, Receive Maximum 1: the client
    refuses the first QoS 2 message with PUBREC 0x80, which ends that delivery (section
    4.3.3): the second comes at once, and on a resume through C the refused one is not
    sent again.  The edge did not tell the home of the refusal: the slot stayed taken."""
    from mqtt5_support import Raw5
    from mqttring.protocol.codec5 import encode5
    from mqttring.protocol.packets5 import (
        ConnAck5,
        Connect5,
        Disconnect5,
        Publish5,
        PubRec5,
        PubRel5,
        SubAck5,
        SubOptions,
        Subscribe5,
    )
    from mqttring.protocol.properties import Properties, PropertyId

    topic, cid = unique("refuse"), view.client_homed_at("b", unique("refuse"))
    sub = Raw5(HOST, cluster.port("a"))
    try:
        connack = sub.connect(cid, receive_maximum=1, session_expiry_interval=300)
        assert isinstance(connack, ConnAck5) and connack.reason_code == 0
        sub.send(encode5(Subscribe5(1, ((topic, SubOptions(2)),))))
        assert sub.recv(timeout=15) == SubAck5(1, (2,))
        pub = clients.connected(cluster.port("c"), unique("pub"))
        pub.publish(topic, "refused", 2)
        pub.publish(topic, "wanted", 2)
        first = sub.recv(timeout=15)
        assert isinstance(first, Publish5) and first.payload == b"refused", first
        sub.send(encode5(PubRec5(first.packet_id, 0x80)))  # type: ignore[arg-type]
        second = sub.recv(timeout=15)
        assert isinstance(second, Publish5) and second.payload == b"wanted", second
        sub.send(encode5(PubRec5(second.packet_id)))  # type: ignore[arg-type]
        assert sub.recv(timeout=15) == PubRel5(second.packet_id)  # type: ignore[arg-type]
        sub.send(encode5(Disconnect5(0)))
    finally:
        sub.close()
    again = Raw5(HOST, cluster.port("c"))
    try:
        again.send(encode5(Connect5(cid, False, properties=Properties(
            [(PropertyId.RECEIVE_MAXIMUM, 1), (PropertyId.SESSION_EXPIRY_INTERVAL, 300)]))))
        connack = again.recv(timeout=15)
        assert isinstance(connack, ConnAck5) and connack.session_present, connack
        # Only the PUBREL of the message it accepted is owed: never "refused" again.
        rest = []
        with contextlib.suppress(TimeoutError, OSError):
            while True:
                rest.append(again.recv(timeout=1.5))
        assert rest == [PubRel5(second.packet_id)], rest  # type: ignore[arg-type]
    finally:
        again.close()
