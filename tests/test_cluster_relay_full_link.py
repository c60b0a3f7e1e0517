"""A persistent session served across nodes when the link to its client's node is full.

The session lives at its home (node a); its client is connected to node b, so the home
relays the session's output over the a -> b data link (``sbytes``).  A flood of QoS 0
traffic to b's clean subscribers fills that link's queue (``link_queue_messages``, tiny
here), and QoS 0 past it is dropped, as documented.  The relayed QoS 1 PUBLISHes must not
be: the session counts them as sent, and a 3.1.1 broker sends nothing again while the
connection lasts.  Before 2026-11-29 the dropped bytes left the subscriber waiting for ever
(its window stalled once full of them); now the home closes that connection and the
client's reconnect gets every message.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster_support import HOST, Clients, start_cluster, unique
from mqtt_client import RawClient, connect, publish

pytestmark = pytest.mark.timeout(180)

ROUNDS = 30
FLOOD_PER_ROUND = 400


def test_relayed_qos1_output_dropped_at_a_full_link_reaches_the_client_after_a_reconnect(
        tmp_path: Path, clients: Clients) -> None:
    cluster = start_cluster(tmp_path, ("a", "b"), extra_toml="link_queue_messages = 8\n")
    try:
        view = cluster.settle(("a", "b"))
        sub_id = view.client_homed_at("a", unique("relay"))
        topic = view.topic_owned_by("a", unique("relay/q1"))
        flood = view.topic_owned_by("a", unique("relay/q0"))
        sub = clients.connected(cluster.port("b"), sub_id, clean_session=False)
        sub.subscribe(topic, 1)
        sink = clients.connected(cluster.port("b"), unique("sink"))
        sink.subscribe(flood, 0)
        # One write holding, per round, a burst of QoS 0 (which fills the a -> b queue)
        # and then one QoS 1 message for the persistent session: read and accepted together
        # at a, so the session's output meets a full queue.
        pub = RawClient(HOST, cluster.port("a"), timeout=30)
        pub.send(connect(unique("flood"), clean_session=True))
        pub.expect(2)  # CONNACK
        burst = b"".join(publish(flood, b"x" * 32) for _ in range(FLOOD_PER_ROUND))
        pub.send(b"".join(burst + publish(topic, f"m{r}".encode(), qos=1, packet_id=r + 1)
                          for r in range(ROUNDS)))
        acked = {pub.expect(4, timeout=30).packet_id for _ in range(ROUNDS)}  # PUBACKs
        assert acked == set(range(1, ROUNDS + 1))

        wanted = {f"m{r}".encode() for r in range(ROUNDS)}
        got: set[bytes] = set()
        reconnects = 0
        deadline = time.monotonic() + 40
        while got != wanted and time.monotonic() < deadline:
            got |= {d.payload for d in sub.until(lambda ds: False, timeout=0.5)
                    if d.topic == topic}
            if got != wanted and not sub.live:
                # Closed by the home (its output was dropped): resume the session.
                reconnects += 1
                sub = clients.connected(cluster.port("b"), sub_id, clean_session=False)
        assert got == wanted, (f"missing {sorted(wanted - got)} after {reconnects} reconnects "
                               f"(the session's relayed output was dropped at the full link)")
        pub.close()
    finally:
        cluster.close()
