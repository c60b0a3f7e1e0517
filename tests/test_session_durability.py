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

from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter, Op
from mqttring.lsm import Durability, LsmStore
from mqttring.protocol.session import Message, Session

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


async def test_a_failed_durable_write_fails_every_caller_that_relied_on_it(
        tmp_path: Path) -> None:
    class Failing(GatedWriter):
        async def write(self, batches: Sequence[tuple[int, list[Op]]],
                        durability: Durability) -> None:
            self.writes.append(durability)
            await self.gate.wait()
            raise OSError("replica unreachable")

    with LsmStore(tmp_path / "store") as lsm:
        writer = Failing(lsm)
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


pytestmark = pytest.mark.timeout(30)
