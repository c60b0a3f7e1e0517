"""The fixed Parquet schemas of an export, and the pure row decoders that fill them.

Why fixed schemas: Spark, DuckDB and pandas each infer types differently from loosely typed
data (a column that is all-null in one file and strings in another breaks a Spark read of the
directory).  Every file of one table therefore carries exactly the schema below, whatever
its rows, and ``docs/analytics.md`` documents it column by column.  Types are the ones all
three readers map without surprises: signed integers (Spark has no unsigned types), UTF-8
strings, binary payloads, and microsecond UTC timestamps (Spark cannot read nanosecond
Parquet timestamps; exact nanoseconds are kept in an ``int64`` column next to them).

The decoders take one snapshot row (raw key, msgpack-decoded value) and return one tuple in
schema column order, or None for a row that holds no data (a retained tombstone); they do no
I/O, so they are tested on literals, and a row that does not have the documented shape
raises ``ExportError`` naming the table and key instead of writing a half-filled row.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from mqttring.analytics import ExportError

#: Bump when a column is added, removed or retyped; readers check it in EXPORT.json.
EXPORT_SCHEMA_VERSION = 1

_UTC_US = pa.timestamp("us", tz="UTC")
_LEN = struct.Struct(">H")
_SEQ = struct.Struct(">Q")
_STAMP = struct.Struct(">QI")


RETAINED = pa.schema([
    pa.field("node_id", pa.string(), nullable=False),
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
    pa.field("payload_bytes", pa.int64(), nullable=False),
    pa.field("qos", pa.int32(), nullable=False),
])

SUBSCRIPTION = pa.struct([
    pa.field("filter", pa.string(), nullable=False),
    pa.field("qos", pa.int32(), nullable=False),
])

SESSIONS = pa.schema([
    pa.field("node_id", pa.string(), nullable=False),
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("client_id", pa.string(), nullable=False),
    pa.field("subscriptions", pa.list_(SUBSCRIPTION), nullable=False),
    pa.field("subscription_count", pa.int32(), nullable=False),
])

QUEUED = pa.schema([
    pa.field("node_id", pa.string(), nullable=False),
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("client_id", pa.string(), nullable=False),
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
    pa.field("payload_bytes", pa.int64(), nullable=False),
    pa.field("qos", pa.int32(), nullable=False),
    pa.field("retain", pa.bool_(), nullable=False),
    pa.field("packet_id", pa.int32(), nullable=True),
    pa.field("state", pa.string(), nullable=False),
    pa.field("expires_at", _UTC_US, nullable=True),
])

ARCHIVE = pa.schema([
    pa.field("node_id", pa.string(), nullable=False),
    pa.field("shard", pa.int32(), nullable=False),
    pa.field("time", _UTC_US, nullable=False),
    pa.field("time_ns", pa.int64(), nullable=False),
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
    pa.field("payload_bytes", pa.int64(), nullable=False),
    pa.field("qos", pa.int32(), nullable=False),
    pa.field("retain", pa.bool_(), nullable=False),
])

#: Names of ``OutState`` (mqttring.protocol.outbound) by value: the handshake step a queued
#: message is in.  Spelled out so that a reader needs no mqttring to interpret the column.
OUT_STATES = {0: "queued", 1: "await_puback", 2: "await_pubrec", 3: "await_pubcomp"}
#: The state of a queue row that marks a completed QoS 2 message (``OutState.COMPLETED``).
COMPLETED_STATE = 4


def _client_id(key: bytes) -> tuple[str, int]:
    """Length-prefixed client id after the shard; returns it and where it ends."""
    (n,) = _LEN.unpack_from(key, 2)
    end = 4 + n
    if len(key) < end:
        raise ValueError("client id runs past the key")
    return key[4:end].decode("utf-8"), end


def retained_row(node_id: str, shard: int, key: bytes, value: Any) -> tuple | None:
    """A retained message, or None for a tombstone (a versioned clear: no message).

    Rows are ``[topic, payload, qos, epoch, seq]`` (``mqttring.broker.retained``), with a
    sixth element for an MQTT 5 message's properties, or the legacy ``[topic, payload,
    qos]``; the version orders writes inside the cluster and is not exported, nor are the
    MQTT 5 properties.
    """
    if len(value) not in (3, 5, 6):
        raise ValueError(f"{len(value)} fields, expected 3, 5 or 6")
    topic, payload, qos = value[:3]
    if not payload:
        return None
    return (node_id, shard, topic, bytes(payload), len(payload), int(qos))


#: Second and third key bytes of a subscription row in ``sessions``
#: (``mqttring.broker.session_store``): no client id has this length.
_SUBSCRIPTION_ROW = b"\xff\xff"
#: Shard, marker, BLAKE2b-128 of the client id and of the filter.
_SUBSCRIPTION_KEY_BYTES = 2 + 2 + 16 + 16


@dataclass(frozen=True, slots=True)
class SubscriptionRow:
    """One subscription stored in its own row: ``fold_sessions`` puts it into its session's
    row, which is why the sessions table is decoded a shard at a time."""

    client_id: str
    filter: str
    qos: int


def session_row(node_id: str, shard: int, key: bytes, value: Any) -> tuple | SubscriptionRow:
    """A session header (subscriptions inline only in version 1 headers) or one of its
    subscription rows."""
    if key[2:4] == _SUBSCRIPTION_ROW:
        if len(key) != _SUBSCRIPTION_KEY_BYTES:
            raise ValueError("subscription key is not shard + marker + two 16-byte digests")
        if len(value) not in (3, 4):  # 4: MQTT 5 subscription options (not exported)
            raise ValueError(f"{len(value)} fields, expected 3 or 4")
        return SubscriptionRow(str(value[0]), str(value[1]), int(value[2]))
    client_id, end = _client_id(key)
    if end != len(key):
        raise ValueError("trailing bytes after the client id")
    subs = [{"filter": str(f), "qos": int(q)} for f, q in value.get("subs", ())]
    return (node_id, shard, client_id, subs, len(subs))


def fold_sessions(rows: Iterable[tuple | SubscriptionRow]) -> list[tuple]:
    """One shard's decoded ``sessions`` rows as the table's rows: each session with its
    subscriptions, sorted by filter.  A subscription whose session header is missing
    belongs to no session (the store ignores it too) and is dropped."""
    headers: dict[str, tuple] = {}
    subs: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if isinstance(row, SubscriptionRow):
            subs.setdefault(row.client_id, []).append({"filter": row.filter, "qos": row.qos})
        else:
            headers[row[2]] = row
    out = []
    for client_id, (node_id, shard, _cid, inline, _count) in headers.items():
        merged = sorted(inline + subs.get(client_id, []), key=lambda s: s["filter"])
        out.append((node_id, shard, client_id, merged, len(merged)))
    return out


def queued_row(node_id: str, shard: int, key: bytes, value: Any) -> tuple | None:
    client_id, end = _client_id(key)
    if len(key) != end + _SEQ.size:
        raise ValueError("queue key is not client id + 8-byte sequence")
    (seq,) = _SEQ.unpack_from(key, end)
    # 8: an MQTT 5 message's properties (or None); 9: then a cluster's QoS 2 identity;
    # 10: a shared subscription's copy's share filter.  None of them is exported.
    if len(value) not in (7, 8, 9, 10):
        raise ValueError(f"{len(value)} fields, expected 7 to 10")
    topic, payload, qos, retain, packet_id, state, expires_at = value[:7]
    if state == COMPLETED_STATE:
        return None  # a completed QoS 2 message's marker (``Completed``): no message
    expires = None if not expires_at else int(float(expires_at) * 1_000_000)
    return (node_id, shard, client_id, seq, topic, bytes(payload), len(payload), int(qos),
            bool(retain), None if packet_id is None else int(packet_id),
            OUT_STATES[int(state)], expires)


def archive_row(node_id: str, shard: int, key: bytes, value: Any) -> tuple:
    if len(key) != 2 + _STAMP.size:
        raise ValueError("archive key is not shard + 8-byte time + 4-byte sequence")
    time_ns, seq = _STAMP.unpack_from(key, 2)
    topic, payload, qos, retain, _value_time_ns = value
    return (node_id, shard, time_ns // 1000, time_ns, seq, topic, bytes(payload), len(payload),
            int(qos), bool(retain))


#: A decoder returns None for a stored row that stands for no data row (a tombstone).
Decoder = Callable[[str, int, bytes, Any], Any]

#: Tables whose stored rows are not one table row each: the decoded rows of one shard go
#: through this function, which returns the shard's table rows.
FOLDS: dict[str, Callable[[Iterable[Any]], list[tuple]]] = {"sessions": fold_sessions}


#: Export table name -> (snapshot database, schema, decoder).  ``inflight`` (inbound QoS 2
#: packet ids) and ``meta`` are not exported: they are protocol bookkeeping, not data.
TABLES: dict[str, tuple[str, pa.Schema, Decoder]] = {
    "retained": ("retained", RETAINED, retained_row),
    "sessions": ("sessions", SESSIONS, session_row),
    "queued": ("queues", QUEUED, queued_row),
    "archive": ("archive", ARCHIVE, archive_row),
}


def decode_row(table: str, node_id: str, key: bytes, value: Any) -> Any:
    """One snapshot row as a tuple in ``TABLES[table]``'s column order, or ExportError.

    None for a row that is not data (a retained tombstone, a completed QoS 2 message's
    marker): the export skips it.  For a table in ``FOLDS`` the result is what its fold
    function takes."""
    _db, _schema, decoder = TABLES[table]
    if len(key) < 2:
        raise ExportError(f"{table}: key {key!r} has no shard prefix")
    shard = (key[0] << 8) | key[1]
    try:
        return decoder(node_id, shard, key, value)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, UnicodeDecodeError,
            struct.error) as exc:
        raise ExportError(f"{table}: row with key {key.hex()} does not have the documented "
                          f"shape ({exc})") from None


def schema_description(schema: pa.Schema) -> list[dict[str, Any]]:
    """JSON-friendly column list, recorded in EXPORT.json so readers can check the schema."""
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]
