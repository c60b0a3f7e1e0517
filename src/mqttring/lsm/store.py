"""LsmStore: a node's durable store, an LSM-style memtable in front of LMDB.

Theory of operation
-------------------
Who calls it: the broker's trio tasks (async API: ``write``/``get``/``scan``/``snapshot``/
``expire``), plain threads and start-up code (the ``*_sync`` twins), and CLI tools.  Any
number of trio runs, in any threads, may use one store at the same time.

Write path: ``write`` validates and msgpack-encodes the ops in the caller's frame, then, in
one step under the queue lock, takes the next sequence number, puts the ops in the memtable
(so they are readable at once) and appends the batch to the commit queue.  The single
flusher thread (``flusher.py``) commits everything queued in one LMDB write transaction,
releases the memtable entries, fsyncs when a durable write is in the batch, and only then
wakes the durable writers.  LMDB's copy-on-write commit is the write-ahead log: a commit is
atomic, and after ``env.sync`` it survives power loss.  The env is opened ``sync=True,
metasync=False``: every commit flushes its data pages before its meta page is written, so
the file is never corrupt after a crash; an un-synced commit may only be rolled back to the
previous one.  (``sync=False`` would save one fdatasync per lazy commit, but a later un-synced
commit can then overwrite pages still referenced by the last synced meta page, and a power
loss would corrupt data that durable writers were told is safe.  See docs/storage.md.)

Read path: ``reads.StoreReads``, which ``LsmStore`` inherits, explains why a read sees
every accepted write, and a scan the exact state at one sequence number.

Invariants:
- Every ``write`` is atomic (one batch, one transaction) and writes apply in sequence order.
- A DURABLE ``write`` returns only when ``synced_seq >= its seq``; if the flusher fails it
  raises StoreError instead, never returns a sequence that is not on disk.
- Pending (uncommitted) encoded bytes stay at or below ``memtable_max_bytes`` except for one
  oversized write; writers wait (back-pressure) rather than grow memory without bound.
- Only the flusher thread opens write transactions after start-up, and it grows the map
  between transactions with all readers held off (``MapGate``).

Must never: block the trio event loop on I/O or on the flusher (async reads that cannot
enter the gate at once, scans, snapshots and expiry run in worker threads; the queue lock
is held only for in-memory bookkeeping, plus at most 512 mmap point reads in ``expire``'s
compare-and-delete step), acknowledge a durable write before its fsync, or
open a write transaction on a thread other than the one that commits it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import lmdb
import trio

from mqttring.config import StoreSettings
from mqttring.lsm.dirlock import DirLock
from mqttring.lsm.flusher import (
    INTERNAL_DB,
    SCHEMA_KEY,
    SEQUENCE_KEY,
    CommitQueue,
    Flusher,
)
from mqttring.lsm.keys import SCHEMA_VERSION, decode_value, encode_value, is_expired, key_range
from mqttring.lsm.mapgate import MapGate
from mqttring.lsm.memtable import EncodedOp
from mqttring.lsm.ops import DATABASES, Delete, Durability, Put, StoreError
from mqttring.lsm.reads import StoreReads
from mqttring.lsm.snapshot import Manifest, write_snapshot
from mqttring.lsm.wakeups import ThreadWaiter, TrioWaiter, wake_all

_DEFAULTS = StoreSettings()


class PendingWrite:
    """A write that has its place in the store's order (``LsmStore.begin_write``)."""

    __slots__ = ("durable", "encoded", "nbytes", "ops", "seq", "store", "turn", "waiter")

    def __init__(self, store: LsmStore, ops: Sequence[Put | Delete], durable: bool,
                 waiter: TrioWaiter | None) -> None:
        self.store = store
        self.ops = ops
        self.durable = durable
        self.waiter = waiter
        self.encoded: list[EncodedOp] | None = None
        self.nbytes = 0
        #: Its place while it waits to be queued (None once queued, or queued at once).
        self.turn: _Turn | None = None
        self.seq = 0

    async def finish(self) -> int:
        """Queue it (encoding it in a thread if big, after the writes ahead of it, once the
        memtable has room), then wait as ``write`` does; returns its sequence number."""
        store = self.store
        if self.turn is not None:
            if self.encoded is None:
                self.encoded, self.nbytes = await trio.to_thread.run_sync(store._encode,
                                                                          self.ops)
            self.seq = await store._queue_in_turn(self.turn, self.encoded, self.nbytes,
                                                  self.durable, self.waiter)
            self.turn = None
        if self.waiter is not None:
            await self.waiter.wait()
            store._check_synced(self.seq)
        else:
            await trio.lowlevel.checkpoint()
        return self.seq

    def abandon(self) -> None:
        """Give up its place if it was never queued (cancelled, failed); else nothing."""
        turn, self.turn = self.turn, None
        if turn is not None:
            store = self.store
            with store._queue.lock:
                if turn in store._turns:
                    store._turns.remove(turn)
                    store._wake_head_locked()


class _Turn:
    """A ``write`` waiting to queue behind writes called before it."""

    __slots__ = ("waiter",)

    def __init__(self) -> None:
        #: Set while it waits for the writes ahead of it; woken when it is first in line.
        self.waiter: TrioWaiter | None = None
#: Bookkeeping bytes charged per op on top of key and value, so that many tiny writes still
#: count against ``memtable_max_bytes`` roughly as much memory as they really take.
OP_OVERHEAD = 96
#: Largest write encoded and queued on the event loop itself; bigger ones use a worker thread.
INLINE_OPS = 64
#: Rows checked and deleted per locked step of ``expire``.
_EXPIRE_CHUNK = 512


class LsmStore(StoreReads):
    """A node's store; see the module docstring for the theory of operation."""

    def __init__(self, path: Path, *, map_size: int = _DEFAULTS.map_size,
                 lazy_sync_ms: int = _DEFAULTS.lazy_sync_ms,
                 memtable_max_bytes: int = _DEFAULTS.memtable_max_bytes,
                 node_id: str | None = None) -> None:
        if map_size <= 0 or lazy_sync_ms < 0 or memtable_max_bytes <= 0:
            raise StoreError("map_size and memtable_max_bytes must be > 0, lazy_sync_ms >= 0")
        self.path = Path(path)
        self.node_id = node_id
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = DirLock.acquire(self.path)
        try:
            self._env = lmdb.open(str(self.path), map_size=map_size, max_dbs=len(DATABASES) + 1,
                                  max_readers=512, sync=True, metasync=False)
        except lmdb.Error as exc:
            self._lock.release()
            raise StoreError(f"cannot open store at {self.path}: {exc}") from exc
        try:
            self._handles, self._internal, last_seq = self._open_databases()
        except BaseException:
            self._env.close()
            self._lock.release()
            raise
        self._lazy_sync_s = lazy_sync_ms / 1000
        self._queue = CommitQueue(last_seq, memtable_max_bytes)
        #: ``write`` calls not queued yet, in call order (under the queue lock): the head
        #: alone may queue, so sequence order is call order (``_queue_in_turn``).
        self._turns: deque[_Turn] = deque()
        self._gate = MapGate()
        self._flusher: Flusher | None = None
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def from_settings(cls, path: Path, settings: StoreSettings,
                      node_id: str | None = None) -> LsmStore:
        return cls(path, map_size=settings.map_size, lazy_sync_ms=settings.lazy_sync_ms,
                   memtable_max_bytes=settings.memtable_max_bytes, node_id=node_id)

    def _open_databases(self) -> tuple[dict[str, Any], Any, int]:
        """Create/open the sub-databases and check the schema, in one start-up transaction."""
        with self._env.begin(write=True) as txn:
            handles = {db: self._env.open_db(db.encode(), txn=txn) for db in DATABASES}
            internal = self._env.open_db(INTERNAL_DB, txn=txn)
            schema = txn.get(SCHEMA_KEY, db=internal)
            if schema is None:
                txn.put(SCHEMA_KEY, SCHEMA_VERSION.to_bytes(4, "big"), db=internal)
            elif int.from_bytes(schema, "big") != SCHEMA_VERSION:
                raise StoreError(f"store {self.path} has schema version "
                                 f"{int.from_bytes(schema, 'big')}, this code reads "
                                 f"{SCHEMA_VERSION}")
            raw_seq = txn.get(SEQUENCE_KEY, db=internal)
        return handles, internal, 0 if raw_seq is None else int.from_bytes(raw_seq, "big")

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the flusher thread; writes are refused before this."""
        if self._closed:
            raise StoreError("store is closed; open a new LsmStore")
        if self._flusher is None:
            self._flusher = Flusher(self._env, self._handles, self._internal, self._gate,
                                    self._queue, self._lazy_sync_s)
            self._flusher.start()

    def close(self) -> None:
        """Commit and fsync everything written so far, stop the flusher, close LMDB.

        Blocks while it flushes; from trio use ``aclose``.  Idempotent.
        """
        with self._close_lock:
            if self._closed:
                return
            self._queue.stop()
            if self._flusher is not None:
                self._flusher.join()
            with self._gate.exclusive():
                self._closed = True
                self._env.close()
            self._lock.release()

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.close)

    def __enter__(self) -> LsmStore:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def last_sequence(self) -> int:
        """Sequence number of the newest accepted write (persisted across reopen)."""
        return self._queue.last_seq

    def stats(self) -> dict[str, Any]:
        """Counters for $SYS topics and benchmarks (cheap; safe from any thread)."""
        q = self._queue
        with q.lock:
            out: dict[str, Any] = {
                "last_sequence": q.last_seq,
                "committed_sequence": q.committed_seq,
                "synced_sequence": q.synced_seq,
                "memtable_bytes": q.pending_bytes,
                "memtable_peak_bytes": q.peak_bytes,
                "memtable_max_bytes": q.max_bytes,
                "memtable_entries": len(q.memtable),
            }
            out.update({name: getattr(q.counters, name)
                        for name in q.counters.__dataclass_fields__})
        commits = out["commits"]
        out["mean_batch_ops"] = out["committed_ops"] / commits if commits else 0.0
        if not self._closed:
            info = self._env.info()
            out["map_size"] = info["map_size"]
            # Pages in use up to the highest one written: the file's real size on disk.
            out["used_bytes"] = (info["last_pgno"] + 1) * self._env.stat()["psize"]
        return out

    # -- writes --------------------------------------------------------------------------

    @staticmethod
    def _encode(ops: Sequence[Put | Delete]) -> tuple[list[EncodedOp], int]:
        encoded: list[EncodedOp] = []
        nbytes = 0
        for op in ops:
            if isinstance(op, Put):
                blob = encode_value(op.value)
                encoded.append((op.db, op.key, blob))
                nbytes += len(op.key) + len(blob) + OP_OVERHEAD
            elif isinstance(op, Delete):
                encoded.append((op.db, op.key, None))
                nbytes += len(op.key) + OP_OVERHEAD
            else:
                raise StoreError(f"write takes Put and Delete ops, got {type(op).__name__}")
        return encoded, nbytes

    def _check_started(self) -> None:
        if self._flusher is None:
            if self._closed:
                raise StoreError("store is closed; writes are refused")
            raise StoreError("store not started: call start() (or use it as a context "
                             "manager) before writing")

    def _check_synced(self, seq: int) -> None:
        q = self._queue
        if q.synced_seq < seq:
            raise q.failure or StoreError(f"write {seq} was not made durable (store closed)")

    def _enqueue_blocking(self, encoded: list[EncodedOp], nbytes: int, durable: bool,
                          waiter: ThreadWaiter | TrioWaiter | None) -> int:
        """Queue a write from a plain thread, waiting for memtable room if needed."""
        q = self._queue
        while True:
            with q.lock:
                q.check_writable_locked()
                if q.has_room_locked(nbytes):
                    return q.enqueue_locked(encoded, durable, nbytes, waiter)
                room = ThreadWaiter()
                q.wait_for_room_locked(room)
            room.wait()

    def write_sync(self, ops: Sequence[Put | Delete],
                   durability: Durability = Durability.DURABLE) -> int:
        """Blocking twin of ``write`` for plain threads (never call it on the event loop)."""
        encoded, nbytes = self._encode(ops)
        self._check_started()
        durable = durability is Durability.DURABLE
        waiter = ThreadWaiter() if durable else None
        seq = self._enqueue_blocking(encoded, nbytes, durable, waiter)
        if waiter is not None:
            waiter.wait()
            self._check_synced(seq)
        return seq

    @property
    def failure(self) -> StoreError | None:
        """Why the store refuses writes (its flusher died: disk full, I/O error), or None."""
        return self._queue.failure

    async def failed(self) -> StoreError:
        """Return once the store has failed (at once if it has), with the error: for a
        caller that must stop rather than serve on without durable writes."""
        waiter = TrioWaiter()
        if self._queue.watch_failure(waiter):
            await waiter.wait()
        failure = self._queue.failure
        assert failure is not None
        return failure

    async def write(self, ops: Sequence[Put | Delete],
                    durability: Durability = Durability.DURABLE) -> int:
        """Apply ``ops`` atomically; return the write's sequence number.

        DURABLE resumes after the fsync'd commit containing the write; LAZY once it is in the
        memtable (readable), possibly after waiting for memtable room.  Writes of more than
        ``INLINE_OPS`` ops are encoded in a worker thread so that encoding megabytes never
        stalls the loop.  Cancelling a waiting DURABLE caller does not undo a write that was
        already queued.

        Writes take sequence numbers in the order ``write`` (or ``begin_write``) was called,
        and so apply in it, whatever their size or a wait for memtable room: callers write a
        row's newer state after its older one and count on the newer winning.  Until
        2026-11-29 a big write queued from its thread after smaller writes called later, and
        a probe found a session's completed QoS 2 deliveries back in the store after a
        restart (sent again, 2 to 16 per round in 5 of 20 rounds).
        """
        pending = self.begin_write(ops, durability)
        try:
            return await pending.finish()
        finally:
            pending.abandon()

    def begin_write(self, ops: Sequence[Put | Delete],
                    durability: Durability = Durability.DURABLE) -> PendingWrite:
        """``write``'s first half, without yielding: the write takes its place in the order
        now (queued at once in the common case: few ops, room in the memtable, nobody ahead
        of it).  For a caller that must fix the order before it can wait, e.g. to start the
        wait in a task beside others: ``await pending.finish()`` completes it, and
        ``pending.abandon()`` (in a ``finally``) gives up a place never used, or every later
        write would wait for it for ever.  Raises ``StoreError`` at once, as ``write``."""
        self._check_started()
        durable = durability is Durability.DURABLE
        pending = PendingWrite(self, ops, durable, TrioWaiter() if durable else None)
        q = self._queue
        if len(ops) <= INLINE_OPS:
            pending.encoded, pending.nbytes = self._encode(ops)
        with q.lock:
            q.check_writable_locked()
            if (pending.encoded is not None and not self._turns
                    and q.has_room_locked(pending.nbytes)):
                pending.seq = q.enqueue_locked(pending.encoded, durable, pending.nbytes,
                                               pending.waiter)  # the common case
            else:
                pending.turn = _Turn()
                self._turns.append(pending.turn)
        return pending

    async def _queue_in_turn(self, turn: _Turn, encoded: list[EncodedOp], nbytes: int,
                             durable: bool, waiter: TrioWaiter | None) -> int:
        """Queue ``encoded`` once every write called before it is queued and the memtable
        has room for it; hand the turn on to the next."""
        q = self._queue
        while True:
            with q.lock:
                q.check_writable_locked()
                if self._turns[0] is turn:
                    if q.has_room_locked(nbytes):
                        seq = q.enqueue_locked(encoded, durable, nbytes, waiter)
                        self._turns.popleft()
                        self._wake_head_locked()
                        return seq
                    wake = TrioWaiter()
                    q.wait_for_room_locked(wake)
                else:
                    wake = turn.waiter = TrioWaiter()
            await wake.wait()

    def _wake_head_locked(self) -> None:
        """The next write in line may queue now: wake it if it waits for its turn."""
        if self._turns:
            head = self._turns[0]
            if head.waiter is not None:
                wake_all([head.waiter])
                head.waiter = None

    # -- snapshots -----------------------------------------------------------------------

    def snapshot_sync(self, dest: Path, *, shards: Iterable[int] | None = None,
                      node_id: str | None = None) -> Manifest:
        """Write a consistent copy of every write up to now into the new directory ``dest``.

        The flusher commits what is queued and opens a read transaction between two commits,
        so the snapshot holds exactly the writes up to its manifest's ``sequence``; writers
        are not stopped while rows are copied."""
        q = self._queue
        if self._closed:
            raise StoreError("store is closed; cannot snapshot")
        if self._flusher is not None:
            with q.lock:
                q.check_writable_locked()
                request = q.request_snapshot_locked()
            request.ready.wait()
            if request.error is not None:
                raise request.error
            assert request.txn is not None
            txn, seq = request.txn, request.seq
        else:
            # Not started: nothing can be queued, LMDB alone is the whole state.
            self._gate.enter()
            try:
                txn, seq = self._env.begin(write=False, buffers=True), q.last_seq
            except BaseException:
                self._gate.leave()
                raise
        try:
            manifest = write_snapshot(txn, self._handles, Path(dest), sequence=seq,
                                      node_id=node_id or self.node_id, shards=shards)
        finally:
            txn.abort()
            self._gate.leave()
        with q.lock:
            q.counters.snapshots += 1
        return manifest

    async def snapshot(self, dest: Path, *, shards: Iterable[int] | None = None,
                       node_id: str | None = None) -> Manifest:
        shard_list = None if shards is None else list(shards)
        return await trio.to_thread.run_sync(
            lambda: self.snapshot_sync(dest, shards=shard_list, node_id=node_id))

    # -- TTL -----------------------------------------------------------------------------

    def expire_sync(self, db: str, now: float, prefix: bytes = b"",
                    durability: Durability = Durability.LAZY) -> int:
        """Delete the rows of ``db`` under ``prefix`` whose value has ``expires_at <= now``.

        A row is deleted only if it still holds the exact value that was found expired, so a
        key rewritten meanwhile survives.  Cost is one pass over the range (O(rows)); the
        broker runs it periodically per shard.  Returns the number of rows deleted.
        """
        self._check_started()
        low, high = key_range(prefix, None, None)
        rows = self._merge(db, low, high, None, bytes)
        expired = [(key, blob) for key, blob in rows if is_expired(decode_value(blob), now)]
        q = self._queue
        handle = self._handles[db]
        durable = durability is Durability.DURABLE
        deleted = 0
        last_seq = 0
        for i in range(0, len(expired), _EXPIRE_CHUNK):
            chunk = expired[i:i + _EXPIRE_CHUNK]
            waiter = ThreadWaiter() if durable else None
            # Enter the gate before the lock: waiting for a map growth while holding the
            # lock would stall every writer.
            with self._gate.reading(), q.lock:
                q.check_writable_locked()
                ops: list[EncodedOp] = []
                with self._env.begin(write=False) as txn:
                    for key, blob in chunk:
                        found, current = q.memtable.lookup(db, key)
                        if not found:
                            current = txn.get(key, db=handle)
                        if current == blob:
                            ops.append((db, key, None))
                if not ops:
                    continue
                last_seq = q.enqueue_locked(ops, durable, len(ops) * OP_OVERHEAD, waiter)
                q.counters.expired += len(ops)
                deleted += len(ops)
            if waiter is not None:
                waiter.wait()
        if durable and last_seq:
            self._check_synced(last_seq)
        return deleted

    async def expire(self, db: str, now: float, prefix: bytes = b"",
                     durability: Durability = Durability.LAZY) -> int:
        return await trio.to_thread.run_sync(self.expire_sync, db, now, prefix, durability)
