"""Retained messages of the topics this node is responsible for.

An in-memory ``TopicIndex`` answers "which retained messages match this filter" (walked along
the filter, not a scan) and the node store keeps them across restarts, keyed by the topic's
shard so that one shard's retained messages are one range scan (shard handoff and export
read them that way).  ``$SYS`` values are kept in memory only: they are recomputed every few
seconds and are meaningless after a restart.

Versioned rows: retained state never goes back in time
------------------------------------------------------
A stored row is ``[topic, payload, qos, epoch, seq]``, plus ``props`` for a message with
MQTT 5 properties (see ``make_row``).  ``(epoch, seq)`` is the row's
*version*: the shard owner stamps it when it accepts the write, with the cluster view epoch
the ownership decision was made in and a per-node sequence that strictly grows, across
restarts too (``max(last + 1, time.time_ns())``, and past the version it already holds in
the same epoch).  Everywhere a row is applied (a client's update on the owner, a replicated
batch on a replica, the catch-up copy, a reload) the row already held wins when its version
is >= the incoming one.  A node that accepted writes while it was cut off from the cluster
stamped them with the epoch it was stuck in, so when those writes are replayed after the
partition heals they lose against everything written in the newer epochs: they can never
replace an acknowledged newer value.  (Fencing stale nodes is the first line of defence;
this is the second.)  Epochs order owners; ``seq`` orders one owner's writes, so clocks of
different nodes are never compared within an epoch except in the stale-owner case, where
either answer is acceptable.

A clear (empty payload, [MQTT-3.3.1-10]) is versioned too: it is stored as a *tombstone*,
``[topic, None, 0, epoch, seq]``, not as a Delete, or an older Put replayed later would
resurrect the topic.  Readers treat tombstones as absent (index, queries, export).  Rows
written before versions existed (``[topic, payload, qos]``) read as version ``(0, 0)``.
Keys: the shard, then the topic's UTF-8 bytes.  LMDB keys end at 511 bytes and MQTT topics at
65,535, so a topic longer than ``NAMED_TOPIC_BYTES`` is keyed by ``0xFF`` (a byte UTF-8 never
starts with) and a 32-byte BLAKE2b digest of it instead; the row carries the topic anyway.
Every node derives the same key from the same topic, so replicas and copies agree.

Tombstones are collected once they are ``retained_tombstone_seconds`` old (one hour by
default; ``collect_tombstones``): each node deletes its own copies, locally, by the age the
owner's stamp gives (``seq`` is a wall-clock time in ns).  What a tombstone guards against
is an older write of the topic arriving after it, and such a write comes late only within
a node's life (an edge's or owner's retries, bounded by ``cluster_write_patience``; a link
replayed after a short cut, bounded by ``failure_grace``): what a node queued before it was
declared down is refused with its old incarnation (``cluster/fencing.py``) and its stale
rows dropped before it copies the shard again.  Kept for ever, as before 2026-11-29, every
cleared topic cost a row and its version in memory for the node's life (a fleet that
retires device topics grew without bound).

The memory side keeps the version of every topic of the shards this node holds (live and
tombstoned) in ``_versions``, next to the index.  Comparing there, not in the store, keeps
the replica path free of reads, and claiming the new version synchronously before the write
is queued means two concurrent batches for one topic cannot both pass the check with the
older landing last (store writes are queued in call order, ``LsmStore.begin_write``).
``update`` still writes the newest row again when a newer one was claimed while its write
was in flight: before 2026-11-29 the cluster writer queued its local write from a task of
its own, out of call order, and the rewrite costs nothing when nothing raced.

What a view change costs: the topics held are also filed by shard (``_shard_topics``), so a
node that stops holding shards forgets their topics only, in slices with a checkpoint
between them (``drop_shards``), not by hashing every topic held.  The filing follows
``shard_for_topic`` at the time a topic came; pins move topics between shards, so a change
of pins (and the first view, before which everything loaded was filed under no view's
shards) re-files every topic, in slices too (``reindex``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from hashlib import blake2b
from typing import Any, NamedTuple

import trio

from mqttring.broker.shard_writes import LocalShardWriter, Op, ShardWriter
from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.lsm.ops import MAX_KEY_SIZE
from mqttring.protocol.message import Message
from mqttring.protocol.session5 import PublishProps
from mqttring.protocol.topics import TopicIndex
from mqttring.ring.hashing import shard_of

log = logging.getLogger("mqttring.retained")

_DB = "retained"

#: Topics forgotten between two checkpoints when a view change drops shards (a few ms).
FORGET_SLICE = 1000

#: Longest topic, in UTF-8 bytes, stored under its own name (the 2-byte shard comes first).
NAMED_TOPIC_BYTES = MAX_KEY_SIZE - 2
_DIGEST_MARK = b"\xff"


def _topic_part(topic: str) -> bytes:
    """What follows the shard in a retained topic's key: its name, or the digest mark and
    a digest of a name too long for a key (module docstring, "Keys")."""
    raw = topic.encode("utf-8")
    if len(raw) > NAMED_TOPIC_BYTES:
        return _DIGEST_MARK + blake2b(raw, digest_size=32).digest()
    return raw


def topic_key(shard: int, topic: str) -> bytes:
    """The store key of a retained topic (see the module docstring, "Keys")."""
    return shard_key(shard, _topic_part(topic))


#: ``(epoch, seq)``: compared as a tuple, the epoch first.
Version = tuple[int, int]
#: The version of rows stored before rows carried one.
LEGACY_VERSION: Version = (0, 0)


def parse_row(row: Sequence[Any]) -> tuple[str, bytes | None, int, Version]:
    """``(topic, payload or None for a tombstone, qos, version)`` of a stored row.

    Accepts the current 5-element rows and the legacy 3-element ones (version ``(0, 0)``);
    anything else raises ValueError so that a corrupt row is reported, not half-applied.
    """
    if len(row) in (5, 6):
        topic, payload, qos, epoch, seq = row[:5]
        version = (int(epoch), int(seq))
    elif len(row) == 3:
        topic, payload, qos = row
        version = LEGACY_VERSION
    else:
        raise ValueError(f"retained row has {len(row)} fields, expected 3 or 5")
    if not isinstance(topic, str):
        raise ValueError("retained row topic is not a string")
    return topic, (bytes(payload) if payload else None), int(qos), version


def row_props(row: Sequence[Any]) -> PublishProps | None:
    """The MQTT 5 properties of a stored row (its optional sixth element), if any."""
    return PublishProps.from_wire(row[5]) if len(row) == 6 else None


def make_row(topic: str, payload: bytes | None, qos: int, version: Version,
             props: PublishProps | None = None) -> list[Any]:
    """The stored form of a retained message (``payload`` None or empty: a tombstone).

    A message with MQTT 5 properties gets a sixth element (``PublishProps.to_wire()``:
    forwarded properties, expiry deadline, origin); 3.1.1 rows stay five elements."""
    if not payload:
        return [topic, None, 0, version[0], version[1]]
    if props is not None:
        return [topic, payload, qos, version[0], version[1], props.to_wire()]
    return [topic, payload, qos, version[0], version[1]]


class RetainedWrite(NamedTuple):
    """What ``RetainedStore.apply_many`` changed in memory, still to be stored."""

    #: topic -> (its version, its stored row).
    rows: dict[str, tuple[Version, list[Any]]]
    #: Whether the write must be durable (a QoS >= 1 message among them).
    durable: bool


class RetainedStore:
    def __init__(
        self,
        store: LsmStore | None,
        num_shards: int,
        writer: ShardWriter | None = None,
        shard_for_topic: Callable[[str], int] | None = None,
        epoch: Callable[[], int] | None = None,
        *,
        max_bytes: int = 0,
        max_topics: int = 0,
    ) -> None:
        self._store = store
        self._writer: ShardWriter | None = writer or (
            LocalShardWriter(store) if store is not None else None
        )
        #: The cluster passes the view's function, which honours pinned subtrees.
        self.shard_for_topic = shard_for_topic or partial(shard_of, num_shards=num_shards)
        #: The current view epoch (a cluster passes its view's; a single node has none: 0).
        self._epoch: Callable[[], int] = epoch or (lambda: 0)
        self._index: TopicIndex[Message] = TopicIndex()
        #: Version of every stored topic held in memory, tombstones included ($SYS: never).
        self._versions: dict[str, Version] = {}
        #: Tombstoned topics -> their version's ``seq`` (the owner's wall clock, ns), in
        #: the order they came here: what ``collect_tombstones`` walks.
        self._tombstones: dict[str, int] = {}
        #: Last ``seq`` this node stamped: a node's stamps strictly grow even within one ns.
        self._last_seq = 0
        #: Updates and replicated/copied rows dropped for being older than the row held.
        self.stale_rejected = 0
        #: Digest-keyed topics held (``topic_key``), by key without its shard: a Delete
        #: names only the key, and a digest cannot be read back.
        self._digested: dict[bytes, str] = {}
        #: The topics of ``_versions`` by the shard ``shard_for_topic`` gave when they came,
        #: and that shard by topic: a shard this node stops holding is forgotten by walking
        #: its own topics, not every topic held (``drop_shards``; "What a view change costs"
        #: in docs/design.md).  Stale only when pins move topics (``reindex``).
        self._shard_topics: dict[int, set[str]] = {}
        self._topic_shard: dict[str, int] = {}
        #: Topics looked at by ``drop_shards``/``reindex``/``forget_shards`` (tests: the
        #: cost of a view change is that of what it changed).
        self.forget_visits = 0
        #: ``limits.max_retained_bytes``/``max_retained_messages`` (0: none), checked where
        #: this node decides what is retained (``update_many``: the owner, or the single
        #: node); replicated and copied rows follow their owner's decision.
        self.max_bytes = max_bytes
        self.max_topics = max_topics
        #: Payload and topic bytes of the retained messages held ($SYS aside): what
        #: ``max_bytes`` bounds.
        self.held_bytes = 0
        #: Retained messages delivered but not retained for a limit (``_fits``).
        self.refused = 0
        self._refusals_logged_at = -math.inf

    def __len__(self) -> int:
        return len(self._index)

    def _key(self, topic: str) -> bytes:
        return topic_key(self.shard_for_topic(topic), topic)

    def version(self, topic: str) -> Version | None:
        """The version held for ``topic`` (a tombstone's too), or None if none is held."""
        return self._versions.get(topic)

    async def load(self, prefix: bytes = b"") -> int:
        """Read the stored rows (under ``prefix``) into memory; how many retained messages
        are held then.  Rows include tombstones (a clear keeps its version), which the
        count left in: a restart after 10,000 clears of 100,000 said "100000 retained"."""
        if self._store is None:
            return 0
        rows = await self._store.scan(_DB, prefix)
        for _key, row in rows:
            self.apply_row(row)
        return len(self._index)

    def _apply(self, topic: str, payload: bytes | None, qos: int, version: Version,
               props: PublishProps | None = None, mid: int = 0) -> bool:
        """Install a row in memory unless the one held is as new; True if it was installed.

        ``mid``: the message's identity, if a cluster gave it one (memory only: a retained
        copy that a subscriber's session already got live is then recognised as the same
        message: ``Subscriptions._send_retained``, ``Session.deliver``)."""
        held = self._versions.get(topic)
        if held is not None and held >= version:
            return False
        if held is None:
            shard = self.shard_for_topic(topic)
            self._topic_shard[topic] = shard
            topics = self._shard_topics.get(shard)
            if topics is None:
                topics = self._shard_topics[shard] = set()
            topics.add(topic)
            if len(topic) > NAMED_TOPIC_BYTES // 4:  # 4 bytes at most per char
                part = _topic_part(topic)
                if part[:1] == _DIGEST_MARK:
                    self._digested[part] = topic
        self._versions[topic] = version
        old = self._index.get(topic)
        if old is not None:
            self.held_bytes -= len(old.payload) + len(topic)
        tombstones = self._tombstones
        if payload:
            self._index.set(topic, Message(topic, payload, qos, True, props, mid))
            self.held_bytes += len(payload) + len(topic)
            if tombstones:
                tombstones.pop(topic, None)
        else:
            self._index.discard(topic)
            tombstones.pop(topic, None)  # to the end: the walk meets the oldest first
            tombstones[topic] = version[1]
        return True

    def apply_ops(self, ops: Sequence[Put | Delete]) -> None:
        """Mirror the retained rows among stored ops (replicated, copied) into memory."""
        for op in ops:
            if op.db != _DB:
                continue
            if isinstance(op, Put):
                self.apply_row(op.value)
            else:
                self.apply_row(None, self.topic_of_key(op.key))

    def apply_row(self, row: Sequence[Any] | None, topic: str | None = None) -> bool:
        """Mirror one stored row (or its deletion: ``row`` None) into memory.

        A row older than (or as old as) the one held is ignored; returns whether memory
        changed.  A deletion is unconditional: it is a local clean-up of the store (a shard
        dropped before a catch-up copy), never a client's clear, which is a tombstone row.
        """
        if row is None:
            if topic is not None:
                self._forget(topic)
            return True
        return self._apply(*parse_row(row), row_props(row))

    def accept_ops(self, ops: list[Op]) -> list[Op]:
        """The ops of a replicated batch or copied chunk that may be written to the store.

        Retained Puts older than (or as old as) the row held are dropped; the others are
        installed in memory *now*, before the caller's store write is queued, so that a
        concurrent older batch for the same topic sees the newer version and is dropped.
        Other databases' ops and Deletes pass through untouched.
        """
        kept: list[Op] = []
        for op in ops:
            if (op.db == _DB and isinstance(op, Put)
                    and not self._apply(*parse_row(op.value), row_props(op.value))):
                self.stale_rejected += 1
                continue
            kept.append(op)
        return kept

    def forget_shards(self, keep: Callable[[int], bool]) -> None:
        """Drop from memory the topics of shards this node no longer holds (every topic
        held is looked at, in one step: ``reindex`` does it in slices)."""
        self.forget_visits += len(self._versions)
        for topic in [t for t in self._versions if not keep(self.shard_for_topic(t))]:
            self._forget(topic)

    def shards_held(self) -> set[int]:
        """The shards some topic held in memory belongs to (as indexed)."""
        return {shard for shard, topics in self._shard_topics.items() if topics}

    async def drop_shards(self, shards: Iterable[int], *,
                          slice_size: int = FORGET_SLICE) -> int:
        """Forget the topics of ``shards`` (no longer held here), walking only theirs, with
        a checkpoint every ``slice_size`` topics; returns how many were forgotten.

        The per-shard index is exact while the pins stay as they were when the topics came
        (a change of pins calls for ``reindex``)."""
        forgotten = budget = 0
        for shard in shards:
            topics = self._shard_topics.get(shard)
            if not topics:
                continue
            pending = list(topics)
            self.forget_visits += len(pending)
            for topic in pending:
                if budget == slice_size:  # counted across shards: most hold few topics
                    budget = 0
                    await trio.lowlevel.checkpoint()
                budget += 1
                # Re-read: a write or a newer copy may have come during a checkpoint.
                if self._topic_shard.get(topic) == shard:
                    self._forget(topic)
                    forgotten += 1
        return forgotten

    async def reindex(self, keep: Callable[[int], bool], *,
                      slice_size: int = FORGET_SLICE) -> int:
        """``forget_shards`` in slices with a checkpoint between them, also re-filing every
        topic kept under the shard ``shard_for_topic`` gives now: after the first view
        (topics loaded before it were filed under no view's shards) and whenever the pins
        change.  Returns how many topics were forgotten."""
        pending = list(self._versions)
        self.forget_visits += len(pending)
        forgotten = 0
        for start in range(0, len(pending), slice_size):
            if start:
                await trio.lowlevel.checkpoint()
            for topic in pending[start:start + slice_size]:
                filed = self._topic_shard.get(topic)
                if filed is None:
                    continue  # forgotten during a checkpoint
                shard = self.shard_for_topic(topic)
                if not keep(shard):
                    self._forget(topic)
                    forgotten += 1
                elif shard != filed:
                    self._unfile(topic, filed)
                    self._topic_shard[topic] = shard
                    self._shard_topics.setdefault(shard, set()).add(topic)
        return forgotten

    def _unfile(self, topic: str, shard: int) -> None:
        topics = self._shard_topics.get(shard)
        if topics is not None:
            topics.discard(topic)
            if not topics:
                del self._shard_topics[shard]

    def _forget(self, topic: str) -> None:
        self._versions.pop(topic, None)
        self._tombstones.pop(topic, None)
        old = self._index.get(topic)
        if old is not None:
            self.held_bytes -= len(old.payload) + len(topic)
            self._index.discard(topic)
        shard = self._topic_shard.pop(topic, None)
        if shard is not None:
            self._unfile(topic, shard)
        if len(topic) > NAMED_TOPIC_BYTES // 4:
            self._digested.pop(_topic_part(topic), None)

    @property
    def tombstones(self) -> int:
        """Cleared topics whose tombstone this node still holds (``/metrics``)."""
        return len(self._tombstones)

    async def collect_tombstones(self, older_than_ns: int, *,
                                 slice_size: int = FORGET_SLICE) -> int:
        """Forget the tombstones stamped before ``older_than_ns`` (wall clock, ns) and
        delete their rows from this node's store (not replicated: every holder of the
        shard collects its own copy); a checkpoint every ``slice_size``.  Returns how many
        were collected.  See the module docstring for why this age is safe."""
        old = [topic for topic, seq in self._tombstones.items() if seq < older_than_ns]
        collected = 0
        for start in range(0, len(old), slice_size):
            ops: list[Op] = []
            for topic in old[start:start + slice_size]:
                seq = self._tombstones.get(topic)
                if seq is None or seq >= older_than_ns:
                    continue  # set again (or forgotten) during a checkpoint
                shard = self._topic_shard.get(topic)  # where it was filed when it came
                if shard is None:
                    shard = self.shard_for_topic(topic)
                ops.append(Delete(_DB, topic_key(shard, topic)))
                self._forget(topic)
            if ops and self._store is not None:
                await self._store.write(ops, Durability.LAZY)
            collected += len(ops)
            await trio.lowlevel.checkpoint()
        return collected

    async def collect_tombstones_every(self, max_age: float, interval: float) -> None:
        """``collect_tombstones`` of those older than ``max_age`` seconds, every
        ``interval``; a task of the node's nursery until it is cancelled."""
        while True:
            await trio.sleep(interval)
            try:
                collected = await self.collect_tombstones(time.time_ns()
                                                          - int(max_age * 1e9))
            except Exception:  # the store failed: its own watch stops the node
                log.exception("retained tombstone collection failed; trying again")
                continue
            if collected:
                log.debug("collected %d retained tombstones older than %.0fs", collected,
                          max_age)

    def topic_of_key(self, key: bytes) -> str | None:
        """The topic a stored key belongs to; None for a digest of no topic held here."""
        if key[2:3] == _DIGEST_MARK:
            return self._digested.get(key[2:])
        return key[2:].decode("utf-8")

    def _stamp(self, topic: str, epoch: int) -> Version | None:
        """A version for a new write of ``topic`` in ``epoch``; None if it would go back.

        The write of an owner always supersedes what it holds from its own epoch (the seq
        also passes the held one, whatever the clocks say); a held row from a *newer* epoch
        means this node decided ownership on a stale view, and its write must lose.
        """
        held = self._versions.get(topic)
        if held is not None and held[0] > epoch:
            return None
        seq = max(self._last_seq + 1, time.time_ns())
        if held is not None and held[0] == epoch:
            seq = max(seq, held[1] + 1)
        self._last_seq = seq
        return (epoch, seq)

    async def update(self, message: Message, *, persist: bool = True,
                     epoch: int | None = None) -> None:
        """Set, replace or (empty payload, [MQTT-3.3.1-10]) clear the topic's retained message.

        ``epoch`` is that of the view in which this node decided it owns the topic's shard
        (default: the current one).  QoS >= 1 updates are durable before they return, so the
        PUBACK that follows never acknowledges a retained message a crash could lose.  An
        update stamped older than the row held (a stale owner) changes nothing.
        ``persist=False``: node-local (``$SYS``), never stored nor replicated.
        """
        if persist:
            await self.update_many([message], epoch=epoch)
        else:
            self._set_local(message)

    def _set_local(self, message: Message) -> None:
        """$SYS: node-local, never stored nor replicated, so not versioned."""
        topic = message.topic
        if message.payload:
            self._index.set(topic, Message(topic, message.payload, message.qos, True,
                                           message.props))
        else:
            self._index.discard(topic)

    async def update_many(self, messages: Sequence[Message], *,
                          epoch: int | None = None) -> None:
        """``update`` for what one connection published, in order, stored in one write.

        Memory changes at once, message by message (the last one of a topic wins); the
        rows go to the store together, durably if any of them is QoS >= 1: a publisher
        with many retained messages in flight pays one group commit per batch, not one
        per message.  ``$SYS/`` topics stay node-local (see ``update``).
        """
        await self.store(self.apply_many(messages, epoch=epoch))

    def apply_many(self, messages: Sequence[Message], *,
                   epoch: int | None = None) -> RetainedWrite:
        """``update_many``'s first half, in the caller's turn: memory changes now; what
        to write is returned, for ``store``.

        Apart so that a router can deliver the same messages in the same turn: a
        subscription registered in between would otherwise find a message both retained
        and then live (two copies), or a later live message ahead of an older retained one.
        """
        stamp_epoch = self._epoch() if epoch is None else epoch
        # topic -> (version, stored row); the row is built from the message just applied,
        # which is what memory now holds (no second walk of the index per topic).
        written: dict[str, tuple[Version, list[Any]]] = {}
        durable = False
        for message in messages:
            topic = message.topic
            if topic.startswith("$SYS/"):
                self._set_local(message)
                continue
            version = self._stamp(topic, stamp_epoch)
            if version is None:
                self.stale_rejected += 1
                log.warning("retained update of %r in epoch %d is older than the row held %s; "
                            "kept the newer one", topic, stamp_epoch, self._versions.get(topic))
                continue
            payload = message.payload or None
            if payload is not None and (self.max_bytes or self.max_topics) and not self._fits(
                    topic, payload):
                continue
            # Always installed: ``_stamp`` returned a version newer than the one held.
            self._apply(topic, payload, message.qos, version, message.props, message.mid)
            written[topic] = (version, make_row(topic, payload, message.qos, version,
                                                message.props))
            durable = durable or message.qos > 0
        return RetainedWrite(written, durable)

    async def store(self, write: RetainedWrite) -> None:
        """``update_many``'s second half: the rows ``apply_many`` built, in one write."""
        written = write.rows
        if self._writer is None or not written:
            return
        durability = Durability.DURABLE if write.durable else Durability.LAZY
        shard_for_topic = self.shard_for_topic
        while written:
            batches: dict[int, list[Op]] = {}
            for topic, (_version, row) in written.items():
                shard = shard_for_topic(topic)
                batches.setdefault(shard, []).append(Put(_DB, topic_key(shard, topic), row))
            await self._writer.write(list(batches.items()), durability)
            # A newer update of a topic may have been queued to the store *before* this
            # one (a cluster writer starts the local write in a task of its own, and trio
            # does not keep their order).  Writing the newest row again after this one
            # completes puts it last; replicas drop it as not newer than what they hold.
            newer: dict[str, tuple[Version, list[Any]]] = {}
            for topic, (version, _row) in written.items():
                held = self._versions.get(topic)
                if held is not None and held > version:
                    newer[topic] = (held, self._held_row(topic, held))
            written = newer

    def _fits(self, topic: str, payload: bytes) -> bool:
        """Whether retaining ``payload`` on ``topic`` keeps this node within its limits.

        Only what *adds* is refused: a new topic past ``max_topics``, more bytes past
        ``max_bytes``; a clear, or a payload no bigger than the one held, always passes, so
        a full node can still be emptied and updated in place.  A refused message is still
        delivered (the caller routes it whatever this says) and keeps the topic's earlier
        retained message, as EMQX's ``max_retained_messages`` does; one warning a minute
        says how many were refused."""
        old = self._index.get(topic)
        grows = len(payload) + len(topic) - (0 if old is None else len(old.payload) + len(topic))
        if ((old is not None or not self.max_topics
             or self._index.count_outside_dollar() < self.max_topics)
                and (grows <= 0 or not self.max_bytes
                     or self.held_bytes + grows <= self.max_bytes)):
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= 60.0:
            self._refusals_logged_at = now
            log.warning("retained message on %r not retained: this node holds %d retained "
                        "messages, %d bytes (limits.max_retained_messages %d, "
                        "max_retained_bytes %d); it was delivered. %d refused so far",
                        topic, self._index.count_outside_dollar(), self.held_bytes,
                        self.max_topics,
                        self.max_bytes, self.refused)
        return False

    def _held_row(self, topic: str, version: Version) -> list[Any]:
        """The stored form of what memory holds for ``topic`` (a tombstone if not indexed)."""
        message = self._index.get(topic)
        if message is None:
            return make_row(topic, None, 0, version)
        return make_row(topic, message.payload, message.qos, version, message.props)

    def count_user_topics(self) -> int:
        """Retained topics outside ``$SYS`` (the ``#`` filter skips ``$`` topics)."""
        return self._index.count_outside_dollar()

    def current(self, topic: str) -> Message | None:
        """The retained message of ``topic`` held now (the object ``matching`` returns)."""
        return self._index.get(topic)

    def matching(
        self, topic_filter: str, owned: Callable[[int], bool] | None = None
    ) -> list[Message]:
        """Retained messages matching a filter (only of shards ``owned`` accepts, if given)."""
        found = [message for _topic, message in self._index.match(topic_filter)]
        if owned is None:
            return found
        return [m for m in found if owned(self.shard_for_topic(m.topic))]
