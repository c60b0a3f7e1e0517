"""Support for the cluster data-plane tests: real node processes, real clients, bounded waits.

What is here and why:

* ``NodeCluster``: ``LocalCluster(entry="node")`` whose nodes also publish ``$SYS`` every
  ``sys_interval`` seconds (the counters the one-hop test reads), with a synchronous API
  (``form``, ``ready``, ``status``, ``settle``) so that tests are plain functions that drive
  threaded paho clients without an event loop of their own.  ``close()`` kills everything.
* ``ViewInfo``: the settled view as a node reports it over the admin RPC, with the owner of a
  topic's shard and the home of a client id, so that tests can choose topics and client ids
  that exercise each placement (owned by the edge, by a third node, ...).
* ``Client``: a paho-mqtt 3.1.1 client whose every wait is bounded, recording what arrives
  as ``Delivery`` tuples.  ``Clients`` closes all of them at teardown.
* ``read_counters``: a node's own ``$SYS`` counters, read from a value published *after*
  the call started (so never a stale retained copy).
* ``mosquitto_sub`` / ``mosquitto_pub``: the mosquitto command-line clients as processes.

The tests call the nodes only through MQTT, the admin ``status`` RPC and their logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import paho.mqtt.client as mqtt
import pytest
import trio

from mqttring.raft.localcluster import LocalCluster, Proc
from mqttring.ring.hashing import shard_of

HOST = "127.0.0.1"
WAIT = 5.0  # "this must arrive" on a settled cluster
SYS_INTERVAL = 0.5
NUM_SHARDS = 64


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class ViewInfo:
    """One node's settled view: members, leader, and the shard map (owner first)."""

    epoch: int
    leader: str | None
    members: dict[str, str]  # node -> state
    shards: list[list[str]]  # per shard: replicas, owner first
    catching_up: list[list[str]]
    num_shards: int

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> ViewInfo:
        view = status["view"]
        return cls(
            epoch=view["epoch"],
            leader=view["leader"],
            members={n: m["state"] for n, m in view["members"].items()},
            shards=[list(replicas) for replicas, _ in view["shards"]],
            catching_up=[list(catching) for _, catching in view["shards"]],
            num_shards=view["num_shards"],
        )

    def up(self) -> set[str]:
        return {n for n, state in self.members.items() if state == "up"}

    def owner_of_topic(self, topic: str) -> str:
        return self.shards[shard_of(topic, self.num_shards)][0]

    def replicas_of_topic(self, topic: str) -> list[str]:
        return self.shards[shard_of(topic, self.num_shards)]

    def home_of(self, client_id: str) -> str:
        return self.shards[shard_of(client_id, self.num_shards)][0]

    def replicas_of_client(self, client_id: str) -> list[str]:
        return self.shards[shard_of(client_id, self.num_shards)]

    def topic_owned_by(self, node: str, prefix: str, avoid: Iterable[str] = ()) -> str:
        """A fresh topic ``prefix/<n>`` whose shard ``node`` owns."""
        avoid = set(avoid)
        for n in range(10_000):
            topic = f"{prefix}/{n}"
            if topic not in avoid and self.owner_of_topic(topic) == node:
                return topic
        raise AssertionError(f"no topic under {prefix!r} owned by {node}")

    def client_homed_at(self, node: str, prefix: str, avoid: Iterable[str] = ()) -> str:
        avoid = set(avoid)
        for n in range(10_000):
            client_id = f"{prefix}-{n}"
            if client_id not in avoid and self.home_of(client_id) == node:
                return client_id
        raise AssertionError(f"no client id under {prefix!r} homed at {node}")


class NodeCluster(LocalCluster):
    """Full ``mqttring.node`` processes on loopback, driven synchronously."""

    # grace 4 s: a node fences itself (fence_after = grace - heartbeat, proofs dated
    # grace/4 back) about 2.8 s after its last answered heartbeat, which must comfortably
    # outlast a Raft election (0.4-0.8 s, more on a loaded 2-core runner) when the leader
    # is killed, or every survivor would drop its clients during an ordinary failover
    # (with 3 s, 2 s of slack was once not enough under the full suite's load).
    def __init__(self, root: Path, *, num_shards: int = NUM_SHARDS, replication: int = 2,
                 heartbeat: float = 0.2, grace: float = 4.0,
                 sys_interval: float = SYS_INTERVAL, secret: str = "test-secret") -> None:
        super().__init__(root, secret, num_shards=num_shards, replication=replication,
                         heartbeat=heartbeat, grace=grace, entry="node")
        self.sys_interval = sys_interval
        self.log_level = "info"
        self.ports: dict[str, int] = {}
        #: More ``mqttring.node`` flags for every node started from now on.
        self.extra_args: list[str] = []
        #: More TOML lines for every node (``acl_file = "..."``, ...).
        self.extra_toml = ""
        #: More TOML lines for one node only, by node id (its cluster TLS files, say).
        self.node_toml: dict[str, str] = {}

    # LocalCluster.start with ``sys_interval`` in the TOML and a log level for diagnosis.
    def start(self, node_id: str, join: str | None = None, *, secret: str | None = None,
              manual_catch_up: bool = False) -> Proc:
        proc = self.procs.get(node_id)
        if proc is None:
            from mqttring.raft.localcluster import free_port

            data_dir = self.root / node_id
            data_dir.mkdir(parents=True, exist_ok=True)
            proc = Proc(node_id, f"{HOST}:{free_port()}", f"{HOST}:{free_port()}",
                        data_dir, self.root / f"{node_id}.ready", self.root / f"{node_id}.log")
            self.procs[node_id] = proc
        assert not proc.alive, f"{node_id} already running"
        proc.ready_file.unlink(missing_ok=True)
        toml = self.root / f"{node_id}.toml"
        toml.write_text(f"heartbeat_interval = {self.heartbeat}\n"
                        f"failure_grace = {self.grace}\n"
                        f"sys_interval = {self.sys_interval}\n" + self.extra_toml
                        + self.node_toml.get(node_id, ""))
        cmd = [sys.executable, "-m", "mqttring.node", "--node-id", node_id,
               "--cluster", proc.cluster, "--raft", proc.raft,
               "--data-dir", str(proc.data_dir), "--ready-file", str(proc.ready_file),
               "--num-shards", str(self.num_shards), "--replication", str(self.replication),
               "--mqtt", f"{HOST}:0", "--config", str(toml),
               "--cluster-secret", secret or self.secret, "--log-level", self.log_level]
        if join:
            cmd += ["--join", join]
        cmd += self.extra_args
        with proc.log_file.open("ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start {' '.join(cmd)}\n".encode())
            log.flush()
            proc.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ports.pop(node_id, None)
        return proc

    def ready(self, node_id: str, timeout: float = 30.0) -> int:
        """Wait for the node's ready file; returns its MQTT port."""
        proc = self.procs[node_id]
        deadline = time.monotonic() + timeout
        while True:
            if proc.ready_file.exists():
                with contextlib.suppress(json.JSONDecodeError):
                    info = json.loads(proc.ready_file.read_text())
                    self.ports[node_id] = int(info["mqtt"])
                    return self.ports[node_id]
            if not proc.alive:
                raise AssertionError(f"{node_id} exited before ready:\n{self.tail(node_id)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{node_id} not ready in {timeout}s:\n{self.tail(node_id)}")
            time.sleep(0.05)

    def form_sync(self, *node_ids: str) -> None:
        first = node_ids[0]
        self.start(first)
        self.ready(first)
        for node_id in node_ids[1:]:
            self.start(node_id, join=self.procs[first].cluster)
            self.ready(node_id)

    def restart(self, node_id: str, via: str) -> int:
        self.start(node_id, join=self.procs[via].cluster)
        return self.ready(node_id)

    def port(self, node_id: str) -> int:
        return self.ports[node_id]

    def status_sync(self, node_id: str, timeout: float = 3.0) -> dict[str, Any]:
        return trio.run(lambda: self.status(node_id, timeout))

    def view(self, node_id: str) -> ViewInfo:
        return ViewInfo.from_status(self.status_sync(node_id))

    def settle(self, nodes: Iterable[str], timeout: float = 30.0) -> ViewInfo:
        """Every node in ``nodes`` is up, reports the same epoch, leader and shard map, and
        nothing is catching up; returns that view."""
        nodes = sorted(nodes)
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                views = [self.view(n) for n in nodes]
            except Exception as exc:  # a node still starting or an RPC timing out: retry
                last = exc
                time.sleep(0.1)
                continue
            last = views
            first = views[0]
            if (all(v.up() == set(nodes) and set(v.members) >= set(nodes) for v in views)
                    and len({(v.epoch, v.leader) for v in views}) == 1
                    and first.leader in nodes
                    and all(v.shards == first.shards for v in views)
                    and not any(c for c in first.catching_up)
                    and all(s and s[0] in nodes for s in first.shards)):
                return first
            time.sleep(0.1)
        raise AssertionError(f"cluster {nodes} did not settle in {timeout}s; last: {last!r}")

    def wait_view(self, node_id: str, predicate: Callable[[ViewInfo], bool],
                  timeout: float = 15.0) -> ViewInfo:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.view(node_id)
                if predicate(last):
                    return last
            except Exception as exc:
                last = exc
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting on {node_id}'s view; last: {last!r}")

    def log(self, node_id: str) -> str:
        path = self.procs[node_id].log_file
        return path.read_text(errors="replace") if path.exists() else ""

    def grep(self, node_id: str, *needles: str, limit: int = 20) -> list[str]:
        lines = [line for line in self.log(node_id).splitlines()
                 if any(n in line for n in needles)]
        return lines[-limit:]

    def logs_of_interest(self, nodes: Iterable[str] | None = None, limit: int = 15) -> str:
        """Warnings, errors and tracebacks of every node, for assertion messages."""
        out = []
        for node in sorted(nodes or self.procs):
            lines = self.grep(node, "WARNING", "ERROR", "Traceback", "Error", "refused",
                              "takeover", "took over", "caught up", limit=limit)
            out.append(f"--- {node}:\n" + "\n".join(lines))
        return "\n".join(out)

    def sigterm(self, node_id: str, timeout: float = 40.0) -> int:
        proc = self.procs[node_id]
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGTERM)
        try:
            return proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(5)
            raise AssertionError(f"{node_id} ignored SIGTERM for {timeout}s:\n"
                                 f"{self.tail(node_id)}") from None


def start_cluster(root: Path, nodes: Iterable[str] = ("a", "b", "c"), *,
                  extra_toml: str = "", **kwargs: Any) -> NodeCluster:
    """A formed, settled cluster; ``extra_toml``: more TOML lines for every node."""
    cluster = NodeCluster(root, **kwargs)
    cluster.extra_toml = extra_toml
    try:
        cluster.form_sync(*nodes)
        cluster.settle(nodes)
    except BaseException:
        cluster.close()
        raise
    return cluster


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[Callable[..., NodeCluster]]:
    """``make(nodes=("a","b","c"), **kwargs) -> NodeCluster`` (settled); killed at teardown."""
    made: list[NodeCluster] = []

    def make(nodes: Iterable[str] = ("a", "b", "c"), **kwargs: Any) -> NodeCluster:
        root = tmp_path / f"cluster{len(made)}"
        root.mkdir()
        cluster = NodeCluster(root, **kwargs)
        made.append(cluster)
        cluster.form_sync(*nodes)
        cluster.settle(nodes)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


# --------------------------------------------------------------------------- clients


class Delivery(NamedTuple):
    topic: str
    payload: bytes
    qos: int
    retain: bool


class ConnectRefused(Exception):
    """No CONNACK 0 within the bound (refused, closed, or unreachable)."""


class Client:
    """One paho-mqtt 3.1.1 connection with bounded waits; records every PUBLISH received.

    A ``Client`` is one connection: to reconnect, make a new one (``Clients.make``) and, to
    keep one log of deliveries per client id, pass the same ``inbox``.
    """

    def __init__(self, port: int, client_id: str = "", clean_session: bool = True,
                 inbox: queue.Queue[Delivery] | None = None, name: str = "") -> None:
        self.port = port
        self.client_id = client_id
        self.name = name or client_id or "anon"
        self.paho = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
            clean_session=clean_session, protocol=mqtt.MQTTv311, reconnect_on_failure=False,
        )
        self.paho.max_inflight_messages_set(1000)
        self.inbox: queue.Queue[Delivery] = inbox if inbox is not None else queue.Queue()
        self.connacks: queue.Queue[tuple[bool, int]] = queue.Queue()
        self.subacks: queue.Queue[tuple[int, list[int]]] = queue.Queue()
        self.unsubacks: queue.Queue[int] = queue.Queue()
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.looping = False
        self.paho.on_connect = self._on_connect
        self.paho.on_message = self._on_message
        self.paho.on_subscribe = self._on_subscribe
        self.paho.on_unsubscribe = self._on_unsubscribe
        self.paho.on_disconnect = self._on_disconnect

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connacks.put((bool(flags.session_present), int(reason_code.value)))
        if int(reason_code.value) == 0:
            self.connected.set()

    def _on_message(self, client, userdata, msg) -> None:
        self.inbox.put(Delivery(msg.topic, bytes(msg.payload), int(msg.qos), bool(msg.retain)))

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.subacks.put((mid, [int(rc.value) for rc in reason_codes]))

    def _on_unsubscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.unsubacks.put(mid)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        self.disconnected.set()

    # -- connection -----------------------------------------------------------------------

    def start_connect(self, keepalive: int = 30,
                      will: tuple[str, bytes, int, bool] | None = None) -> None:
        """Send CONNECT and return at once (for races); ``wait_connack`` completes it."""
        if will is not None:
            topic, payload, qos, retain = will
            self.paho.will_set(topic, payload, qos, retain)
        self.disconnected.clear()
        try:
            self.paho.connect(HOST, self.port, keepalive)
        except OSError as exc:
            raise ConnectRefused(f"{self.name}: {exc}") from None
        self.paho.loop_start()
        self.looping = True

    def wait_connack(self, timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                present, rc = self.connacks.get(timeout=max(min(remaining, 0.05), 0))
            except queue.Empty:
                if self.disconnected.is_set():
                    raise ConnectRefused(f"{self.name}: closed before CONNACK") from None
                if remaining <= 0:
                    raise ConnectRefused(f"{self.name}: no CONNACK in {timeout}s") from None
                continue
            if rc != 0:
                raise ConnectRefused(f"{self.name}: CONNACK return code {rc}")
            return present

    def connect(self, keepalive: int = 30, will: tuple[str, bytes, int, bool] | None = None,
                timeout: float = WAIT) -> bool:
        """Connect and return session-present; raises ``ConnectRefused``."""
        self.start_connect(keepalive, will)
        try:
            return self.wait_connack(timeout)
        except ConnectRefused:
            self.close()
            raise

    def disconnect(self) -> None:
        """A clean DISCONNECT, waited for (the broker then discards the will)."""
        if self.looping:
            self.paho.disconnect()
            self.disconnected.wait(WAIT)
            self.paho.loop_stop()
            self.looping = False

    def close(self) -> None:
        """Drop the TCP connection without DISCONNECT if it is still open (a will is owed).

        paho's ``loop_stop`` may sit in its 1 s select; it is left to finish in the
        background instead of slowing every teardown down.
        """
        if self.looping:
            self.looping = False
            with contextlib.suppress(Exception):
                sock = self.paho.socket()
                if sock is not None:
                    sock.close()
            threading.Thread(target=self.paho.loop_stop, daemon=True).start()

    @property
    def live(self) -> bool:
        return self.connected.is_set() and not self.disconnected.is_set()

    # -- operations -----------------------------------------------------------------------

    def subscribe(self, topic: str | list[tuple[str, int]], qos: int = 0,
                  timeout: float = WAIT) -> list[int]:
        if isinstance(topic, str):
            result, mid = self.paho.subscribe(topic, qos)
        else:
            result, mid = self.paho.subscribe(topic)
        assert result == 0, f"{self.name}: paho could not send SUBSCRIBE ({result})"
        deadline = time.monotonic() + timeout
        while True:
            try:
                got, codes = self.subacks.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no SUBACK for {topic!r} in {timeout}s"
                                     ) from None
            if got == mid:
                return codes

    def unsubscribe(self, topic: str, timeout: float = WAIT) -> None:
        result, mid = self.paho.unsubscribe(topic)
        assert result == 0
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.unsubacks.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"{self.name}: no UNSUBACK for {topic!r} in {timeout}s"
                                     ) from None
            if got == mid:
                return

    def publish(self, topic: str, payload: bytes | str = b"", qos: int = 0,
                retain: bool = False, timeout: float = WAIT) -> None:
        """Publish and wait until the QoS flow completed (PUBACK / PUBCOMP)."""
        info = self.paho.publish(topic, payload, qos, retain)
        if qos:
            with contextlib.suppress(RuntimeError, ValueError):
                info.wait_for_publish(timeout=timeout)
            assert info.is_published(), (
                f"{self.name}: QoS {qos} publish to {topic!r} not acknowledged in {timeout}s")
        else:
            assert info.rc == 0, f"{self.name}: publish to {topic!r} not sent ({info.rc})"

    def publish_nowait(self, topic: str, payload: bytes | str = b"", qos: int = 0,
                       retain: bool = False) -> mqtt.MQTTMessageInfo:
        return self.paho.publish(topic, payload, qos, retain)

    def ack_within(self, info: mqtt.MQTTMessageInfo, timeout: float) -> bool:
        """Whether the broker acknowledged ``info`` within ``timeout`` seconds."""
        with contextlib.suppress(RuntimeError, ValueError):
            info.wait_for_publish(timeout=timeout)
        return info.is_published()

    # -- receiving ------------------------------------------------------------------------

    def collect(self, count: int, timeout: float = WAIT) -> list[Delivery]:
        """Exactly ``count`` deliveries within ``timeout`` (fails if fewer arrive)."""
        deadline = time.monotonic() + timeout
        got: list[Delivery] = []
        while len(got) < count:
            try:
                got.append(self.inbox.get(timeout=max(deadline - time.monotonic(), 0)))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: only {len(got)} of {count} deliveries in {timeout}s: "
                    f"{[(d.topic, d.payload[:30]) for d in got][:20]}") from None
        return got

    def drain(self, seconds: float) -> list[Delivery]:
        """Everything arriving within ``seconds`` (to prove something does NOT arrive)."""
        deadline = time.monotonic() + seconds
        got: list[Delivery] = []
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                got.append(self.inbox.get(timeout=remaining))
            except queue.Empty:
                break
        return got

    def pending(self) -> list[Delivery]:
        """What has arrived and not been read yet, without waiting."""
        got: list[Delivery] = []
        with contextlib.suppress(queue.Empty):
            while True:
                got.append(self.inbox.get_nowait())
        return got

    def until(self, predicate: Callable[[list[Delivery]], bool], timeout: float = WAIT,
              quiet: float = 0.0) -> list[Delivery]:
        """Collect until ``predicate(everything so far)`` holds (then ``quiet`` seconds more
        to catch extras) or ``timeout`` passes; returns everything collected."""
        deadline = time.monotonic() + timeout
        got: list[Delivery] = []
        while not predicate(got):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return got
            with contextlib.suppress(queue.Empty):
                got.append(self.inbox.get(timeout=min(remaining, 0.1)))
        return got + self.drain(quiet)


class Clients:
    """Factory of ``Client``s; all closed at teardown."""

    def __init__(self) -> None:
        self.made: list[Client] = []

    def make(self, port: int, client_id: str = "", clean_session: bool = True,
             inbox: queue.Queue[Delivery] | None = None, name: str = "") -> Client:
        client = Client(port, client_id, clean_session, inbox, name)
        self.made.append(client)
        return client

    def connected(self, port: int, client_id: str = "", clean_session: bool = True,
                  **kwargs: Any) -> Client:
        client = self.make(port, client_id, clean_session, **kwargs)
        client.connect()
        return client

    def close(self) -> None:
        """Teardown: a clean DISCONNECT for live clients (fast), a dropped socket otherwise."""
        for client in self.made:
            if client.live:
                with contextlib.suppress(Exception):
                    client.disconnect()
            client.close()


@pytest.fixture
def clients() -> Iterator[Clients]:
    made = Clients()
    yield made
    made.close()


def connect_with_retry(clients: Clients, port_of: Callable[[], int], client_id: str,
                       clean_session: bool, inbox: queue.Queue[Delivery] | None = None,
                       timeout: float = 20.0) -> tuple[Client, bool]:
    """Connect until CONNACK 0 (a node may refuse while the view changes after a fault)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        client = clients.make(port_of(), client_id, clean_session, inbox)
        try:
            present = client.connect(timeout=min(WAIT, max(deadline - time.monotonic(), 0.5)))
        except ConnectRefused as exc:
            last = exc
            time.sleep(0.2)
            continue
        return client, present
    raise AssertionError(f"{client_id}: could not connect in {timeout}s: {last}")


# --------------------------------------------------------------------------- counters

COUNTERS = {
    "$SYS/broker/cluster/forwarded_to_owner": "forwarded_to_owner",
    "$SYS/broker/cluster/deliveries_to_nodes": "deliveries_to_nodes",
    "$SYS/broker/messages/received": "messages_received",
    "$SYS/broker/messages/sent": "messages_sent",
    "$SYS/broker/clients/connected": "clients_connected",
}


def read_counters(port: int, timeout: float = 5.0) -> dict[str, int]:
    """The node's counters as published on its own ``$SYS`` after this call started.

    The retained copies a subscriber gets at once may be up to one interval old, so only
    live updates (RETAIN=0, published after the SUBACK) count.
    """
    client = Client(port, name=f"counters@{port}")
    try:
        client.connect()
        client.subscribe([(topic, 0) for topic in COUNTERS])
        values: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while len(values) < len(COUNTERS):
            try:
                d = client.inbox.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                raise AssertionError(f"no fresh $SYS counters from port {port} in {timeout}s; "
                                     f"got {values}") from None
            if not d.retain:
                values[COUNTERS[d.topic]] = int(d.payload)
        return values
    finally:
        client.disconnect()


# --------------------------------------------------------------------------- mosquitto CLI


class MosquittoSub:
    """``mosquitto_sub -v`` as a process; its output lines arrive on a queue (bounded reads)."""

    def __init__(self, port: int, topics: list[str], qos: int = 0, count: int | None = None,
                 client_id: str | None = None, clean: bool = True, timeout: int = 20) -> None:
        cmd = ["mosquitto_sub", "-h", HOST, "-p", str(port), "-V", "mqttv311", "-q", str(qos),
               "-W", str(timeout), "-F", "%t %q %r %p"]
        for topic in topics:
            cmd += ["-t", topic]
        if count is not None:
            cmd += ["-C", str(count)]
        if client_id:
            cmd += ["-i", client_id]
        if not clean:
            cmd.append("-c")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))

    def line(self, timeout: float = WAIT) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"mosquitto_sub printed nothing in {timeout}s") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.thread.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def mosquitto_pub(port: int, topic: str, payload: str, qos: int = 0, retain: bool = False,
                  client_id: str | None = None, timeout: float = 10.0) -> None:
    cmd = ["mosquitto_pub", "-h", HOST, "-p", str(port), "-V", "mqttv311", "-t", topic,
           "-m", payload, "-q", str(qos)]
    if retain:
        cmd.append("-r")
    if client_id:
        cmd += ["-i", client_id]
    done = subprocess.run(cmd, capture_output=True, timeout=timeout)
    assert done.returncode == 0, f"mosquitto_pub failed: {done.stderr.decode()}"


__all__ = [
    "HOST",
    "NUM_SHARDS",
    "SYS_INTERVAL",
    "WAIT",
    "Client",
    "Clients",
    "ConnectRefused",
    "Delivery",
    "MosquittoSub",
    "NodeCluster",
    "ViewInfo",
    "clients",
    "connect_with_retry",
    "fresh_cluster",
    "mosquitto_pub",
    "read_counters",
    "start_cluster",
    "unique",
]
