"""Every message that travels on a cluster data link, as types, and the one codec for them.

Why types: a message used to be a positional msgpack list unpacked by hand at the receiver,
so a field added at one end broke the other silently, and a malformed message surfaced as an
``IndexError`` somewhere in a handler.  Here each message is a ``msgspec.Struct``: the link
decodes a whole frame against these definitions before anything is applied, so a frame that
does not match (another version, an unknown tag, a field of the wrong type) is refused as a
whole with ``PeerProtocolError``, and a handler only ever sees a well-formed message of the
one type it handles (``DataPlane`` dispatches by type).

Wire form: every message is ``array_like`` and tagged, so on the wire it is still a compact
msgpack array whose first element names the kind (``["pub", req, topic, ...]``): the same
bytes the lists had, but now checked.  The frame around them is a ``Frame`` (version, the
sender's incarnation and view epoch for fencing, the messages).

Requests carry ``req`` (0 for a message nobody answers); ``Links.request`` fills it with
``msgspec.structs.replace`` and the peer answers with an ``Ack`` naming it.  Messages are
frozen, except the packed QoS 0 ``Batch``, which ``wire.append`` grows in place while it sits
at the tail of a link queue (the hot path: no copy per PUBLISH).

Each docstring says who sends the message, when, and what the receiver must do; the same
table is in docs/design.md ("Messages on the data links").

Layout: the messages between a session's edge and its home, and the will messages, are in
``mqttring.cluster.messages_sessions``; the base class and shared field types in
``mqttring.cluster.messages_base``.  This module imports and re-exports them, so every
message is still named ``mqttring.cluster.messages.X``, and it alone holds the
``LinkMessage`` union, the ``Frame`` and its codec: the wire format is defined here once.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

from mqttring.cluster.errors import PeerProtocolError
from mqttring.cluster.messages_base import FrozenMessage, Props, QoS, RouteKey, WireMessage
from mqttring.cluster.messages_sessions import (
    InboundQos2,
    SessionAck,
    SessionBytes,
    SessionClose,
    SessionKick,
    SessionOpen,
    SessionOpened,
    SessionSubscribe,
    SessionUnsubscribe,
    V5Client,
    WillDelete,
    WillRegister,
    WillSpec,
)

#: Version of the frame format; a frame of any other version is refused.  Version 1 was the
#: untyped map of positional lists; version 2 had a ``Dlv`` that was refused whole when the
#: receiver lacked one of its session shards (version 3 delivers the rest, see ``Dlv``);
#: version 3 carried one message per ``Pub``/``Dlv`` (version 4 carries batches); version 4
#: had no shared subscriptions (a version 4 node would take a share's ``DlvEntry`` for an
#: ordinary one and know neither ``Redispatch`` nor ``SharedDone``); version 5 sent a route
#: set in one ``RouteSync`` whatever its size (version 6 sends it in parts); version 6
#: frames were not numbered (version 7 numbers them for replay, ``cluster/replay.py``);
#: version 7 had no ``mid`` in ``PubEntry``/``DlvEntry`` (QoS 2 copies made by retries);
#: version 8 carried inbound QoS 2 ids without their messages' ``mid`` (``InboundQos2``,
#: ``SessionOpened``); version 9 had no view epochs in ``RetainedQuery``/``RetainedRows``;
#: version 10 nodes cannot read the marker rows of completed QoS 2 messages (``Completed``)
#: that replication and shard copies now carry.
#: Nodes of different versions refuse each other's links.
FRAME_VERSION = 11


# -- publish routing (``mqttring.cluster.router``) --------------------------------------------


class PubEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One application message of a ``Pub``, as its publisher sent it (``props``: MQTT 5
    properties, None for a 3.1.1 message)."""

    topic: str
    payload: bytes
    qos: QoS
    retain: bool
    props: Props | None = None
    #: ``Message.mid``: set by the edge on a QoS 2 publish, kept by every retry and hop.
    mid: int = 0


class Pub(FrozenMessage, tag="pub"):
    """Edge -> owner of the topics' shards: route these publishes (QoS >= 1, or RETAIN).

    One ``Pub`` carries what one connection had waiting (up to its ``publish_window``), in
    the order the client sent it, so QoS 1/2 cost one request and one answer per batch and
    per owner rather than per message.  Also sent by a node that got a ``Pub`` for shards it
    no longer owns (the view changed in flight), with ``hops`` incremented.  The receiver
    routes, in order, the messages it owns (``accept``) and passes the others on by its own
    view, refuses them past ``MAX_HOPS``, and, when ``req`` is set, answers once every node
    with subscribers accepted every message (a refusal covers the whole batch: the edge
    acknowledges none of it).  Plain QoS 0 first hops travel in a ``Batch`` instead.
    """

    req: int
    messages: list[PubEntry]
    #: The node that took the publishes from its client (for logs only).
    origin: str
    #: The sender's view epoch when it chose this owner (for logs only).
    epoch: int
    hops: int


class DlvEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One message of a ``Dlv`` and exactly which sessions of the receiver it is for: the
    receiver's clean sessions if ``clean``, and the persistent sessions of the session
    shards in ``shards`` (the receiver is their owner).  Each session gets one copy however
    many paths lead to it, which QoS 2 needs."""

    topic: str
    payload: bytes
    qos: QoS
    shards: list[int]
    clean: bool = True
    #: Set: the entry is for ONE member of this share (``$share/{group}/{filter}``) among
    #: the sessions named above, chosen by the receiver, online ones first; an offline
    #: (persistent) one only if ``offline_ok``.  Where it has none to give it to, the
    #: receiver says so in ``Delivered.declined`` and the sender tries another member.
    share: str = ""
    offline_ok: bool = False
    #: Non-zero: the sender keeps this copy until told it is gone (``SharedDone``), to
    #: place it again if the receiver dies first; the receiver watches the copy it gives a
    #: clean member.
    track: int = 0
    #: MQTT 5 properties; None for a 3.1.1 message.
    props: Props | None = None
    #: The RETAIN flag it was published with: a v5 subscription with Retain As Published
    #: forwards it (single-node brokers see the publish itself).  Older senders: False.
    retain: bool = False
    #: With ``track``: the node that records this copy too (``ShareTrack``); the receiver
    #: reports it gone there as well (``SharedDone`` naming the sender as ``origin``), so
    #: that it is placed again if the sender and the receiver die together.
    witness: str = ""
    #: ``Message.mid`` (0: none): a session takes a QoS 2 message of one identity once.
    mid: int = 0


class Dlv(FrozenMessage, tag="dlv"):
    """Owner -> a node with subscribers: deliver these, in order, to your local sessions;
    never route them again.

    A shard the receiver does not hold (still loading, or moved away in flight) is left out
    and named in the answer (``Delivered``), so the owner follows it to its current home
    while the rest, the clean sessions above all, are served at once.  With ``req`` set the
    receiver answers once the copies it queued for persistent sessions are stored (one
    group commit for the whole message).  A delivery to clean sessions only at QoS 0 travels
    in a ``Batch`` instead.
    """

    req: int
    entries: list[DlvEntry]


class Batch(WireMessage, tag="q0"):
    """Packed plain QoS 0 PUBLISHes, edge -> owner (ROUTE runs) and owner -> subscriber's
    node (DELIVER runs); format and checks in ``mqttring.cluster.wire``.

    The receiver routes each ROUTE run as the owner (re-sending it as ``Pub`` if it no longer
    owns the shard) and appends each DELIVER run to its clean sessions.  Nothing is answered.
    Only 3.1.1-encodable messages travel here: a message with MQTT 5 properties goes in a
    ``Pub``/``Dlv`` (whose entries carry them), never packed.
    Mutable on purpose: ``wire.append`` grows the batch at the tail of a link queue.
    """

    #: The PUBLISH frames back to back (a ``bytearray`` while it is being filled).
    blob: bytes
    #: PUBLISHes in ``blob``: the back-pressure count of this one message.
    count: int
    #: ``[section, topic, frames, bytes, ...]``: the runs, four entries each.
    index: list[int | str]


class SharedEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One message for one share (``Redispatch``)."""

    topic: str
    payload: bytes
    qos: QoS
    share: str
    props: Props | None = None


class Redispatch(FrozenMessage, tag="shre"):
    """A node where a member of a share ended (its session closed, clean) with copies it had
    not acknowledged -> the owner of their topics' shards: give each to another member of
    its share (``mqttring.cluster.shared``).  The receiver dispatches them as it would a
    publish, for that share only, and answers once each is placed (or no member is left);
    it passes on, by its own view, what it does not own."""

    req: int
    entries: list[SharedEntry]


class SharedDone(FrozenMessage, tag="shdone"):
    """A node -> the node that placed copies of shares with its clean members (``DlvEntry.
    track``): these copies are gone (acknowledged by the client, or handed back to the
    share when the member ended), sent in batches on a timer.  The receiver forgets them:
    it no longer places them again when the sender dies.  Never answered."""

    tokens: list[int]
    #: Set: the tokens are this node's, not the receiver's: the receiver is their witness
    #: (``ShareTrack``) and forgets its records of them.
    origin: str = ""


class TrackedEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One copy a witness records (``ShareTrack``): the owner's token and the message."""

    token: int
    topic: str
    payload: bytes
    qos: QoS
    share: str
    props: Props | None = None


class ShareTrack(FrozenMessage, tag="shtrack"):
    """The owner of topics -> their witness (``mqttring.cluster.witness``): it placed these
    copies with clean members on node ``member``, which hold them unacknowledged.  Sent in
    the round that places them; the owner acknowledges the publisher only once this is
    answered.  The receiver records them (bounded) and answers; it forgets each when told
    it is gone (``SharedDone`` naming the sender as ``origin``), and places them again
    (through the topic's owner) if the sender and ``member`` both leave the view first."""

    req: int
    member: str
    entries: list[TrackedEntry]


# -- routes (``mqttring.cluster.routes``, anti-entropy in ``registry``) ----------------------


class RouteAdd(FrozenMessage, tag="radd"):
    """A node with a new local subscription -> every node that must hold its route (the
    replicas of the filter's shard, or every live node for a wildcard filter).

    The receiver adds ``(topic_filter, target)`` registered by the sender and answers; the
    subscriber's SUBACK waits for that answer.
    """

    req: int
    topic_filter: str
    target: str


class RouteDel(FrozenMessage, tag="rdel"):
    """Like ``RouteAdd``, when the last local subscription of a filter goes: the receiver
    removes the sender's registration of the route (others' stay) and answers."""

    req: int
    topic_filter: str
    target: str


class RouteSync(FrozenMessage, tag="rsync"):
    """Every node -> each live peer, after every view change and link (re)connection, and
    on ``RoutePull``: the full set of routes the peer should hold for the sender.

    The receiver replaces exactly what the sender had registered with it in its own name,
    and, for each session shard in ``homes`` (those the sender is the loaded home of), what
    is registered in that home's name (``registrar_for``); it records that the sender's
    routes are complete as of ``epoch`` (``RouteRegistry.routes_complete``).

    A set larger than half a link frame is sent in parts, numbered from 0, one after the
    other on the link; only the part marked ``last`` applies the whole set.  A part out of
    sequence (the link broke in between) discards what was gathered: the set is sent again
    after the reconnection, and a digest round asks for it otherwise.
    """

    epoch: int
    routes: list[RouteKey]
    homes: list[int]
    part: int = 0
    last: bool = True


class RouteDigest(FrozenMessage, tag="rdig"):
    """Every node -> each live peer, every ``route_sync_interval``: a digest of the route set
    the peer should hold for the sender; the receiver answers ``RoutePull`` if its own copy
    has another digest."""

    epoch: int
    digest: int
    #: The session shards the sender is the loaded home of (their routes are in ``digest``).
    homes: list[int]


class RoutePull(FrozenMessage, tag="rpull"):
    """The answer to a ``RouteDigest`` that did not match: the receiver sends ``RouteSync``."""


class Handoff(FrozenMessage, tag="hoff"):
    """New owner of shards -> their previous owner, still alive: confirm you let go.

    The receiver answers once its view has reached ``epoch`` (so it takes no more
    deliveries for the shards' sessions) and none of its durable writes to them is in
    flight; only then does the new owner load the shards' sessions
    (``DataPlane._take_over``), so nothing the old owner acknowledged is missing from them.
    """

    req: int
    shards: list[int]
    epoch: int


class RetainedQuery(FrozenMessage, tag="retq"):
    """A node whose client subscribed -> the owners that may hold matching retained
    messages: the receiver answers with ``RetainedRows`` of the shards it owns, in topic
    order, those after ``after``, as many as fit half a link frame.  Paged because an answer
    past the frame limit would be dropped, and the subscriber would miss every row of it."""

    req: int
    topic_filter: str
    #: The last topic of the previous page ("" for the first).
    after: str = ""
    #: The view the asker chose this node by: the answer waits until the receiver's view is
    #: at least as new (it would otherwise answer for the shards it owned before).
    epoch: int = 0


# -- shard replication (``mqttring.cluster.replication``) ------------------------------------


class StoredOp(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One replicated store operation: a put, or a delete when ``value`` is None.

    ``value`` is whatever the store holds (``mqttring.lsm.Put``: any msgpack-able object);
    its shape is the store's business, checked where the rows are read back.
    """

    db: str
    key: bytes
    value: Any


class ShardOps(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The operations of one shard in a ``Repl``."""

    shard: int
    ops: list[StoredOp]


class Repl(FrozenMessage, tag="repl"):
    """Owner of shards -> each other replica of them: apply these writes.

    The receiver writes them (durably if ``durable``), keeps its in-memory mirrors in step,
    and answers when ``req`` is set; the owner's durable write waits for every answer.
    """

    req: int
    shards: list[ShardOps]
    durable: bool


class CatchUp(FrozenMessage, tag="cu"):
    """A node catching up on a shard -> its owner: the next chunk of ``db`` rows of
    ``shard`` after key ``after`` (empty: from the start).  The receiver answers with
    ``ShardRows``, at most ``CATCH_UP_CHUNK`` rows and half a link frame of them."""

    req: int
    shard: int
    db: str
    after: bytes


# -- sessions and wills: ``mqttring.cluster.messages_sessions`` (imported above) --------------


# -- answers ----------------------------------------------------------------------------------


class RetainedRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    topic: str
    payload: bytes
    qos: QoS
    #: MQTT 5 properties; None for a 3.1.1 message.
    props: Props | None = None
    #: The message's identity (``Message.mid``; 0: none), so that a subscriber that got
    #: the message live already takes this copy as the same one.  (A trailing default:
    #: nodes without it ignore it, and its absence reads as 0.)
    mid: int = 0


class RetainedRows(FrozenMessage, tag="retained"):
    """The answer to ``RetainedQuery``."""

    rows: list[RetainedRow]
    #: More rows follow the last one: ask again with its topic as ``after``.
    more: bool = False
    #: The view the answer was made under (the shards it covers are those the answerer owns
    #: in it): newer than the asker's, and the asker asks again by the newer view.
    epoch: int = 0


class ShardRows(FrozenMessage, tag="rows"):
    """The answer to ``CatchUp``: ``(key, value)`` rows in key order (values as in
    ``StoredOp``)."""

    rows: list[tuple[bytes, Any]]
    #: More rows follow the last one: ask again after its key.
    more: bool = False


#: What an ``Ack`` may carry besides a refusal's reason.
class Delivered(FrozenMessage, tag="delivered"):
    """The answer to ``Dlv``: for each entry whose session shards the receiver did not all
    hold, (its index in ``entries``, those shards); their sessions got nothing, the owner
    delivers to them where they are now.  Empty in the common case."""

    unheld: list[tuple[int, list[int]]]
    #: For each share entry the receiver could not place: (its index, why: a
    #: ``mqttring.broker.shared.Placement``, no member here or only offline ones).
    declined: list[tuple[int, int]] = []
    #: For each share entry it placed: (its index, how many members could have taken it
    #: online), by which the sender weighs this node's turns (a fair share per member).
    online: list[tuple[int, int]] = []


Reply: TypeAlias = RetainedRows | ShardRows | SessionOpened | Delivered


class Ack(FrozenMessage, tag="ack"):
    """Any node -> the sender of a request (``req`` != 0): the answer to it.

    ``ok`` False means refused, ``body`` then says why.  Handled inside ``Links``: it wakes
    the waiting ``request``.  Never dropped (the requester waits for it).
    """

    req: int
    ok: bool
    body: Reply | str | None = None


#: Every message a link carries.
LinkMessage: TypeAlias = (
    Pub | Dlv | Batch | Redispatch | SharedDone | ShareTrack | RouteAdd | RouteDel | RouteSync
    | RouteDigest | RoutePull | Handoff | RetainedQuery | Repl | CatchUp | SessionOpen
    | SessionClose | SessionKick
    | WillRegister | WillDelete | SessionBytes | SessionAck | InboundQos2 | SessionSubscribe
    | SessionUnsubscribe | Ack
)
#: Messages sent with ``Links.request``: they carry ``req`` and get an ``Ack``.
Request: TypeAlias = (
    Pub | Dlv | Redispatch | ShareTrack | RouteAdd | RouteDel | Handoff | RetainedQuery | Repl
    | CatchUp | SessionOpen | SessionClose | SessionKick | InboundQos2 | SessionSubscribe
    | SessionUnsubscribe
)


class Frame(msgspec.Struct, array_like=True, gc=False):
    """One write on a link: the messages the writer had queued, stamped for fencing.

    The receiver refuses the whole frame (and closes the link) if ``version`` is not
    ``FRAME_VERSION`` or if ``admit(sender, incarnation)`` says the sender's life ended.
    """

    version: int
    incarnation: int
    epoch: int
    messages: list[LinkMessage]
    #: The frame's number in its link session (``cluster/replay.py``): frames are applied
    #: in order, once, and acknowledged by number.
    seq: int = 0


class _FrameHead(msgspec.Struct, array_like=True):
    """The version alone, to say why a frame that did not decode was refused."""

    version: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)
_head_decoder = msgspec.msgpack.Decoder(_FrameHead)


def encode_frame(incarnation: int, epoch: int, messages: list[Any], seq: int = 0) -> bytes:
    """The bytes of one link frame carrying ``messages``."""
    return _encoder.encode(Frame(FRAME_VERSION, incarnation, epoch, messages, seq))


def decode_frame(payload: bytes) -> Frame:
    """A received frame, checked against the types above; ``PeerProtocolError`` if it is not
    one of ours (never a half-applied frame: nothing is dispatched before this returns)."""
    try:
        frame = _decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        try:
            version = _head_decoder.decode(payload).version
        except msgspec.MsgspecError:
            version = None
        if version is not None and version != FRAME_VERSION:
            raise PeerProtocolError(
                f"frame version {version}, this node speaks {FRAME_VERSION}") from None
        raise PeerProtocolError(f"undecodable frame: {exc}") from None
    if frame.version != FRAME_VERSION:
        raise PeerProtocolError(f"frame version {frame.version}, this node speaks "
                                f"{FRAME_VERSION}")
    return frame


__all__ = [
    "FRAME_VERSION",
    "Ack",
    "Batch",
    "CatchUp",
    "Delivered",
    "Dlv",
    "DlvEntry",
    "Frame",
    "Handoff",
    "InboundQos2",
    "LinkMessage",
    "Pub",
    "PubEntry",
    "Redispatch",
    "Repl",
    "Reply",
    "Request",
    "RetainedQuery",
    "RetainedRow",
    "RetainedRows",
    "RouteAdd",
    "RouteDel",
    "RouteDigest",
    "RouteKey",
    "RoutePull",
    "RouteSync",
    "SessionAck",
    "SessionBytes",
    "SessionClose",
    "SessionKick",
    "SessionOpen",
    "SessionOpened",
    "SessionSubscribe",
    "SessionUnsubscribe",
    "ShardOps",
    "ShardRows",
    "ShareTrack",
    "SharedDone",
    "SharedEntry",
    "StoredOp",
    "TrackedEntry",
    "V5Client",
    "WillDelete",
    "WillRegister",
    "WillSpec",
    "WireMessage",
    "decode_frame",
    "encode_frame",
]
