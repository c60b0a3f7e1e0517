"""Queued-message expiry is wall-clock time, through the broker's own code paths.

``expires_at`` is stored, exported as a UTC timestamp and read back on other nodes and after
restarts, so it must be a UNIX timestamp (``time.time()``), never a monotonic deadline.  These
tests go through the production callers (``LocalRouter``'s default clock, ``SessionStore`` on
a real LMDB store, the Parquet export) rather than stamping deadlines themselves, so a
monotonic clock anywhere on the way makes them fail.  Clocks are passed explicitly wherever
the code accepts one; the only reads of ``time.time()`` here bracket the code under test.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pyarrow.parquet as pq
import trio

from mqttring.analytics.export import export_snapshot
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.lsm import Durability, LsmStore, Put, shard_key
from mqttring.protocol.codec import PacketDecoder
from mqttring.protocol.message import Message
from mqttring.protocol.session import LEGACY_EXPIRY_CUTOFF, Outbound, Session, SessionLimits
from mqttring.ring.hashing import shard_of

TTL = 3600.0
#: A fixed wall-clock "now" (2023-11-14T22:13:20Z) for tests that pin the clock.
T0 = 1_700_000_000.0
NUM_SHARDS = 16


def _router(
    sessions: dict[str, Session], store: SessionStore, **kw: object
) -> LocalRouter:
    return LocalRouter(sessions, RetainedStore(None, NUM_SHARDS), store, BrokerMetrics(),
                       lambda _cid: None, **kw)  # type: ignore[arg-type]


def _offline_subscriber(limits: SessionLimits, client_id: str = "sub") -> Session:
    session = Session(client_id, False, limits)
    session.subscriptions["t/#"] = 1
    return session


def _payloads(buf: bytearray) -> list[bytes]:
    decoder = PacketDecoder()
    decoder.feed(bytes(buf))
    return [p.payload for p in decoder]


# --------------------------------------------------------------------------- stamping


def test_router_default_clock_stamps_a_wall_clock_deadline() -> None:
    """Without an injected clock the router stamps ``time.time() + ttl`` (was monotonic)."""
    session = _offline_subscriber(SessionLimits(message_ttl=TTL))
    router = _router({"sub": session}, SessionStore(None, NUM_SHARDS))
    router.add_subscription(session, "t/#", 1)
    before = time.time()
    router.deliver_local(Message("t/x", b"p", 1))
    after = time.time()
    (entry,) = session.queue
    assert before + TTL <= entry.expires_at <= after + TTL


def test_router_uses_the_injected_wall_clock() -> None:
    session = _offline_subscriber(SessionLimits(message_ttl=TTL))
    router = _router({"sub": session}, SessionStore(None, NUM_SHARDS), clock=lambda: T0)
    router.add_subscription(session, "t/#", 1)
    router.deliver_local(Message("t/x", b"p", 1))
    assert [e.expires_at for e in session.queue] == [T0 + TTL]


def test_no_ttl_means_no_deadline() -> None:
    session = _offline_subscriber(SessionLimits())
    router = _router({"sub": session}, SessionStore(None, NUM_SHARDS))
    router.add_subscription(session, "t/#", 1)
    router.deliver_local(Message("t/x", b"p", 1))
    assert [e.expires_at for e in session.queue] == [0.0]


# --------------------------------------------------------------------------- the store


async def _save(store: SessionStore, session: Session) -> None:
    await store.save_changes([session], Durability.DURABLE)


def test_saved_and_reloaded_session_keeps_its_wall_clock_deadline(tmp_path: Path) -> None:
    """A deadline survives a store close/reopen unchanged, and is judged against wall time."""
    limits = SessionLimits(message_ttl=TTL)
    path = tmp_path / "store"
    with LsmStore(path) as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        session = _offline_subscriber(limits)
        router = _router({"sub": session}, store, clock=lambda: T0)
        router.add_subscription(session, "t/#", 1)
        router.deliver_local(Message("t/x", b"old", 1))
        session.deliver(Message("t/x", b"new", 1), 1, now=T0 + 100)
        trio.run(store.save_subscriptions, session)
        trio.run(_save, store, session)
    with LsmStore(path) as lsm:
        (record,) = trio.run(SessionStore(lsm, NUM_SHARDS).load_all)
    assert [e.expires_at for e in record.outbound] == [T0 + TTL, T0 + 100 + TTL]
    # Loaded "a day later" on whatever host: not re-based, nothing marked changed.
    reloaded = record.to_session(limits, now=T0 + 50)
    assert [e.expires_at for e in reloaded.queue] == [T0 + TTL, T0 + 100 + TTL]
    assert not reloaded.has_changes()
    out = bytearray()
    reloaded.attach(out, now=T0 + TTL + 50)  # the first deadline passed, the second did not
    assert _payloads(out) == [b"new"]
    assert reloaded.dropped == 1


def _legacy_row(seq: int, expires_at: float) -> Put:
    """A queue row as the broker wrote it before expiry was wall-clock."""
    cid = b"sub"
    key = shard_key(shard_of("sub", NUM_SHARDS), len(cid).to_bytes(2, "big") + cid)
    return Put("queues", key + seq.to_bytes(8, "big"),
               ["t/x", b"legacy-%d" % seq, 1, False, None, 0, expires_at])


def test_legacy_monotonic_deadlines_are_rebased_once_on_load(tmp_path: Path) -> None:
    """Rows written with a monotonic deadline neither expire at once nor live forever: they
    get ``load time + ttl``, and that is written back so a second load keeps it."""
    limits = SessionLimits(message_ttl=TTL)
    path = tmp_path / "store"
    with LsmStore(path) as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        trio.run(store.save_subscriptions, _offline_subscriber(limits))
        lsm.write_sync([_legacy_row(1, 12345.6), _legacy_row(2, 0.0),
                        _legacy_row(3, T0 + 7.0)])
        (record,) = trio.run(store.load_all)
        session = record.to_session(limits, now=T0)
        assert [e.expires_at for e in session.queue] == [T0 + TTL, 0.0, T0 + 7.0]
        assert session.has_changes(), "the re-based deadline must be persisted"
        trio.run(_save, store, session)
    with LsmStore(path) as lsm:
        (record,) = trio.run(SessionStore(lsm, NUM_SHARDS).load_all)
    again = record.to_session(limits, now=T0 + 600)  # a later restart does not extend it
    assert [e.expires_at for e in again.queue] == [T0 + TTL, 0.0, T0 + 7.0]
    assert not again.has_changes()
    out = bytearray()
    again.attach(out, now=T0 + 600)  # only the row with a real, passed deadline expires
    assert _payloads(out) == [b"legacy-1", b"legacy-2"]


def test_legacy_deadline_without_a_ttl_becomes_never() -> None:
    session = Session("c", False, SessionLimits())
    session.restore([Outbound(1, Message("t", b"x", 1), 1, expires_at=99.5)], set(), T0)
    assert session.queue[0].expires_at == 0.0
    assert 99.5 < LEGACY_EXPIRY_CUTOFF < T0


# --------------------------------------------------------------------------- the export


def test_exported_queue_row_has_a_current_utc_expiry(tmp_path: Path) -> None:
    """The ``queued`` table's ``expires_at`` is this year's UTC time (it read 1970 before)."""
    limits = SessionLimits(message_ttl=TTL)
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        session = _offline_subscriber(limits)
        router = _router({"sub": session}, store)  # the production (default) clock
        router.add_subscription(session, "t/#", 1)
        trio.run(store.save_subscriptions, session)
        before = time.time()
        trio.run(router.publish, Message("t/x", b"p", 1))
        after = time.time()
        lsm.snapshot_sync(tmp_path / "snap", node_id="n1")
    export_snapshot(tmp_path / "snap", tmp_path / "out", progress=False)
    (row,) = pq.read_table(tmp_path / "out" / "queued").to_pylist()
    expires = row["expires_at"]
    assert expires.tzinfo is not None and expires.utcoffset() == dt.timedelta(0)
    assert expires.year >= dt.datetime.now(dt.UTC).year
    assert before + TTL - 1e-3 <= expires.timestamp() <= after + TTL + 1e-3
