"""Link frames numbered, acknowledged and replayed (``mqttring.cluster.replay``), and the
receiving end of ``Links`` that applies them once, in order.

The end-to-end case (a real connection stalled by nftables, replaced, its frames replayed,
nothing lost) is ``tests/faults/test_link_stall.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from link_support import serve_frames
from mqttring.cluster import messages as m
from mqttring.cluster.errors import PeerProtocolError
from mqttring.cluster.inbound import unwrapped
from mqttring.cluster.links import Links
from mqttring.cluster.outbound import Link
from mqttring.cluster.replay import InboundSession, OutboundWindow, StallJudge, Verdict
from mqttring.rpc import FramedStream, Peer
from mqttring.tcp_options import SendState

# -- the sender's window ---------------------------------------------------------------------


def test_frames_stay_in_the_window_until_acknowledged_and_are_replayed_in_order() -> None:
    window = OutboundWindow(max_bytes=1000)
    for seq, payload in enumerate([b"a", b"bb", b"ccc"], start=1):
        assert window.next_seq() == seq
        window.sent(seq, payload, now=10.0)
    assert len(window) == 3 and window.bytes == 6
    window.on_ack(1, now=11.0)
    assert window.reconnected(now=12.0) == [b"bb", b"ccc"]
    window.on_ack(3, now=13.0)
    assert len(window) == 0 and window.bytes == 0 and window.reconnected(14.0) == []
    assert window.next_seq() == 4


def test_acknowledgements_are_cumulative_and_may_repeat() -> None:
    window = OutboundWindow(max_bytes=1000)
    for seq in (1, 2, 3):
        window.sent(seq, b"x", now=0.0)
    window.on_ack(2, now=1.0)
    window.on_ack(1, now=2.0)  # an older one, overtaken: nothing changes
    assert window.acked == 2 and len(window) == 1


def test_an_acknowledgement_of_a_frame_never_sent_is_a_protocol_error() -> None:
    window = OutboundWindow(max_bytes=1000)
    window.sent(1, b"x", now=0.0)
    with pytest.raises(PeerProtocolError):
        window.on_ack(2, now=1.0)


def test_a_stall_counts_from_the_last_progress() -> None:
    window = OutboundWindow(max_bytes=1000)
    assert window.stalled_for(100.0) == 0.0  # nothing in flight: never stalled
    window.sent(1, b"x", now=10.0)
    window.sent(2, b"y", now=12.0)
    assert window.stalled_for(13.0) == 3.0  # from the oldest frame's send
    window.on_ack(1, now=14.0)
    assert window.stalled_for(15.0) == 1.0  # from the acknowledgement
    window.reconnected(now=20.0)
    assert window.stalled_for(20.5) == 0.5  # a new connection gets a whole timeout
    window.on_ack(2, now=21.0)
    assert window.stalled_for(99.0) == 0.0


# -- when a connection counts as stalled --------------------------------------------------


def test_a_stall_with_tcp_retransmitting_is_one_after_the_timeout() -> None:
    judge = StallJudge(timeout=3.0)
    busy = SendState(retransmitting=True, queued=900)
    assert judge.why_stalled(2.9, busy) is None  # within the timeout
    assert judge.why_stalled(3.1, busy) == "TCP retransmits"


def test_retransmissions_in_the_past_do_not_make_a_stall() -> None:
    """Between two retransmission bursts the connection may be recovering: replacing it
    then buys a new handshake through the same lossy path (docs/faults.md)."""
    judge = StallJudge(timeout=3.0)
    assert judge.why_stalled(4.0, SendState(False, 900)) is None


def test_acknowledgements_lost_on_the_way_back_are_a_stall_after_twice_the_timeout() -> None:
    """Every byte reached the peer's TCP and nothing is retransmitting here: the missing
    acknowledgement is the peer's to resend, which no counter on this end shows."""
    judge = StallJudge(timeout=3.0)
    delivered = SendState(retransmitting=False, queued=0)
    assert judge.why_stalled(1.0, delivered) is None
    assert judge.why_stalled(5.9, delivered) is None  # maybe a peer slow to apply
    assert judge.why_stalled(6.1, delivered) == (
        "every byte delivered, no acknowledgement back")


def test_a_large_frame_still_on_its_way_is_never_cut_short() -> None:
    judge = StallJudge(timeout=3.0)
    sending = SendState(retransmitting=False, queued=4_000_000)
    assert judge.why_stalled(0.1, sending) is None
    assert judge.why_stalled(60.0, sending) is None


def test_without_the_kernels_word_the_stall_alone_decides() -> None:
    judge = StallJudge(timeout=3.0)
    assert judge.why_stalled(2.0, None) is None
    assert judge.why_stalled(3.5, None) == "TCP state unknown"


def test_the_window_fills_by_bytes() -> None:
    window = OutboundWindow(max_bytes=10)
    window.sent(1, b"x" * 6, now=0.0)
    assert not window.full()
    window.sent(2, b"x" * 6, now=0.0)
    assert window.full()
    window.on_ack(1, now=1.0)
    assert not window.full()


def test_a_links_window_holds_at_least_two_of_its_largest_frames() -> None:
    small = Links("me", b"k" * 32, lambda node, msg: None, max_frame=10_000,
                  max_unacked_bytes=100)
    assert Link(small, "peer", "x:1").window.max_bytes == 20_000
    large = Links("me", b"k" * 32, lambda node, msg: None, max_frame=10_000,
                  max_unacked_bytes=1_000_000)
    assert Link(large, "peer", "x:1").window.max_bytes == 1_000_000


def test_sessions_differ() -> None:
    assert len({OutboundWindow(10).session for _ in range(50)}) == 50


# -- the receiver's session ------------------------------------------------------------------


def test_the_receiver_applies_each_frame_once_in_order() -> None:
    inbound = InboundSession(7)
    assert inbound.verdict(5) is Verdict.APPLY  # a restarted receiver meets it mid-way
    inbound.applied(5)
    assert inbound.verdict(5) is Verdict.DUPLICATE
    assert inbound.verdict(4) is Verdict.DUPLICATE
    assert inbound.verdict(6) is Verdict.APPLY
    with pytest.raises(PeerProtocolError):
        inbound.verdict(8)  # 6 and 7 never arrived
    with pytest.raises(PeerProtocolError):
        inbound.verdict(0)


# -- the receiving end of Links ----------------------------------------------------------------


_serve = serve_frames


def _frame(seq: int, *messages: Any, incarnation: int = 1, epoch: int = 1) -> bytes:
    return m.encode_frame(incarnation, epoch, list(messages) or [m.RoutePull()], seq)


def _recording() -> tuple[Links, list[Any]]:
    got: list[Any] = []
    return Links("me", b"k" * 32, lambda node, msg: got.append(msg)), got


async def test_a_replayed_connection_applies_only_what_the_last_one_did_not(
        autojump_clock: trio.abc.Clock) -> None:
    links, got = _recording()
    kick = [m.SessionKick(0, f"c{i}", "a:1") for i in range(5)]
    _, acks = await _serve(links, [_frame(1, kick[0]), _frame(2, kick[1])])
    assert acks[-1] == 2
    # The sender never saw that acknowledgement: it replays 2 and goes on.
    error, acks = await _serve(links, [_frame(2, kick[1]), _frame(3, kick[2]),
                                       _frame(4, kick[3])])
    assert error is None and acks[-1] == 4
    assert got == kick[:4]


async def test_acknowledgements_coalesce(autojump_clock: trio.abc.Clock) -> None:
    links, got = _recording()
    _, acks = await _serve(links, [_frame(seq) for seq in range(1, 11)])
    assert len(got) == 10 and acks == [10]  # one acknowledgement covers the burst


async def test_the_acknowledgement_interval_is_the_links_option(
        autojump_clock: trio.abc.Clock) -> None:
    """``link_ack_interval``: the connection below is served for 1 s (virtual) and ends; at
    2 s between acknowledgements none was due yet."""
    slow = Links("me", b"k" * 32, lambda node, msg: None, ack_interval=2.0)
    error, acks = await _serve(slow, [_frame(1), _frame(2)])
    assert error is None and acks == []
    quick = Links("me", b"k" * 32, lambda node, msg: None, ack_interval=0.5)
    error, acks = await _serve(quick, [_frame(1), _frame(2)])
    assert error is None and acks == [2]


async def test_a_new_session_starts_afresh(autojump_clock: trio.abc.Clock) -> None:
    links, got = _recording()
    await _serve(links, [_frame(1), _frame(2)], session=1)
    error, acks = await _serve(links, [_frame(1), _frame(2)], session=2)
    assert error is None and acks[-1] == 2 and len(got) == 4


async def test_a_gap_in_a_session_is_a_protocol_error(autojump_clock: trio.abc.Clock) -> None:
    links, got = _recording()
    error, _ = await _serve(links, [_frame(1), _frame(3)])
    assert isinstance(error, PeerProtocolError) and len(got) == 1
    assert links.protocol_errors == {"peer": 1}


async def test_a_link_without_a_session_is_refused(autojump_clock: trio.abc.Clock) -> None:
    links, got = _recording()
    ours, theirs = trio.testing.memory_stream_pair()
    await FramedStream(theirs).send_packed(_frame(1))
    with pytest.raises(PeerProtocolError):
        await links.serve_stream(FramedStream(ours), Peer("peer", "x:1"), {})
    assert got == []


async def test_fenced_off_frames_are_skipped_and_the_senders_next_life_applied(
        autojump_clock: trio.abc.Clock) -> None:
    """A node's link session spans its lives (a restarted node links before it is admitted,
    at incarnation 0): what fencing refuses is never applied, and acknowledged so that it
    is not replayed; what the same session sends in the next life is applied."""
    got: list[Any] = []
    links = Links("me", b"k" * 32, lambda node, msg: got.append(msg),
                  admit=lambda node, inc, epoch: inc >= 2)
    kick = m.SessionKick(0, "c", "a:1")
    error, acks = await _serve(links, [_frame(1, incarnation=1), _frame(2, incarnation=1)])
    assert error is None and got == [] and acks[-1] == 2
    error, acks = await _serve(links, [_frame(2, incarnation=1), _frame(3, kick, incarnation=2)])
    assert error is None and got == [kick] and acks[-1] == 3
    assert links.refused_frames == 2 and links.protocol_errors == {}


async def test_a_newer_connection_of_a_peer_replaces_the_one_being_served(
        autojump_clock: trio.abc.Clock) -> None:
    links, got = _recording()
    old_ours, old_theirs = trio.testing.memory_stream_pair()
    await FramedStream(old_theirs).send_packed(_frame(1))
    ended = trio.Event()

    async def serve_old() -> None:
        await links.serve_stream(FramedStream(old_ours), Peer("peer", "x:1"), {"session": 1})
        ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_old)
        await trio.testing.wait_all_tasks_blocked()
        assert got == [m.RoutePull()] and not ended.is_set()  # waiting for more on it
        error, acks = await _serve(links, [_frame(1), _frame(2)])
        with trio.fail_after(5):
            await ended.wait()  # the newer connection ended the older one's service
    assert error is None and acks[-1] == 2 and len(got) == 2


def test_a_connection_that_ended_in_both_tasks_is_one_ordinary_end() -> None:
    """A peer's reset: the frame loop reads EOF while the acknowledger's write breaks.  The
    two came out as an ExceptionGroup the RPC server logged as a failure with a traceback
    (seen in a power-loss run of the fault suite); it is one ordinary end of a connection."""
    eof, broken = EOFError("connection closed by peer"), trio.BrokenResourceError("reset")
    assert unwrapped(BaseExceptionGroup("x", [broken, eof])) is broken
    protocol = PeerProtocolError("frame 3 after 1")
    assert unwrapped(BaseExceptionGroup("x", [eof, protocol])) is protocol
    bug = BaseExceptionGroup("x", [KeyError("k"), ValueError("v")])
    assert unwrapped(bug) is bug
