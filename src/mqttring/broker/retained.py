"""Retained messages of the topics this node is responsible for.

An in-memory ``TopicIndex`` answers "which retained messages match this filter" (walked along
the filter, not a scan) and the node store keeps them across restarts, keyed by the topic's
shard so that one shard's retained messages are one range scan (shard handoff and export
read them that way).  ``$SYS`` values are kept in memory only: they are recomputed every few
seconds and are meaningless after a restart.
"""

from __future__ import annotations

from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.protocol.session import Message
from mqttring.protocol.topics import TopicIndex
from mqttring.ring.hashing import shard_of

_DB = "retained"


class RetainedStore:
    def __init__(self, store: LsmStore | None, num_shards: int) -> None:
        self._store = store
        self._num_shards = num_shards
        self._index: TopicIndex[Message] = TopicIndex()

    def __len__(self) -> int:
        return len(self._index)

    def _key(self, topic: str) -> bytes:
        return shard_key(shard_of(topic, self._num_shards), topic.encode("utf-8"))

    async def load(self) -> int:
        if self._store is None:
            return 0
        rows = await self._store.scan(_DB)
        for _key, (topic, payload, qos) in rows:
            self._index.set(topic, Message(topic, payload, qos, True))
        return len(rows)

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
        if self._store is None or not persist:
            return
        durability = Durability.DURABLE if message.qos else Durability.LAZY
        op: Put | Delete
        if message.payload:
            op = Put(_DB, self._key(topic), (topic, message.payload, message.qos))
        else:
            op = Delete(_DB, self._key(topic))
        await self._store.write([op], durability)

    def count_user_topics(self) -> int:
        """Retained topics outside ``$SYS`` (the ``#`` filter skips ``$`` topics)."""
        return sum(1 for _ in self._index.match("#"))

    def matching(self, topic_filter: str) -> list[Message]:
        return [message for _topic, message in self._index.match(topic_filter)]
