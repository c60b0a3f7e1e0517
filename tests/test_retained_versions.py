"""Retained state never goes back in time: versioned rows on real LMDB stores.

A retained row is ``[topic, payload, qos, epoch, seq]`` (``mqttring.broker.retained``); a
write older than the row held for its topic must never replace it, neither in the store nor
in the in-memory index, whichever way it arrives: a client's update on the owner, a
replicated batch (``ShardReplicator.on_repl``), or the catch-up copy
(``ShardReplicator.copy_shard``).  The scenario behind it: a node cut off by a partition
accepted writes in its stale epoch and replayed them once the partition healed, and an
acknowledged retained value went back on every node.

Everything runs on real ``LsmStore`` files under ``tmp_path``; only the network is replaced,
by a links object that calls the peer's handler directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mqttring.analytics.export import export_snapshot
from mqttring.analytics.schemas import decode_row
from mqttring.broker.retained import RetainedStore, Version, make_row, parse_row
from mqttring.broker.shard_writes import Op
from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.messages import Ack, CatchUp, Repl, ShardOps, decode_frame, encode_frame
from mqttring.cluster.replication import (
    CATCH_UP_CHUNK,
    ShardReplicator,
    encode_ops,
    in_frame_runs,
)
from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.protocol.message import Message
from mqttring.raft.view import EMPTY_VIEW
from mqttring.rpc import MAX_FRAME

NUM_SHARDS = 4
TOPIC = "plant/1/temp"


# -- helpers ------------------------------------------------------------------------------


async def _no_view_change(timeout: float) -> None:
    """These tests never change the view; a replica that fails fails at once."""


class RecordingWriter:
    """The owner's ``ShardWriter``: writes to its own store and keeps the batches, which the
    test then delivers to replicas (now, late, twice, out of order) as a network might."""

    def __init__(self, store: LsmStore) -> None:
        self.store = store
        self.batches: list[tuple[int, list[Op]]] = []

    async def write(self, batches: Sequence[tuple[int, list[Op]]], durability: Durability) -> None:
        self.batches.extend(batches)
        await self.store.write([op for _, ops in batches for op in ops], durability)


class Owner:
    """A shard owner: a ``RetainedStore`` stamping versions with a settable view epoch."""

    def __init__(self, path: Path, stack: Any) -> None:
        self.store = stack.enter_context(LsmStore(path))
        self.writer = RecordingWriter(self.store)
        self.epoch = 1
        self.retained = RetainedStore(self.store, NUM_SHARDS, self.writer,
                                      epoch=lambda: self.epoch)

    async def publish(self, payload: bytes, topic: str = TOPIC, qos: int = 1) -> Repl:
        """Retain ``payload`` (empty: clear) and return the repl message it produced."""
        before = len(self.writer.batches)
        await self.retained.update(Message(topic, payload, qos, True))
        return repl_message(self.writer.batches[before:])


def over_the_wire(message: Any) -> Any:
    """A link message as the peer decodes it (through the frame codec)."""
    return decode_frame(encode_frame(1, 1, [message])).messages[0]


def repl_message(batches: Sequence[tuple[int, list[Op]]], req: int = 7) -> Repl:
    """The ``Repl`` the owner's writes produce, as it crosses the wire."""
    return over_the_wire(Repl(req, [ShardOps(shard, encode_ops(ops)) for shard, ops in batches],
                              True))


class FakeLinks:
    """Answers instead of a network: replies are recorded; ``cu`` requests are served by
    the source node's replicator, called directly."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.replies: list[tuple[str, int, bool, Any]] = []
        self.peers: dict[str, ShardReplicator] = {}
        #: As ``Links``: a message in a frame larger than this is dropped, never answered.
        self.max_frame = max_frame

    def reply(self, node: str, req: int, ok: bool, body: Any = None) -> None:
        self.replies.append((node, req, ok, body))

    def send(self, node: str, message: Any) -> bool:
        return True

    async def request(self, node: str, message: CatchUp, timeout: float = 10.0,
                      expect: type | None = None) -> Any:
        source = self.peers.get(node)
        if source is None:
            raise PeerUnavailable(f"{node}: no working link")
        links = source.links
        assert isinstance(links, FakeLinks)
        await source.serve_catch_up("me", over_the_wire(message))
        _node, _req, ok, body = links.replies.pop()
        assert ok, body
        frame = encode_frame(1, 1, [Ack(1, True, body)])
        if len(frame) > links.max_frame:
            raise trio.TooSlowError(f"answer of {len(frame)} bytes dropped at the frame limit")
        return decode_frame(frame).messages[0].body


class Replica:
    """A replica as ``DataPlane`` composes it: the replicator filters incoming ops through
    ``RetainedStore.accept_ops`` and mirrors what it wrote into the index."""

    def __init__(self, node_id: str, path: Path, stack: Any) -> None:
        self.store = stack.enter_context(LsmStore(path))
        self.links = FakeLinks()
        self.retained = RetainedStore(self.store, NUM_SHARDS)
        self.replicator = ShardReplicator(node_id, self.store, self.links,  # type: ignore[arg-type]
                                          lambda: EMPTY_VIEW, self._on_applied,
                                          _no_view_change,
                                          accept_ops=self.retained.accept_ops)

    def _on_applied(self, ops: list[Op]) -> None:
        self.retained.apply_ops(ops)


def key(topic: str = TOPIC) -> bytes:
    return RetainedStore(None, NUM_SHARDS)._key(topic)


def payloads(retained: RetainedStore, topic_filter: str = "#") -> dict[str, bytes]:
    return {m.topic: m.payload for m in retained.matching(topic_filter)}


async def reloaded(store: LsmStore) -> dict[str, bytes]:
    """What a restarted node would serve: a fresh index loaded from the store."""
    fresh = RetainedStore(store, NUM_SHARDS)
    await fresh.load()
    return payloads(fresh)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as s:
        yield s


# -- rows ---------------------------------------------------------------------------------


def test_rows_parse_current_legacy_and_tombstones():
    assert parse_row(["a/b", b"x", 1, 3, 99]) == ("a/b", b"x", 1, (3, 99))
    assert parse_row(["a/b", b"x", 2]) == ("a/b", b"x", 2, (0, 0))  # legacy: version (0, 0)
    assert parse_row(["a/b", None, 0, 3, 100]) == ("a/b", None, 0, (3, 100))
    assert make_row("a/b", b"", 1, (3, 100)) == ["a/b", None, 0, 3, 100]
    with pytest.raises(ValueError):
        parse_row(["a/b", b"x"])


# -- the owner ----------------------------------------------------------------------------


async def test_an_update_stamped_in_an_older_epoch_never_replaces_a_newer_row(tmp_path, stack):
    owner = Owner(tmp_path / "o", stack)
    owner.epoch = 5
    await owner.publish(b"630")
    # A write decided on a stale view (epoch 4), however late its clock says it is.
    await owner.retained.update(Message(TOPIC, b"180", 1, True), epoch=4)
    assert payloads(owner.retained) == {TOPIC: b"630"}
    assert owner.retained.stale_rejected == 1
    assert await reloaded(owner.store) == {TOPIC: b"630"}
    # The same owner in its current epoch moves on normally.
    await owner.publish(b"631")
    assert await reloaded(owner.store) == {TOPIC: b"631"}


async def test_stamps_grow_even_when_the_clock_goes_back(tmp_path, stack, monkeypatch):
    owner = Owner(tmp_path / "o", stack)
    clock = iter([5_000, 4_000, 3_000, 2_000])
    monkeypatch.setattr("mqttring.broker.retained.time.time_ns", lambda: next(clock))
    versions: list[Version | None] = []
    for payload in (b"1", b"2", b"3"):
        await owner.publish(payload)
        versions.append(owner.retained.version(TOPIC))
    assert versions == sorted(versions) and len(set(versions)) == 3
    # A restarted node (fresh in-memory stamp counter, clock still behind) still supersedes
    # what it stored before: the stamp passes the held version of the same epoch.
    again = RetainedStore(owner.store, NUM_SHARDS, owner.writer, epoch=lambda: 1)
    await again.load()
    await again.update(Message(TOPIC, b"4", 1, True))
    assert await reloaded(owner.store) == {TOPIC: b"4"}


async def test_single_node_clear_and_retain_behave_as_before(tmp_path, stack):
    store = stack.enter_context(LsmStore(tmp_path / "s"))
    retained = RetainedStore(store, NUM_SHARDS)
    await retained.update(Message("a/1", b"x", 0, True))
    await retained.update(Message("a/2", b"y", 1, True))
    await retained.update(Message("a/1", b"", 1, True))  # clear [MQTT-3.3.1-10]
    assert payloads(retained) == {"a/2": b"y"}
    assert len(retained) == retained.count_user_topics() == 1
    assert await reloaded(store) == {"a/2": b"y"}
    # What a restart reports: the messages held, not the rows read (a clear is a row).
    assert await RetainedStore(store, NUM_SHARDS).load() == 1
    # $SYS stays in memory only, unversioned.
    await retained.update(Message("$SYS/broker/uptime", b"3", 0, True), persist=False)
    assert payloads(retained, "$SYS/#") == {"$SYS/broker/uptime": b"3"}
    assert retained.version("$SYS/broker/uptime") is None


async def test_legacy_rows_load_and_are_superseded(tmp_path, stack):
    store = stack.enter_context(LsmStore(tmp_path / "s"))
    await store.write([Put("retained", key(), [TOPIC, b"old", 1])])
    retained = RetainedStore(store, NUM_SHARDS)
    assert await retained.load() == 1
    assert payloads(retained) == {TOPIC: b"old"}
    assert retained.version(TOPIC) == (0, 0)
    await retained.update(Message(TOPIC, b"new", 1, True))
    assert await reloaded(store) == {TOPIC: b"new"}
    # A legacy row arriving later (an old peer) cannot override a versioned one.
    assert retained.accept_ops([Put("retained", key(), [TOPIC, b"old", 1])]) == []


# -- replicas -----------------------------------------------------------------------------


def test_a_replicated_row_keeps_its_mqtt5_properties():
    """A replica (or a new owner taking a copied shard) installs a retained row's MQTT 5
    properties with it: its message expiry deadline, the forwarded properties and the
    origin.  Before 2026-11-25 ``accept_ops`` dropped them, so once a shard had moved, an
    expired retained message was served again, its properties gone (found by mosquitto's
    02-subpub-qos1-message-expiry-retain.py against a 3-node cluster)."""
    from mqttring.protocol.session5 import PublishProps

    props = PublishProps(b"\x03\x00\x0atext/plain", 1_700_000_000.0, "pub-1")
    replica = RetainedStore(None, NUM_SHARDS)
    row = make_row(TOPIC, b"v5", 1, (7, 1), props)
    assert replica.accept_ops([Put("retained", key(), row)]) != []
    [message] = replica.matching("#")
    assert message.props == props
    assert message.props.expired(1_700_000_001.0)



async def test_a_replayed_older_batch_never_replaces_a_newer_one_on_a_replica(tmp_path, stack):
    """The partition scenario: the stale node's write (epoch 4) reaches the replica after
    the new owner's acknowledged one (epoch 5)."""
    stale = Owner(tmp_path / "stale", stack)
    stale.epoch = 4
    new = Owner(tmp_path / "new", stack)
    new.epoch = 5
    replica = Replica("r", tmp_path / "r", stack)
    acked = await new.publish(b"630")
    await trio.sleep(0.001)
    replayed = await stale.publish(b"180")  # later wall clock, older epoch
    await replica.replicator.on_repl("new", acked)()
    await replica.replicator.on_repl("stale", replayed)()
    assert payloads(replica.retained) == {TOPIC: b"630"}
    assert await reloaded(replica.store) == {TOPIC: b"630"}
    assert [r[2] for r in replica.links.replies] == [True, True]  # both acknowledged
    # The same write replayed twice, and the older one again: still no change.
    await replica.replicator.on_repl("new", acked)()
    await replica.replicator.on_repl("stale", replayed)()
    assert await reloaded(replica.store) == {TOPIC: b"630"}


async def test_same_owner_batches_out_of_order(tmp_path, stack):
    owner = Owner(tmp_path / "o", stack)
    replica = Replica("r", tmp_path / "r", stack)
    first = await owner.publish(b"1")
    second = await owner.publish(b"2")
    await replica.replicator.on_repl("o", second)()
    await replica.replicator.on_repl("o", first)()
    assert payloads(replica.retained) == {TOPIC: b"2"}
    assert await reloaded(replica.store) == {TOPIC: b"2"}


async def test_a_tombstone_blocks_resurrection(tmp_path, stack):
    owner = Owner(tmp_path / "o", stack)
    replica = Replica("r", tmp_path / "r", stack)
    put = await owner.publish(b"hello")
    put_op = owner.writer.batches[-1][1][0]
    clear = await owner.publish(b"")
    assert payloads(owner.retained) == {}
    await replica.replicator.on_repl("o", clear)()
    await replica.replicator.on_repl("o", put)()  # the older Put arrives late
    assert payloads(replica.retained) == {}
    assert await reloaded(replica.store) == {}
    row = await replica.store.get("retained", key())
    assert row is not None and row[1] is None  # a versioned tombstone, not a missing row
    # The owner's store too, and the tombstone survives its restart.
    assert await reloaded(owner.store) == {}
    restarted = RetainedStore(owner.store, NUM_SHARDS)
    await restarted.load()
    assert restarted.accept_ops([put_op]) == []


async def test_non_retained_ops_pass_through_the_filter(tmp_path, stack):
    replica = Replica("r", tmp_path / "r", stack)
    ops: list[Op] = [Put("sessions", shard_key(1, b"\x00\x01c"), {"v": 1, "subs": []}),
                     Delete("queues", shard_key(1, b"q"))]
    assert replica.retained.accept_ops(ops) == ops


async def test_a_replica_applies_batches_in_the_order_they_arrive(tmp_path, stack):
    """Session rows carry no version: the replica's copy is right only if batches apply in
    arrival order (the owner's write order).  The first, big (encoded in a worker thread),
    holds a queued message's older state; the second, small, deletes it.  Their finishing
    halves run in one nursery, whose tasks trio runs in any order: the delete must win.
    (Applied from a task per batch, the store took them in the order the tasks ran.)"""
    replica = Replica("r", tmp_path / "r", stack)
    row = shard_key(1, b"\x00\x01c" + b"\x00" * 8)
    filler = [Put("queues", shard_key(2, b"f%03d" % i), ["t", b"x" * 200, 1]) for i in range(100)]
    for trial in range(10):
        older = repl_message([(1, [Put("queues", row, ["t", b"old", 1, trial])]),
                              (2, filler)], req=2 * trial)
        newer = repl_message([(1, [Delete("queues", row)])], req=2 * trial + 1)
        finishes = [replica.replicator.on_repl("o", older), replica.replicator.on_repl("o", newer)]
        async with trio.open_nursery() as nursery:
            for finish in reversed(finishes):
                nursery.start_soon(finish)
        assert await replica.store.get("queues", row) is None, trial
    assert len(replica.links.replies) == 20 and all(r[2] for r in replica.links.replies)


# -- catch-up copy ------------------------------------------------------------------------


async def test_catch_up_copy_never_replaces_newer_rows(tmp_path, stack):
    """The copy source holds an older row of one topic (and rows the target lacks); a live
    write already gave the target a newer row of that topic."""
    source_owner = Owner(tmp_path / "src", stack)
    source_owner.epoch = 4
    source = Replica("src", tmp_path / "src-repl", stack)
    target = Replica("me", tmp_path / "me", stack)
    target.links.peers["src"] = source.replicator
    shard = source_owner.retained.shard_for_topic(TOPIC)
    other = next(f"other/{i}" for i in range(100)
                 if source_owner.retained.shard_for_topic(f"other/{i}") == shard)
    for message in (await source_owner.publish(b"180"), await source_owner.publish(b"o", other)):
        await source.replicator.on_repl("src", message)()
    newer = Owner(tmp_path / "newer", stack)
    newer.epoch = 5
    await target.replicator.on_repl("newer", await newer.publish(b"630"))()
    # The target holds the newer row (a live write after the copy's own bookkeeping ended,
    # so the copy's touched-key skip does not hide the old one: the version check must).
    copied = await target.replicator.copy_shard(shard, "src")
    assert copied == 1  # only the other topic
    assert payloads(target.retained) == {TOPIC: b"630", other: b"o"}
    assert await reloaded(target.store) == {TOPIC: b"630", other: b"o"}


async def test_catch_up_copy_carries_tombstones_and_many_chunks(tmp_path, stack):
    owner = Owner(tmp_path / "o", stack)
    source = Replica("src", tmp_path / "src", stack)
    target = Replica("me", tmp_path / "me", stack)
    target.links.peers["src"] = source.replicator
    shard = 0
    topics = [t for t in (f"bulk/{i}" for i in range(6 * CATCH_UP_CHUNK))
              if owner.retained.shard_for_topic(t) == shard][: CATCH_UP_CHUNK + 10]
    assert len(topics) > CATCH_UP_CHUNK
    for topic in topics:
        await owner.retained.update(Message(topic, topic.encode(), 0, True))
    await owner.retained.update(Message(topics[0], b"", 0, True))
    await source.replicator.on_repl("o", repl_message(owner.writer.batches))()
    assert await target.replicator.copy_shard(shard, "src") == len(topics)
    want = {t: t.encode() for t in topics[1:]}
    assert payloads(target.retained) == want
    assert await reloaded(target.store) == want
    # A late replay of the cleared topic's Put is refused by the copy's tombstone.
    first_put = repl_message([owner.writer.batches[0]])
    await target.replicator.on_repl("o", first_put)()
    assert topics[0] not in payloads(target.retained)


async def test_catch_up_answers_stay_under_the_frame_limit(tmp_path, stack):
    """A shard holding more bytes than a link frame in fewer than ``CATCH_UP_CHUNK`` rows
    (large retained messages, a persistent session's backlog of large messages): each
    answer was one chunk of rows, dropped at the frame limit, and the copy failed on
    every try.  Here frames of 1 MiB and 40 rows of 100 KB, in two databases."""
    source = Replica("src", tmp_path / "src", stack)
    source.links.max_frame = 1 << 20
    target = Replica("me", tmp_path / "me", stack)
    target.links.peers["src"] = source.replicator
    shard = 3
    big = b"x" * 100_000
    cid = b"\x00\x07backlog"
    rows = [Put("queues", shard_key(shard, cid, i.to_bytes(8, "big")),
                [f"t/{i}", big, 1, False, None, 0, 0.0]) for i in range(40)]
    rows.append(Put("sessions", shard_key(shard, cid), {"v": 2}))
    await source.store.write(rows, Durability.DURABLE)
    assert await target.replicator.copy_shard(shard, "src") == len(rows)
    copied = await target.store.scan("queues", shard_key(shard))
    assert [(k, v[1]) for k, v in copied] == [(op.key, big) for op in rows[:40]]
    assert await target.store.get("sessions", shard_key(shard, cid)) == {"v": 2}


@given(sizes=st.lists(st.lists(st.integers(0, 5000), max_size=8), max_size=6),
       budget=st.integers(1000, 20000))
def test_replicated_writes_are_cut_into_messages_under_the_budget(sizes, budget):
    """``in_frame_runs``: every op once, in order, shard by shard; a message over the
    budget only when it holds a single op."""
    shard_ops = [(shard, [Put("queues", shard_key(shard, b"%d" % i), ["t", b"x" * n, 1])
                          for i, n in enumerate(ns)]) for shard, ns in enumerate(sizes)]
    runs = in_frame_runs(shard_ops, budget)
    flat = [(entry.shard, op.key) for run in runs for entry in run for op in entry.ops]
    assert flat == [(shard, op.key) for shard, ops in shard_ops for op in ops]
    for run in runs:
        ops = [op for entry in run for op in entry.ops]
        total = sum(64 + len(op.key) + len(op.value[1]) + 4 * len(op.value[0]) for op in ops)
        assert total <= budget or len(ops) == 1


# -- any order of delivery ----------------------------------------------------------------


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    writes=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([b"", b"a", b"b", b"c"])),
                    min_size=1, max_size=12),
    order=st.randoms(use_true_random=False),
    duplicate=st.booleans(),
)
def test_any_delivery_order_ends_at_the_newest_version(tmp_path_factory, writes, order,
                                                       duplicate):
    """Owners in epochs (non-decreasing over time, as views are) write a topic; the replica
    receives the batches shuffled (and maybe twice) and must end at the newest write."""
    path = tmp_path_factory.mktemp("prop")
    writes = sorted(writes, key=lambda w: w[0])

    async def main() -> None:
        with contextlib.ExitStack() as s:
            owner = Owner(path / "o", s)
            replica = Replica("r", path / "r", s)
            messages = []
            for epoch, payload in writes:
                owner.epoch = epoch
                messages.append(await owner.publish(payload))
            deliveries = messages + (messages if duplicate else [])
            order.shuffle(deliveries)
            for message in deliveries:
                await replica.replicator.on_repl("o", message)()
            last = writes[-1][1]
            want = {TOPIC: last} if last else {}
            assert payloads(replica.retained) == want
            assert await reloaded(replica.store) == want
            assert payloads(owner.retained) == want
            assert await reloaded(owner.store) == want

    trio.run(main)


# -- export -------------------------------------------------------------------------------


def test_export_skips_tombstones_and_reads_legacy_rows(tmp_path):
    with LsmStore(tmp_path / "store") as store:
        store.write_sync([
            Put("retained", shard_key(1, b"a"), ["a", b"live", 1, 3, 10]),
            Put("retained", shard_key(1, b"b"), ["b", None, 0, 3, 11]),  # cleared
            Put("retained", shard_key(1, b"c"), ["c", b"legacy", 2]),
            Put("retained", shard_key(2, b"d"), ["d", None, 0, 3, 12]),  # shard 2: only this
        ])
        store.snapshot_sync(tmp_path / "snap", node_id="n1")
    result = export_snapshot(tmp_path / "snap", tmp_path / "out", progress=False)
    rows = pq.read_table(tmp_path / "out" / "retained").to_pylist()
    assert sorted((r["topic"], r["payload"], r["qos"], r["shard"]) for r in rows) == [
        ("a", b"live", 1, 1), ("c", b"legacy", 2, 1)]
    assert result.rows["retained"] == 2
    files = result.manifest["tables"]["retained"]["files"]
    assert [f["shard"] for f in files] == [1]  # no file for a shard of tombstones only
    assert decode_row("retained", "n", shard_key(1, b"b"), ["b", None, 0, 3, 11]) is None
    assert decode_row("retained", "n", shard_key(1, b"a"), ["a", b"xy", 1, 3, 10]) == (
        "n", 1, "a", b"xy", 2, 1)


class ReorderingWriter(RecordingWriter):
    """Lets the second write reach the store before the first, as the cluster writer's
    separate local-write task may."""

    def __init__(self, store: LsmStore) -> None:
        super().__init__(store)
        self.calls = 0
        self.second_done = trio.Event()

    async def write(self, batches: Sequence[tuple[int, list[Op]]], durability: Durability) -> None:
        self.calls += 1
        if self.calls == 1:
            await self.second_done.wait()
            await super().write(batches, durability)
            return
        await super().write(batches, durability)
        self.second_done.set()


async def test_the_owner_store_ends_at_the_newest_row_when_its_writes_reorder(tmp_path, stack):
    owner = Owner(tmp_path / "o", stack)
    owner.writer = ReorderingWriter(owner.store)
    owner.retained = RetainedStore(owner.store, NUM_SHARDS, owner.writer, epoch=lambda: 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(owner.retained.update, Message(TOPIC, b"first", 1, True))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(owner.retained.update, Message(TOPIC, b"second", 1, True))
    assert payloads(owner.retained) == {TOPIC: b"second"}
    assert await reloaded(owner.store) == {TOPIC: b"second"}
    # ... and the rewrite replicated to a replica changes nothing there.
    replica = Replica("r", tmp_path / "r", stack)
    for batch in owner.writer.batches:
        await replica.replicator.on_repl("o", repl_message([batch]))()
    assert await reloaded(replica.store) == {TOPIC: b"second"}
