"""A metadata-only cluster member: ``python -m mqttring.raft.member``.

It runs ``MetadataService`` and nothing else (no MQTT listener, no store), for tests,
benchmarks and for operating the metadata layer on its own.  It holds no shard data, so
it claims the shards it is catching up on at once (``CatchUp.NOTHING_TO_COPY``) unless
``--manual-catch-up`` is given, in which case something else must send ``caught_up``.

``--ready-file F`` writes ``{"node_id", "cluster", "raft", "pid", "epoch"}`` as JSON once the
node is a member (written atomically, so a reader never sees half a file).  SIGTERM and
SIGINT leave the cluster gracefully (shards handed away, then out of Raft); kill -9 is
what failure detection is for.  Before the process is a member (importing, starting Raft,
joining) a SIGTERM/SIGINT stops it at once, exit 0: they are held from its first line
(``mqttring.stop_signals``), as ``python -m mqttring.node`` does, so that a signal that
comes while it still imports is neither a traceback nor a death by signal.  SIGHUP is
logged and otherwise ignored (there is nothing to reload).
"""

from __future__ import annotations

from mqttring.stop_signals import HELD, HeldSignals, hold

#: Run as ``python -m mqttring.raft.member``: stop signals are held from here, before the
#: imports below (most of the process's first second).  Imported as a module: nothing.
_HELD_AT_START: HeldSignals | None = hold() if __name__ == "__main__" else None

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
from mqttring.errors import JoinError, describe_error, sole_exception
from mqttring.raft.service import CatchUp, CommitError, MetadataService
from mqttring.raft.view import ClusterView
from mqttring.rpc import AuthError, RpcError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mqttring.raft.member", description=__doc__)
    p.add_argument("--node-id", required=True)
    p.add_argument("--cluster", required=True, help="HOST:PORT of the cluster RPC")
    p.add_argument("--raft", required=True, help="HOST:PORT of pysyncobj (fixed port)")
    p.add_argument("--data-dir", required=True, type=Path)
    p.add_argument("--join", help="HOST:PORT of any member's cluster address")
    p.add_argument("--join-timeout", type=float, default=30.0,
                   help="seconds to keep asking --join before giving up")
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


async def serve(service: MetadataService, ready_file: Path | None,
                held: HeldSignals | None = None) -> None:
    """Run ``service`` until a stop signal or a remote leave.

    The signal receiver opens before anything starts, and what ``held`` recorded before trio
    ran is taken right after it: a stop signal before the service is a member (still
    joining, say) stops it at once (it has nothing to hand away); once it is a member, it
    leaves first.
    """
    log = logging.getLogger(__name__)
    with trio.open_signal_receiver(*HELD) as signals:
        async with trio.open_nursery() as nursery:
            member = trio.Event()

            async def run_service(task_status: trio.TaskStatus[ClusterView]) -> None:
                await service.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # run returns after a remote "leave": exit too

            async def start() -> None:
                view = await nursery.start(run_service)
                if ready_file is not None:
                    tmp = ready_file.with_suffix(".tmp")
                    tmp.write_text(json.dumps({
                        "node_id": service.node_id, "cluster": service._cluster_address,
                        "raft": service.config.raft, "pid": os.getpid(),
                        "epoch": view.epoch}))
                    tmp.replace(ready_file)
                member.set()

            # After the receiver is open, so that no signal falls between the two.
            early = [s for s in (held.take() if held is not None else [])
                     if s != signal.SIGHUP]
            if early:
                log.info("signal %s: stopping (starting)", signal.Signals(early[0]).name)
                nursery.cancel_scope.cancel()
                return
            nursery.start_soon(start)
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    log.info("signal %s: nothing to reload in a metadata-only member", name)
                    continue
                if not member.is_set():
                    log.info("signal %s: stopping (starting)", name)
                    nursery.cancel_scope.cancel()
                    return
                log.info("signal %s: leaving the cluster", name)
                try:
                    with trio.move_on_after(service.config.leave_timeout + 10):
                        await service.leave()
                except (CommitError, RpcError, trio.TooSlowError) as exc:
                    # No majority to leave through: stop anyway, failure detection follows.
                    log.warning("leave did not complete: %s", describe_error(exc))
                nursery.cancel_scope.cancel()
                return


def main(argv: list[str] | None = None) -> int:
    held = hold()  # already, when run as a command (idempotent)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s {args.node_id} %(name)s %(levelname)s %(message)s")
    try:
        config = BrokerConfig(
            node_id=args.node_id, mqtt="127.0.0.1:0", data_dir=args.data_dir,
            cluster=args.cluster, raft=args.raft, join=args.join, cluster_secret=args.secret,
            num_shards=args.num_shards, replication=args.replication,
            heartbeat_interval=args.heartbeat_interval, failure_grace=args.failure_grace,
            node_weight=args.weight, join_timeout=args.join_timeout,
        )
        catch_up = CatchUp.DATA_PLANE if args.manual_catch_up else CatchUp.NOTHING_TO_COPY
        service = MetadataService(config, tls=cluster_tls(config), catch_up=catch_up)
        service.advertise_mqtt(None)  # no MQTT listener here
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(serve, service, args.ready_file, held)
    except Exception as exc:
        error = sole_exception(exc)
        if not isinstance(error, OSError | ConfigError | trio.TooSlowError | RpcError
                          | AuthError | CommitError | JoinError):
            raise  # a bug: its traceback
        # The operator's to fix (a busy port, a join nobody answered): one line.
        logging.getLogger(__name__).debug("member failed", exc_info=exc)
        print(f"error: cannot run member {args.node_id}: {describe_error(error)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
