"""What callers hand to the store: write operations, durability classes and the store's error.

These are plain values so that the broker, tests and tools can build them without touching
LMDB; they are validated when built, so a bad key fails in the caller's frame, not later on
the flusher thread where nobody could be told.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

#: The named sub-databases of a node store.  Keys in every one of them except ``meta`` are
#: built with :func:`mqttring.lsm.keys.shard_key`, so one shard's rows are one range.
DATABASES: tuple[str, ...] = ("retained", "sessions", "queues", "inflight", "meta", "archive")

#: LMDB's compile-time key limit (``mdb_env_get_maxkeysize``); longer keys cannot be stored.
MAX_KEY_SIZE = 511


class StoreError(Exception):
    """The store cannot do what was asked: misuse (bad key, closed store), a missing or
    corrupt snapshot, or a failed flusher (disk full, I/O error).  The message says which."""


class Durability(Enum):
    """How far a write must have travelled before ``write`` returns.

    ``DURABLE``: committed to LMDB *and* fsync'd; survives process kill and power loss.  Use
    it before PUBACK/PUBREC of stored QoS 1/2 messages, retained updates, session changes.
    ``LAZY``: in the memtable (readable at once); committed by the flusher within
    milliseconds and fsync'd within ``lazy_sync_ms``.  Use it for QoS 0 data.
    ``docs/storage.md`` lists exactly what each class survives.
    """

    DURABLE = "durable"
    LAZY = "lazy"


def check_db(db: str) -> None:
    if db not in DATABASES:
        raise StoreError(f"unknown database {db!r}; expected one of {', '.join(DATABASES)}")


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise StoreError(f"keys are bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_SIZE:
        raise StoreError(f"key length must be 1..{MAX_KEY_SIZE} bytes (LMDB limit), got {len(key)}")


@dataclass(frozen=True, slots=True)
class Put:
    """Set ``db[key] = value``; ``value`` is any msgpack-able object (dict, list, str, ...)."""

    db: str
    key: bytes
    value: Any

    def __post_init__(self) -> None:
        check_db(self.db)
        check_key(self.key)


@dataclass(frozen=True, slots=True)
class Delete:
    """Remove ``db[key]``; deleting a missing key is not an error (it is a tombstone)."""

    db: str
    key: bytes

    def __post_init__(self) -> None:
        check_db(self.db)
        check_key(self.key)
