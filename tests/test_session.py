"""The session machine on its own: flow control, redelivery, QoS 2 ids, overflow, persistence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mqttring.protocol.codec import PacketDecoder
from mqttring.protocol.message import Message
from mqttring.protocol.packets import Publish, PubRel
from mqttring.protocol.session import (
    LEGACY_EXPIRY_CUTOFF,
    Outbound,
    OutState,
    Session,
    SessionLimits,
)


def packets(buf: bytearray) -> list:
    decoder = PacketDecoder()
    decoder.feed(bytes(buf))
    buf.clear()
    return list(decoder)


def make(clean: bool = False, **limits) -> Session:
    return Session("c1", clean, SessionLimits(**limits))


def stored(s: Session) -> None:
    """What ``SessionStore.release_when_stored`` does once its durable write returns: the
    held PUBRELs go out."""
    count = s.take_held_releases()
    s.take_changes()
    s.release(count)


def test_qos0_goes_straight_out_when_online():
    s = make()
    out = bytearray()
    s.attach(out)
    s.deliver(Message("a", b"x", 0), 0)
    assert packets(out) == [Publish("a", b"x", 0)]


def test_inflight_window_holds_back_qos1_until_acked():
    s = make(max_inflight=2)
    out = bytearray()
    s.attach(out)
    for i in range(4):
        s.deliver(Message("t", b"%d" % i, 1), 1)
    sent = packets(out)
    assert [p.payload for p in sent] == [b"0", b"1"]
    assert len(s.inflight) == 2 and len(s.queue) == 2
    assert s.on_puback(sent[0].packet_id)
    assert [p.payload for p in packets(out)] == [b"2"]
    assert not s.on_puback(sent[0].packet_id), "an ack for an unknown id changes nothing"


def test_reattach_resends_inflight_with_dup_then_pubrel_then_queue():
    s = make(max_inflight=2)
    out = bytearray()
    s.attach(out)
    s.deliver(Message("q1", b"a", 1), 1)
    s.deliver(Message("q2", b"b", 2), 2)
    s.deliver(Message("q3", b"c", 1), 1)
    first = packets(out)
    assert [p.topic for p in first] == ["q1", "q2"]
    s.on_pubrec(first[1].packet_id)
    assert packets(out) == [], "a persistent session's PUBREL waits for its record"
    stored(s)
    assert packets(out) == [PubRel(first[1].packet_id)]
    s.detach()
    s.deliver(Message("q4", b"d", 1), 1)
    out2 = bytearray()
    s.attach(out2)
    again = packets(out2)
    assert again[0] == Publish("q1", b"a", 1, dup=True, packet_id=first[0].packet_id)
    assert again[1] == PubRel(first[1].packet_id)
    assert again[2:] == []  # window of 2 is full: q3, q4 wait
    s.on_pubcomp(first[1].packet_id)
    assert [p.topic for p in packets(out2)] == ["q3"]


def test_clean_session_drops_qos0_while_away_persistent_queues_it():
    clean, durable = make(clean=True), make(clean=False)
    for s in (clean, durable):
        s.deliver(Message("t", b"x", 0), 0)
    assert len(clean.queue) == 0
    assert len(durable.queue) == 1


def test_overflow_drops_oldest_qos0_first_then_oldest_qos1():
    s = make(max_queued=3)
    s.deliver(Message("t", b"q1-a", 1), 1)
    s.deliver(Message("t", b"q0", 0), 0)
    s.deliver(Message("t", b"q1-b", 1), 1)
    s.deliver(Message("t", b"q1-c", 1), 1)  # evicts the QoS 0 message
    assert [e.message.payload for e in s.queue] == [b"q1-a", b"q1-b", b"q1-c"]
    s.deliver(Message("t", b"q1-d", 1), 1)  # evicts the oldest QoS 1 message
    assert [e.message.payload for e in s.queue] == [b"q1-b", b"q1-c", b"q1-d"]
    assert s.dropped == 2


def test_inbound_qos2_id_is_routed_once_until_pubrel():
    s = make()
    first = s.begin_inbound_qos2(7)
    assert first not in (0, 1)
    s.inbound_qos2_acknowledged(7)  # its PUBREC went out
    assert s.begin_inbound_qos2(7) == 0  # a resend: answered, not routed
    s.release_inbound_qos2(7)
    again = s.begin_inbound_qos2(7)
    assert again not in (0, 1, first)  # a new message with a reused id


def test_a_resend_of_an_id_not_acknowledged_is_routed_as_the_same_message():
    """Routing failed (or the node died) before the PUBREC: the client's resend goes out
    with the identity the first attempt had, wherever the session is by then, so a session
    that got the first copy takes the resend for the same message."""
    s = make()
    mid = s.begin_inbound_qos2(7)
    assert s.begin_inbound_qos2(7) == mid
    _, qos2 = s.take_changes()
    assert qos2 == {7: mid}  # stored with its identity, before it is routed
    moved = make()  # the session read back on its next node
    moved.restore([], qos2)
    assert moved.begin_inbound_qos2(7) == mid
    moved.inbound_qos2_acknowledged(7)
    _, qos2 = moved.take_changes()
    assert qos2 == {7: 0}
    moved.release_inbound_qos2(7)
    _, qos2 = moved.take_changes()
    assert qos2 == {7: None}


def test_changes_coalesce_and_clean_sessions_mark_nothing():
    s = make(max_inflight=1)
    out = bytearray()
    s.attach(out)
    s.deliver(Message("t", b"1", 1), 1)
    s.deliver(Message("t", b"2", 1), 1)
    pid = packets(out)[0].packet_id
    s.on_puback(pid)
    dirty, _qos2 = s.take_changes()
    assert dirty[1] is None, "message 1 was acked: its record goes"
    assert dirty[2].state == OutState.AWAIT_PUBACK
    assert not s.has_changes()
    clean = make(clean=True)
    clean.attach(bytearray())
    clean.deliver(Message("t", b"1", 1), 1)
    assert not clean.has_changes()


#: A wall-clock instant (UNIX seconds): deadlines are ``time.time()``-based, not monotonic.
T0 = 1_700_000_000.0


def test_expired_queued_messages_are_dropped_on_attach():
    s = make(message_ttl=10.0)
    s.deliver(Message("t", b"old", 1), 1, now=T0)
    s.deliver(Message("t", b"new", 1), 1, now=T0 + 8.0)
    assert [e.expires_at for e in s.queue] == [T0 + 10.0, T0 + 18.0]
    out = bytearray()
    s.attach(out, now=T0 + 12.0)
    assert [p.payload for p in packets(out)] == [b"new"]


def test_restore_rebases_legacy_monotonic_deadlines_only():
    """Deadlines below LEGACY_EXPIRY_CUTOFF were monotonic: they get a full TTL from load;
    0 (never) and real wall-clock deadlines are kept as they are."""
    s = make(message_ttl=60.0)
    entries = [Outbound(1, Message("t", b"a", 1), 1, expires_at=12345.6),
               Outbound(2, Message("t", b"b", 1), 1, expires_at=0.0),
               Outbound(3, Message("t", b"c", 1), 1, expires_at=T0 - 5.0)]
    s.restore(entries, set(), now=T0)
    assert [e.expires_at for e in s.queue] == [T0 + 60.0, 0.0, T0 - 5.0]
    dirty, _ = s.take_changes()
    assert list(dirty) == [1], "only the re-based entry needs writing back"
    assert s.expire(T0) == 1 and [e.message.payload for e in s.queue] == [b"a", b"b"]
    assert 12345.6 < LEGACY_EXPIRY_CUTOFF < T0


ops = st.lists(
    st.one_of(
        st.tuples(st.just("deliver"), st.integers(0, 2)),
        st.tuples(st.just("ack"), st.integers(0, 40)),
        st.tuples(st.just("bounce"), st.just(0)),
        st.tuples(st.just("store"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 5))
def test_model_every_qos_message_arrives_in_order(operations, window):
    """Against a model client that acks correctly: QoS 1/2 messages are first sent in the
    order they were delivered, ids never collide, and after a final drain every one arrived.
    The store's durable writes (``store``) come at any point: a PUBREL waits for one."""
    s = make(max_inflight=window, max_queued=10_000)
    out = bytearray()
    s.attach(out)
    expected: list[bytes] = []
    first_seen: list[bytes] = []
    awaiting: dict[int, str] = {}  # pid -> what the client owes
    counter = 0

    def absorb(buf: bytearray) -> None:
        for p in packets(buf):
            if isinstance(p, Publish) and p.qos:
                assert p.packet_id not in awaiting or p.dup
                if p.payload not in first_seen:
                    first_seen.append(p.payload)
                awaiting[p.packet_id] = "puback" if p.qos == 1 else "pubrec"
            elif isinstance(p, PubRel):
                awaiting[p.packet_id] = "pubcomp"
        assert len([1 for k in awaiting if s.inflight.get(k)]) <= window

    for op, arg in operations:
        if op == "deliver":
            counter += 1
            payload = b"%d" % counter
            s.deliver(Message("t", payload, arg), arg)
            if arg:
                expected.append(payload)
        elif op == "ack" and awaiting:
            pid = sorted(awaiting)[arg % len(awaiting)]
            kind = awaiting.pop(pid)
            {"puback": s.on_puback, "pubrec": s.on_pubrec, "pubcomp": s.on_pubcomp}[kind](pid)
        elif op == "bounce":
            s.detach()
            awaiting.clear()
            out = bytearray()
            s.attach(out)
        elif op == "store":
            stored(s)
        absorb(out)
    for _ in range(10 * (len(expected) + 1)):
        stored(s)
        absorb(out)
        if not awaiting:
            break
        pid = min(awaiting)
        kind = awaiting.pop(pid)
        {"puback": s.on_puback, "pubrec": s.on_pubrec, "pubcomp": s.on_pubcomp}[kind](pid)
        absorb(out)
    assert first_seen == expected
    assert not s.inflight and not s.queue


class DenyPrefix:
    """A read access that refuses topics under one prefix (the ACL's ``ClientAccess``
    answers the same question)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def may_read(self, topic: str) -> bool:
        return not topic.startswith(self.prefix)


def test_reattach_drops_inflight_publishes_the_client_may_no_longer_read():
    """Sent before an ACL change (or to another identity with the same client id): an
    unacknowledged PUBLISH the client may not read now is dropped, not sent again; a
    PUBREL (no payload) still goes; the freed window takes readable queued messages."""
    s = make(max_inflight=3)
    out = bytearray()
    s.attach(out)
    s.deliver(Message("open/1", b"a", 1), 1)
    s.deliver(Message("closed/2", b"b", 2), 2)
    s.deliver(Message("closed/3", b"c", 2), 2)
    s.deliver(Message("open/4", b"d", 1), 1)
    first = packets(out)
    assert [p.topic for p in first] == ["open/1", "closed/2", "closed/3"]
    s.on_pubrec(first[1].packet_id)
    stored(s)
    assert packets(out) == [PubRel(first[1].packet_id)]
    s.detach()
    s.take_changes()
    s.access = DenyPrefix("closed/")
    out2 = bytearray()
    s.attach(out2)
    again = packets(out2)
    assert again == [Publish("open/1", b"a", 1, dup=True, packet_id=first[0].packet_id),
                     PubRel(first[1].packet_id),
                     Publish("open/4", b"d", 1, packet_id=again[2].packet_id)]
    assert first[2].packet_id not in s.inflight
    dirty, _ = s.take_changes()
    assert None in dirty.values(), "the dropped message is removed from the store too"
    s.access = DenyPrefix("open/")  # even the message in PUBREL stage keeps its flow
    s.detach()
    out3 = bytearray()
    s.attach(out3)
    assert packets(out3) == [PubRel(first[1].packet_id)]


def test_a_qos2_message_of_one_identity_is_taken_once_within_the_window():
    """A cluster node that retries a delivery whose answer it lost makes a second copy of
    the same publish (same ``mid``): at QoS 2 the session takes one.  QoS 1 copies, and
    QoS 2 messages without an identity (one node), go through as before."""
    s = make(max_inflight=10, qos2_dedup_window=2)
    out = bytearray()
    s.attach(out)
    first = Message("t", b"a", 2, mid=11)
    s.deliver(first, 2)
    s.deliver(Message("t", b"a", 2, mid=11), 2)  # the retry's copy
    s.deliver(Message("t", b"a", 2, mid=11), 1)  # granted QoS 1: at least once
    s.deliver(Message("t", b"z", 2), 2)  # no identity
    s.deliver(Message("t", b"z", 2), 2)
    assert [(p.payload, p.qos) for p in packets(out)] == [(b"a", 2), (b"a", 1), (b"z", 2),
                                                           (b"z", 2)]
    s.deliver(Message("t", b"b", 2, mid=12), 2)
    s.deliver(Message("t", b"c", 2, mid=13), 2)  # the window (2) forgets 11
    s.deliver(Message("t", b"a", 2, mid=11), 2)
    s.deliver(Message("t", b"c", 2, mid=13), 2)
    assert [p.payload for p in packets(out)] == [b"b", b"c", b"a"]
    off = make(qos2_dedup_window=0)
    off.attach(out)
    off.deliver(Message("t", b"a", 2, mid=11), 2)
    off.deliver(Message("t", b"a", 2, mid=11), 2)
    assert len(packets(out)) == 2


def test_qos2_identities_are_kept_as_long_as_a_retry_can_come_and_no_longer():
    """Memory follows the recent QoS 2 rate, not the session's history: an identity older
    than the horizon (twice ``cluster_write_patience`` in a node) is forgotten when the
    next QoS 2 message comes."""
    s = make(max_inflight=10, qos2_dedup_window=100, qos2_dedup_seconds=30.0)
    out = bytearray()
    s.attach(out)
    s.deliver(Message("t", b"a", 2, mid=1), 2, now=1000.0)
    s.deliver(Message("t", b"b", 2, mid=2), 2, now=1020.0)
    s.deliver(Message("t", b"a", 2, mid=1), 2, now=1025.0)  # a retry within 30 s: dropped
    s.deliver(Message("t", b"c", 2, mid=3), 2, now=1040.0)  # 1 is older than 30 s now
    assert s.recent_qos2 is not None and len(s.recent_qos2) == 2
    s.deliver(Message("t", b"a", 2, mid=1), 2, now=1041.0)
    assert [p.payload for p in packets(out)] == [b"a", b"b", b"c", b"a"]


def test_a_session_that_just_moved_keeps_what_comes_past_max_queued_until_its_grace_ends():
    """Its client is away only because the session moved (``keep_until``): nothing is
    dropped for ``max_queued`` until then; after it, the away rule applies again."""
    s = make(max_queued=3)
    s.keep_until = 100.0
    for i in range(10):
        s.deliver(Message("t", f"m{i}".encode(), 1), 1, now=50.0)
    assert len(s.queue) == 10 and s.dropped == 0
    s.deliver(Message("t", b"late", 1), 1, now=100.0)
    assert s.dropped == 1 and s.queue[0].message.payload == b"m1"
