"""The archive in a cluster: rows live where they were archived, and the export merges them.

A message is archived once, at the node that owned its shard when it was published, and the
rows are neither replicated nor handed over when the shard changes owner.  So after a node
joined (or left, or came back) one shard's archive is spread over several node snapshots,
and exporting only the current owner's copy — right for the replicated tables — would drop
acknowledged messages the snapshot set holds.  These tests check, on real snapshots and on a
real two-node cluster (``mqttring.node`` processes), that:

* every archive row of a snapshot set is exported, each shard's rows merged in time order,
  while retained/sessions/queued still come from one copy per shard;
* a set whose SNAPSHOT-SET.json names a node snapshot that is not there is refused (one
  line, exit code 1) instead of exporting less without a word;
* archiving in a cluster writes at the owner only: no replica receives archive ops (which
  the replication layer refuses, logging a traceback per write) and none holds such rows;
* a node's retention covers the rows it keeps of shards that moved away (only it can
  delete them).
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import trio

from cluster_support import NodeCluster, start_cluster
from mqttring.analytics.export import EXPORT_MANIFEST, export_snapshot
from mqttring.analytics.snapshot import SNAPSHOT_SET, SNAPSHOT_SET_FORMAT
from mqttring.cli import main
from mqttring.lsm import LsmStore, Put, open_snapshot, shard_key
from mqttring.ring.hashing import shard_of
from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key
from test_export import WAIT, assert_one_line_error, close_client, connected_client, run_cli

NUM_SHARDS = 16


def _archive_put(shard: int, time_ns: int, seq: int, topic: str, payload: bytes) -> Put:
    """One archive row in the broker's format (``mqttring.broker.archive``)."""
    return Put("archive", shard_key(shard, struct.pack(">QI", time_ns, seq)),
               [topic, payload, 1, False, time_ns])


def _node_snapshot(root: Path, node_id: str, puts: list[Put]) -> None:
    with LsmStore(root / f"store-{node_id}") as store:
        store.write_sync(puts)
        store.snapshot_sync(root / "set" / node_id, node_id=node_id)


def _write_set_file(set_dir: Path, owners: list[str | None], nodes: list[str]) -> None:
    """SNAPSHOT-SET.json as ``mqttring snapshot --all`` writes it."""
    record = {"format": SNAPSHOT_SET_FORMAT, "format_version": 1, "created_at": time.time(),
              "epoch": 3, "num_shards": len(owners), "replication": 2, "owners": owners,
              "nodes": {n: {"address": "127.0.0.1:1", "path": str(set_dir / n), "sequence": 1}
                        for n in nodes}}
    (set_dir / SNAPSHOT_SET).write_text(json.dumps(record))


@pytest.fixture
def moved_shard_set(tmp_path: Path) -> Path:
    """Shard 7 was owned by ``a`` (which archived at t=1,3,5), then by ``b`` (t=2,4,6: the
    two took turns, as with a paused node whose shards moved away and came back); shard 9's
    archive is only at ``a`` although ``b`` owns it now.  Both replicate both shards, so
    both hold retained rows of shard 7: ``a`` a stale one, ``b`` (the owner) the newest."""
    _node_snapshot(tmp_path, "a", [
        *(_archive_put(7, t, i, "sensors/x", b"a%d" % t) for i, t in enumerate((1, 3, 5))),
        _archive_put(9, 10, 3, "sensors/y", b"a10"),
        Put("retained", shard_key(7, b"plant/x"), ["plant/x", b"stale", 1, 1, 1]),
    ])
    _node_snapshot(tmp_path, "b", [
        *(_archive_put(7, t, i, "sensors/x", b"b%d" % t) for i, t in enumerate((2, 4, 6))),
        Put("retained", shard_key(7, b"plant/x"), ["plant/x", b"newest", 1, 2, 1]),
    ])
    owners: list[str | None] = ["b"] * NUM_SHARDS
    _write_set_file(tmp_path / "set", owners, ["a", "b"])
    return tmp_path / "set"


def test_archive_rows_of_a_shard_are_merged_from_every_snapshot(moved_shard_set, tmp_path):
    out = tmp_path / "export"
    result = export_snapshot(moved_shard_set, out, progress=False)
    assert result.rows["archive"] == 7
    archive = pq.read_table(out / "archive" / "shard-00007.parquet").to_pylist()
    # Every row of both nodes, in time order, each attributed to the node that archived it.
    assert [(r["time_ns"], r["node_id"], r["payload"]) for r in archive] == [
        (1, "a", b"a1"), (2, "b", b"b2"), (3, "a", b"a3"), (4, "b", b"b4"), (5, "a", b"a5"),
        (6, "b", b"b6")]
    shard9 = pq.read_table(out / "archive" / "shard-00009.parquet").to_pylist()
    assert [(r["node_id"], r["payload"]) for r in shard9] == [("a", b"a10")]
    # The replicated tables still hold one copy per shard: the owner's.
    retained = pq.read_table(out / "retained").to_pylist()
    assert [(r["node_id"], r["payload"]) for r in retained] == [("b", b"newest")]
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    files = {f["shard"]: f for f in manifest["tables"]["archive"]["files"]}
    assert files[7]["node_ids"] == ["a", "b"] and files[9]["node_ids"] == ["a"]
    by_node = {s["node_id"]: s for s in manifest["snapshots"]}
    assert by_node["a"]["archive_shards"] == [7, 9]
    assert by_node["b"]["archive_shards"] == [7]


def test_a_set_missing_a_listed_node_snapshot_is_refused(moved_shard_set, tmp_path):
    shutil.rmtree(moved_shard_set / "a")
    proc = run_cli("export", "--snapshot", str(moved_shard_set), "--out", str(tmp_path / "o"),
                   "--no-progress")
    assert_one_line_error(proc, "missing", str(moved_shard_set / "a"))
    assert not (tmp_path / "o").exists(), "nothing is exported from an incomplete set"


# --------------------------------------------------------------------------- a real cluster


def _archive_stats(cluster: NodeCluster, node: str) -> dict[str, Any]:
    """The node's archive counters (admin ``stats``): appended, bytes, expired, dropped."""
    key = derive_key(cluster.secret, RPC_KEY_PURPOSE)
    return trio.run(call_once, cluster.procs[node].cluster, key, "test", "stats")["archive"]


def _archived(cluster: NodeCluster, nodes: list[str]) -> int:
    return sum(_archive_stats(cluster, node)["appended"] for node in nodes)


def _publish(cluster: NodeCluster, node: str, nodes: list[str], start: int, count: int,
             topics: list[str]) -> dict[bytes, str]:
    """QoS 1 to archived topics through ``node``, each acknowledged; returns payload ->
    topic, once every message is queued for the archive somewhere (then a moment for the
    archive's writer task to store them)."""
    client = connected_client(cluster.port(node), f"pub-{start}")
    sent: dict[bytes, str] = {}
    try:
        for i in range(start, start + count):
            topic = topics[i % len(topics)]
            info = client.publish(topic, b"m%d" % i, qos=1)
            info.wait_for_publish(WAIT)
            assert info.is_published()
            sent[b"m%d" % i] = topic
    finally:
        close_client(client)
    deadline = time.monotonic() + WAIT
    while _archived(cluster, nodes) < start + count:
        assert time.monotonic() < deadline, "the cluster did not archive every message"
        time.sleep(0.05)
    time.sleep(0.3)
    return sent


def test_archive_after_a_shard_moved_is_exported_whole_and_never_replicated(tmp_path, capsys):
    """``a`` alone archives a first batch (it owns every shard); ``b`` joins and takes over
    about half of the shards (``a`` stays their replica); a second batch is archived at the
    new owners.  The snapshot set holds every message, so the export must too."""
    topics = [f"sensors/{i}/v" for i in range(40)]
    cluster = start_cluster(tmp_path / "cluster", nodes=("a",), replication=2,
                            num_shards=NUM_SHARDS, extra_toml='archive = ["sensors/#"]\n')
    try:
        sent = _publish(cluster, "a", ["a"], 0, 120, topics)
        cluster.start("b", join=cluster.procs["a"].cluster)
        cluster.ready("b")
        view = cluster.settle(("a", "b"))
        assert {replicas[0] for replicas in view.shards} == {"a", "b"}, view.shards
        sent |= _publish(cluster, "b", ["a", "b"], 120, 120, topics)
        out = tmp_path / "snaps"
        rc = main(["snapshot", "--node", cluster.procs["a"].cluster, "--out", str(out),
                   "--secret", cluster.secret, "--all"])
        assert rc == 0, capsys.readouterr().err
        logs = {n: cluster.log(n) for n in ("a", "b")}
    finally:
        cluster.close()
    for node, log in logs.items():
        assert "bad replicated op" not in log and "on_repl failed" not in log, (
            f"{node} was sent archive ops to replicate:\n{log[-3000:]}")

    owners = json.loads((out / SNAPSHOT_SET).read_text())["owners"]
    first, second = set(list(sent)[:120]), set(list(sent)[120:])
    held: dict[str, list[bytes]] = {}
    for node in ("a", "b"):
        rows = list(open_snapshot(out / node).rows("archive"))
        held[node] = [value[1] for _key, value in rows]
        for key, value in rows:  # the second batch: only at the owner, no replica copy
            if value[1] in second:
                assert owners[(key[0] << 8) | key[1]] == node, (node, value)
    assert first <= set(held["a"]), "a archived the first batch (it owned every shard)"
    assert sorted(held["a"] + held["b"]) == sorted(sent), "each message archived exactly once"

    export_snapshot(out, tmp_path / "export", progress=False)
    archive = pq.read_table(tmp_path / "export" / "archive").to_pylist()
    assert sorted(r["payload"] for r in archive) == sorted(sent), (
        f"exported {len(archive)} of {len(sent)} archived messages")
    assert all(r["topic"] == sent[r["payload"]] for r in archive)
    # Moved shards hold rows of both nodes; each shard's rows are in time order.
    assert {r["node_id"] for r in archive} == {"a", "b"}
    for shard in {r["shard"] for r in archive}:
        times = [r["time_ns"] for r in archive if r["shard"] == shard]
        assert times == sorted(times), shard


def test_retention_expires_rows_of_shards_that_moved_away(tmp_path):
    """Rows stay at the node that archived them when their shard moves, and only that node
    can delete them: its retention must cover them, not only the shards it owns now."""
    max_age = 4.0
    toml = ('archive = ["sensors/#"]\n'
            f"archive_max_age = {max_age}\narchive_expiry_interval = 0.2\n")
    cluster = start_cluster(tmp_path / "cluster", nodes=("a",), replication=2,
                            num_shards=NUM_SHARDS, extra_toml=toml)
    try:
        topics = [f"sensors/{i}/v" for i in range(40)]
        _publish(cluster, "a", ["a"], 0, 40, topics)
        published = time.monotonic()
        cluster.start("b", join=cluster.procs["a"].cluster)
        cluster.ready("b")
        view = cluster.settle(("a", "b"))
        moved = {s for s, replicas in enumerate(view.shards) if replicas[0] == "b"}
        assert moved & {shard_of(t, NUM_SHARDS) for t in topics}, "no archived shard moved"
        assert time.monotonic() - published < max_age, "too slow to test before expiry"
        deadline = published + max_age + 5.0
        while (expired := _archive_stats(cluster, "a")["expired"]) < 40:
            assert time.monotonic() < deadline, (
                f"a expired {expired} of its 40 rows: those of the shards b owns now stay "
                f"forever")
            time.sleep(0.2)
        assert _archive_stats(cluster, "a")["bytes"] == 0
    finally:
        cluster.close()
