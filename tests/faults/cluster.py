"""Real ``mqttring.node`` processes, one per network namespace, driven from the client one.

Each node listens on fixed ports of its own namespace address (MQTT 1883, cluster RPC 7000,
Raft 7001).  Start-up is awaited on the node's ``--ready-file``; a settled cluster is
awaited by polling every node's admin ``status`` RPC with a deadline (the same criterion
as ``tests/cluster_support.NodeCluster.settle``).  ``kill9``/``restart`` keep the data dir,
which is what a crash-and-recover fault needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from mqttring.ring.hashing import shard_of
from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key

from .netns import IP, Topology

MQTT_PORT = 1883
CLUSTER_PORT = 7000
RAFT_PORT = 7001
SECRET = "mqf-secret"


@dataclass(frozen=True)
class View:
    """One node's view as the ``status`` RPC reports it."""

    epoch: int
    leader: str | None
    members: dict[str, str]
    shards: list[list[str]]
    catching_up: list[list[str]]
    num_shards: int

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> View:
        view = status["view"]
        return cls(view["epoch"], view["leader"],
                   {n: m["state"] for n, m in view["members"].items()},
                   [list(r) for r, _ in view["shards"]],
                   [list(c) for _, c in view["shards"]], view["num_shards"])

    def owner_of(self, key: str) -> str:
        return self.shards[shard_of(key, self.num_shards)][0]

    def topic_owned_by(self, node: str, prefix: str, count: int = 1) -> list[str]:
        """``count`` topics ``prefix/<n>`` whose shard ``node`` owns."""
        out = []
        for n in range(20_000):
            topic = f"{prefix}/{n}"
            if self.owner_of(topic) == node:
                out.append(topic)
                if len(out) == count:
                    return out
        raise RuntimeError(f"no topic under {prefix!r} owned by {node}")


@dataclass
class Node:
    name: str
    namespace: str
    address: str
    data_dir: Path
    log_file: Path
    ready_file: Path
    popen: subprocess.Popen[bytes] | None = None
    killed_by_us: bool = False
    starts: int = 0

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def mqtt(self) -> tuple[str, int]:
        return self.address, MQTT_PORT

    @property
    def cluster(self) -> str:
        return f"{self.address}:{CLUSTER_PORT}"


class Cluster:
    """The nodes of one scenario; ``close()`` kills every process it started, by PID."""

    def __init__(self, topology: Topology, root: Path, *, num_shards: int = 64,
                 replication: int = 2, heartbeat: float = 0.5, grace: float = 5.0,
                 node_names: list[str] | None = None) -> None:
        self.topology = topology
        self.root = root
        self.num_shards = num_shards
        self.replication = replication
        self.heartbeat = heartbeat
        self.grace = grace
        self.key = derive_key(SECRET, RPC_KEY_PURPOSE)
        self.nodes: dict[str, Node] = {}
        self.unexpected_exits: list[dict[str, Any]] = []
        for name in node_names or topology.nodes:
            self.nodes[name] = Node(name, topology.namespaces[name], topology.addresses[name],
                                    root / name, root / f"{name}.log", root / f"{name}.ready")

    # ------------------------------------------------------------------ processes

    def start(self, name: str, join: str | None = None) -> None:
        node = self.nodes[name]
        assert not node.alive, f"{name} already running"
        node.data_dir.mkdir(parents=True, exist_ok=True)
        node.ready_file.unlink(missing_ok=True)
        toml = self.root / f"{name}.toml"
        toml.write_text(f"heartbeat_interval = {self.heartbeat}\nfailure_grace = {self.grace}\n")
        cmd = [IP, "netns", "exec", node.namespace, sys.executable, "-m", "mqttring.node",
               "--node-id", name, "--mqtt", f"{node.address}:{MQTT_PORT}",
               "--cluster", node.cluster, "--raft", f"{node.address}:{RAFT_PORT}",
               "--data-dir", str(node.data_dir), "--cluster-secret", SECRET,
               "--num-shards", str(self.num_shards), "--replication", str(self.replication),
               "--ready-file", str(node.ready_file), "--config", str(toml),
               "--log-level", "info"]
        if join:
            cmd += ["--join", join]
        node.starts += 1
        node.killed_by_us = False
        with node.log_file.open("ab") as log:
            log.write(f"\n==== {time.strftime('%H:%M:%S')} start {node.starts}: "
                      f"{' '.join(cmd)}\n".encode())
            log.flush()
            # ``ip netns exec`` execs the command: the PID is the node's own.
            node.popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def wait_ready(self, name: str, timeout: float = 40.0) -> float:
        """Wait for the ready file (bounded); returns seconds waited."""
        node = self.nodes[name]
        t0 = time.monotonic()
        while True:
            if node.ready_file.exists():
                with contextlib.suppress(json.JSONDecodeError, OSError):
                    json.loads(node.ready_file.read_text())
                    return time.monotonic() - t0
            if not node.alive:
                raise RuntimeError(f"{name} exited before ready:\n{self.tail(name)}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{name} not ready in {timeout}s:\n{self.tail(name)}")
            time.sleep(0.05)

    def form(self, names: list[str] | None = None) -> None:
        """First node alone, then each other node joins through it, one at a time (``names``:
        those of the cluster's nodes to form with, all by default)."""
        names = names or list(self.nodes)
        first = self.nodes[names[0]]
        self.start(first.name)
        self.wait_ready(first.name)
        for name in names[1:]:
            self.start(name, join=first.cluster)
            self.wait_ready(name)

    def kill9(self, name: str) -> None:
        node = self.nodes[name]
        if node.alive:
            assert node.popen is not None
            node.killed_by_us = True
            node.popen.send_signal(signal.SIGKILL)
            node.popen.wait(10)

    def terminate(self, name: str, timeout: float = 60.0) -> float:
        """SIGTERM (a graceful leave) and wait for the process to exit by itself (bounded;
        killed past it, and the exit then counts as unexpected). Returns seconds waited."""
        node = self.nodes[name]
        assert node.popen is not None and node.alive, f"{name} not running"
        t0 = time.monotonic()
        node.popen.send_signal(signal.SIGTERM)
        try:
            rc = node.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            node.popen.kill()
            node.popen.wait(10)
            return time.monotonic() - t0
        node.killed_by_us = rc == 0  # a leave that ends in an error exit is a crash
        return time.monotonic() - t0

    def restart(self, name: str) -> None:
        """Start again on the same data dir, joining through any live member."""
        via = next((n for n in self.nodes.values() if n.name != name and n.alive), None)
        self.start(name, join=via.cluster if via else None)

    def check_exits(self) -> None:
        """Record node processes that died without us killing them."""
        for node in self.nodes.values():
            if node.popen is not None and node.popen.poll() is not None \
                    and not node.killed_by_us:
                entry = {"node": node.name, "rc": node.popen.returncode, "start": node.starts}
                if entry not in self.unexpected_exits:
                    self.unexpected_exits.append(entry)

    def close(self) -> None:
        for node in self.nodes.values():
            if node.alive:
                assert node.popen is not None
                node.killed_by_us = True
                node.popen.kill()
        for node in self.nodes.values():
            if node.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.popen.wait(10)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.nodes[name].log_file
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def tracebacks(self) -> dict[str, int]:
        out = {}
        for name, node in self.nodes.items():
            text = node.log_file.read_text(errors="replace") if node.log_file.exists() else ""
            count = text.count("Traceback")
            if count:
                out[name] = count
        return out

    # ------------------------------------------------------------------ admin RPC

    def status(self, name: str, timeout: float = 2.0) -> dict[str, Any]:
        node = self.nodes[name]

        async def call() -> dict[str, Any]:
            return await call_once(node.cluster, self.key, "faults", "status", {},
                                   timeout=timeout)

        return trio.run(call)

    def view(self, name: str, timeout: float = 2.0) -> View:
        return View.from_status(self.status(name, timeout))

    def settle(self, names: list[str] | None = None, timeout: float = 30.0) -> View:
        """All ``names`` up, same epoch/leader/shard map, nothing catching up (bounded)."""
        names = sorted(names or self.nodes)
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                views = [self.view(n) for n in names]
            except Exception as exc:  # a node restarting, an RPC timing out: poll again
                last = exc
                time.sleep(0.2)
                continue
            last = views[0]
            first = views[0]
            if (all({n for n, s in v.members.items() if s == "up"} == set(names)
                    for v in views)
                    and len({(v.epoch, v.leader) for v in views}) == 1
                    and first.leader in names
                    and all(v.shards == first.shards for v in views)
                    and not any(first.catching_up)
                    and all(s and s[0] in names for s in first.shards)):
                return first
            time.sleep(0.2)
        raise RuntimeError(f"cluster {names} did not settle in {timeout}s; last: {last!r}")

    def raft_terms(self) -> dict[str, int]:
        """Each live node's Raft term (nodes that do not answer are left out): how many
        elections a fault caused, for the report."""
        terms: dict[str, int] = {}
        for name, node in self.nodes.items():
            if node.alive:
                with contextlib.suppress(Exception):
                    terms[name] = int(self.status(name)["raft"]["term"])
        return terms

    def leader(self, timeout: float = 10.0) -> str:
        """The node whose own status says it is the Raft leader (bounded polling)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, node in self.nodes.items():
                if not node.alive:
                    continue
                with contextlib.suppress(Exception):
                    if self.status(name).get("raft", {}).get("is_leader"):
                        return name
            time.sleep(0.2)
        raise RuntimeError("no Raft leader reported")
