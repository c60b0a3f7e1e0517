"""Persistent sessions served across nodes: the machine at the home, the client at an edge.

Theory of operation
-------------------
A persistent session lives at the home of its client id, always (``mqttring.cluster.sessions``
decides which node that is and holds the id's lock and will).  Its subscriptions route to the
home, which stores every queued QoS 1/2 message (replicated to the shard's replicas) and runs
the ``Session`` machine (windows, packet ids, DUP resends, QoS 2 state).  When the client is
connected to another node (the *edge*), this module relays between the two:

* **home -> edge.**  A ``SessionProxy`` is the session's waker at the home: it ships the
  encoded output to the edge (``sbytes``) and can ask the edge to close the connection
  (``skick``).
* **edge -> home.**  A ``RemoteSession`` is the edge's stand-in for the protocol machine.
  It forwards the client's PUBACK/PUBREC/PUBCOMP (``sack``), SUBSCRIBE/UNSUBSCRIBE
  (``ssub``/``sunsub``, answered by the home in the byte stream, so a SUBACK can never
  overtake nor follow the retained messages it announces, and then as requests, so the
  edge answers the client's later packets after it) and inbound QoS 2 ids (``q2``,
  durably before a PUBREC).

Every relayed message carries the connection's token; the home serves only the proxy of the
registered token, so a taken-over connection's late acknowledgements change nothing.  The
session is attached to a proxy only under the client id's lock, with that connection's
registration current (``ClusterSessions.on_sopen``; ``serve`` does not await), and a new
registration detaches any other proxy: the session never stays attached to a connection
that is gone (it would never expire, and would queue for it without bound).

Kept apart from the registrations because it is a different question: the lock and will
keeper decide *whether* a connection is the client id's live one; the relay only carries a
live connection's session bytes and acknowledgements, and does no locking of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

import trio

from mqttring.broker.sessions import SessionUnavailable
from mqttring.cluster.errors import PeerFailure, PeerUnavailable
from mqttring.cluster.links import Links
from mqttring.cluster.messages import (
    InboundQos2,
    SessionAck,
    SessionBytes,
    SessionKick,
    SessionOpen,
    SessionOpened,
    SessionSubscribe,
    SessionUnsubscribe,
)
from mqttring.lsm import Durability
from mqttring.protocol.codec import encode
from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.message import Message, new_mid
from mqttring.protocol.packets import SubAck, UnsubAck
from mqttring.protocol.packets5 import SubAck5, UnsubAck5
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import ClientLimits5, retained_wanted
from mqttring.protocol.topics import validate_topic_filter

if TYPE_CHECKING:
    from mqttring.broker.core import BrokerCore

log = logging.getLogger("mqttring.cluster.relay")


class RemoteSession(Session):
    """Edge-side stand-in for a persistent session whose home is another node.

    The protocol machine at the edge talks to it like to any session; it does no I/O of its
    own.  What the client acknowledges (PUBACK, PUBREC, PUBCOMP) is handed at once to
    ``on_ack`` (``SessionRelay`` forwards it to the home, whose window it frees); the
    inbound QoS 2 ids the client opens, has acknowledged and releases are recorded as
    changes, which ``ClusterSessions.persist`` has the relay forward (an id and its message's
    identity durably before the message is routed, ``Session.begin_inbound_qos2``).
    """

    __slots__ = ("home", "on_ack", "pending", "q2_changes", "token")

    def __init__(self, client_id: str, home: str, token: str,
                 subscriptions: dict[str, int], inbound_qos2: Iterable[tuple[int, int]],
                 on_ack: Callable[[RemoteSession, int, int], None]) -> None:
        super().__init__(client_id, False)
        self.home = home
        self.token = token
        self.subscriptions = dict(subscriptions)
        self.inbound_qos2 = dict(inbound_qos2)
        #: Inbound QoS 2 ids changed, as ``Session._dirty_qos2`` (None: released).
        self.q2_changes: dict[int, int | None] = {}
        #: Called with (this session, packet type, packet id) for each acknowledgement
        #: (-5: a PUBREC with a failure reason code).
        self.on_ack = on_ack
        #: Bytes from the home that arrived before the connection was accepted.
        self.pending = bytearray()
        self.output = self.pending  # sbytes land here until attach()

    def attach(self, output: bytearray, now: float = 0.0) -> None:
        output += self.pending  # after the CONNACK that accept() just wrote
        self.pending = output
        self.output = output

    def detach(self) -> None:
        self.output = None

    def deliver(self, message: Message, qos: int, retain: bool = False,
                now: float = 0.0) -> None:
        raise RuntimeError("messages for a remote session are routed to its home")

    def on_puback(self, packet_id: int, pump: bool = True) -> bool:
        self.on_ack(self, 4, packet_id)  # the home refills the window (``pump`` is its)
        return True

    def on_pubrec(self, packet_id: int) -> bool:
        self.on_ack(self, 5, packet_id)
        return True

    def on_pubcomp(self, packet_id: int, pump: bool = True) -> bool:
        self.on_ack(self, 7, packet_id)
        return True

    def on_pubrec_failed(self, packet_id: int) -> bool:
        # The home holds the delivery; left here, it waited for a PUBREL that never comes
        # (its window slot taken for good, the refused message sent again on resume).
        self.on_ack(self, -5, packet_id)
        return True

    def pump(self) -> None:
        """Nothing is queued here: the home sends what the freed window lets through."""

    def begin_inbound_qos2(self, packet_id: int) -> int:
        mid = self.inbound_qos2.get(packet_id)
        if mid is None:
            mid = self.inbound_qos2[packet_id] = new_mid()
            self.q2_changes[packet_id] = mid
            self.durable_due = True  # forwarded as a request, even by a lazy persist
        return mid

    def inbound_qos2_acknowledged(self, packet_id: int) -> None:
        if self.inbound_qos2.get(packet_id):
            self.inbound_qos2[packet_id] = 0
            self.q2_changes[packet_id] = 0

    def release_inbound_qos2(self, packet_id: int) -> None:
        if packet_id in self.inbound_qos2:
            del self.inbound_qos2[packet_id]
            self.q2_changes[packet_id] = None

    def has_changes(self) -> bool:
        return bool(self.q2_changes)

    def take_changes(self) -> tuple[dict[int, Any], dict[int, int | None]]:
        self.durable_due = False
        changes, self.q2_changes = self.q2_changes, {}
        return {}, changes


class HomeAnswer:
    """The answer of a session's home to a forwarded SUBSCRIBE or UNSUBSCRIBE
    (``mqttring.broker.sessions.Forwarded``): awaited by the connection's acceptor, closed
    unawaited if the connection ends first."""

    __slots__ = ("_answer", "_error", "home")

    def __init__(self, home: str, answer: Coroutine[Any, Any, None] | None,
                 error: PeerFailure | None = None) -> None:
        self.home = home
        self._answer = answer
        self._error = error

    async def wait(self) -> None:
        answer, self._answer = self._answer, None
        try:
            if answer is None:
                raise self._error or PeerUnavailable(f"{self.home}: already awaited")
            await answer
        except PeerFailure as exc:
            raise SessionUnavailable(f"the session's home {self.home} did not answer "
                                     f"({type(exc).__name__}: {exc})") from exc

    def close(self) -> None:
        if self._answer is not None:
            self._answer.close()
            self._answer = None


class SessionProxy:
    """Home-side waker: ships a persistent session's output to the edge that holds it."""

    __slots__ = ("_last_answer", "broken", "client_id", "links", "node", "output", "token")

    def __init__(self, links: Links, node: str, client_id: str, token: str) -> None:
        self.links = links
        self.node = node
        self.client_id = client_id
        self.token = token
        self.output = bytearray()
        #: Set once the last SUBACK/UNSUBACK asked for is written (``answer_turn``).
        self._last_answer: trio.Event | None = None
        #: Bytes for this connection were dropped (``wake``): nothing more is sent to it.
        self.broken = False

    def answer_turn(self) -> tuple[trio.Event | None, trio.Event]:
        """Places in line for a SUBACK or UNSUBACK: the event to wait for before writing
        it (None: nothing ahead) and the one to set once written.  What each waits for
        (other nodes' confirmations, a durable write) ends in any order; the answers leave
        in the order the requests came [MQTT-4.6.0-2], as from one connection's acceptor."""
        ahead, mine = self._last_answer, trio.Event()
        self._last_answer = mine
        return ahead, mine

    def wake(self) -> None:
        """Ship the output, in pieces of at most half a link frame: one pump of the inflight
        window can exceed a frame (32 messages of up to ``max_packet_size`` each), and the
        link drops a message that does not fit.  The edge appends the pieces in order.

        A piece the link drops (its queue to the edge is full: the edge or the network is
        slower than this session's traffic) takes QoS 1/2 PUBLISHes the session counts as
        sent, which nothing sends again while the connection lasts (3.1.1 resends only on
        reconnect), and may cut a packet in two.  So the connection is closed instead, once,
        and nothing more is sent to it: the client's reconnect resends the whole window
        with DUP [MQTT-4.4.0-1], as after any lost connection.  Before 2026-11-29 the piece
        was dropped silently and the session stalled once its window was full of them."""
        output = self.output
        if not output:
            return
        if not self.broken:
            piece = self.links.max_frame // 2
            for start in range(0, len(output), piece):
                if not self.links.send(self.node, SessionBytes(
                        self.client_id, self.token, bytes(output[start:start + piece]))):
                    self.broken = True
                    log.warning("client %r: its session's output to %s was dropped (the link "
                                "is full); closing its connection there so that the client "
                                "resends its window", self.client_id, self.node,
                                extra={"client_id": self.client_id, "event": "relay-full"})
                    self.kick("session output dropped", 0x97)  # MQTT 5: quota exceeded
                    break
        output.clear()

    def kick(self, reason: str = "closed by the broker", code: int | None = None) -> None:
        """Close the connection at the edge (its will is published as for any unclean
        close: the edge reports the close, and this registration is still current), which
        tells an MQTT 5 client ``code`` (a slow consumer's 0x97).  Never dropped at a full
        link: a close that did not happen would leave the client on a stalled session."""
        self.links.send_control(self.node, SessionKick(0, self.client_id, self.token,
                                                       0x8E if code is None else code))


class SessionRelay:
    """Both ends of the relay on one node: the stand-ins of its connections whose sessions
    live elsewhere (``remote``) and the proxies of the sessions it is home to whose clients
    are connected elsewhere (``proxies``).  ``ClusterSessions`` owns it and decides when a
    stand-in or a proxy begins and ends; the link dispatch hands it the relayed messages."""

    def __init__(self, core: BrokerCore, links: Links, answer_timeout: float = 15.0) -> None:
        self.core = core
        self.links = links
        #: Seconds an edge waits for the home's answer to a SUBSCRIBE or UNSUBSCRIBE.
        self.answer_timeout = answer_timeout
        #: Edge side: stand-ins by (client id, connection token).
        self.remote: dict[tuple[str, str], RemoteSession] = {}
        #: Home side: the proxy of each session served to another node, by client id.
        self.proxies: dict[str, SessionProxy] = {}

    # -- edge side --------------------------------------------------------------------------

    def stand_in(self, client_id: str, home: str, token: str) -> RemoteSession:
        """A stand-in for connection ``token``, created before its ``sopen`` is sent: the
        home's first ``sbytes`` may arrive before its answer is handled."""
        stand_in = RemoteSession(client_id, home, token, {}, (), self._forward_ack)
        self.remote[(client_id, token)] = stand_in
        return stand_in

    def drop(self, client_id: str, token: str) -> None:
        self.remote.pop((client_id, token), None)

    async def forward_changes(self, session: RemoteSession, durability: Durability) -> None:
        if session.durable_due:
            durability = Durability.DURABLE  # an id begun: stored before it is routed
        _, changes = session.take_changes()
        if not changes:
            return
        message = InboundQos2(0, session.client_id, session.token, list(changes.items()))
        if durability is Durability.DURABLE:
            try:
                await self.links.request(session.home, message)
            except PeerFailure as exc:  # the publishes wait for it: the client resends them
                raise PeerUnavailable(f"the session's home {session.home} did not store its "
                                      f"QoS 2 ids ({type(exc).__name__}: {exc})") from exc
        else:
            # Never dropped at a full link (nor below): a home that missed an id's release
            # would take the client's next QoS 2 PUBLISH with that id, at its next
            # connection, for a resend, and acknowledge it without routing it.
            self.links.send_control(session.home, message)

    def _forward_ack(self, session: RemoteSession, kind: int, packet_id: int) -> None:
        """The client acknowledged a message its home sent: tell the home (it frees the
        window and forgets the message there).  Never dropped at a full link: a lost one
        holds a slot of the window until the client reconnects, and enough of them stall
        the session.  They are as many as the deliveries the window let out."""
        if kind == -5:  # a PUBREC with a failure reason code
            message = SessionAck(session.client_id, session.token, 5, packet_id, True)
        else:
            message = SessionAck(session.client_id, session.token, kind, packet_id)  # type: ignore[arg-type]
        self.links.send_control(session.home, message)

    def forward_subscribe(self, session: Session, packet_id: int,
                          topics: tuple[tuple[str, int], ...],
                          options: tuple[int, ...] | None = None,
                          subscription_id: int = 0) -> HomeAnswer | None:
        if not isinstance(session, RemoteSession):
            return None
        return self._ask_home(session, SessionSubscribe(
            0, session.client_id, session.token, packet_id, list(topics),
            None if options is None else list(options), subscription_id))

    def forward_unsubscribe(self, session: Session, packet_id: int,
                            topics: tuple[str, ...]) -> HomeAnswer | None:
        if not isinstance(session, RemoteSession):
            return None
        return self._ask_home(session, SessionUnsubscribe(
            0, session.client_id, session.token, packet_id, list(topics)))

    def _ask_home(self, session: RemoteSession,
                  message: SessionSubscribe | SessionUnsubscribe) -> HomeAnswer:
        """Queue ``message`` to the session's home now, in the caller's turn (the home
        applies SUBSCRIBEs and UNSUBSCRIBEs in link order); its answer comes once the
        SUBACK/UNSUBACK is in the connection's output, so the answers to the client's
        later packets (a PINGRESP, a PUBACK) follow it, as from one broker."""
        try:
            answer = self.links.request_now(session.home, message, self.answer_timeout)
        except PeerUnavailable as exc:
            return HomeAnswer(session.home, None, exc)
        return HomeAnswer(session.home, answer)

    def on_sbytes(self, message: SessionBytes) -> None:
        stand_in = self.remote.get((message.client_id, message.token))
        if stand_in is not None and stand_in.output is not None:
            stand_in.output += message.data
            self.core.wake(message.client_id)

    # -- home side --------------------------------------------------------------------------

    def serve(self, node: str, message: SessionOpen, session: Session,
              present: bool) -> None:
        """Serve ``session`` (bound, registered) to the edge that opened it, and answer the
        ``sopen``: the answer goes out before the session's first bytes (links keep order).

        No await: the caller holds the client id's lock (``ClusterSessions.on_sopen``), so
        that the registration, the bind and this attachment are one step a takeover cannot
        come between; what may wait (stores) is ``settle``, after the lock."""
        client_id, v5 = message.client_id, message.v5
        # The ACL's view of the client, before attach: queued messages are checked too.
        session.access = self.core.access_for(message.username, client_id)
        session.username = message.username
        # Its protocol: an MQTT 5 client's session output is encoded as v5 here.
        self.core.bind_protocol(session, None if v5 is None else ClientLimits5(
            v5.max_packet_size, v5.receive_maximum, v5.topic_alias_maximum,
            v5.problem_info))
        proxy = SessionProxy(self.links, message.edge, client_id, message.token)
        self.proxies[client_id] = proxy
        self.core.wakers[client_id] = proxy
        self.links.reply(node, message.req, True, SessionOpened(
            present, list(session.subscriptions.items()), sorted(session.inbound_qos2.items()),
            list(session.kept_options.items()) if session.kept_options else None))
        # Resends inflight with DUP, fills the window; drops queued messages whose
        # wall-clock deadline passed while the client was away.
        session.attach(proxy.output, time.time())
        proxy.wake()

    async def settle(self, session: Session) -> None:
        """What ``serve`` leaves to wait for: the attachment's changes stored, and the
        PUBRECs of the previous connection not stored yet released once they are."""
        if session.has_changes():
            await self.core.session_store.save_changes([session], Durability.LAZY)
        if session.held_releases:
            await self.core.session_store.release_when_stored(session, self.core.wake)

    def detach_proxy(self, client_id: str, token: str) -> None:
        proxy = self.proxies.get(client_id)
        if proxy is None or proxy.token != token:
            return
        del self.proxies[client_id]
        if self.core.wakers.get(client_id) is proxy:
            del self.core.wakers[client_id]
        session = self.core.sessions.get(client_id)
        if session is not None and session.output is proxy.output:
            session.detach()

    def _proxied(self, client_id: str, token: str) -> tuple[Session, SessionProxy] | None:
        proxy = self.proxies.get(client_id)
        session = self.core.sessions.get(client_id)
        if proxy is None or proxy.token != token or session is None:
            return None
        return session, proxy

    async def on_sack(self, message: SessionAck) -> None:
        found = self._proxied(message.client_id, message.token)
        if found is None:
            return
        session, proxy = found
        if message.failed:
            if session.on_pubrec_failed(message.packet_id):
                session.pump()
        else:
            acknowledge = {4: session.on_puback, 5: session.on_pubrec, 7: session.on_pubcomp}
            acknowledge[message.packet_type](message.packet_id)
        proxy.wake()
        self.core.flow.room_made(message.client_id)
        if session.held_releases:
            # A PUBREC: its PUBREL waits until the new state is stored durably, on this node
            # and the shard's replicas (the next home must not send the PUBLISH again).
            await self.core.session_store.release_when_stored(session, self.core.wake)
        elif session.has_changes():
            await self.core.session_store.save_changes([session], Durability.LAZY)

    async def on_q2(self, node: str, message: InboundQos2) -> None:
        req = message.req
        found = self._proxied(message.client_id, message.token)
        if found is None:
            self.links.reply(node, req, False, "not the registered connection")
            return
        session, _ = found
        for packet_id, mid in message.changes:
            if mid is None:
                session.release_inbound_qos2(packet_id)
            else:
                session.record_inbound_qos2(packet_id, mid)
        durability = Durability.DURABLE if req else Durability.LAZY
        await self.core.session_store.save_changes([session], durability)
        self.links.reply(node, req, True)

    def on_ssub(self, node: str, message: SessionSubscribe
                ) -> Callable[[], Awaitable[None]] | None:
        """Register a SUBSCRIBE forwarded by the edge as it arrives, in the link's order
        (an UNSUBSCRIBE after it acts after it); what remains, the SUBACK and the retained
        messages in their turn, then the answer, is returned for a task to finish."""
        found = self._proxied(message.client_id, message.token)
        if found is None:
            self.links.reply(node, message.req, False, "not the registered connection")
            return None
        session, proxy = found
        subscriptions = self.core.subscriptions
        pairs = tuple(message.topics)
        _check_filters(f for f, _ in pairs)
        options = None if message.options is None else tuple(message.options)
        replay = retained_wanted(session, pairs, options)
        since = time.time()
        codes, registered = subscriptions.register(session, pairs, options,
                                                   message.subscription_id)
        return self._answer_in_turn(
            node, message.req, session, proxy,
            lambda: subscriptions.registered(session, pairs, registered),
            SubAck(message.packet_id, tuple(codes)) if session.v5 is None
            else SubAck5(message.packet_id, tuple(codes)),
            lambda send_ack: subscriptions.acknowledge(session, pairs, codes, replay,
                                                       send_ack, since))

    def on_sunsub(self, node: str, message: SessionUnsubscribe
                  ) -> Callable[[], Awaitable[None]] | None:
        """An UNSUBSCRIBE forwarded by the edge, as ``on_ssub``: acts as it arrives,
        answered in its turn."""
        found = self._proxied(message.client_id, message.token)
        if found is None:
            self.links.reply(node, message.req, False, "not the registered connection")
            return None
        session, proxy = found
        topics = tuple(message.topics)
        _check_filters(topics)
        codes = self.core.subscriptions.unregister(session, topics)
        return self._answer_in_turn(
            node, message.req, session, proxy,
            lambda: self.core.session_store.save_subscriptions(session, topics),
            UnsubAck(message.packet_id) if session.v5 is None
            else UnsubAck5(message.packet_id, tuple(codes)))

    def _answer_in_turn(self, node: str, req: int, session: Session, proxy: SessionProxy,
                        ready: Callable[[], Awaitable[None]],
                        ack: SubAck | UnsubAck | SubAck5 | UnsubAck5,
                        acknowledge: Callable[[Callable[[], bool]], Awaitable[None]]
                        | None = None,
                        ) -> Callable[[], Awaitable[None]]:
        """Take the request's place in line now (``answer_turn``); what it returns, run in
        a task, waits for ``ready`` and for the answers ahead, writes ``ack`` (the SUBACK
        or UNSUBACK of the session's protocol) into the session's bytes (through
        ``acknowledge``, if given, which writes the retained messages with it), and answers
        the edge behind those bytes, or refuses at once if anything failed (the edge
        closes the client now, not after its timeout)."""
        ahead, mine = proxy.answer_turn()
        sent = False

        def send_ack() -> bool:
            nonlocal sent
            if self.proxies.get(session.client_id) is not proxy \
                    or session.output is not proxy.output:
                # The connection that asked is gone (taken over meanwhile, maybe by a
                # client of the other protocol version: the ack built for it was then
                # written into the new one's bytes, and failed to encode).
                return False
            proxy.output += (session.v5.encode_ack(ack)  # type: ignore[arg-type]
                             if session.v5 is not None else encode(ack))
            proxy.wake()
            sent = True
            return True

        async def finish() -> None:
            answered = False
            try:
                await ready()
                if ahead is not None:
                    await ahead.wait()
                if acknowledge is None:
                    send_ack()
                else:
                    await acknowledge(send_ack)
                if not sent:
                    return
                self.links.reply(node, req, True)
                answered = True
            finally:
                mine.set()
                if not answered:
                    self.links.reply(node, req, False, f"{type(ack).__name__} not sent here")

        return finish


def _check_filters(filters: Iterable[str]) -> None:
    """The edge's decoder checked them; a peer that sends a filter no client could is a
    bug or a version skew, refused as bad content (``ValueError``: the link closes), not
    registered inline in the link's reader."""
    for topic_filter in filters:
        try:
            validate_topic_filter(topic_filter)
        except InvalidTopic as exc:
            raise ValueError(f"a forwarded filter is invalid: {exc}") from None


__all__ = ["HomeAnswer", "RemoteSession", "SessionProxy", "SessionRelay"]
