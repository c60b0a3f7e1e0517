"""The typed link messages and their frame codec (``mqttring.cluster.messages``).

What these pin: every message type survives the frame codec unchanged (strategies are built
from the Struct fields, so a new field or type is covered without editing this file); a frame
that is not ours (another version, an unknown tag, a field of the wrong type, garbage) raises
``PeerProtocolError`` before anything is dispatched, and on a real link it is counted and
closes that peer's link; the dispatch table covers every message type; requests get their id
without positional slots.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from link_support import serve_frames
from mqttring.cluster import messages as m
from mqttring.cluster.errors import PeerProtocolError
from mqttring.cluster.links import Links, _Pending
from mqttring.cluster.plane import DataPlane
from mqttring.rpc import ProtocolError

MESSAGE_TYPES: tuple[type, ...] = typing.get_args(m.LinkMessage)
REQUEST_TYPES: tuple[type, ...] = typing.get_args(m.Request)


# -- strategies from the Struct definitions -------------------------------------------------

_text = st.text(max_size=20)
_bytes = st.binary(max_size=40)
_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
#: What a store value may be (``StoredOp.value`` is Any): msgpack-able, no float NaN trouble.
_any = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _text | _bytes,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    """A strategy for values of a field type as the messages module annotates them."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        _base, *meta = typing.get_args(tp)
        bounds = next(x for x in meta if isinstance(x, msgspec.Meta))
        return st.integers(bounds.ge, bounds.le)
    if origin is typing.Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return st.one_of([strategy_for(arg) for arg in typing.get_args(tp)])
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(strategy_for(item), max_size=4)
    if origin is tuple:
        return st.tuples(*(strategy_for(arg) for arg in typing.get_args(tp)))
    if tp is Any:
        return _any
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return struct_strategy(tp)
    return {str: _text, bytes: _bytes, int: _ints, bool: st.booleans(),
            float: st.floats(allow_nan=False)}[tp]


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f: strategy_for(hints[f]) for f in cls.__struct_fields__}
    return st.builds(cls, **fields)


any_message = st.one_of([struct_strategy(cls) for cls in MESSAGE_TYPES])


# -- the codec ------------------------------------------------------------------------------


def test_every_message_type_is_tagged_and_in_the_union() -> None:
    tags = [cls.__struct_config__.tag for cls in MESSAGE_TYPES]
    assert len(set(tags)) == len(tags) == 26
    assert set(REQUEST_TYPES) <= set(MESSAGE_TYPES)
    for cls in REQUEST_TYPES:
        assert cls.__struct_fields__[0] == "req", cls


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda cls: cls.__name__)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_every_message_type_round_trips_through_the_frame_codec(cls: type, data: Any) -> None:
    message = data.draw(struct_strategy(cls))
    frame = m.decode_frame(m.encode_frame(3, 7, [message]))
    assert (frame.version, frame.incarnation, frame.epoch) == (m.FRAME_VERSION, 3, 7)
    assert frame.messages == [message] and type(frame.messages[0]) is cls


@settings(max_examples=100, deadline=None)
@given(st.lists(any_message, max_size=12))
def test_a_frame_of_mixed_messages_keeps_their_order(messages: list[Any]) -> None:
    assert m.decode_frame(m.encode_frame(1, 2, messages)).messages == messages


def test_the_wire_form_is_a_tagged_array() -> None:
    """Compact as the lists it replaced: the tag first, then the fields in order."""
    raw = msgspec.msgpack.decode(m.encode_frame(1, 5, [m.Dlv(4, [m.DlvEntry("t", b"p", 1, [2],
                                                                            False)])], 9))
    # The trailing fields: shares (none here), then the MQTT 5 properties a 3.1.1 message
    # does not have, the RETAIN flag it was published with, a tracked copy's witness and
    # the QoS 2 identity (``mid``) a QoS 1 message does not have.  The frame's own last
    # field is its number in the link session (cluster/replay.py).
    assert raw == [m.FRAME_VERSION, 1, 5, [["dlv", 4, [["t", b"p", 1, [2], False, "", False, 0,
                                                       None, False, "", 0]]]], 9]


def test_entries_of_senders_without_witnesses_still_decode() -> None:
    """``DlvEntry.witness`` and ``SharedDone.origin`` are optional trailing fields: a frame
    without them (an older node of the same version) decodes with their defaults."""
    raw = msgspec.msgpack.encode([m.FRAME_VERSION, 1, 5, [
        ["dlv", 4, [["t", b"p", 1, [], True, "$share/g/t", False, 9, None, False]]],
        ["shdone", [9]]]])
    dlv, done = m.decode_frame(raw).messages
    assert dlv.entries[0].witness == "" and dlv.entries[0].track == 9
    assert done == m.SharedDone([9]) and done.origin == ""


def _raw_frame(*messages: Any, version: int = m.FRAME_VERSION, incarnation: Any = 1) -> bytes:
    return msgspec.msgpack.encode([version, incarnation, 1, list(messages)])


BAD_FRAMES = {
    "unknown-tag": _raw_frame(["nope", 1, 2]),
    "wrong-field-type": _raw_frame(["dlv", 0, [["t", "not bytes", 0, []]]]),
    "qos-out-of-range": _raw_frame(["pub", 0, [["t", b"", 3, False]], "a", 1, 1]),
    "sack-unknown-packet-type": _raw_frame(["sack", "c", "a:1", 6, 1]),
    "missing-field": _raw_frame(["skick", "c"]),
    "message-not-an-array": _raw_frame({"kind": "dlv"}),
    "incarnation-not-int": _raw_frame(incarnation="1"),
    "other-version": _raw_frame(["rpull"], version=m.FRAME_VERSION + 1),
    "old-map-frame": msgspec.msgpack.encode({"b": [["rpull"]], "i": 1, "e": 1}),
    "garbage": b"\xc1\x00",
    "truncated": m.encode_frame(1, 1, [m.RoutePull()])[:-1],
}


@pytest.mark.parametrize("payload", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_a_frame_that_is_not_ours_raises_peer_protocol_error(payload: bytes) -> None:
    with pytest.raises(PeerProtocolError):
        m.decode_frame(payload)


def test_another_version_is_named_as_such() -> None:
    with pytest.raises(PeerProtocolError, match="version"):
        m.decode_frame(_raw_frame(["rpull"], version=1))
    with pytest.raises(PeerProtocolError, match="version"):
        m.decode_frame(_raw_frame(["no such tag"], version=99))


def test_peer_protocol_error_closes_the_link_by_the_rpc_path() -> None:
    assert issubclass(PeerProtocolError, ProtocolError)


# -- Links: requests and the receiving end -------------------------------------------------


def make_links(handler: Any = None) -> Links:
    return Links("me", b"k" * 32, handler or (lambda node, msg: None))


def test_a_request_gets_its_id_in_a_copy_not_by_slot() -> None:
    message = m.CatchUp(0, 3, "queues", b"")
    numbered = msgspec.structs.replace(message, req=17)
    assert (message.req, numbered.req, numbered.shard) == (0, 17, 3)


async def _serve(links: Links, *payloads: bytes) -> Exception | None:
    """Feed ``payloads`` as frames to ``serve_stream``; what it raised (None at EOF)."""
    return (await serve_frames(links, list(payloads)))[0]


async def test_a_bad_frame_is_counted_and_closes_the_link_after_the_good_ones(
        autojump_clock: trio.abc.Clock) -> None:
    got: list[tuple[str, Any]] = []
    links = make_links(lambda node, msg: got.append((node, msg)))
    good = m.encode_frame(0, 0, [m.RoutePull(), m.SessionKick(0, "c", "a:1")], 1)
    error = await _serve(links, good, BAD_FRAMES["unknown-tag"],
                         m.encode_frame(0, 0, [m.RoutePull()], 3))
    assert isinstance(error, PeerProtocolError)
    assert got == [("peer", m.RoutePull()), ("peer", m.SessionKick(0, "c", "a:1"))]
    assert links.protocol_errors == {"peer": 1} and links.received_messages == 2


async def test_a_message_whose_content_fails_its_checks_is_a_protocol_error(
        autojump_clock: trio.abc.Clock) -> None:
    def handler(node: str, msg: Any) -> None:
        raise ValueError("QoS 0 batch index does not cover its blob")

    links = make_links(handler)
    error = await _serve(links, m.encode_frame(0, 0, [m.Batch(b"\x30\x02\x00\x00", 1, [])], 1))
    assert isinstance(error, PeerProtocolError) and "Batch" in str(error)
    assert links.protocol_errors == {"peer": 1}


async def test_a_fenced_off_frame_is_refused_not_a_protocol_error(
        autojump_clock: trio.abc.Clock) -> None:
    got: list[Any] = []
    links = Links("me", b"k" * 32, lambda node, msg: got.append(msg),
                  admit=lambda node, inc, epoch: inc >= 2)
    error, acks = await serve_frames(links, [m.encode_frame(1, 0, [m.RoutePull()], 1)])
    assert error is None and got == []  # never applied; the link goes on
    assert acks == [1]  # acknowledged, so that it is not replayed
    assert links.refused_frames == 1 and links.protocol_errors == {}


async def test_an_ack_wakes_its_request_with_the_typed_body(
        autojump_clock: trio.abc.Clock) -> None:
    links = make_links()
    pending = links._pending[5] = _Pending("peer")
    rows = m.ShardRows([(b"k", {"v": 1})])
    await _serve(links, m.encode_frame(0, 0, [m.Ack(5, True, rows)], 1))
    assert pending.done.is_set() and pending.ok and pending.result == rows


# -- DataPlane dispatch ---------------------------------------------------------------------


class _Anything:
    """Any attribute, at any depth (``sessions.relay.on_sack``), is a do-nothing handler."""

    def __getattr__(self, name: str) -> Any:
        return _Anything()

    def __call__(self, *args: Any) -> None:
        return None


def test_the_dispatch_table_covers_every_message_but_ack() -> None:
    plane = object.__new__(DataPlane)  # only the parts the table binds
    plane.router = plane.sessions = plane.replicator = plane.deliveries = _Anything()  # type: ignore[assignment]
    table = DataPlane._dispatch_table(plane)
    assert set(table) == set(MESSAGE_TYPES) - {m.Ack}


@pytest.mark.parametrize("kind", ["ssub", "sunsub"])
def test_a_forwarded_filter_no_client_could_send_is_bad_content(kind: str) -> None:
    """The home applies a forwarded SUBSCRIBE/UNSUBSCRIBE inline, in the link's reader: a
    filter the edge's decoder would have refused is a peer's bad content (``ValueError``,
    the link closes), never registered."""
    from types import SimpleNamespace

    from mqttring.cluster.relay import SessionProxy, SessionRelay
    from mqttring.protocol.session import Session

    session = Session("c", False)
    core = SimpleNamespace(sessions={"c": session}, subscriptions=_Anything())
    relay = SessionRelay(core, make_links())  # type: ignore[arg-type]
    relay.proxies["c"] = SessionProxy(make_links(), "edge", "c", "edge:1")
    bad = "a/#/b"
    message = (m.SessionSubscribe(0, "c", "edge:1", 1, [(bad, 1)], None, 0) if kind == "ssub"
               else m.SessionUnsubscribe(0, "c", "edge:1", 1, [bad]))
    with pytest.raises(ValueError, match="forwarded filter"):
        (relay.on_ssub if kind == "ssub" else relay.on_sunsub)("edge", message)  # type: ignore[operator]
    assert session.subscriptions == {}


async def test_an_answer_for_a_connection_taken_over_meanwhile_is_not_written() -> None:
    """A persistent session away from its home: its UNSUBSCRIBE's answer waits for a
    durable write; meanwhile a client of the other protocol version takes the session
    over.  The UNSUBACK built for the first connection must not go into the second one's
    bytes (a probe: ``not an MQTT packet: UnsubAck5`` or ``'SubAck' object has no
    attribute 'reason_code'``, an ERROR each, the new client closed)."""
    from types import SimpleNamespace

    from mqttring.cluster.relay import SessionProxy, SessionRelay
    from mqttring.protocol.session import Session
    from mqttring.protocol.session5 import V5Session

    session = Session("c", True)
    session.subscriptions["a/b"] = 1
    stored = trio.Event()

    async def save_subscriptions(*args: Any) -> None:
        await stored.wait()

    core = SimpleNamespace(
        sessions={"c": session}, wakers={},
        subscriptions=SimpleNamespace(unregister=lambda s, topics: [0] * len(topics)),
        session_store=SimpleNamespace(save_subscriptions=save_subscriptions))
    replies: list[tuple[Any, ...]] = []
    links = make_links()
    links.reply = lambda *args: replies.append(args)  # type: ignore[method-assign]
    relay = SessionRelay(core, links)  # type: ignore[arg-type]
    first = relay.proxies["c"] = SessionProxy(links, "edge", "c", "edge:1")
    session.attach(first.output)  # a 3.1.1 client
    finish = relay.on_sunsub("edge", m.SessionUnsubscribe(7, "c", "edge:1", 1, ["a/b"]))
    assert finish is not None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(finish)
        await trio.testing.wait_all_tasks_blocked()
        # Taken over by an MQTT 5 client through another edge.
        relay.detach_proxy("c", "edge:1")
        second = relay.proxies["c"] = SessionProxy(links, "edge2", "c", "edge2:1")
        session.v5 = V5Session("c")
        session.attach(second.output)
        stored.set()
    assert second.output == bytearray()
    assert replies and replies[-1][:3] == ("edge", 7, False)
