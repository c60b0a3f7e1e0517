"""Opt-in telemetry archive: published messages on configured topics, kept for analytics.

Operators list topic filters (``archive = ["sensors/#"]``); every message published to a
matching topic is appended at its shard's owner, so each message is archived once however
many nodes it crosses.  Keys are ``shard | time (ns, 8 bytes) | sequence (4 bytes)``: one
shard's archive is one time-ordered range scan, which is what the Spark export reads.

Rows are written to the owner's own store only (the writer is a local one, in a cluster
too): they are neither replicated nor handed over when the shard changes owner, so after a
move one shard's archive is spread over the nodes that owned it, and the export merges the
parts (``mqttring.analytics.export``).  Retention therefore runs over every shard whose rows
this node holds, not only those it owns now.

The publish path does not write: ``append`` only queues the row (no await, no allocation
beyond the row), and a writer task stores everything queued since its last write as one
batch with the *lazy* durability class.  So a burst of publishes costs one store write, not
one each (archiving every message once cost 84% of QoS 0 throughput that way).  A process
kill loses what was queued but not yet handed to the store (milliseconds of traffic) and
a power loss the last ``lazy_sync_ms``; if the writer falls ``max_pending`` rows behind,
new rows are dropped and counted rather than slowing publishers down: the archive is for
analytics, never on the delivery path.

Retention is enforced in the background by age and by total size, oldest first; the size
is tracked incrementally (one scan at start-up).
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from collections.abc import Callable, Iterable

import trio

from mqttring.broker.shard_writes import Op, ShardWriter
from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.protocol.message import Message
from mqttring.protocol.topics import TopicTrie, validate_topic_filter

log = logging.getLogger("mqttring.archive")

_DB = "archive"
_STAMP = struct.Struct(">QI")
#: Topics whose archive decision is cached (cleared when full).
_TOPIC_CACHE_SIZE = 100_000
#: Rows per delete batch during expiry, so one pass never holds the store for long.
_EXPIRY_BATCH = 5000


def archive_key(shard: int, time_ns: int, seq: int) -> bytes:
    return shard_key(shard, _STAMP.pack(time_ns, seq & 0xFFFFFFFF))


def key_time_ns(key: bytes) -> int:
    return int(_STAMP.unpack_from(key, 2)[0])


class TelemetryArchive:
    def __init__(
        self,
        filters: Iterable[str],
        store: LsmStore,
        writer: ShardWriter,
        shard_for_topic: Callable[[str], int],
        max_age: float,
        max_bytes: int,
        clock: Callable[[], int] = time.time_ns,
        max_pending: int = 100_000,
    ) -> None:
        self._filters: TopicTrie[str, int] = TopicTrie()
        for topic_filter in filters:
            validate_topic_filter(topic_filter)
            self._filters.add(topic_filter, topic_filter, 1)
        self._store = store
        self._writer = writer
        self._shard_for_topic = shard_for_topic
        self.max_age = max_age
        self.max_bytes = max_bytes
        self._clock = clock
        self._seq = itertools.count()
        self._pending: list[tuple[int, Op]] = []
        self._topic_cache: dict[str, int] = {}
        self._wakeup = trio.Event()
        self.max_pending = max_pending
        self.bytes = 0
        self.appended = 0
        self.expired = 0
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return len(self._filters) > 0

    def matches(self, topic: str) -> bool:
        return bool(self._filters.match(topic))

    def _route(self, topic: str) -> int:
        """Shard of an archived topic, or -1 if not archived; cached, since telemetry
        topics repeat (the cache is cleared when full and rebuilt from the traffic)."""
        shard = self._topic_cache.get(topic)
        if shard is None:
            shard = self._shard_for_topic(topic) if self._filters.match(topic) else -1
            if len(self._topic_cache) >= _TOPIC_CACHE_SIZE:
                self._topic_cache.clear()
            self._topic_cache[topic] = shard
        return shard

    def append(self, message: Message) -> None:
        """Queue one message for the archive if its topic matches (never waits)."""
        shard = self._route(message.topic)
        if shard < 0:
            return
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return
        now = self._clock()
        value = [message.topic, message.payload, message.qos, message.retain, now]
        self._pending.append((shard, Put(_DB, archive_key(shard, now, next(self._seq)), value)))
        self.bytes += len(message.payload) + len(message.topic)
        self.appended += 1
        self._wakeup.set()

    async def flush(self) -> None:
        """Store everything queued so far, one batch per shard, in one write."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        by_shard: dict[int, list[Op]] = {}
        for shard, op in pending:
            by_shard.setdefault(shard, []).append(op)
        await self._writer.write(list(by_shard.items()), Durability.LAZY)

    async def run_writer(self) -> None:
        """Runs until cancelled: store queued rows as soon as there are any."""
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            await self.flush()

    # -- retention --------------------------------------------------------------------------

    async def measure(self) -> None:
        """Size of what is already archived (once, at start-up)."""
        rows = await self._store.scan(_DB)
        self.bytes = sum(len(v[1]) + len(v[0]) for _, v in rows)

    async def run_expiry(self, interval: float, shards: Callable[[], Iterable[int]]) -> None:
        """Runs until cancelled: expire by age, then by size, every ``interval`` seconds."""
        await self.measure()
        while True:
            await trio.sleep(interval)
            try:
                await self.expire(list(shards()))
            except Exception:
                log.exception("archive expiry pass failed")

    async def expire(self, shards: list[int]) -> int:
        removed = 0
        if self.max_age > 0:
            cutoff = self._clock() - int(self.max_age * 1e9)
            for shard in shards:
                removed += await self._delete_range(shard, cutoff)
        if self.max_bytes > 0 and self.bytes > self.max_bytes:
            removed += await self._shrink(shards)
        self.expired += removed
        return removed

    async def _delete_range(self, shard: int, cutoff_ns: int) -> int:
        end = archive_key(shard, max(cutoff_ns, 0), 0)
        removed = 0
        while True:
            rows = await self._store.scan(_DB, shard_key(shard), end=end, limit=_EXPIRY_BATCH)
            if not rows:
                return removed
            await self._delete(shard, rows)
            removed += len(rows)

    async def _delete(self, shard: int, rows: list[tuple[bytes, list]]) -> None:
        ops: list[Op] = [Delete(_DB, key) for key, _ in rows]
        self.bytes -= sum(len(v[1]) + len(v[0]) for _, v in rows)
        await self._writer.write([(shard, ops)], Durability.LAZY)

    async def _shrink(self, shards: list[int]) -> int:
        """Delete the globally oldest rows until the archive fits in ``max_bytes``."""
        stamps: list[tuple[int, int, int]] = []  # (time, size, shard)
        for shard in shards:
            for key, value in await self._store.scan(_DB, shard_key(shard)):
                stamps.append((key_time_ns(key), len(value[1]) + len(value[0]), shard))
        stamps.sort()
        excess = self.bytes - self.max_bytes
        cutoff_ns = 0
        for stamp, size, _ in stamps:
            if excess <= 0:
                break
            excess -= size
            cutoff_ns = stamp + 1
        removed = 0
        for shard in shards:
            removed += await self._delete_range(shard, cutoff_ns)
        return removed
