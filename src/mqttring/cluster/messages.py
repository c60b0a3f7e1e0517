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
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from mqttring.cluster.errors import PeerProtocolError

#: Version of the frame format; a frame of any other version is refused.  Version 1 was the
#: untyped map of positional lists; version 2 had a ``Dlv`` that was refused whole when the
#: receiver lacked one of its session shards (version 3 delivers the rest, see ``Dlv``);
#: version 3 carried one message per ``Pub``/``Dlv`` (version 4 carries batches); version 4
#: had no shared subscriptions (a version 4 node would take a share's ``DlvEntry`` for an
#: ordinary one and know neither ``Redispatch`` nor ``SharedDone``).
#: Nodes of different versions refuse each other's links.
FRAME_VERSION = 5

QoS = Annotated[int, msgspec.Meta(ge=0, le=2)]
#: A route as the route table keys it: (topic filter, target: a node id or ``s:<shard>``).
RouteKey: TypeAlias = tuple[str, str]
#: The MQTT 5 properties of a message (``session5.PublishProps.to_wire()``): forwarded
#: property bytes, message expiry deadline (wall-clock UNIX seconds, 0: none), publisher's
#: client id (No Local).  None for a 3.1.1 message (one msgpack nil on the wire: msgspec
#: does not omit defaults of array-like structs).
Props: TypeAlias = tuple[bytes, float, str]


class WireMessage(msgspec.Struct, array_like=True, gc=False):
    """Base of every link message: the codec options live here, once.

    ``gc=False``: messages hold only strings, bytes, numbers and lists of them, never a
    reference back, so the cycle collector need not track the thousands per second the
    links carry.
    """


class _Frozen(WireMessage, frozen=True):
    """A message never changed after it is built (all but ``Batch``)."""


class WillSpec(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A client's will as the will keepers hold it (``mqttring.protocol.packets.Will``).

    ``props`` and ``delay`` are MQTT 5's: the will properties as encoded in a CONNECT (the
    Will Delay Interval in them already bounded by the session expiry), and that delay in
    seconds (for logs and readers that do not decode the properties); None and 0 for a
    3.1.1 will."""

    topic: str
    payload: bytes
    qos: QoS
    retain: bool
    props: bytes | None = None
    delay: int = 0


# -- publish routing (``mqttring.cluster.router``) --------------------------------------------


class PubEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One application message of a ``Pub``, as its publisher sent it (``props``: MQTT 5
    properties, None for a 3.1.1 message)."""

    topic: str
    payload: bytes
    qos: QoS
    retain: bool
    props: Props | None = None


class Pub(_Frozen, tag="pub"):
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


class Dlv(_Frozen, tag="dlv"):
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


class Redispatch(_Frozen, tag="shre"):
    """A node where a member of a share ended (its session closed, clean) with copies it had
    not acknowledged -> the owner of their topics' shards: give each to another member of
    its share (``mqttring.cluster.shared``).  The receiver dispatches them as it would a
    publish, for that share only, and answers once each is placed (or no member is left);
    it passes on, by its own view, what it does not own."""

    req: int
    entries: list[SharedEntry]


class SharedDone(_Frozen, tag="shdone"):
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


class ShareTrack(_Frozen, tag="shtrack"):
    """The owner of topics -> their witness (``mqttring.cluster.witness``): it placed these
    copies with clean members on node ``member``, which hold them unacknowledged.  Sent in
    the round that places them; the owner acknowledges the publisher only once this is
    answered.  The receiver records them (bounded) and answers; it forgets each when told
    it is gone (``SharedDone`` naming the sender as ``origin``), and places them again
    (through the topic's owner) if the sender and ``member`` both leave the view first."""

    req: int
    member: str
    entries: list[TrackedEntry]


# -- routes (``mqttring.cluster.routes``, anti-entropy in ``router``) ------------------------


class RouteAdd(_Frozen, tag="radd"):
    """A node with a new local subscription -> every node that must hold its route (the
    replicas of the filter's shard, or every live node for a wildcard filter).

    The receiver adds ``(topic_filter, target)`` registered by the sender and answers; the
    subscriber's SUBACK waits for that answer.
    """

    req: int
    topic_filter: str
    target: str


class RouteDel(_Frozen, tag="rdel"):
    """Like ``RouteAdd``, when the last local subscription of a filter goes: the receiver
    removes the sender's registration of the route (others' stay) and answers."""

    req: int
    topic_filter: str
    target: str


class RouteSync(_Frozen, tag="rsync"):
    """Every node -> each live peer, after every view change and link (re)connection, and
    on ``RoutePull``: the full set of routes the peer should hold for the sender.

    The receiver replaces exactly what the sender had registered with it in its own name,
    and, for each session shard in ``homes`` (those the sender is the loaded home of), what
    is registered in that home's name (``registrar_for``); it records that the sender's
    routes are complete as of ``epoch`` (``RouteRegistry.routes_complete``).
    """

    epoch: int
    routes: list[RouteKey]
    homes: list[int]


class RouteDigest(_Frozen, tag="rdig"):
    """Every node -> each live peer, every ``route_sync_interval``: a digest of the route set
    the peer should hold for the sender; the receiver answers ``RoutePull`` if its own copy
    has another digest."""

    epoch: int
    digest: int
    #: The session shards the sender is the loaded home of (their routes are in ``digest``).
    homes: list[int]


class RoutePull(_Frozen, tag="rpull"):
    """The answer to a ``RouteDigest`` that did not match: the receiver sends ``RouteSync``."""


class Handoff(_Frozen, tag="hoff"):
    """New owner of shards -> their previous owner, still alive: confirm you let go.

    The receiver answers once its view has reached ``epoch`` (so it takes no more
    deliveries for the shards' sessions) and none of its durable writes to them is in
    flight; only then does the new owner load the shards' sessions
    (``DataPlane._take_over``), so nothing the old owner acknowledged is missing from them.
    """

    req: int
    shards: list[int]
    epoch: int


class RetainedQuery(_Frozen, tag="retq"):
    """A node whose client subscribed -> the owners that may hold matching retained
    messages: the receiver answers with ``RetainedRows`` of the shards it owns."""

    req: int
    topic_filter: str


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


class Repl(_Frozen, tag="repl"):
    """Owner of shards -> each other replica of them: apply these writes.

    The receiver writes them (durably if ``durable``), keeps its in-memory mirrors in step,
    and answers when ``req`` is set; the owner's durable write waits for every answer.
    """

    req: int
    shards: list[ShardOps]
    durable: bool


class CatchUp(_Frozen, tag="cu"):
    """A node catching up on a shard -> its owner: the next chunk of ``db`` rows of
    ``shard`` after key ``after`` (empty: from the start).  The receiver answers with
    ``ShardRows`` (fewer than a chunk means the end)."""

    req: int
    shard: int
    db: str
    after: bytes


# -- sessions (``mqttring.cluster.sessions``) ------------------------------------------------


class V5Client(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What the home of an MQTT 5 client's persistent session needs from its CONNECT to
    run the session: the client's Maximum Packet Size (0: none) and Receive Maximum (the
    inflight window towards it), and whether it asked for a Clean Start (with a session
    to keep: the old one is discarded, the new one kept)."""

    max_packet_size: int
    receive_maximum: int
    clean_start: bool
    #: Clean Start 0 with a Session Expiry Interval of 0 (``resume_until_close``): resume
    #: the kept session if there is one, else start a persistent one; either ends when this
    #: connection closes (the edge's ``SessionClose`` says expiry 0).  False from older
    #: senders, which asked for a clean session instead.
    until_close: bool = False
    #: Outbound topic aliases the home may use on this connection (the client's maximum
    #: capped by the edge's ``topic_alias_maximum_out``), and the client's Request Problem
    #: Information (reason strings in the SUBACKs the home encodes).
    topic_alias_maximum: int = 0
    problem_info: bool = True


class SessionOpen(_Frozen, tag="sopen"):
    """Edge -> home of a client id, on CONNECT (and again with the same token when the home
    moves under a live clean session).

    The home serializes registrations of one id, takes over any other connection with it
    (``SessionKick``, publishes its will), keeps the will, binds the session and answers
    ``SessionOpened``; a fenced home refuses.
    """

    req: int
    client_id: str
    edge: str
    token: str
    clean: bool
    will: WillSpec | None
    #: The CONNECT's username: the home applies the ACL (``acl_file``, the same on every
    #: node) to what it delivers to a persistent session.  Defaults for older senders.
    username: str | None = None
    #: MQTT 5: the client speaks v5 (the home encodes its session's output as v5); None
    #: for a 3.1.1 client.
    v5: V5Client | None = None


class SessionClose(_Frozen, tag="sclose"):
    """Edge -> home when a connection ends: unregister it if ``token`` is still the
    registered one, and publish its will if ``publish_will`` (no clean DISCONNECT)."""

    client_id: str
    token: str
    publish_will: bool
    #: MQTT 5: the Session Expiry Interval in force when the connection ended (CONNECT's,
    #: or the one its DISCONNECT set); the home keeps the session that long.  None: 3.1.1.
    session_expiry: int | None = None


class SessionKick(_Frozen, tag="skick"):
    """Home -> the edge of a connection that was taken over (or whose session's home shed
    it as a slow consumer): close connection ``token`` (its will is the home's to publish),
    then answer.  The home lets the new connection
    in only after that answer, or once the view declares the edge down (a cut-off edge
    has fenced itself by then): never two live connections for one client id."""

    req: int
    client_id: str
    token: str
    #: MQTT 5: the DISCONNECT reason the edge tells the client: 0x8E "session taken over"
    #: (also what older senders meant), 0x97 a slow consumer shed by its home.
    reason_code: int = 0x8E


class WillRegister(_Frozen, tag="wreg"):
    """Home -> the other replicas of a client's shard, on every registration (and to a new
    replica): keep this copy, so the will outlives the home."""

    client_id: str
    node: str
    token: str
    will: WillSpec | None
    clean: bool


class WillDelete(_Frozen, tag="wdel"):
    """Home -> the other replicas: forget the copy if ``token`` is still the one held."""

    client_id: str
    token: str


class SessionBytes(_Frozen, tag="sbytes"):
    """Home of a persistent session -> the edge its client is connected to: the session's
    encoded output; the edge appends it to connection ``token``'s output, if still open."""

    client_id: str
    token: str
    data: bytes


class SessionAck(_Frozen, tag="sack"):
    """Edge -> home: the client acknowledged an outbound message; the home applies it to the
    session machine (``packet_type``: 4 PUBACK, 5 PUBREC, 7 PUBCOMP)."""

    client_id: str
    token: str
    packet_type: Literal[4, 5, 7]
    packet_id: int


class InboundQos2(_Frozen, tag="q2"):
    """Edge -> home: inbound QoS 2 packet ids begun (True) or released (False) by the
    client; the home stores them (durably and answering when ``req`` is set)."""

    req: int
    client_id: str
    token: str
    changes: list[tuple[int, bool]]


class SessionSubscribe(_Frozen, tag="ssub"):
    """Edge -> home: the client's SUBSCRIBE; the home subscribes the session, writes the
    SUBACK and then the retained messages into the session's byte stream."""

    client_id: str
    token: str
    packet_id: int
    topics: list[tuple[str, int]]
    #: MQTT 5: the subscription options byte of each filter, and the subscription
    #: identifier (0: none); the home answers with a v5 SUBACK.  None for 3.1.1.
    options: list[int] | None = None
    subscription_id: int = 0


class SessionUnsubscribe(_Frozen, tag="sunsub"):
    """Edge -> home: the client's UNSUBSCRIBE; the home unsubscribes and writes UNSUBACK."""

    client_id: str
    token: str
    packet_id: int
    topics: list[str]


# -- answers ----------------------------------------------------------------------------------


class RetainedRow(msgspec.Struct, array_like=True, frozen=True, gc=False):
    topic: str
    payload: bytes
    qos: QoS
    #: MQTT 5 properties; None for a 3.1.1 message.
    props: Props | None = None


class RetainedRows(_Frozen, tag="retained"):
    """The answer to ``RetainedQuery``."""

    rows: list[RetainedRow]


class ShardRows(_Frozen, tag="rows"):
    """The answer to ``CatchUp``: ``(key, value)`` rows in key order (values as in
    ``StoredOp``)."""

    rows: list[tuple[bytes, Any]]


class SessionOpened(_Frozen, tag="opened"):
    """The answer to ``SessionOpen``: what the edge's stand-in of a persistent session
    needs (empty for a clean session)."""

    present: bool
    subscriptions: list[tuple[str, int]]
    inbound_qos2: list[int]
    #: The v5 subscription options the home keeps while a 3.1.1 client holds the session
    #: (``Session.kept_options``): the edge tags the client's publishes with its id when
    #: any says No Local, so the home can tell the client's own messages.
    kept_options: list[tuple[str, int]] | None = None


#: What an ``Ack`` may carry besides a refusal's reason.
class Delivered(_Frozen, tag="delivered"):
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


class Ack(_Frozen, tag="ack"):
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
    | CatchUp | SessionOpen | SessionKick | InboundQos2
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


class _FrameHead(msgspec.Struct, array_like=True):
    """The version alone, to say why a frame that did not decode was refused."""

    version: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)
_head_decoder = msgspec.msgpack.Decoder(_FrameHead)


def encode_frame(incarnation: int, epoch: int, messages: list[Any]) -> bytes:
    """The bytes of one link frame carrying ``messages``."""
    return _encoder.encode(Frame(FRAME_VERSION, incarnation, epoch, messages))


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
    "WillDelete",
    "WillRegister",
    "WillSpec",
    "WireMessage",
    "decode_frame",
    "encode_frame",
]
