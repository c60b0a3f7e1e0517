"""A client disconnected because its persistent session moved is alive, and is treated so.

When a persistent session's home dies, the nodes where its client is connected close the
connection so that it reconnects to the session at its new home.  For
``moved_session_grace`` after that:

* its will waits, and is dropped if the client id connects again meanwhile.  MQTT lets a
  broker publish the will of any connection it closes, and before 2026-11-28 mqttring did:
  every such client "died" on every node fault (the operator probe counted them each run);
* its session at the new home keeps what arrives past ``limits.max_queued``: the deliveries
  held back during the failover arrive there at once, while the client is away, and the
  away rule dropped the oldest of them, acknowledged messages (the operator probe: 435 lost
  per subscriber whose home was frozen 15 s, in 2 of 3 such runs; found by a helper).

Real node processes on loopback; the home is killed with SIGKILL.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

from cluster_support import HOST, Clients, Delivery, NodeCluster, connect_with_retry, unique
from mqtt_client import PUBLISH, RawClient, puback

pytestmark = pytest.mark.timeout(150)

DELAY = 3.0


def test_a_client_whose_session_moved_gets_no_will_if_it_comes_back(tmp_path: Path) -> None:
    cluster = NodeCluster(tmp_path / "cluster")
    cluster.extra_toml = f"moved_session_grace = {DELAY}\n"
    made: list[RawClient] = []
    try:
        cluster.form_sync("a", "b", "c")
        view = cluster.settle(("a", "b", "c"))
        topic = unique("moved")
        watcher = RawClient(HOST, cluster.port("a"))
        made.append(watcher)
        assert watcher.connect(unique("watcher")).return_code == 0
        assert watcher.subscribe([(f"{topic}/#", 1)]) == [1]
        back_id = view.client_homed_at("b", unique("back"))
        gone_id = view.client_homed_at("b", unique("gone"), avoid=(back_id,))
        clients = {}
        for client_id, name in ((back_id, "back"), (gone_id, "gone")):
            client = RawClient(HOST, cluster.port("c"))
            made.append(client)
            ack = client.connect(client_id, clean_session=False,
                                 will=(f"{topic}/{name}", name.encode(), 1, False))
            assert ack.return_code == 0
            clients[name] = client
        cluster.kill("b")
        for client in clients.values():  # closed by c once b's shards moved
            assert client.wait_closed(timeout=30), "not disconnected when its session moved"
        kicked = time.monotonic()
        deadline = kicked + 20
        while True:  # "back" reconnects at once (its new home may still be loading)
            again = RawClient(HOST, cluster.port("c"))
            made.append(again)
            ack = again.connect(back_id, clean_session=False)
            if ack.return_code == 0:
                break
            assert time.monotonic() < deadline, ack
            time.sleep(0.2)
        wills: list[tuple[str, float]] = []
        while time.monotonic() < kicked + DELAY + 8:
            packet = watcher.no_packet_within(kicked + DELAY + 8 - time.monotonic())
            if packet is None:
                break
            if packet.type == PUBLISH:
                wills.append((packet.topic, time.monotonic() - kicked))
                if packet.qos:
                    watcher.send(puback(packet.packet_id))
        assert [t for t, _ in wills] == [f"{topic}/gone"], (wills, cluster.logs_of_interest())
        assert wills[0][1] >= DELAY - 0.5, f"the will came {wills[0][1]:.1f} s after the close"
    finally:
        for client in made:
            client.close()
        cluster.close()


def test_what_piled_up_for_a_moved_session_is_kept_past_max_queued(
        tmp_path: Path, clients: Clients) -> None:
    """A persistent QoS 1 subscriber homed on the node that dies, connected to another; a
    publisher streams through the failover.  With ``max_queued = 20``, far less than what
    is held back for the subscriber while its home is being declared down, it still gets
    every acknowledged message once it has reconnected."""
    cluster = NodeCluster(tmp_path / "cluster")
    cluster.extra_toml = "[limits]\nmax_queued = 20\n"
    try:
        cluster.form_sync("a", "b", "c")
        view = cluster.settle(("a", "b", "c"))
        topic = view.topic_owned_by("a", unique("pile"))
        sub_id = view.client_homed_at("b", unique("pile-sub"))
        inbox: queue.Queue[Delivery] = queue.Queue()
        sub = clients.make(cluster.port("c"), sub_id, clean_session=False, inbox=inbox)
        sub.connect()
        assert sub.subscribe(topic, 1) == [1]
        publisher = clients.connected(cluster.port("a"), name="publisher@a")
        infos = []
        for i in range(240):  # about 6 s at 40/s: through the 4 s failure grace
            if i == 40:
                cluster.kill("b")
            infos.append((f"m{i}".encode(), publisher.publish_nowait(topic, f"m{i}", 1)))
            time.sleep(0.025)
        assert sub.disconnected.wait(30), "not disconnected when its session moved"
        again, present = connect_with_retry(clients, lambda: cluster.port("c"), sub_id,
                                            False, inbox)
        assert present
        acked = [p for p, info in infos if publisher.ack_within(info, 20)]
        assert len(acked) > 100, f"only {len(acked)} acknowledged"
        got = {d.payload for d in again.until(
            lambda g: set(acked) <= {d.payload for d in g}, timeout=30, quiet=0.5)}
        got |= {d.payload for d in sub.pending()}
        lost = [p for p in acked if p not in got]
        assert not lost, (f"{len(lost)} of {len(acked)} acknowledged messages lost, first "
                          f"{lost[:5]}\n{cluster.logs_of_interest()}")
    finally:
        cluster.close()
