"""The telemetry archive: which messages, in what order, and retention by age and size."""

from __future__ import annotations

from functools import partial

import pytest

from mqttring.broker.archive import TelemetryArchive, key_time_ns
from mqttring.broker.shard_writes import LocalShardWriter
from mqttring.lsm import LsmStore
from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.message import Message
from mqttring.ring.hashing import shard_of

SHARDS = 8


@pytest.fixture
def store(tmp_path):
    s = LsmStore(tmp_path / "store")
    s.start()
    yield s
    s.close()


def make(store, clock, filters=("sensors/#",), max_age=0.0, max_bytes=0):
    return TelemetryArchive(filters, store, LocalShardWriter(store),
                            partial(shard_of, num_shards=SHARDS), max_age, max_bytes, clock)


async def test_only_matching_topics_are_archived_in_time_order_per_shard(store):
    now = [1_000]
    archive = make(store, lambda: now[0])
    for i in range(20):
        now[0] += 10
        archive.append(Message(f"sensors/{i % 3}", b"%d" % i, 1))
        archive.append(Message(f"other/{i}", b"no", 0))
    await archive.flush()
    rows = await store.scan("archive")
    assert len(rows) == 20
    assert {r[1][0] for r in rows} == {"sensors/0", "sensors/1", "sensors/2"}
    for shard in {shard_of(f"sensors/{i}", SHARDS) for i in range(3)}:
        times = [key_time_ns(k) for k, _ in rows if k[:2] == shard.to_bytes(2, "big")]
        assert times == sorted(times)


async def test_expiry_by_age_keeps_the_young(store):
    now = [0]
    archive = make(store, lambda: now[0], max_age=5.0)
    for i in range(10):
        now[0] = i * 1_000_000_000  # one message per second
        archive.append(Message("sensors/a", b"%d" % i, 0))
    await archive.flush()
    now[0] = 10 * 1_000_000_000
    removed = await archive.expire(list(range(SHARDS)))
    left = [v[1] for _, v in await store.scan("archive")]
    assert removed == 5  # ages 10..6 s; the one exactly 5 s old is not older than max_age
    assert left == [b"5", b"6", b"7", b"8", b"9"]


async def test_expiry_by_size_drops_the_oldest_first(store):
    now = [0]
    archive = make(store, lambda: now[0], filters=("#",), max_bytes=10 * 11)
    for i in range(30):
        now[0] += 1
        archive.append(Message(f"t/{i % 4}", b"x" * 8, 0))  # 3 + 8 = 11 bytes each
    await archive.flush()
    await archive.expire(list(range(SHARDS)))
    rows = await store.scan("archive")
    assert archive.bytes <= 110
    assert len(rows) == 10
    kept = sorted(v[4] for _, v in rows)
    assert kept == list(range(21, 31)), "the ten newest remain"


def test_bad_filter_is_refused_at_start(store):
    with pytest.raises(InvalidTopic):
        make(store, lambda: 0, filters=("a/#/b",))


async def test_a_writer_that_falls_behind_drops_and_counts_never_blocks(store):
    archive = make(store, lambda: 1, filters=("#",))
    archive.max_pending = 5
    for i in range(8):
        archive.append(Message("t", b"%d" % i, 0))
    assert archive.dropped == 3
    await archive.flush()
    assert [v[1] for _, v in await store.scan("archive")] == [b"%d" % i for i in range(5)]
