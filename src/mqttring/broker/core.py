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

Events of one connection are handled in order by that connection's reader task, so one
client's packets are processed sequentially; different clients proceed concurrently.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
import uuid
from typing import TYPE_CHECKING

from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.router import Router
from mqttring.broker.session_store import SessionStore
from mqttring.config import BrokerConfig
from mqttring.lsm import Durability
from mqttring.protocol.connection import (
    ConnectRequested,
    DisconnectRequested,
    Event,
    PublishReceived,
    SubscribeRequested,
    UnsubscribeRequested,
)
from mqttring.protocol.packets import SUBACK_FAILURE, Connect, ConnectReturnCode
from mqttring.protocol.session import Message, Session, SessionLimits

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler

log = logging.getLogger("mqttring.broker")


class BrokerCore:
    def __init__(
        self, config: BrokerConfig, session_store: SessionStore, metrics: BrokerMetrics
    ) -> None:
        self.config = config
        self.limits = config.limits
        self.session_limits = SessionLimits(
            max_inflight=config.limits.max_inflight,
            max_queued=config.limits.max_queued,
            max_output=config.limits.max_outgoing_buffer,
            message_ttl=config.limits.queued_message_ttl,
        )
        self.session_store = session_store
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        self.clients: dict[str, ClientHandler] = {}
        self.router: Router  # set by the server once the router exists (it needs `wake`)
        self.shutting_down = False

    # -- plumbing used by the router --------------------------------------------------------

    def wake(self, client_id: str) -> None:
        """Tell a client's writer that its session appended output."""
        handler = self.clients.get(client_id)
        if handler is not None:
            handler.wake()

    async def restore_sessions(self) -> int:
        """Load persistent sessions from the store at start-up (all offline)."""
        stored = await self.session_store.load_all()
        restored = []
        for record in stored:
            session = Session(record.client_id, False, self.session_limits)
            session.subscriptions = dict(record.subscriptions)
            session.restore(record.outbound, record.inbound_qos2)
            self.sessions[record.client_id] = session
            restored.append(session)
        restore = getattr(self.router, "restore", None)
        if restore is not None:
            restore(restored)
        return len(restored)

    # -- events -----------------------------------------------------------------------------

    async def handle(self, handler: ClientHandler, events: list[Event]) -> None:
        """Act on one batch of events from a connection, in order."""
        for event in events:
            kind = type(event)
            if kind is PublishReceived:
                await self.on_publish(handler, event)  # type: ignore[arg-type]
            elif kind is ConnectRequested:
                more = await self.on_connect(handler, event.packet)  # type: ignore[union-attr]
                if more:
                    await self.handle(handler, more)
            elif kind is SubscribeRequested:
                await self.on_subscribe(handler, event)  # type: ignore[arg-type]
            elif kind is UnsubscribeRequested:
                await self.on_unsubscribe(handler, event)  # type: ignore[arg-type]
            elif kind is DisconnectRequested:
                handler.clean_disconnect = True
            if handler.conn.closed:
                break
        session = handler.session
        if session is not None and session.persistent and session.has_changes():
            # Acks received, packet ids assigned: progress whose loss only causes a
            # permitted redelivery, so it is written lazily.
            await self.session_store.save_changes([session], Durability.LAZY)

    def _authenticate(self, packet: Connect) -> ConnectReturnCode:
        users = self.config.users
        if packet.username is None:
            if self.config.allow_anonymous:
                return ConnectReturnCode.ACCEPTED
            return ConnectReturnCode.NOT_AUTHORIZED
        if users is None:
            return (
                ConnectReturnCode.ACCEPTED
                if self.config.allow_anonymous
                else (ConnectReturnCode.NOT_AUTHORIZED)
            )
        expected = users.get(packet.username)
        given = hashlib.sha256(packet.password or b"").hexdigest()
        if expected is None or not hmac.compare_digest(expected.lower(), given):
            return ConnectReturnCode.BAD_USERNAME_OR_PASSWORD
        return ConnectReturnCode.ACCEPTED

    async def on_connect(self, handler: ClientHandler, packet: Connect) -> list[Event]:
        conn = handler.conn
        code = self._authenticate(packet)
        if code is not ConnectReturnCode.ACCEPTED:
            conn.refuse(code)
            return []
        client_id = packet.client_id or f"auto-{uuid.uuid4().hex}"
        old = self.clients.get(client_id)
        if old is None and len(self.clients) >= self.limits.max_connections:
            conn.refuse(ConnectReturnCode.SERVER_UNAVAILABLE)
            return []
        if old is not None:
            log.info("takeover of client %r", client_id)
            await self.connection_lost(old)
            old.kick()
        existing = self.sessions.get(client_id)
        if packet.clean_session or existing is None or existing.clean_session:
            if existing is not None:
                self.router.forget(existing)
                del self.sessions[client_id]
                if existing.persistent:
                    await self.session_store.delete(client_id)
            session = Session(client_id, packet.clean_session, self.session_limits)
            present = False
            self.sessions[client_id] = session
            await self.session_store.save_subscriptions(session)
        else:
            session = existing
            present = True
        handler.session = session
        handler.will = packet.will
        self.clients[client_id] = handler
        self.metrics.clients_connected += 1
        self.metrics.connections_total += 1
        dropped = session.dropped
        events = conn.accept(session, present, time.monotonic())
        self.metrics.messages_dropped += session.dropped - dropped  # expired while away
        return events

    async def on_publish(self, handler: ClientHandler, event: PublishReceived) -> None:
        message = event.message
        self.metrics.messages_received += 1
        # Clients may not write the broker's own $SYS tree; the message is acknowledged
        # (refusing it would only make the client resend) and not routed.
        if not message.topic.startswith("$SYS"):
            await self.router.publish(message)
        session = handler.session
        if message.qos == 2 and session is not None and session.persistent:
            # The inbound QoS 2 id must be durable before PUBREC, or a crash would let the
            # client's redelivery be routed a second time.
            await self.session_store.save_changes([session], Durability.DURABLE)
        handler.conn.ack_publish(event.packet_id, message.qos)

    async def on_subscribe(self, handler: ClientHandler, event: SubscribeRequested) -> None:
        session = handler.session
        assert session is not None
        codes: list[int] = []
        granted: list[tuple[str, int]] = []
        for topic_filter, qos in event.topics:
            if (
                topic_filter not in session.subscriptions
                and len(session.subscriptions) >= self.limits.max_subscriptions
            ):
                codes.append(SUBACK_FAILURE)
                continue
            self.router.subscribe(session, topic_filter, qos)
            codes.append(qos)
            granted.append((topic_filter, qos))
        await self.session_store.save_subscriptions(session)
        handler.conn.send_suback(event.packet_id, codes)
        # Retained messages follow the SUBACK [MQTT-3.3.1-6]; one copy per topic even when
        # several new filters match it, at the best QoS any of them grants.
        best: dict[str, tuple[Message, int]] = {}
        for topic_filter, qos in granted:
            for message in await self.router.retained(topic_filter):
                q = min(message.qos, qos)
                seen = best.get(message.topic)
                if seen is None or seen[1] < q:
                    best[message.topic] = (message, q)
        now = time.monotonic()
        for message, q in best.values():
            session.deliver(message, q, True, now)
        self.metrics.messages_sent += len(best)

    async def on_unsubscribe(self, handler: ClientHandler, event: UnsubscribeRequested) -> None:
        session = handler.session
        assert session is not None
        for topic_filter in event.topics:
            self.router.unsubscribe(session, topic_filter)
        await self.session_store.save_subscriptions(session)
        handler.conn.send_unsuback(event.packet_id)

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
        if self.clients.get(client_id) is handler:
            del self.clients[client_id]
            self.metrics.clients_connected -= 1
        if session.output is handler.conn.output:
            session.detach()
        will = handler.will
        handler.will = None
        if session.clean_session:
            if self.sessions.get(client_id) is session:
                self.router.forget(session)
                del self.sessions[client_id]
        elif session.has_changes():
            await self.session_store.save_changes([session], Durability.LAZY)
        if will is not None and not handler.clean_disconnect and not self.shutting_down:
            self.metrics.messages_received += 1
            await self.router.publish(Message(will.topic, will.payload, will.qos, will.retain))
