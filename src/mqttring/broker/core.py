"""What the broker decides for its clients: sessions, takeover, subscribe, publish, wills.

Theory of operation
-------------------
``BrokerCore`` owns the node's client-facing state: ``sessions`` (client id -> ``Session``,
online or not) and ``clients`` (client id -> the live ``ClientHandler``).  Connection
handlers turn bytes into protocol events (``mqttring.protocol.connection``) and call one
``on_*`` method per event; the core answers through the handler's ``ServerConnection`` and
routes messages through the ``Router`` seam, never directly to other clients.

Invariants:

* At most one live handler per client id.  A second CONNECT for an id closes the first
  connection *before* the new one is bound (takeover [MQTT-3.1.4-2]); the old connection's
  cleanup runs synchronously here, so it can never detach the new connection's session.
* A client id maps to one session.  CleanSession=1 discards any previous session, stored or
  not [MQTT-3.1.2-6]; CleanSession=0 resumes it [MQTT-3.1.2-4].
* Acknowledgements go out only after the work they promise is done: SUBACK after the
  subscription is durable (persistent sessions), PUBACK/PUBREC after the router accepted the
  message (durable where it was queued for a persistent session).
* ``connection_lost`` runs once per handler (guarded by ``handler.finished``) and publishes
  the will unless the client sent DISCONNECT [MQTT-3.1.2-8, MQTT-3.14.4-3].

Who may do what (``mqttring.security``, docs/security.md): ``auth`` decides CONNECT (the
password check runs in a worker thread); ``acl`` (None without an ``acl_file``) is asked
for a client's writes here at its edge, for its subscriptions where its session lives, and
for each delivery by the session itself (``Session.access``, bound at connect).

MQTT 5.0 (docs/design.md, "MQTT 5.0"): ``bind_protocol`` gives a session the v5 encoder and
the client's limits at each CONNECT; SUBACK/UNSUBACK carry v5 reason codes for v5 sessions;
subscription options go to the session's ``V5Session``; wills may wait (``DelayedWills``).

Events of one connection are handled in order by that connection's acceptor task
(``mqttring.broker.client``), so one client's packets are processed sequentially; different
clients proceed concurrently.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import trio

from mqttring.broker.core_config import limits5, login_settings, session_limits
from mqttring.broker.delayed import DelayedWills
from mqttring.broker.denials import AclDenials
from mqttring.broker.flow import FlowControl
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.refusals import PublishRefused
from mqttring.broker.router import Router
from mqttring.broker.security_reload import SecurityReload
from mqttring.broker.session_store import SessionStore
from mqttring.broker.sessions import (
    SESSION_SWEEP_INTERVAL,
    LocalSessions,
    SessionManager,
    SessionUnavailable,
)
from mqttring.broker.subscribing import Subscriptions
from mqttring.config import BrokerConfig
from mqttring.logs import clipped
from mqttring.lsm import Durability
from mqttring.protocol.connection import (
    ConnectRequested,
    DisconnectRequested,
    Event,
    PingRequested,
    PublishReceived,
    SubscribeRequested,
    UnsubscribeRequested,
)
from mqttring.protocol.message import Message, with_origin
from mqttring.protocol.packets import Connect, ConnectReturnCode, Will
from mqttring.protocol.packets5 import Connect5, Will5
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import ClientLimits5, V5Session
from mqttring.security.acl import AccessControl, AclFile, ClientAccess
from mqttring.security.auth import Authenticator, AuthOutcome
from mqttring.security.passwords import PasswordFile

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler

log = logging.getLogger("mqttring.broker")


RouterFactory = Callable[["BrokerCore"], Router]
ManagerFactory = Callable[["BrokerCore"], SessionManager]



class BrokerCore(SecurityReload):
    """See the module docstring.

    The router and the session manager need the core (its sessions, its ``wake``) and the
    core needs them, so the core takes *factories* and calls them at the end of its own
    construction: when the constructor returns the core is complete, and nobody assigns
    its parts afterwards.  ``LocalRouter``/``LocalSessions`` on one node; a cluster member
    supplies its own (``mqttring.broker.membership``).
    """

    def __init__(
        self, config: BrokerConfig, session_store: SessionStore, metrics: BrokerMetrics,
        router: RouterFactory, manager: ManagerFactory = LocalSessions,
        passwords: PasswordFile | None = None, acl_rules: AclFile | None = None,
    ) -> None:
        """``passwords``/``acl_rules``: ``config.password_file``/``config.acl_file`` already
        loaded (``mqttring.broker.files``); None: loaded here from the config."""
        self.config = config
        self.limits = config.limits
        #: What a v5 connection announces and may use (``ServerConnection``).
        self.limits5 = limits5(config)
        self.session_limits = session_limits(config)
        self.flow = FlowControl(config.limits.slow_subscriber_hold, metrics, self.shed)
        self.session_store = session_store
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        self.clients: dict[str, ClientHandler] = {}
        #: client id -> whatever must be woken when that session appends output: the local
        #: connection, or (cluster) the proxy that ships it to the client's node.
        self.wakers: dict[str, Waker] = {}
        self.shutting_down = False
        #: The event loop this core serves (built inside it by the node; None when built
        #: outside one): a reload from another thread closes revoked users' connections
        #: there.  Until 2026-11-29 the token was the authenticator's, set at its first
        #: login check: a reload that had swapped in a new authenticator (a changed login
        #: setting) left it unset, and a later password-file reload closed nobody.
        try:
            self._trio_token: trio.lowlevel.TrioToken | None = (
                trio.lowlevel.current_trio_token())
        except RuntimeError:
            self._trio_token = None
        #: Counts and logs what the ACL denied (the publish and the subscribe paths).
        self.acl_denied = AclDenials(metrics)
        #: Who may connect (password file, anonymous access, failed-login limit); its
        #: ``reload()`` re-reads the password file.
        self.auth = Authenticator.from_config(config, passwords)
        #: What clients may read, write and subscribe to; None (no ``acl_file``): anything.
        #: Its ``reload()`` swaps in the file as it is now.
        self.acl = (AccessControl(config.acl_file, acl_rules)
                    if config.acl_file is not None else None)
        self.router: Router = router(self)
        self.manager: SessionManager = manager(self)
        #: SUBSCRIBE and UNSUBSCRIBE, from the packet to the SUBACK and retained messages.
        self.subscriptions = Subscriptions(self.router, self.manager, session_store, metrics,
                                           lambda: self.limits.max_subscriptions, self.wake,
                                           self.acl_denied,
                                           lambda: self.limits.suback_retained_wait)
        #: MQTT 5 wills waiting for their Will Delay Interval; ``run`` is a task of the
        #: node's nursery (``mqttring.broker.server``).
        self.delayed_wills = DelayedWills(self.router.publish, self.clients.__contains__)

    def apply_settings(self, config: BrokerConfig) -> None:
        """A SIGHUP reload (``mqttring.reload``): swap in the new immutable settings.

        Read where they are used: logins and ``max_connections`` at each CONNECT, limits
        of a connection when it starts, ``session_limits`` when a session is created.  A
        changed login setting or ACL path builds a new ``Authenticator``/``AccessControl``
        first (reading its file: a bad one raises ``ConfigError`` and nothing changes),
        then applies it to the clients already connected (``security_reload``).
        """
        old = self.config
        old_auth, old_acl = self.auth, self.acl
        auth, acl = old_auth, old_acl
        if login_settings(old) != login_settings(config):
            auth = Authenticator.from_config(config)
        if old.acl_file != config.acl_file:
            acl = AccessControl(config.acl_file) if config.acl_file is not None else None
        self.config, self.auth, self.acl = config, auth, acl
        self.security_changed(old_auth, old_acl)
        self.limits = config.limits
        self.limits5 = limits5(config)
        self.session_limits = session_limits(config)

    # -- plumbing used by the router --------------------------------------------------------

    def wake(self, client_id: str) -> None:
        """Tell a client's writer that its session appended output."""
        waker = self.wakers.get(client_id)
        if waker is not None:
            waker.wake()

    def shed(self, client_id: str) -> None:
        """Disconnect a client, wherever its connection is (a slow consumer)."""
        waker = self.wakers.get(client_id)
        if waker is not None:
            # MQTT 5: 0x97 quota exceeded (its max_queued, for slow_subscriber_hold)
            waker.kick("slow consumer (no room within slow_subscriber_hold)", 0x97)

    async def run_session_expiry(self, interval: float = SESSION_SWEEP_INTERVAL) -> None:
        """End expired MQTT 5 sessions as their deadlines pass; a task of the node's
        nursery until it is cancelled (``mqttring.broker.server``)."""
        while True:
            await trio.sleep(interval)
            try:
                await self.manager.expire_sessions(time.time())
            except Exception:
                log.exception("session expiry pass failed; trying again")

    async def restore_sessions(self) -> int:
        """Load persistent sessions from the store at start-up (all offline)."""
        stored = await self.session_store.load_all()
        restored = []
        for record in stored:
            session = record.to_session(self.session_limits)
            self.sessions[record.client_id] = session
            restored.append(session)
        restore = getattr(self.router, "restore", None)
        if restore is not None:
            restore(restored)
        return len(restored)

    # -- events -----------------------------------------------------------------------------

    async def handle(self, handler: ClientHandler, events: list[Event]) -> None:
        """Act on one batch of events from a connection, in order.

        Consecutive PUBLISHes are accepted together (``on_publishes``): what a client sent
        while its previous publishes were being accepted costs one group commit and one
        round trip per owner, not one each.
        """
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            kind = type(event)
            i += 1
            if kind is PublishReceived:
                j = i
                while j < n and type(events[j]) is PublishReceived:
                    j += 1
                await self.on_publishes(handler, events[i - 1:j])  # type: ignore[arg-type]
                i = j
            elif kind is ConnectRequested:
                more = await self.on_connect(handler, event.packet)  # type: ignore[union-attr]
                if more:
                    await self.handle(handler, more)
            elif kind is SubscribeRequested:
                await self.subscriptions.on_subscribe(handler, event)  # type: ignore[arg-type]
            elif kind is UnsubscribeRequested:
                await self.subscriptions.on_unsubscribe(handler, event)  # type: ignore[arg-type]
            elif kind is PingRequested:
                handler.answer_ping(event)  # type: ignore[arg-type]
            elif kind is DisconnectRequested:
                # Only Success (0x00; MQTT 3.1.1's DISCONNECT has no other) discards the will
                # [MQTT-3.14.4-3]: 0x04 "disconnect with will message" and every error
                # reason keep it.
                handler.clean_disconnect = event.reason_code == 0  # type: ignore[union-attr]
            if handler.conn.pending_output:
                handler.wake()  # what this event answered leaves now, not after the batch
            if handler.conn.closed and not handler.conn.disconnected:
                break  # taken over or refused: nothing more from this connection counts
        session = handler.session
        if session is not None:
            self.flow.room_made(session.client_id)
            if session.persistent and session.has_changes():
                # Acks received, packet ids assigned: progress whose loss only causes a
                # permitted redelivery, so it is written lazily.
                try:
                    await self.manager.persist([session], Durability.LAZY)
                except PublishRefused as exc:
                    # A home on another node refused it: this connection is no longer the
                    # session's (taken over elsewhere, or the home moved).  It ends, as a
                    # refused publish ends it; it was an internal error with a traceback.
                    log.info("client %r: its session's progress was not stored (%s); "
                             "closing the connection", handler.client_id, exc)
                    handler.kick(f"session not stored: {exc}", 0x89)  # MQTT 5: server busy
                    return
            if session.held_releases:
                handler.release_soon()  # PUBRECs, or a resumed session's held PUBRELs

    def _certificate_login(self, handler: ClientHandler, packet: Connect | Connect5
                           ) -> tuple[Connect | Connect5, ConnectReturnCode]:
        """``use_identity_as_username`` on a TLS connection (mosquitto's rule): the verified
        client certificate is the credential and its CN the username, whatever CONNECT says;
        a certificate without a CN cannot log in."""
        identity = handler.transport.identity
        if identity is None:
            return packet, ConnectReturnCode.NOT_AUTHORIZED
        log.info("client %r from %s: certificate CN %r is its username", packet.client_id,
                 handler.transport.peer, identity)
        return replace(packet, username=identity, password=None), ConnectReturnCode.ACCEPTED

    async def on_connect(self, handler: ClientHandler, packet: Connect | Connect5
                         ) -> list[Event]:
        conn = handler.conn
        if self.config.use_identity_as_username and handler.transport.secure:
            packet, code = self._certificate_login(handler, packet)
            if code is not ConnectReturnCode.ACCEPTED:
                log.info("refusing client %r from %s: its certificate has no CN",
                         packet.client_id, handler.transport.peer,
                         extra={"client_id": packet.client_id, "event": "refused"})
                conn.refuse(code)
                return []
        else:
            outcome = await self.auth.check(packet.username, packet.password,
                                            handler.transport.peer)
            if outcome is not AuthOutcome.ACCEPTED:
                # A rate-limited address was logged once when it went over; not every CONNECT.
                log.log(logging.DEBUG if outcome is AuthOutcome.RATE_LIMITED else logging.INFO,
                        "refusing client %r from %s: %s (user %r)", packet.client_id,
                        handler.transport.peer, outcome.value, clipped(packet.username),
                        extra={"client_id": packet.client_id, "event": "refused"})
                conn.refuse(_CONNACK_FOR[outcome])
                return []
        client_id = packet.client_id or f"auto-{uuid.uuid4().hex}"
        if client_id not in self.clients and len(self.clients) >= self.limits.max_connections:
            conn.refuse(ConnectReturnCode.SERVER_UNAVAILABLE)
            return []
        access = self.access_for(packet.username, client_id)
        if access is not None and packet.will is not None and not access.may_write(
                packet.will.topic):
            # As mosquitto: a will the client could not publish itself refuses the CONNECT.
            log.info("refusing client %r from %s: the ACL denies its will topic %r",
                     client_id, handler.transport.peer, clipped(packet.will.topic))
            conn.refuse(ConnectReturnCode.NOT_AUTHORIZED)
            return []
        handler.client_id = client_id
        try:
            session, present = await self.manager.open(handler, client_id, packet)
        except SessionUnavailable as exc:
            log.info("refusing %r: %s", client_id, exc)
            conn.refuse(ConnectReturnCode.SERVER_UNAVAILABLE)
            return []
        # A new connection within the will delay: the previous connection's will (also one
        # just owed by the takeover inside ``open``) is not sent (section 3.1.3.2.2).
        self.delayed_wills.cancel(client_id)
        if conn.closed:
            return []  # taken over while we were asking
        handler.session = session
        session.access = access  # before accept: what it sends from its queue is checked
        session.username = packet.username  # for the ACL's view again after a reload
        self._bind_protocol(handler, session)
        # As sent: bounded by the session expiry in force when the connection ends
        # (``effective_will``), which its DISCONNECT may change.
        handler.will = packet.will
        handler.connected_at = time.time()
        self.clients[client_id] = handler
        self.wakers[client_id] = handler
        # Counted from the table, not incremented: a connection overwritten here would
        # otherwise stay counted for ever (its close does not find itself registered).
        self.metrics.clients_connected = len(self.clients)
        self.metrics.connections_total += 1
        log.info("client %r connected from %s (clean session %s, keepalive %d s%s)",
                 client_id, handler.transport.peer, packet.clean_session, conn.keepalive,
                 ", session present" if present else "",
                 extra={"client_id": client_id, "event": "connected"})
        dropped = session.dropped
        # Wall clock: ``now`` only feeds queued-message expiry, whose deadlines are UNIX time.
        events = conn.accept(session, present, time.time())
        self.metrics.messages_dropped += session.dropped - dropped  # expired while away
        return events

    def _bind_protocol(self, handler: ClientHandler, session: Session) -> None:
        link = handler.conn.v5
        self.bind_protocol(session, None if link is None else ClientLimits5(
            link.client_max_packet, link.client_receive_max, link.client_alias_max,
            link.problem_info))

    def bind_protocol(self, session: Session, v5: ClientLimits5 | None) -> None:
        """Give the session the delivery rules of the protocol its client speaks now.

        ``v5``: what an MQTT 5 client's CONNECT announced: the v5 encoder (properties,
        subscription options, outbound topic aliases, packets too large for the client
        dropped) and an inflight window no larger than the client's Receive Maximum
        [MQTT-3.3.4-7].  None (3.1.1): the node's limits and the 3.1.1 encoder.  Called at
        every CONNECT, so the new ``V5Session``'s aliases start empty with the connection;
        also called by a cluster home for a session whose client is on another node.
        """
        old = session.v5
        if v5 is None:
            if old is not None and old.options:
                # A 3.1.1 client resumed a v5 session: its subscriptions keep their options.
                session.kept_options = old.options
            session.v5 = None
            session.limits = self.session_limits
            return
        session.v5 = V5Session(session.client_id, v5.max_packet_size,
                               old.options if old is not None else session.kept_options,
                               alias_max=v5.topic_alias_maximum,
                               problem_info=v5.problem_info)
        session.kept_options = None
        limits = self.session_limits
        if v5.receive_maximum < limits.max_inflight:
            limits = replace(limits, max_inflight=v5.receive_maximum)
        session.limits = limits

    async def on_publishes(self, handler: ClientHandler, events: list[PublishReceived]
                           ) -> None:
        """Route a run of PUBLISHes in order, then acknowledge them in the same order
        [MQTT-4.6.0-2/3]: all of them once the router accepted all, or none (the connection
        is closed and the client resends what it has no acknowledgement for)."""
        self.metrics.messages_received += len(events)
        by_qos = self.metrics.received_by_qos
        messages = []
        system = False  # one pass for the counts, the list and the $SYS check below
        for event in events:
            message = event.message
            by_qos[message.qos] += 1
            messages.append(message)
            if message.topic[:4] == "$SYS":
                system = True
        session = handler.session
        access = session.access if session is not None else None
        denied: set[int] = set()
        if access is not None:
            allowed = self._writable(handler, access, messages)
            if len(allowed) != len(messages):
                kept = {id(m) for m in allowed}
                denied = {id(m) for m in messages if id(m) not in kept}
            messages = allowed
        # Clients may not write the broker's own $SYS tree; such a message is acknowledged
        # (refusing it would only make the client resend) and not routed.  After the ACL:
        # one that denies it is told so (MQTT 5: 0x87), as for any other topic.
        if system:
            messages = [m for m in messages if not m.topic.startswith("$SYS")]
        if session is not None and session.kept_options and messages:
            messages = with_origin(messages, session.client_id, session.kept_options)
        try:
            if session is not None and session.persistent and any(
                    e.message.qos == 2 for e in events):
                # The inbound QoS 2 ids and their messages' identities are stored before the
                # messages are routed (``Session.begin_inbound_qos2``): a crash or a failed
                # routing then leaves each id to the client's resend, routed again as the
                # same message wherever the session is next.
                await self.manager.persist([session], Durability.DURABLE)
            if messages:
                await self.router.publish_many(messages)
        except PublishRefused as exc:
            count = len(messages) or len(events)
            self.metrics.publishes_refused += count
            log.warning("%d publishes to %r and on from %r not accepted (%s); closing the "
                        "connection without acknowledging them", count,
                        (messages or [e.message for e in events])[0].topic,
                        handler.client_id, exc)
            handler.kick(f"publishes not accepted: {exc}", 0x89)  # MQTT 5: server busy
            return
        if denied and handler.conn.v5 is not None:
            # MQTT 5 can say it (as mosquitto does): 0x87 not authorized, and for QoS 2 the
            # exchange ends there (a 3.1.1 client is told success, as before).
            ack = handler.conn.ack_publish
            for event in events:
                ack(event.packet_id, event.message.qos,
                    0x87 if id(event.message) in denied else 0)
            return
        handler.conn.ack_publishes(events)

    def access_for(self, username: str | None, client_id: str) -> ClientAccess | None:
        """The ACL's view of one client (None: no ACL file, anything goes)."""
        return None if self.acl is None else self.acl.for_client(username, client_id)

    def will_allowed(self, username: str | None, client_id: str, will: Will | Will5) -> bool:
        """Whether a will that falls due may go out: its client may still write its topic.
        The CONNECT checked that too; an ACL reload since may have revoked it, and then
        the will is not published (as mosquitto decides at that moment too)."""
        access = self.access_for(username, client_id)
        return access is None or self.will_allowed_by(access, client_id, will.topic)

    @staticmethod
    def will_allowed_by(access: ClientAccess, client_id: str, topic: str) -> bool:
        if access.may_write(topic):
            return True
        log.info("will of %r on %r not published: the ACL no longer lets it write there",
                 client_id, clipped(topic), extra={"client_id": client_id, "event": "will-denied"})
        return False

    def _writable(self, handler: ClientHandler, access: ClientAccess,
                  messages: list[Message]) -> list[Message]:
        """The messages the ACL lets this client publish.  A denied one is acknowledged
        (as mosquitto does: refusing would only make the client resend; with 0x87 for an
        MQTT 5 client) but never routed, so it is neither delivered, retained nor archived."""
        allowed = [m for m in messages if access.may_write(m.topic)]
        if len(allowed) != len(messages):
            for m in messages:
                if not access.may_write(m.topic):
                    self.acl_denied(handler.client_id, "a publish", m.topic)
        return allowed


    # -- disconnects ------------------------------------------------------------------------

    async def connection_lost(self, handler: ClientHandler) -> None:
        """Unbind a connection from its session; publish its will unless it said goodbye."""
        if handler.finished:
            return
        handler.finished = True
        handler.conn.close()
        session = handler.session
        if session is None:
            return  # never got past CONNECT
        client_id = session.client_id
        log.info("client %r disconnected (%s)", client_id,
                 "DISCONNECT" if handler.clean_disconnect
                 else handler.close_reason or "connection closed",
                 extra={"client_id": client_id, "event": "disconnected"})
        if self.clients.get(client_id) is handler:
            del self.clients[client_id]
            self.metrics.clients_connected = len(self.clients)
        if self.wakers.get(client_id) is handler:
            del self.wakers[client_id]
        await self.manager.close(handler)


_CONNACK_FOR = {
    AuthOutcome.ACCEPTED: ConnectReturnCode.ACCEPTED,
    AuthOutcome.NOT_AUTHORIZED: ConnectReturnCode.NOT_AUTHORIZED,
    AuthOutcome.BAD_CREDENTIALS: ConnectReturnCode.BAD_USERNAME_OR_PASSWORD,
    AuthOutcome.RATE_LIMITED: ConnectReturnCode.NOT_AUTHORIZED,
}


class Waker(Protocol):
    def wake(self) -> None: ...

    def kick(self, reason: str = ..., code: int | None = ...) -> None: ...
