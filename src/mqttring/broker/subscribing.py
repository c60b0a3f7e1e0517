"""SUBSCRIBE and UNSUBSCRIBE: the checks, the registration, the SUBACK, retained messages.

Apart from the broker core because a subscription has a life of its own between its packet
and its SUBACK, in two steps.  It is *registered* as soon as it is read (``subscribe_early``,
called by the connection's reader when nothing else of that connection is ahead of it,
``ClientHandler._read_ahead``): checked (ACL, quota, a share's syntax), its options set,
added here and announced to the nodes that must know, or forwarded to the session's home.
So a PUBLISH of another client read after it finds it, as on one broker, whatever the
SUBSCRIBEs ahead of it still wait for.  It is *finished* in order by the connection's
acceptor (``on_subscribe``): once the other nodes confirmed and a persistent session's
subscriptions are stored, the SUBACK, then the retained messages [MQTT-3.3.1-6].
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.router import LocalRouter, Registration, Router
from mqttring.broker.session_store import SessionStore
from mqttring.broker.sessions import Forwarded, SessionManager, SessionUnavailable
from mqttring.broker.shared import is_shared, parse_shared
from mqttring.logs import clipped
from mqttring.protocol.connection import SubscribeRequested, UnsubscribeRequested
from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.message import Message
from mqttring.protocol.packets import SUBACK_FAILURE
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import retained_wanted

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler

log = logging.getLogger("mqttring.broker")


#: A retained message for a new subscription: the message, the QoS it goes at, and the
#: filters of the SUBSCRIBE that matched it.
Gathered = tuple[Message, int, tuple[str, ...]]


@dataclass(slots=True)
class EarlySubscribe:
    """A SUBSCRIBE registered as it was read, for ``on_subscribe`` to finish: the filters'
    Retain Handling answers, the SUBACK codes, the registrations still being confirmed
    elsewhere, or ``forwarded`` to the session's home node, which answers it (awaited
    through this: done once the SUBACK is in the connection's output)."""

    replay: list[bool] | None
    codes: list[int]
    registered: list[Registration]
    forwarded: Forwarded | None = None
    #: One node: the retained messages for it, read in the turn it was registered in
    #: (``Subscriptions.acknowledge``); None: gathered when it is acknowledged.
    retained: list[Gathered] | None = None
    #: When it was registered (wall clock): a message delivered live since is not sent
    #: again as a retained one (``Subscriptions.acknowledge``).
    registered_at: float = 0.0

    def abandon(self) -> None:
        for registration in self.registered:
            registration.abandon()
        if self.forwarded is not None:
            self.forwarded.close()  # never awaited: closed, so it is not reported as a leak
            self.forwarded = None


class RetainedReplay(Message):
    """A retained message sent because of a SUBSCRIBE, naming the filters of that
    SUBSCRIBE it is sent for (``session5.V5Session._subscription_ids`` reads
    ``replay_for``).  Stored, it is a plain message again (its identifiers are then those
    of every matching subscription, as for a shared subscription's copy)."""

    __slots__ = ("replay_for",)

    def __init__(self, message: Message, replay_for: tuple[str, ...]) -> None:
        super().__init__(message.topic, message.payload, message.qos, message.retain,
                         message.props, message.mid)
        self.replay_for = replay_for


class Subscriptions:
    def __init__(self, router: Router, manager: SessionManager, session_store: SessionStore,
                 metrics: BrokerMetrics, max_subscriptions: Callable[[], int],
                 wake: Callable[[str], None],
                 acl_denied: Callable[[str | None, str, str], None],
                 suback_retained_wait: Callable[[], float] = lambda: 0.0) -> None:
        self.router = router
        self.manager = manager
        self.session_store = session_store
        self.metrics = metrics
        #: ``limits.max_subscriptions`` as it is now (a SIGHUP may change it).
        self.max_subscriptions = max_subscriptions
        self.wake = wake
        #: Counts and logs a subscription the ACL denied (``mqttring.broker.denials``).
        self.acl_denied = acl_denied
        #: ``limits.suback_retained_wait`` as it is now (see ``acknowledge``).
        self.suback_retained_wait = suback_retained_wait

    def subscribe_early(self, handler: ClientHandler, event: SubscribeRequested
                        ) -> EarlySubscribe:
        """Register a SUBSCRIBE as it is read, before the packets ahead of it are answered
        (``ClientHandler._read_ahead``): forwarded to the session's home, or registered
        here, in the caller's turn.  ``on_subscribe`` finishes it, in order."""
        session = handler.session
        assert session is not None
        forwarded = self.manager.forward_subscribe(session, event.packet_id, event.topics,
                                                   event.options, event.subscription_id)
        if forwarded is not None:
            return EarlySubscribe(None, [], [], forwarded)
        replay = retained_wanted(session, event.topics, event.options)
        registered_at = time.time()
        codes, registered = self.register(session, event.topics, event.options,
                                           event.subscription_id)
        retained = None
        if isinstance(self.router, LocalRouter):
            # Read with the registration, in one turn: a message published after it is
            # delivered live and is not among these; one published before is not live.
            # (Read at the SUBACK instead, one published between the two came twice.)
            lookup = self.router.retained_now
            retained = self._best([(f, q, lookup(f))
                                   for f, q in self._wanted(event.topics, codes, replay)])
        return EarlySubscribe(replay, codes, registered, retained=retained,
                              registered_at=registered_at)

    async def on_subscribe(self, handler: ClientHandler, event: SubscribeRequested) -> None:
        session = handler.session
        assert session is not None
        early = handler.early.pop(id(event), None) if handler.early else None
        if early is None:
            early = self.subscribe_early(handler, event)
        if early.forwarded is not None:
            # The session lives on another node, which answers: the client's next packets
            # are answered once that SUBACK is in the output.
            forwarded, early.forwarded = early.forwarded, None
            await self._home_answered(handler, forwarded)
            return
        codes = early.codes
        await self.registered(session, event.topics, early.registered)

        def send_suback() -> bool:
            handler.conn.send_suback(event.packet_id, codes)
            handler.wake()
            return True

        if early.retained is not None:
            send_suback()
            assert isinstance(self.router, LocalRouter)
            # A topic retained anew since the registration sent its new message live: the
            # older one read then would follow it (out of order), and is left out.
            current = self.router.retained_current
            self._send_retained(session, [g for g in early.retained
                                          if current(g[0].topic) is g[0]])
            return
        await self.acknowledge(session, event.topics, codes, early.replay, send_suback,
                               early.registered_at)

    async def registered(self, session: Session, topics: tuple[tuple[str, int], ...],
                         registered: list[Registration]) -> None:
        """Return once publishes anywhere find the filters ``register`` took, and a
        persistent session's are stored."""
        try:
            for registration in registered:
                await registration.confirmed()
        finally:
            for registration in registered:
                registration.abandon()  # those a cancelled wait never reached
        await self.session_store.save_subscriptions(session, [f for f, _ in topics])

    def register(self, session: Session, topics: tuple[tuple[str, int], ...],
                 options: tuple[int, ...] | None, subscription_id: int
                 ) -> tuple[list[int], list[Registration]]:
        """A SUBSCRIBE's part that acts at once, in the caller's turn: the SUBACK codes,
        and each registration still to be confirmed elsewhere (``Router.subscribe_now``).

        ``options`` (MQTT 5: one subscription options byte per filter) and the
        subscription identifier go to the session's ``V5Session``.  Failure codes are the
        precise v5 ones for a v5 session (0x87 not authorized, 0x97 quota exceeded, 0x8F
        a malformed ``$share/...`` filter) and 0x80 for a 3.1.1 one.
        """
        codes: list[int] = []
        registered: list[Registration] = []
        access = session.access
        v5 = session.v5
        for i, (topic_filter, qos) in enumerate(topics):
            checked = topic_filter
            if is_shared(topic_filter):
                try:
                    checked = parse_shared(topic_filter).filter  # ACLs see the inner filter
                except InvalidTopic as exc:
                    log.info("refused a subscription of %r: %s", session.client_id,
                             clipped(str(exc)))
                    codes.append(SUBACK_FAILURE if v5 is None else 0x8F)  # filter invalid
                    continue
            if access is not None and not access.may_subscribe(checked):
                # mosquitto checks a subscription against read rules; SUBACK 0x80.
                self.acl_denied(session.client_id, "a subscription", topic_filter)
                codes.append(SUBACK_FAILURE if v5 is None else 0x87)
                continue
            if (
                topic_filter not in session.subscriptions
                and len(session.subscriptions) >= self.max_subscriptions()
            ):
                codes.append(SUBACK_FAILURE if v5 is None else 0x97)
                continue
            if v5 is not None:
                v5.set_options(topic_filter, options[i] if options else 0, subscription_id)
            elif session.kept_options:  # a 3.1.1 SUBSCRIBE replaces it, without options
                session.kept_options.pop(topic_filter, None)
            registration = self.router.subscribe_now(session, topic_filter, qos)
            if registration is not None:
                registered.append(registration)
            codes.append(qos)
        return codes, registered

    async def acknowledge(self, session: Session, topics: tuple[tuple[str, int], ...],
                          codes: list[int], replay: list[bool] | None,
                          send_ack: Callable[[], bool], since: float = 0.0) -> None:
        """The SUBACK (``send_ack``: False if it could not be sent, and then nothing
        follows), then the retained messages [MQTT-3.3.1-6], in one turn once they are
        gathered, if that takes at most ``suback_retained_wait``.

        In one turn, because a message published after the client saw its SUBACK must
        reach it after the retained value it follows, and once: gathered after the SUBACK
        (from another node in a cluster), a retained value came after the live message
        that replaced it (a probe, 6 to 12 of 12 rounds), or the same message came twice,
        live and retained.  Not while gathering waits for a failover (a node that holds
        some of them does not answer: until the view names its replicas), and never past
        the bound: the client must not wait that long for its SUBACK, which then leaves
        alone.
        ``since``: when the subscriptions were registered (wall clock); a QoS 2 message
        delivered live since then is not sent again as a retained one (a cluster probe: a
        message published with the SUBSCRIBE came twice, 13 rounds of 20).
        """
        wanted = self._wanted(topics, codes, replay)
        if not wanted:
            send_ack()
            return
        found: list[Gathered] = []
        done = False
        ready = trio.Event()  # gathered, or stalled (waiting for a failover)

        async def gather() -> None:
            nonlocal done
            found.extend(await self._gather(wanted, ready.set))
            done = True
            ready.set()

        acked = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gather)
            with trio.move_on_after(self.suback_retained_wait()):
                await ready.wait()
            if not done:
                log.debug("retained messages for %r not gathered yet (a failover, or slow): "
                          "SUBACK sent first", session.client_id)
                acked = True
                if not send_ack():
                    nursery.cancel_scope.cancel()
                    return
        if acked or send_ack():
            self._send_retained(session, found, since)

    @staticmethod
    def _wanted(topics: tuple[tuple[str, int], ...], codes: list[int],
                replay: list[bool] | None) -> list[tuple[str, int]]:
        """The filters that get retained messages, each with the QoS granted.  ``replay``
        (MQTT 5 Retain Handling) says which; never a shared subscription [MQTT-4.8.2]:
        which member would it be for?"""
        if replay is None:
            replay = [True] * len(topics)
        return [(f, code) for (f, _), code, wanted in zip(topics, codes, replay, strict=True)
                if code <= 2 and wanted and not is_shared(f)]

    async def _gather(self, granted: list[tuple[str, int]],
                      stalled: Callable[[], None] | None = None) -> list[Gathered]:
        """The retained messages matching ``granted`` (``_best``), from the router."""
        return self._best([(f, q, await self.router.retained(f, stalled))
                           for f, q in granted])

    @staticmethod
    def _best(found: list[tuple[str, int, list[Message]]]) -> list[Gathered]:
        """One per topic even when several filters match it, at the best QoS any of them
        grants, with the filters that matched; expired ones are left out."""
        best: dict[str, Gathered] = {}
        now = time.time()  # wall clock: message expiry deadlines are UNIX time
        for topic_filter, qos, messages in found:
            for message in messages:
                if message.props is not None and message.props.expired(now):
                    continue  # MQTT 5 message expiry interval passed [MQTT-3.3.2-5]
                q = min(message.qos, qos)
                seen = best.get(message.topic)
                if seen is None:
                    best[message.topic] = (message, q, (topic_filter,))
                else:
                    best[message.topic] = (message if seen[1] < q else seen[0],
                                           max(q, seen[1]), (*seen[2], topic_filter))
        return list(best.values())

    def _send_retained(self, session: Session, gathered: list[Gathered],
                       since: float = 0.0) -> None:
        """Hand the gathered retained messages to the session, in the caller's turn.

        A session with subscription options gets each as a ``RetainedReplay`` naming the
        filters of this SUBSCRIBE that matched it, so that it carries their Subscription
        Identifiers only, not those of the client's older subscriptions [MQTT-3.3.4-3]
        (before 2026-11-29 it carried every matching subscription's, as mosquitto does
        not)."""
        if not gathered:
            return
        v5 = session.v5
        named = v5 is not None and bool(v5.options)
        now = time.time()
        sent = 0
        for message, q, filters in gathered:
            if since and message.mid and session.delivered_since(message.mid, since):
                continue  # it came live after the subscription was made: once is enough
            dropped = session.dropped
            session.deliver(RetainedReplay(message, filters) if named else message, q, True,
                            now)
            if session.dropped != dropped:
                self.metrics.messages_dropped += session.dropped - dropped
                if not q:
                    continue  # this QoS 0 copy was dropped over the output limit: not sent
            sent += 1
        self.metrics.messages_sent += sent
        self.wake(session.client_id)

    async def on_unsubscribe(self, handler: ClientHandler, event: UnsubscribeRequested) -> None:
        session = handler.session
        assert session is not None
        forwarded = self.manager.forward_unsubscribe(session, event.packet_id, event.topics)
        if forwarded is not None:
            await self._home_answered(handler, forwarded)
            return
        codes = self.unregister(session, event.topics)
        await self.session_store.save_subscriptions(session, event.topics)
        handler.conn.send_unsuback(event.packet_id, codes)

    @staticmethod
    async def _home_answered(handler: ClientHandler, forwarded: Forwarded) -> None:
        """Wait until the session's home wrote its answer; a home that does not answer
        leaves the subscription state unknown here: the client is closed (MQTT 5: 0x89,
        server busy) and finds it out from its session when it reconnects."""
        try:
            await forwarded.wait()
        except SessionUnavailable as exc:
            log.info("closing %r: %s", handler.client_id, exc)
            handler.kick(str(exc), 0x89)

    def unregister(self, session: Session, topics: tuple[str, ...]) -> list[int]:
        """An UNSUBSCRIBE's part that acts at once: the filters dropped here and at the
        nodes that routed them; the UNSUBACK codes.  MQTT 5 reports per filter: 0x11 "no
        subscription existed" (section 3.11.3)."""
        codes = [0 if f in session.subscriptions else 0x11 for f in topics]
        for topic_filter in topics:
            self.router.unsubscribe(session, topic_filter)
        session.forget_options(topics)
        return codes
