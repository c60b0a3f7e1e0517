"""``python -m benchmarks.hotspots``: py-spy profile of mqttring under one scenario's load.

Why a script and not a recipe: the profile that explains a missed target must be taken
under the same load the target was measured with, and reproducible by whoever optimises
next.  It starts mqttring, runs the scenario with a long measuring window, and samples the
broker with py-spy twice: a flame graph (SVG) and raw collapsed stacks, from which it prints
the top functions by own time and by inclusive time.

Needs ``py-spy`` (``.venv/bin/pip install py-spy``) and ptrace rights on the broker process.
"""

from __future__ import annotations

import argparse
import collections
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import cluster, loadgen
from benchmarks.__main__ import RESULTS, SCENARIOS
from benchmarks.brokers import BrokerHandle, start_mqttring
from benchmarks.scenarios import Params


def py_spy() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


#: Leaf frames where a thread sits blocked (py-spy cannot always tell a blocked thread from
#: a running one): trio's idle epoll wait and thread cache, lock waits, pysyncobj's poller.
WAITING = frozenset(
    {
        "Condition.wait (threading.py)",
        "WorkerThread._work (trio/_core/_thread_cache.py)",
        "PollPoller.poll (pysyncobj/poller.py)",
        "EpollIOManager.get_events (trio/_core/_io_epoll.py)",
        "Event.wait (threading.py)",
        "Thread._wait_for_tstate_lock (threading.py)",
    }
)


def hot_spots(raw: Path, top: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """(own-time, inclusive-time) shares per function from py-spy's collapsed stacks.

    Inclusive time lists mqttring's own functions only: the trio and runpy frames that
    enclose everything say nothing about where to optimise.
    """
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = waiting = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        # One key per function (py-spy appends the line number: drop it).
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";") if f]
        if not frames:
            continue
        if frames[-1] in WAITING:
            waiting += n
            continue
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            if "mqttring/" in f:
                incl[f] += n
    if not total:
        return [], []
    print(f"samples: {total} working, {waiting} in known waits (excluded)")

    def share(c: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100 * n / total, 1)) for f, n in c.most_common(top)]

    return share(own), share(incl)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hotspots", description=__doc__)
    ap.add_argument("scenario", nargs="?", default="fanin_qos0", choices=sorted(SCENARIOS))
    ap.add_argument("--duration", type=int, default=10, help="seconds per py-spy recording")
    ap.add_argument("--out", default=str(RESULTS / "profile-fanin.svg"))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--node",
        type=int,
        default=1,
        choices=(1, 2, 3),
        help="cluster scenario: which node to profile (1 has the publishers)",
    )
    ap.add_argument(
        "--single",
        action="store_true",
        help="cluster scenario: profile the single node it is compared with, same load",
    )
    ap.add_argument(
        "--spread",
        action="store_true",
        help=f"cluster scenario: publish over {cluster.SPREAD_TOPICS:,} topics, not one",
    )
    args = ap.parse_args(argv)
    spread = cluster.SPREAD_TOPICS if args.spread else 0
    spy = py_spy()
    if spy is None:
        print("py-spy not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    loadgen.raise_nofile()
    p = replace(Params.quick(), warmup_s=1.0, measure_s=2 * args.duration + 6)
    result: dict[str, Any] = {}
    svg = Path(args.out)
    raw = svg.with_suffix(".txt")
    handles: list[BrokerHandle] = []
    try:
        if args.scenario == "cluster" and args.single:
            target = start_mqttring()
            handles = [target]

            def load() -> dict[str, Any]:
                return cluster._load(p, target, [target, target], "bench/prof/sn", "prof", target,
                                     spread=spread)
        elif args.scenario == "cluster":
            # Profile one node of a 3-node cluster under the cluster scenario's load.
            handles = cluster.start_nodes(3, secrets.token_hex(8))
            cluster.wait_settled(handles[0])  # a shard copy in progress is not the hot path
            cluster.probe_cross_node(handles, "bench/prof/probe", 30)
            whole = BrokerHandle("cluster", extra={"pids": [h.pid for h in handles]})
            target = handles[args.node - 1]

            def load() -> dict[str, Any]:
                return cluster._load(p, handles[0], handles[1:], "bench/prof/cl", "prof", whole,
                                     spread=spread)
        else:
            target = start_mqttring()
            handles = [target]
            if target.unavailable:
                print(f"mqttring not available: {target.unavailable}", file=sys.stderr)
                return 2

            def load() -> dict[str, Any]:
                return SCENARIOS[args.scenario](target, p, "prof")

        t = threading.Thread(target=lambda: result.update(load()), daemon=True)
        t.start()
        time.sleep(3)  # workers spawned, connected, warmed up
        for fmt, path in (("flamegraph", svg), ("raw", raw)):
            subprocess.run(
                [spy, "record", "--pid", str(target.pid), "--duration", str(args.duration),
                 "--rate", "200", "--format", fmt, "--output", str(path)],
                check=False, timeout=args.duration + 60,
            )  # fmt: skip
        t.join(p.measure_s + 60)
    finally:
        for h in handles:
            h.stop()
    own, incl = hot_spots(raw, args.top) if raw.exists() else ([], [])
    print(f"\nscenario result: {_short(result)}")
    print(f"\ntop {args.top} by own time (% of samples):")
    for f, s in own:
        print(f"  {s:5.1f}%  {f}")
    print(f"\ntop {args.top} mqttring functions by inclusive time:")
    for f, s in incl:
        print(f"  {s:5.1f}%  {f}")
    print(f"\nflame graph: {svg}\ncollapsed stacks: {raw}")
    return 0


def _short(r: dict[str, Any]) -> str:
    keys = ("status", "deliveries_per_s", "lost", "error")
    return ", ".join(f"{k}={r[k]}" for k in keys if k in r)


if __name__ == "__main__":
    sys.exit(main())
