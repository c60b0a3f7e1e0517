"""PySpark jobs over an export (``mqttring export``): plain functions over a SparkSession.

Theory of operation
-------------------
Every job is a function from DataFrames to a DataFrame, so users compose them with their own
Spark code (``read_export`` → ``topic_stats`` → their join); ``run_topic_stats`` is the
composition the ``mqttring spark topic-stats`` command runs.  Nothing here collects rows to
the driver except ``format_summary``, which takes the first few rows of results that are
already aggregated.

The export is read through its manifest (EXPORT.json), never by listing directories: the
manifest names exactly the files of the export, so a stray or half-copied file next to them
cannot be counted, and a table with no rows becomes an empty DataFrame with its documented
schema instead of a "cannot infer schema" error.  The manifest is read through Spark itself
(``wholetext``), so ``--input`` may be any path Spark can read: a local directory with a
local master, or HDFS / S3 / a shared mount when executors run elsewhere.

Only built-in column functions are used (no Python UDFs): executors then need no Python
worker round-trips per row, which matters at millions of archived messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from mqttring.analytics import ExportError

_TS = T.TimestampType()

#: The export schemas (``mqttring.analytics.schemas``) as Spark sees them.
SCHEMAS: dict[str, T.StructType] = {
    "retained": T.StructType([
        T.StructField("node_id", T.StringType(), False),
        T.StructField("shard", T.IntegerType(), False),
        T.StructField("topic", T.StringType(), False),
        T.StructField("payload", T.BinaryType(), False),
        T.StructField("payload_bytes", T.LongType(), False),
        T.StructField("qos", T.IntegerType(), False),
    ]),
    "sessions": T.StructType([
        T.StructField("node_id", T.StringType(), False),
        T.StructField("shard", T.IntegerType(), False),
        T.StructField("client_id", T.StringType(), False),
        T.StructField("subscriptions", T.ArrayType(T.StructType([
            T.StructField("filter", T.StringType(), False),
            T.StructField("qos", T.IntegerType(), False),
        ]), True), False),
        T.StructField("subscription_count", T.IntegerType(), False),
    ]),
    "queued": T.StructType([
        T.StructField("node_id", T.StringType(), False),
        T.StructField("shard", T.IntegerType(), False),
        T.StructField("client_id", T.StringType(), False),
        T.StructField("seq", T.LongType(), False),
        T.StructField("topic", T.StringType(), False),
        T.StructField("payload", T.BinaryType(), False),
        T.StructField("payload_bytes", T.LongType(), False),
        T.StructField("qos", T.IntegerType(), False),
        T.StructField("retain", T.BooleanType(), False),
        T.StructField("packet_id", T.IntegerType(), True),
        T.StructField("state", T.StringType(), False),
        T.StructField("expires_at", _TS, True),
    ]),
    "archive": T.StructType([
        T.StructField("node_id", T.StringType(), False),
        T.StructField("shard", T.IntegerType(), False),
        T.StructField("time", _TS, False),
        T.StructField("time_ns", T.LongType(), False),
        T.StructField("seq", T.LongType(), False),
        T.StructField("topic", T.StringType(), False),
        T.StructField("payload", T.BinaryType(), False),
        T.StructField("payload_bytes", T.LongType(), False),
        T.StructField("qos", T.IntegerType(), False),
        T.StructField("retain", T.BooleanType(), False),
    ]),
}


@dataclass(frozen=True)
class ExportTables:
    """The four tables of one export as DataFrames, plus its manifest."""

    retained: DataFrame
    sessions: DataFrame
    queued: DataFrame
    archive: DataFrame
    manifest: dict[str, Any]


@dataclass(frozen=True)
class TopicStats:
    """Results of ``run_topic_stats`` (each also written as Parquet under ``out``)."""

    topics: DataFrame
    prefixes: DataFrame
    clients: DataFrame
    retained: DataFrame
    depth: int


def build_session(master: str = "local[*]", app_name: str = "mqttring-topic-stats",
                  shuffle_partitions: int | None = None,
                  conf: dict[str, str] | None = None) -> SparkSession:
    """A SparkSession with quiet logs; ``shuffle_partitions`` small for small local jobs."""
    builder = SparkSession.builder.master(master).appName(app_name)
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    if shuffle_partitions is not None:
        builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def read_export(spark: SparkSession, path: str) -> ExportTables:
    """The export at ``path`` (any Spark-readable URI), read through its manifest."""
    from mqttring.analytics.export import EXPORT_MANIFEST, check_export_manifest

    try:
        text = spark.read.text(_join(path, EXPORT_MANIFEST), wholetext=True).first()
    except Exception as exc:  # Spark raises AnalysisException subclasses per version
        raise ExportError(f"{path}: cannot read {EXPORT_MANIFEST} "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                          ) from None
    try:
        manifest = json.loads(text[0]) if text is not None else None
    except ValueError as exc:
        raise ExportError(f"{path}: {EXPORT_MANIFEST} is not JSON ({exc})") from None
    check_export_manifest(manifest, path)
    frames: dict[str, DataFrame] = {}
    for table, schema in SCHEMAS.items():
        entry = manifest["tables"].get(table, {"files": []})
        files = [_join(path, f["path"]) for f in entry["files"]]
        if files:
            frames[table] = spark.read.schema(schema).parquet(*files)
        else:
            frames[table] = spark.createDataFrame([], schema)
    return ExportTables(manifest=manifest, **frames)


def topic_prefix(topic: Column, depth: int) -> Column:
    """The first ``depth`` levels of a topic name (all of it when it has fewer levels)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    return F.concat_ws("/", F.slice(F.split(topic, "/", -1), 1, depth))


def _traffic(grouped: Any, *extra: Column) -> DataFrame:
    """Count, bytes, first/last seen (exact ns and as timestamps), messages per minute."""
    df = grouped.agg(
        F.count(F.lit(1)).alias("messages"),
        F.sum("payload_bytes").alias("bytes"),
        F.min("time_ns").alias("first_seen_ns"),
        F.max("time_ns").alias("last_seen_ns"),
        F.min("time").alias("first_seen"),
        F.max("time").alias("last_seen"),
        *extra,
    )
    span_ns = F.col("last_seen_ns") - F.col("first_seen_ns")
    # Over the observed span; undefined (null) when the span is zero (one message).
    return df.withColumn("messages_per_minute",
                         F.when(span_ns > 0, F.col("messages") * F.lit(60e9) / span_ns))


def topic_stats(archive: DataFrame) -> DataFrame:
    """Per archived topic: messages, bytes, first/last seen, messages per minute."""
    return _traffic(archive.groupBy("topic")).orderBy(F.desc("messages"), "topic")


def prefix_stats(archive: DataFrame, depth: int) -> DataFrame:
    """The same per topic prefix of ``depth`` levels, with how many topics each holds."""
    with_prefix = archive.withColumn("prefix", topic_prefix(F.col("topic"), depth))
    return (_traffic(with_prefix.groupBy("prefix"), F.countDistinct("topic").alias("topics"))
            .withColumn("depth", F.lit(depth))
            .orderBy(F.desc("messages"), "prefix"))


def client_backlog(sessions: DataFrame, queued: DataFrame) -> DataFrame:
    """Per persistent client: messages and bytes waiting for it (0 when nothing is queued).

    ``queued`` counts messages not yet sent; ``inflight`` those sent and awaiting an ack.
    """
    backlog = queued.groupBy("client_id").agg(
        F.count(F.lit(1)).alias("backlog_messages"),
        F.sum("payload_bytes").alias("backlog_bytes"),
        F.sum(F.when(F.col("state") == "queued", 1).otherwise(0)).alias("queued"),
        F.sum(F.when(F.col("state") != "queued", 1).otherwise(0)).alias("inflight"),
        F.min("seq").alias("oldest_seq"),
    )
    clients = sessions.select("client_id", "shard", "subscription_count")
    # Full outer: queued rows of a client whose session row is missing still show up.
    joined = clients.join(backlog, "client_id", "full_outer")
    zero = F.lit(0).cast("long")
    return (joined
            .withColumn("backlog_messages", F.coalesce("backlog_messages", zero))
            .withColumn("backlog_bytes", F.coalesce("backlog_bytes", zero))
            .withColumn("queued", F.coalesce("queued", zero))
            .withColumn("inflight", F.coalesce("inflight", zero))
            .orderBy(F.desc("backlog_messages"), "client_id"))


def retained_inventory(retained: DataFrame, depth: int) -> DataFrame:
    """Retained messages per topic prefix: how many, their bytes, the largest, QoS mix."""
    return (retained.withColumn("prefix", topic_prefix(F.col("topic"), depth))
            .groupBy("prefix")
            .agg(F.count(F.lit(1)).alias("retained_messages"),
                 F.sum("payload_bytes").alias("bytes"),
                 F.max("payload_bytes").alias("largest_bytes"),
                 F.sum(F.when(F.col("qos") == 0, 1).otherwise(0)).alias("qos0"),
                 F.sum(F.when(F.col("qos") == 1, 1).otherwise(0)).alias("qos1"),
                 F.sum(F.when(F.col("qos") == 2, 1).otherwise(0)).alias("qos2"))
            .withColumn("depth", F.lit(depth))
            .orderBy(F.desc("retained_messages"), "prefix"))


def compute_topic_stats(tables: ExportTables, depth: int = 1) -> TopicStats:
    """All four results as (lazy) DataFrames, without writing anything."""
    return TopicStats(
        topics=topic_stats(tables.archive),
        prefixes=prefix_stats(tables.archive, depth),
        clients=client_backlog(tables.sessions, tables.queued),
        retained=retained_inventory(tables.retained, depth),
        depth=depth,
    )


#: Output directory names under ``out``, one Parquet dataset each.
OUTPUTS = ("topics", "prefixes", "clients", "retained")


def run_topic_stats(spark: SparkSession, input_path: str, out: str | None,
                    depth: int = 1) -> TopicStats:
    """Read an export, compute the stats, write them as Parquet under ``out`` (if given).

    Results are small (one row per topic, prefix or client), so each is written as a single
    file; the returned DataFrames read the written files back, which is cheaper than
    recomputing them for the summary.
    """
    stats = compute_topic_stats(read_export(spark, input_path), depth)
    if out is None:
        return stats
    frames = dict(zip(OUTPUTS, (stats.topics, stats.prefixes, stats.clients, stats.retained),
                      strict=True))
    for name, df in frames.items():
        df.coalesce(1).write.mode("errorifexists").parquet(_join(out, name))
    return TopicStats(*(spark.read.parquet(_join(out, n)) for n in OUTPUTS), depth=depth)


def format_summary(stats: TopicStats, top: int = 10) -> str:
    """A short plain-text table for the terminal: the busiest prefixes, clients, totals."""
    def fmt_ts(value: Any) -> str:
        return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"

    totals = stats.topics.agg(F.count(F.lit(1)), F.sum("messages"), F.sum("bytes")).first()
    n_topics, n_messages, n_bytes = (totals[0] or 0, totals[1] or 0, totals[2] or 0)
    lines = [f"archive: {n_messages:,} messages, {n_bytes:,} bytes, {n_topics:,} topics",
             "",
             f"{'prefix (depth ' + str(stats.depth) + ')':<32} {'messages':>10} {'bytes':>12} "
             f"{'msg/min':>10}  {'first seen':<19}  {'last seen':<19}"]
    for row in stats.prefixes.orderBy(F.desc("messages"), "prefix").limit(top).collect():
        rate = "-" if row.messages_per_minute is None else f"{row.messages_per_minute:,.1f}"
        lines.append(f"{row.prefix[:32]:<32} {row.messages:>10,} {row.bytes:>12,} {rate:>10}  "
                     f"{fmt_ts(row.first_seen):<19}  {fmt_ts(row.last_seen):<19}")
    clients = (stats.clients.where(F.col("backlog_messages") > 0)
               .orderBy(F.desc("backlog_messages"), "client_id").limit(top).collect())
    lines += ["", f"{'client (queued backlog)':<32} {'messages':>10} {'bytes':>12} "
                  f"{'inflight':>10}"]
    lines += [f"{(r.client_id or '')[:32]:<32} {r.backlog_messages:>10,} "
              f"{r.backlog_bytes:>12,} {r.inflight:>10,}" for r in clients] or ["(none)"]
    retained = stats.retained.agg(F.sum("retained_messages"), F.sum("bytes")).first()
    lines += ["", f"retained: {retained[0] or 0:,} messages, {retained[1] or 0:,} bytes"]
    return "\n".join(lines)
