"""The node store: an LSM-style memtable with group commit in front of LMDB (docs/storage.md)."""

from mqttring.lsm.keys import (
    EXPIRES_AT,
    SCHEMA_VERSION,
    decode_value,
    encode_value,
    is_expired,
    key_shard,
    shard_key,
)
from mqttring.lsm.ops import DATABASES, Delete, Durability, Put, StoreError
from mqttring.lsm.snapshot import DbFile, Manifest, Snapshot, open_snapshot
from mqttring.lsm.store import LsmStore

__all__ = [
    "DATABASES",
    "EXPIRES_AT",
    "SCHEMA_VERSION",
    "DbFile",
    "Delete",
    "Durability",
    "LsmStore",
    "Manifest",
    "Put",
    "Snapshot",
    "StoreError",
    "decode_value",
    "encode_value",
    "is_expired",
    "key_shard",
    "open_snapshot",
    "shard_key",
]
