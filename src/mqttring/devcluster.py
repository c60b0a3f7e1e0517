"""``make cluster`` / ``python -m mqttring.devcluster``: a local N-node cluster on loopback.

For trying things out and for the cluster benchmarks: starts N full nodes (the first forms
the cluster, the others join through it), prints each node's MQTT port and log file, and
stops them all on Ctrl-C.  Data lives under ``--data-dir`` and survives a restart.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import trio

from mqttring.raft.localcluster import LocalCluster


async def run(nodes: int, data_dir: Path, secret: str) -> None:
    cluster = LocalCluster(data_dir, secret, entry="node", heartbeat=0.5, grace=3.0)
    names = [f"node{i + 1}" for i in range(nodes)]
    try:
        await cluster.form(*names)
        print(f"{nodes}-node cluster up (secret {secret!r}); Ctrl-C stops it")
        for name in names:
            ready = await cluster.wait_ready(name)
            proc = cluster.procs[name]
            print(f"  {name}: mqtt 127.0.0.1:{ready['mqtt']}  cluster {proc.cluster}  "
                  f"log {proc.log_file}")
        print(f"status: mqttring status --node {cluster.procs[names[0]].cluster} "
              f"--secret {secret}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
    finally:
        for name in reversed(names):
            if cluster.procs.get(name) and cluster.procs[name].alive:
                cluster.terminate(name)
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqttring.devcluster", description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("data/cluster"))
    parser.add_argument("--secret", default="dev-cluster-secret")
    args = parser.parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    trio.run(run, args.nodes, args.data_dir.resolve(), args.secret)
    return 0


if __name__ == "__main__":
    sys.exit(main())
