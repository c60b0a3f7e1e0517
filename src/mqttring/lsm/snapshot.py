"""Point-in-time snapshots: a directory of per-database row files plus a checksummed manifest.

The store hands ``write_snapshot`` a read transaction that sees exactly the writes up to the
snapshot's sequence (the flusher opens it between two commits, after flushing the memtable up
to that sequence), so writers keep going while rows are copied.  The format is deliberately
plain so that the Spark export (and any script) can read it with nothing but msgpack:

    <dest>/MANIFEST.json      written last; its presence means the snapshot is complete
    <dest>/<db>.rows          msgpack stream of [key: bin, value: bin] arrays in key order

``value`` is the stored blob: one schema-version byte followed by msgpack (``decode_value``).
The directory is built under a temporary name and renamed into place after every file and
the manifest are fsync'd, so a crash leaves either a whole snapshot or none at ``dest``.
``docs/storage.md`` is the reference for this layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import lmdb
import msgpack

from mqttring.lsm.keys import SCHEMA_VERSION, decode_value, key_shard
from mqttring.lsm.ops import DATABASES, StoreError, check_db

FORMAT = "mqttring-lsm-snapshot"
FORMAT_VERSION = 1
MANIFEST_NAME = "MANIFEST.json"
_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class DbFile:
    """One database's row file as recorded in the manifest."""

    file: str
    rows: int
    bytes: int
    sha256: str
    #: Rows per shard id (keys shorter than 2 bytes are counted in ``rows`` only).
    shard_rows: dict[int, int]


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a snapshot holds; serialised as MANIFEST.json (see docs/storage.md)."""

    node_id: str | None
    #: Shard ids included, sorted; None means every row of every database.
    shards: tuple[int, ...] | None
    sequence: int
    created_at: float
    schema_version: int
    databases: dict[str, DbFile]

    @property
    def rows(self) -> dict[str, int]:
        return {db: entry.rows for db, entry in self.databases.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "node_id": self.node_id,
            "shards": None if self.shards is None else list(self.shards),
            "sequence": self.sequence,
            "created_at": self.created_at,
            "created_at_iso": datetime.fromtimestamp(self.created_at, UTC).isoformat(),
            "schema_version": self.schema_version,
            "databases": {
                db: {"file": e.file, "rows": e.rows, "bytes": e.bytes, "sha256": e.sha256,
                     "shard_rows": {str(s): n for s, n in sorted(e.shard_rows.items())}}
                for db, e in self.databases.items()
            },
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Manifest:
        if raw.get("format") != FORMAT:
            raise StoreError(f"not a {FORMAT} manifest (format={raw.get('format')!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"snapshot format version {raw.get('format_version')!r} is not "
                             f"{FORMAT_VERSION}, which this code reads")
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise StoreError(f"snapshot schema version {raw.get('schema_version')!r} is not "
                             f"{SCHEMA_VERSION}, which this code reads")
        try:
            shards = raw["shards"]
            return cls(
                node_id=raw["node_id"],
                shards=None if shards is None else tuple(int(s) for s in shards),
                sequence=int(raw["sequence"]),
                created_at=float(raw["created_at"]),
                schema_version=int(raw["schema_version"]),
                databases={
                    db: DbFile(file=e["file"], rows=int(e["rows"]), bytes=int(e["bytes"]),
                               sha256=e["sha256"],
                               shard_rows={int(s): int(n) for s, n in e["shard_rows"].items()})
                    for db, e in raw["databases"].items()
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"malformed snapshot manifest: {exc!r}") from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard_ranges(shards: tuple[int, ...] | None) -> list[tuple[bytes, bytes | None]]:
    if shards is None:
        return [(b"", None)]
    ranges: list[tuple[bytes, bytes | None]] = []
    for shard in shards:
        low = shard.to_bytes(2, "big")
        high = (shard + 1).to_bytes(2, "big") if shard < 0xFFFF else None
        ranges.append((low, high))
    return ranges


def _write_db(txn: lmdb.Transaction, handle: Any, ranges: list[tuple[bytes, bytes | None]],
              out: BinaryIO) -> DbFile:
    digest = hashlib.sha256()
    packer = msgpack.Packer(use_bin_type=True)
    shard_rows: dict[int, int] = {}
    rows = size = 0
    buf: list[bytes] = []
    buffered = 0
    with txn.cursor(db=handle) as cursor:
        for low, high in ranges:
            if not cursor.set_range(low):
                continue
            for key, value in cursor.iternext():
                key_bytes = bytes(key)
                if high is not None and key_bytes >= high:
                    break
                record = packer.pack([key_bytes, value])
                buf.append(record)
                buffered += len(record)
                rows += 1
                if len(key_bytes) >= 2:
                    shard = (key_bytes[0] << 8) | key_bytes[1]
                    shard_rows[shard] = shard_rows.get(shard, 0) + 1
                if buffered >= _CHUNK:
                    chunk = b"".join(buf)
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    buf, buffered = [], 0
    chunk = b"".join(buf)
    out.write(chunk)
    digest.update(chunk)
    size += len(chunk)
    return DbFile(file="", rows=rows, bytes=size, sha256=digest.hexdigest(),
                  shard_rows=shard_rows)


def write_snapshot(txn: lmdb.Transaction, handles: dict[str, Any], dest: Path, *,
                   sequence: int, node_id: str | None,
                   shards: Iterable[int] | None) -> Manifest:
    """Copy what ``txn`` sees into a new directory ``dest``; see the module docstring."""
    dest = Path(dest)
    if dest.exists():
        raise StoreError(f"snapshot destination {dest} already exists; snapshots never "
                         f"overwrite")
    shard_ids = None if shards is None else tuple(sorted(set(shards)))
    if shard_ids is not None and any(not 0 <= s <= 0xFFFF for s in shard_ids):
        raise StoreError(f"shard ids must be in 0..65535, got {shard_ids}")
    ranges = _shard_ranges(shard_ids)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        databases: dict[str, DbFile] = {}
        for db in DATABASES:
            name = f"{db}.rows"
            with open(tmp / name, "wb") as out:
                entry = _write_db(txn, handles[db], ranges, out)
                out.flush()
                os.fsync(out.fileno())
            databases[db] = DbFile(name, entry.rows, entry.bytes, entry.sha256,
                                   entry.shard_rows)
        manifest = Manifest(node_id=node_id, shards=shard_ids, sequence=sequence,
                            created_at=time.time(), schema_version=SCHEMA_VERSION,
                            databases=databases)
        with open(tmp / MANIFEST_NAME, "w") as out:
            json.dump(manifest.to_json(), out, indent=2, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


class Snapshot:
    """A validated snapshot on disk (made by ``open_snapshot``); iterates rows lazily."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest

    def raw_rows(self, db: str) -> Iterator[tuple[bytes, bytes]]:
        """(key, stored blob) pairs of ``db`` in key order."""
        check_db(db)
        entry = self.manifest.databases.get(db)
        if entry is None:
            return
        with open(self.path / entry.file, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=64 * 1024 * 1024)
            yield from unpacker

    def rows(self, db: str, shard: int | None = None) -> Iterator[tuple[bytes, Any]]:
        """(key, value) pairs of ``db`` in key order, optionally only those of one shard."""
        for key, blob in self.raw_rows(db):
            if shard is not None and (len(key) < 2 or key_shard(key) != shard):
                continue
            yield key, decode_value(blob)


def open_snapshot(path: Path) -> Snapshot:
    """Open and fully validate a snapshot directory (manifest, sizes, sha256 of every file).

    Raises StoreError naming the problem for a missing directory, missing or malformed
    manifest, missing file, or any size/checksum mismatch, so that a corrupt snapshot is never
    half-imported.
    """
    path = Path(path)
    manifest_path = path / MANIFEST_NAME
    if not path.is_dir():
        raise StoreError(f"snapshot {path} does not exist or is not a directory")
    try:
        raw = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise StoreError(f"snapshot {path} has no {MANIFEST_NAME} (incomplete or not a "
                         f"snapshot)") from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"snapshot {path}: unreadable {MANIFEST_NAME}: {exc}") from exc
    if not isinstance(raw, dict):
        raise StoreError(f"snapshot {path}: {MANIFEST_NAME} is not a JSON object")
    manifest = Manifest.from_json(raw)
    for db, entry in manifest.databases.items():
        if db not in DATABASES or Path(entry.file).name != entry.file:
            raise StoreError(f"snapshot {path}: manifest names unexpected {db!r}/{entry.file!r}")
        file = path / entry.file
        digest = hashlib.sha256()
        size = 0
        try:
            with open(file, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            raise StoreError(f"snapshot {path}: file {entry.file} is missing") from None
        if size != entry.bytes or digest.hexdigest() != entry.sha256:
            raise StoreError(f"snapshot {path}: {entry.file} is corrupt (size {size} vs "
                             f"{entry.bytes}, sha256 mismatch or truncated)")
    return Snapshot(path, manifest)

