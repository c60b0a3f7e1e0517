"""A client whose session's home just died connects to a survivor and is let in.

The home of a client id (the owner of its client shard) decides on its connections, so
while a dead home is still in the view (``failure_grace``) nobody can.  The edge used to
answer CONNACK 3 (server unavailable) at once, for as long as that lasted: mosquitto_sub
and mosquitto_pub give up on it, and a single broker never shows it.  Now the edge waits
for the view to move the id elsewhere (within ``cluster_write_patience``) and asks the new
home: the CONNACK comes late, but it comes.  Real node processes, kill -9.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from cluster_support import HOST, NodeCluster, unique
from mqtt_client import CONNACK, RawClient, connect

pytestmark = pytest.mark.timeout(120)


def test_a_connect_while_its_dead_home_is_still_in_the_view_waits_for_the_new_home(
        fresh_cluster: Callable[..., NodeCluster]) -> None:
    cluster = fresh_cluster()
    view = cluster.view("a")
    victim, edge = "b", "a"
    clean_id = view.client_homed_at(victim, unique("clean"))
    kept_id = view.client_homed_at(victim, unique("kept"), avoid=[clean_id])
    before = RawClient(HOST, cluster.port(edge))  # a persistent session, stored at b
    before.send(connect(kept_id, clean_session=False))
    assert before.expect(CONNACK).return_code == 0
    before.close()
    time.sleep(0.5)  # (its close reaches the home; the session stays)
    cluster.kill(victim)
    killed = time.monotonic()
    clients: list[RawClient] = []
    try:
        for client_id, clean in ((clean_id, True), (kept_id, False)):
            client = RawClient(HOST, cluster.port(edge))
            clients.append(client)
            client.send(connect(client_id, clean_session=clean, keepalive=60))
            ack = client.expect(CONNACK, timeout=30)
            assert ack.return_code == 0, (
                f"{client_id}: CONNACK {ack.return_code} "
                f"{time.monotonic() - killed:.1f} s after the kill of its home\n"
                f"{cluster.logs_of_interest(('a', 'c'))}")
            assert ack.session_present is (not clean), client_id  # the replica had it
            print(f"{client_id}: CONNACK 0 {time.monotonic() - killed:.2f} s after the kill")
    finally:
        for client in clients:
            client.close()
