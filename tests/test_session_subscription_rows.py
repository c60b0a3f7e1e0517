"""A persistent session's subscriptions are stored one row per filter.

Found by measurement: the session record held every filter and was rewritten whole on each
SUBSCRIBE and UNSUBSCRIBE, so a client subscribing one filter at a time made the node write
a quadratic number of bytes (5,000 filters of 20 bytes: 5.6 s; 1,000 filters of 4 KB: about
2 GB written).  A SUBSCRIBE now writes the session header and the rows of the filters it
names, whatever the session already holds.

A real ``LsmStore`` behind a writer that records what each write carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from mqtt_client import PUBLISH, UNSUBACK, puback, publish, unsubscribe
from mqttring.analytics.schemas import SubscriptionRow, decode_row, fold_sessions
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter, Op
from mqttring.config import MAX_CLIENT_ID_BYTES
from mqttring.lsm import Durability, LsmStore, Put
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import V5Session

NUM_SHARDS = 8


class RecordingWriter:
    """The real local writer, keeping the operations of every write."""

    def __init__(self, store: LsmStore) -> None:
        self.inner = LocalShardWriter(store)
        self.writes: list[list[Op]] = []

    async def write(self, batches: Sequence[tuple[int, list[Op]]],
                    durability: Durability) -> None:
        self.writes.append([op for _, ops in batches for op in ops])
        await self.inner.write(batches, durability)


def subscriber(client_id: str = "sub", filters: int = 0) -> Session:
    session = Session(client_id, False)
    for i in range(filters):
        session.subscriptions[f"f/{i}"] = i % 3
    return session


def loaded(store: SessionStore, client_id: str) -> dict:
    (record,) = [s for s in trio.run(store.load_all) if s.client_id == client_id]
    return {"subs": record.subscriptions, "opts": record.options, "ends": record.ends_at}


def test_a_subscribe_writes_its_own_filters_however_many_the_session_holds(
        tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        writer = RecordingWriter(lsm)
        store = SessionStore(lsm, NUM_SHARDS, writer)
        session = subscriber(filters=2000)
        trio.run(store.save_subscriptions, session)
        assert len(writer.writes[-1]) == 1 + 2000  # header + every row: a new session

        session.subscriptions["g/new"] = 1
        trio.run(store.save_subscriptions, session, ["g/new"])
        assert len(writer.writes[-1]) == 2  # header + the one new row
        assert sum(len(repr(op)) for op in writer.writes[-1]) < 400

        del session.subscriptions["f/7"]
        trio.run(store.save_subscriptions, session, ["f/7", "never/subscribed"])
        assert [type(op).__name__ for op in writer.writes[-1]] == ["Put", "Delete", "Delete"]

        want = {f"f/{i}": i % 3 for i in range(2000) if i != 7} | {"g/new": 1}
        assert loaded(store, "sub") == {"subs": want, "opts": None, "ends": 0.0}


def test_options_and_expiry_read_back(tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        session = subscriber()
        session.v5 = V5Session("sub")
        session.subscriptions.update({"a/#": 1, "b/+": 2, "c": 0})
        session.v5.set_options("a/#", 0x04, 7)  # No Local, subscription identifier 7
        session.v5.set_options("b/+", 0x08, 0)  # Retain As Published
        session.ends_at = 1.8e9
        trio.run(store.save_subscriptions, session)
        assert loaded(store, "sub") == {
            "subs": {"a/#": 1, "b/+": 2, "c": 0},
            "opts": {"a/#": 0x04 | 7 << 8, "b/+": 0x08}, "ends": 1.8e9}

        session.ends_at = 0.0  # connected again: the header alone changes
        trio.run(store.save_subscriptions, session, ())
        assert loaded(store, "sub")["ends"] == 0.0
        assert loaded(store, "sub")["subs"] == {"a/#": 1, "b/+": 2, "c": 0}


def test_a_version_1_record_is_read_and_rewritten_whole_on_the_next_save(
        tmp_path: Path) -> None:
    """Stores written before one row per filter keep their subscriptions across the
    upgrade: the first save of such a session writes every row, not only the new one."""
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        old = {"v": 1, "subs": [["a/#", 1], ["b", 2]], "opts": {"a/#": 0x04}, "ends": 1.7e9}
        trio.run(lsm.write, [Put("sessions", store._prefix("sub"), old)])
        assert loaded(store, "sub") == {"subs": {"a/#": 1, "b": 2}, "opts": {"a/#": 0x04},
                                        "ends": 1.7e9}

        (record,) = trio.run(store.load_all)
        session = record.to_session(Session("x", False).limits)
        session.subscriptions["c"] = 0
        trio.run(store.save_subscriptions, session, ["c"])
        assert trio.run(lsm.get, "sessions", store._prefix("sub")) == {"v": 2, "ends": 1.7e9}
        assert loaded(store, "sub") == {"subs": {"a/#": 1, "b": 2, "c": 0},
                                        "opts": {"a/#": 0x04}, "ends": 1.7e9}


def test_a_new_session_clears_rows_an_earlier_life_left_and_delete_removes_them_all(
        tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        trio.run(store.save_subscriptions, subscriber(filters=5))
        trio.run(store.save_subscriptions, subscriber("other", filters=3))

        fresh = subscriber()  # e.g. a session created where stale rows were replicated
        fresh.subscriptions["only"] = 1
        trio.run(store.save_subscriptions, fresh)
        assert loaded(store, "sub")["subs"] == {"only": 1}

        trio.run(store.delete, "sub")
        assert [s.client_id for s in trio.run(store.load_all)] == ["other"]
        assert trio.run(lsm.scan, "sessions", store._subscriptions_prefix("sub")) == []
        assert len(loaded(store, "other")["subs"]) == 3


def test_the_longest_client_id_and_filter_fit_the_keys(tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        client_id = "c" * MAX_CLIENT_ID_BYTES
        session = subscriber(client_id)
        longest = "é" * 32767 + "x"  # 65,535 bytes of UTF-8
        session.subscriptions.update({longest: 1, "short": 0})
        trio.run(store.save_subscriptions, session)
        assert loaded(store, client_id)["subs"] == {longest: 1, "short": 0}


def test_the_export_folds_subscription_rows_into_their_session(tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, 1)
        session = subscriber(filters=3)
        session.subscriptions["z/last"] = 2
        trio.run(store.save_subscriptions, session)
        trio.run(store.save_subscriptions, subscriber("gone", filters=1))
        trio.run(lsm.write, [Put("sessions", store._prefix("v1"), {"v": 1, "subs": [["x", 1]]})])
        # Without its header, "gone"'s row belongs to no session (a torn copy): dropped.
        rows = [r for r in trio.run(lsm.scan, "sessions") if r[0] != store._prefix("gone")]
        decoded = [decode_row("sessions", "n", key, value) for key, value in rows]
        assert sum(isinstance(d, SubscriptionRow) for d in decoded) == 5
        folded = {row[2]: row for row in fold_sessions(decoded)}
        assert folded == {
            "sub": ("n", 0, "sub", [{"filter": "f/0", "qos": 0}, {"filter": "f/1", "qos": 1},
                                    {"filter": "f/2", "qos": 2}, {"filter": "z/last", "qos": 2}],
                    4),
            "v1": ("n", 0, "v1", [{"filter": "x", "qos": 1}], 1),
        }


@pytest.mark.timeout(120)
def test_subscriptions_made_one_at_a_time_survive_a_restart(node_factory, raw, uid) -> None:
    """A real node: 300 filters, one SUBSCRIBE each at QoS 0, 1 or 2, the 100 at QoS 2
    unsubscribed again, the node restarted: the session holds exactly the other 200, each
    at the QoS it was granted."""
    node = node_factory()
    handle = node.start()
    client_id, base = uid("rows"), uid("t")
    sub = raw(handle)
    assert sub.connect(client_id, clean_session=False).return_code == 0
    for i in range(300):
        assert sub.subscribe([(f"{base}/{i}", i % 3)], packet_id=i + 1) == [i % 3]
    for i in range(2, 300, 3):
        sub.send(unsubscribe(1000 + i, [f"{base}/{i}"]))
        assert sub.expect(UNSUBACK).packet_id == 1000 + i
    sub.close()

    assert node.terminate() == 0
    handle = node.start()
    back = raw(handle)
    assert back.connect(client_id, clean_session=False).session_present
    pub = raw(handle)
    assert pub.connect(uid("pub")).return_code == 0
    for i in range(300):
        pub.send(publish(f"{base}/{i}", b"%d" % i, qos=1, packet_id=i + 1))
    got: dict[str, int] = {}
    while len(got) < 200:
        pkt = back.expect(PUBLISH, 10)
        got[pkt.topic] = pkt.qos
        if pkt.qos:
            back.send(puback(pkt.packet_id))
    assert got == {f"{base}/{i}": i % 3 for i in range(300) if i % 3 != 2}
    assert back.no_packet_within(0.5) is None
