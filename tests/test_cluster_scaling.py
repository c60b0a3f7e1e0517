"""Scaling out and in with data at rest: a join and a graceful leave move shards (sessions,
their queued messages, retained values) between real ``mqttring.node`` processes; nothing
acknowledged may be lost or delivered twice on the way, and a leaving node sends its clients
away without publishing their wills.

The fault suite's ``join``/``leave`` scenarios check the same under a live workload; this
one holds what is hardest to move: offline persistent sessions with QoS 1 messages queued
at their homes (a home that moves must take the queue along) and many retained values.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster_support import Client, NodeCluster, start_cluster

pytestmark = pytest.mark.timeout(240)

SESSIONS = 40
QUEUED = 10
RETAINED = 200


def _queue(cluster: NodeCluster, via: str, ids: list[str], batch: int) -> None:
    """``QUEUED`` QoS 1 messages per offline session, each acknowledged by the broker."""
    pub = Client(cluster.port(via), f"pub-{batch}")
    pub.connect()
    try:
        for cid in ids:
            for k in range(QUEUED):
                pub.publish(f"q/{cid}", f"{batch}:{k}", qos=1)
    finally:
        pub.disconnect()
        pub.close()


def _collect(cluster: NodeCluster, nodes: list[str], ids: list[str], batch: int) -> list[str]:
    """Resume every session (alternating over ``nodes``); the problems found."""
    problems = []
    for j, cid in enumerate(ids):
        node = nodes[j % len(nodes)]
        client = Client(cluster.port(node), cid, clean_session=False)
        client.connect()
        try:
            got = client.until(lambda d: len(d) >= QUEUED, timeout=10, quiet=0.2)
        finally:
            client.disconnect()
            client.close()
        payloads = [d.payload.decode() for d in got]
        want = [f"{batch}:{k}" for k in range(QUEUED)]
        if payloads != want:
            problems.append(f"{cid} via {node}: got {payloads}, want {want}")
    return problems


def _retained(cluster: NodeCluster, node: str) -> list[str]:
    client = Client(cluster.port(node), f"retained-reader-{node}")
    client.connect()
    try:
        client.subscribe("r/#", qos=1)
        got = client.until(lambda d: len(d) >= RETAINED, timeout=20, quiet=0.3)
    finally:
        client.close()
    seen: dict[str, list[bytes]] = {}
    for d in got:
        seen.setdefault(d.topic, []).append(d.payload)
    return [f"r/{i}: {seen.get(f'r/{i}')}" for i in range(RETAINED)
            if seen.get(f"r/{i}") != [f"v{i}".encode()]]


def test_queued_messages_and_retained_values_move_with_a_join_and_a_leave(
        tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, ("a", "b", "c"))
    try:
        ids = [f"scaled-{i}" for i in range(SESSIONS)]
        for cid in ids:
            client = Client(cluster.port("a"), cid, clean_session=False)
            client.connect()
            client.subscribe(f"q/{cid}", qos=1)
            client.disconnect()
            client.close()
        _queue(cluster, "b", ids, 1)
        writer = Client(cluster.port("c"), "retainer")
        writer.connect()
        for i in range(RETAINED):
            writer.publish(f"r/{i}", f"v{i}", qos=1, retain=True)
        writer.close()

        # Scale out: d takes about a quarter of the shards, homes of queued sessions too.
        cluster.start("d", join=cluster.procs["a"].cluster)
        cluster.ready("d")
        view = cluster.settle(("a", "b", "c", "d"), timeout=60)
        moved = [cid for cid in ids if view.home_of(cid) == "d"]
        assert moved, "the join moved no session home: the test would prove nothing"
        assert _collect(cluster, ["d", "a"], ids, 1) == [], cluster.logs_of_interest()
        assert _retained(cluster, "d") == []

        # Scale in: c leaves on SIGTERM, handing its shards over, with a new queue waiting,
        # and a client with a will connected to it.
        _queue(cluster, "d", ids, 2)
        homed_at_c = [cid for cid in ids if view.home_of(cid) == "c"]
        assert homed_at_c, "no session homed at the leaver: the test would prove nothing"
        watcher = Client(cluster.port("a"), "will-watcher")
        watcher.connect()
        watcher.subscribe("wills/#", qos=1)
        alive = Client(cluster.port("c"), "on-the-leaver")
        alive.connect(will=("wills/on-the-leaver", b"gone", 1, False))
        assert cluster.sigterm("c") == 0
        # Sent away (to reconnect elsewhere), not kept until c was out of the cluster.
        assert alive.disconnected.wait(5)
        alive.close()
        again = Client(cluster.port("b"), "on-the-leaver")
        again.connect()
        cluster.settle(("a", "b", "d"), timeout=60)
        # Its will waits for it (``moved_session_grace``) and it came back: none.  Before,
        # the homes published it as soon as they saw c leaving.
        assert watcher.drain(1.0) == []
        # The new owners took c's shards only once c had handed them over: a leaving
        # owner still takes deliveries for them until its view moves on.
        assert any(" c handed " in line for node in ("a", "b", "d")
                   for line in cluster.grep(node, "handed")), cluster.logs_of_interest()
        assert _collect(cluster, ["b", "d"], ids, 2) == [], cluster.logs_of_interest()
        assert _retained(cluster, "a") == []
        again.close()
        watcher.close()
        for node in ("a", "b", "d"):
            assert cluster.grep(node, "Traceback", "ERROR") == [], node
    finally:
        cluster.close()
