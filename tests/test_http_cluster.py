"""The HTTP API and ``/metrics`` of a three-node cluster, asked through any one member.

Real ``mqttring.node`` processes with ``--http``; real paho clients; real HTTP.  What it
proves: every member reports the same members, leader and quorum; one node lists a client
connected to another, proxies another node's counters, kicks a client held by another node,
and a publish made through one node's API reaches a subscriber on another; the Raft, quorum
and link metrics are there; and once two nodes die the third reports that it lost quorum
(API and metrics) while its listings still answer, naming the members that did not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cluster_support import NodeCluster
from http_support import HOST, TOKEN, scrape, wait_for


@dataclass
class Target:
    host: str
    port: int
    ws_port: int | None = None


def test_cluster_api_through_any_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        paho_any) -> None:
    monkeypatch.setenv("MQTTRING_HTTP_TOKEN", TOKEN)
    cluster = NodeCluster(tmp_path, num_shards=64)
    cluster.extra_args = ["--http", f"{HOST}:0"]
    try:
        cluster.form_sync("a", "b", "c")
        cluster.settle(["a", "b", "c"])
        http = {}
        for node in "abc":
            info = json.loads(cluster.procs[node].ready_file.read_text())
            http[node] = httpx.Client(base_url=f"http://{HOST}:{info['http']}", timeout=20.0,
                                      headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            _check(cluster, http, paho_any)
        finally:
            for client in http.values():
                client.close()
    finally:
        cluster.close()


def _check(cluster: NodeCluster, http: dict[str, httpx.Client], paho_any) -> None:
    views = {node: http[node].get("/api/v1/cluster").json() for node in "abc"}
    leaders = {v["leader"] for v in views.values()}
    assert len(leaders) == 1 and leaders <= {"a", "b", "c"}, views
    for node, view in views.items():
        assert view["node_id"] == node and view["clustered"] is True
        assert view["quorum"] is True and view["fenced"] is False
        assert view["term"] >= 1 and view["epoch"] >= 1
        assert [(m["id"], m["state"]) for m in view["members"]] == [
            ("a", "up"), ("b", "up"), ("c", "up")]
        assert sum(m["shards"]["owner"] for m in view["members"]) == 64
        assert {m["mqtt"] for m in view["members"]} == {
            f"{HOST}:{cluster.port(n)}" for n in "abc"}

    # A subscriber on b; a publish through a's API reaches it.
    sub = paho_any(Target(HOST, cluster.port("b")), "sub-on-b")
    sub.connect()
    assert sub.subscribe("plant/#", 1) == [1]
    response = http["a"].post("/api/v1/publish",
                              json={"topic": "plant/line1", "payload": "from-a", "qos": 1})
    assert response.status_code == 200, response.text
    message = sub.get(timeout=10)
    assert (message.topic, message.payload) == ("plant/line1", b"from-a")

    # c lists the client that b holds, and shows it alone.
    listed = http["c"].get("/api/v1/clients").json()
    assert listed["unreachable"] == []
    assert [(c["client_id"], c["node"]) for c in listed["clients"]] == [("sub-on-b", "b")]
    assert http["c"].get("/api/v1/clients/sub-on-b").json()["node"] == "b"
    subs = http["a"].get("/api/v1/subscriptions").json()["subscriptions"]
    assert [(s["client_id"], s["filter"]) for s in subs] == [("sub-on-b", "plant/#")]

    # Persistent sessions live at their client id's home node; the figures come from there
    # whichever node holds the connection (some of these ids are homed on b or c).
    persistent = [paho_any(Target(HOST, cluster.port("a")), f"p-{i}", clean_session=False)
                  for i in range(6)]
    for client in persistent:
        client.connect()
        assert client.subscribe([("p/one", 1), ("p/two", 0)]) == [1, 0]
    for node in "abc":
        rows = http[node].get("/api/v1/clients", params={"limit": 100}).json()["clients"]
        figures = {r["client_id"]: r["subscriptions"] for r in rows if r["client_id"][:2] == "p-"}
        assert figures == {f"p-{i}": 2 for i in range(6)}, (node, rows)
    assert http["b"].get("/api/v1/clients/p-3").json()["subscriptions"] == 2
    for client in persistent:
        client.disconnect()

    # Any node's counters, through any node (proxied over the admin RPC).
    stats = http["a"].get("/api/v1/nodes/b/stats").json()
    assert stats["node_id"] == "b" and stats["metrics"]["clients_connected"] == 1
    assert set(stats["links"]) == {"a", "c"}

    # Retained: stored on its shard's owner, read and deleted exactly through any node,
    # "plant/../plant/state" included (a browser sends its path form as "plant/state").
    topics = {"plant/state": "on", "plant/../plant/state": "odd"}
    for topic, payload in topics.items():
        http["b"].post("/api/v1/publish", json={"topic": topic, "payload": payload,
                                                "retain": True}).raise_for_status()
        assert sub.get(timeout=10).payload == payload.encode()

    def retained_through(node: str) -> set[str]:
        return {r["topic"] for r in http[node].get("/api/v1/retained").json()["retained"]}

    wait_for(lambda: retained_through("c") == set(topics), 10,
             "the retained messages through c")
    for node in "abc":
        for topic, payload in topics.items():
            one = http[node].get("/api/v1/retained", params={"topic": topic}).json()
            assert (one["topic"], one["payload"]) == (topic, payload), (node, one)
    assert http["c"].delete("/api/v1/retained", params={"topic": "plant/../plant/state"}
                            ).json() == {"deleted": "plant/../plant/state"}
    wait_for(lambda: retained_through("a") == {"plant/state"}, 10,
             "only the odd topic to be gone through a")
    http["c"].delete("/api/v1/retained", params={"topic": "plant/state"}).raise_for_status()
    wait_for(lambda: http["a"].get("/api/v1/retained").json()["retained"] == [], 10,
             "the retained message to be gone through a")

    # Metrics: Raft, quorum and the links to both peers.
    samples = scrape(http["a"])
    assert samples[("mqttring_cluster_quorum", ())] == 1
    assert samples[("mqttring_raft_term", ())] >= 1
    assert samples[("mqttring_cluster_members", (("state", "up"),))] == 3
    for peer in "bc":
        assert samples[("mqttring_link_connected", (("peer", peer),))] == 1
        assert samples[("mqttring_link_sent_bytes_total", (("peer", peer),))] > 0
        # Healthy loopback links never stall, so none was replaced; the window is exported.
        assert samples[("mqttring_link_replaced_connections_total", (("peer", peer),))] == 0
        assert ("mqttring_link_unacked_frames", (("peer", peer),)) in samples
    leader = views["a"]["leader"]
    assert scrape(http[leader])[("mqttring_raft_leader", ())] == 1
    # The shipped Grafana dashboard charts only metrics a cluster node exposes.
    grafana = Path(__file__).resolve().parent.parent / "deploy/grafana/mqttring-dashboard.json"
    charted = set(re.findall(r"\b(?:mqttring|process)_[a-z_]+", grafana.read_text()))
    exposed = {name for name, _ in samples}
    assert charted and charted <= exposed, f"not exposed: {sorted(charted - exposed)}"

    # Kick from c: the connection held by b closes.
    assert http["c"].delete("/api/v1/clients", params={"client": "sub-on-b"}).json() == {
        "kicked": "sub-on-b", "nodes": ["b"]}
    assert sub.disconnected.wait(10), "the kicked client is still connected"
    wait_for(lambda: http["a"].get("/api/v1/clients").json()["clients"] == [], 10,
             "the kicked client to leave the listing")
    assert http["a"].delete("/api/v1/clients/sub-on-b").status_code == 404  # the old form
    assert http["a"].delete("/api/v1/clients", params={"client": "sub-on-b"}
                            ).status_code == 404

    # Quorum lost: with b and c dead, a cannot prove it is in the majority's view any more;
    # the API and the metrics say so, and listings still answer, naming who did not.
    for node in "bc":
        popen = cluster.procs[node].popen
        assert popen is not None
        popen.kill()
        popen.wait(10)
    wait_for(lambda: http["a"].get("/api/v1/cluster").json()["quorum"] is False, 30,
             "a to report that it lost quorum")
    samples = scrape(http["a"])
    assert samples[("mqttring_cluster_quorum", ())] == 0
    listed = http["a"].get("/api/v1/clients").json()
    # Nobody can mark b and c down without a majority: they are asked, and do not answer.
    assert listed["unreachable"] == ["b", "c"], listed
    assert http["a"].get("/api/v1/nodes/b/stats").status_code == 503
