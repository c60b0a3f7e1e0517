"""Cluster scenario: publishers on node 1 of a local 3-node cluster, subscribers on nodes 2, 3.

What it measures (issue 7):

* inter-node messages per publish, from the nodes' own counters (``$SYS/broker/cluster/
  forwarded_to_owner`` + ``deliveries_to_nodes``, summed over nodes) divided by the
  publishes the nodes received from clients; the target is <= 1 + nodes with subscribers;
* CPU seconds of all nodes per delivered message, divided by the same figure for the same
  load on one node (the single node the suite already runs); the target is <= 2x.

Why counters and not a model: a figure here must come from the cluster itself.  If anything
needed is missing (no cluster options, no counters, a cluster that does not deliver across
nodes within the set-up time) the scenario says "not available" or "failed" with the exact
reason and no figure.  Mosquitto and amqtt have no clustering: "not available".

Nodes are started directly with ``python -m mqttring.node`` (the first forms the cluster,
the others ``--join`` it), each with its own temporary directory, and always stopped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import secrets
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from benchmarks import wire
from benchmarks.brokers import BrokerHandle, _spawn, free_port, wait_listening
from benchmarks.loadgen import ProtocolFailure, open_conn, read_frame, subscribe
from benchmarks.scenarios import CpuMeter, Params, WorkerSpec, stream

CLUSTER_FLAGS = ("--join", "--cluster", "--cluster-secret")
COUNTERS = (
    "cluster/forwarded_to_owner",
    "cluster/deliveries_to_nodes",
    "messages/received",
    "messages/sent",
)


def cluster_support(broker: BrokerHandle) -> str | None:
    """None if a local cluster can be started; otherwise why not."""
    if broker.name != "mqttring":
        return f"{broker.name} has no clustering"
    if importlib.util.find_spec("mqttring.node") is None:
        return "mqttring.node does not exist yet"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "mqttring.node", "--help"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`python -m mqttring.node --help` failed: {exc}"
    missing = [f for f in CLUSTER_FLAGS if f not in out.stdout]
    if missing:
        return f"mqttring.node lacks {', '.join(missing)}: no cluster data plane"
    return None


def start_nodes(
    n: int, secret: str, timeout: float = 40.0, sys_interval: float = 0.5
) -> list[BrokerHandle]:
    """Start ``n`` nodes one after another (each joins the first); raise if one fails."""
    nodes: list[BrokerHandle] = []
    first_cluster = ""
    for i in range(1, n + 1):
        h = BrokerHandle(f"node{i}", version="cluster")
        nodes.append(h)
        h.tmpdir = tempfile.mkdtemp(prefix=f"bench-cluster-node{i}-")
        cl = f"127.0.0.1:{free_port()}"
        ready = Path(h.tmpdir) / "ready.json"
        argv = [
            sys.executable,
            "-m",
            "mqttring.node",
            "--node-id",
            f"node{i}",
            "--mqtt",
            "127.0.0.1:0",
            "--cluster",
            cl,
            "--raft",
            f"127.0.0.1:{free_port()}",
            "--cluster-secret",
            secret,
            "--data-dir",
            str(Path(h.tmpdir) / "data"),
            "--sys-interval",
            str(sys_interval),
            "--log-level",
            "warning",
            "--ready-file",
            str(ready),
        ]
        if first_cluster:
            argv += ["--join", first_cluster]
        first_cluster = first_cluster or cl
        _spawn(h, argv)
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if not h.alive() or time.monotonic() > deadline:
                tail = h.stderr_tail().strip()[-400:]
                raise ProtocolFailure(
                    f"node{i} did not become ready" + (f" (stderr: {tail})" if tail else "")
                )
            time.sleep(0.05)
        time.sleep(0.05)  # the file may be being written
        info = json.loads(ready.read_text())
        h.port, h.pid = int(info["mqtt"]), int(info.get("pid", h.pid))
        h.extra["cluster"], h.extra["secret"] = cl, secret
        if not wait_listening(h, 10):
            raise ProtocolFailure(f"node{i} wrote its ready file but does not accept connections")
    return nodes


def wait_settled(node: BrokerHandle, timeout: float = 60.0) -> float:
    """Wait until no shard is catching up any more (joins copy shards for a while after
    formation); measuring before that would bill the copy to the idle cluster."""
    from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key

    key = derive_key(str(node.extra["secret"]), RPC_KEY_PURPOSE)
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        status = trio.run(call_once, str(node.extra["cluster"]), key, "bench", "status", {}, 5.0)
        if not any(catching for _, catching in status["view"]["shards"]):
            return time.monotonic() - start
        time.sleep(0.2)
    raise ProtocolFailure(f"cluster still catching up after {timeout:.0f} s")


def topic_owners(node: BrokerHandle) -> Callable[[str], str | None]:
    """Which node owns a topic's shard, by the cluster's current view (asked once): lets a
    benchmark place its streams' topics instead of leaving the split to the hash."""
    from mqttring.ring.hashing import shard_of
    from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key

    key = derive_key(str(node.extra["secret"]), RPC_KEY_PURPOSE)
    view = trio.run(call_once, str(node.extra["cluster"]), key, "bench", "status", {}, 5.0)["view"]
    shards, count, pins = view["shards"], view["num_shards"], view.get("pins") or {}

    def owner(topic: str) -> str | None:
        levels = topic.split("/")
        for n in range(len(levels), 0, -1):  # a pinned subtree wins (``ClusterView``)
            if (pinned := pins.get("/".join(levels[:n]))) is not None:
                return shards[pinned][0][0] if shards[pinned][0] else None
        replicas = shards[shard_of(topic, count)][0]
        return replicas[0] if replicas else None

    return owner


def read_counters(node: BrokerHandle, timeout: float = 3.0) -> dict[str, int]:
    """The node's retained ``$SYS/broker/...`` values (refreshed every 0.5 s)."""
    sock, buf = open_conn(node.host, node.port, f"bench-sys-{secrets.token_hex(3)}")
    try:
        sock.sendall(wire.subscribe(1, ["$SYS/broker/#"], 0))
        values: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(c in values for c in COUNTERS):
            r, _, _ = select.select([sock], [], [], 0.1)
            if r:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
            while (frame := wire.next_frame(buf, 0, len(buf))) is not None:
                first, body, end = frame
                if first & 0xF0 == wire.PUBLISH:
                    tl = (buf[body] << 8) | buf[body + 1]
                    topic = bytes(buf[body + 2 : body + 2 + tl]).decode()
                    start = body + 2 + tl + (2 if first & 0x06 else 0)
                    key = topic.removeprefix("$SYS/broker/")
                    with contextlib.suppress(ValueError):
                        values[key] = int(bytes(buf[start:end]).split()[0])
                del buf[:end]
        return values
    finally:
        sock.close()


def counters(nodes: list[BrokerHandle]) -> dict[str, int]:
    total = dict.fromkeys(COUNTERS, 0)
    for node in nodes:
        values = read_counters(node)
        missing = [c for c in COUNTERS if c not in values]
        if missing:
            raise ProtocolFailure(f"{node.name} publishes no $SYS/broker/{missing[0]}")
        for c in COUNTERS:
            total[c] += values[c]
    return total


def probe_cross_node(nodes: list[BrokerHandle], topic: str, timeout: float) -> float:
    """Publish on node 1 until subscribers on every other node receive: the cluster works."""
    t0 = time.monotonic()
    subs = []
    for k, node in enumerate(nodes[1:]):
        sock, buf = open_conn(node.host, node.port, f"bench-probe-s{k}-{secrets.token_hex(3)}")
        subscribe(sock, buf, [topic], 0, 10)
        subs.append((sock, buf))
    pub, _ = open_conn(nodes[0].host, nodes[0].port, f"bench-probe-p-{secrets.token_hex(3)}")
    got = [False] * len(subs)
    try:
        while not all(got):
            if time.monotonic() - t0 > timeout:
                raise ProtocolFailure(
                    f"a publish on node1 did not reach subscribers on the other "
                    f"nodes within {timeout:.0f} s (reached: {got})"
                )
            pub.sendall(wire.publish(topic, b"probe"))
            for k, (sock, buf) in enumerate(subs):
                if got[k]:
                    continue
                with contextlib.suppress(ProtocolFailure, TimeoutError):
                    first, _, _ = read_frame(sock, buf, 0.2)
                    got[k] = first & 0xF0 == wire.PUBLISH
        return time.monotonic() - t0
    finally:
        pub.close()
        for sock, _ in subs:
            sock.close()


def _load(
    p: Params,
    pub_node: BrokerHandle,
    sub_nodes: list[BrokerHandle],
    topic: str,
    tag: str,
    meter_on: BrokerHandle,
    spread: int = 0,
) -> dict[str, Any]:
    """Two publishers on ``pub_node``, one subscriber per ``sub_nodes`` entry.

    ``spread=0``: every message on ``topic``.  ``spread=N``: publishers cycle over N topics
    ``topic/<i>`` and subscribers take ``topic/#``, so consecutive messages differ in topic
    (nothing can be grouped by topic) and their shards are owned all over the cluster.
    """
    topics = [f"{topic}/{i}" for i in range(spread)] if spread else [topic]
    sub_filter = f"{topic}/#" if spread else topic
    subs = [
        WorkerSpec(
            role="sub",
            index=0,
            host=n.host,
            port=n.port,
            client_prefix=f"{tag}-s{i}",
            filters=[[sub_filter]],
            payload_size=p.payload,
        )
        for i, n in enumerate(sub_nodes)
    ]
    pub = WorkerSpec(
        role="pub",
        index=0,
        host=pub_node.host,
        port=pub_node.port,
        client_prefix=f"{tag}-p",
        topics=topics,
        payload_size=p.payload,
        batch=32,
        window=2000,
    )
    return stream(meter_on, p, [pub, pub], subs, len(sub_nodes), 0)


#: Topics the second cluster load cycles over (see ``_load``'s ``spread``).
SPREAD_TOPICS = 1000


def _cpu_per_delivery(load: dict[str, Any]) -> float:
    delivered = max(1, load["deliveries_per_s"] * load["cpu"]["elapsed_s"])
    return float(load["cpu"]["broker_s"]) / delivered


def run(broker: BrokerHandle, p: Params, run_id: str) -> dict[str, Any]:
    reason = cluster_support(broker)
    if reason:
        return {"status": "not available", "reason": reason}
    topic = f"bench/{run_id}/cluster"
    nodes: list[BrokerHandle] = []
    loads: dict[str, dict[str, Any]] = {}
    try:
        try:
            nodes = start_nodes(3, secrets.token_hex(8))
            settle_s = wait_settled(nodes[0])
            probe_s = probe_cross_node(nodes, f"bench/{run_id}/probe", p.setup_timeout + 15)
        except (ProtocolFailure, OSError, ValueError) as exc:
            return {"status": "failed", "error": f"cluster set-up: {exc}"}
        whole = BrokerHandle("cluster", pid=nodes[0].pid, extra={"pids": [n.pid for n in nodes]})
        # Background CPU of the idle cluster (Raft heartbeats, pollers, flushers): part of
        # the per-delivery figure below, so it is shown on its own.
        idle_meter = CpuMeter([n.pid for n in nodes], [])
        a = idle_meter.snap()
        time.sleep(1.0)
        idle_cpu = CpuMeter.diff(a, idle_meter.snap())
        before = counters(nodes)
        loads["cluster"] = _load(p, nodes[0], nodes[1:], topic, f"bench-{run_id}-cl", whole)
        time.sleep(1.2)  # $SYS values are refreshed every 0.5 s
        after = counters(nodes)
        loads["single node"] = _load(
            p, broker, [broker, broker], f"{topic}-single", f"bench-{run_id}-sn", broker
        )
        # The same with every consecutive message on another topic (owners all over the
        # cluster): the per-message cost that batching by topic cannot hide.
        before_spread = after
        loads["cluster, spread"] = _load(
            p, nodes[0], nodes[1:], f"{topic}-spread", f"bench-{run_id}-cx", whole,
            spread=SPREAD_TOPICS,
        )
        time.sleep(1.2)
        after_spread = counters(nodes)
        loads["single node, spread"] = _load(
            p, broker, [broker, broker], f"{topic}-single-spread", f"bench-{run_id}-sx", broker,
            spread=SPREAD_TOPICS,
        )
    except (ProtocolFailure, OSError) as exc:
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        for n in nodes:
            n.stop()
    delta = {c: after[c] - before[c] for c in COUNTERS}
    delta_spread = {c: after_spread[c] - before_spread[c] for c in COUNTERS}
    publishes = delta["messages/received"]
    out: dict[str, Any] = {
        "status": "ok",
        "nodes": 3,
        "nodes_with_subscribers": 2,
        "probe_s": round(probe_s, 2),
        "counters_delta": delta,
        "counters_delta_spread": delta_spread,
        "publishes_counted": publishes,
        "settle_s": round(settle_s, 2),
        "idle_cluster_cores": round(idle_cpu["broker_s"] / idle_cpu["elapsed_s"], 3),
        "cluster_load": loads["cluster"],
        "single_node_load": loads["single node"],
        "spread_topics": SPREAD_TOPICS,
        "cluster_load_spread": loads["cluster, spread"],
        "single_node_load_spread": loads["single node, spread"],
    }
    for name, r in loads.items():
        if r.get("status") != "ok":
            out.update(status="failed", error=f"{name} load: {r.get('error')}")
            return out
    if publishes <= 0 or delta_spread["messages/received"] <= 0:
        out.update(status="failed", error="nodes counted no publishes from clients")
        return out

    def inter(d: dict[str, int]) -> float:
        hops = d["cluster/forwarded_to_owner"] + d["cluster/deliveries_to_nodes"]
        return round(hops / d["messages/received"], 3)

    out["internode_per_publish"] = inter(delta)
    out["internode_per_publish_spread"] = inter(delta_spread)
    cpu_c = _cpu_per_delivery(loads["cluster"])
    cpu_s = _cpu_per_delivery(loads["single node"])
    out["cpu_us_per_delivery_cluster"] = round(cpu_c * 1e6, 2)
    out["cpu_us_per_delivery_single"] = round(cpu_s * 1e6, 2)
    out["cpu_ratio_vs_single"] = round(cpu_c / cpu_s, 2) if cpu_s else None
    spread_c = _cpu_per_delivery(loads["cluster, spread"])
    spread_s = _cpu_per_delivery(loads["single node, spread"])
    out["cpu_us_per_delivery_cluster_spread"] = round(spread_c * 1e6, 2)
    out["cpu_us_per_delivery_single_spread"] = round(spread_s * 1e6, 2)
    out["cpu_ratio_vs_single_spread"] = round(spread_c / spread_s, 2) if spread_s else None
    # Diagnostic only (the target uses the ratio above): the same figure with the idle
    # cluster's background CPU taken out, to tell per-message cost from background chatter.
    load = loads["cluster"]
    idle_cpu_s = out["idle_cluster_cores"] * load["cpu"]["elapsed_s"]
    idle_share = idle_cpu_s / max(load["cpu"]["broker_s"], 1e-9)
    out["cpu_us_per_delivery_cluster_minus_idle"] = round(
        max(0.0, 1 - idle_share) * cpu_c * 1e6, 2
    )
    out["deliveries_per_s"] = load["deliveries_per_s"]
    out["single_deliveries_per_s"] = loads["single node"]["deliveries_per_s"]
    out["deliveries_per_s_spread"] = loads["cluster, spread"]["deliveries_per_s"]
    lost = {name: r.get("lost") for name, r in loads.items() if r.get("lost")}
    if lost:
        out["note"] = f"QoS 0 loss: {lost}"
    return out
