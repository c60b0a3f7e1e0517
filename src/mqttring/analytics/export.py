"""Snapshot → Parquet: one file per shard per table, fixed schemas, and a checksummed manifest.

Theory of operation
-------------------
Input is either one node snapshot (a directory holding MANIFEST.json, ``docs/storage.md``)
or a *snapshot set*: a directory of node snapshots as ``mqttring snapshot --all`` writes it
(``<dir>/<node id>/`` each, plus SNAPSHOT-SET.json with the shard owners at snapshot time).
Every snapshot is opened with ``open_snapshot``, which verifies each file's size and SHA-256
before a single row is read, so a corrupt or half-copied snapshot is refused, never half
exported.

In a cluster each shard is held by R replicas, so R snapshots may contain it.  Exactly one
copy of a shard's *replicated* tables (retained, sessions, queued) is exported (otherwise every
count downstream would be multiplied by R): the copy of the node that *owned* the shard in the
view recorded by SNAPSHOT-SET.json, or, when no view was recorded (snapshots gathered by
hand), the node whose snapshot has the most rows of that shard (the least lagging replica),
ties broken by node id.  These tables of one shard come from the same node, so a shard's
sessions and queued messages agree.

The archive is different (``MERGED_TABLES``): a message is archived once, at the node that
owned its shard *when it was published*, and archive rows are neither replicated nor handed
over when the shard changes owner (``mqttring.broker.archive``).  After a node joined or
left, or a paused node's shards moved away and came back, one shard's archive is spread
over several nodes and the current owner's copy holds only its own part of it; taking that
copy alone would silently drop acknowledged, archived messages that the snapshot set holds.
So the archive rows of a shard are taken from *every* snapshot that has some, merged in key
order (``shard | time_ns | seq``: each node's rows are already time-ordered, and the merge
keeps them so), and no row is held twice, since no node ever stores another's rows.

A snapshot set whose SNAPSHOT-SET.json names a node whose snapshot directory is not there
is refused: that node's part of the archive (and any shard it alone owned) would be missing
from the export without a word.

Row files are in key order and keys start with the shard id, so a node's database is
streamed once and cut into per-shard Parquet files as the shard changes; memory is bounded
by one row group (``ROW_GROUP`` rows).  After writing, the rows of every (table, shard) are
compared with the snapshot manifest's ``shard_rows``: equal, or the export fails.  The output
is built under a temporary name and renamed into place after EXPORT.json is written last, so
``out`` is either a complete export or absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mqttring.analytics import ExportError
from mqttring.analytics.progress import ProgressBar
from mqttring.analytics.schemas import (
    EXPORT_SCHEMA_VERSION,
    FOLDS,
    TABLES,
    decode_row,
    schema_description,
)
from mqttring.analytics.snapshot import SNAPSHOT_SET, SNAPSHOT_SET_FORMAT
from mqttring.lsm import Snapshot, StoreError, decode_value, open_snapshot
from mqttring.lsm.snapshot import MANIFEST_NAME

EXPORT_FORMAT = "mqttring-parquet-export"
EXPORT_FORMAT_VERSION = 1
EXPORT_MANIFEST = "EXPORT.json"
#: Rows per Parquet row group: large enough for fast scans, small enough to bound memory.
ROW_GROUP = 65_536
#: Tables whose rows are written only where the shard's owner was at the time and never
#: replicated: a shard's rows are merged from every snapshot, not taken from one copy.
MERGED_TABLES = frozenset({"archive"})


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One validated node snapshot and the node id its rows are attributed to."""

    node_id: str
    snapshot: Snapshot


@dataclass(slots=True)
class ExportResult:
    """What ``export_snapshot`` wrote (also recorded in EXPORT.json)."""

    out: Path
    rows: dict[str, int]
    files: int
    seconds: float
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


def load_snapshots(path: Path) -> tuple[list[NodeSnapshot], list[str | None] | None]:
    """Open one snapshot or a snapshot set; returns the snapshots and the shard owners.

    Raises ExportError (with the StoreError's words) for anything missing or corrupt.
    """
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"snapshot {path} does not exist or is not a directory")
    try:
        if (path / MANIFEST_NAME).exists():
            snap = open_snapshot(path)
            return [NodeSnapshot(snap.manifest.node_id or path.name, snap)], None
        owners: list[str | None] | None = None
        listed: list[str] = []
        set_file = path / SNAPSHOT_SET
        if set_file.exists():
            try:
                raw = json.loads(set_file.read_text())
                if raw.get("format") != SNAPSHOT_SET_FORMAT:
                    raise ValueError(f"format is {raw.get('format')!r}")
                owners = [None if o is None else str(o) for o in raw["owners"]]
                members = raw.get("nodes", {})
                if not isinstance(members, dict):
                    raise ValueError("'nodes' is not an object")
                listed = sorted(str(n) for n in members)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ExportError(f"snapshot set {path}: unreadable {SNAPSHOT_SET}: "
                                  f"{exc}") from None
        subdirs = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not subdirs:
            raise ExportError(f"{path} is not a snapshot: no {MANIFEST_NAME} and no node "
                              f"snapshot directories in it")
        nodes = []
        for sub in subdirs:
            snap = open_snapshot(sub)
            nodes.append(NodeSnapshot(snap.manifest.node_id or sub.name, snap))
    except StoreError as exc:
        raise ExportError(str(exc)) from None
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        raise ExportError(f"snapshot set {path} holds two snapshots of the same node: {ids}")
    missing = [n for n in listed if n not in ids]
    if missing:
        # Exporting without them would silently lose their archive rows (held nowhere else)
        # and any shard only they held: the operator must copy them in, or drop the set file.
        raise ExportError(f"snapshot set {path}: {SNAPSHOT_SET} lists node snapshot(s) that "
                          f"are missing: {', '.join(str(path / n) for n in missing)}")
    return nodes, owners


def _holds(node: NodeSnapshot, shard: int) -> bool:
    shards = node.snapshot.manifest.shards
    return shards is None or shard in shards


def choose_shard_sources(nodes: list[NodeSnapshot],
                         owners: list[str | None] | None) -> dict[int, str]:
    """Shard id -> the node whose copy of the replicated tables is exported (see the module
    docstring for the rule).  Rows of ``MERGED_TABLES`` are not counted: they are exported
    from every node, and a former owner's archive rows say nothing about how fresh its copy
    of the shard's sessions is."""
    dbs = [db for table, (db, _schema, _dec) in TABLES.items() if table not in MERGED_TABLES]
    rows: dict[int, dict[str, int]] = {}
    for node in nodes:
        for db in dbs:
            entry = node.snapshot.manifest.databases.get(db)
            if entry is None:
                continue
            for shard, n in entry.shard_rows.items():
                per_node = rows.setdefault(shard, {})
                per_node[node.node_id] = per_node.get(node.node_id, 0) + n
    by_id = {n.node_id: n for n in nodes}
    chosen: dict[int, str] = {}
    for shard, per_node in rows.items():
        owner = owners[shard] if owners is not None and shard < len(owners) else None
        if owner is not None and owner in by_id and _holds(by_id[owner], shard):
            chosen[shard] = owner
        else:
            chosen[shard] = min(per_node, key=lambda n: (-per_node[n], n))
    return chosen


class _ShardFile:
    """Rows of one (table, shard) buffered into row groups of one Parquet file."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.rows = 0
        self._buf: list[tuple] = []
        self._writer = pq.ParquetWriter(path, schema, compression="zstd")

    def add(self, row: tuple) -> None:
        self._buf.append(row)
        if len(self._buf) >= ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        columns = list(zip(*self._buf, strict=True))
        try:
            arrays = [pa.array(col, type=f.type) for col, f in zip(columns, self.schema,
                                                                    strict=True)]
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            raise ExportError(f"{self.path.parent.name}: a row does not fit the documented "
                              f"schema ({exc})") from None
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.rows += len(self._buf)
        self._buf = []

    def close(self) -> None:
        self._flush()
        self._writer.close()

    def abandon(self) -> None:
        """Close the file after a failure (its directory is about to be removed)."""
        # The export already failed with a better error than a close can give.
        with contextlib.suppress(Exception):
            self._writer.close()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _selected_rows(node: NodeSnapshot, db: str,
                   shards: set[int]) -> Iterator[tuple[int, bytes, Any]]:
    """(shard, key, value) of ``db`` in key order, only for ``shards``."""
    for key, blob in node.snapshot.raw_rows(db):
        shard = (key[0] << 8) | key[1] if len(key) >= 2 else -1
        if shard in shards:
            try:
                value = decode_value(blob)
            except StoreError as exc:
                raise ExportError(f"{db}: row with key {key.hex()}: {exc}") from None
            yield shard, key, value


def _table_rows(table: str, node_id: str, stored: Iterable[tuple[int, bytes, Any]],
                seen: list[int], progress: ProgressBar) -> Iterator[tuple]:
    """One shard's table rows from its stored rows, counting those in ``seen[0]`` (data or
    not: the snapshot manifest counts tombstones, which are not exported).  Streamed, except
    for a table in ``FOLDS``, whose shard is decoded whole first."""
    fold = FOLDS.get(table)
    folding: list[Any] = []
    for _shard, key, value in stored:
        seen[0] += 1
        row = decode_row(table, node_id, key, value)
        progress.advance(1)
        if row is None:
            continue
        if fold is None:
            yield row
        else:
            folding.append(row)
    if fold is not None:
        yield from fold(folding)


def _write_shard_file(path: Path, schema: pa.Schema, rows: Iterable[tuple]) -> _ShardFile | None:
    """Write ``rows`` as one Parquet file; None (and no file) when there are none."""
    current: _ShardFile | None = None
    try:
        for row in rows:
            if current is None:
                current = _ShardFile(path, schema)
            current.add(row)
    except BaseException:
        if current is not None:
            current.abandon()
        raise
    if current is None:
        return None
    current.close()
    return current


def _file_entry(table: str, shard: int, written: _ShardFile,
                node_ids: list[str]) -> dict[str, Any]:
    return {"path": f"{table}/{written.path.name}", "shard": shard,
            "node_id": ",".join(node_ids), "node_ids": node_ids, "rows": written.rows,
            "bytes": written.path.stat().st_size, "sha256": _sha256(written.path)}


def _checked_rows(table: str, node_id: str, shard: int,
                  stored: Iterable[tuple[int, bytes, Any]], expected: int,
                  progress: ProgressBar) -> Iterator[tuple]:
    """``_table_rows`` of one node's shard, then ExportError unless as many stored rows were
    read as its snapshot manifest counts (a row file that lost rows is never exported)."""
    seen = [0]
    yield from _table_rows(table, node_id, stored, seen, progress)
    if seen[0] != expected:
        raise ExportError(f"{table}: shard {shard} of {node_id}: read {seen[0]} rows, the "
                          f"snapshot manifest says {expected}")


def _counted_rows(table: str, stored: Iterable[tuple[bytes, str, int, Any]],
                  seen: dict[tuple[str, int], int], contributors: set[str],
                  progress: ProgressBar) -> Iterator[tuple]:
    """Table rows of merged (key, node id, shard, value) rows; counts what each node gave in
    ``seen`` (checked against the manifests once all is read) and who gave data rows."""
    for key, node_id, shard, value in stored:
        seen[node_id, shard] = seen.get((node_id, shard), 0) + 1
        progress.advance(1)
        row = decode_row(table, node_id, key, value)
        if row is not None:
            contributors.add(node_id)
            yield row


def _one_copy_table(table: str, nodes: list[NodeSnapshot], sources: dict[int, str],
                    tmp: Path, progress: ProgressBar) -> list[dict[str, Any]]:
    """Each shard's rows from the one node ``sources`` names for it."""
    db, schema, _decoder = TABLES[table]
    files: list[dict[str, Any]] = []
    for node in nodes:
        mine = {s for s, n in sources.items() if n == node.node_id}
        entry = node.snapshot.manifest.databases.get(db)
        if entry is None:  # a manifest may omit a database: no rows of it, nothing to export
            continue
        expected = entry.shard_rows
        by_shard = itertools.groupby(_selected_rows(node, db, mine), key=lambda r: r[0])
        for shard, stored in by_shard:
            rows = _checked_rows(table, node.node_id, shard, stored, expected.get(shard, 0),
                                 progress)
            written = _write_shard_file(tmp / table / f"shard-{shard:05d}.parquet", schema,
                                        rows)
            if written is not None:  # else only rows without data (tombstones): no file
                files.append(_file_entry(table, shard, written, [node.node_id]))
    return files


def _merged_table(table: str, nodes: list[NodeSnapshot], tmp: Path,
                  progress: ProgressBar) -> list[dict[str, Any]]:
    """Each shard's rows from every node that holds some, merged in key order (time order
    for the archive), ties by node id; streamed, one row per node in memory."""
    db, schema, _decoder = TABLES[table]
    ordered = sorted(nodes, key=lambda n: n.node_id)

    def stream(node: NodeSnapshot) -> Iterator[tuple[bytes, str, int, Any]]:
        for key, blob in node.snapshot.raw_rows(db):
            if len(key) < 2:  # counted in the manifest's rows only, as in ``_selected_rows``
                continue
            try:
                value = decode_value(blob)
            except StoreError as exc:
                raise ExportError(f"{db}: row with key {key.hex()} of {node.node_id}: "
                                  f"{exc}") from None
            yield key, node.node_id, (key[0] << 8) | key[1], value

    merged = heapq.merge(*(stream(n) for n in ordered), key=lambda r: (r[0], r[1]))
    seen: dict[tuple[str, int], int] = {}
    files: list[dict[str, Any]] = []
    for shard, stored in itertools.groupby(merged, key=lambda r: r[2]):
        contributors: set[str] = set()
        rows = _counted_rows(table, stored, seen, contributors, progress)
        written = _write_shard_file(tmp / table / f"shard-{shard:05d}.parquet", schema, rows)
        if written is not None:
            files.append(_file_entry(table, shard, written, sorted(contributors)))
    expected: dict[tuple[str, int], int] = {}
    for node in ordered:
        entry = node.snapshot.manifest.databases.get(db)
        for shard, n in (entry.shard_rows if entry is not None else {}).items():
            expected[node.node_id, shard] = n
    for node_id, shard in sorted(expected.keys() | seen.keys()):
        read, want = seen.get((node_id, shard), 0), expected.get((node_id, shard), 0)
        if read != want:
            raise ExportError(f"{table}: shard {shard} of {node_id}: read {read} rows, the "
                              f"snapshot manifest says {want}")
    return files


def _export_table(table: str, nodes: list[NodeSnapshot], sources: dict[int, str],
                  tmp: Path, progress: ProgressBar) -> list[dict[str, Any]]:
    (tmp / table).mkdir()
    if table in MERGED_TABLES:
        files = _merged_table(table, nodes, tmp, progress)
    else:
        files = _one_copy_table(table, nodes, sources, tmp, progress)
    files.sort(key=lambda f: f["shard"])
    return files


def export_snapshot(snapshot: Path, out: Path, *, progress: bool = True,
                    tables: tuple[str, ...] = tuple(TABLES)) -> ExportResult:
    """Export a snapshot (or snapshot set) to Parquet under ``out``; see the module docstring.

    ``out`` must not exist (or be an empty directory): exports never overwrite or mix.
    Raises ExportError for bad input.
    """
    started = time.perf_counter()
    nodes, owners = load_snapshots(Path(snapshot))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"export destination {out} exists and is not an empty directory")
    sources = choose_shard_sources(nodes, owners)
    total = 0
    for table in tables:
        db = TABLES[table][0]
        for node in nodes:
            entry = node.snapshot.manifest.databases.get(db)
            shard_rows = entry.shard_rows if entry is not None else {}
            total += sum(n for s, n in shard_rows.items()
                         if table in MERGED_TABLES or sources.get(s) == node.node_id)
    bar = ProgressBar(total, "export", enabled=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        table_entries: dict[str, Any] = {}
        for table in tables:
            files = _export_table(table, nodes, sources, tmp, bar)
            table_entries[table] = {
                "rows": sum(f["rows"] for f in files),
                "schema": schema_description(TABLES[table][1]),
                "files": files,
            }
        bar.finish()
        created = time.time()
        manifest = {
            "format": EXPORT_FORMAT,
            "format_version": EXPORT_FORMAT_VERSION,
            "schema_version": EXPORT_SCHEMA_VERSION,
            "created_at": created,
            "created_at_iso": datetime.fromtimestamp(created, UTC).isoformat(),
            "snapshots": [
                {"node_id": n.node_id, "path": str(n.snapshot.path.resolve()),
                 "sequence": n.snapshot.manifest.sequence,
                 "created_at": n.snapshot.manifest.created_at,
                 "shards": (None if n.snapshot.manifest.shards is None
                            else list(n.snapshot.manifest.shards)),
                 "exported_shards": sorted({s for s, src in sources.items()
                                            if src == n.node_id}
                                           | set(_merged_shards(n, tables))),
                 "archive_shards": _merged_shards(n, tables)}
                for n in nodes
            ],
            "tables": table_entries,
        }
        with open(tmp / EXPORT_MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if out.exists():
            out.rmdir()  # checked empty above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rows = {t: e["rows"] for t, e in table_entries.items()}
    return ExportResult(out, rows, sum(len(e["files"]) for e in table_entries.values()),
                        time.perf_counter() - started, manifest)


def _merged_shards(node: NodeSnapshot, tables: tuple[str, ...]) -> list[int]:
    """Shards whose ``MERGED_TABLES`` rows (the archive) came (also) from ``node``."""
    shards: set[int] = set()
    for table in tables:
        if table in MERGED_TABLES:
            entry = node.snapshot.manifest.databases.get(TABLES[table][0])
            if entry is not None:
                shards.update(s for s, n in entry.shard_rows.items() if n)
    return sorted(shards)


def read_export_manifest(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """Read and check EXPORT.json of a local export; with ``verify``, every file's SHA-256.

    Raises ExportError naming the problem (what the Spark job shows for a bad ``--input``).
    """
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"export {path} does not exist or is not a directory")
    try:
        manifest = json.loads((path / EXPORT_MANIFEST).read_text())
    except FileNotFoundError:
        raise ExportError(f"{path} is neither an export ({EXPORT_MANIFEST}) nor a snapshot "
                          f"({MANIFEST_NAME})") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"export {path}: unreadable {EXPORT_MANIFEST}: {exc}") from None
    check_export_manifest(manifest, str(path))
    if verify:
        for table, entry in manifest["tables"].items():
            for f in entry["files"]:
                file = path / f["path"]
                if not file.is_file():
                    raise ExportError(f"export {path}: {f['path']} is missing")
                if file.stat().st_size != f["bytes"] or _sha256(file) != f["sha256"]:
                    raise ExportError(f"export {path}: {f['path']} of {table} is corrupt "
                                      f"(size or sha256 differs from {EXPORT_MANIFEST})")
    return manifest


def check_export_manifest(manifest: Any, where: str) -> None:
    """Format, versions and the fields readers rely on; ExportError otherwise."""
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{where}: {EXPORT_MANIFEST} is not an {EXPORT_FORMAT} manifest")
    if manifest.get("format_version") != EXPORT_FORMAT_VERSION:
        raise ExportError(f"{where}: export format version {manifest.get('format_version')!r} "
                          f"is not {EXPORT_FORMAT_VERSION}, which this code reads")
    if manifest.get("schema_version") != EXPORT_SCHEMA_VERSION:
        raise ExportError(f"{where}: export schema version {manifest.get('schema_version')!r} "
                          f"is not {EXPORT_SCHEMA_VERSION}, which this code reads")
    tables = manifest.get("tables")
    if not isinstance(tables, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("files"), list) for e in tables.values()):
        raise ExportError(f"{where}: {EXPORT_MANIFEST} has no valid 'tables'")
