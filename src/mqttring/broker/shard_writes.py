"""Where stored writes go: the local store alone, or the shard's replicas as well.

Sessions and retained messages are stored per shard (keys are prefixed by shard id), and
every write names its shard.  A single node writes to its own store; a cluster node writes
to its store *and* to the shard's other replicas (``mqttring.cluster.replication``), waiting
for their acknowledgement when the write is durable.  Both sides of that seam look alike to
``SessionStore`` and ``RetainedStore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mqttring.lsm import Delete, Durability, LsmStore, Put

Op = Put | Delete


class ShardWriter(Protocol):
    async def write(self, batches: Sequence[tuple[int, list[Op]]], durability: Durability) -> None:
        """Apply ``(shard, ops)`` batches; DURABLE returns once they survive a crash."""


class LocalShardWriter:
    """One node: one store, one group-committed transaction for all shards."""

    def __init__(self, store: LsmStore) -> None:
        self._store = store

    async def write(self, batches: Sequence[tuple[int, list[Op]]], durability: Durability) -> None:
        ops = [op for _, shard_ops in batches for op in shard_ops]
        if ops:
            await self._store.write(ops, durability)
