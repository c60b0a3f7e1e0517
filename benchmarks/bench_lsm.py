"""Benchmark of the node store (issue 3): group commit against one fsync'd transaction per put.

Usage: python benchmarks/bench_lsm.py [--quick] [--dir DIR]

Measures, in one run on real files (default: a temporary directory next to the repo's
benchmarks/results, i.e. the same disk the store uses in production tests):
- durable puts/s and ack latency p50/p99 with 1, 100 and 1,000 concurrent trio writers,
- lazy puts/s (accepted, and until all are committed),
- the baseline: a plain LMDB loop committing one synced transaction per put,
- scan rows/s and snapshot time for 1M rows (100k with --quick).
Writes benchmarks/results/lsm.json and lsm.png (lsm_quick.* with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import trio

from mqttring.lsm import Durability, LsmStore, Put, open_snapshot, shard_key

RESULTS = Path(__file__).resolve().parent / "results"
VALUE = {"topic": "sensors/room1/temperature", "payload": b"x" * 64, "qos": 1}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_durable(root: Path, writers: int, seconds: float) -> dict:
    """``writers`` trio tasks each writing one durable put at a time for ``seconds``."""
    latencies: list[float] = []
    path = root / f"durable-{writers}"
    with LsmStore(path, map_size=1 << 30) as store:
        async def writer(w: int, deadline: float) -> None:
            i = 0
            while time.perf_counter() < deadline:
                key = shard_key(w % 1024, b"%06d-%08d" % (w, i))
                t0 = time.perf_counter()
                await store.write([Put("queues", key, VALUE)])
                latencies.append(time.perf_counter() - t0)
                i += 1

        async def main() -> float:
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for w in range(writers):
                    nursery.start_soon(writer, w, start + seconds)
            return time.perf_counter() - start

        elapsed = trio.run(main)
        stats = store.stats()
    shutil.rmtree(path)
    return {
        "writers": writers,
        "puts": len(latencies),
        "seconds": elapsed,
        "puts_per_s": len(latencies) / elapsed,
        "latency_p50_ms": percentile(latencies, 0.50) * 1000,
        "latency_p99_ms": percentile(latencies, 0.99) * 1000,
        "commits": stats["commits"],
        "syncs": stats["syncs"],
        "mean_batch_ops": stats["mean_batch_ops"],
        "max_batch_ops": stats["max_batch_ops"],
    }


def bench_lazy(root: Path, writers: int, total: int) -> dict:
    """LAZY puts: rate at which writers are released (in the memtable), and the rate until
    the last one is committed to LMDB (back-pressure keeps the two close)."""
    path = root / f"lazy-{writers}"
    per_writer = total // writers
    with LsmStore(path, map_size=1 << 30) as store:
        async def writer(w: int) -> None:
            for i in range(per_writer):
                key = shard_key(w % 1024, b"%06d-%08d" % (w, i))
                await store.write([Put("queues", key, VALUE)], Durability.LAZY)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                for w in range(writers):
                    nursery.start_soon(writer, w)

        start = time.perf_counter()
        trio.run(main)
        accepted = time.perf_counter() - start
        target = store.last_sequence
        while store.stats()["committed_sequence"] < target:
            time.sleep(0.0002)
        committed = time.perf_counter() - start
        stats = store.stats()
    shutil.rmtree(path)
    puts = per_writer * writers
    return {"writers": writers, "puts": puts, "accepted_seconds": accepted,
            "puts_per_s": puts / accepted, "committed_seconds": committed,
            "committed_puts_per_s": puts / committed, "commits": stats["commits"],
            "mean_batch_ops": stats["mean_batch_ops"],
            "backpressure_waits": stats["backpressure_waits"]}


def bench_baseline(root: Path, seconds: float) -> dict:
    """Plain LMDB, default (fully synced) env, one write transaction per put."""
    from mqttring.lsm.keys import encode_value

    path = root / "baseline"
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=2)
    db = env.open_db(b"queues")
    blob = encode_value(VALUE)
    latencies: list[float] = []
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        with env.begin(write=True) as txn:
            txn.put(shard_key(i % 1024, b"%08d" % i), blob, db=db)
        latencies.append(time.perf_counter() - t0)
        i += 1
    elapsed = time.perf_counter() - start
    env.close()
    shutil.rmtree(path)
    return {"puts": i, "seconds": elapsed, "puts_per_s": i / elapsed,
            "latency_p50_ms": percentile(latencies, 0.50) * 1000,
            "latency_p99_ms": percentile(latencies, 0.99) * 1000}


def bench_scan_and_snapshot(root: Path, rows: int) -> dict:
    path = root / "bulk"
    out: dict = {"rows": rows}
    with LsmStore(path, map_size=1 << 31) as store:
        t0 = time.perf_counter()
        batch = 10_000
        for start in range(0, rows, batch):
            store.write_sync([Put("queues", shard_key(i % 1024, b"%09d" % i), VALUE)
                              for i in range(start, min(rows, start + batch))],
                             Durability.LAZY)
        store.write_sync([])  # a durable barrier: everything before it is synced
        out["load_seconds"] = time.perf_counter() - t0
        out["load_rows_per_s"] = rows / out["load_seconds"]

        t0 = time.perf_counter()
        scanned = store.scan_sync("queues")
        out["scan_seconds"] = time.perf_counter() - t0
        assert len(scanned) == rows
        out["scan_rows_per_s"] = rows / out["scan_seconds"]
        del scanned

        t0 = time.perf_counter()
        shard = store.scan_sync("queues", shard_key(7))
        out["scan_one_shard_rows"] = len(shard)
        out["scan_one_shard_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        manifest = store.snapshot_sync(root / "snap", node_id="bench")
        out["snapshot_seconds"] = time.perf_counter() - t0
        out["snapshot_bytes"] = sum(e.bytes for e in manifest.databases.values())
        assert manifest.rows["queues"] == rows

        t0 = time.perf_counter()
        open_snapshot(root / "snap")
        out["snapshot_verify_seconds"] = time.perf_counter() - t0
    shutil.rmtree(path)
    shutil.rmtree(root / "snap")
    return out


def plot(results: dict, dest: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = ["LMDB 1 txn/put\n(baseline)"]
    rates = [results["baseline"]["puts_per_s"]]
    for r in results["durable"]:
        labels.append(f"durable\n{r['writers']} writers")
        rates.append(r["puts_per_s"])
    for r in results["lazy"]:
        labels.append(f"lazy\n{r['writers']} writers")
        rates.append(r["puts_per_s"])
    colors = ["grey"] + ["tab:blue"] * len(results["durable"]) + ["tab:green"] * len(
        results["lazy"])
    bars = left.bar(labels, rates, color=colors)
    left.bar_label(bars, labels=[f"{r / 1000:.1f}k" for r in rates], fontsize=8)
    left.axhline(30_000, color="red", linestyle="--", linewidth=1, label="target 30k/s")
    left.set_yscale("log")
    left.set_ylabel("acknowledged puts/s (log)")
    left.set_title("Throughput")
    left.legend(fontsize=8)
    left.tick_params(axis="x", labelsize=8)

    names = ["baseline"] + [f"{r['writers']} writers" for r in results["durable"]]
    p50 = [results["baseline"]["latency_p50_ms"]] + [r["latency_p50_ms"]
                                                     for r in results["durable"]]
    p99 = [results["baseline"]["latency_p99_ms"]] + [r["latency_p99_ms"]
                                                     for r in results["durable"]]
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
    right.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
    right.set_xticks(list(xs), names, fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("durable ack latency, ms (log)")
    bulk = results["bulk"]
    right.set_title(f"Ack latency  |  scan {bulk['scan_rows_per_s'] / 1e6:.2f}M rows/s, "
                    f"snapshot of {bulk['rows'] / 1e6:g}M rows {bulk['snapshot_seconds']:.1f}s",
                    fontsize=9)
    right.legend(fontsize=8)
    machine = results["machine"]
    fig.suptitle(f"mqttring LsmStore, {machine['cpus']} CPUs, load average "
                 f"{machine['loadavg_start'][0]:.1f} at start, "
                 f"{machine.get('loadavg_end', [float('nan')])[0]:.1f} at end"
                 f"{' (quick)' if results['quick'] else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(dest, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs, 100k-row bulk")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the stores")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else 4.0
    bulk_rows = 100_000 if args.quick else 1_000_000
    lazy_total = 50_000 if args.quick else 300_000
    root = Path(tempfile.mkdtemp(prefix="bench-lsm-", dir=args.dir))
    try:
        results: dict = {
            "quick": args.quick,
            "machine": {"python": sys.version.split()[0], "lmdb": lmdb.__version__,
                        "cpus": os.cpu_count(), "platform": platform.platform(),
                        "dir": str(root), "loadavg_start": os.getloadavg()},
            "value_bytes": len(json.dumps(VALUE, default=str)),
        }
        print(f"bench dir {root}", flush=True)
        results["baseline"] = bench_baseline(root, seconds)
        print("baseline", results["baseline"], flush=True)
        results["durable"] = []
        for writers in (1, 100, 1000):
            r = bench_durable(root, writers, seconds)
            results["durable"].append(r)
            print("durable", r, flush=True)
        results["lazy"] = []
        for writers in (1, 100):
            r = bench_lazy(root, writers, lazy_total)
            results["lazy"].append(r)
            print("lazy", r, flush=True)
        results["bulk"] = bench_scan_and_snapshot(root, bulk_rows)
        print("bulk", results["bulk"], flush=True)
        durable100 = next(r for r in results["durable"] if r["writers"] == 100)
        results["target_30k_at_100_writers_met"] = durable100["puts_per_s"] >= 30_000
        results["speedup_100_writers_vs_baseline"] = (durable100["puts_per_s"]
                                                      / results["baseline"]["puts_per_s"])
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["median_durable_p50_ms"] = statistics.median(
            r["latency_p50_ms"] for r in results["durable"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "lsm_quick" if args.quick else "lsm"
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / stem}.json and .png")


if __name__ == "__main__":
    main()
