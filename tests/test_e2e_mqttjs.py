"""MQTT.js (the Node.js client issue 15 names) against real mqttring nodes.

Each test runs ``tests/js/exchange.js`` (MQTT.js 5.x, pinned in ``tests/js/package-lock.json``)
as a process against ``python -m mqttring.node`` processes, over TCP and over WebSocket, with
``protocolVersion`` 4 (MQTT 3.1.1) and 5, and asserts on the JSON it prints: CONNACK, SUBACK,
QoS 1 deliveries, v5 user properties and subscription identifiers, a shared subscription
split between two MQTT.js members, and the same across a 3-node cluster.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster_support import HOST, NodeCluster, ViewInfo, unique
from conftest import NodeProcess
from js_support import ensure_mqttjs, run_exchange

pytestmark = pytest.mark.timeout(180)

TIMEOUT_MS = 20_000  # each script's own bound; the Python side kills it 10 s later


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    ensure_mqttjs()  # before the node starts: a first npm ci must not eat its time
    root = Path(tmp_path_factory.mktemp("mqttjs"))
    (root / "data").mkdir()
    proc = NodeProcess(root / "data", root / "node.log", "js", ws=True)
    proc.start()
    yield proc
    proc.terminate()


def url(port: int | None, transport: str) -> str:
    assert port, f"no {transport} listener"
    return f"{'ws' if transport == 'ws' else 'mqtt'}://{HOST}:{port}"


def node_url(node: NodeProcess, transport: str) -> str:
    return url(node.ws_port if transport == "ws" else node.port, transport)


def exchange(subscribers: list[dict[str, Any]], publisher: dict[str, Any], expect: int,
             quiet_ms: int = 300) -> dict[str, Any]:
    return run_exchange({"timeout_ms": TIMEOUT_MS, "quiet_ms": quiet_ms, "expect": expect,
                         "subscribers": subscribers, "publisher": publisher},
                        timeout=TIMEOUT_MS / 1000 + 10)


@pytest.mark.parametrize("transport", ["tcp", "ws"])
@pytest.mark.parametrize("version", [4, 5])
def test_connect_subscribe_and_qos1_round_trip(node: NodeProcess, transport: str,
                                               version: int) -> None:
    root = unique("js")
    where = node_url(node, transport)
    result = exchange(
        [{"name": "sub", "url": where, "protocolVersion": version,
          "subscribe": [{"filter": f"{root}/#", "qos": 1, "subscriptionIdentifier": 42}]
          if version == 5 else [{"filter": f"{root}/#", "qos": 1}]}],
        {"url": where, "protocolVersion": version, "messages": [
            {"topic": f"{root}/a", "payload": "one", "qos": 1,
             **({"userProperties": {"k": "v", "multi": ["1", "2"]}} if version == 5 else {})},
            {"topic": f"{root}/b", "payload": "two", "qos": 1},
        ]},
        expect=2)
    for name in ("sub", "publisher"):
        connack = result["connacks"][name]
        assert connack["reasonCode"] == 0 and connack["sessionPresent"] is False
    assert result["granted"] == {"sub": [1]}
    got = {m["payload"]: m for m in result["received"]}
    assert sorted(got) == ["one", "two"], result["received"]
    assert all(m["qos"] == 1 and not m["retain"] for m in got.values())
    if version == 4:
        assert all(m["properties"] is None for m in got.values())
        assert result["connacks"]["sub"]["properties"] is None
        return
    caps = result["connacks"]["sub"]["properties"]
    assert caps["sharedSubscriptionAvailable"] and caps["subscriptionIdentifiersAvailable"]
    one, two = got["one"]["properties"], got["two"]["properties"]
    # repeated keys keep their order; a key sent once is a plain string
    assert one["userProperties"] == {"k": "v", "multi": ["1", "2"]}
    assert one["subscriptionIdentifier"] == 42
    assert two == {"subscriptionIdentifier": 42}


@pytest.mark.parametrize("version", [4, 5])
def test_shared_subscription_split_between_two_mqttjs_members(node: NodeProcess,
                                                              version: int) -> None:
    """One member over TCP, one over WebSocket: each message to exactly one of them,
    and (round robin, the default) each gets its share."""
    root = unique("jsq")
    share = f"$share/workers/{root}/#"
    n = 12
    result = exchange(
        [{"name": name, "url": node_url(node, transport), "protocolVersion": version,
          "subscribe": [{"filter": share, "qos": 1}]}
         for name, transport in (("m-tcp", "tcp"), ("m-ws", "ws"))],
        {"url": node_url(node, "tcp"), "protocolVersion": version, "messages": [
            {"topic": f"{root}/{i}", "payload": str(i), "qos": 1} for i in range(n)]},
        expect=n, quiet_ms=500)
    assert result["granted"] == {"m-tcp": [1], "m-ws": [1]}
    payloads = collections.Counter(m["payload"] for m in result["received"])
    assert payloads == collections.Counter(str(i) for i in range(n)), payloads
    per_member = collections.Counter(m["to"] for m in result["received"])
    assert per_member["m-tcp"] == per_member["m-ws"] == n // 2, per_member


@pytest.fixture(scope="module")
def aliasing_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node that may alias topics towards clients (off by default: paho and
    libmosquitto cannot resolve them, ``test_e2e_mqtt5_connection.py``)."""
    ensure_mqttjs()
    root = Path(tmp_path_factory.mktemp("mqttjs-alias"))
    (root / "data").mkdir()
    (root / "node.toml").write_text("[limits]\ntopic_alias_maximum_out = 2\n")
    proc = NodeProcess(root / "data", root / "node.log", "jsal", ws=True)
    proc.extra_args = ["--config", str(root / "node.toml")]
    proc.start()
    yield proc
    proc.terminate()


@pytest.mark.parametrize("transport", ["tcp", "ws"])
def test_mqttjs_resolves_outbound_topic_aliases(aliasing_node: NodeProcess,
                                                transport: str) -> None:
    """MQTT.js 5 announcing a Topic Alias Maximum gets aliased PUBLISHes (the topic once,
    then the alias with an empty topic) and hands every message over with its topic."""
    root = unique("jsal")
    where = node_url(aliasing_node, transport)
    leaves = ["a", "a", "b", "a", "c", "b", "c"]
    result = exchange(
        [{"name": "sub", "url": where, "protocolVersion": 5, "topicAliasMaximum": 2,
          "subscribe": [{"filter": f"{root}/#", "qos": 1}]}],
        {"url": where, "protocolVersion": 5, "messages": [
            {"topic": f"{root}/{leaf}", "payload": f"{i}", "qos": 1}
            for i, leaf in enumerate(leaves)]},
        expect=len(leaves))
    got = sorted(result["received"], key=lambda m: int(m["payload"]))
    assert [m["topic"] for m in got] == [f"{root}/{leaf}" for leaf in leaves], got
    # a and b took the two aliases; c (past the maximum) always went in full.
    aliases = [(m["properties"] or {}).get("topicAlias") for m in got]
    assert aliases == [1, 1, 2, 1, None, 2, None], aliases


# --------------------------------------------------------------------------- a cluster


NODES = ("a", "b", "c")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    ensure_mqttjs()
    c = NodeCluster(Path(tmp_path_factory.mktemp("mqttjs-cluster")))
    c.extra_args = ["--ws", f"{HOST}:0"]
    try:
        c.form_sync(*NODES)
        c.settle(NODES)
        yield c
    finally:
        c.close()


def ws_port(cluster: NodeCluster, node: str) -> int:
    port = json.loads(cluster.procs[node].ready_file.read_text())["ws"]
    assert port, f"{node} has no WebSocket listener"
    return int(port)


def one_topic_per_owner(view: ViewInfo, prefix: str) -> dict[str, str]:
    return {owner: view.topic_owned_by(owner, prefix) for owner in NODES}


def test_across_a_cluster_v5_subscriber_and_shared_members(cluster: NodeCluster) -> None:
    """Publisher (v5, TCP) on a; a v5 subscriber over WebSocket on b; two shared members on
    b and c. Topics owned by each node, so every path (owner = edge, = subscriber's node,
    = a third node) is taken; properties and the subscription identifier survive it."""
    view = cluster.settle(NODES)
    prefix = unique("jsc")
    topics = one_topic_per_owner(view, prefix)
    per_topic = 4
    messages = [{"topic": topic, "payload": f"{owner}-{i}", "qos": 1,
                 "userProperties": {"owner": owner}, "messageExpiryInterval": 600}
                for owner, topic in topics.items() for i in range(per_topic)]
    n = len(messages)
    share = f"$share/pool/{prefix}/#"
    result = exchange(
        [{"name": "sub@b", "url": url(ws_port(cluster, "b"), "ws"), "protocolVersion": 5,
          "subscribe": [{"filter": f"{prefix}/#", "qos": 1, "subscriptionIdentifier": 9}]},
         {"name": "m@b", "url": url(cluster.port("b"), "tcp"), "protocolVersion": 5,
          "subscribe": [{"filter": share, "qos": 1}]},
         {"name": "m@c", "url": url(cluster.port("c"), "tcp"), "protocolVersion": 5,
          "subscribe": [{"filter": share, "qos": 1}]}],
        {"url": url(cluster.port("a"), "tcp"), "protocolVersion": 5, "messages": messages},
        expect=2 * n, quiet_ms=800)
    assert all(codes == [1] for codes in result["granted"].values()), result["granted"]
    by_member = collections.defaultdict(list)
    for m in result["received"]:
        by_member[m["to"]].append(m)
    sub = {m["payload"]: m for m in by_member["sub@b"]}
    assert sorted(sub) == sorted(m["payload"] for m in messages)
    for payload, m in sub.items():
        owner = payload.split("-")[0]
        props = m["properties"]
        assert props["userProperties"] == {"owner": owner}
        assert props["subscriptionIdentifier"] == 9
        assert 0 < props["messageExpiryInterval"] <= 600
    shared = collections.Counter(m["payload"] for m in by_member["m@b"] + by_member["m@c"])
    assert shared == collections.Counter(m["payload"] for m in messages), shared
    assert by_member["m@b"] and by_member["m@c"], {k: len(v) for k, v in by_member.items()}
    assert all(m["properties"]["userProperties"] for m in by_member["m@b"] + by_member["m@c"])
