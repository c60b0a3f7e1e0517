"""A persistent subscriber whose session's home restarts, still its home, is reconnected.

When every replica of a client shard is lost, the node that held it last stays its owner
while it is down and rejoining (``raft/state.py``): no view moves the shard, so nothing
told the edges of that home's proxied connections that the proxies it served died with it.
The home came back in a new life holding the sessions offline, and each such client stayed
connected to its edge and got nothing, ever (the fault probe of 2026-11-30, V2: 5 nodes,
both replicas of the shard killed -9 and restarted; 3 of 6 subscribers stuck in each run,
551 of 581 acknowledged messages missing, all there on a forced reconnect).  Now the edge
closes such a connection when the view shows the home in a new incarnation, as for a
moved session, and the client reconnects to it.

Real node processes on loopback.  Replication 1 makes the home the shard's only holder,
which is the same position as both replicas of a shard killed together, with three nodes.
"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from cluster_support import (
    Clients,
    Delivery,
    connect_with_retry,
    start_cluster,
    unique,
)

pytestmark = pytest.mark.timeout(120)

NODES = ("a", "b", "c")


def test_a_subscriber_whose_session_home_restarted_is_reconnected_to_it(
        tmp_path: Path, clients: Clients) -> None:
    cluster = start_cluster(tmp_path / "cluster", NODES, replication=1)
    try:
        view = cluster.settle(NODES)
        leader = view.leader
        assert leader is not None
        home = next(n for n in NODES if n != leader)
        edge = next(n for n in NODES if n not in (home, leader))
        client_id = view.client_homed_at(home, unique("homed"))
        topic = view.topic_owned_by(leader, unique("restart"))
        inbox: queue.Queue[Delivery] = queue.Queue()
        subscriber = clients.make(cluster.port(edge), client_id, clean_session=False,
                                  inbox=inbox)
        subscriber.connect()
        assert subscriber.subscribe(topic, 1) == [1]
        publisher = clients.connected(cluster.port(leader), unique("pub"))
        publisher.publish(topic, b"before", 1)
        assert [d.payload for d in subscriber.collect(1)] == [b"before"]

        cluster.kill(home)
        down = cluster.wait_view(leader, lambda v: home not in v.up(), timeout=20)
        assert down.home_of(client_id) == home, "the shard moved: not the case under test"
        cluster.restart(home, via=leader)
        cluster.settle(NODES, timeout=30)
        publisher.publish(topic, b"after", 1, timeout=15)

        # The old connection cannot receive it: its home's proxy died with its old life.
        # It must not stay connected to nothing (before the fix it did, for ever).
        assert subscriber.disconnected.wait(10), (
            "still connected at its edge to a session its restarted home holds offline\n"
            + cluster.logs_of_interest())
        again, present = connect_with_retry(clients, lambda: cluster.port(edge), client_id,
                                            False, inbox)
        assert present
        got = again.until(lambda got: any(d.payload == b"after" for d in got), timeout=10)
        assert b"after" in [d.payload for d in got], (got, cluster.logs_of_interest())
    finally:
        cluster.close()
