"""``mqttring spark topic-stats``: the PySpark job as an operator command.

Input checks happen before the JVM starts (a missing or corrupt snapshot or export is
reported in a second, as one line, not after Spark's start-up and a Java stack trace).  A
local ``--input`` may be a snapshot (or snapshot set) instead of an export: it is exported
to ``<out>/export`` first, which keeps "snapshot, then stats" one command for a single
machine.  Remote inputs (``hdfs://``, ``s3a://``...) must already be exports; Spark reads
them and its errors are reduced to their first line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mqttring.analytics import ExportError


def _error(message: str) -> int:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 1


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer option of at least ``minimum``.

    Numeric options are checked by the parser, before anything else runs: a value that only
    fails once it reaches Spark (``--top -1`` in a ``limit``, ``--shuffle-partitions 0`` in
    the session) would fail after the job wrote its results, and the rerun with the value
    fixed would then be refused because ``--out`` is no longer empty.  A bad value is a
    usage error like any other of this command: argparse's one ``error:`` line, exit 2.
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _local(path: str) -> Path:
    return Path(path.removeprefix("file://"))


def prepare_input(input_path: str, out: str, progress: bool) -> str:
    """Validate ``--input`` (export or snapshot) and return the export path Spark reads."""
    from mqttring.analytics.export import (
        EXPORT_MANIFEST,
        export_snapshot,
        read_export_manifest,
    )

    if not _is_local(input_path):
        return input_path
    local = _local(input_path)
    if not local.is_dir():
        raise ExportError(f"input {local} does not exist or is not a directory")
    if (local / EXPORT_MANIFEST).exists():
        read_export_manifest(local, verify=True)
        return str(local.resolve())
    if _is_local(out):
        dest = _local(out) / "export"
        export_snapshot(local, dest, progress=progress)
        return str(dest.resolve())
    raise ExportError(f"{input_path} is a snapshot and --out is not local: run `mqttring "
                      f"export` first and put the export where the executors can read it")


def cmd_topic_stats(args: argparse.Namespace) -> int:
    if args.shuffle_partitions is None and args.master.startswith("local"):
        # Spark's default of 200 shuffle partitions costs seconds of task overhead per stage
        # on one machine for results that are one row per topic.
        args.shuffle_partitions = 16
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return _error("this command needs PySpark: pip install 'mqttring[spark]'")
    if _is_local(args.out):
        out = _local(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            return _error(f"--out {out} exists and is not empty; results are never mixed")
    try:
        export_path = prepare_input(args.input, args.out, progress=not args.no_progress)
    except ExportError as exc:
        return _error(str(exc))
    except OSError as exc:
        return _error(f"{type(exc).__name__}: {exc}")

    from pyspark.sql import SparkSession

    from mqttring.spark.jobs import OUTPUTS, build_session, format_summary, run_topic_stats

    out_uri = str(_local(args.out).resolve()) if _is_local(args.out) else args.out
    # Called from a program that already runs a session (a notebook, the tests): use it and
    # leave it running; --master and --shuffle-partitions then do not apply.
    active = SparkSession.getActiveSession()
    try:
        spark = active or build_session(args.master, shuffle_partitions=args.shuffle_partitions)
    except Exception as exc:  # JVM missing, bad master URL: Py4J/Spark raise many types
        return _error(f"cannot start Spark (--master {args.master}): "
                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}")
    try:
        stats = run_topic_stats(spark, export_path, out_uri, depth=args.depth)
        print(format_summary(stats, top=args.top))
        print(f"\nwritten: {', '.join(f'{out_uri}/{n}' for n in OUTPUTS)}")
    except ExportError as exc:
        return _error(str(exc))
    except Exception as exc:  # a Spark job failure: its first line is what matters
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        return _error(f"Spark job failed: {type(exc).__name__}: {first}")
    finally:
        if active is None:
            spark.stop()
    return 0


def register(subparsers: Any) -> None:
    spark = subparsers.add_parser("spark", help="PySpark analytics over exports (mqttring[spark])")
    jobs = spark.add_subparsers(dest="job", required=True)
    ts = jobs.add_parser(
        "topic-stats",
        help="per topic / prefix traffic, per client backlog, retained inventory")
    ts.add_argument("--input", required=True, metavar="DIR",
                    help="an export (`mqttring export --out`), or a local snapshot")
    ts.add_argument("--out", required=True, metavar="DIR", help="new directory for the results")
    ts.add_argument("--master", default="local[*]",
                    help="Spark master URL (local[*], spark://host:7077, yarn, k8s://...)")
    ts.add_argument("--depth", type=int_at_least(1), default=1,
                    help="topic levels per prefix (default 1)")
    ts.add_argument("--top", type=int_at_least(0), default=10,
                    help="rows per section of the printed table")
    ts.add_argument("--shuffle-partitions", type=int_at_least(1), default=None,
                    help="spark.sql.shuffle.partitions (default: 16 with a local master, "
                         "else Spark's own default)")
    ts.add_argument("--no-progress", action="store_true",
                    help="no progress bar when a snapshot is exported first")
    ts.set_defaults(func=cmd_topic_stats)
