"""Group commit: the queue writers append to and the one thread that turns it into LMDB commits.

``CommitQueue`` is the state writers, readers and the flusher share, all under one
``threading.Lock`` held only for O(batch) bookkeeping (never for I/O):

- ``last_seq`` numbers writes; a write's sequence is assigned, its ops enter the memtable and
  its batch is appended to ``pending`` in one locked step, so queue order is sequence order
  and a durable waiter registered in that step can never miss its wakeup.
- ``pending_bytes`` counts encoded bytes of writes not yet committed; a writer that would
  push it past ``max_bytes`` waits (back-pressure) unless nothing is pending at all, so one
  oversized write still goes through instead of waiting forever.
- ``committed_seq`` / ``synced_seq``: everything up to these is in LMDB / on stable storage.

``Flusher`` owns the only LMDB write transactions (so they never leave its thread): it takes
everything pending, writes it in a single transaction, releases the memtable entries, fsyncs
if any write in it was durable (or ``lazy_sync_s`` has passed), then wakes the writers whose
sequence is now synced.  It never sleeps for batching: a lone writer's commit starts at once,
and writers arriving during an fsync form the next batch.  A full map is grown here, between
transactions, behind the ``MapGate``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import lmdb

from mqttring.lsm.mapgate import MapGate
from mqttring.lsm.memtable import EncodedOp, Memtable
from mqttring.lsm.ops import StoreError
from mqttring.lsm.wakeups import Waiter, wake_all

#: Name of the internal sub-database and its keys (sequence of the last commit, schema).
INTERNAL_DB = b"__lsm__"
SEQUENCE_KEY = b"sequence"
SCHEMA_KEY = b"schema_version"
#: Memtable entries released per lock hold after a commit.
RELEASE_CHUNK = 512


@dataclass(slots=True)
class Batch:
    """One ``write`` call: applied atomically, in one LMDB transaction."""

    seq: int
    ops: list[EncodedOp]
    durable: bool
    nbytes: int


@dataclass(slots=True)
class SnapshotRequest:
    """Queue marker: hand over a read transaction that sees exactly writes <= ``seq``."""

    seq: int
    ready: threading.Event = field(default_factory=threading.Event)
    txn: lmdb.Transaction | None = None
    error: StoreError | None = None


@dataclass(slots=True)
class Counters:
    writes: int = 0
    durable_writes: int = 0
    puts: int = 0
    deletes: int = 0
    commits: int = 0
    committed_ops: int = 0
    max_batch_ops: int = 0
    max_batch_writes: int = 0
    syncs: int = 0
    map_grows: int = 0
    backpressure_waits: int = 0
    snapshots: int = 0
    expired: int = 0
    #: Seconds spent in write transactions and in fsyncs (the mean latency of each is this
    #: over ``commits`` / ``syncs``; exposed in ``/metrics``).
    commit_seconds: float = 0.0
    sync_seconds: float = 0.0


class CommitQueue:
    """Shared state between writers (any thread), readers and the flusher; see module doc."""

    def __init__(self, last_seq: int, max_bytes: int) -> None:
        self.lock = threading.Lock()
        self._wakeup = threading.Condition(self.lock)
        self.memtable = Memtable()
        self.counters = Counters()
        self.last_seq = last_seq
        self.committed_seq = last_seq
        self.synced_seq = last_seq
        self.max_bytes = max_bytes
        self.pending_bytes = 0
        self.peak_bytes = 0
        self.failure: StoreError | None = None
        self.stopping = False
        self.held = False
        self._pending: list[Batch | SnapshotRequest] = []
        self._flusher_idle = False
        self._durable_waiters: deque[tuple[int, Waiter]] = deque()
        self._space_waiters: list[Waiter] = []
        self._failure_waiters: list[Waiter] = []

    # -- writers (caller holds self.lock) -------------------------------------------------

    def check_writable_locked(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.stopping:
            raise StoreError("store is closed (or closing); writes are refused")

    def has_room_locked(self, nbytes: int) -> bool:
        return self.pending_bytes == 0 or self.pending_bytes + nbytes <= self.max_bytes

    def wait_for_room_locked(self, waiter: Waiter) -> None:
        self.counters.backpressure_waits += 1
        self._space_waiters.append(waiter)

    def enqueue_locked(self, ops: list[EncodedOp], durable: bool, nbytes: int,
                       waiter: Waiter | None) -> int:
        self.last_seq += 1
        seq = self.last_seq
        self.memtable.apply(seq, ops)
        self._pending.append(Batch(seq, ops, durable, nbytes))
        self.pending_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)
        c = self.counters
        c.writes += 1
        c.durable_writes += durable
        for _, _, blob in ops:
            if blob is None:
                c.deletes += 1
            else:
                c.puts += 1
        if waiter is not None:
            self._durable_waiters.append((seq, waiter))
        self._notify_locked()
        return seq

    def request_snapshot_locked(self) -> SnapshotRequest:
        request = SnapshotRequest(self.last_seq)
        self._pending.append(request)
        self._notify_locked()
        return request

    def _notify_locked(self) -> None:
        if self._flusher_idle:
            self._flusher_idle = False
            self._wakeup.notify()

    # -- flusher ------------------------------------------------------------------------

    def take(self, timeout: float | None) -> tuple[list[Batch | SnapshotRequest], bool]:
        """Everything pending, waiting up to ``timeout`` (None: forever) if nothing is; and
        whether these are the last (the store is stopping: no write is accepted after).

        "Last" is read under the lock that drained the queue.  The flusher used to test
        ``stopping`` after ``take`` returned: a write queued and a ``close`` in between (the
        flusher back from an empty wait) ended the flusher with that write uncommitted, a
        LAZY write lost at a clean close (the store's model test, 1 run in 5 under load)."""
        with self.lock:
            if (self.held or not self._pending) and not self.stopping:
                self._flusher_idle = True
                self._wakeup.wait(timeout)
                self._flusher_idle = False
            if self.held and not self.stopping:
                return [], False
            items, self._pending = self._pending, []
            return items, self.stopping

    def hold(self, held: bool) -> None:
        """Tests only: while held, the flusher commits nothing, so writes stay in the memtable
        (durable writers and snapshots wait).  ``stop`` overrides it."""
        with self.lock:
            self.held = held
            self._wakeup.notify()

    def committed(self, batches: list[Batch], seq: int) -> None:
        """``batches`` are visible in LMDB: drop them from the memtable, release bytes.

        The lock is dropped every ``RELEASE_CHUNK`` ops so that a writer on the event loop
        never waits behind a whole large commit's bookkeeping.  Releasing part of a write
        early is safe: what is released is already readable from LMDB."""
        lock = self.lock
        lock.acquire()
        try:
            budget = RELEASE_CHUNK
            for batch in batches:
                ops = batch.ops
                for i in range(0, len(ops), RELEASE_CHUNK):
                    chunk = ops[i:i + RELEASE_CHUNK]
                    self.memtable.release(batch.seq, chunk)
                    budget -= len(chunk)
                    if budget <= 0:
                        lock.release()
                        lock.acquire()
                        budget = RELEASE_CHUNK
                self.pending_bytes -= batch.nbytes
            self.committed_seq = seq
            waiters, self._space_waiters = self._space_waiters, []
        finally:
            lock.release()
        wake_all(waiters)

    def synced(self, seq: int) -> None:
        """Everything <= ``seq`` is on stable storage: wake its durable writers."""
        woken: list[Waiter] = []
        with self.lock:
            self.synced_seq = seq
            queue = self._durable_waiters
            while queue and queue[0][0] <= seq:
                woken.append(queue.popleft()[1])
        wake_all(woken)

    def watch_failure(self, waiter: Waiter) -> bool:
        """Wake ``waiter`` when the flusher dies; False (and no wake) if it already has."""
        with self.lock:
            if self.failure is not None:
                return False
            self._failure_waiters.append(waiter)
            return True

    def fail(self, error: StoreError) -> None:
        """The flusher died: refuse writes from now on and wake everyone so they can raise."""
        with self.lock:
            if self.failure is None:
                self.failure = error
            waiters = ([w for _, w in self._durable_waiters] + self._space_waiters
                       + self._failure_waiters)
            self._durable_waiters.clear()
            self._space_waiters = []
            self._failure_waiters = []
            requests = [r for r in self._pending if isinstance(r, SnapshotRequest)]
        for request in requests:
            request.error = error
            request.ready.set()
        wake_all(waiters)

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self._wakeup.notify()
            waiters, self._space_waiters = self._space_waiters, []
        wake_all(waiters)


class Flusher:
    """The group-commit thread; see the module docstring for its loop and invariants."""

    def __init__(self, env: lmdb.Environment, handles: dict[str, Any], internal: Any,
                 gate: MapGate, queue: CommitQueue, lazy_sync_s: float) -> None:
        self._env = env
        self._handles = handles
        self._internal = internal
        self._gate = gate
        self._queue = queue
        self._lazy_sync_s = lazy_sync_s
        self._last_sync = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="lsm-flusher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        q = self._queue
        items: list[Batch | SnapshotRequest] = []
        try:
            while True:
                timeout = None
                if q.committed_seq > q.synced_seq:
                    timeout = max(0.0, self._last_sync + self._lazy_sync_s - time.monotonic())
                items, last = q.take(timeout)
                if items:
                    self._process(items)
                if q.committed_seq > q.synced_seq and (
                    last or time.monotonic() >= self._last_sync + self._lazy_sync_s
                ):
                    self._sync()
                if last:
                    break
        except BaseException as exc:
            error = StoreError(f"store flusher failed, writes are refused: {exc!r}")
            q.fail(error)
            # Snapshot requests already taken off the queue wait on us, not on the queue.
            for item in items:
                if isinstance(item, SnapshotRequest) and not item.ready.is_set():
                    item.error = error
                    item.ready.set()
            if not isinstance(exc, Exception):
                raise

    def _process(self, items: list[Batch | SnapshotRequest]) -> None:
        done: list[Batch] = []
        segment: list[Batch] = []
        for item in items:
            if isinstance(item, SnapshotRequest):
                if segment:
                    self._commit(segment)
                    done.extend(segment)
                    segment = []
                self._hand_over(item)
            else:
                segment.append(item)
        if segment:
            self._commit(segment)
            done.extend(segment)
        if not done:
            return
        self._queue.committed(done, done[-1].seq)
        if any(batch.durable for batch in done):
            self._sync()

    def _commit(self, batches: list[Batch]) -> None:
        """Write ``batches`` in one transaction, growing the map until it fits.

        The transaction is atomic, so only each key's last op matters: ops are collapsed to
        the final state per key, then written per database in key order, puts with one
        ``putmulti`` call.  Fewer, sorted LMDB calls matter beyond speed: py-lmdb releases
        the GIL around every call, and each reacquisition can wait a whole switch interval
        behind a busy event loop, so a put-per-op loop starves the flusher under load."""
        final: dict[str, dict[bytes, bytes | None]] = {}
        for batch in batches:
            for db, key, blob in batch.ops:
                table = final.get(db)
                if table is None:
                    table = final[db] = {}
                table[key] = blob
        plan = []
        for db, table in final.items():
            puts = sorted((k, b) for k, b in table.items() if b is not None)
            deletes = sorted(k for k, b in table.items() if b is None)
            plan.append((self._handles[db], puts, deletes))
        started = time.perf_counter()
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for handle, puts, deletes in plan:
                        if puts:
                            with txn.cursor(db=handle) as cursor:
                                cursor.putmulti(puts)
                        for key in deletes:
                            txn.delete(key, db=handle)
                    txn.put(SEQUENCE_KEY, batches[-1].seq.to_bytes(8, "big"),
                            db=self._internal)
                break
            except lmdb.MapFullError:
                self._grow()
        c = self._queue.counters
        ops = sum(len(batch.ops) for batch in batches)
        c.commit_seconds += time.perf_counter() - started
        c.commits += 1
        c.committed_ops += ops
        c.max_batch_ops = max(c.max_batch_ops, ops)
        c.max_batch_writes = max(c.max_batch_writes, len(batches))

    def _grow(self) -> None:
        with self._gate.exclusive():
            size = self._env.info()["map_size"]
            self._env.set_mapsize(size * 2)
        self._queue.counters.map_grows += 1

    def _sync(self) -> None:
        seq = self._queue.committed_seq
        started = time.perf_counter()
        self._env.sync(True)
        self._last_sync = time.monotonic()
        self._queue.counters.sync_seconds += time.perf_counter() - started
        self._queue.counters.syncs += 1
        self._queue.synced(seq)

    def _hand_over(self, request: SnapshotRequest) -> None:
        """Open the snapshot's read transaction now, between commits, so it sees exactly the
        writes queued before the request.  The snapshot thread leaves the gate when done."""
        self._gate.enter()
        try:
            request.txn = self._env.begin(write=False, buffers=True)
        except BaseException:
            self._gate.leave()
            raise
        request.ready.set()
