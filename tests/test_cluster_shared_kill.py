"""A share member's node killed while the owners' ``Dlv``s to it are in flight, on 3 nodes.

The owners (a and b) track each QoS 1 copy they place with a clean member on c; when c
leaves the view, ``ShareDispatch.on_view`` takes back what c never reported gone and places
it again.  A ``Dlv`` still unanswered at that moment then fails as ``NODE_GONE``; until
2026-11-29 that failure also counted as a decline, so the owner asked the next member too
and each such copy reached the survivor twice (a probe: 1 to 16 duplicates per run, every
run).  At least once must hold (nothing acknowledged lost) and, as no member ended holding a
copy unacknowledged, each copy placed once.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest

from cluster_support import WAIT, Client, Clients, Delivery, NodeCluster, unique

pytestmark = pytest.mark.timeout(120)

#: QoS 1 messages published after c is killed (about half are asked of c first).
IN_FLIGHT = 40


def _warm_up(publisher: Client, doomed: Client, topics: list[str], rounds: int = 10) -> None:
    """Publish until the member on c got a message of every topic: each owner's route
    table has c as a target of the share (its route reached them)."""
    seen: set[str] = set()
    for i in range(rounds):
        for topic in topics:
            publisher.publish(topic, f"w{i}", 1)
        seen.update(d.topic for d in doomed.drain(0.3))
        if seen >= set(topics):
            return
    raise AssertionError(f"the member on c got nothing of {sorted(set(topics) - seen)}")


def test_copies_in_flight_to_a_killed_members_node_are_placed_once(
        fresh_cluster: Callable[..., NodeCluster], clients: Clients) -> None:
    """Members on b and c, the publisher on a, topics owned by a and b; c is killed, then
    ``IN_FLIGHT`` QoS 1 messages are published: those asked of c wait (in flight) until c
    leaves the view.  Every one is acknowledged and reaches the member on b exactly once."""
    cluster = fresh_cluster()
    view = cluster.view("a")
    prefix = unique("inflight")
    topics = [view.topic_owned_by("a", prefix)]
    topics.append(view.topic_owned_by("b", prefix, avoid=topics))
    share = f"$share/g/{prefix}/#"
    doomed = clients.make(cluster.port("c"), unique("m-c"), name="m@c")
    doomed.connect()
    assert doomed.subscribe(share, 1) == [1]
    survivor = clients.make(cluster.port("b"), unique("m-b"), name="m@b")
    survivor.connect()
    assert survivor.subscribe(share, 1) == [1]
    publisher = clients.connected(cluster.port("a"), name="publisher@a")
    _warm_up(publisher, doomed, topics)

    cluster.kill("c")
    payloads = [f"m{i}".encode() for i in range(IN_FLIGHT)]
    infos = [publisher.publish_nowait(topics[i % len(topics)], p, 1)
             for i, p in enumerate(payloads)]
    # Acknowledged once c has left the view (failure_grace) and its copies are placed.
    unacked = [p for p, info in zip(payloads, infos, strict=True)
               if not publisher.ack_within(info, 30)]
    assert not unacked, (f"{len(unacked)} not acknowledged, first {unacked[:5]}\n"
                         f"{cluster.logs_of_interest(('a', 'b'))}")

    wanted = set(payloads)

    def complete(got: list[Delivery]) -> bool:
        return wanted <= {d.payload for d in got}

    # Then a while longer: a second copy of one comes about as soon as the first.
    got = survivor.until(complete, timeout=4 * WAIT, quiet=1.5)
    counts = collections.Counter(d.payload for d in got if d.payload in wanted)
    lost = sorted(wanted - set(counts), key=lambda p: int(p[1:]))
    twice = sorted((p for p, n in counts.items() if n > 1), key=lambda p: int(p[1:]))
    assert not lost, (f"{len(lost)} of {IN_FLIGHT} acknowledged messages lost, first "
                      f"{lost[:10]}\n{cluster.logs_of_interest(('a', 'b'))}")
    assert not twice, f"{len(twice)} of {IN_FLIGHT} placed twice: {twice}"
