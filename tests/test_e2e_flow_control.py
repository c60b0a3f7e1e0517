"""Flow control (``mqttring.broker.flow``): a connected subscriber that falls behind slows the
publishers feeding it instead of losing what they were told was accepted, and a connection
keeps reading acknowledgements while its own publishes wait.

Raw clients, so that who reads and who acknowledges what is exact.  Each test's limits are
small (``max_inflight`` 2, ``max_queued`` 5): the subscriber is congested after 7 messages.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from mqtt_client import (
    DISCONNECT_BYTES,
    PINGREQ_BYTES,
    PINGRESP,
    PUBACK,
    PUBLISH,
    RawClient,
    puback,
    publish,
)

pytestmark = pytest.mark.timeout(60)

LIMITS = {"max_inflight": 2, "max_queued": 5}


def read_packets(client: RawClient, want: dict[int, int], ack: bool,
                 timeout: float = 10.0) -> dict[int, list]:
    """Packets until ``want`` (type -> count) is met; PUBLISHes are acknowledged if ``ack``."""
    got: dict[int, list] = {ptype: [] for ptype in want}
    deadline = time.monotonic() + timeout
    while any(len(got[t]) < n for t, n in want.items()):
        packet = client.recv_packet(max(deadline - time.monotonic(), 0.01))
        got.setdefault(packet.type, []).append(packet)
        if packet.type == PUBLISH and ack and packet.qos == 1:
            client.send(puback(packet.packet_id))
    return got


def subscriber_and_publisher(b, raw, uid, topic: str, qos: int
                             ) -> tuple[RawClient, RawClient]:
    """A client subscribed to ``topic`` at ``qos`` and a connected publisher."""
    sub = raw(b)
    assert sub.connect(uid("sub")).return_code == 0
    assert sub.subscribe([(topic, qos)]) == [qos]
    pub = raw(b)
    assert pub.connect(uid("pub")).return_code == 0
    return sub, pub


def subscriber_and_flood(b, raw, uid, payload: str = "m") -> tuple[RawClient, RawClient]:
    """A subscriber that reads nothing yet, and a publisher that sent it 20 QoS 1
    messages in one write (``<payload>1`` .. ``<payload>20``)."""
    topic = uid("flow")
    sub, pub = subscriber_and_publisher(b, raw, uid, topic, 1)
    pub.send(b"".join(publish(topic, f"{payload}{i}".encode(), qos=1, packet_id=i)
                      for i in range(1, 21)))
    return sub, pub


def test_a_congested_subscriber_holds_its_publisher_back_and_loses_nothing(
        broker_factory, raw, uid) -> None:
    """Without flow control the subscriber would keep 2 + 5 of 20 messages; with it, the
    publisher waits and the subscriber gets all 20, in order [MQTT-4.6.0-6], and the
    publisher's PUBACKs come in the order of its PUBLISHes [MQTT-4.6.0-2].

    The first 7 fit (2 in flight, 5 queued); the 7th congests the subscriber.  The publishes
    that came in one read are accepted together, so the acknowledgement of at most the
    first 6 may leave before the subscriber makes room, and none after them."""
    b = broker_factory(slow_subscriber_hold=8.0, **LIMITS)
    sub, pub = subscriber_and_flood(b, raw, uid)
    early: list[int] = []
    with pytest.raises(TimeoutError):  # held: the 20 PUBACKs do not come
        while len(early) < 20:
            packet = pub.recv_packet(1.5)
            assert packet.type == PUBACK
            early.append(packet.packet_id)
    assert early == list(range(1, len(early) + 1)) and len(early) <= 6
    # Meanwhile the node serves everyone else as usual.
    other = raw(b)
    assert other.connect(uid("other")).return_code == 0
    elsewhere = uid("elsewhere")
    assert other.subscribe([(elsewhere, 1)]) == [1]
    other.send(publish(elsewhere, b"still served", qos=1, packet_id=1))
    answered = read_packets(other, {PUBACK: 1, PUBLISH: 1}, ack=True, timeout=5.0)
    assert [p.payload for p in answered[PUBLISH]] == [b"still served"]
    got = read_packets(sub, {PUBLISH: 20}, ack=True)  # reading makes room
    assert [p.payload for p in got[PUBLISH]] == [f"m{i}".encode() for i in range(1, 21)]
    rest = read_packets(pub, {PUBACK: 20 - len(early)}, ack=False)
    assert [p.packet_id for p in rest[PUBACK]] == list(range(len(early) + 1, 21))


@pytest.mark.parametrize("window_bytes", [10_000, None])
def test_a_held_publisher_of_large_messages_stops_being_read_at_the_byte_window(
        broker_factory, raw, uid, window_bytes: int | None) -> None:
    """``publish_window_bytes`` bounds what a held publisher's connection has read: with
    4 KB messages and a 10 KB window the node stops reading it once the congested batch
    is in flight, so the PINGREQ behind its 20 PUBLISHes is answered only after the
    subscriber made room.  With the default window (1 MiB) all 20 and the PINGREQ are read
    at once, and the PINGRESP comes while the publishes are still held (``pingresp_wait``:
    it waits behind their PUBACKs for a second at most, so the held client's keep alive
    does not close it)."""
    extra = {} if window_bytes is None else {"publish_window_bytes": window_bytes}
    b = broker_factory(slow_subscriber_hold=8.0, **LIMITS, **extra)
    sub, pub = subscriber_and_flood(b, raw, uid, payload="x" * 4000)
    pub.send(PINGREQ_BYTES)
    early = []
    with pytest.raises(TimeoutError):
        while True:
            early.append(pub.recv_packet(1.5).type)
    if window_bytes is None:
        assert PINGRESP in early, "the whole flood was not read at once"
    else:
        assert PINGRESP not in early, "the held publisher was read past its byte window"
    assert early.count(PUBACK) <= 6
    got = read_packets(sub, {PUBLISH: 20}, ack=True)  # reading makes room
    assert len(got[PUBLISH]) == 20
    want = {PUBACK: 20 - early.count(PUBACK), PINGRESP: 0 if PINGRESP in early else 1}
    rest = read_packets(pub, want, ack=False)
    assert len(rest[PINGRESP]) == want[PINGRESP]  # one PINGRESP in all


def test_a_publisher_that_is_its_own_slow_subscriber_is_not_deadlocked(
        broker_factory, raw, uid) -> None:
    """The connection reads acknowledgements while its publishes wait: a client subscribed
    to what it publishes, which sent 30 PUBLISHes before reading anything, makes room by
    acknowledging its deliveries and gets every PUBACK, without being disconnected."""
    b = broker_factory(slow_subscriber_hold=8.0, **LIMITS)
    topic = uid("echo")
    client = raw(b)
    assert client.connect(uid("echo")).return_code == 0
    assert client.subscribe([(topic, 1)]) == [1]
    client.send(b"".join(publish(topic, f"e{i}".encode(), qos=1, packet_id=i)
                         for i in range(1, 31)))
    got = read_packets(client, {PUBLISH: 30, PUBACK: 30}, ack=True, timeout=6.0)
    assert [p.payload for p in got[PUBLISH]] == [f"e{i}".encode() for i in range(1, 31)]
    assert [p.packet_id for p in got[PUBACK]] == list(range(1, 31))


def test_a_subscriber_that_makes_no_room_is_disconnected_after_the_hold(
        broker_factory, raw, uid) -> None:
    b = broker_factory(slow_subscriber_hold=1.0, **LIMITS)
    sub, pub = subscriber_and_flood(b, raw, uid)
    started = time.monotonic()
    acks = read_packets(pub, {PUBACK: 20}, ack=False)
    assert [p.packet_id for p in acks[PUBACK]] == list(range(1, 21))
    assert time.monotonic() - started >= 0.9, "the publisher was not held back"
    assert sub.wait_closed(5), "the slow subscriber was not disconnected"


def test_an_mqtt5_subscriber_that_makes_no_room_is_told_quota_exceeded(
        broker_factory, raw, uid) -> None:
    """The same for an MQTT 5 subscriber: its last packet is DISCONNECT 0x97."""
    from mqtt5_support import Raw5
    from mqttring.protocol.codec5 import encode5
    from mqttring.protocol.packets5 import Disconnect5, SubAck5, SubOptions, Subscribe5
    from mqttring.protocol.properties import Properties, PropertyId

    b = broker_factory(slow_subscriber_hold=1.0, **LIMITS)
    topic = uid("flow5")
    sub = Raw5(b.host, b.port)
    try:
        assert sub.connect(uid("sub5")).reason_code == 0
        sub.send(encode5(Subscribe5(1, ((topic, SubOptions(1)),))))
        assert sub.recv() == SubAck5(1, (1,))
        pub = raw(b)
        assert pub.connect(uid("pub")).return_code == 0
        pub.send(b"".join(publish(topic, f"m{i}".encode(), qos=1, packet_id=i)
                          for i in range(1, 21)))
        read_packets(pub, {PUBACK: 20}, ack=False)
        received = []
        with contextlib.suppress(ConnectionError):
            while True:
                received.append(sub.recv())
        assert received and received[-1] == Disconnect5(0x97, Properties(
            [(PropertyId.REASON_STRING, "quota exceeded")])), received[-3:]
    finally:
        sub.close()


def test_hold_zero_drops_the_oldest_as_for_an_offline_client(broker_factory, raw, uid) -> None:
    """``slow_subscriber_hold = 0`` turns flow control off (the documented escape hatch)."""
    b = broker_factory(slow_subscriber_hold=0.0, **LIMITS)
    sub, pub = subscriber_and_flood(b, raw, uid)
    read_packets(pub, {PUBACK: 20}, ack=False)  # nobody waits
    got = read_packets(sub, {PUBLISH: 7}, ack=True)
    # 2 were in flight; of the queue only the newest 5 are left.
    assert [p.payload for p in got[PUBLISH]] == [
        b"m1", b"m2", b"m16", b"m17", b"m18", b"m19", b"m20"]


def test_publishes_before_a_disconnect_in_one_write_are_all_routed(
        broker_factory, raw, uid) -> None:
    """Packets that arrive together are all handled: the DISCONNECT behind two QoS 0
    PUBLISHes ends the connection only after both [MQTT-3.14.4-1 is about what follows it]."""
    b = broker_factory()
    topic = uid("last-words")
    sub, pub = subscriber_and_publisher(b, raw, uid, topic, 0)
    pub.send(publish(topic, b"one") + publish(topic, b"two") + DISCONNECT_BYTES)
    got = read_packets(sub, {PUBLISH: 2}, ack=False)
    assert [p.payload for p in got[PUBLISH]] == [b"one", b"two"]


def _in_process(tmp_path, hold: float, max_queued: int):
    from mqttring import BrokerConfig, Limits, MqttRingBroker

    broker = MqttRingBroker(BrokerConfig(
        mqtt="127.0.0.1:0", ws=None, data_dir=tmp_path / "d", sys_interval=0,
        limits=Limits(slow_subscriber_hold=hold, max_inflight=2, max_queued=max_queued)))
    return broker, broker.start().mqtt


def _fed_by_ten(port: int, uid, clients: list[RawClient]) -> RawClient:
    """A QoS 1 subscriber, then ten publishers that each send it 20 messages in one write
    (``<n>-1`` .. ``<n>-20``); all of them appended to ``clients``, the subscriber first."""
    topic = uid("fed")
    sub = RawClient("127.0.0.1", port, timeout=10)
    clients.append(sub)
    assert sub.connect(uid("sub")).return_code == 0
    assert sub.subscribe([(topic, 1)]) == [1]
    for n in range(10):
        pub = RawClient("127.0.0.1", port, timeout=10)
        clients.append(pub)
        assert pub.connect(uid("pub")).return_code == 0
        pub.send(b"".join(publish(topic, f"{n}-{i}".encode(), qos=1, packet_id=i)
                          for i in range(1, 21)))
    return sub


def test_a_subscriber_that_reads_steadily_is_not_shed_however_many_feed_it(
        tmp_path, uid) -> None:
    """Ten publishers send 20 each at once: 200 messages for a subscriber that makes room
    the whole time, one message per 10 ms.  A publish then waits about 2 s, longer than
    the 1 s hold: it goes on when the hold ends (its message is queued already), and the
    subscriber, making progress, is not cut off (it was, losing what it had been sent).
    (``max_queued`` 20: the queue may reach 200, below 16 times that.)"""
    broker, port = _in_process(tmp_path, hold=1.0, max_queued=20)
    clients: list[RawClient] = []
    try:
        sub = _fed_by_ten(port, uid, clients)
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 200:
            packet = sub.recv_packet(max(deadline - time.monotonic(), 0.01))
            assert packet.type == PUBLISH, packet
            got.append(packet.payload)
            time.sleep(0.01)  # a slow but steady reader
            sub.send(puback(packet.packet_id))
        assert sorted(got) == sorted(f"{n}-{i}".encode() for n in range(10)
                                     for i in range(1, 21))
        for pub in clients[1:]:  # every publish acknowledged, in order
            acks = read_packets(pub, {PUBACK: 20}, ack=False)
            assert [p.packet_id for p in acks[PUBACK]] == list(range(1, 21))
        assert broker.core is not None
        assert broker.core.metrics.slow_subscribers_disconnected == 0
        assert broker.core.metrics.messages_dropped == 0
    finally:
        for c in clients:
            c.close()
        broker.stop()


def test_a_stuck_subscriber_is_shed_once_and_its_losses_counted(tmp_path, uid) -> None:
    """A subscriber that never acknowledges, fed by ten publishers: one disconnect, one
    warning, however many publishes waited for it; its clean session's messages count as
    dropped."""
    broker, port = _in_process(tmp_path, hold=1.0, max_queued=5)
    clients: list[RawClient] = []
    try:
        sub = _fed_by_ten(port, uid, clients)
        for pub in clients[1:]:
            read_packets(pub, {PUBACK: 20}, ack=False)
        assert sub.wait_closed(5), "the stuck subscriber was not disconnected"
        assert broker.core is not None
        metrics = broker.core.metrics
        assert metrics.slow_subscribers_disconnected == 1
        # What it held when it was shed (2 in flight, the queue) was lost with it; the
        # publishes held meanwhile found no subscriber when they went on.
        assert 2 + 5 <= metrics.messages_dropped <= 200
    finally:
        for c in clients:
            c.close()
        broker.stop()
