"""``mqttring snapshot`` and ``mqttring export``: the operator's side of the analytics path.

Both are used by people and by scripts, so a failure is one line on stderr naming the cause
and a non-zero exit code (1 for bad input or an unreachable node, 2 for usage), never a
traceback: a corrupt snapshot is the operator's problem to fix, not a bug to report.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import trio

from mqttring.analytics import ExportError
from mqttring.cluster_tls import add_client_arguments, client_context_from_args
from mqttring.config import ConfigError
from mqttring.config_fields import positive_seconds
from mqttring.rpc import SECRET_ENV, AuthError, ProtocolError, RpcError


def _error(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 1


def _failure(exc: BaseException, timeout: float) -> str:
    """What went wrong talking to a node, in the operator's terms.  The exceptions' own
    words are not enough: ``TooSlowError`` has none, and a bare "connection closed by peer"
    (what a port that is not an mqttring admin port does) does not say what to check."""
    if isinstance(exc, trio.TooSlowError):
        return (f"no answer within {timeout:g} s (is the node up and this its cluster/admin "
                f"address? a large snapshot may need a longer --timeout)")
    if isinstance(exc, EOFError | trio.BrokenResourceError):
        said = str(exc) or "connection closed by peer"
        return f"{said}: is this the node's cluster/admin address?"
    if isinstance(exc, ProtocolError):
        return f"not an mqttring admin port? ({exc})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def cmd_snapshot(args: argparse.Namespace) -> int:
    from mqttring.analytics.snapshot import SNAPSHOT_SET, take_snapshots

    secret = args.secret or os.environ.get(SECRET_ENV)
    if not secret:
        return _error(f"give --secret or set ${SECRET_ENV}")
    out = Path(os.path.abspath(args.out))
    try:
        tls = client_context_from_args(args)
    except ConfigError as exc:
        return _error(str(exc))
    try:
        replies = take_snapshots(args.node, secret, out, all_nodes=args.all,
                                 timeout=args.timeout, tls=tls)
    except AuthError as exc:
        return _error(f"{args.node}: authentication refused ({exc}); check the secret")
    except RpcError as exc:
        return _error(f"{args.node}: the node refused: {exc}")
    except (OSError, EOFError, trio.TooSlowError, trio.BrokenResourceError, ProtocolError,
            KeyError, RuntimeError) as exc:
        return _error(f"{args.node}: {_failure(exc, args.timeout)}")
    except ConfigError:
        raise  # a bad --node address: a usage error, one line and exit 2 (``main``)
    except Exception as exc:  # a reply of an unexpected shape, say: still one line
        return _error(f"{args.node}: unexpected failure: {_failure(exc, args.timeout)}")
    if args.all and not (out / SNAPSHOT_SET).exists():
        print(f"note: {out} is not visible here, so {SNAPSHOT_SET} (the shard owners) was not "
              f"written; the export will keep the fullest copy of each shard instead",
              file=sys.stderr)
    for r in replies:
        rows = {db: e["rows"] for db, e in r.manifest["databases"].items()}
        summary = ", ".join(f"{db} {n}" for db, n in rows.items() if n)
        print(f"{r.node_id}: {r.path} (sequence {r.manifest['sequence']}; "
              f"{summary or 'empty'})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    try:
        from mqttring.analytics.export import export_snapshot
    except ImportError as exc:  # pyarrow missing
        return _error(f"export needs pyarrow ({exc}); pip install 'mqttring[spark]'")
    try:
        result = export_snapshot(Path(args.snapshot), Path(args.out),
                                 progress=not args.no_progress)
    except ExportError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"{type(exc).__name__}: {exc}")
    rate = result.total_rows / result.seconds if result.seconds > 0 else 0.0
    tables = ", ".join(f"{t} {n}" for t, n in result.rows.items())
    print(f"exported {result.total_rows} rows ({tables}) in {result.files} files to "
          f"{result.out} in {result.seconds:.2f} s ({rate:,.0f} rows/s)")
    return 0


def register(subparsers: Any) -> None:
    snap = subparsers.add_parser(
        "snapshot", help="consistent point-in-time snapshot of a node (or the whole cluster)")
    snap.add_argument("--node", required=True, metavar="HOST:PORT",
                      help="the node's admin address (cluster address, or --admin of a single "
                           "node)")
    snap.add_argument("--out", required=True, metavar="DIR",
                      help="directory on the node's filesystem; each node writes DIR/<node id>/")
    snap.add_argument("--all", action="store_true",
                      help="snapshot every member that is up (through --node's cluster view)")
    snap.add_argument("--secret", help=f"cluster secret (else ${SECRET_ENV})")
    add_client_arguments(snap)
    snap.add_argument("--timeout", type=positive_seconds, default=300.0,
                      help="seconds to wait for each node's snapshot")
    snap.set_defaults(func=cmd_snapshot)

    exp = subparsers.add_parser(
        "export", help="write a snapshot (or snapshot set) as Parquet, one file per shard")
    exp.add_argument("--snapshot", required=True, metavar="DIR",
                     help="a node snapshot, or the --out directory of `mqttring snapshot`")
    exp.add_argument("--out", required=True, metavar="DIR", help="new directory for Parquet")
    exp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    exp.set_defaults(func=cmd_export)
