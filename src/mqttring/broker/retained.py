"""Retained messages of the topics this node is responsible for.

An in-memory ``TopicIndex`` answers "which retained messages match this filter" (walked along
the filter, not a scan) and the node store keeps them across restarts, keyed by the topic's
shard so that one shard's retained messages are one range scan (shard handoff and export
read them that way).  ``$SYS`` values are kept in memory only: they are recomputed every few
seconds and are meaningless after a restart.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from mqttring.broker.shard_writes import LocalShardWriter, ShardWriter
from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.protocol.session import Message
from mqttring.protocol.topics import TopicIndex
from mqttring.ring.hashing import shard_of

_DB = "retained"


class RetainedStore:
    def __init__(
        self,
        store: LsmStore | None,
        num_shards: int,
        writer: ShardWriter | None = None,
        shard_for_topic: Callable[[str], int] | None = None,
    ) -> None:
        self._store = store
        self._writer: ShardWriter | None = writer or (
            LocalShardWriter(store) if store is not None else None
        )
        #: The cluster passes the view's function, which honours pinned subtrees.
        self.shard_for_topic = shard_for_topic or partial(shard_of, num_shards=num_shards)
        self._index: TopicIndex[Message] = TopicIndex()

    def __len__(self) -> int:
        return len(self._index)

    def _key(self, topic: str) -> bytes:
        return shard_key(self.shard_for_topic(topic), topic.encode("utf-8"))

    async def load(self, prefix: bytes = b"") -> int:
        if self._store is None:
            return 0
        rows = await self._store.scan(_DB, prefix)
        for _key, row in rows:
            self.apply_row(row)
        return len(rows)

    def apply_row(self, row: list | tuple | None, topic: str | None = None) -> None:
        """Mirror one stored row (or its deletion: ``row`` None) into the index."""
        if row is None:
            if topic is not None:
                self._index.discard(topic)
            return
        topic, payload, qos = row
        self._index.set(topic, Message(topic, payload, qos, True))

    def forget_shards(self, keep: Callable[[int], bool]) -> None:
        """Drop from memory the topics of shards this node no longer holds."""
        for topic in [t for t, _ in self._index.match("#") if not keep(self.shard_for_topic(t))]:
            self._index.discard(topic)

    @staticmethod
    def topic_of_key(key: bytes) -> str:
        return key[2:].decode("utf-8")


    async def update(self, message: Message, *, persist: bool = True) -> None:
        """Set, replace or (empty payload, [MQTT-3.3.1-10]) clear the topic's retained message.

        QoS >= 1 updates are durable before they return, so the PUBACK that follows never
        acknowledges a retained message a crash could lose.
        """
        topic = message.topic
        if message.payload:
            self._index.set(topic, Message(topic, message.payload, message.qos, True))
        else:
            self._index.discard(topic)
        if self._writer is None or not persist:
            return
        durability = Durability.DURABLE if message.qos else Durability.LAZY
        op: Put | Delete
        if message.payload:
            op = Put(_DB, self._key(topic), (topic, message.payload, message.qos))
        else:
            op = Delete(_DB, self._key(topic))
        await self._writer.write([(self.shard_for_topic(topic), [op])], durability)

    def count_user_topics(self) -> int:
        """Retained topics outside ``$SYS`` (the ``#`` filter skips ``$`` topics)."""
        return sum(1 for _ in self._index.match("#"))

    def matching(
        self, topic_filter: str, owned: Callable[[int], bool] | None = None
    ) -> list[Message]:
        """Retained messages matching a filter (only of shards ``owned`` accepts, if given)."""
        found = [message for _topic, message in self._index.match(topic_filter)]
        if owned is None:
            return found
        return [m for m in found if owned(self.shard_for_topic(m.topic))]
