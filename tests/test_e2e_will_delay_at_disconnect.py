"""A will goes out at the earlier of its Will Delay Interval and the end of its session
[MQTT-3.1.3-9], with the Session Expiry Interval in force when the connection ends: a
DISCONNECT with reason 0x04 (keep the will) may change it.  The delay was bounded once, at
CONNECT: lowered to 1 s at DISCONNECT, a will delayed 10 s came after 10 s; raised from 1 s
to 60, a will delayed 3 s came after 1 s, while its session was still alive.

Three clients at once, each drops its connection after its DISCONNECT's properties are
sent, and a subscriber notes when each will arrives.  On one node, and through a cluster
with each client's session homed on another node than its connection (the home keeps the
will and hears the delay in force from the edge).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster_support import HOST, NodeCluster, start_cluster, unique
from conftest import BrokerHandle
from mqtt5_support import Raw5
from mqtt_client import PUBLISH, RawClient
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets5 import (
    ConnAck5,
    Connect5,
    Disconnect5,
    Publish5,
    SubAck5,
    SubOptions,
    Subscribe5,
    Will5,
)
from mqttring.protocol.properties import Properties, PropertyId

pytestmark = pytest.mark.timeout(120)

#: name -> (Will Delay Interval, Session Expiry at CONNECT, at DISCONNECT, (earliest, latest)
#: seconds after the DISCONNECT the will may arrive).
CASES = {
    "lowered": (10, 60, 1, (0.5, 6.0)),
    "raised": (3, 1, 60, (2.5, 9.0)),
    "ended": (10, 60, 0, (0.0, 3.0)),
}


def _run(edges: dict[str, int], sub_port: int, client_ids: dict[str, str]) -> None:
    root = unique("wd")
    sub = RawClient(HOST, sub_port, timeout=15)
    clients: list[Raw5] = []
    try:
        assert sub.connect(unique("wd-sub")).return_code == 0
        assert sub.subscribe([(f"{root}/#", 0)]) == [0]
        for name, (delay, expiry, _, _) in CASES.items():
            client = Raw5(HOST, edges[name])
            clients.append(client)
            will = Will5(f"{root}/{name}", name.encode(), 0, False,
                         Properties([(PropertyId.WILL_DELAY_INTERVAL, delay)]))
            client.send(encode5(Connect5(client_ids[name], True, 60, will, properties=Properties(
                [(PropertyId.SESSION_EXPIRY_INTERVAL, expiry)]))))
            connack = client.recv(timeout=15)
            assert isinstance(connack, ConnAck5) and connack.reason_code == 0, connack
        sent: dict[str, float] = {}
        for (name, (_, _, expiry_at_close, _)), client in zip(CASES.items(), clients,
                                                                strict=True):
            client.send(encode5(Disconnect5(0x04, Properties(
                [(PropertyId.SESSION_EXPIRY_INTERVAL, expiry_at_close)]))))
            sent[name] = time.monotonic()
        arrived: dict[str, float] = {}
        deadline = time.monotonic() + 15
        while len(arrived) < len(CASES):
            packet = sub.recv_packet(max(deadline - time.monotonic(), 0.01))
            assert packet.type == PUBLISH, packet
            name = packet.payload.decode()
            assert name not in arrived, f"the will of {name!r} came twice"
            arrived[name] = time.monotonic() - sent[name]
        for name, (_, _, _, (earliest, latest)) in CASES.items():
            assert earliest <= arrived[name] <= latest, (name, arrived)
    finally:
        for client in clients:
            client.close()
        sub.close()


def test_one_node(broker: BrokerHandle) -> None:
    _run({name: broker.port for name in CASES}, broker.port,
         {name: unique(f"wd-{name}") for name in CASES})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    c = start_cluster(Path(tmp_path_factory.mktemp("willdelay")))
    yield c
    c.close()


def test_a_cluster_home_on_another_node(cluster: NodeCluster) -> None:
    view = cluster.settle(("a", "b", "c"))
    _run({name: cluster.port("a") for name in CASES}, cluster.port("c"),
         {name: view.client_homed_at("b", unique(f"wd-{name}")) for name in CASES})


def test_a_delayed_wills_expiry_counts_from_its_publication(broker: BrokerHandle) -> None:
    """A will's Message Expiry Interval is its lifetime from when it is *published*
    [3.1.3.2.4]: a will delayed 2 s with an expiry of 1 s goes out (with MEI 1), as
    mosquitto sends it.  A probe found it counted from the close on one node: the will
    had expired before it was due, and was never published."""
    topic = unique("wd-mei")
    sub = Raw5(HOST, broker.port)
    client = Raw5(HOST, broker.port)
    try:
        connack = sub.connect(unique("wd-mei-sub"))
        assert isinstance(connack, ConnAck5) and connack.reason_code == 0
        sub.send(encode5(Subscribe5(1, ((topic, SubOptions(0)),))))
        assert isinstance(sub.recv(), SubAck5)
        will = Will5(topic, b"gone", 0, False, Properties([
            (PropertyId.WILL_DELAY_INTERVAL, 2), (PropertyId.MESSAGE_EXPIRY_INTERVAL, 1)]))
        client.send(encode5(Connect5(unique("wd-mei"), True, 60, will, properties=Properties(
            [(PropertyId.SESSION_EXPIRY_INTERVAL, 60)]))))
        connack = client.recv()
        assert isinstance(connack, ConnAck5) and connack.reason_code == 0
        client.close()  # no DISCONNECT: the will is due after its delay
        packet = sub.recv(timeout=15)
        assert isinstance(packet, Publish5) and packet.payload == b"gone", packet
        assert packet.properties.get(PropertyId.MESSAGE_EXPIRY_INTERVAL) == 1
    finally:
        client.close()
        sub.close()
