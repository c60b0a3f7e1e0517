"""``mqttring status`` (``leave``, ``pin``) pointed at a port of a node that is not its cluster
address says so in one line: what answered there and what the command talks to.

Before, every such case waited the whole ``--timeout`` and said "no answer in time (is a
Raft majority of the cluster reachable?)", which no case was.  One real node process with
every kind of listener (MQTT, WebSocket, MQTT over TLS, HTTP, a cluster address with mutual
TLS and its Raft port); each command is a real ``python -m mqttring`` process.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mqttring.certs import make_ca, make_node_cert
from mqttring.raft.localcluster import free_port

pytestmark = pytest.mark.timeout(180)

HOST = "127.0.0.1"
SECRET = "wrong-port-secret"
EXPECTED = "talks to a node's cluster address (--cluster)"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A node with every listener; its ports by name and the admin's TLS flags."""
    tmp = tmp_path_factory.mktemp("wrong-port")
    pki = tmp / "pki"
    ca = make_ca(pki)
    cert, key = make_node_cert(pki, "n1")
    admin_cert, admin_key = make_node_cert(pki, "admin")
    tls = ["--cluster-cafile", str(ca), "--cluster-certfile", str(cert),
           "--cluster-keyfile", str(key)]
    ports = {name: free_port() for name in ("ws", "mqtts", "http", "cluster", "raft")}
    ready, out = tmp / "ready.json", tmp / "node.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mqttring.node", "--node-id", "n1", "--data-dir",
             str(tmp / "data"), "--ready-file", str(ready), "--sys-interval", "0",
             "--mqtt", f"{HOST}:0", "--ws", f"{HOST}:{ports['ws']}",
             "--mqtts", f"{HOST}:{ports['mqtts']}", "--certfile", str(cert),
             "--keyfile", str(key), "--http", f"{HOST}:{ports['http']}",
             "--cluster", f"{HOST}:{ports['cluster']}", "--raft", f"{HOST}:{ports['raft']}",
             "--cluster-secret", SECRET, *tls],
            stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # bounded: until the node is a member and listens
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        ports["mqtt"] = json.loads(ready.read_text())["mqtt"]
        yield {"ports": ports, "admin_tls": ["--cluster-cafile", str(ca), "--cluster-certfile",
                                             str(admin_cert), "--cluster-keyfile",
                                             str(admin_key)]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def mqttring(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mqttring", *args, "--secret", SECRET],
                          capture_output=True, text=True, timeout=60)


def test_status_at_the_cluster_address_works(node):
    """The control case: the right address, with the admin certificate."""
    done = mqttring("status", "--node", f"{HOST}:{node['ports']['cluster']}",
                    *node["admin_tls"])
    assert done.returncode == 0, done.stderr
    assert "quorum:    yes" in done.stdout


@pytest.mark.parametrize(("command", "port", "with_tls", "answered"), [
    ("status", "mqtt", False, "answered like an MQTT broker"),
    ("status", "mqtt", True, "answered like an MQTT broker"),
    ("status", "ws", False, "answered like an HTTP server"),
    ("status", "http", False, "answered like an HTTP server"),
    ("leave", "http", True, "answered like an HTTP server"),
    ("pin", "mqtt", False, "answered like an MQTT broker"),
    ("status", "mqtts", False, "answered like a TLS server"),
    ("status", "cluster", False, "answered like a TLS server"),
    ("status", "raft", False, "accepted the connection but sent no cluster handshake in 5 s"),
])
def test_a_command_at_another_port_says_what_answered(node, command, port, with_tls,
                                                      answered):
    """``with_tls``: with the admin certificate (the commands then speak TLS first).
    ``cluster`` without it: the cluster address runs mutual TLS, so the line says which
    flags to give.  The Raft port answers none of the probes: the line says that it sent
    no cluster handshake, not that a Raft majority is missing."""
    address = f"{HOST}:{node['ports'][port]}"
    args = [command, "--node", address, "--timeout", "5"]
    if command == "pin":
        args += ["factory/#"]
    started = time.monotonic()
    done = mqttring(*args, *(node["admin_tls"] if with_tls else []))
    took = time.monotonic() - started
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {address}: {answered}"), lines[0]
    if port != "raft":
        assert f"`mqttring {command}` {EXPECTED}" in lines[0], lines[0]
        if port == "cluster":
            assert "--cluster-certfile" in lines[0], lines[0]
        # Told before the --timeout is over (the cluster address speaks first, at once).
        assert took < 5, (took, lines[0])
    assert "Traceback" not in done.stderr
