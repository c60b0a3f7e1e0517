"""Link messages between a client's edge and its session's home, and for its will.

A persistent session lives at its home (the owner of its shard) while its client is
connected to any node (the edge): ``mqttring.cluster.sessions`` sends these to open, drive
and close the session remotely, and to register and withdraw the client's will with the
will keepers.  They are apart from ``mqttring.cluster.messages`` (which re-exports them
and holds the ``LinkMessage`` union and the frame codec) because they are one conversation
of their own, and one module of every message type would be two files' worth.  Same rules
as there: each docstring says who sends it, when, and what the receiver must do.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mqttring.cluster.messages_base import FrozenMessage, QoS


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
    #: The client's Session Expiry Interval at CONNECT (``Session.cut_expiry``: 0 for
    #: never), which the home stores to count from should the edge die with the client
    #: connected.  0 from older senders.
    cut_expiry: int = 0


class SessionOpen(FrozenMessage, tag="sopen"):
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


class SessionClose(FrozenMessage, tag="sclose"):
    """Edge -> home when a connection ends: unregister it if ``token`` is still the
    registered one, and publish its will if ``publish_will`` (no clean DISCONNECT); then
    answer.  A node that is not the client's home in its view refuses it: the edge asks
    again by its newer view, until the home that holds the registration answers (a close
    sent to a home that dies would otherwise leave the registration live at the replica
    that takes over, and its will unpublished)."""

    req: int
    client_id: str
    token: str
    publish_will: bool
    #: MQTT 5: the Session Expiry Interval in force when the connection ended (CONNECT's,
    #: or the one its DISCONNECT set); the home keeps the session that long.  None: 3.1.1.
    session_expiry: int | None = None
    #: When the connection ended (wall clock, the edge's): a Will Delay Interval runs from
    #: then, however late the close reaches the home.  None: when it arrives.
    closed_at: float | None = None
    #: The will waits at least this many seconds (the edge closed the connection because
    #: the session moved: ``ClusterSessions.kick_moved``).
    will_delay_at_least: float = 0.0
    #: MQTT 5: the will's delay as the connection ended: its Will Delay Interval bounded by
    #: ``session_expiry`` (a DISCONNECT may have changed that since the registration, which
    #: holds the delay bounded by CONNECT's).  None: the registered will's own.
    will_delay: int | None = None
    #: The connection was never accepted at its edge (it closed, or its edge gave up,
    #: while its ``sopen`` was on its way or being answered): no will is owed.  A home
    #: that does not hold ``token`` yet remembers it for a while and refuses that
    #: ``sopen`` if it comes later (the two run as separate tasks, in either order), or
    #: it would attach the session to a connection that no longer exists.
    abandoned: bool = False


class SessionKick(FrozenMessage, tag="skick"):
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


class WillRegister(FrozenMessage, tag="wreg"):
    """Home -> the other replicas of a client's shard, on every registration (and to a new
    replica): keep this copy, so the will outlives the home.  ``due`` (wall-clock seconds):
    the connection closed and its MQTT 5 will waits for its Will Delay Interval until then;
    a replica promoted to home publishes it then unless the client id reconnects.
    ``username``: the CONNECT's, so that whoever publishes the will checks its topic
    against the ACL as it is then."""

    client_id: str
    node: str
    token: str
    will: WillSpec | None
    clean: bool
    due: float | None = None
    username: str | None = None


class WillDelete(FrozenMessage, tag="wdel"):
    """Home -> the other replicas: forget the copy if ``token`` is still the one held."""

    client_id: str
    token: str


class SessionBytes(FrozenMessage, tag="sbytes"):
    """Home of a persistent session -> the edge its client is connected to: the session's
    encoded output; the edge appends it to connection ``token``'s output, if still open."""

    client_id: str
    token: str
    data: bytes


class SessionAck(FrozenMessage, tag="sack"):
    """Edge -> home: the client acknowledged an outbound message; the home applies it to the
    session machine (``packet_type``: 4 PUBACK, 5 PUBREC, 7 PUBCOMP).  ``failed``: an MQTT
    5 PUBREC with a failure reason code (>= 0x80), which ends that QoS 2 delivery
    (section 4.3.3: no PUBREL, the packet id and the window slot are free)."""

    client_id: str
    token: str
    packet_type: Literal[4, 5, 7]
    packet_id: int
    failed: bool = False


class InboundQos2(FrozenMessage, tag="q2"):
    """Edge -> home: inbound QoS 2 packet ids the client began (-> the message's ``mid``,
    before it is routed), had acknowledged (-> 0) or released (-> None); the home stores
    them (durably and answering when ``req`` is set)."""

    req: int
    client_id: str
    token: str
    changes: list[tuple[int, int | None]]


class SessionSubscribe(FrozenMessage, tag="ssub"):
    """Edge -> home: the client's SUBSCRIBE; the home subscribes the session (as it
    arrives), writes the SUBACK and then the retained messages into the session's byte
    stream (in arrival order), then answers ``req``: the edge, which got those bytes first
    (one link is one FIFO), lets the client's next packets be answered only then."""

    req: int
    client_id: str
    token: str
    packet_id: int
    topics: list[tuple[str, int]]
    #: MQTT 5: the subscription options byte of each filter, and the subscription
    #: identifier (0: none); the home answers with a v5 SUBACK.  None for 3.1.1.
    options: list[int] | None = None
    subscription_id: int = 0


class SessionUnsubscribe(FrozenMessage, tag="sunsub"):
    """Edge -> home: the client's UNSUBSCRIBE; the home unsubscribes, writes UNSUBACK, then
    answers ``req`` (as ``SessionSubscribe``)."""

    req: int
    client_id: str
    token: str
    packet_id: int
    topics: list[str]


# -- answers ----------------------------------------------------------------------------------


class SessionOpened(FrozenMessage, tag="opened"):
    """The answer to ``SessionOpen``: what the edge's stand-in of a persistent session
    needs (empty for a clean session)."""

    present: bool
    subscriptions: list[tuple[str, int]]
    #: (packet id, ``mid``: 0 once acknowledged) of the inbound QoS 2 ids not released.
    inbound_qos2: list[tuple[int, int]]
    #: The v5 subscription options the home keeps while a 3.1.1 client holds the session
    #: (``Session.kept_options``): the edge tags the client's publishes with its id when
    #: any says No Local, so the home can tell the client's own messages.
    kept_options: list[tuple[str, int]] | None = None


__all__ = [
    "InboundQos2",
    "SessionAck",
    "SessionBytes",
    "SessionClose",
    "SessionKick",
    "SessionOpen",
    "SessionOpened",
    "SessionSubscribe",
    "SessionUnsubscribe",
    "V5Client",
    "WillDelete",
    "WillRegister",
    "WillSpec",
]
