"""Witnesses of shared-subscription copies on real clusters (``cluster/witness.py``).

A clean member that received QoS 1 messages through a share and has not acknowledged them
holds the only copy; the publisher already has its PUBACK.  With ``local_first`` the topic's
owner O places each message with its own member, so O's death alone would lose them unless
another node (the witness) recorded them before the publisher was acknowledged.  Here O is
killed with ``kill -9`` and the other member must get every acknowledged message; then, on
five nodes, O and a member's node M are killed together.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster_support import (
    Client,
    Clients,
    ConnectRefused,
    Delivery,
    NodeCluster,
    start_cluster,
    unique,
)
from mqtt_client import PUBLISH, RawClient

pytestmark = pytest.mark.timeout(180)


@contextlib.contextmanager
def local_first_cluster(root: Path, nodes: tuple[str, ...]) -> Iterator[NodeCluster]:
    cluster = start_cluster(root, nodes,
                            extra_toml='shared_subscription_strategy = "local_first"\n')
    try:
        yield cluster
    finally:
        cluster.close()


def drain(member: RawClient, quiet: float = 1.0) -> list[bytes]:
    """The payloads of the PUBLISHes ``member`` gets until ``quiet`` seconds pass without
    one (it acknowledges none of them)."""
    held: list[bytes] = []
    while True:
        try:
            packet = member.recv_packet(timeout=quiet)
        except TimeoutError:
            return held
        if packet.type == PUBLISH:
            held.append(packet.payload)


class SurvivingMember:
    """The member expected to get every message: a persistent session, reconnected (to the
    same node, same inbox) whenever its connection ends, as a real device would.

    Killing nodes on a loaded 2-core runner can cost the survivors their proof of quorum for
    a moment (a Raft election that takes longer than the test cluster's short fence
    period); the node then fences, disconnecting this member.  The promise under test is
    that no acknowledged message is lost, not that no node ever fences: the session (and
    its share membership) outlives the disconnection, and what it missed waits in it."""

    def __init__(self, clients: Clients, port: int, name: str,
                 client_id: str | None = None) -> None:
        self.clients, self.port, self.name = clients, port, name
        self.client_id = client_id or unique(name.replace("@", "-"))
        self.inbox: queue.Queue[Delivery] = queue.Queue()
        self.client = self._connect()
        self.reconnects = 0

    def _connect(self) -> Client:
        client = self.clients.make(self.port, self.client_id, clean_session=False,
                                   inbox=self.inbox, name=self.name)
        client.connect()
        return client

    def subscribe(self, share: str) -> list[int]:
        return self.client.subscribe(share, 1)

    def wait_for_all(self, want: set[bytes], timeout: float) -> set[bytes]:
        got: set[bytes] = set()
        deadline = time.monotonic() + timeout
        while not want <= got and time.monotonic() < deadline:
            if self.client.disconnected.is_set():
                with contextlib.suppress(ConnectRefused):  # fenced: refused for a moment
                    self.client.close()
                    self.client = self._connect()
                    self.reconnects += 1
            with contextlib.suppress(queue.Empty):
                got.add(self.inbox.get(timeout=0.2).payload)
        return got


def test_the_owners_own_member_dying_with_it_loses_no_acknowledged_message(
        tmp_path: Path, clients: Clients) -> None:
    """Owner b's member (raw, never acknowledging) takes every message (local_first); the
    other member is on c, the publisher on a.  b is killed: the witness of b's copies
    places them with the member on c."""
    with local_first_cluster(tmp_path / "one", ("a", "b", "c")) as cluster:
        view = cluster.view("a")
        prefix = unique("wit")
        topics = [view.topic_owned_by("b", prefix)]
        topics.append(view.topic_owned_by("b", prefix, avoid=topics))
        share = f"$share/g/{prefix}/#"
        stubborn = RawClient("127.0.0.1", cluster.port("b"), timeout=10)
        try:
            assert stubborn.connect(unique("stubborn")).return_code == 0
            assert stubborn.subscribe([(share, 1)]) == [1]
            # Its session must live on c: one homed at b would be a member *at b*, and
            # local_first would share the messages between it and the stubborn member.
            other = SurvivingMember(clients, cluster.port("c"), "m@c",
                                    view.client_homed_at("c", f"{prefix}-m"))
            assert other.subscribe(share) == [1]
            publisher = clients.connected(cluster.port("a"), name="publisher@a")
            n = 30
            for i in range(n):
                publisher.publish(topics[i % len(topics)], f"m{i}", 1)  # PUBACK awaited
            held = drain(stubborn)
            assert len(held) == n, f"local_first: b's member should hold all, got {held}"
            assert other.inbox.empty()
            cluster.kill("b")
        finally:
            stubborn.close()
        want = {f"m{i}".encode() for i in range(n)}
        got = other.wait_for_all(want, 40)
        assert want <= got, (f"lost {sorted(want - got)} ({other.reconnects} reconnects)\n"
                             f"{cluster.logs_of_interest(('a', 'c'))}")


def test_the_owner_and_the_members_node_dying_together_lose_no_acknowledged_message(
        fresh_cluster: Callable[..., NodeCluster], clients: Clients) -> None:
    """Five nodes (two may die and a majority is left).  Owner O of the topics, member
    node M (a raw member, never acknowledging, the only member while the messages are
    published, so it holds them all), witness W (the topics' other replica), the other
    member on X, the publisher on P.  O and M are killed together: W places the copies
    again through the topics' new owner, and the member on X gets them all."""
    nodes = ("a", "b", "c", "d", "e")
    # Five node processes on a 2-core runner: a longer grace than the test default (4 s)
    # so that a slow election under that load (seen once on CI: ~3 s without a leader, no
    # fault injected) does not fence the nodes before the kills; a kill is then noticed
    # 6 s later instead of 4.
    cluster = fresh_cluster(nodes, grace=6.0)
    view = cluster.view("a")
    prefix = unique("wit2")
    owner = "b"
    topic = view.topic_owned_by(owner, prefix)
    witness = view.replicas_of_topic(topic)[1]
    member_node, other_node, publisher_node = [n for n in nodes if n not in (owner, witness)]
    share = f"$share/g/{prefix}/#"
    stubborn = RawClient("127.0.0.1", cluster.port(member_node), timeout=10)
    try:
        assert stubborn.connect(unique("stubborn")).return_code == 0
        assert stubborn.subscribe([(share, 1)]) == [1]
        publisher = clients.connected(cluster.port(publisher_node),
                                      name=f"publisher@{publisher_node}")
        n = 30
        for i in range(n):
            publisher.publish(topic, f"m{i}", 1)  # PUBACK awaited
        held = drain(stubborn)
        assert len(held) == n, f"the only member should hold all, got {held}"
        # Its session must outlive the kills: with two copies of each session (R = 2), one
        # whose copies were both on the killed nodes dies with them (and its subscription),
        # which the contract does not cover; seen once as "lost all 30" on a random id.
        survivor = next(cid for cid in (f"{prefix}-m{n}" for n in range(10_000))
                        if not {owner, member_node} & set(view.replicas_of_client(cid)))
        other = SurvivingMember(clients, cluster.port(other_node), f"m@{other_node}",
                                survivor)
        assert other.subscribe(share) == [1]
        cluster.kill(owner)
        cluster.kill(member_node)
    finally:
        stubborn.close()
    want = {f"m{i}".encode() for i in range(n)}
    got = other.wait_for_all(want, 60)
    assert want <= got, (f"lost {sorted(want - got)} (owner {owner}, member {member_node}, "
                         f"witness {witness}, {other.reconnects} reconnects)\n"
                         f"{cluster.logs_of_interest((witness, other_node, publisher_node))}")
