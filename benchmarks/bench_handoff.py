"""Shard handoff: how long a joining (or restarted) node takes to catch up on its shards.

    python benchmarks/bench_handoff.py [--quick]

A 2-node cluster (R=2) is loaded over MQTT with retained messages and persistent sessions
holding queued QoS 1 messages; then a third node joins and the time until no shard is
catching up any more is measured (the bulk range copy plus the Raft report), as is the time
for a node stopped with SIGKILL and restarted to be given its shards back.  Loopback only;
every wait is bounded; every process started is killed at the end.  Writes
benchmarks/results/handoff.json.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from mqttring.protocol.codec import PacketDecoder, encode
from mqttring.protocol.packets import Connect, Disconnect, PingReq, PingResp, Publish, Subscribe
from mqttring.raft.localcluster import LocalCluster

RESULTS = Path(__file__).resolve().parent / "results" / "handoff.json"


def raw_connect(port: int, client_id: str, clean: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(encode(Connect(client_id, clean_session=clean, keepalive=0)))
    sock.recv(4)
    return sock


def sync(sock: socket.socket) -> None:
    """Wait until everything sent before has been processed (PINGREQ is answered in order)."""
    sock.sendall(encode(PingReq()))
    decoder = PacketDecoder()
    while True:
        decoder.feed(sock.recv(65536))
        if any(isinstance(p, PingResp) for p in decoder):
            return


def load(port: int, retained: int, sessions: int, queued: int) -> None:
    pub = raw_connect(port, "handoff-loader")
    batch = []
    for i in range(retained):
        batch.append(encode(Publish(f"handoff/r/{i}", b"v" * 64, 0, retain=True)))
        if len(batch) == 1000:
            pub.sendall(b"".join(batch))
            batch.clear()
    pub.sendall(b"".join(batch))
    for s in range(sessions):
        sub = raw_connect(port, f"handoff-s{s}", clean=False)
        sub.sendall(encode(Subscribe(1, ((f"handoff/q/{s}", 1),))))
        sync(sub)
        sub.sendall(encode(Disconnect()))
        sub.close()
    for s in range(sessions):
        pub.sendall(b"".join(encode(Publish(f"handoff/q/{s}", b"q" * 64, 1, packet_id=i + 1))
                             for i in range(queued)))
    sync(pub)
    pub.close()


async def settled(lc: LocalCluster, node: str, timeout: float) -> float:
    start = time.monotonic()
    # Each shard on the wire is [replicas, catching_up].
    await lc.wait_for(node, lambda st: not any(s[1] for s in st["view"]["shards"]), timeout)
    return time.monotonic() - start


async def main(quick: bool) -> dict[str, Any]:
    retained, sessions, queued = (2_000, 50, 20) if quick else (20_000, 500, 20)
    root = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    lc = LocalCluster(root, entry="node", num_shards=256, heartbeat=0.2, grace=1.5)
    try:
        await lc.form("a", "b")
        await settled(lc, "a", 60)
        port = (await lc.wait_ready("a"))["mqtt"]
        t0 = time.monotonic()
        await trio.to_thread.run_sync(load, port, retained, sessions, queued)
        load_s = time.monotonic() - t0
        rows = retained + sessions * (1 + queued)
        start = time.monotonic()
        lc.start("c", join=lc.procs["a"].cluster)
        await lc.wait_ready("c")
        join_ready_s = time.monotonic() - start
        catch_up_s = await settled(lc, "a", 120) + join_ready_s
        lc.kill("b")
        await lc.wait_for("a", lambda st: st["view"]["members"]["b"]["state"] == "down", 30)
        start = time.monotonic()
        lc.start("b", join=lc.procs["a"].cluster)
        await lc.wait_ready("b")
        rejoin_s = await settled(lc, "a", 120) + (time.monotonic() - start)
        return {
            "mode": "quick" if quick else "full",
            "rows_in_cluster": rows,
            "retained": retained, "sessions": sessions, "queued_per_session": queued,
            "load_over_mqtt_s": round(load_s, 2),
            "join_until_no_shard_catching_up_s": round(catch_up_s, 2),
            "restart_after_kill_until_caught_up_s": round(rejoin_s, 2),
        }
    finally:
        lc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    figures = trio.run(main, parser.parse_args().quick)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=2))
    json.dump(figures, sys.stdout, indent=2)
    print()
