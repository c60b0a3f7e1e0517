"""``python -m mqttring.node`` / ``mqttring node``: run one broker node until a signal.

Settings come from defaults, then ``--config FILE`` (TOML), then ``MQTTRING_*`` environment
variables, then flags, later winning, all checked against the one schema of
``mqttring.config`` before anything starts (a bad one: one line on stderr, exit 2).  With
``--cluster`` the node also runs the cluster metadata service (Raft) next to the broker; on
SIGINT/SIGTERM it leaves the cluster (handing its shards away) before it stops.

``--ready-file PATH`` writes ``{"mqtt": port, "ws": port, "pid": pid, ...}`` once the node
listens; tests and the benchmark harness use it with port 0 to learn the real ports without
sleeping or polling a socket.
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
from mqttring.config import BrokerConfig, ConfigError, flag_overrides
from mqttring.embedded import MqttRingBroker
from mqttring.security import check_security_files
from mqttring.workers import run_workers, worker_count

log = logging.getLogger("mqttring.node")

#: Seconds past ``config.leave_timeout`` allowed for the last hand-offs and Raft removal.
LEAVE_SLACK = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with settings")
    parser.add_argument("--node-id", help="unique name of this node (default node1)")
    parser.add_argument("--mqtt", help="MQTT TCP listener HOST:PORT (default 127.0.0.1:1883; "
                        "'' turns it off)")
    parser.add_argument("--ws", help="MQTT over WebSocket listener HOST:PORT (off by default; "
                        "'' turns it off)")
    parser.add_argument("--data-dir", help="where the node store lives (./data)")
    parser.add_argument("--sys-interval", help="seconds between $SYS updates")
    parser.add_argument("--cluster", help="HOST:PORT for inter-node links and the admin RPC")
    parser.add_argument("--admin", help="single node: HOST:PORT of the admin RPC (snapshots)")
    parser.add_argument("--raft", help="HOST:PORT for Raft (default: cluster port + 1)")
    parser.add_argument("--join", help="HOST:PORT (cluster address) of any existing member")
    parser.add_argument("--cluster-secret",
                        help="shared secret of the cluster (or env MQTTRING_CLUSTER_SECRET)")
    parser.add_argument("--http", help="HTTP API, /metrics and dashboard HOST:PORT (off by "
                                       "default; token in env MQTTRING_HTTP_TOKEN)")
    parser.add_argument("--password-file",
                        help="mosquitto-format password file (mqttring passwd)")
    parser.add_argument("--acl-file", help="mosquitto-format ACL file")
    parser.add_argument("--replication", help="replicas per shard (default 2)")
    parser.add_argument("--num-shards", help="shards, fixed when a cluster forms")
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
    """Defaults < ``--config`` file < ``MQTTRING_*`` environment < these flags.

    Flag values are strings here (no argparse ``type=``) so that they are parsed and checked
    by the config schema like the environment's, with the same one-line errors.
    """
    overrides: dict[str, Any] = {
        "node_id": args.node_id,
        "mqtt": args.mqtt,
        "ws": args.ws,
        "data_dir": args.data_dir,
        "sys_interval": args.sys_interval,
        "cluster": args.cluster,
        "admin": args.admin,
        "raft": args.raft,
        "join": args.join,
        "cluster_secret": args.cluster_secret,
        "replication": args.replication,
        "http": args.http,
        "password_file": args.password_file,
        "acl_file": args.acl_file,
        "num_shards": args.num_shards,
        "reuse_port": args.reuse_port,
        "leave_on_stop": None if args.stay_on_stop is None else not args.stay_on_stop,
    }
    overrides = flag_overrides(overrides)
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
                    {"mqtt": ports.mqtt, "ws": ports.ws, "pid": os.getpid(),
                     "node_id": config.node_id, "cluster": config.cluster,
                     "admin": broker.admin_port, "http": broker.http_port},
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
        check_security_files(config)  # a bad file is a one-line error, not a traceback
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
