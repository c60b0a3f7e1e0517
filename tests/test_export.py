"""Snapshot → Parquet export (``mqttring snapshot`` / ``mqttring export``), end to end.

A real broker with an archive filter receives a known set of telemetry over MQTT (paho),
the snapshot is taken through the CLI entry point (admin RPC), exported, and the Parquet is
read back with pyarrow, pandas and DuckDB: every row equals what was published.  Also: a
snapshot taken while publishers run exports consistently (no gap in any publisher's stream,
row counts equal the manifest), and bad input is one line on stderr with exit code 1.

The helpers at the top are shared with ``test_spark.py`` (plain functions, no fixtures).
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import paho.mqtt.client as mqtt
import pandas as pd
import pyarrow.parquet as pq
import pytest
import trio

from mqttring import BrokerConfig, MqttRingBroker
from mqttring.analytics import ExportError
from mqttring.analytics.export import (
    EXPORT_MANIFEST,
    NodeSnapshot,
    choose_shard_sources,
    export_snapshot,
    read_export_manifest,
)
from mqttring.analytics.schemas import TABLES, decode_row
from mqttring.cli import main
from mqttring.lsm import DbFile, LsmStore, Manifest, Put, Snapshot, open_snapshot, shard_key
from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key

SECRET = "analytics-test-secret"
WAIT = 10.0
SITES, DEVICES, METRICS = ("a", "b"), ("d1", "d2", "d3"), ("temp", "hum")
TOPICS = [f"sensors/{s}/{d}/{m}" for s in SITES for d in DEVICES for m in METRICS]
BACKLOG_CLIENT = "backlog-1"


# --------------------------------------------------------------------------- shared helpers


@dataclass(frozen=True)
class Published:
    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass
class Node:
    broker: MqttRingBroker
    mqtt_port: int
    admin: str
    data_dir: Path


@dataclass
class Telemetry:
    """What was published, and the wall-clock bracket around it (ns)."""

    messages: list[Published]
    started_ns: int
    ended_ns: int
    archived: list[Published] = field(default_factory=list)


def start_node(data_dir: Path, archive: tuple[str, ...] = ("sensors/#",)) -> Node:
    broker = MqttRingBroker(BrokerConfig(
        node_id="solo", mqtt="127.0.0.1:0", admin="127.0.0.1:0", cluster_secret=SECRET,
        data_dir=data_dir, archive=archive, sys_interval=0, num_shards=64,
    ))
    ports = broker.start()
    assert ports.mqtt and broker.admin_port
    return Node(broker, ports.mqtt, f"127.0.0.1:{broker.admin_port}", data_dir)


def connected_client(port: int, client_id: str = "", clean: bool = True) -> mqtt.Client:
    """A paho client with its network loop running; CONNACK awaited (bounded)."""
    connected = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                         clean_session=clean, protocol=mqtt.MQTTv311,
                         reconnect_on_failure=False)
    client.on_connect = lambda *a: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(WAIT), "no CONNACK"
    return client


def close_client(client: mqtt.Client) -> None:
    client.disconnect()
    client.loop_stop()


def make_offline_subscriber(port: int) -> None:
    """A persistent session on sensors/a/# that then goes away: QoS>=1 messages queue for it."""
    subscribed = threading.Event()
    client = connected_client(port, BACKLOG_CLIENT, clean=False)
    client.on_subscribe = lambda *a: subscribed.set()
    client.subscribe("sensors/a/#", qos=1)
    assert subscribed.wait(WAIT), "no SUBACK"
    close_client(client)


def telemetry_set(n: int = 240) -> list[Published]:
    """Deterministic messages: 12 archived topics, varied sizes, QoS 0/1/2, some retained,
    plus a few on a topic outside the archive filter."""
    out = []
    for i in range(n):
        topic = TOPICS[(i * 7) % len(TOPICS)]
        payload = b"%d:" % i + bytes([65 + i % 26]) * (i % 37)
        out.append(Published(topic, payload, i % 3, i % 11 == 0))
    out += [Published(f"other/{i}", b"not archived %d" % i, 1, False) for i in range(5)]
    return out


def stats(node: Node) -> dict:
    return trio.run(call_once, node.admin, derive_key(SECRET, RPC_KEY_PURPOSE), "test", "stats")


def publish_telemetry(node: Node, messages: list[Published]) -> Telemetry:
    """Publish in order on one connection; return once the broker archived every match."""
    make_offline_subscriber(node.mqtt_port)
    started = time.time_ns()
    client = connected_client(node.mqtt_port, "telemetry-pub")
    for m in messages:
        info = client.publish(m.topic, m.payload, qos=m.qos, retain=m.retain)
        info.wait_for_publish(WAIT)
        assert info.is_published()
    close_client(client)
    archived = [m for m in messages if m.topic.startswith("sensors/")]
    deadline = time.monotonic() + WAIT
    while stats(node)["archive"]["appended"] < len(archived):  # QoS 0 has no ack to wait for
        assert time.monotonic() < deadline, "broker did not archive every message in time"
        time.sleep(0.02)
    ended = time.time_ns()
    return Telemetry(messages, started, ended, archived)


def snapshot_via_cli(node: Node, out: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    rc = main(["snapshot", "--node", node.admin, "--out", str(out), "--secret", SECRET])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "solo:" in captured.out
    return out


def expected_by_topic(archived: list[Published]) -> dict[str, tuple[int, int]]:
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for m in archived:
        counts[m.topic][0] += 1
        counts[m.topic][1] += len(m.payload)
    return {t: (c, b) for t, (c, b) in counts.items()}


def snapshot_time_ranges(snapshot_dir: Path) -> dict[str, tuple[int, int]]:
    """First/last archive time (ns) per topic, read from the snapshot itself (not the export)."""
    ranges: dict[str, tuple[int, int]] = {}
    for key, value in open_snapshot(snapshot_dir / "solo").rows("archive"):
        t = struct.unpack_from(">Q", key, 2)[0]
        lo, hi = ranges.get(value[0], (t, t))
        ranges[value[0]] = (min(lo, t), max(hi, t))
    return ranges


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """The real ``mqttring`` entry point in a child process (what an operator sees)."""
    return subprocess.run([sys.executable, "-m", "mqttring.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


# --------------------------------------------------------------------------- tests


@pytest.fixture
def node(tmp_path):
    n = start_node(tmp_path / "data")
    yield n
    n.broker.stop()


def test_export_equals_what_was_published(node, tmp_path, capsys):
    telemetry = publish_telemetry(node, telemetry_set())
    snap = snapshot_via_cli(node, tmp_path / "snap", capsys)
    rc = main(["export", "--snapshot", str(snap), "--out", str(tmp_path / "export")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "export [" in captured.err and "100.0%" in captured.err  # the progress bar
    out = tmp_path / "export"
    manifest = read_export_manifest(out, verify=True)

    # Every file has exactly the documented schema and holds one shard (its name's).
    for table, (_db, schema, _dec) in TABLES.items():
        for f in manifest["tables"][table]["files"]:
            t = pq.read_table(out / f["path"])
            assert t.schema.equals(schema, check_metadata=False), (table, t.schema)
            assert set(t.column("shard").to_pylist()) == {f["shard"]}
            assert f["path"] == f"{table}/shard-{f['shard']:05d}.parquet"
            assert t.num_rows == f["rows"]

    # archive: pandas reads the directory; every archived message, none other, exact bytes.
    archive = pd.read_parquet(out / "archive")
    got = sorted(zip(archive.topic, archive.payload.map(bytes), archive.qos,
                     archive.retain, strict=True))
    want = sorted((m.topic, m.payload, m.qos, m.retain) for m in telemetry.archived)
    assert got == want
    assert (archive.payload_bytes == archive.payload.map(len)).all()
    assert archive.time_ns.between(telemetry.started_ns, telemetry.ended_ns).all()
    assert list(archive.time.map(lambda ts: ts.value // 1000)) == list(archive.time_ns // 1000)

    # DuckDB on the same files: per-topic counts and bytes.
    rows = duckdb.sql(
        f"select topic, count(*), sum(payload_bytes) from read_parquet('{out}/archive/*.parquet')"
        " group by topic").fetchall()
    assert {t: (c, int(b)) for t, c, b in rows} == expected_by_topic(telemetry.archived)

    # retained: the last retained payload per topic.
    last_retained = {m.topic: m for m in telemetry.messages if m.retain}
    retained = pq.read_table(out / "retained").to_pylist()
    assert {r["topic"]: (r["payload"], r["qos"]) for r in retained} == {
        t: (m.payload, m.qos) for t, m in last_retained.items()}

    # sessions and queued: the offline subscriber and its QoS>=1 backlog, in publish order.
    sessions = pq.read_table(out / "sessions").to_pylist()
    assert [(s["client_id"], s["subscriptions"]) for s in sessions] == [
        (BACKLOG_CLIENT, [{"filter": "sensors/a/#", "qos": 1}])]
    queued = pq.read_table(out / "queued").sort_by("seq").to_pylist()
    want_queued = [m for m in telemetry.messages
                   if m.topic.startswith("sensors/a/") and m.qos >= 1]
    assert [(q["topic"], q["payload"], q["qos"], q["state"]) for q in queued] == [
        (m.topic, m.payload, 1, "queued") for m in want_queued]
    assert {q["client_id"] for q in queued} == {BACKLOG_CLIENT}


def test_export_of_a_snapshot_taken_under_load_is_consistent(node, tmp_path, capsys):
    """Publishers keep going through the snapshot; the export holds a gap-free prefix of
    every publisher's stream, and every count equals the snapshot manifest's."""
    stop = threading.Event()
    sent = [0, 0, 0]

    def publisher(k: int) -> None:
        client = connected_client(node.mqtt_port, f"load-{k}")
        try:
            i = 0
            while not stop.is_set():
                client.publish(f"sensors/load/{k}", b"%d" % i, qos=0).wait_for_publish(WAIT)
                i += 1
                sent[k] = i
        finally:
            close_client(client)

    threads = [threading.Thread(target=publisher, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + WAIT
        while min(sent) < 200:
            assert time.monotonic() < deadline, "publishers made no progress"
            time.sleep(0.01)
        snap = snapshot_via_cli(node, tmp_path / "snap", capsys)
        at_snapshot = list(sent)
        deadline = time.monotonic() + WAIT
        while any(s < a + 100 for s, a in zip(sent, at_snapshot, strict=True)):
            assert time.monotonic() < deadline, "publishers stalled during the snapshot"
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
    assert not any(t.is_alive() for t in threads)

    out = tmp_path / "export"
    result = export_snapshot(snap, out, progress=False)
    snapshot_manifest = open_snapshot(snap / "solo").manifest
    manifest = read_export_manifest(out, verify=True)  # every sha256 checked
    assert manifest["snapshots"][0]["sequence"] == snapshot_manifest.sequence

    # Row counts: per file == manifest shard_rows; per table == manifest rows.
    for table, (db, _schema, _dec) in TABLES.items():
        entry = snapshot_manifest.databases[db]
        files = manifest["tables"][table]["files"]
        assert {f["shard"]: pq.read_metadata(out / f["path"]).num_rows for f in files} == {
            s: n for s, n in entry.shard_rows.items() if n}
        assert result.rows[table] == entry.rows == manifest["tables"][table]["rows"]

    archive = pq.read_table(out / "archive").to_pandas()
    assert len(archive) > 0
    # Archive sequence numbers are given in publish order: a consistent cut has 0..n-1.
    assert sorted(archive.seq) == list(range(len(archive)))
    for k in range(3):
        got = sorted(int(p) for p in archive[archive.topic == f"sensors/load/{k}"].payload)
        assert got == list(range(len(got))), f"publisher {k}: gap in the snapshot"
        assert 0 < len(got) < sent[k], "the snapshot was taken while publishers ran"


def test_rows_that_do_not_have_the_documented_shape_are_refused(tmp_path):
    with LsmStore(tmp_path / "store") as store:
        store.write_sync([Put("archive", shard_key(3, b"\x00" * 12), ["t", b"p", 0])])
        store.snapshot_sync(tmp_path / "snap", node_id="n1")
    with pytest.raises(ExportError, match=r"archive: row with key .* documented shape"):
        export_snapshot(tmp_path / "snap", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists(), "a failed export leaves nothing behind"


def test_decoders_on_literal_rows():
    cid = b"c1"
    qkey = shard_key(5, struct.pack(">H", len(cid)) + cid + struct.pack(">Q", 42))
    row = decode_row("queued", "n", qkey, ["t/x", b"pay", 1, False, 7, 1, 0.0])
    assert row == ("n", 5, "c1", 42, "t/x", b"pay", 3, 1, False, 7, "await_puback", None)
    akey = shard_key(9, struct.pack(">QI", 1_500_000_123, 4))
    row = decode_row("archive", "n", akey, ["s/1", b"ab", 0, True, 1_500_000_123])
    assert row == ("n", 9, 1_500_000, 1_500_000_123, 4, "s/1", b"ab", 2, 0, True)
    skey = shard_key(1, struct.pack(">H", 2) + cid)
    assert decode_row("sessions", "n", skey, {"v": 1, "subs": [["a/#", 1]]}) == (
        "n", 1, "c1", [{"filter": "a/#", "qos": 1}], 1)
    with pytest.raises(ExportError, match="queued"):
        decode_row("queued", "n", skey, ["t", b"", 0, False, None, 0, 0])  # no seq in key


def test_decoders_on_mqtt5_rows():
    """Rows of MQTT 5 messages carry their properties last; the export leaves them out."""
    cid = b"c1"
    qkey = shard_key(5, struct.pack(">H", len(cid)) + cid + struct.pack(">Q", 42))
    props = [b"\x03\x00\x01a", 0.0, "pub"]
    row = decode_row("queued", "n", qkey, ["t/x", b"pay", 1, False, 7, 1, 0.0, props])
    assert row == ("n", 5, "c1", 42, "t/x", b"pay", 3, 1, False, 7, "await_puback", None)
    # A cluster's QoS 2 message: its identity ninth (after the properties, or None).
    for eighth in (props, None):
        row = decode_row("queued", "n", qkey, ["t/x", b"pay", 2, False, 7, 2, 0.0, eighth, 99])
        assert row == ("n", 5, "c1", 42, "t/x", b"pay", 3, 2, False, 7, "await_pubrec", None)
    # A shared subscription's copy: its share's filter tenth.
    shared = ["t/x", b"pay", 1, False, 7, 1, 0.0, None, 0, "$share/g/t/+"]
    row = decode_row("queued", "n", qkey, shared)
    assert row == ("n", 5, "c1", 42, "t/x", b"pay", 3, 1, False, 7, "await_puback", None)
    # A completed QoS 2 message's marker (state 4: its identity, no message): not a row.
    assert decode_row("queued", "n", qkey, [None, None, 2, False, None, 4, 1.7e9, None, 99]
                      ) is None
    assert decode_row("retained", "n", shard_key(1, b"a"), ["a", b"xy", 1, 3, 10, props]) == (
        "n", 1, "a", b"xy", 2, 1)
    skey = shard_key(1, struct.pack(">H", 2) + cid)
    record = {"v": 1, "subs": [["a/#", 1]], "opts": {"a/#": 0x0504}, "ends": 1.5e9}
    assert decode_row("sessions", "n", skey, record) == (
        "n", 1, "c1", [{"filter": "a/#", "qos": 1}], 1)


def _fake(node_id: str, shards: tuple[int, ...], shard_rows: dict[int, int],
          db: str = "retained") -> NodeSnapshot:
    empty = DbFile("x.rows", 0, 0, "", {})
    dbs = {d: empty for d in ("retained", "sessions", "queues", "inflight", "meta", "archive")}
    dbs[db] = DbFile(f"{db}.rows", sum(shard_rows.values()), 0, "", shard_rows)
    manifest = Manifest(node_id, shards, 1, 0.0, 1, dbs)
    return NodeSnapshot(node_id, Snapshot(Path("/nonexistent"), manifest))


def test_one_copy_per_shard_owner_first_else_the_fullest_replica():
    a = _fake("a", (0, 1, 2), {0: 10, 1: 5, 2: 7})
    b = _fake("b", (0, 1, 2), {0: 9, 1: 6, 2: 7})
    c = _fake("c", (3,), {3: 1})
    # With the view's owners: the owner's copy even if a replica has more rows.
    assert choose_shard_sources([a, b, c], ["a", "a", "b", "c"]) == {0: "a", 1: "a", 2: "b",
                                                                     3: "c"}
    # Without: most rows, then node id.
    assert choose_shard_sources([a, b, c], None) == {0: "a", 1: "b", 2: "a", 3: "c"}
    # An owner whose snapshot does not hold the shard is not trusted for it.
    assert choose_shard_sources([a, c], ["c", "c", "c", "c"])[0] == "a"
    # Archive rows (merged from every node, never one copy) do not make a node the source:
    # a former owner's archive says nothing about how fresh its copy of the shard is.
    old_owner = _fake("a", (0,), {0: 1000}, db="archive")
    fresh = _fake("b", (0,), {0: 3})
    assert choose_shard_sources([old_owner, fresh], None) == {0: "b"}


def _small_snapshot(tmp_path: Path) -> Path:
    with LsmStore(tmp_path / "store") as store:
        store.write_sync([Put("archive", shard_key(1, struct.pack(">QI", 1, 0)),
                              ["sensors/x", b"1", 0, False, 1])])
        store.snapshot_sync(tmp_path / "snap" / "n1", node_id="n1")
    return tmp_path / "snap"


def test_bad_input_is_one_line_and_exit_code_1(tmp_path):
    snap = _small_snapshot(tmp_path)
    assert_one_line_error(run_cli("export", "--snapshot", str(tmp_path / "missing"),
                                  "--out", str(tmp_path / "o1")), "does not exist")
    assert_one_line_error(run_cli("export", "--snapshot", str(tmp_path / "store"),
                                  "--out", str(tmp_path / "o1")), "not a snapshot")
    # Corrupt: one flipped byte in a row file.
    rows = snap / "n1" / "archive.rows"
    data = bytearray(rows.read_bytes())
    data[-1] ^= 0xFF
    rows.write_bytes(bytes(data))
    assert_one_line_error(run_cli("export", "--snapshot", str(snap), "--out",
                                  str(tmp_path / "o2")), "corrupt")
    assert not (tmp_path / "o2").exists()
    # Truncated manifest (a snapshot copied while it was being written).
    (snap / "n1" / "MANIFEST.json").write_text('{"format": "mqttring-lsm-sn')
    assert_one_line_error(run_cli("export", "--snapshot", str(snap / "n1"), "--out",
                                  str(tmp_path / "o3")), "MANIFEST.json")


def test_export_refuses_a_non_empty_destination(tmp_path):
    snap = _small_snapshot(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert_one_line_error(run_cli("export", "--snapshot", str(snap), "--out",
                                  str(tmp_path / "out")), "not an empty directory")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_snapshot_cli_errors_are_one_line(node, tmp_path):
    assert_one_line_error(run_cli("snapshot", "--node", node.admin, "--out", str(tmp_path / "s"),
                                  "--secret", "wrong"), "authentication refused")
    # --all asks for the cluster view, which a single node's admin port does not serve.
    assert_one_line_error(run_cli("snapshot", "--node", node.admin, "--out", str(tmp_path / "s"),
                                  "--secret", SECRET, "--all"), "refused")
    closed = "127.0.0.1:9"  # discard port: nothing listens in the test environment
    assert_one_line_error(run_cli("snapshot", "--node", closed, "--out", str(tmp_path / "s"),
                                  "--secret", SECRET, "--timeout", "5"), closed)


class _Peer:
    """A TCP listener that is not an mqttring admin port: it closes each connection at once
    (``close=True``, like a port of something else) or holds it open and says nothing."""

    def __init__(self, close: bool) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.close_each = close
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.close_each:
                conn.close()
            else:
                self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_snapshot_cli_names_a_peer_that_closes_or_never_answers(tmp_path):
    """--node at something that is not the admin port: one line that says what happened
    (not an EOFError traceback, not an empty "TooSlowError:")."""
    closing, silent = _Peer(close=True), _Peer(close=False)
    try:
        proc = run_cli("snapshot", "--node", closing.address, "--out", str(tmp_path / "s"),
                       "--secret", SECRET, "--timeout", "5")
        assert_one_line_error(proc, closing.address, "connection closed by peer",
                              "cluster/admin address")
        proc = run_cli("snapshot", "--node", silent.address, "--out", str(tmp_path / "s"),
                       "--secret", SECRET, "--timeout", "0.5")
        assert_one_line_error(proc, silent.address, "no answer within 0.5 s")
    finally:
        closing.close()
        silent.close()


def test_export_manifest_is_self_describing(tmp_path):
    out = tmp_path / "out"
    export_snapshot(_small_snapshot(tmp_path), out, progress=False)
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    assert manifest["format"] == "mqttring-parquet-export"
    assert manifest["tables"]["archive"]["rows"] == 1
    assert [c["name"] for c in manifest["tables"]["archive"]["schema"]] == [
        f.name for f in TABLES["archive"][1]]
    assert manifest["snapshots"][0]["exported_shards"] == [1]


def test_snapshot_all_of_a_cluster_exports_each_shard_once(tmp_path, capsys):
    """Three real nodes, R=2: every retained message is in two node snapshots, and the export
    holds it once (the owner's copy, from SNAPSHOT-SET.json)."""
    from cluster_support import start_cluster

    cluster = start_cluster(tmp_path / "cluster", replication=2)
    try:
        node = next(iter(sorted(cluster.procs)))
        client = connected_client(cluster.port(node), "retainer")
        want = {f"plant/{i % 5}/line{i}": b"v%d" % i for i in range(40)}
        for topic, payload in want.items():
            info = client.publish(topic, payload, qos=1, retain=True)
            info.wait_for_publish(WAIT)
            assert info.is_published()
        close_client(client)
        out = tmp_path / "snaps"
        rc = main(["snapshot", "--node", cluster.procs[node].cluster, "--out", str(out),
                   "--secret", cluster.secret, "--all"])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
    finally:
        cluster.close()
    assert sorted(p.name for p in out.iterdir()) == ["SNAPSHOT-SET.json", "a", "b", "c"]
    set_file = json.loads((out / "SNAPSHOT-SET.json").read_text())
    snapshots = {n: open_snapshot(out / n) for n in ("a", "b", "c")}
    result = export_snapshot(out, tmp_path / "export", progress=False)
    retained = pq.read_table(tmp_path / "export" / "retained").to_pylist()
    assert sorted((r["topic"], r["payload"]) for r in retained) == sorted(want.items())
    assert result.rows["retained"] == len(want)
    for r in retained:  # each row came from its shard's owner at snapshot time
        assert r["node_id"] == set_file["owners"][r["shard"]]
    held = sum(s.manifest.rows["retained"] for s in snapshots.values())
    # Replicas held copies (2x with R=2 once replicated), yet each was exported once.
    assert held > len(want), held
