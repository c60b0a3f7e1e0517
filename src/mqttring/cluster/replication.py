"""Shard data on R nodes: replicated writes and the catch-up copy of a shard.

Theory of operation
-------------------
Each shard's stored data (retained messages, persistent sessions and their queues) lives on
the shard's replica list: the owner plus R-1 replicas (``ClusterView.replicas``).  The owner
is the only writer of a shard.  ``ShardReplicator.write`` applies a batch to the local store
and sends the same operations to every other replica of the shard; a DURABLE write returns
only when every replica that is reachable in the current view has it durably, which is what
makes an acknowledged QoS 1 message survive the loss of the owner.  A replica that does not
answer is asked again until it answers or the view no longer names it (the failure detector
moved the shard; a new replica copies the data from us).  A write is never reported durable
on fewer replicas than the current view names: past ``patience`` it fails, and the caller
withholds its acknowledgement.  That is what keeps an owner cut off from its replicas from
acknowledging messages that only it holds (the majority will take its shards over and a
healed node discards what it held).

Catch-up: a node that (re)joins is made a *catching-up* target of some shards by the
metadata state machine, and already receives their new writes (it is in ``replicas``).  It
copies what existed before with a range scan from the owner (``cu`` requests, one database
and one chunk at a time), skipping every key that a live write has touched since the copy
started, so an old copied value can never overwrite a newer replicated one.  When all its
shards are copied it reports them caught up through Raft; only then may it become owner.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from operator import itemgetter
from typing import Any

import trio

from mqttring.broker.shard_writes import Op
from mqttring.cluster.errors import PeerFailure, ReplicationIncomplete, peer_failures_unwrapped
from mqttring.cluster.links import Links, in_frames
from mqttring.cluster.messages import CatchUp, Repl, ShardOps, ShardRows, StoredOp
from mqttring.lsm import Delete, Durability, LsmStore, Put, encode_value, shard_key
from mqttring.raft.view import ClusterView

log = logging.getLogger("mqttring.cluster.replication")

#: Databases that hold shard data (and so are replicated and copied on catch-up).
SHARD_DATABASES = ("retained", "sessions", "queues", "inflight")
CATCH_UP_CHUNK = 2000
#: Rows read per store scan while filling a ``CatchUp`` answer.
CATCH_UP_SCAN = 256
REPLICA_TIMEOUT = 5.0


def op_size(op: Op) -> int:
    """About how many bytes ``op`` takes in a link frame (at most 4 per character of text),
    from its key and the top level of its value: payloads are there."""
    size = 64 + len(op.key)
    if type(op) is Put:
        value = op.value
        for part in value if type(value) is list else (value,):
            kind = type(part)
            if kind is bytes:
                size += len(part)
            elif kind is str:
                size += 4 * len(part)
    return size


def in_frame_runs(shard_ops: list[tuple[int, list[Op]]], budget: int) -> list[list[ShardOps]]:
    """One write's ops for one replica, as the ``Repl`` messages that carry them: one unless
    they exceed ``budget`` bytes (a large message queued for many persistent sessions), for
    the link drops a message larger than a frame, and the write could then never be
    confirmed.  The replica applies each message atomically, not the whole write; the write
    is acknowledged only once every message is."""
    if sum(op_size(op) for _, ops in shard_ops for op in ops) <= budget:  # nearly always
        return [[ShardOps(shard, encode_ops(ops)) for shard, ops in shard_ops]]
    pairs = [(shard, op) for shard, ops in shard_ops for op in ops]
    return [[ShardOps(shard, encode_ops([op for _, op in group]))
             for shard, group in itertools.groupby(run, key=itemgetter(0))]
            for run in in_frames(pairs, lambda pair: op_size(pair[1]), budget)]


def encode_ops(ops: Sequence[Op]) -> list[StoredOp]:
    return [StoredOp(op.db, op.key, op.value) if isinstance(op, Put)
            else StoredOp(op.db, op.key, None) for op in ops]


def decode_ops(raw: list[StoredOp]) -> list[Op]:
    ops: list[Op] = []
    for op in raw:
        if op.db not in SHARD_DATABASES:
            raise ValueError(f"bad replicated op for {op.db!r}")
        ops.append(Delete(op.db, op.key) if op.value is None else Put(op.db, op.key, op.value))
    return ops


def _accept_all(ops: list[Op]) -> list[Op]:
    return ops


class ShardReplicator:
    """The cluster's ``ShardWriter`` and the receiving end of replication and catch-up."""

    def __init__(
        self,
        node_id: str,
        store: LsmStore,
        links: Links,
        view: Callable[[], ClusterView],
        on_applied: Callable[[list[Op]], None],
        wait_for_view_change: Callable[[float], Awaitable[None]],
        *,
        accept_ops: Callable[[list[Op]], list[Op]] | None = None,
        patience: float = 15.0,
    ) -> None:
        self.node_id = node_id
        self.wait_for_view_change = wait_for_view_change
        #: Longest a durable write keeps asking a replica that the view still names.
        self.patience = patience
        self.store = store
        self.links = links
        self.view = view
        #: Keeps in-memory mirrors (the retained index) in step with replicated rows.
        self.on_applied = on_applied
        #: Drops incoming ops older than what this node holds (versioned retained rows)
        #: before they reach the store; replication itself knows no row semantics.
        self.accept_ops: Callable[[list[Op]], list[Op]] = accept_ops or _accept_all
        #: Keys written by live replication per shard while that shard is being copied.
        self._touched: dict[int, set[tuple[str, bytes]]] = {}
        self.replicated_batches = 0

    # -- the writer side ------------------------------------------------------------------

    async def write(self, batches: Sequence[tuple[int, list[Op]]], durability: Durability) -> None:
        all_ops = [op for _, ops in batches for op in ops]
        if not all_ops:
            return
        view = self.view()
        by_node: dict[str, list[tuple[int, list[Op]]]] = {}
        for shard, ops in batches:
            for node in view.replicas(shard):
                if node != self.node_id:
                    by_node.setdefault(node, []).append((shard, ops))
        messages = [(node, run) for node, shard_ops in by_node.items()
                    for run in in_frame_runs(shard_ops, self.links.max_frame // 2)]
        if durability is Durability.LAZY:
            for node, run in messages:
                self.links.send(node, Repl(0, run, False))
            await self.store.write(all_ops, durability)
            return
        # The local write and the first copy to each replica take their places now, before
        # anything else this loop writes or sends: a replica applies what it receives in
        # arrival order (``on_repl``), and the store in call order, so a row's newer state
        # written next (say a lazy write right after this durable one) stays the newer one
        # on every copy.  Started from tasks, they went in whatever order trio ran those.
        local = self.store.begin_write(all_ops, durability)
        try:
            first: list[Awaitable[None] | None] = []
            for node, run in messages:
                try:
                    first.append(self.links.request_now(node, Repl(0, run, True),
                                                        REPLICA_TIMEOUT))
                except PeerFailure:
                    first.append(None)  # no link now: asked again below
            with peer_failures_unwrapped():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(local.finish)
                    for (node, run), answer in zip(messages, first, strict=True):
                        nursery.start_soon(self._replicate, node, run, answer)
        finally:
            local.abandon()
            for answer in first:
                if isinstance(answer, Coroutine):
                    answer.close()  # never awaited (cancelled first): no warning
        self.replicated_batches += 1

    async def _replicate(self, node: str, shard_ops: list[ShardOps],
                         answer: Awaitable[None] | None) -> None:
        shards = [entry.shard for entry in shard_ops]
        deadline = trio.current_time() + self.patience
        while True:
            try:
                if answer is not None:
                    waiting, answer = answer, None
                    await waiting
                else:
                    await self.links.request(node, Repl(0, shard_ops, True), REPLICA_TIMEOUT)
                return
            except PeerFailure as exc:
                view = self.view()
                if not any(node in view.replicas(shard) for shard in shards):
                    # Re-placed: whoever replaces it copies the shard from us (catch-up).
                    log.info("replica %s left shards %s before confirming: %s", node, shards,
                             exc)
                    return
                if trio.current_time() >= deadline:
                    raise ReplicationIncomplete(
                        f"replica {node} of shards {shards} did not confirm: {exc}") from exc
                log.debug("replica %s did not confirm a write (%s); asking again", node, exc)
                await self.wait_for_view_change(0.5)

    # -- the replica side -----------------------------------------------------------------

    def on_repl(self, node: str, message: Repl) -> Callable[[], Awaitable[None]]:
        """Apply a batch the owner replicated to us, then acknowledge it if asked to.

        Called inline, in the order batches arrive, which is the order the owner wrote
        them: the store write takes its place here (``begin_write``), and what returns
        waits for it and answers, in a task.  Applied from one task per batch, two batches
        of one frame reached the store in the order trio ran those tasks (it shuffles
        them), and a row's older state could win on the replica.
        """
        ops: list[Op] = []
        for entry in message.shards:
            decoded = decode_ops(entry.ops)
            touched = self._touched.get(entry.shard)
            if touched is not None:
                touched.update((op.db, op.key) for op in decoded)
            ops.extend(decoded)
        ops = self.accept_ops(ops)
        pending = self.store.begin_write(
            ops, Durability.DURABLE if message.durable else Durability.LAZY)

        async def finish() -> None:
            try:
                await pending.finish()
            finally:
                pending.abandon()
            self.on_applied(ops)
            self.links.reply(node, message.req, True)

        return finish

    async def serve_catch_up(self, node: str, message: CatchUp) -> None:
        """Answer a ``CatchUp`` with the next chunk of rows."""
        req, db, after = message.req, message.db, message.after
        if db not in SHARD_DATABASES:
            self.links.reply(node, req, False, f"unknown database {db!r}")
            return
        prefix = shard_key(message.shard)
        start = after + b"\x00" if after else prefix
        # Bounded in bytes too: a chunk of 2,000 large rows (retained messages, a session's
        # backlog) is past the frame limit, and the link would drop the answer: the copy
        # would then fail on every try.  Read in small scans, so as not to hold such a
        # chunk in memory either.
        budget = self.links.max_frame // 2
        page: list[tuple[bytes, Any]] = []
        used = 0
        while len(page) < CATCH_UP_CHUNK:
            limit = min(CATCH_UP_SCAN, CATCH_UP_CHUNK - len(page))
            rows = await self.store.scan(db, prefix, start=start, limit=limit)
            for key, value in rows:
                size = len(key) + len(encode_value(value))
                if page and used + size > budget:
                    self.links.reply(node, req, True, ShardRows(page, True))
                    return
                page.append((key, value))
                used += size
            if len(rows) < limit:
                self.links.reply(node, req, True, ShardRows(page, False))
                return
            start = rows[-1][0] + b"\x00"
        self.links.reply(node, req, True, ShardRows(page, True))

    async def copy_shard(self, shard: int, source: str) -> int:
        """Copy one shard from ``source``; returns the number of rows written."""
        touched = self._touched.setdefault(shard, set())
        copied = 0
        try:
            for db in SHARD_DATABASES:
                after = b""
                while True:
                    answer = await self.links.request(source, CatchUp(0, shard, db, after),
                                                      expect=ShardRows)
                    rows = answer.rows
                    ops: list[Op] = self.accept_ops([
                        Put(db, key, value) for key, value in rows if (db, key) not in touched
                    ])
                    if ops:
                        await self.store.write(ops, Durability.LAZY)
                        self.on_applied(ops)
                        copied += len(ops)
                    if not answer.more or not rows:
                        break
                    after = rows[-1][0]
            await self.store.write([], Durability.DURABLE)  # make the whole copy durable
        finally:
            self._touched.pop(shard, None)
        return copied
