"""Cluster metadata benchmark: formation, join, failover, epoch propagation, ring lookups.

Run as a file: ``.venv/bin/python benchmarks/bench_raft.py [--quick]``.  Members are real
processes (``mqttring.raft.member``) on loopback with the test timings (heartbeat 0.2 s,
grace 1.5 s) and pysyncobj's ``RaftTimeouts`` defaults.  Times include what an operator
waits for, e.g. "form" runs from starting the first process until all three report the same
settled view; process start-up (importing Python, deriving the Raft key) is measured
separately so it can be subtracted.  Results go to ``benchmarks/results/raft.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType

import trio

from mqttring.raft.localcluster import LocalCluster
from mqttring.raft.replicated import DEFAULT_TIMEOUTS
from mqttring.raft.state import MetadataState, cmd_bootstrap, cmd_caught_up, cmd_joining, cmd_up
from mqttring.raft.state import member_info as info
from mqttring.ring.placement import place_shards
from mqttring.rpc import RpcClient

RESULTS = Path(__file__).resolve().parent / "results" / "raft.json"


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median_s": round(statistics.median(ordered), 4),
        "min_s": round(ordered[0], 4),
        "max_s": round(ordered[-1], 4),
        "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4),
    }


def settled(status: dict, members: set[str]) -> bool:
    view = status["view"]
    return (
        set(view["members"]) == members
        and all(m["state"] == "up" for m in view["members"].values())
        and view["leader"] in members
        and all(not catching for _, catching in view["shards"])
    )


async def form_three(root: Path) -> tuple[LocalCluster, float]:
    cluster = LocalCluster(root, num_shards=1024)
    started = time.monotonic()
    await cluster.form("a", "b", "c")
    for node in "abc":
        await cluster.wait_for(node, lambda s: settled(s, {"a", "b", "c"}), timeout=30)
    return cluster, time.monotonic() - started


async def bench_form_and_join(runs: int) -> dict:
    form, join = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            cluster, elapsed = await form_three(Path(tmp))
            try:
                form.append(elapsed)
                started = time.monotonic()
                cluster.start("d", join=cluster.procs["b"].cluster)
                await cluster.wait_ready("d")
                join.append(time.monotonic() - started)
            finally:
                cluster.close()
    return {"form_3_nodes": summary(form), "join_4th_node_to_member": summary(join)}


def bench_process_startup(runs: int) -> dict:
    samples = []
    for _ in range(runs):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import mqttring.raft.member"], check=True)
        samples.append(time.monotonic() - started)
    return summary(samples)


async def bench_failover(runs: int) -> dict:
    elected, writable, marked_down = [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            cluster, _ = await form_three(Path(tmp))
            try:
                leader = (await cluster.status("a"))["view"]["leader"]
                survivor = next(n for n in "abc" if n != leader)
                cluster.kill(leader)
                started = time.monotonic()
                await cluster.wait_for(
                    survivor,
                    lambda s, old=leader: s["view"]["leader"] not in (None, old),
                    timeout=30,
                )
                elected.append(time.monotonic() - started)
                while True:  # first successful commit after the kill
                    try:
                        await cluster.call(survivor, "pin", {"subtree": "bench/#"}, timeout=2)
                        break
                    except Exception:
                        await trio.sleep(0.01)
                writable.append(time.monotonic() - started)
                await cluster.wait_for(
                    survivor,
                    lambda s, old=leader: s["view"]["members"][old]["state"] == "down",
                    timeout=30,
                )
                marked_down.append(time.monotonic() - started)
            finally:
                cluster.close()
    return {
        "new_leader_known": summary(elected),
        "first_commit": summary(writable),
        "old_leader_marked_down": summary(marked_down),
    }


async def bench_epoch_propagation(rounds: int) -> dict:
    """Commit on one node; time until every member's status reports the new epoch."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster, _ = await form_three(Path(tmp))
        try:
            commit, everywhere = [], []
            clients = {
                n: await RpcClient.connect(cluster.procs[n].cluster, cluster.key, "bench")
                for n in "abc"
            }
            for i in range(rounds):
                started = time.monotonic()
                reply = await clients["c"].call("pin", {"subtree": f"p/{i}/#"})
                commit.append(time.monotonic() - started)
                for node in "abc":
                    while (await clients[node].call("status", {"brief": True}))["view"][
                        "epoch"
                    ] < reply["epoch"]:
                        await trio.sleep(0.001)
                everywhere.append(time.monotonic() - started)
            for client in clients.values():
                await client.aclose()
            return {"commit_acknowledged": summary(commit), "applied_on_all_3": summary(everywhere)}
        finally:
            cluster.close()


def bench_ring(seconds: float) -> dict:
    state = MetadataState()
    state.apply(cmd_bootstrap(1024, 2, info("n0", "c0", "r0")))
    for i in range(1, 5):
        state.apply(cmd_joining(info(f"n{i}", f"c{i}", f"r{i}")))
        inc = state.apply(cmd_up(f"n{i}"))["incarnation"]
        state.apply(cmd_caught_up(f"n{i}", inc, list(state.view().catching_up_for(f"n{i}"))))
    view = state.view()
    topics = [f"factory/line{i % 17}/machine{i}/temperature" for i in range(10_000)]
    clients = [f"client-{i}" for i in range(10_000)]
    out: dict[str, float] = {}
    for name, fn, keys in (
        ("topic_to_owner_per_s", lambda t: view.owner(view.shard_for_topic(t)), topics),
        ("client_to_owner_per_s", lambda c: view.owner(view.shard_for_client(c)), clients),
    ):
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for key in keys:
                fn(key)
            count += len(keys)
        out[name] = round(count / (time.perf_counter() - started))
    pinned = view.__class__(
        **{
            **{f: getattr(view, f) for f in view.__dataclass_fields__},
            "pins": MappingProxyType({f"factory/line{i}": i for i in range(8)}),
        }
    )
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for topic in topics:
            pinned.owner(pinned.shard_for_topic(topic))
        count += len(topics)
    out["topic_to_owner_with_8_pins_per_s"] = round(count / (time.perf_counter() - started))
    started = time.perf_counter()
    for _ in range(10):
        place_shards({f"n{i}": 1 for i in range(10)}, 1024, 2)
    out["place_1024_shards_10_nodes_ms"] = round((time.perf_counter() - started) * 100, 2)
    started = time.perf_counter()
    for _ in range(10):
        state.view()
    out["build_cluster_view_1024_shards_ms"] = round((time.perf_counter() - started) * 100, 2)
    return out


async def run(quick: bool) -> dict:
    runs = 2 if quick else 5
    return {
        "process_startup": bench_process_startup(3),
        **(await bench_form_and_join(runs)),
        "failover_after_leader_kill_9": await bench_failover(runs),
        "epoch_propagation_3_nodes": await bench_epoch_propagation(10 if quick else 30),
        "ring": bench_ring(0.5 if quick else 2.0),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs (CI smoke)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = trio.run(run, args.quick)
    results["settings"] = {
        "heartbeat_interval_s": 0.2,
        "failure_grace_s": 1.5,
        "num_shards": 1024,
        "replication": 2,
        "raft_timeouts": asdict(DEFAULT_TIMEOUTS),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "quick": args.quick,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
