"""Benchmark of the analytics path (issue 6): export rows/s, Spark job time, archive overhead.

Usage: python benchmarks/bench_spark.py [--quick] [--rows N] [--messages N]

1. Generates N archived messages (default 1,000,000) straight into an LsmStore ``archive``
   database with the broker's real key/value format (``archive_key``, shard of the topic over
   1024 shards, 1,000 topics, 32-byte payloads): publishing a million messages over MQTT
   would measure the broker, not the pipeline.
2. Snapshots it (``snapshot_sync``) and exports it (``export_snapshot``): export rows/s.
3. Runs ``run_topic_stats`` (depth 2, writing Parquet) on ``local[2]``: wall time of the job,
   with the SparkSession start-up reported separately.
4. Archive overhead on QoS 0 publish throughput: an in-process broker (with a store), one
   raw-socket publisher sending M QoS 0 PUBLISH packets in large writes then a PINGREQ (the
   PINGRESP comes after every earlier packet was routed), with ``archive = []`` and with
   ``archive = ["#"]`` (every message archived), and with a filter no message matches
   (``["nomatch/#"]``: the cost of the lookup alone); best of 3 alternating rounds each.

Writes benchmarks/results/spark.json (spark_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from mqttring import BrokerConfig, MqttRingBroker
from mqttring.analytics.export import export_snapshot
from mqttring.broker.archive import archive_key
from mqttring.lsm import LsmStore, Put
from mqttring.ring.hashing import shard_of

RESULTS = Path(__file__).resolve().parent / "results"
SHARDS = 1024


# --------------------------------------------------------------------------- data


def topics(n: int = 1000) -> list[str]:
    return [f"sensors/site{i % 10}/dev{i // 10 % 10}/m{i // 100}" for i in range(n)]


def generate(store_dir: Path, rows: int) -> float:
    """``rows`` archive rows in the broker's format; returns seconds taken."""
    names = topics()
    shards = [shard_of(t, SHARDS) for t in names]
    payload = b"p" * 32
    start_ns = time.time_ns() - rows * 1_000_000  # one message per ms, ending now
    started = time.perf_counter()
    with LsmStore(store_dir, map_size=1 << 31) as store:
        batch: list[Put] = []
        for i in range(rows):
            k = i % len(names)
            t = start_ns + i * 1_000_000
            batch.append(Put("archive", archive_key(shards[k], t, i),
                             [names[k], payload, 0, False, t]))
            if len(batch) == 20_000:
                store.write_sync(batch)
                batch = []
        if batch:
            store.write_sync(batch)
    return time.perf_counter() - started


# --------------------------------------------------------------------------- archive overhead


def _rl(n: int) -> bytes:
    out = bytearray()
    while True:
        digit, n = n % 128, n // 128
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _str(b: bytes) -> bytes:
    return struct.pack(">H", len(b)) + b


def _connect(client_id: bytes) -> bytes:
    body = _str(b"MQTT") + bytes([4, 0x02]) + struct.pack(">H", 0) + _str(client_id)
    return b"\x10" + _rl(len(body)) + body


def _publish(topic: bytes, payload: bytes) -> bytes:
    body = _str(topic) + payload
    return b"\x30" + _rl(len(body)) + body


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


def publish_round(port: int, messages: int) -> float:
    """Seconds for ``messages`` QoS 0 publishes to be routed (CONNECT .. PINGRESP)."""
    frames = [_publish(b"sensors/x/%d" % (i % 100), b"p" * 32) for i in range(messages)]
    chunks = [b"".join(frames[i:i + 1000]) for i in range(0, messages, 1000)]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(_connect(b"bench-%d" % os.getpid()))
        assert _read_exact(sock, 4)[:2] == b"\x20\x02", "no CONNACK"
        started = time.perf_counter()
        for chunk in chunks:
            sock.sendall(chunk)
        sock.sendall(b"\xc0\x00")  # PINGREQ: answered after every publish before it
        assert _read_exact(sock, 2) == b"\xd0\x00", "no PINGRESP"
        elapsed = time.perf_counter() - started
        sock.sendall(b"\xe0\x00")
    return elapsed


def archive_overhead(root: Path, messages: int, rounds: int = 3) -> dict:
    filters = {"off": (), "miss": ("nomatch/#",), "on": ("#",)}
    results: dict[str, list[float]] = {mode: [] for mode in filters}
    appended = 0
    for r in range(rounds):
        for mode in filters:
            data = root / f"pub-{mode}-{r}"
            broker = MqttRingBroker(BrokerConfig(
                node_id=f"bench-{mode}", mqtt="127.0.0.1:0", data_dir=data, sys_interval=0,
                archive=filters[mode]))
            ports = broker.start()
            try:
                assert ports.mqtt
                seconds = publish_round(ports.mqtt, messages)
                if mode == "on":
                    assert broker.archive is not None
                    appended = broker.archive.appended
                    assert appended == messages, (appended, messages)
            finally:
                broker.stop()
            shutil.rmtree(data, ignore_errors=True)
            results[mode].append(messages / seconds)
            print(f"  publish round {r} archive {mode}: {messages / seconds:,.0f} msg/s",
                  flush=True)
    off, miss, on = (max(results[m]) for m in ("off", "miss", "on"))
    return {"messages_per_round": messages, "rounds": rounds,
            "qos0_msgs_per_s_archive_off": round(off), "qos0_msgs_per_s_archive_on": round(on),
            "qos0_msgs_per_s_archive_filter_not_matching": round(miss),
            "all_rounds_off": [round(x) for x in results["off"]],
            "all_rounds_on": [round(x) for x in results["on"]],
            "all_rounds_miss": [round(x) for x in results["miss"]],
            "median_off": round(statistics.median(results["off"])),
            "median_on": round(statistics.median(results["on"])),
            "overhead_pct_best": round(100 * (1 - on / off), 1),
            "archived_per_round": appended}


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k rows, 20k messages")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    messages = args.messages or (20_000 if args.quick else 100_000)
    root = Path(tempfile.mkdtemp(prefix="bench-spark-", dir=args.dir))
    result: dict = {"python": sys.version.split()[0], "machine": platform.machine(),
                    "cpus": os.cpu_count(), "rows": rows}
    try:
        print(f"generating {rows:,} archive rows ...", flush=True)
        result["generate_s"] = round(generate(root / "store", rows), 2)

        t = time.perf_counter()
        with LsmStore(root / "store", map_size=1 << 31) as store:
            manifest = store.snapshot_sync(root / "snap", node_id="bench")
        result["snapshot_s"] = round(time.perf_counter() - t, 2)
        assert manifest.rows["archive"] == rows

        print("exporting ...", flush=True)
        export = export_snapshot(root / "snap", root / "export", progress=False)
        assert export.rows["archive"] == rows
        result["export_s"] = round(export.seconds, 2)
        result["export_rows_per_s"] = round(rows / export.seconds)
        result["export_files"] = export.files
        result["export_bytes"] = sum(p.stat().st_size for p in (root / "export").rglob("*.parquet"))

        print("spark topic-stats on local[2] ...", flush=True)
        from mqttring.spark.jobs import build_session, run_topic_stats

        t = time.perf_counter()
        spark = build_session("local[2]", app_name="bench-spark", shuffle_partitions=4,
                              conf={"spark.ui.enabled": "false"})
        result["spark_session_start_s"] = round(time.perf_counter() - t, 2)
        try:
            t = time.perf_counter()
            stats = run_topic_stats(spark, str(root / "export"), str(root / "stats"), depth=2)
            result["spark_job_s"] = round(time.perf_counter() - t, 2)
            total = stats.topics.agg({"messages": "sum"}).first()[0]
            assert total == rows, (total, rows)
            result["spark_topics"] = stats.topics.count()
        finally:
            spark.stop()

        print(f"archive overhead, {messages:,} QoS 0 messages per round ...", flush=True)
        result["publish"] = archive_overhead(root, messages)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("spark_quick.json" if args.quick else "spark.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
