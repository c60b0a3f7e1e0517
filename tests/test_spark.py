"""The PySpark job against a real local SparkSession (local[2]), on data a real broker took in.

One module-scoped SparkSession serves every test (a JVM start costs ~10 s here) and is
stopped by the fixture's finalizer; shuffle partitions are few because the data is small.
The broker, publishing, snapshot and export are done once per module too.  The expected
figures come from the published list (counts, bytes) and from the snapshot's own rows read
without Spark (exact first/last nanoseconds), so the job is checked against independent
sources, not against itself.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mqttring.analytics.export import export_snapshot
from mqttring.cli import main
from mqttring.spark import build_session, read_export, run_topic_stats, topic_prefix
from mqttring.spark.jobs import compute_topic_stats
from test_export import (
    BACKLOG_CLIENT,
    Telemetry,
    assert_one_line_error,
    expected_by_topic,
    publish_telemetry,
    run_cli,
    snapshot_time_ranges,
    start_node,
    telemetry_set,
)

DEPTH = 3


@pytest.fixture(scope="module")
def spark():
    session = build_session("local[2]", app_name="mqttring-tests", shuffle_partitions=2,
                            conf={"spark.ui.enabled": "false",
                                  "spark.sql.adaptive.coalescePartitions.enabled": "false"})
    yield session
    session.stop()


@dataclass
class Published:
    telemetry: Telemetry
    snapshot: Path
    export: Path


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A broker took the telemetry set over MQTT; snapshot (admin RPC) and export done."""
    root = tmp_path_factory.mktemp("spark")
    node = start_node(root / "data")
    try:
        telemetry = publish_telemetry(node, telemetry_set())
        rc = main(["snapshot", "--node", node.admin, "--out", str(root / "snap"),
                   "--secret", "analytics-test-secret"])
        assert rc == 0
    finally:
        node.broker.stop()
    export_snapshot(root / "snap", root / "export", progress=False)
    return Published(telemetry, root / "snap", root / "export")


def _prefix(topic: str) -> str:
    return "/".join(topic.split("/")[:DEPTH])


def test_topic_stats_equal_what_was_published(spark, published, tmp_path):
    stats = run_topic_stats(spark, str(published.export), str(tmp_path / "stats"), depth=DEPTH)
    archived = published.telemetry.archived
    ranges = snapshot_time_ranges(published.snapshot)
    t0, t1 = published.telemetry.started_ns, published.telemetry.ended_ns

    topics = {r.topic: r for r in stats.topics.collect()}
    assert {t: (r.messages, r.bytes) for t, r in topics.items()} == expected_by_topic(archived)
    for topic, row in topics.items():
        assert (row.first_seen_ns, row.last_seen_ns) == ranges[topic]
        assert t0 <= row.first_seen_ns <= row.last_seen_ns <= t1
        span_min = (row.last_seen_ns - row.first_seen_ns) / 60e9
        assert row.messages_per_minute == pytest.approx(row.messages / span_min)

    want: dict[str, list] = defaultdict(lambda: [0, 0, set(), []])
    for m in archived:
        entry = want[_prefix(m.topic)]
        entry[0] += 1
        entry[1] += len(m.payload)
        entry[2].add(m.topic)
    for topic, (lo, hi) in ranges.items():
        want[_prefix(topic)][3] += [lo, hi]
    prefixes = {r.prefix: r for r in stats.prefixes.collect()}
    assert {p: (r.messages, r.bytes, r.topics, r.first_seen_ns, r.last_seen_ns)
            for p, r in prefixes.items()} == {
        p: (c, b, len(ts), min(times), max(times)) for p, (c, b, ts, times) in want.items()}

    clients = {r.client_id: r for r in stats.clients.collect()}
    want_backlog = [m for m in published.telemetry.messages
                    if m.topic.startswith("sensors/a/") and m.qos >= 1]
    assert set(clients) == {BACKLOG_CLIENT}
    row = clients[BACKLOG_CLIENT]
    assert (row.backlog_messages, row.backlog_bytes, row.queued, row.inflight,
            row.subscription_count) == (len(want_backlog),
                                        sum(len(m.payload) for m in want_backlog),
                                        len(want_backlog), 0, 1)

    last_retained = {m.topic: m for m in published.telemetry.messages if m.retain}
    inventory = {r.prefix: (r.retained_messages, r.bytes) for r in stats.retained.collect()}
    want_inv: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for topic, m in last_retained.items():
        want_inv[_prefix(topic)][0] += 1
        want_inv[_prefix(topic)][1] += len(m.payload)
    assert inventory == {p: tuple(v) for p, v in want_inv.items()}

    # The Parquet results are readable without Spark.
    topics_pq = pq.read_table(tmp_path / "stats" / "topics").to_pylist()
    assert sum(r["messages"] for r in topics_pq) == len(archived)


def test_functions_compose_and_prefix_handles_short_topics(spark, published):
    tables = read_export(spark, str(published.export))
    assert tables.archive.count() == len(published.telemetry.archived)
    df = spark.createDataFrame([("a",), ("a/b/c/d",), ("/x/y",)], "topic string")
    got = [r.p for r in df.select(topic_prefix(df.topic, 2).alias("p")).collect()]
    assert got == ["a", "a/b", "/x"]
    stats = compute_topic_stats(tables, depth=1)
    assert [r.prefix for r in stats.prefixes.collect()] == ["sensors"]


def test_cli_runs_on_a_snapshot_and_prints_a_table(spark, published, tmp_path, capsys):
    out = tmp_path / "cli-stats"
    rc = main(["spark", "topic-stats", "--input", str(published.snapshot), "--out", str(out),
               "--depth", "2", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    n = len(published.telemetry.archived)
    assert f"archive: {n:,} messages" in captured.out
    assert "sensors/a" in captured.out and BACKLOG_CLIENT in captured.out
    assert sorted(p.name for p in out.iterdir()) == [
        "clients", "export", "prefixes", "retained", "topics"]
    assert spark.sparkContext._jsc is not None, "the command left the caller's session running"


def test_bad_input_is_one_line_and_exit_code_1(published, tmp_path):
    args = ["spark", "topic-stats", "--out", str(tmp_path / "o")]
    assert_one_line_error(run_cli(*args, "--input", str(tmp_path / "missing")),
                          "does not exist")
    snap = tmp_path / "snap"
    shutil.copytree(published.snapshot, snap)
    rows = snap / "solo" / "archive.rows"
    data = bytearray(rows.read_bytes())
    data[len(data) // 2] ^= 0x01
    rows.write_bytes(bytes(data))
    assert_one_line_error(run_cli(*args, "--input", str(snap)), "corrupt")
    export = tmp_path / "export"
    shutil.copytree(published.export, export)
    victim = next((export / "archive").iterdir())
    victim.write_bytes(victim.read_bytes()[:-10])
    assert_one_line_error(run_cli(*args, "--input", str(export)), "corrupt")
    (export / "EXPORT.json").unlink()
    assert_one_line_error(run_cli(*args, "--input", str(export)), "no MANIFEST.json")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("option, value, words", [
    ("--top", "-1", "argument --top: must be >= 0, got -1"),
    ("--shuffle-partitions", "0", "argument --shuffle-partitions: must be >= 1, got 0"),
    ("--depth", "0", "argument --depth: must be >= 1, got 0"),
])
def test_numeric_options_are_checked_before_spark_starts(published, tmp_path, option, value,
                                                         words):
    """On a valid export, a bad number is a usage error (exit 2, one ``error:`` line) before
    Spark starts: nothing is written to --out, so the corrected command can run there."""
    out = tmp_path / "o"
    proc = run_cli("spark", "topic-stats", "--input", str(published.export), "--out", str(out),
                   "--master", "local[1]", option, value)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert not out.exists(), "Spark ran (and wrote results) before the option was checked"
