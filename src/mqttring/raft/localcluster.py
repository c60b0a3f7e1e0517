"""Metadata-only members as real processes on loopback, for tests and benchmarks.

Each member is ``python -m mqttring.raft.member`` (or, with ``entry="node"``, the full
``mqttring.node``) in its own process with its own data dir.  A member keeps its ports
across restarts (Raft identifies nodes by address).  ``close()`` kills everything started;
tests call it from a finalizer so that no process outlives a failed test.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key

#: The lowest port ``free_port`` hands out (below it: well-known and registered services).
_PORTS_FROM = 10000


def _ephemeral_low() -> int:
    """The bottom of the kernel's range for outgoing connections' ports (Linux: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_next_port: list[int] = []


def free_port() -> int:
    """A loopback port nothing listens on now, for a process started later to bind.

    Not the kernel's pick (bind to 0): that port is in the range the kernel also gives
    outgoing connections, and one of those (any test's client, on two pytest workers)
    could take it before the process started later binds it, which failed a suite run
    now and then.  Ports below that range are never taken that way; each process walks
    them from its own random start, so two processes asking at once hand out different
    ones unless their walks meet.
    """
    low = _ephemeral_low()
    span = max(low - _PORTS_FROM, 1)
    if not _next_port:
        _next_port.append(random.randrange(span))
    for _ in range(span):
        port = _PORTS_FROM + _next_port[0] % span
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every port below the range is taken: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_base_port(offsets: tuple[int, ...] = (0, 1, 2, 10, 11, 12)) -> int:
    """A base port with ``base + offset`` free right now for every offset (a dev cluster's
    ports: ``mqttring.devcluster`` numbers its nodes' ports from one base)."""
    for _ in range(50):
        base = free_port() // 10 * 10
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise OSError("no free port range")


@dataclass
class Proc:
    node_id: str
    cluster: str
    raft: str
    data_dir: Path
    ready_file: Path
    log_file: Path
    popen: subprocess.Popen[bytes] | None = None
    extra: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class LocalCluster:
    def __init__(self, root: Path, secret: str = "test-secret", *, num_shards: int = 256,
                 replication: int = 2, heartbeat: float = 0.2, grace: float = 1.5,
                 entry: str = "member") -> None:
        if entry not in ("member", "node"):
            raise ValueError("entry is 'member' (metadata only) or 'node' (mqttring.node)")
        self.entry = entry
        self.root = root
        self.secret = secret
        self.num_shards = num_shards
        self.replication = replication
        self.heartbeat = heartbeat
        self.grace = grace
        self.procs: dict[str, Proc] = {}
        self.key = derive_key(secret, RPC_KEY_PURPOSE)
        #: Client context for a cluster that speaks TLS (``mqttring.cluster_tls``).
        self.tls: ssl.SSLContext | None = None

    def start(self, node_id: str, join: str | None = None, *, secret: str | None = None,
              manual_catch_up: bool = False) -> Proc:
        proc = self.procs.get(node_id)
        if proc is None:
            data_dir = self.root / node_id
            data_dir.mkdir(parents=True, exist_ok=True)
            proc = Proc(node_id, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}",
                        data_dir, self.root / f"{node_id}.ready", self.root / f"{node_id}.log")
            self.procs[node_id] = proc
        assert not proc.alive, f"{node_id} already running"
        proc.ready_file.unlink(missing_ok=True)
        common = ["--node-id", node_id, "--cluster", proc.cluster, "--raft", proc.raft,
                  "--data-dir", str(proc.data_dir), "--ready-file", str(proc.ready_file),
                  "--num-shards", str(self.num_shards), "--replication", str(self.replication)]
        if join:
            common += ["--join", join]
        if self.entry == "node":
            # The full node: timings come from a TOML file, the secret from its own flag.
            toml = self.root / f"{node_id}.toml"
            toml.write_text(f"heartbeat_interval = {self.heartbeat}\n"
                            f"failure_grace = {self.grace}\n")
            cmd = [sys.executable, "-m", "mqttring.node", *common, "--mqtt", "127.0.0.1:0",
                   "--config", str(toml), "--cluster-secret", secret or self.secret]
        else:
            cmd = [sys.executable, "-m", "mqttring.raft.member", *common,
                   "--secret", secret or self.secret,
                   "--heartbeat-interval", str(self.heartbeat),
                   "--failure-grace", str(self.grace)]
            if manual_catch_up:
                cmd.append("--manual-catch-up")
        log = proc.log_file.open("ab")
        proc.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        return proc

    async def wait_ready(self, node_id: str, timeout: float = 20.0) -> dict[str, Any]:
        proc = self.procs[node_id]
        with trio.fail_after(timeout):
            while not proc.ready_file.exists():
                if not proc.alive:
                    raise RuntimeError(f"{node_id} exited: {self.tail(node_id)}")
                await trio.sleep(0.05)
        return dict(json.loads(proc.ready_file.read_text()))

    async def form(self, *node_ids: str) -> None:
        """Start the first node alone, then join the others one by one through it."""
        first = node_ids[0]
        self.start(first)
        await self.wait_ready(first)
        for node_id in node_ids[1:]:
            self.start(node_id, join=self.procs[first].cluster)
            await self.wait_ready(node_id)

    async def status(self, node_id: str, timeout: float = 3.0,
                     brief: bool = False) -> dict[str, Any]:
        return await call_once(self.procs[node_id].cluster, self.key, "test", "status",
                               {"brief": brief}, timeout=timeout, tls=self.tls)

    async def call(self, node_id: str, kind: str, body: dict[str, Any],
                   timeout: float = 10.0) -> dict[str, Any]:
        return await call_once(self.procs[node_id].cluster, self.key, "test", kind, body,
                               timeout=timeout, tls=self.tls)

    async def wait_for(self, node_id: str, predicate: Any, timeout: float = 15.0) -> dict:
        """Poll ``node_id``'s status until ``predicate(status)`` holds; return that status."""
        last: Any = None
        with trio.move_on_after(timeout):
            while True:
                try:
                    last = await self.status(node_id)
                    if predicate(last):
                        return dict(last)
                except (OSError, trio.TooSlowError, EOFError) as exc:
                    last = exc
                await trio.sleep(0.05)
        raise AssertionError(f"timed out waiting on {node_id}; last status: {last!r}")

    def kill(self, node_id: str) -> None:
        proc = self.procs[node_id]
        if proc.alive:
            assert proc.popen is not None
            proc.popen.send_signal(signal.SIGKILL)
            proc.popen.wait(5)

    def terminate(self, node_id: str, timeout: float = 30.0) -> int:
        proc = self.procs[node_id]
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGTERM)
        return proc.popen.wait(timeout)

    def tail(self, node_id: str, lines: int = 30) -> str:
        path = self.procs[node_id].log_file
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.alive:
                assert proc.popen is not None
                proc.popen.kill()
        deadline = time.monotonic() + 5
        for proc in self.procs.values():
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(max(0.1, deadline - time.monotonic()))
