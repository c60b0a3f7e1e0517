"""Who owns a client id: the session lifecycle seam, and its single-node answer.

CONNECT, the end of a connection and the persistence of session progress all go through a
``SessionManager``.  On one node (``LocalSessions``) that is a dictionary and the node store.
In a cluster (``mqttring.cluster.sessions``) the owner of ``shard(client id)`` is the lock
for the id and the home of its persistent session, possibly on another node.  The broker
core (``BrokerCore``) is the same in both cases.

Rules kept here (MQTT 3.1.1):
* a second connection with the same client id closes the first [MQTT-3.1.4-2] and, since
  that close is not a DISCONNECT, publishes its will (MQTT 5: unless the second resumes the
  session, ``takeover_publishes_will``);
* CleanSession=1 discards any previous session [MQTT-3.1.2-6], CleanSession=0 resumes it
  [MQTT-3.1.2-4] (session present set [MQTT-3.2.2-2]);
* a clean session ends with its connection [MQTT-3.1.2-6];
* the will is published on every close that is not a DISCONNECT [MQTT-3.1.2-8] and
  discarded after one [MQTT-3.14.4-3].
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Protocol

from mqttring.broker.id_locks import IdLocks
from mqttring.broker.refusals import PublishRefused
from mqttring.lsm import Durability
from mqttring.protocol.connection5 import V5Link
from mqttring.protocol.message import Message
from mqttring.protocol.packets import Connect, Will
from mqttring.protocol.packets5 import Connect5, Will5
from mqttring.protocol.properties import Properties, PropertyId
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import PublishProps

#: The MQTT 5 Session Expiry Interval that means "never" (section 3.1.2.11.2).
NEVER_EXPIRES = 0xFFFFFFFF
#: Seconds between two scans for expired sessions (``expire_sessions``); a session also
#: counts as gone at a CONNECT of its id past its deadline, whatever the scan.
SESSION_SWEEP_INTERVAL = 2.0


def fresh_start(packet: Connect | Connect5) -> bool:
    """MQTT 5 Clean Start with a session to keep: discard the old one, keep the new."""
    return type(packet) is Connect5 and packet.clean_start and packet.session_expiry > 0


def resume_until_close(packet: Connect | Connect5) -> bool:
    """MQTT 5 Clean Start 0 with a Session Expiry Interval of 0: resume the session kept for
    this client id, if there is one (left by an earlier connection with a non-zero expiry)
    [MQTT-3.1.2-4]; it then ends when this connection closes, the new interval applying from
    now on (3.1.2.11.2) [MQTT-3.1.2-23].  The session layer sees such a CONNECT as "clean"
    (``Connect5.clean_session``: nothing to keep), so this is what tells it to look first."""
    return type(packet) is Connect5 and not packet.clean_start and packet.session_expiry == 0


def will_message(will: Will | Will5, client_id: str) -> Message:
    """The message a will becomes; an MQTT 5 will keeps its properties."""
    props = None
    if type(will) is Will5:
        props = PublishProps.from_properties(will.properties, client_id, time.time())
    return Message(will.topic, will.payload, will.qos, will.retain, props)


def effective_will(will: Will | Will5 | None, link: V5Link | None) -> Will | Will5 | None:
    """The will as it will be kept: an MQTT 5 will's Will Delay Interval bounded by the
    Session Expiry Interval, since the will goes out when the session ends if that comes
    first (section 3.1.3.2.2).  Kept in the will's own properties, so that whoever holds it
    (this node, or a cluster home: ``WillSpec``) reads one number, ``Will5.delay``."""
    if type(will) is not Will5:
        return will
    expiry = link.session_expiry if link is not None else 0
    delay = min(will.delay, expiry)
    if delay == will.delay:
        return will
    props = will.properties.without(PropertyId.WILL_DELAY_INTERVAL)
    if delay:
        props = Properties((*props.items, (PropertyId.WILL_DELAY_INTERVAL, delay)))
    return replace(will, properties=props)


def expiry_at_close(link: V5Link | None, persistent_session_expiry: int) -> int | None:
    """The Session Expiry Interval a persistent session runs on once its connection closes:
    an MQTT 5 client's own; for MQTT 3.1.1, which has none, ``limits.persistent_session_
    expiry`` (mosquitto's ``persistent_client_expiration``), or None (0: kept until its
    client returns, as 3.1.1 says) so that devices gone for good do not keep their sessions
    and queues forever where an operator says so."""
    if link is not None:
        return link.session_expiry
    return persistent_session_expiry or None


def cut_expiry(link: V5Link | None, persistent_session_expiry: int) -> int:
    """``Session.cut_expiry`` for a connection: the expiry interval it would run on had it
    closed now, 0 for "never" (none, or MQTT 5's 0xFFFFFFFF) and for 0 (a session ending
    with its connection has its deadline stored already: ``_end_with_connection``)."""
    expiry = expiry_at_close(link, persistent_session_expiry)
    return expiry if expiry is not None and 0 < expiry < NEVER_EXPIRES else 0


def will_delay(will: Will | Will5) -> int:
    """Seconds a will waits before it is published (0 for a 3.1.1 will)."""
    return will.delay if type(will) is Will5 else 0


def starts_clean(packet: Connect | Connect5) -> bool:
    """Whether this CONNECT starts a new session rather than resuming one: MQTT 5 Clean
    Start, MQTT 3.1.1 CleanSession."""
    return packet.clean_start if type(packet) is Connect5 else packet.clean_session


def takeover_publishes_will(will: Will | Will5, kept: Session | None,
                            starts_clean: bool) -> bool:
    """Whether the will of a connection taken over by another of its client id goes out.

    MQTT 5: not when the new connection resumes the old one's session.  That is "a new
    Network Connection to this Session ... before the Will Delay Interval has passed"
    [MQTT-3.1.3-9], a delay of 0 included, since the new connection came before the old one
    closed; a fleet's "offline" will must not fire because a device reconnected before the
    broker noticed its old connection was dead (mosquitto, HiveMQ alike).  Taken over by a
    Clean Start, the old session ends, and its will goes out after its delay like any other
    (a delay longer than 0 is then cancelled by that very connection [MQTT-3.1.2-8], as
    mosquitto does).  MQTT 3.1.1 has no such rule: the close is not a DISCONNECT, so its
    will goes out [MQTT-3.1.2-8].
    ``kept``: the session the old connection had (at the session's home); resumed when the
    new connection does not ``starts_clean`` and it was to outlive its connection
    (persistent, not ending at its close)."""
    resumed = (not starts_clean and kept is not None and kept.persistent
               and not kept.ends_at)
    return type(will) is not Will5 or not resumed

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler
    from mqttring.broker.core import BrokerCore

log = logging.getLogger("mqttring.broker")


class SessionUnavailable(Exception):
    """The node that must decide on this client id cannot be reached now (CONNACK 3)."""


class Forwarded(Protocol):
    """A SUBSCRIBE or UNSUBSCRIBE forwarded to the node its session lives on: ``wait``
    returns once that node's answer (SUBACK, UNSUBACK) is in the connection's output, or
    raises ``SessionUnavailable`` if it did not answer; ``close`` if it is never awaited
    (the connection ended first)."""

    async def wait(self) -> None: ...

    def close(self) -> None: ...


class SessionManager(Protocol):
    async def open(
        self, handler: ClientHandler, client_id: str, packet: Connect | Connect5
    ) -> tuple[Session, bool]:
        """Take the id (closing any other connection with it); return (session, present)."""

    async def close(self, handler: ClientHandler) -> None:
        """The connection is gone: unbind its session, publish its will if it is owed."""

    async def persist(self, sessions: Iterable[Session], durability: Durability) -> None:
        """Store what changed in these sessions."""

    def forward_subscribe(self, session: Session, packet_id: int,
                          topics: tuple[tuple[str, int], ...],
                          options: tuple[int, ...] | None = None,
                          subscription_id: int = 0) -> Forwarded | None:
        """If the session lives on another node: forward the SUBSCRIBE now, which that
        node answers in the session's own byte stream, and return what to await until the
        SUBACK is in this connection's output (it raises ``SessionUnavailable`` if that
        node did not answer).  None: the broker core handles it here.
        ``options``/``subscription_id``: MQTT 5's, as in ``SubscribeRequested``."""

    def forward_unsubscribe(self, session: Session, packet_id: int,
                            topics: tuple[str, ...]) -> Forwarded | None:
        """As ``forward_subscribe``, for UNSUBSCRIBE."""

    async def expire_sessions(self, now: float) -> int:
        """End the offline sessions of this node whose MQTT 5 Session Expiry Interval ran
        out by ``now`` (wall clock); returns how many."""


class LocalSessions:
    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        #: One CONNECT at a time per client id (``open``).
        self._opening = IdLocks()

    def forward_subscribe(self, session: Session, packet_id: int,
                          topics: tuple[tuple[str, int], ...],
                          options: tuple[int, ...] | None = None,
                          subscription_id: int = 0) -> Forwarded | None:
        return None  # every session of a single node lives here

    def forward_unsubscribe(self, session: Session, packet_id: int,
                            topics: tuple[str, ...]) -> Forwarded | None:
        return None

    async def open(
        self, handler: ClientHandler, client_id: str, packet: Connect | Connect5
    ) -> tuple[Session, bool]:
        """One CONNECT of an id at a time: each looks for the connection to take over,
        then waits for the store (``bind``), and the core registers the winner only when
        this returns.  Unserialized, CONNECTs of one id that came together each found none
        and both stayed connected, one of them a connection nothing was delivered to
        (a probe: 2 of 3 live in 20 of 20 rounds; MQTT-3.1.4-2 asks for one).  The lock is
        given back as this returns, and the core registers the connection before its next
        await, so the next CONNECT of the id finds it and takes it over."""
        async with self._opening.hold(client_id):
            return await self._open(handler, client_id, packet)

    async def _open(
        self, handler: ClientHandler, client_id: str, packet: Connect | Connect5
    ) -> tuple[Session, bool]:
        core = self.core
        old = core.clients.get(client_id)
        if old is not None:
            log.info("takeover of client %r", client_id)
            if old.will is not None and not takeover_publishes_will(
                    old.will, old.session, starts_clean(packet)):
                log.info("will of %r not published: its session resumed at once", client_id)
                old.will = None
            old.close_reason = old.close_reason or "taken over by a new connection"
            old.goodbye(0x8E)  # MQTT 5: "session taken over", before the cleanup closes it
            await core.connection_lost(old)
            old.kick("taken over by a new connection")
        return await self.bind(client_id, packet.clean_session, fresh_start(packet),
                               resume_until_close(packet),
                               cut_expiry(handler.conn.v5,
                                          core.limits.persistent_session_expiry))

    async def bind(self, client_id: str, clean_session: bool, fresh: bool = False,
                   until_close: bool = False, cut: int = 0) -> tuple[Session, bool]:
        """Resume or create the session for a client whose id this node now holds.

        ``fresh``: an MQTT 5 Clean Start with a non-zero Session Expiry Interval, which
        discards the old session but keeps the new one (CleanSession=1 cannot say that).
        ``until_close`` (``resume_until_close``): resume a kept session whatever
        ``clean_session`` says; a session so resumed, or created persistent (a cluster home
        does: the edge cannot know beforehand whether one is kept), ends with this
        connection.  A session whose expiry interval ran out while it was offline is gone.
        ``cut``: ``cut_expiry`` of the connection, kept with the session (and stored).
        """
        core = self.core
        existing = core.sessions.get(client_id)
        if existing is not None and 0 < existing.ends_at <= time.time():
            log.info("session of %r expired (session expiry interval)", client_id)
            fresh = True
        if until_close and not fresh and existing is not None and existing.persistent:
            await self._end_with_connection(existing)
            return existing, True
        if clean_session or fresh or existing is None or existing.clean_session:
            if existing is not None:
                core.router.forget(existing)
                del core.sessions[client_id]
                if existing.persistent:
                    await core.session_store.delete(client_id)
            session = Session(client_id, clean_session, core.session_limits)
            session.cut_expiry = cut
            core.sessions[client_id] = session
            if until_close and session.persistent:
                session.ends_at = time.time()  # see _end_with_connection
            # Every row: also clears subscriptions an earlier life left behind.
            await core.session_store.save_subscriptions(session)
            return session, False
        if existing.ends_at or existing.cut_expiry != cut:
            existing.ends_at = 0.0  # connected again: it no longer runs out
            existing.cut_expiry = cut
            await core.session_store.save_subscriptions(existing, ())
        return existing, True

    async def _end_with_connection(self, session: Session) -> None:
        """A persistent session whose connection's Session Expiry Interval is 0.  The close
        of the connection ends it (``session_expiry_at_close``); its deadline is also set to
        now, stored, so that if this node dies first the session, read back, is ended by
        the sweep instead of kept forever.  No sweep touches it while it is connected
        (``expire_sessions`` skips attached sessions) and a takeover ends it anyway, as
        its connection closes."""
        session.ends_at = time.time()
        await self.core.session_store.save_subscriptions(session, ())

    async def close(self, handler: ClientHandler) -> None:
        session = handler.session
        assert session is not None
        await self.unbind(handler, session)
        await self.publish_will(handler)

    async def unbind(self, handler: ClientHandler, session: Session) -> None:
        core = self.core
        client_id = session.client_id
        if session.output is handler.conn.output:
            session.detach()
        expiry = expiry_at_close(handler.conn.v5, core.limits.persistent_session_expiry)
        if expiry is not None and await self.session_expiry_at_close(session, expiry):
            return
        if session.clean_session:
            if core.sessions.get(client_id) is session:
                core.router.forget(session)
                del core.sessions[client_id]
        elif session.has_changes():
            await core.session_store.save_changes([session], Durability.LAZY)

    async def session_expiry_at_close(self, session: Session, expiry: int) -> bool:
        """A persistent session's connection ended with this Session Expiry Interval in
        force (``expiry_at_close``): keep the session that long (wall clock, so any node and a
        restart agree: ``Session.ends_at``, stored), forever, or, for 0 (a DISCONNECT set
        it), end it now.  True if the session ended."""
        core = self.core
        client_id = session.client_id
        if not session.persistent or core.sessions.get(client_id) is not session:
            return False
        if expiry == 0:
            core.router.forget(session)
            del core.sessions[client_id]
            await core.session_store.delete(client_id)
            return True
        if expiry != NEVER_EXPIRES:
            session.ends_at = time.time() + expiry
            await core.session_store.save_subscriptions(session, ())
        return False

    async def expire_sessions(self, now: float) -> int:
        """See ``SessionManager.expire_sessions``.  A scan of this node's sessions (a cheap
        attribute test each, every ``SESSION_SWEEP_INTERVAL``): expiry deadlines are
        stored with the session, so whichever node holds the session next, after a
        handoff or a restart, ends it on time without any other bookkeeping."""
        core = self.core
        due = [s for s in core.sessions.values() if 0 < s.ends_at <= now and s.output is None]
        ended = 0
        for session in due:
            client_id = session.client_id
            if core.sessions.get(client_id) is not session or not 0 < session.ends_at <= now:
                continue  # it reconnected meanwhile
            log.info("session of %r expired (session expiry interval)", client_id)
            core.router.forget(session)
            del core.sessions[client_id]
            await core.session_store.delete(client_id)
            ended += 1
        return ended

    async def publish_will(self, handler: ClientHandler) -> None:
        # Bounded by the session expiry in force now (a DISCONNECT may have changed it).
        will = effective_will(handler.will, handler.conn.v5)
        handler.will = None
        if will is not None and handler.will_forfeited:
            log.info("will of %r not published: its login was revoked", handler.client_id)
            return
        if will is not None and not handler.clean_disconnect and not self.core.shutting_down:
            access = handler.session.access if handler.session is not None else None
            client_id = handler.client_id or ""
            if access is not None and not self.core.will_allowed_by(access, client_id,
                                                                    will.topic):
                return
            delay = will_delay(will)
            current = self.core.clients.get(handler.client_id or "")
            if delay > 0 and current is not None and current is not handler:
                log.info("will of %r not published: it reconnected within the will delay",
                         handler.client_id)
                return
            if delay > 0:
                log.info("will of %r on %r delayed %d s: %s", handler.client_id, will.topic,
                         delay, handler.close_reason or "closed without DISCONNECT")
                self.core.delayed_wills.schedule(
                    client_id, partial(will_message, will, client_id), delay,
                    None if access is None else (
                        lambda m: self.core.will_allowed_by(access, client_id, m.topic)))
                return
            message = will_message(will, client_id)
            log.info("publishing the will of %r on %r: %s", handler.client_id, will.topic,
                     handler.close_reason or "closed without DISCONNECT",
                     extra={"client_id": handler.client_id, "event": "will"})
            self.core.metrics.messages_received += 1
            try:
                await self.core.router.publish(message)
            except PublishRefused as exc:
                # Handed to its subscribers, but a durable write it shared was cancelled (a
                # takeover closing another connection mid-write).  A client's publish is
                # then not acknowledged and sent again; a will has no sender to resend it,
                # and must not end the connection's close (or the node) with an error.
                log.warning("will of %r on %r handed to its subscribers, but not confirmed "
                            "stored: %s", handler.client_id, will.topic, exc)

    async def persist(self, sessions: Iterable[Session], durability: Durability) -> None:
        await self.core.session_store.save_changes(sessions, durability)
