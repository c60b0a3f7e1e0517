"""``messages_sent`` counts what was written (or queued) for local clients, not drops.

A probe's QoS 0 slow reader got 300 PUBLISHes of 100 kB: ``messages_sent_total`` said 311
and ``messages_dropped_total`` 229, while ``bytes_sent`` came to about 71 payloads: the
router counted a QoS 0 message dropped over the client's output limit as sent as well.
These drive ``LocalRouter`` directly, on every path that counts (one node's delivery, a
shared subscription, a cluster link's pre-encoded run), and check the two counters
against what the client's output buffer really holds.
"""

from __future__ import annotations

import trio

from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.broker.subscribing import Subscriptions
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session, SessionLimits

PAYLOAD = b"x" * 400
#: Room for three PUBLISHes: the limit is checked before each write.
LIMITS = SessionLimits(max_output=1000, hold_when_online=False, max_queued=4)


def setup(topic_filter: str, clean: bool = True, limits: SessionLimits = LIMITS,
          ) -> tuple[LocalRouter, Session, BrokerMetrics]:
    session = Session("slow", clean, limits)
    session.attach(bytearray())
    metrics = BrokerMetrics()
    router = LocalRouter({"slow": session}, RetainedStore(None, 16),
                         SessionStore(None, 16, None),  # type: ignore[arg-type]
                         metrics, lambda client_id: None)
    router.add_subscription(session, topic_filter, 2)
    return router, session, metrics


def publishes_in(session: Session, message: Message) -> int:
    assert session.output is not None
    size = len(message.encode_qos0(False))
    assert len(session.output) % size == 0
    return len(session.output) // size


def test_qos0_dropped_for_a_slow_reader_is_not_counted_as_sent() -> None:
    router, session, metrics = setup("t/#")
    message = Message("t/a", PAYLOAD, 0)
    for _ in range(10):
        router.deliver_local(message)
    written = publishes_in(session, message)
    assert written == 3
    assert (metrics.messages_sent, metrics.messages_dropped) == (written, 10 - written)


def test_qos0_to_a_slow_share_member_is_not_counted_as_sent() -> None:
    router, session, metrics = setup("$share/g/t/#")
    message = Message("t/a", PAYLOAD, 0)
    for _ in range(10):
        router.deliver_to_share(message, "$share/g/t/#")
    written = publishes_in(session, message)
    assert (metrics.messages_sent, metrics.messages_dropped) == (written, 10 - written)


def test_a_link_run_over_the_output_limit_is_not_counted_as_sent() -> None:
    router, session, metrics = setup("t/#")
    message = Message("t/a", PAYLOAD, 0)
    run = message.encode_qos0(False) * 2
    for _ in range(5):  # 2 runs fit under the limit (checked before each); 3 dropped
        router.deliver_frames("t/a", run, 2, lambda frames: [message, message])
    written = publishes_in(session, message)
    assert written == 4
    assert (metrics.messages_sent, metrics.messages_dropped) == (written, 10 - written)


def test_a_qos1_message_queued_in_place_of_an_older_one_still_counts_as_sent() -> None:
    """With a full queue (and no holding back) the oldest queued message makes room: that
    one is the drop, the new one is queued for the client, so it counts as sent."""
    limits = SessionLimits(hold_when_online=False, max_queued=4, max_inflight=0)  # all queue
    router, session, metrics = setup("t/#", clean=False, limits=limits)
    for i in range(limits.max_queued + 2):
        router.deliver_local(Message(f"t/{i}", b"", 1))
    assert [e.message.topic for e in session.queue] == ["t/2", "t/3", "t/4", "t/5"]
    assert (metrics.messages_sent, metrics.messages_dropped) == (limits.max_queued + 2, 2)


def test_retained_qos0_dropped_on_subscribe_is_not_counted_as_sent() -> None:
    """The retained messages that follow a SUBACK count as the router's deliveries do."""
    router, session, metrics = setup("t/#")
    retained = router._retained

    async def store_then_subscribe() -> None:
        for i in range(10):
            await retained.update(Message(f"r/{i}", PAYLOAD, 0, True), persist=False)
        await subscriptions.acknowledge(session, (("r/#", 0),), [0], None, lambda: True)

    subscriptions = Subscriptions(router, None, None, metrics,  # type: ignore[arg-type]
                                  lambda: 100, lambda client_id: None, lambda *denied: None)
    trio.run(store_then_subscribe)
    written = publishes_in(session, Message("r/0", PAYLOAD, 0, True))
    assert written == 3
    assert (metrics.messages_sent, metrics.messages_dropped) == (written, 10 - written)
