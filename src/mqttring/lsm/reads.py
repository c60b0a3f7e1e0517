"""How a store is read: the memtable merged over LMDB, so a reader sees every accepted write.

Apart from ``store.py`` because reads never queue or commit: they only have to see what
the writes left, consistently, and stay out of a map growth's way (``MapGate``), and why
they do is an argument of its own.

Read path: memtable first (an entry there is newer than LMDB, a tombstone hides the LMDB
row), then a fresh LMDB read transaction.  Because the flusher removes a memtable entry only
after the commit holding it (or a newer version) is visible, a reader that misses the
memtable and then opens a read transaction cannot see an older value than the one it missed.
A scan copies its memtable range and begins its read transaction under one lock hold, so it
is the exact state at one sequence number (no write can be queued in between, and a commit
landing in between only carries writes whose memtable entries were copied).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import trio

from mqttring.lsm.flusher import CommitQueue
from mqttring.lsm.keys import decode_value, key_range
from mqttring.lsm.mapgate import MapGate
from mqttring.lsm.ops import StoreError, check_db, check_key

_T = TypeVar("_T")


class StoreReads:
    """The reads of ``LsmStore``, which inherits them and holds their state (set up and
    documented in its ``__init__``)."""

    __slots__ = ()

    path: Path
    _env: lmdb.Environment
    _handles: dict[str, Any]
    _queue: CommitQueue
    _gate: MapGate
    _closed: bool

    def _read(self, fn: Callable[[lmdb.Transaction], _T]) -> _T:
        """Run ``fn`` in a fresh read transaction; caller has entered the gate."""
        if self._closed:
            raise StoreError("store is closed; reads are refused")
        try:
            with self._env.begin(write=False, buffers=True) as txn:
                return fn(txn)
        except lmdb.Error as exc:
            raise StoreError(f"read from {self.path} failed: {exc}") from exc

    def _lmdb_get(self, db: str, key: bytes) -> Any | None:
        handle = self._handles[db]

        def read(txn: lmdb.Transaction) -> Any | None:
            blob = txn.get(key, db=handle)
            return None if blob is None else decode_value(blob)

        return self._read(read)

    def _memtable_get(self, db: str, key: bytes) -> tuple[bool, Any | None]:
        check_db(db)
        check_key(key)
        with self._queue.lock:
            found, blob = self._queue.memtable.lookup(db, key)
        if not found:
            return False, None
        return True, None if blob is None else decode_value(blob)

    def get_sync(self, db: str, key: bytes) -> Any | None:
        found, value = self._memtable_get(db, key)
        if found:
            return value
        with self._gate.reading():
            return self._lmdb_get(db, key)

    async def get(self, db: str, key: bytes) -> Any | None:
        """The value of ``db[key]``, or None.  A point read from the page cache takes
        microseconds, so it runs inline; while a map growth is pending it moves to a thread."""
        found, value = self._memtable_get(db, key)
        if not found:
            if self._gate.try_enter():
                try:
                    value = self._lmdb_get(db, key)
                finally:
                    self._gate.leave()
            else:
                value = await trio.to_thread.run_sync(self.get_sync, db, key)
        await trio.lowlevel.checkpoint()
        return value

    def _merge(self, db: str, low: bytes, high: bytes | None, limit: int | None,
               convert: Callable[[Any], Any]) -> list[tuple[bytes, Any]]:
        """Memtable entries merged over LMDB rows in [low, high), tombstones dropped."""
        check_db(db)
        if limit is not None and limit <= 0:
            return []
        if high is not None and low >= high:
            return []
        handle = self._handles[db]

        def read(txn: lmdb.Transaction,
                 mem: list[tuple[bytes, bytes | None]]) -> list[tuple[bytes, Any]]:
            out: list[tuple[bytes, Any]] = []
            want = -1 if limit is None else limit
            i, n = 0, len(mem)
            with txn.cursor(db=handle) as cur:
                rows = cur.iternext() if cur.set_range(low) else iter(())
                for raw_key, blob in rows:
                    key = bytes(raw_key)
                    if high is not None and key >= high:
                        break
                    # Memtable entries sort in front of (or replace) the LMDB row.
                    while i < n and mem[i][0] <= key:
                        mkey, mblob = mem[i]
                        i += 1
                        if mblob is not None:
                            out.append((mkey, convert(mblob)))
                            if len(out) == want:
                                return out
                        if mkey == key:
                            break
                    else:
                        out.append((key, convert(blob)))
                        if len(out) == want:
                            return out
            for mkey, mblob in mem[i:]:
                if mblob is not None:
                    out.append((mkey, convert(mblob)))
                    if len(out) == want:
                        break
            return out

        # Copying the memtable range and beginning the read transaction under one lock hold
        # makes the result the exact state at one sequence number: no write can be queued
        # in between, and a commit landing in between only holds writes whose (newer or
        # equal) memtable entries were copied.  The gate comes first: waiting for a map
        # growth while holding the queue lock would stall every writer.
        with self._gate.reading():
            if self._closed:
                raise StoreError("store is closed; reads are refused")
            try:
                with self._queue.lock:
                    mem = self._queue.memtable.range(db, low, high)
                    txn = self._env.begin(write=False, buffers=True)
                try:
                    return read(txn, mem)
                finally:
                    txn.abort()
            except lmdb.Error as exc:
                raise StoreError(f"read from {self.path} failed: {exc}") from exc

    def scan_sync(self, db: str, prefix: bytes = b"", *, start: bytes | None = None,
                  end: bytes | None = None,
                  limit: int | None = None) -> list[tuple[bytes, Any]]:
        low, high = key_range(prefix, start, end)
        return self._merge(db, low, high, limit, decode_value)

    async def scan(self, db: str, prefix: bytes = b"", *, start: bytes | None = None,
                   end: bytes | None = None,
                   limit: int | None = None) -> list[tuple[bytes, Any]]:
        """Rows with ``prefix``, ``start <= key < end``, in key order, at most ``limit``.

        The rows are the store's exact state at one sequence number (no torn multi-op
        writes).  Runs in a worker thread: a scan's length is up to the caller."""
        return await trio.to_thread.run_sync(
            lambda: self.scan_sync(db, prefix, start=start, end=end, limit=limit))
