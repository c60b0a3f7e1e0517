"""A session change acknowledged on the promise of durability never rests on a lazy write.

Found by the fault suite (a 3-node partition lost one acknowledged message): a delivery
queued a message for a persistent session and went to write it durably before its PUBACK,
but a lazy write of the same session (after the client's acknowledgements) ran first and
took every change; the durable call then found nothing to write and returned at once, and
the message lived only in a lazily replicated write when the node was cut off.

A real ``LsmStore``; the writer in front of it holds each write at a gate, so the order of
the two writers is set by the test, not by timing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import trio

from mqttring.broker.refusals import PublishRefused, WriteCancelled
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter, Op
from mqttring.lsm import Durability, LsmStore
from mqttring.protocol.codec import PacketDecoder
from mqttring.protocol.message import Message
from mqttring.protocol.outbound import Completed
from mqttring.protocol.packets import Publish, PubRel
from mqttring.protocol.session import OutState, Session, SessionLimits

NUM_SHARDS = 8


class GatedWriter:
    """A real local writer whose writes wait until the test opens their gate."""

    def __init__(self, store: LsmStore) -> None:
        self.inner = LocalShardWriter(store)
        self.writes: list[Durability] = []
        self.gate = trio.Event()

    async def write(self, batches: Sequence[tuple[int, list[Op]]],
                    durability: Durability) -> None:
        self.writes.append(durability)
        await self.gate.wait()
        await self.inner.write(batches, durability)


def offline_subscriber() -> Session:
    session = Session("sub", False)
    session.subscriptions["t/#"] = 1
    return session


async def test_a_lazy_writer_that_takes_a_due_change_writes_it_durably_and_the_durable_caller_waits(
        tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        writer = GatedWriter(lsm)
        store = SessionStore(lsm, NUM_SHARDS, writer)
        session = offline_subscriber()
        session.deliver(Message("t/x", b"acked", 1), 1)  # due to be durable before a PUBACK
        order: list[str] = []

        async def lazy() -> None:  # e.g. after the client's PUBACKs
            await store.save_changes([session], Durability.LAZY)
            order.append("lazy")

        async def durable() -> None:  # the delivery, before it answers
            await store.save_changes([session], Durability.DURABLE)
            order.append("durable")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lazy)
            await trio.testing.wait_all_tasks_blocked()
            assert writer.writes == [Durability.DURABLE], "the lazy writer took a due change"
            nursery.start_soon(durable)
            await trio.testing.wait_all_tasks_blocked()
            assert order == [], "the durable caller returned before the write it relies on"
            writer.gate.set()
        assert sorted(order) == ["durable", "lazy"]
        assert len(await lsm.scan("queues", b"")) == 1  # the message's row is stored


class FailingWriter(GatedWriter):
    """Each write fails once its gate opens, as one to an unreachable replica does."""

    async def write(self, batches: Sequence[tuple[int, list[Op]]],
                    durability: Durability) -> None:
        self.writes.append(durability)
        await self.gate.wait()
        raise OSError("replica unreachable")


async def test_a_failed_durable_write_fails_every_caller_that_relied_on_it(
        tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        writer = FailingWriter(lsm)
        store = SessionStore(lsm, NUM_SHARDS, writer)
        session = offline_subscriber()
        session.deliver(Message("t/x", b"m", 1), 1)
        failures: list[str] = []

        async def save(durability: Durability) -> None:
            try:
                await store.save_changes([session], durability)
            except OSError as exc:
                failures.append(f"{durability.name}: {exc}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(save, Durability.LAZY)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(save, Durability.DURABLE)
            await trio.testing.wait_all_tasks_blocked()
            writer.gate.set()
        assert sorted(failures) == ["DURABLE: replica unreachable", "LAZY: replica unreachable"]


async def test_a_cancelled_durable_write_is_a_refusal_for_every_caller_that_relied_on_it(
        tmp_path: Path) -> None:
    """The task carrying a durable write can be cancelled (its connection closed as its
    session moved: the 5-node power-loss run); another caller waiting on that write must
    not take its changes as stored, and gets a typed refusal (answered as one: no
    acknowledgement), not the RuntimeError that ended its task with a traceback."""
    with LsmStore(tmp_path / "store") as lsm:
        writer = GatedWriter(lsm)
        store = SessionStore(lsm, NUM_SHARDS, writer)
        session = offline_subscriber()
        session.deliver(Message("t/x", b"m", 1), 1)
        refused: list[type] = []
        carrier = trio.CancelScope()

        async def carry() -> None:
            with carrier:
                await store.save_changes([session], Durability.DURABLE)

        async def rely() -> None:
            try:
                await store.save_changes([session], Durability.DURABLE)
            except PublishRefused as exc:
                refused.append(type(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(carry)
            await trio.testing.wait_all_tasks_blocked()
            assert writer.writes == [Durability.DURABLE]  # the carrier took the change
            nursery.start_soon(rely)
            await trio.testing.wait_all_tasks_blocked()
            carrier.cancel()
        assert refused == [WriteCancelled]


def test_acknowledgement_progress_alone_stays_lazy() -> None:
    """Only changes promised durable upgrade a write: PUBACK progress is lazy."""
    session = offline_subscriber()
    session.deliver(Message("t/x", b"m", 1), 1)
    session.take_changes()
    out = bytearray()
    session.attach(out)  # sends it: the packet id is progress, not a promise
    assert session.has_changes() and not session.durable_due
    assert session.on_puback(1)
    assert not session.durable_due


# -- QoS 2: a PUBREL waits for its PUBREC's record ----------------------------------------


def decoded(out: bytearray) -> list[object]:
    decoder = PacketDecoder()
    decoder.feed(bytes(out))
    out.clear()
    return list(decoder)


def online_qos2_subscriber(out: bytearray) -> Session:
    session = offline_subscriber()
    session.attach(out)
    session.deliver(Message("t/1", b"one", 2), 2)
    session.deliver(Message("t/2", b"two", 2), 2)
    session.take_changes()  # the messages' rows: written before their publishers' PUBRECs
    out.clear()
    return session


async def test_pubrels_leave_in_order_only_after_their_pubrecs_are_stored_durably(
        tmp_path: Path) -> None:
    """Sent before its record, a PUBREL lets the client release the message to its
    application while a crash can still make the next owner send the PUBLISH again."""
    with LsmStore(tmp_path / "store") as lsm:
        writer = GatedWriter(lsm)
        store = SessionStore(lsm, NUM_SHARDS, writer)
        out = bytearray()
        session = online_qos2_subscriber(out)
        woken: list[str] = []
        session.on_pubrec(1)
        assert out == b"" and session.held_releases == [1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.release_when_stored, session, woken.append)
            await trio.testing.wait_all_tasks_blocked()
            assert writer.writes == [Durability.DURABLE] and store.releasing(session)
            session.on_pubrec(2)  # while the first write is on its way: needs one of its own
            await store.release_when_stored(session, woken.append)  # runs already: returns
            assert out == b"" and woken == []
            writer.gate.set()
        assert decoded(out) == [PubRel(1), PubRel(2)]  # in PUBREC order
        assert woken == ["sub", "sub"] and writer.writes == [Durability.DURABLE] * 2
        assert session.held_releases is None and not store.releasing(session)
        rows = [value for _, value in await lsm.scan("queues", b"")]
        assert [(row[4], row[5]) for row in rows] == [
            (1, OutState.AWAIT_PUBCOMP), (2, OutState.AWAIT_PUBCOMP)]


async def test_a_failed_write_keeps_the_pubrel_held_and_a_reconnection_does_not_send_it(
        tmp_path: Path) -> None:
    with LsmStore(tmp_path / "store") as lsm:
        writer = FailingWriter(lsm)
        writer.gate.set()
        store = SessionStore(lsm, NUM_SHARDS, writer)
        out = bytearray()
        session = online_qos2_subscriber(out)
        session.on_pubrec(1)
        await store.release_when_stored(session, lambda _: None)  # logged, not raised
        assert out == b"" and session.held_releases == [1]
        session.detach()
        again = bytearray()
        session.attach(again)
        assert decoded(again) == [Publish("t/2", b"two", 2, dup=True, packet_id=2)], (
            "the PUBLISH without an answer goes again; the held PUBREL does not")


def test_a_clean_session_answers_pubrec_at_once_and_a_stored_one_is_repeated_at_once() -> None:
    clean = Session("c", True)
    out = bytearray()
    clean.attach(out)
    clean.deliver(Message("t", b"x", 2), 2)
    out.clear()
    assert clean.on_pubrec(1) and decoded(out) == [PubRel(1)]
    assert clean.held_releases is None
    persistent = online_qos2_subscriber(out)
    persistent.on_pubrec(1)
    persistent.on_pubrec(1)  # repeated while held: still one PUBREL to come
    assert persistent.held_releases == [1] and decoded(out) == []
    persistent.release(persistent.take_held_releases())
    assert decoded(out) == [PubRel(1)]
    persistent.on_pubrec(1)  # repeated once stored: answered at once
    assert decoded(out) == [PubRel(1)] and persistent.held_releases is None



async def test_the_next_owner_of_a_session_knows_the_qos2_messages_it_holds(
        tmp_path: Path) -> None:
    """A QoS 2 message's cluster identity is stored with it: the node that loads the
    session (a takeover, a restart) drops a retry's copy of a message the session still
    holds, rather than queue a second one."""
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        session = offline_subscriber()
        session.subscriptions["t/#"] = 2
        session.deliver(Message("t/x", b"once", 2, mid=77), 2)
        session.deliver(Message("t/y", b"v5", 2, mid=78), 2)  # and one with no properties
        await store.save_subscriptions(session)
        await store.save_changes([session], Durability.DURABLE)
        (stored,) = await store.load_all()
        loaded = stored.to_session(session.limits)
        assert [e.message.mid for e in loaded.queue] == [77, 78]
        loaded.deliver(Message("t/x", b"once", 2, mid=77), 2)  # the retry's copy
        loaded.deliver(Message("t/z", b"new", 2, mid=79), 2)
        assert [e.message.payload for e in loaded.queue] == [b"once", b"v5", b"new"]



async def test_the_next_owner_of_a_session_knows_the_qos2_messages_its_client_completed(
        tmp_path: Path) -> None:
    """A QoS 2 message the client completed leaves its identity in the session's record
    (``Completed``) for ``qos2_dedup_seconds``: the node that loads the session next drops
    a retry's copy of it, as the node that delivered it does.  Before, the row was deleted
    and the next owner delivered the copy again, as a new message (the 5-node partition
    of the fault suite: its session handed back after the heal)."""
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        out = bytearray()
        session = Session("sub", False)
        session.subscriptions["t/#"] = 2
        session.attach(out)
        session.deliver(Message("t/x", b"done", 2, mid=77), 2, now=1000.0)
        session.deliver(Message("t/x", b"old", 2, mid=76), 2, now=1000.0)
        session.deliver(Message("t/x", b"open", 2, mid=78), 2, now=1000.0)
        for pid in (1, 2):
            session.on_pubrec(pid)
        session.release(session.take_held_releases())
        assert session.on_pubcomp(1, now=1001.0)
        assert session.on_pubcomp(2, now=960.0)  # (a clock that went back: past its time)
        await store.save_subscriptions(session)
        await store.save_changes([session], Durability.DURABLE)
        (stored,) = await store.load_all()
        assert [e.message.mid for e in stored.outbound] == [78]  # markers hold no message
        assert {m.mid for _, m in stored.completed} == {76, 77}
        loaded = stored.to_session(session.limits, now=1010.0)
        assert loaded.next_seq > max(seq for seq, _ in stored.completed)
        loaded.deliver(Message("t/x", b"done", 2, mid=77), 2, now=1010.0)  # the retry's copy
        loaded.deliver(Message("t/x", b"old", 2, mid=76), 2, now=1010.0)  # too late for it
        loaded.deliver(Message("t/x", b"new", 2, mid=79), 2, now=1010.0)
        assert [e.message.payload for e in [*loaded.inflight.values(), *loaded.queue]] == [
            b"open", b"old", b"new"]
        # The marker past its time is deleted with the loaded session's next write.
        await store.save_changes([loaded], Durability.LAZY)
        (again,) = await store.load_all()
        assert [m.mid for _, m in again.completed] == [77]


def test_completed_markers_are_deleted_after_their_time_and_beyond_the_window() -> None:
    """The record stays bounded: a marker is deleted once a retry can no longer come
    (``qos2_dedup_seconds``) or when more than ``qos2_dedup_window`` are listed; a clean
    session, a message without an identity and a window of 0 leave no marker."""
    limits = SessionLimits(qos2_dedup_window=2, qos2_dedup_seconds=30.0)
    session = Session("sub", False, limits)
    session.attach(bytearray())
    for mid in (11, 12, 13):
        session.deliver(Message("t", b"m", 2, mid=mid), 2, now=1000.0)
    session.deliver(Message("t", b"m", 2), 2, now=1000.0)  # no identity (one node's)
    session.take_changes()
    for pid in (1, 2, 3, 4):
        session.on_pubrec(pid)
    session.release(session.take_held_releases())
    session.take_changes()
    for pid, now in ((1, 1000.0), (2, 1001.0), (3, 1002.0), (4, 1003.0)):
        session.on_pubcomp(pid, now=now)
    dirty, _ = session.take_changes()
    assert dirty == {1: None, 2: Completed(12, 1001.0), 3: Completed(13, 1002.0), 4: None}
    session.deliver(Message("t", b"m", 2, mid=14), 2, now=1040.0)
    session.on_pubrec(5)
    session.release(session.take_held_releases())
    session.take_changes()
    session.on_pubcomp(5, now=1040.0)
    dirty, _ = session.take_changes()
    assert dirty == {2: None, 3: None, 5: Completed(14, 1040.0)}  # 30 s later
    assert list(session.completed or ()) == [(5, 1040.0)]
    for quiet in (Session("c", True), Session("p", False, SessionLimits(qos2_dedup_window=0))):
        quiet.attach(bytearray())
        quiet.deliver(Message("t", b"m", 2, mid=21), 2, now=1000.0)
        quiet.on_pubrec(1)
        quiet.release(quiet.take_held_releases())
        quiet.take_changes()
        quiet.on_pubcomp(1, now=1000.0)
        assert quiet.take_changes()[0] == ({} if quiet.clean_session else {1: None})
        assert quiet.completed is None


async def test_an_inbound_qos2_id_is_stored_with_its_identity_until_acknowledged(
        tmp_path: Path) -> None:
    """The id of a QoS 2 PUBLISH is written with the message's identity before it is
    routed, and read back with it: a resend at the session's next owner is routed as the
    same message.  Once its PUBREC went out the row says so (``1``, which is also what
    rows written before identities were stored hold), and a resend is only answered."""
    with LsmStore(tmp_path / "store") as lsm:
        store = SessionStore(lsm, NUM_SHARDS)
        session = Session("pub", False)
        mid = session.begin_inbound_qos2(5)
        acked = session.begin_inbound_qos2(6)
        await store.save_subscriptions(session)
        await store.save_changes([session], Durability.DURABLE)
        (stored,) = await store.load_all()
        assert stored.inbound_qos2 == {5: mid, 6: acked}
        session.inbound_qos2_acknowledged(6)
        await store.save_changes([session], Durability.LAZY)
        (stored,) = await store.load_all()
        loaded = stored.to_session(session.limits)
        assert loaded.begin_inbound_qos2(5) == mid  # routed again, as the same message
        assert loaded.begin_inbound_qos2(6) == 0  # acknowledged: answered, not routed
        session.release_inbound_qos2(5)
        await store.save_changes([session], Durability.LAZY)
        (stored,) = await store.load_all()
        assert stored.inbound_qos2 == {6: 0}


pytestmark = pytest.mark.timeout(30)



async def test_a_will_whose_durable_write_is_cancelled_under_it_ends_nothing_else(
        caplog: pytest.LogCaptureFixture) -> None:
    """A will is published as its connection closes; its delivery to a persistent session
    may wait on a durable write that another task carries, and that task may be cancelled
    (a takeover closing a connection mid-write): the router refuses it (``WriteCancelled``,
    as the test above shows).  A client's publish is then not acknowledged and is resent; a
    will has no sender.  A probe found the refusal raised out of the close: the new
    connection of a takeover failed with an internal error, or the node itself stopped
    ("node failed: the durable write carrying these changes was cancelled")."""
    from types import SimpleNamespace

    from mqttring.broker.core import BrokerCore
    from mqttring.broker.metrics import BrokerMetrics
    from mqttring.broker.retained import RetainedStore
    from mqttring.broker.router import LocalRouter
    from mqttring.config import BrokerConfig
    from mqttring.protocol.packets import Will

    store = SessionStore(None, NUM_SHARDS, None)  # type: ignore[arg-type]
    core = BrokerCore(BrokerConfig(), store, BrokerMetrics(),
                      lambda core: LocalRouter(core.sessions, RetainedStore(None, NUM_SHARDS),
                                               store, core.metrics, lambda cid: None))
    tried: list[str] = []

    async def refused(message: Message) -> None:
        tried.append(message.topic)
        raise WriteCancelled("the durable write carrying these changes was cancelled")

    core.router.publish = refused  # type: ignore[method-assign]
    closed = SimpleNamespace(will=Will("wills/dev", b"gone", 1, False),
                             clean_disconnect=False, will_forfeited=False, client_id="dev",
                             close_reason="taken over by a new connection", session=None,
                             conn=SimpleNamespace(v5=None))
    await core.manager.publish_will(closed)  # type: ignore[arg-type]
    assert tried == ["wills/dev"]
    assert "not confirmed stored" in caplog.text
