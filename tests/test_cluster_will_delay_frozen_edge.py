"""An MQTT 5 will in its delay while its client's node freezes, is declared down and comes
back: the will still waits out its delay, counted from the declaration.

The node that takes over the client's session (its home was the frozen node) counts the
connection closed when the edge leaves the view and starts the delay then.  The frozen
edge, resumed, fences itself and closes its clients, and its close of this one reached the
new home late: taken for an owed will back from a fence, the will was published at once,
seconds early, and even for a client that came back within the delay (a fault probe, 7 of
10 runs).  Real node processes on loopback; the edge is frozen with SIGSTOP.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from cluster_support import HOST, NodeCluster, unique
from mqtt5_support import Paho5, Raw5, props
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets5 import Connect5, Will5
from mqttring.protocol.properties import Properties, PropertyId

pytestmark = pytest.mark.timeout(150)

SUBSCRIBE = 8
DELAY = 10  # seconds: well past the time the edge takes to come back


EDGE, WATCHER = "c", "a"  # the client's edge is also its home: its session moves


def connect_with_will(cluster: NodeCluster, client_id: str, topic: str, payload: bytes) -> Raw5:
    """An MQTT 5 client at the edge, persistent, its will delayed by ``DELAY``."""
    holder = Raw5(HOST, cluster.port(EDGE))
    holder.send(encode5(Connect5(
        client_id, clean_start=False, keepalive=60,
        will=Will5(topic, payload, 1, False,
                   Properties([(PropertyId.WILL_DELAY_INTERVAL, DELAY)])),
        properties=Properties([(PropertyId.SESSION_EXPIRY_INTERVAL, 300)]))))
    assert holder.recv().reason_code == 0  # type: ignore[attr-defined]
    return holder


def freeze_past_declared_down(cluster: NodeCluster) -> float:
    """SIGSTOP the edge until the watcher's node sees it down, 3 s more, then SIGCONT (it
    fences itself and closes its clients); when it was declared down (monotonic)."""
    frozen = cluster.procs[EDGE].popen
    assert frozen is not None
    frozen.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while cluster.view(WATCHER).members.get(EDGE) != "down":
            assert time.monotonic() < deadline, "the frozen edge was never declared down"
            time.sleep(0.1)
        declared = time.monotonic()
        # Frozen a while longer: the other nodes take its shards over, the client's
        # registration (and its will's due time) with them.
        while time.monotonic() < declared + 3:
            time.sleep(0.1)
    finally:
        frozen.send_signal(signal.SIGCONT)
    return declared


def watching(cluster: NodeCluster, topic: str) -> Paho5:
    watcher = Paho5(HOST, cluster.port(WATCHER))
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    return watcher


def test_a_delayed_will_waits_its_delay_when_its_frozen_edge_comes_back(
        fresh_cluster: Callable[..., NodeCluster]) -> None:
    cluster = fresh_cluster()
    topic = unique("frozen-will")
    watcher = watching(cluster, topic)
    client_id = cluster.view("a").client_homed_at(EDGE, unique("fw"))
    holder = connect_with_will(cluster, client_id, f"{topic}/gone", b"late")
    try:
        declared = freeze_past_declared_down(cluster)
        # Nothing until the delay has run from the declaration (less a margin for the
        # time the watcher took to see it).
        early = watcher.messages
        quiet_until = declared + DELAY - 1.5
        while (left := quiet_until - time.monotonic()) > 0:
            if not early.empty():
                got = early.get_nowait()
                raise AssertionError(
                    f"the will came {time.monotonic() - declared:.1f} s after the edge was "
                    f"declared down, its delay is {DELAY} s: {got.topic} {got.payload!r}\n"
                    f"{cluster.logs_of_interest()}")
            time.sleep(min(left, 0.1))
        got = watcher.get(timeout=15)
        assert (got.topic, got.payload) == (f"{topic}/gone", b"late")
    finally:
        holder.sock.close()
        watcher.client.loop_stop()


def test_a_client_back_within_the_delay_after_its_edge_froze_gets_no_will(
        fresh_cluster: Callable[..., NodeCluster]) -> None:
    """The same, and the client connects again (at another node) within the delay: its
    session goes on, and no will is published [MQTT-3.1.3.2.2]."""
    cluster = fresh_cluster()
    topic = unique("frozen-back")
    watcher = watching(cluster, topic)
    client_id = cluster.view("a").client_homed_at(EDGE, unique("fb"))
    holder = connect_with_will(cluster, client_id, f"{topic}/gone", b"never")
    again = Paho5(HOST, cluster.port(WATCHER), client_id)
    try:
        declared = freeze_past_declared_down(cluster)
        present, _ = again.connect(clean_start=False,
                                   properties=props(1, SessionExpiryInterval=300))
        assert present
        assert time.monotonic() - declared < DELAY - 2, "reconnected too late to test"
        # Past the delay: a will would be out by now.
        while time.monotonic() < declared + DELAY + 3:
            time.sleep(0.1)
        # (From the watcher: the returned client may be sent away meanwhile, when the
        # frozen node is back and its shards go home, and it is then owed a reconnect.)
        watcher.publish(f"{topic}/sentinel", b"s", 1)
        watcher.nothing_before(f"{topic}/sentinel")
    finally:
        holder.sock.close()
        watcher.client.loop_stop()
        again.client.loop_stop()
