"""TLS listeners: node memory per idle connection and sequential connect rate, mqtt vs mqtts.

    python benchmarks/bench_tls.py [--connections 2000]

One ``mqttring.node`` process with an ``mqtt`` and an ``mqtts`` listener (a throwaway CA
and an ECDSA P-256 certificate from ``mqttring cert``); one client thread opens N
connections one after the other on each listener (CONNECT, wait for CONNACK, keep them
open, no TCP_NODELAY, as mosquitto's clients), and the node's RSS growth per connection
is read with psutil.  Loopback only; every wait is bounded; the node is stopped at the end.
Prints one line per listener (the numbers in docs/security.md, "Costs").
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from mqttring.certs import make_ca, make_node_cert


def _connect(port: int, client_id: bytes, context: ssl.SSLContext | None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname="node")
    variable = b"\x00\x04MQTT\x04\x02\x00\x00" + len(client_id).to_bytes(2, "big") + client_id
    sock.sendall(bytes([0x10, len(variable)]) + variable)
    if sock.recv(4) != b"\x20\x02\x00\x00":
        raise RuntimeError("no CONNACK 0")
    return sock


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=2000)
    args = parser.parse_args()
    n = args.connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * n + 100)), hard))
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        root = Path(tmp)
        make_ca(root / "pki")
        cert, key = make_node_cert(root / "pki", "node")
        ready = root / "ready.json"
        node = subprocess.Popen([
            sys.executable, "-m", "mqttring.node", "--mqtt", "127.0.0.1:0",
            "--mqtts", "127.0.0.1:0", "--certfile", str(cert), "--keyfile", str(key),
            "--data-dir", str(root / "data"), "--ready-file", str(ready),
            "--sys-interval", "0", "--log-level", "warning"])
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if time.monotonic() > deadline or node.poll() is not None:
                    raise RuntimeError("the node did not start")
                time.sleep(0.05)
            info = json.loads(ready.read_text())
            process = psutil.Process(node.pid)
            context = ssl.create_default_context(cafile=str(root / "pki" / "ca.pem"))
            time.sleep(1)
            for name, tls in (("mqtt", None), ("mqtts", context)):
                base = process.memory_info().rss
                started = time.perf_counter()
                socks = [_connect(info[name], f"{name}-{i}".encode(), tls) for i in range(n)]
                elapsed = time.perf_counter() - started
                time.sleep(2)  # let idle connections settle (park, for plain TCP)
                grown = process.memory_info().rss - base
                print(f"{name:5}: {n} idle connections, {grown / n / 1024:.1f} KB each, "
                      f"{n / elapsed:.0f} connects/s (one client, one after the other)")
                for sock in socks:
                    sock.close()
                time.sleep(2)
        finally:
            node.terminate()
            try:
                node.wait(20)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
