"""``python -m mqttring.node`` / ``mqttring node``: run one broker node until a signal.

Settings come from defaults, then ``--config FILE`` (TOML), then ``MQTTRING_*`` environment
variables, then flags, later winning, all checked against the one schema of
``mqttring.config`` before anything starts (a bad one: one line on stderr, exit 2).  With
``--cluster`` the node also runs the cluster metadata service (Raft) next to the broker; on
SIGINT/SIGTERM it leaves the cluster (handing its shards away) before it stops, and SIGHUP
reloads what may change live from the config file (``mqttring.lifecycle``).  Every way it
ends is one log or stderr line and an ``ExitCode``, never a traceback for an operator.

``--ready-file PATH`` writes ``{"mqtt": port, "ws": port, "mqtts": port, "wss": port,
"pid": pid, ...}`` once the node listens; tests and the benchmark harness use it with port 0
to learn the real ports without sleeping or polling a socket.
"""

from __future__ import annotations

from mqttring.stop_signals import HeldSignals, hold

#: Run as ``python -m mqttring.node``: stop signals are held from here on, before the
#: imports below (a second of a process's start), so that a signal at any moment of the
#: start is a clean stop (``mqttring.stop_signals``).  Imported as a module: nothing yet
#: (``main``/``run`` hold them when they run a node).
_HELD_AT_START: HeldSignals | None = hold() if __name__ == "__main__" else None

import argparse
import gc
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from mqttring import __version__
from mqttring.broker.files import NodeFiles
from mqttring.config import BrokerConfig, ConfigError, flag_overrides
from mqttring.errors import JoinError, describe_error, sole_exception
from mqttring.lifecycle import ConfigLoader, ExitCode, NodeLifecycle, Stage
from mqttring.logs import FORMATS, LEVELS, setup_logging
from mqttring.lsm import StoreError
from mqttring.rpc import AuthError
from mqttring.workers import run_workers, worker_count

log = logging.getLogger("mqttring.node")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML file with settings")
    parser.add_argument("--node-id", help="unique name of this node (default node1)")
    parser.add_argument("--mqtt", help="MQTT TCP listener HOST:PORT (default 127.0.0.1:1883; "
                        "'' turns it off)")
    parser.add_argument("--ws", help="MQTT over WebSocket listener HOST:PORT (off by default; "
                        "'' turns it off)")
    parser.add_argument("--mqtts", help="MQTT over TLS listener HOST:PORT (off by default)")
    parser.add_argument("--wss", help="MQTT over WebSocket over TLS HOST:PORT (off by default)")
    parser.add_argument("--certfile", help="PEM server certificate for mqtts/wss")
    parser.add_argument("--keyfile", help="PEM private key of --certfile")
    parser.add_argument("--cafile", help="PEM CA that signs client certificates")
    parser.add_argument("--crlfile", help="PEM revocation list of --cafile's certificates")
    parser.add_argument("--require-certificate", action="store_true", default=None,
                        help="TLS clients must present a certificate signed by --cafile")
    parser.add_argument("--data-dir", help="where the node store lives (./data)")
    parser.add_argument("--sys-interval", help="seconds between $SYS updates")
    parser.add_argument("--cluster", help="HOST:PORT for inter-node links and the admin RPC")
    parser.add_argument("--admin", help="single node: HOST:PORT of the admin RPC (snapshots)")
    parser.add_argument("--raft", help="HOST:PORT for Raft (default: cluster port + 1)")
    parser.add_argument("--join", help="HOST:PORT (cluster address) of any existing member")
    parser.add_argument("--join-timeout",
                        help="seconds to keep asking the members to join through before "
                             "giving up (default 30)")
    parser.add_argument("--cluster-secret",
                        help="shared secret of the cluster (or env MQTTRING_CLUSTER_SECRET)")
    parser.add_argument("--http", help="HTTP API, /metrics and dashboard HOST:PORT (off by "
                                       "default; token in env MQTTRING_HTTP_TOKEN)")
    parser.add_argument("--password-file",
                        help="mosquitto-format password file (mqttring passwd)")
    parser.add_argument("--acl-file", help="mosquitto-format ACL file")
    parser.add_argument("--cluster-cafile",
                        help="cluster CA (PEM): mutual TLS on the cluster address")
    parser.add_argument("--cluster-certfile",
                        help="this node's certificate, signed by --cluster-cafile (PEM)")
    parser.add_argument("--cluster-keyfile", help="its private key (PEM)")
    parser.add_argument("--replication", help="replicas per shard (default 2)")
    parser.add_argument("--num-shards", help="shards, fixed when a cluster forms")
    parser.add_argument("--ready-file", type=Path, help="write bound ports as JSON here")
    parser.add_argument("--log-level", choices=LEVELS,
                        help="debug, info, warning or error (default info; SIGHUP reloads "
                             "log_level from the config file)")
    parser.add_argument("--log-file",
                        help="append the log here instead of stderr (reopened when rotated)")
    parser.add_argument("--log-format", choices=FORMATS,
                        help="text (default) or json: one JSON object per line")
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
        "mqtts": args.mqtts,
        "wss": args.wss,
        "certfile": args.certfile,
        "keyfile": args.keyfile,
        "cafile": args.cafile,
        "crlfile": args.crlfile,
        "require_certificate": args.require_certificate,
        "data_dir": args.data_dir,
        "sys_interval": args.sys_interval,
        "cluster": args.cluster,
        "admin": args.admin,
        "raft": args.raft,
        "join": args.join,
        "join_timeout": args.join_timeout,
        "cluster_secret": args.cluster_secret,
        "cluster_cafile": args.cluster_cafile,
        "cluster_certfile": args.cluster_certfile,
        "cluster_keyfile": args.cluster_keyfile,
        "replication": args.replication,
        "http": args.http,
        "password_file": args.password_file,
        "acl_file": args.acl_file,
        "num_shards": args.num_shards,
        "reuse_port": args.reuse_port,
        "leave_on_stop": None if args.stay_on_stop is None else not args.stay_on_stop,
        "log_level": args.log_level,
        "log_file": args.log_file,
        "log_format": args.log_format,
    }
    overrides = flag_overrides(overrides)
    if args.config is not None:
        return BrokerConfig.from_toml(args.config, **overrides)
    return BrokerConfig.from_mapping({}, **overrides)


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


def reloaded_config(args: argparse.Namespace) -> BrokerConfig:
    """The configuration a SIGHUP reads: as at start-up, except that an empty file is
    refused (``ConfigError``: the running settings stay).  A file caught empty while it is
    being rewritten, or truncated by a failed deploy, reads as all defaults, which open the
    node (anonymous clients in, no password file, no ACL): a security probe turned a locked
    node open that way.  At start-up an empty file still means the defaults."""
    path = args.config
    try:
        blank = path is not None and not path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        blank = False  # config_from_args says what is wrong with it
    if blank:
        raise ConfigError(f"{path} is empty (being written?); send SIGHUP again once it "
                          "holds the settings")
    return config_from_args(args)


def make_lifecycle(config: BrokerConfig, ready_file: Path | None = None,
                   reload_config: ConfigLoader | None = None,
                   files: NodeFiles | None = None,
                   held: HeldSignals | None = None) -> NodeLifecycle:
    """The node process's lifecycle (``mqttring.lifecycle``: what each signal does when);
    ``files``: what ``config`` names, loaded already (None: the broker loads it); ``held``:
    signals that came before trio ran, for the lifecycle to act on."""
    def started() -> None:
        if config.gc_freeze:
            gc.freeze()  # modules and start-up state: never garbage, never walked again

    return NodeLifecycle(config, ready_file=ready_file, reload_config=reload_config,
                         on_started=started, files=files, held=held)


def run(args: argparse.Namespace) -> int:
    # What the node writes (its store of sessions and messages, the Raft journal with the
    # cluster's membership, workers.json with the generated cluster secret, its log) is
    # for its own user only, whatever umask it was started with (022 made them 0644).
    os.umask(os.umask(0o077) | 0o077)
    # Already held when started as a command (idempotent); from here for other callers.
    held = hold()
    try:
        config = config_from_args(args)
        if args.workers > 1 and config.http is not None:
            # Every worker would bind that one port (the second fails and the supervisor
            # gives up after starting them all): refused before anything starts.
            raise ConfigError(f"http = {config.http}: not with --workers ({args.workers} "
                              "node processes cannot share one HTTP port); query any node "
                              "of a cluster started without --workers instead")
        # Loaded here, before logging is set up or anything is bound, so that a bad
        # password/ACL file or certificate is one line and exit 2; the broker then uses
        # these loaded files instead of reading them again (``mqttring.broker.files``).
        files = NodeFiles.load(config)
    except ConfigError as exc:
        print(f"mqttring: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        setup_logging(config.log_level, config.log_file, config.log_format)
    except OSError as exc:
        print(f"mqttring: cannot open log file {config.log_file}: {exc.strerror or exc}",
              file=sys.stderr)
        return ExitCode.CONFIG
    if args.workers > 1:
        # The supervisor serves nothing: each worker process loads the files for itself.
        return run_workers(config, args.workers, args, held)
    tune_gc(config)
    reload_config = None if args.config is None else partial(reloaded_config, args)
    lifecycle = make_lifecycle(config, args.ready_file, reload_config, files, held)
    try:
        return int(trio.run(lifecycle.run))
    except BaseException as exc:  # one line for the operator, not a traceback
        error = _store_failure(exc) or sole_exception(exc)
        if isinstance(error, KeyboardInterrupt):
            return ExitCode.OK
        # AuthError: a member refused our certificate or secret, or we refused its
        # certificate (a join with another CA's files): the operator's to fix, not a bug.
        # JoinError: no member answered within join_timeout (the message says whom).
        expected = isinstance(error, OSError | ConfigError | trio.TooSlowError | AuthError
                              | StoreError | JoinError)
        # Expected failures: the traceback at debug only; anything else is a bug: log it.
        log.log(logging.DEBUG if expected else logging.ERROR, "node failed", exc_info=exc)
        what = "cannot start node" if lifecycle.stage is Stage.STARTING else "node failed"
        print(f"mqttring: {what}: {describe_error(error)}", file=sys.stderr)
        return ExitCode.STORE_FAILED if isinstance(error, StoreError) else ExitCode.FAILED


def _store_failure(exc: BaseException) -> StoreError | None:
    """The store failure that stopped the node, if that is all that went wrong (several
    tasks may have met it before the node stopped)."""
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(StoreError)
        if matched is None or rest is not None:
            return None
        leaf: BaseException = matched
        while isinstance(leaf, BaseExceptionGroup):
            leaf = leaf.exceptions[0]
        exc = leaf
    return exc if isinstance(exc, StoreError) else None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("node", help="run a broker node")
    add_arguments(parser)
    # ``holds_signals``: ``mqttring.cli`` keeps the stop signals it held while importing.
    parser.set_defaults(func=run, holds_signals=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqttring.node", description=__doc__)
    parser.add_argument("--version", action="version", version=f"mqttring {__version__}")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
