"""Packed QoS 0 batches on cluster links: format, checks, back-pressure and frame limits.

The format is exercised end to end by the data-plane tests (three real nodes); these tests
pin what those cannot reach deterministically: every malformed batch is refused, a batch
survives the frame codec trip the link gives it, and a link never builds a frame its peer
would refuse.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqttring.cluster import wire
from mqttring.cluster.links import Links
from mqttring.cluster.messages import Batch, Dlv, DlvEntry, decode_frame, encode_frame
from mqttring.cluster.outbound import Link
from mqttring.protocol.codec import PacketDecoder
from mqttring.protocol.message import Message
from mqttring.protocol.packets import Publish
from mqttring.protocol.session import Session, SessionLimits

topics = st.sampled_from(["a", "a/b", "sensors/1/temp", "ü/ñ", "x" * 300])
entries = st.tuples(st.sampled_from([wire.ROUTE, wire.DELIVER]), topics,
                    st.binary(max_size=300))


def build(items: list[tuple[int, str, bytes]]) -> Batch:
    """The batch a link queue would hold after these pushes, one frame each."""
    batch = None
    for section, topic, payload in items:
        frame = Message(topic, payload).encode_qos0(False)
        if batch is None:
            batch = wire.new_batch(section, topic, frame, 1)
        else:
            wire.append(batch, section, topic, frame, 1)
    assert batch is not None
    return batch


def over_the_link(batch: Batch) -> Batch:
    received = decode_frame(encode_frame(1, 1, [batch])).messages[0]
    assert isinstance(received, Batch)
    return received


@settings(max_examples=200, deadline=None)
@given(st.lists(entries, min_size=1, max_size=40))
def test_runs_give_back_every_frame_in_order(items: list[tuple[int, str, bytes]]) -> None:
    batch = over_the_link(build(items))
    blob, index = batch.blob, batch.index
    assert type(blob) is bytes and batch.count == len(items)
    seen: list[tuple[int, str, bytes]] = []
    previous: tuple[int, str] | None = None
    for section, topic, start, stop, n in wire.runs(blob, index):
        assert (section, topic) != previous, "consecutive frames of one run were split"
        previous = (section, topic)
        messages = list(wire.unpack(memoryview(blob)[start:stop]))
        assert len(messages) == n
        for m in messages:
            assert m.topic == topic and m.qos == 0 and not m.retain
            # The frame handed to subscribers is the PUBLISH itself, byte for byte.
            decoder = PacketDecoder()
            decoder.feed(m.encode_qos0(False))
            assert list(decoder) == [Publish(topic, m.payload)]
            seen.append((section, m.topic, m.payload))
    assert seen == items


def test_runs_group_consecutive_frames_of_one_topic_and_section() -> None:
    items = [(wire.ROUTE, "t", b"1"), (wire.ROUTE, "t", b"2"), (wire.DELIVER, "t", b"3"),
             (wire.DELIVER, "u", b"4"), (wire.DELIVER, "u", b"5"), (wire.ROUTE, "t", b"6")]
    batch = over_the_link(build(items))
    shape = [(s, t, n) for s, t, _, _, n in wire.runs(batch.blob, batch.index)]
    assert shape == [(wire.ROUTE, "t", 2), (wire.DELIVER, "t", 1), (wire.DELIVER, "u", 2),
                     (wire.ROUTE, "t", 1)]


def _valid() -> tuple[bytes, list]:
    batch = over_the_link(build([(wire.ROUTE, "t", b"12"), (wire.DELIVER, "u", b"")]))
    return batch.blob, batch.index


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b, i: (bytearray(b), i), id="blob-not-bytes"),
        pytest.param(lambda b, i: (b, tuple(i)), id="index-not-a-list"),
        pytest.param(lambda b, i: (b, i[:-1]), id="index-not-in-fours"),
        pytest.param(lambda b, i: (b, [2, *i[1:]]), id="unknown-section"),
        pytest.param(lambda b, i: (b, [i[0], b"t", *i[2:]]), id="topic-not-text"),
        pytest.param(lambda b, i: (b, [i[0], i[1], 0, *i[3:]]), id="zero-frames"),
        pytest.param(lambda b, i: (b, [*i[:3], 3, *i[4:]]), id="run-too-short"),
        pytest.param(lambda b, i: (b, [*i[:3], len(b) + 1, *i[4:]]), id="run-past-the-blob"),
        pytest.param(lambda b, i: (b + b"\x30\x02\x00\x00", i), id="blob-not-covered"),
        pytest.param(lambda b, i: (b"\x32" + b[1:], i), id="not-a-qos0-publish"),
    ],
)
def test_malformed_batches_are_refused(mutate) -> None:
    blob, index = mutate(*_valid())
    with pytest.raises(ValueError):
        list(wire.runs(blob, index))


@pytest.mark.parametrize(
    "frames",
    [b"\x30\x05\x00\x01", b"\x30\x02\x00\x05ab", b"\x30\x02\x00\x00", b"\x30\xff\xff\xff\xff\x01",
     b"\x20\x02\x00\x00", b"\x30\x03\x00\x01\xff"],
    ids=["truncated", "topic-past-frame", "empty-topic", "length-too-long", "not-publish",
         "topic-not-utf8"],
)
def test_unpack_refuses_garbled_frames(frames: bytes) -> None:
    with pytest.raises(ValueError):
        list(wire.unpack(frames))


# --------------------------------------------------------------------------- sessions


def test_encoded_frames_reach_an_online_session_as_they_are() -> None:
    s = Session("c", True, SessionLimits(max_output=10))
    assert not s.deliver_encoded(b"\x30\x03\x00\x01ax", 1)  # offline: caller queues
    out = bytearray()
    s.attach(out)
    run = Message("a", b"x").encode_qos0(False) * 2
    assert s.deliver_encoded(run, 2) and out == run
    assert s.deliver_encoded(run, 2) and s.dropped == 2 and out == run  # over max_output


# --------------------------------------------------------------------------- links


def make_link(max_queued: int = 100, max_frame: int = 10_000) -> Link:
    links = Links("me", b"k" * 32, lambda node, msg: None, max_queued=max_queued,
                  max_frame=max_frame)
    return Link(links, "peer", "127.0.0.1:1")


def test_packed_frames_count_for_back_pressure() -> None:
    link = make_link(max_queued=5)
    frame = Message("t", b"x").encode_qos0(False)
    assert link.push_frames(wire.ROUTE, "t", frame * 3, 3)
    assert link.push_frames(wire.DELIVER, "t", frame * 2, 2)
    assert len(link.queue) == 1 and link.queued == 5  # one link message, five PUBLISHes
    assert not link.push_frames(wire.ROUTE, "t", frame, 1) and link.dropped == 1
    assert link.push(Dlv(0, [DlvEntry("t", b"x", 0, [])])) is False and link.dropped == 2


def test_a_frame_never_exceeds_the_peer_limit() -> None:
    link = make_link(max_frame=10_000)
    for i in range(6):
        assert link.push(Dlv(0, [DlvEntry("t", bytes([i]) * 3_000, 0, [])]))
    batch = [link.queue.popleft() for _ in range(len(link.queue))]
    sent = []
    while True:
        payload = link._pack(batch, len(sent) + 1)
        assert payload is not None and len(payload) <= 10_000
        sent += decode_frame(payload).messages
        if not link.queue:
            break
        batch = [link.queue.popleft() for _ in range(len(link.queue))]
    assert [m.entries[0].payload[0] for m in sent] == list(range(6))  # split, none lost, in order


def test_a_message_too_big_for_any_frame_is_dropped_not_sent() -> None:
    link = make_link(max_frame=10_000)
    link.push(Dlv(0, [DlvEntry("t", b"x" * 20_000, 0, [])]))
    assert link._pack([link.queue.popleft()], 1) is None
    assert link.dropped == 1 and link.queued == 0
