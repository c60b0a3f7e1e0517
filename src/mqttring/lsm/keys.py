"""Keys and values as they lie on disk: shard-prefixed keys, versioned msgpack values, TTLs.

Keys start with the shard id as 2 bytes big-endian so that LMDB's byte order puts one
shard's rows next to each other: shard handoff and the Spark export read one shard with one
range scan.  Values are one schema-version byte followed by msgpack, so a later format can be
read next to this one and an unknown version is refused instead of misread.
"""

from __future__ import annotations

from typing import Any

import msgpack

from mqttring.lsm.ops import StoreError

#: Version byte written in front of every stored value (see docs/storage.md).
SCHEMA_VERSION = 1
_VERSION_BYTE = bytes([SCHEMA_VERSION])

#: Number of shard ids a 2-byte prefix can name.
MAX_SHARDS = 1 << 16

#: Field of a dict value holding its expiry (unix seconds, float); see ``is_expired``.
EXPIRES_AT = "expires_at"


def shard_key(shard: int, *parts: bytes) -> bytes:
    """``shard`` as 2 bytes big-endian followed by ``parts`` concatenated.

    Parts are joined without separators: callers that need an unambiguous split use
    fixed-width parts or put a length-delimited or terminated part last.
    """
    if not 0 <= shard < MAX_SHARDS:
        raise StoreError(f"shard id must be in 0..{MAX_SHARDS - 1}, got {shard}")
    return shard.to_bytes(2, "big") + b"".join(parts)


def key_shard(key: bytes) -> int:
    """The shard id a key built by ``shard_key`` belongs to."""
    if len(key) < 2:
        raise StoreError(f"key {key!r} is shorter than the 2-byte shard prefix")
    return int.from_bytes(key[:2], "big")


def prefix_end(prefix: bytes) -> bytes | None:
    """Smallest key greater than every key starting with ``prefix`` (None: no upper bound)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def key_range(
    prefix: bytes, start: bytes | None, end: bytes | None
) -> tuple[bytes, bytes | None]:
    """Combine a prefix and optional [start, end) bounds into one [low, high) range."""
    low = prefix if start is None else max(prefix, start)
    high = prefix_end(prefix)
    if end is not None:
        high = end if high is None else min(high, end)
    return low, high


def encode_value(value: Any) -> bytes:
    """Version byte + msgpack; raises StoreError for values msgpack cannot carry."""
    try:
        return _VERSION_BYTE + msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(f"value is not msgpack-serialisable: {exc}") from exc


def decode_value(blob: bytes | memoryview) -> Any:
    """Inverse of ``encode_value``; msgpack gives lists for tuples and allows int map keys."""
    if not blob or blob[0] != SCHEMA_VERSION:
        version = blob[0] if blob else None
        raise StoreError(f"stored value has schema version {version}, this code reads "
                         f"{SCHEMA_VERSION}")
    return msgpack.unpackb(blob[1:], raw=False, strict_map_key=False)


def is_expired(value: Any, now: float) -> bool:
    """True if ``value`` is a dict whose ``expires_at`` (unix seconds) is at or before ``now``.

    This is the store's whole TTL convention: a value without the field never expires.
    """
    if not isinstance(value, dict):
        return False
    expires_at = value.get(EXPIRES_AT)
    return isinstance(expires_at, int | float) and expires_at <= now
