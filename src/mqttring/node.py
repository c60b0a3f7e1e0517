"""``python -m mqttring.node`` / ``mqttring node``: run one broker node until a signal.

Settings come from defaults, then ``--config FILE`` (TOML), then flags, later winning.  With
``--cluster`` the node also runs the cluster metadata service (Raft) next to the broker; on
SIGINT/SIGTERM it leaves the cluster (handing its shards away) before it stops.

``--ready-file PATH`` writes ``{"mqtt": port, "ws": port, "mqtts": port, "wss": port,
"pid": pid, ...}`` once the node listens; tests and the benchmark harness use it with port 0
to learn the real ports without sleeping or polling a socket.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from mqttring import __version__
from mqttring.broker.tls import build_server_context, tls_enabled
from mqttring.cluster_tls import cluster_tls
from mqttring.config import BrokerConfig, ConfigError
from mqttring.embedded import MqttRingBroker
from mqttring.workers import run_workers, worker_count

log = logging.getLogger("mqttring.node")

#: Seconds past ``config.leave_timeout`` allowed for the last hand-offs and Raft removal.
LEAVE_SLACK = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with settings")
    parser.add_argument("--node-id", help="unique name of this node (default node1)")
    parser.add_argument("--mqtt", help="MQTT TCP listener HOST:PORT (default 127.0.0.1:1883)")
    parser.add_argument("--ws", help="MQTT over WebSocket listener HOST:PORT (off by default)")
    parser.add_argument("--mqtts", help="MQTT over TLS listener HOST:PORT (off by default)")
    parser.add_argument("--wss", help="MQTT over WebSocket over TLS HOST:PORT (off by default)")
    parser.add_argument("--certfile", type=Path, help="PEM server certificate for mqtts/wss")
    parser.add_argument("--keyfile", type=Path, help="PEM private key of --certfile")
    parser.add_argument("--cafile", type=Path, help="PEM CA that signs client certificates")
    parser.add_argument("--require-certificate", action="store_true", default=None,
                        help="TLS clients must present a certificate signed by --cafile")
    parser.add_argument("--data-dir", type=Path, help="where the node store lives (./data)")
    parser.add_argument("--sys-interval", type=float, help="seconds between $SYS updates")
    parser.add_argument("--cluster", help="HOST:PORT for inter-node links and the admin RPC")
    parser.add_argument("--admin", help="single node: HOST:PORT of the admin RPC (snapshots)")
    parser.add_argument("--raft", help="HOST:PORT for Raft (default: cluster port + 1)")
    parser.add_argument("--join", help="HOST:PORT (cluster address) of any existing member")
    parser.add_argument(
        "--cluster-secret",
        default=os.environ.get("MQTTRING_CLUSTER_SECRET"),
        help="shared secret of the cluster (or env MQTTRING_CLUSTER_SECRET)",
    )
    parser.add_argument("--cluster-cafile", type=Path,
                        help="cluster CA (PEM): mutual TLS on the cluster address")
    parser.add_argument("--cluster-certfile", type=Path,
                        help="this node's certificate, signed by --cluster-cafile (PEM)")
    parser.add_argument("--cluster-keyfile", type=Path, help="its private key (PEM)")
    parser.add_argument("--replication", type=int, help="replicas per shard (default 2)")
    parser.add_argument("--num-shards", type=int, help="shards, fixed when a cluster forms")
    parser.add_argument("--ready-file", type=Path, help="write bound ports as JSON here")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--workers", type=worker_count, default=1,
        help="run N node processes on this machine as one cluster sharing the MQTT port "
             "(SO_REUSEPORT); 'auto' = one per core (default 1)")
    parser.add_argument("--reuse-port", action="store_true", default=None,
                        help="bind the MQTT/WebSocket ports with SO_REUSEPORT")
    parser.add_argument("--stay-on-stop", action="store_true", default=None,
                        help="on SIGINT/SIGTERM stop without leaving the cluster")


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    overrides: dict[str, Any] = {
        "node_id": args.node_id,
        "mqtt": args.mqtt,
        "ws": args.ws,
        "mqtts": args.mqtts,
        "wss": args.wss,
        "certfile": args.certfile,
        "keyfile": args.keyfile,
        "cafile": args.cafile,
        "require_certificate": args.require_certificate,
        "data_dir": args.data_dir,
        "sys_interval": args.sys_interval,
        "cluster": args.cluster,
        "admin": args.admin,
        "raft": args.raft,
        "join": args.join,
        "cluster_secret": args.cluster_secret,
        "cluster_cafile": args.cluster_cafile,
        "cluster_certfile": args.cluster_certfile,
        "cluster_keyfile": args.cluster_keyfile,
        "replication": args.replication,
        "num_shards": args.num_shards,
        "reuse_port": args.reuse_port,
        "leave_on_stop": None if args.stay_on_stop is None else not args.stay_on_stop,
    }
    if args.config is not None:
        return BrokerConfig.from_toml(args.config, **overrides)
    return BrokerConfig.from_mapping({}, **overrides)


def _write_ready_file(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)  # atomic: readers never see half a file


def tune_gc(config: BrokerConfig) -> None:
    """Make full garbage collections rarer: the node process owns its interpreter.

    A broker's heap is mostly long-lived per-connection state, and CPython runs a full
    collection (a walk over all of it) every 10 middle-generation ones: with 10,000
    connections arriving, that walk was most of the CPU of a connect storm (5.4k
    connections/s; 8.4k with ``gc_full_every = 100``).  Cycles among young objects are still
    collected as often as before.
    """
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, config.gc_full_every)


async def run_node(config: BrokerConfig, ready_file: Path | None = None) -> None:
    broker = MqttRingBroker(config)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            ports = await nursery.start(broker.serve)
            if config.gc_freeze:
                gc.freeze()  # modules and start-up state: never garbage, never walked again
            if ready_file is not None:
                _write_ready_file(
                    ready_file,
                    {"mqtt": ports.mqtt, "ws": ports.ws, "mqtts": ports.mqtts,
                     "wss": ports.wss, "pid": os.getpid(),
                     "node_id": config.node_id, "cluster": config.cluster,
                     "admin": broker.admin_port},
                )
            async for signum in signals:
                log.info("signal %s: shutting down", signal.Signals(signum).name)
                break
            if broker.plane is not None and config.leave_on_stop:
                with trio.move_on_after(config.leave_timeout + LEAVE_SLACK):
                    await broker.plane.leave()
            nursery.cancel_scope.cancel()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        if tls_enabled(config):
            build_server_context(config)  # a bad certificate or key: exit 2 before starting
        cluster_tls(config)  # the same for the cluster's certificate
    except ConfigError as exc:
        print(f"mqttring: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1:
        return run_workers(config, args.workers, args)
    tune_gc(config)
    try:
        trio.run(run_node, config, args.ready_file)
    except OSError as exc:
        print(f"mqttring: cannot start node: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("node", help="run a broker node")
    add_arguments(parser)
    parser.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqttring.node", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mqttring {__version__}")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
