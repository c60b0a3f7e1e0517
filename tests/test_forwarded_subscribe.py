"""A SUBSCRIBE/UNSUBSCRIBE forwarded to the node its persistent session lives on
(``broker/subscribing.py``, ``cluster/relay.py``): the connection's acceptor waits for that
node's answer, and one that never comes closes the client instead of leaving it waiting
for a SUBACK on an open connection.  Real processes: ``test_cluster_dataplane.py``
(``test_a_session_away_from_its_home_gets_its_answers_in_the_order_of_its_packets``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import trio

from mqttring.broker.sessions import SessionUnavailable
from mqttring.broker.subscribing import EarlySubscribe, Subscriptions
from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.relay import HomeAnswer
from mqttring.protocol.connection import SubscribeRequested, UnsubscribeRequested


class _Handler:
    def __init__(self) -> None:
        self.client_id = "c"
        self.session = object()
        self.early: dict[int, EarlySubscribe] | None = None
        self.kicked: list[tuple[str, int | None]] = []

    def kick(self, reason: str, code: int | None = None) -> None:
        self.kicked.append((reason, code))


def _subscriptions(forwarded: Any) -> Subscriptions:
    manager = SimpleNamespace(forward_subscribe=lambda *a: forwarded,
                              forward_unsubscribe=lambda *a: forwarded)
    return Subscriptions(None, manager, None, None, lambda: 10, lambda c: None,  # type: ignore[arg-type]
                         lambda *denied: None)


async def test_a_home_that_cannot_be_reached_closes_the_client_with_0x89() -> None:
    for event in (SubscribeRequested(1, (("a", 1),)), UnsubscribeRequested(2, ("a",))):
        handler = _Handler()
        answer = HomeAnswer("b", None, PeerUnavailable("b: no working link"))
        subscriptions = _subscriptions(answer)
        if isinstance(event, SubscribeRequested):
            await subscriptions.on_subscribe(handler, event)  # type: ignore[arg-type]
        else:
            await subscriptions.on_unsubscribe(handler, event)  # type: ignore[arg-type]
        assert len(handler.kicked) == 1 and handler.kicked[0][1] == 0x89
        assert "b" in handler.kicked[0][0]


async def test_the_acceptor_waits_for_the_homes_answer(autojump_clock: trio.abc.Clock) -> None:
    answered = trio.Event()

    async def answer() -> None:
        await answered.wait()

    handler = _Handler()
    subscriptions = _subscriptions(HomeAnswer("b", answer()))
    finished = trio.Event()

    async def subscribe() -> None:
        await subscriptions.on_subscribe(handler, SubscribeRequested(1, (("a", 1),)))  # type: ignore[arg-type]
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(subscribe)
        await trio.sleep(5)
        assert not finished.is_set()  # the client's next packets wait for the SUBACK
        answered.set()
        await finished.wait()
    assert handler.kicked == []


def test_an_answer_never_awaited_is_closed_with_its_subscribe() -> None:
    async def answer() -> None:
        raise AssertionError("never run")

    pending = answer()
    early = EarlySubscribe(None, [], [], HomeAnswer("b", pending))
    early.abandon()
    assert pending.cr_frame is None  # closed: no "never awaited" warning later
    assert early.forwarded is None


def test_a_failed_answer_is_a_session_unavailable() -> None:
    async def main() -> None:
        try:
            await HomeAnswer("b", None, PeerUnavailable("gone")).wait()
        except SessionUnavailable as exc:
            assert "b" in str(exc)
        else:
            raise AssertionError("no SessionUnavailable")

    trio.run(main)
