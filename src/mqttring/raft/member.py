"""A metadata-only cluster member: ``python -m mqttring.raft.member``.

It runs ``MetadataService`` and nothing else (no MQTT listener, no store), for tests,
benchmarks and for operating the metadata layer on its own.  It holds no shard data, so
it claims the shards it is catching up on at once (``CatchUp.NOTHING_TO_COPY``) unless
``--manual-catch-up`` is given, in which case something else must send ``caught_up``.

``--ready-file F`` writes ``{"node_id", "cluster", "raft", "pid", "epoch"}`` as JSON once the
node is a member (written atomically, so a reader never sees half a file).  SIGTERM and
SIGINT leave the cluster gracefully (shards handed away, then out of Raft); kill -9 is
what failure detection is for.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

import trio

from mqttring.cluster_tls import cluster_tls
from mqttring.config import BrokerConfig, ConfigError
from mqttring.errors import describe_error
from mqttring.raft.service import CatchUp, CommitError, MetadataService
from mqttring.raft.view import ClusterView
from mqttring.rpc import RpcError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mqttring.raft.member", description=__doc__)
    p.add_argument("--node-id", required=True)
    p.add_argument("--cluster", required=True, help="HOST:PORT of the cluster RPC")
    p.add_argument("--raft", required=True, help="HOST:PORT of pysyncobj (fixed port)")
    p.add_argument("--data-dir", required=True, type=Path)
    p.add_argument("--join", help="HOST:PORT of any member's cluster address")
    p.add_argument("--secret", help="cluster secret (else $MQTTRING_CLUSTER_SECRET)")
    p.add_argument("--num-shards", type=int, default=1024)
    p.add_argument("--replication", type=int, default=2)
    p.add_argument("--heartbeat-interval", type=float, default=0.5)
    p.add_argument("--failure-grace", type=float, default=5.0)
    p.add_argument("--weight", type=int, default=1)
    p.add_argument("--manual-catch-up", action="store_true")
    p.add_argument("--ready-file", type=Path)
    p.add_argument("--log-level", default="INFO")
    return p


async def serve(service: MetadataService, ready_file: Path | None) -> None:
    async with trio.open_nursery() as nursery:

        async def run_service(task_status: trio.TaskStatus[ClusterView]) -> None:
            await service.run(task_status=task_status)
            nursery.cancel_scope.cancel()  # run returns after a remote "leave": exit too

        view = await nursery.start(run_service)
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({
                "node_id": service.node_id, "cluster": service._cluster_address,
                "raft": service.config.raft, "pid": os.getpid(), "epoch": view.epoch}))
            tmp.replace(ready_file)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                try:
                    with trio.move_on_after(service.config.leave_timeout + 10):
                        await service.leave()
                except (CommitError, RpcError, trio.TooSlowError) as exc:
                    # No majority to leave through: stop anyway, failure detection follows.
                    logging.getLogger(__name__).warning("leave did not complete: %s",
                                                        describe_error(exc))
                nursery.cancel_scope.cancel()
                return


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s {args.node_id} %(name)s %(levelname)s %(message)s")
    try:
        config = BrokerConfig(
            node_id=args.node_id, mqtt="127.0.0.1:0", data_dir=args.data_dir,
            cluster=args.cluster, raft=args.raft, join=args.join, cluster_secret=args.secret,
            num_shards=args.num_shards, replication=args.replication,
            heartbeat_interval=args.heartbeat_interval, failure_grace=args.failure_grace,
            node_weight=args.weight,
        )
        catch_up = CatchUp.DATA_PLANE if args.manual_catch_up else CatchUp.NOTHING_TO_COPY
        service = MetadataService(config, tls=cluster_tls(config), catch_up=catch_up)
        service.advertise_mqtt(None)  # no MQTT listener here
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trio.run(serve, service, args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
