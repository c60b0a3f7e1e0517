"""The memtable: writes not yet known to be in LMDB, newest version of each key, tombstones.

Readers consult it before LMDB, so a write is visible the moment ``write`` has queued it,
whatever its durability.  An entry leaves only after the flusher's commit containing it (or
a newer version of the key) is visible to new LMDB read transactions; that order is what
lets a reader that misses here trust LMDB.  Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sortedcontainers import SortedDict

from mqttring.lsm.ops import DATABASES

#: Stored blob, or None for a tombstone (a delete that still hides an LMDB row).
Blob = bytes | None
#: One operation after encoding: database, key, blob or tombstone.
EncodedOp = tuple[str, bytes, Blob]


class Memtable:
    """Per database, a sorted map key -> (sequence, blob or tombstone)."""

    __slots__ = ("_tables",)

    def __init__(self) -> None:
        self._tables: dict[str, SortedDict] = {db: SortedDict() for db in DATABASES}

    def apply(self, seq: int, ops: Iterable[EncodedOp]) -> None:
        for db, key, blob in ops:
            self._tables[db][key] = (seq, blob)

    def lookup(self, db: str, key: bytes) -> tuple[bool, Blob]:
        """(found, blob): found with blob None means deleted (a tombstone)."""
        entry = self._tables[db].get(key)
        if entry is None:
            return False, None
        return True, entry[1]

    def range(self, db: str, low: bytes, high: bytes | None) -> list[tuple[bytes, Blob]]:
        """Entries with low <= key < high in key order, tombstones included."""
        table = self._tables[db]
        keys: Iterator[bytes] = table.irange(low, high, inclusive=(True, False))
        return [(key, table[key][1]) for key in keys]

    def release(self, seq: int, ops: Iterable[EncodedOp]) -> None:
        """Forget the entries ``ops`` of write ``seq`` created, unless a newer write replaced
        them (that newer entry stays until its own commit)."""
        for db, key, _ in ops:
            table = self._tables[db]
            entry = table.get(key)
            if entry is not None and entry[0] <= seq:
                del table[key]

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables.values())
