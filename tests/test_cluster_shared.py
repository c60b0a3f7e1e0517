"""Shared subscriptions on a real 3-node cluster: one member per group cluster-wide.

Members sit on every node (clean sessions on their edge, a persistent one at its home), the
publisher on one node and the topics' shards on all three; each QoS 1 message must reach
exactly one member of each group, and ordinary subscribers everything.  A member that leaves
with messages unacknowledged loses none of them for its group; a member's node killed
mid-stream costs no acknowledged message (at least once).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster_support import (
    Client,
    Clients,
    Delivery,
    NodeCluster,
    ViewInfo,
    start_cluster,
    unique,
)
from mqtt_client import PUBLISH, RawClient

pytestmark = pytest.mark.timeout(150)

NODES = ("a", "b", "c")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("shared")), NODES)
    yield c
    c.close()


@pytest.fixture
def view(cluster: NodeCluster) -> ViewInfo:
    return cluster.settle(NODES, timeout=30)


def topics_on_every_owner(view: ViewInfo, prefix: str, per_node: int = 2) -> list[str]:
    found: list[str] = []
    for node in NODES:
        for _ in range(per_node):
            found.append(view.topic_owned_by(node, prefix, avoid=found))
    return found


def collect_all(members: list[Client], want: int, timeout: float = 20.0,
                quiet: float = 0.5) -> dict[str, list[Delivery]]:
    """Everything the members get until ``want`` deliveries in all (then ``quiet`` more)."""
    got: dict[str, list[Delivery]] = {m.name: [] for m in members}
    deadline = time.monotonic() + timeout
    while sum(map(len, got.values())) < want and time.monotonic() < deadline:
        for m in members:
            got[m.name] += m.pending()
        time.sleep(0.02)
    time.sleep(quiet)
    for m in members:
        got[m.name] += m.pending()
    return got


def sys_counter(clients: Clients, port: int, name: str, at_least: int = 0,
                timeout: float = 10.0) -> int:
    """The node's ``$SYS/broker/shared/{name}``, once it is at least ``at_least`` (the
    retained value first, then each update, every ``SYS_INTERVAL``)."""
    watcher = clients.connected(port, name=f"sys-{name}")
    watcher.subscribe(f"$SYS/broker/shared/{name}", 0)
    deadline = time.monotonic() + timeout
    value = -1
    try:
        while time.monotonic() < deadline:
            for d in watcher.pending():
                value = int(d.payload)
            if value >= at_least:
                return value
            time.sleep(0.05)
    finally:
        watcher.disconnect()
    raise AssertionError(f"$SYS/broker/shared/{name} stayed at {value} < {at_least}")


def test_members_on_three_nodes_each_get_a_share_and_nothing_twice(
        cluster: NodeCluster, view: ViewInfo, clients: Clients) -> None:
    prefix = unique("jobs")
    topics = topics_on_every_owner(view, prefix)
    share = f"$share/workers/{prefix}/#"
    members = []
    for node in NODES:
        m = clients.connected(cluster.port(node), unique(f"w-{node}"), name=f"w@{node}")
        assert m.subscribe(share, 1) == [1]
        members.append(m)
    # A persistent member, homed where its client id hashes, connected to a.
    home_b = view.client_homed_at("b", unique("durable"))
    durable = clients.make(cluster.port("a"), home_b, clean_session=False, name="durable@a")
    durable.connect()
    assert durable.subscribe(share, 1) == [1]
    members.append(durable)
    plain = clients.connected(cluster.port("c"), name="plain@c")
    assert plain.subscribe(f"{prefix}/#", 1) == [1]
    other = clients.connected(cluster.port("b"), name="other-group@b")
    assert other.subscribe(f"$share/audit/{prefix}/#", 1) == [1]
    publisher = clients.connected(cluster.port("a"), name="publisher@a")
    n = 60
    sent = []
    for i in range(n):
        payload = f"m{i}".encode()
        publisher.publish(topics[i % len(topics)], payload, 1)
        sent.append(payload)
    got = collect_all(members, n)
    counts = collections.Counter(d.payload for ds in got.values() for d in ds)
    assert set(counts) == set(sent), f"lost: {sorted(set(sent) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"twice: {[p for p, c in counts.items() if c > 1]}"
    assert all(got.values()), {k: len(v) for k, v in got.items()}  # everyone took a share
    assert sorted(d.payload for d in plain.collect(n)) == sorted(sent)
    assert sorted(d.payload for d in other.collect(n)) == sorted(sent)  # its own group
    assert not plain.drain(0.3) and not other.drain(0.1)


def test_malformed_shares_are_refused_and_retained_is_not_sent(
        cluster: NodeCluster, view: ViewInfo, clients: Clients) -> None:
    topic = unique("ret")
    publisher = clients.connected(cluster.port("a"), name="publisher@a")
    publisher.publish(topic, b"kept", 1, retain=True)
    s = clients.connected(cluster.port("b"), name="s@b")
    codes = s.subscribe([("$share//x", 1), ("$share/g", 1), ("$share/g/", 1),
                         ("$share/+/x", 1), (f"$share/g/{topic}", 1)])
    assert codes == [0x80, 0x80, 0x80, 0x80, 1]
    assert s.drain(0.5) == []
    publisher.publish(topic, b"live", 1)
    assert s.collect(1) == [Delivery(topic, b"live", 1, False)]


def test_a_member_leaving_with_unacknowledged_messages_loses_none(
        cluster: NodeCluster, view: ViewInfo, clients: Clients) -> None:
    """A raw member on b takes its share of QoS 1 messages and never acknowledges them;
    when its connection drops mid-stream, what it held goes to the members on a and c, and
    the rest of the stream too, each message once."""
    prefix = unique("rd")
    topics = topics_on_every_owner(view, prefix)
    share = f"$share/g/{prefix}/#"
    redispatched = sys_counter(clients, cluster.port("b"), "redispatched")
    stubborn = RawClient("127.0.0.1", cluster.port("b"), timeout=10)
    try:
        assert stubborn.connect(unique("stubborn")).return_code == 0
        assert stubborn.subscribe([(share, 1)]) == [1]
        steady = []
        for node in ("a", "c"):
            m = clients.connected(cluster.port(node), name=f"steady@{node}")
            assert m.subscribe(share, 1) == [1]
            steady.append(m)
        publisher = clients.connected(cluster.port("a"), name="publisher@a")
        n = 30
        for i in range(n):
            publisher.publish(topics[i % len(topics)], f"m{i}", 1)
        held = []
        while True:
            try:
                p = stubborn.recv_packet(timeout=1.0)
            except TimeoutError:
                break
            if p.type == PUBLISH:
                held.append(p.payload)
        assert held, "the stubborn member got no share"
        assert sys_counter(clients, cluster.port("b"), "groups", 1) >= 1  # (a gauge)
    finally:
        stubborn.close()  # no PUBACK, no DISCONNECT: its clean session ends
    # The stream goes on while b drops the member and its route: the owners may still ask
    # b, which then declines, and they ask the next member.
    for i in range(n, 2 * n):
        publisher.publish(topics[i % len(topics)], f"m{i}", 1)
    got = collect_all(steady, 2 * n)
    counts = collections.Counter(d.payload for ds in got.values() for d in ds)
    assert set(counts) == {f"m{i}".encode() for i in range(2 * n)}, (
        f"held by the stubborn member: {held}\n{cluster.logs_of_interest()}")
    assert max(counts.values()) == 1
    # b handed back what its member held (and had queued, not yet sent): counted there.
    sys_counter(clients, cluster.port("b"), "redispatched", redispatched + len(held))


def test_copies_held_past_a_link_frame_are_handed_back_whole(
        cluster: NodeCluster, view: ViewInfo, clients: Clients) -> None:
    """The only member, on b, holds 24 unacknowledged QoS 1 copies of 900 KB (21.6 MB) of a
    topic owned by a when its connection drops: they go back to a to place with the members
    that joined meanwhile.  In one ``Redispatch`` that was more than a link frame (16 MiB):
    the link dropped it on every try, and the copies were lost."""
    prefix = unique("rdbig")
    topic = next(t for t in (f"{prefix}/{i}" for i in range(1000))
                 if view.owner_of_topic(t) == "a")
    share = f"$share/g/{prefix}/#"
    stubborn = RawClient("127.0.0.1", cluster.port("b"), timeout=10)
    payloads = [bytes([65 + i]) * 900_000 for i in range(24)]
    try:
        assert stubborn.connect(unique("stubborn")).return_code == 0
        assert stubborn.subscribe([(share, 1)]) == [1]
        publisher = clients.connected(cluster.port("a"), name="bigpub@a")
        for payload in payloads:
            publisher.publish(topic, payload, 1)
        held = 0
        while held < len(payloads):
            if stubborn.recv_packet(timeout=10).type == PUBLISH:
                held += 1  # no PUBACK: 24 copies unacknowledged (inflight or queued)
        steady = []
        for node in ("a", "c"):
            m = clients.connected(cluster.port(node), name=f"steady@{node}")
            assert m.subscribe(share, 1) == [1]
            steady.append(m)
    finally:
        stubborn.close()  # its clean session ends: the copies go back to their owner
    got = collect_all(steady, len(payloads), timeout=60)
    counts = collections.Counter(d.payload for ds in got.values() for d in ds)
    assert sorted(counts) == sorted(payloads) and max(counts.values()) == 1, (
        f"{len(counts)} of {len(payloads)} copies placed again")


def test_a_members_node_killed_mid_stream_loses_no_acknowledged_message(
        fresh_cluster: Callable[..., NodeCluster], clients: Clients) -> None:
    """Members on a, b and c; the publisher on a streams QoS 1 to topics owned by every
    node; c is killed mid-stream.  Every acknowledged message reaches some member (at least
    once: a redispatched one may arrive twice)."""
    cluster = fresh_cluster()
    view = cluster.view("a")
    prefix = unique("kill")
    topics = topics_on_every_owner(view, prefix)
    share = f"$share/g/{prefix}/#"
    inbox: queue.Queue[Delivery] = queue.Queue()
    for node in NODES:
        m = clients.make(cluster.port(node), unique(f"m-{node}"), inbox=inbox, name=f"m@{node}")
        m.connect()
        assert m.subscribe(share, 1) == [1]
    publisher = clients.connected(cluster.port("a"), name="publisher@a")
    infos = []
    total, kill_at = 240, 80
    for i in range(total):
        if i == kill_at:
            cluster.kill("c")
        info = publisher.publish_nowait(topics[i % len(topics)], f"m{i}", 1)
        infos.append((f"m{i}".encode(), info))
        publisher.ack_within(info, 2.0)
    publisher.publish(f"{prefix}-barrier", b"", 1, timeout=40)
    acked = {p for p, info in infos if info.is_published()}
    assert len(acked) >= kill_at
    got: set[bytes] = set()
    deadline = time.monotonic() + 30
    while not acked <= got and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            got.add(inbox.get(timeout=0.2).payload)
    lost = sorted(acked - got, key=lambda p: int(p[1:]))
    assert not lost, (f"{len(lost)} of {len(acked)} acknowledged messages lost, first "
                      f"{lost[:10]}\n{cluster.logs_of_interest(('a', 'b'))}")


def test_copies_held_by_a_member_whose_node_dies_go_to_the_others(
        fresh_cluster: Callable[..., NodeCluster], clients: Clients) -> None:
    """A raw member on c takes its share of QoS 1 messages and never acknowledges them;
    c is killed.  The owners (a and b) kept each copy they placed on c until told it was
    gone, and now place them with the members on a and b: nothing acknowledged is lost."""
    cluster = fresh_cluster()
    view = cluster.view("a")
    prefix = unique("held")
    topics = [view.topic_owned_by(node, prefix) for node in ("a", "b")]
    topics.append(view.topic_owned_by("b", prefix, avoid=topics))
    share = f"$share/g/{prefix}/#"
    stubborn = RawClient("127.0.0.1", cluster.port("c"), timeout=10)
    try:
        assert stubborn.connect(unique("stubborn")).return_code == 0
        assert stubborn.subscribe([(share, 1)]) == [1]
        inbox: queue.Queue[Delivery] = queue.Queue()
        for node in ("a", "b"):
            m = clients.make(cluster.port(node), unique(f"m-{node}"), inbox=inbox,
                             name=f"m@{node}")
            m.connect()
            assert m.subscribe(share, 1) == [1]
        publisher = clients.connected(cluster.port("a"), name="publisher@a")
        n = 30
        for i in range(n):
            publisher.publish(topics[i % len(topics)], f"m{i}", 1)
        held = []
        while True:
            try:
                p = stubborn.recv_packet(timeout=1.0)
            except TimeoutError:
                break
            if p.type == PUBLISH:
                held.append(p.payload)
        assert held, "the stubborn member got no share"
        cluster.kill("c")
    finally:
        stubborn.close()
    want = {f"m{i}".encode() for i in range(n)}
    got: set[bytes] = set()
    deadline = time.monotonic() + 30
    while not want <= got and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            got.add(inbox.get(timeout=0.2).payload)
    assert want <= got, (f"lost {sorted(want - got)}; held at c: {held}\n"
                         f"{cluster.logs_of_interest(('a', 'b'))}")


def test_local_first_gives_each_message_to_the_member_on_its_topics_owner(
        tmp_path: Path, clients: Clients) -> None:
    """``shared_subscription_strategy = "local_first"``: with a member on every node, each
    message goes to the member on the node that owns its topic: no inter-node delivery."""
    cluster = NodeCluster(tmp_path / "local-first")
    cluster.extra_toml = 'shared_subscription_strategy = "local_first"\n'
    try:
        cluster.form_sync(*NODES)
        view = cluster.settle(NODES)
        prefix = unique("lf")
        topics = topics_on_every_owner(view, prefix)
        share = f"$share/g/{prefix}/#"
        members = []
        for node in NODES:
            m = clients.connected(cluster.port(node), unique(f"m-{node}"), name=node)
            assert m.subscribe(share, 1) == [1]
            members.append(m)
        publisher = clients.connected(cluster.port("a"), name="publisher@a")
        for i in range(18):
            publisher.publish(topics[i % len(topics)], f"m{i}", 1)
        got = collect_all(members, 18)
        for node, deliveries in got.items():
            owners = {view.owner_of_topic(d.topic) for d in deliveries}
            assert owners == {node}, f"member on {node} got topics owned by {owners}"
            assert len(deliveries) == 6
    finally:
        cluster.close()


def test_members_get_even_shares_however_they_are_spread_over_nodes(
        cluster: NodeCluster, view: ViewInfo, clients: Clients) -> None:
    """Three members on a, one on c, topics owned by b: each member gets about a quarter
    (b weighs a's turns by its members online), not a's a sixth each and c's a half."""
    prefix = unique("even")
    topics = [view.topic_owned_by("b", prefix)]
    topics.append(view.topic_owned_by("b", prefix, avoid=topics))
    share = f"$share/g/{prefix}/#"
    members = []
    for n, node in enumerate(("a", "a", "a", "c")):
        m = clients.connected(cluster.port(node), unique(f"m-{node}"), name=f"m{n}@{node}")
        assert m.subscribe(share, 1) == [1]
        members.append(m)
    publisher = clients.connected(cluster.port("a"), name="publisher@a")
    n = 40
    for i in range(n):
        publisher.publish(topics[i % 2], f"m{i}", 1)
    got = collect_all(members, n)
    per_member = {name: len(ds) for name, ds in got.items()}
    assert sum(per_member.values()) == n
    assert all(6 <= c <= 14 for c in per_member.values()), per_member
