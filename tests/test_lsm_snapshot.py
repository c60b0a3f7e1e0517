"""Snapshots: point-in-time content under concurrent writers, manifest, layout, validation."""

from __future__ import annotations

import json

import msgpack
import pytest
import trio

from mqttring.lsm import (
    DATABASES,
    SCHEMA_VERSION,
    Delete,
    Durability,
    LsmStore,
    Manifest,
    Put,
    StoreError,
    decode_value,
    open_snapshot,
    shard_key,
)


def fill(store: LsmStore) -> None:
    store.write_sync([Put("queues", shard_key(s, b"m%d" % i), {"s": s, "i": i})
                      for s in (1, 2, 3) for i in range(4)])
    store.write_sync([Put("retained", shard_key(2, b"t"), "r"), Put("meta", b"node", "n")])
    store.write_sync([Delete("queues", shard_key(3, b"m0"))], Durability.LAZY)


def test_snapshot_manifest_and_plain_layout(tmp_path):
    with LsmStore(tmp_path / "s", node_id="node-7") as store:
        fill(store)
        manifest = store.snapshot_sync(tmp_path / "snap")
    assert manifest.node_id == "node-7"
    assert manifest.shards is None
    assert manifest.sequence == 3
    assert manifest.schema_version == SCHEMA_VERSION
    assert manifest.rows == {"retained": 1, "sessions": 0, "queues": 11, "inflight": 0,
                             "meta": 1, "archive": 0}
    assert manifest.databases["queues"].shard_rows == {1: 4, 2: 4, 3: 3}

    # The layout a Spark job reads: MANIFEST.json plus one msgpack stream per database.
    raw = json.loads((tmp_path / "snap" / "MANIFEST.json").read_text())
    assert raw["format"] == "mqttring-lsm-snapshot" and raw["format_version"] == 1
    assert Manifest.from_json(raw) == manifest
    assert sorted(p.name for p in (tmp_path / "snap").iterdir()) == sorted(
        ["MANIFEST.json"] + [f"{db}.rows" for db in DATABASES])
    with open(tmp_path / "snap" / "queues.rows", "rb") as f:
        records = list(msgpack.Unpacker(f, raw=False))
    assert records[0] == [shard_key(1, b"m0"), records[0][1]]
    assert records[0][1][0] == SCHEMA_VERSION
    assert decode_value(records[0][1]) == {"s": 1, "i": 0}

    snap = open_snapshot(tmp_path / "snap")
    assert [k for k, _ in snap.rows("queues", shard=3)] == [shard_key(3, b"m%d" % i)
                                                           for i in (1, 2, 3)]
    assert list(snap.rows("meta")) == [(b"node", "n")]


def test_snapshot_of_selected_shards(tmp_path):
    with LsmStore(tmp_path / "s", node_id="n") as store:
        fill(store)
        manifest = store.snapshot_sync(tmp_path / "snap", shards=[3, 2, 2], node_id="other")
    assert manifest.shards == (2, 3)
    assert manifest.node_id == "other"
    assert manifest.rows["queues"] == 7
    assert manifest.rows["retained"] == 1
    assert manifest.rows["meta"] == 0  # b"node" is shard 0x6e6f
    snap = open_snapshot(tmp_path / "snap")
    assert {k[:2] for k, _ in snap.rows("queues")} == {shard_key(2), shard_key(3)}


def test_snapshot_of_a_store_that_was_never_started(tmp_path):
    with LsmStore(tmp_path / "s") as store:
        fill(store)
    store = LsmStore(tmp_path / "s")
    try:
        manifest = store.snapshot_sync(tmp_path / "snap")
    finally:
        store.close()
    assert manifest.sequence == 3 and manifest.rows["queues"] == 11


async def test_snapshot_is_point_in_time_while_writers_run(tmp_path):
    with LsmStore(tmp_path / "s", lazy_sync_ms=5) as store:
        written: dict[bytes, int] = {}
        stop = trio.Event()

        async def writer(w: int) -> None:
            i = 0
            while not stop.is_set():
                key = shard_key(w, b"%06d" % i)
                durability = Durability.LAZY if i % 2 else Durability.DURABLE
                written[key] = await store.write([Put("queues", key, i)], durability)
                i += 1

        async with trio.open_nursery() as nursery:
            for w in range(8):
                nursery.start_soon(writer, w)
            await trio.sleep(0.05)
            manifests = []
            for n in range(3):
                manifests.append(await store.snapshot(tmp_path / f"snap{n}"))
                await trio.sleep(0.02)
            stop.set()
        for n, manifest in enumerate(manifests):
            snap = open_snapshot(tmp_path / f"snap{n}")
            keys = {k for k, _ in snap.rows("queues")}
            expected = {k for k, seq in written.items() if seq <= manifest.sequence}
            assert keys == expected, f"snapshot {n} is not the state at its sequence"
            assert len(keys) > 0
        assert manifests[0].sequence < manifests[1].sequence < manifests[2].sequence


def test_snapshot_refuses_existing_destination(tmp_path):
    (tmp_path / "snap").mkdir()
    with LsmStore(tmp_path / "s") as store, pytest.raises(StoreError, match="already exists"):
        store.snapshot_sync(tmp_path / "snap")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".snap")]


@pytest.fixture
def snapshot_dir(tmp_path):
    with LsmStore(tmp_path / "s") as store:
        fill(store)
        store.snapshot_sync(tmp_path / "snap")
    return tmp_path / "snap"


def test_open_snapshot_rejects_missing_directory(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        open_snapshot(tmp_path / "nope")


def test_open_snapshot_rejects_missing_manifest(snapshot_dir):
    (snapshot_dir / "MANIFEST.json").unlink()
    with pytest.raises(StoreError, match=r"no MANIFEST\.json"):
        open_snapshot(snapshot_dir)


def test_open_snapshot_rejects_flipped_byte(snapshot_dir):
    path = snapshot_dir / "queues.rows"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"queues\.rows is corrupt"):
        open_snapshot(snapshot_dir)


def test_open_snapshot_rejects_truncated_and_missing_files(snapshot_dir):
    path = snapshot_dir / "queues.rows"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(StoreError, match="corrupt"):
        open_snapshot(snapshot_dir)
    path.unlink()
    with pytest.raises(StoreError, match="missing"):
        open_snapshot(snapshot_dir)


@pytest.mark.parametrize("mutate, message", [
    (lambda m: "{not json", "unreadable"),
    (lambda m: json.dumps({**m, "format_version": 99}), "format version"),
    (lambda m: json.dumps({**m, "schema_version": 99}), "schema version"),
    (lambda m: json.dumps({**m, "format": "zip"}), "not a mqttring-lsm-snapshot"),
    (lambda m: json.dumps({k: v for k, v in m.items() if k != "sequence"}), "malformed"),
    (lambda m: json.dumps([1]), "not a JSON object"),
    (lambda m: json.dumps({**m, "databases": {"queues": {**m["databases"]["queues"],
                                                         "file": "../x.rows"}}}),
     "unexpected"),
])
def test_open_snapshot_rejects_bad_manifests(snapshot_dir, mutate, message):
    path = snapshot_dir / "MANIFEST.json"
    path.write_text(mutate(json.loads(path.read_text())))
    with pytest.raises(StoreError, match=message):
        open_snapshot(snapshot_dir)
