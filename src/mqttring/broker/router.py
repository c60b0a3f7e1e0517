"""Where a PUBLISH goes: the one seam a cluster replaces.

Theory of operation
-------------------
Every message a client publishes (and every will) enters ``Router.publish``; every
subscription change enters ``subscribe``/``unsubscribe``; retained messages for a new
subscription come from ``retained``.  Connection handlers never look at subscriptions or the
retained store themselves, so a cluster router (which forwards a publish to its shard's owner
and fans out to the nodes with subscribers) drops in without touching the protocol side.

``LocalRouter`` is the single-node answer.  It keeps a ``TopicTrie`` of ``client id ->
granted QoS`` per filter and delivers to ``Session`` objects:

* Overlapping subscriptions of one client deliver once, at the highest granted QoS
  (MQTT 3.3.5 allows either; one copy is what clients expect).  For the client's own MQTT 5
  message, a subscription whose No Local excludes it does not count (``own_grant``).
* Delivered QoS is ``min(publish QoS, granted QoS)`` [MQTT-3.8.4-6].
* Live deliveries carry RETAIN=0 [MQTT-3.3.1-9]; a retained PUBLISH also updates the
  retained store first [MQTT-3.3.1-5].
* ``publish`` returns only when the message is *accepted*: every copy queued for a persistent
  session at QoS >= 1 has been written durably, so the caller's PUBACK/PUBREC promises what
  a crash cannot take back.  Copies for clean sessions and QoS 0 are never written.

The hot path does one trie walk, one dict per publish and one bytes append per subscriber
(QoS 0 PUBLISH bytes are encoded once and shared); it never logs.

Shared subscriptions (``mqttring.broker.shared``) are kept apart from the trie of ordinary
ones (``shared``): ``deliver_local`` never serves them, because in a cluster the owner of
the topic chooses one member cluster-wide and names it (``deliver_to_share``).  One node
chooses itself (``deliver_to_groups``, from ``publish_many``).  With no share on the node
the only cost is ``if self.shared.members``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from mqttring.broker.archive import TelemetryArchive
from mqttring.broker.flow import FlowControl
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shared import (
    Chooser,
    CopyWatch,
    Placed,
    Placement,
    SharedGroups,
    SharedMessage,
    Strategy,
    is_shared,
    orphans,
)
from mqttring.lsm import Durability
from mqttring.protocol.message import Message
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import own_grant
from mqttring.protocol.topics import TopicTrie

#: Topics whose subscriber set is cached (cleared when full or when subscriptions change).
MATCH_CACHE_SIZE = 50_000


class Registration(Protocol):
    """A subscription announced to other nodes whose confirmation is still to come."""

    async def confirmed(self) -> None:
        """Return once the nodes that must know have answered (or failed to: anti-entropy
        repairs what a lost announcement missed)."""

    def abandon(self) -> None:
        """Nobody will wait for the answers (the connection ended first)."""


class Router(Protocol):
    #: The telemetry archive the owner side appends to (None when not configured).
    archive: TelemetryArchive | None
    #: True: a subscription change and a plain QoS 0 publish (not retained, no MQTT 5
    #: properties) never wait for another node, so a connection's reader may hand them to
    #: the core itself (``mqttring.broker.reading``) without going unanswered for long.
    answers_locally: bool

    async def publish(self, message: Message) -> None:
        """Route one application message; returns once it is accepted (see module doc)."""

    async def publish_many(self, messages: Sequence[Message]) -> None:
        """Route what one connection had waiting, in order; returns once all of it is
        accepted (one group commit, one round trip per owner), or raises
        ``PublishRefused`` (``mqttring.broker.refusals``) for the whole batch."""

    async def publish_local(self, message: Message) -> None:
        """Deliver to this node's subscribers only (the node's own ``$SYS`` values)."""

    def subscribe_now(self, session: Session, topic_filter: str, qos: int
                      ) -> Registration | None:
        """Register (or replace [MQTT-3.8.4-3]) one subscription of a session, in the
        caller's turn: here, and announced to the nodes that must know (ahead of anything
        routed after it).  What it returns, if anything, is still to be confirmed by them;
        the SUBACK waits for that, so that it is truthful."""

    def unsubscribe(self, session: Session, topic_filter: str) -> None: ...

    def forget(self, session: Session) -> None:
        """Drop every subscription of a session that is going away."""

    async def retained(self, topic_filter: str,
                       stalled: Callable[[], None] | None = None) -> list[Message]:
        """Retained messages matching a new subscription.  ``stalled`` is called if the
        answer must wait for a failover (a node that holds some of them does not answer)."""


class LocalRouter:
    answers_locally = True

    def __init__(
        self,
        sessions: dict[str, Session],
        retained: RetainedStore,
        session_store: SessionStore,
        metrics: BrokerMetrics,
        wake: Callable[[str], None],
        clock: Callable[[], float] = time.time,
        flow: FlowControl | None = None,
        strategy: Strategy = Strategy.ROUND_ROBIN,
    ) -> None:
        self._sessions = sessions
        self._retained = retained
        self._session_store = session_store
        self._metrics = metrics
        self._wake = wake
        #: Wall clock (UNIX seconds) that stamps queued-message expiry deadlines; they are
        #: stored and exported, so not ``time.monotonic``.  Injectable for tests.
        self._clock = clock
        #: Holds publishers back for congested subscribers; None: never (tests of routing).
        self._flow = flow
        self.subscriptions: TopicTrie[str, int] = TopicTrie()
        #: Set by the server when ``config.archive`` lists topic filters.
        self.archive: TelemetryArchive | None = None
        self._match_cache: dict[str, dict[str, int]] = {}
        #: Members of shared subscriptions on this node, by share.
        self.shared = SharedGroups()
        #: Which member of a share is tried first (``shared_subscription_strategy``).
        self.chooser = Chooser(strategy)
        #: Copies placed here by another node's dispatcher, watched until they are gone.
        self.copies = CopyWatch()
        #: Persistent sessions that got a redispatched copy outside a publish (a member's
        #: session ended); written with the next publish's group commit.
        self._owed_writes: list[Session] = []

    async def publish(self, message: Message) -> None:
        await self.publish_many((message,))

    async def publish_many(self, messages: Sequence[Message]) -> None:
        retained = [m for m in messages if m.retain]
        # Retained state and delivery change in one turn, stored after: a subscription
        # registered between the two found a message both retained and then live (two
        # copies, a probe 20 of 20), or a later message ahead of the retained one.  The
        # PUBACK still waits for the durable write.
        write = self._retained.apply_many(retained) if retained else None
        archive = self.archive
        congested: list[Session] = []
        if len(messages) == 1:
            message = messages[0]
            if archive is not None:
                archive.append(message)
            to_persist = self.deliver_local(message, congested=congested)
            if self.shared.members:
                to_persist += self.deliver_to_groups(message, congested)
        else:
            # One wake per subscriber and one durable write for the whole batch.
            persist: dict[int, Session] = {}  # by id: one write per session (unhashable)
            with self.wakes_deferred():
                for message in messages:
                    if archive is not None:
                        archive.append(message)
                    for session in self.deliver_local(message, congested=congested):
                        persist[id(session)] = session
                    if self.shared.members:
                        for session in self.deliver_to_groups(message, congested):
                            persist[id(session)] = session
            to_persist = list(persist.values())
        if write is not None:
            await self._retained.store(write)
        if self._owed_writes:
            to_persist += self._owed_writes
            self._owed_writes = []
        if to_persist:
            await self._session_store.save_changes(to_persist, Durability.DURABLE)
        if congested:
            await self.hold_back(congested)

    async def hold_back(self, congested: list[Session]) -> None:
        """Return once the congested subscribers have room (``mqttring.broker.flow``)."""
        if self._flow is not None:
            await self._flow.hold_back(congested)

    async def publish_local(self, message: Message) -> None:
        """Node-local traffic ($SYS): kept in memory, never stored."""
        if message.retain:
            await self._retained.update(message, persist=False)
        self.deliver_local(message)

    def deliver_local(self, message: Message, *, clean: bool = True,
                      shards: Container[int] | None = None,
                      congested: list[Session] | None = None) -> list[Session]:
        """Hand ``message`` to matching local sessions; returns those needing a write.

        Sessions left congested by a QoS 1/2 copy are added to ``congested``: the caller
        must ``hold_back`` the publish until they have room.

        By default every matching session.  A cluster names them exactly instead (one copy
        per session however many nodes ask, which QoS 2 needs): clean sessions only if
        ``clean``, persistent ones only of the session shards in ``shards``.
        """
        targets = self._targets(message.topic)
        if not targets:
            return []
        pub_qos = message.qos
        props = message.props
        # The publisher's id when it may have said No Local (MQTT 5, or tagged: 3.1.1 with
        # kept options); None for every other 3.1.1 message.
        origin = props.origin if props is not None else None
        sessions = self._sessions
        wake = self._wake
        now = self._clock()
        to_persist: list[Session] = []
        sent = 0
        for cid, granted in targets.items():
            session = sessions.get(cid)
            if session is None:
                continue
            persistent = not session.clean_session
            if not persistent:
                if not clean:
                    continue
            elif shards is not None and self._session_store.shard(cid) not in shards:
                continue
            if cid == origin:
                # Its own message: a No Local subscription does not bring it, nor its QoS.
                granted = own_grant(session.subscription_options, session.subscriptions,
                                    message.topic, granted)
                if granted < 0:
                    continue
            qos = granted if granted < pub_qos else pub_qos
            dropped = session.dropped
            session.deliver(message, qos, False, now)
            if session.dropped != dropped:
                self._metrics.messages_dropped += session.dropped - dropped
                if not qos:
                    # QoS 0 to a client over its output limit: this very message was
                    # dropped, not sent (a QoS 1/2 drop is an older one making room).
                    continue
            if session.output is not None:
                sent += 1
                wake(cid)
                if qos and congested is not None and session.congested:
                    congested.append(session)
            if qos and persistent:
                to_persist.append(session)
        self._metrics.messages_sent += sent
        return to_persist

    # -- shared subscriptions ---------------------------------------------------------------

    def deliver_to_groups(self, message: Message, congested: list[Session] | None = None,
                          ) -> list[Session]:
        """One node choosing for itself: one member of each matching share gets
        ``message``; returns the sessions needing a write."""
        to_persist: list[Session] = []
        for share in self.shared.match(message.topic):
            session = self.deliver_to_share(message, share, congested=congested).session
            if session is not None and session.persistent and message.qos:
                to_persist.append(session)
        return to_persist

    def deliver_to_share(
        self, message: Message, share: str, *, clean: bool = True,
        shards: Container[int] | None = None, offline_ok: bool = True,
        exclude: str | None = None, congested: list[Session] | None = None,
        origin: tuple[str, int] | tuple[str, int, str] | None = None,
    ) -> Placed:
        """Give ``message`` to one member of ``share`` here, chosen by the strategy among
        the members named (clean sessions if ``clean``, persistent ones of ``shards``, or
        all with ``shards`` None), online ones first; an offline persistent member only if
        ``offline_ok``.  Returns what happened, the session that got it and how many
        online members could have (a cluster weighs this node's turns by it).  ``origin``:
        (dispatcher, token[, witness]) to tell when a copy for a clean member is gone
        (``copies``)."""
        members = self.shared.members.get(share)
        if not members:
            self._metrics.shared_declined += 1
            return Placed(Placement.NO_MEMBER)
        sessions = self._sessions
        topic = message.topic
        ready: list[Session] = []
        offline: list[Session] = []
        for cid in members:
            session = sessions.get(cid)
            if session is None or cid == exclude:
                continue
            if session.clean_session:
                if not clean:
                    continue
            elif shards is not None and self._session_store.shard(cid) not in shards:
                continue
            access = session.access
            if access is not None and not access.may_read(topic):
                continue
            if session.output is not None:
                ready.append(session)
            elif session.persistent:
                offline.append(session)
        # The rotation runs over the members that can take it, so an offline one does not
        # hand its turn to its neighbour.
        if ready:
            chosen = self.chooser.order(share, ready)[0]
        elif not offline:
            self._metrics.shared_declined += 1
            return Placed(Placement.NO_MEMBER)
        elif not offline_ok:
            self._metrics.shared_declined += 1
            return Placed(Placement.OFFLINE_ONLY)
        else:
            chosen = self.chooser.order(share, offline)[0]
        granted = members[chosen.client_id]
        qos = granted if granted < message.qos else message.qos
        dropped = chosen.dropped
        copy = SharedMessage(message, share)
        if origin is not None:
            if chosen.clean_session:
                self.copies.watch(copy, *origin)
            else:  # stored with the session: nothing for the origin to keep
                self.copies.note(*origin)
        chosen.deliver(copy, qos, False, self._clock())
        del copy  # the session holds it now, or nobody: then it is gone at once
        self._metrics.shared_placed += 1
        dropped = chosen.dropped - dropped
        self._metrics.messages_dropped += dropped
        # A QoS 0 drop is this very copy (over the output limit): not sent.
        if chosen.output is not None and not (dropped and not qos):
            self._metrics.messages_sent += 1
            self._wake(chosen.client_id)
        if qos and congested is not None and chosen.congested:
            congested.append(chosen)
        return Placed(Placement.SERVED, chosen, len(ready))

    def take_orphans(self, session: Session) -> list[SharedMessage]:
        """What a session that is ending got through shares and did not acknowledge (see
        ``mqttring.broker.shared.orphans``).  Looked for whatever its subscriptions are now:
        a member that unsubscribed from its share still holds the copies it got before (a
        worker that unsubscribes, then disconnects, on shutdown); only checking sessions
        with a share subscription lost those, acknowledged to their publishers (a probe:
        about 100 of 200)."""
        if not session.inflight and not session.queue:
            return []
        return orphans(session)

    def redispatch(self, lost: list[SharedMessage], exclude: str) -> None:
        """One node: give the copies a member lost (its session ended) to other members of
        their shares, online ones first.  A copy for an offline persistent member is written
        with the next publish's group commit."""
        self._metrics.shared_redispatched += len(lost)
        for message in lost:
            session = self.deliver_to_share(message, message.share, exclude=exclude).session
            if session is not None and session.persistent:
                self._owed_writes.append(session)

    def deliver_frames(
        self,
        topic: str,
        frames: bytes | bytearray | memoryview,
        count: int,
        unpack: Callable[[bytes | bytearray | memoryview], Iterable[Message]],
    ) -> None:
        """Deliver ``count`` QoS 0 messages on one topic, already encoded back to back.

        What a cluster link carries (``mqttring.cluster.wire``): every online subscriber
        gets the run with one append, whatever its granted QoS (a QoS 0 message is
        delivered at QoS 0).  Only an offline persistent session needs ``Message`` objects
        (``unpack(frames)`` builds them, at most once); QoS 0 is never written to the store.
        """
        targets = self._targets(topic)
        if not targets:
            return
        sessions = self._sessions
        wake = self._wake
        sent = dropped = 0
        pending: list[Message] | None = None
        for cid in targets:
            session = sessions.get(cid)
            if session is None:
                continue
            access = session.access
            if access is not None and not access.may_read(topic):
                continue
            before = session.dropped
            if session.deliver_encoded(frames, count):
                if session.dropped == before:  # else the whole run was over the limit
                    sent += count
                    wake(cid)
            elif not session.clean_session or session.output is not None:
                # Offline and persistent (queued), or online but not for these bytes (an MQTT
                # 5 client's v5 encoding, or a 3.1.1 client with kept v5 options).
                if pending is None:
                    pending = list(unpack(frames))
                now = self._clock()
                for message in pending:
                    session.deliver(message, 0, False, now)
                if session.output is not None:  # an online MQTT 5 client: it has output
                    # (QoS 0 each: what it dropped over its output limit was not sent.)
                    sent += count - (session.dropped - before)
                    wake(cid)
            dropped += session.dropped - before
        self._metrics.messages_sent += sent
        if dropped:
            self._metrics.messages_dropped += dropped

    @contextmanager
    def wakes_deferred(self) -> Iterator[None]:
        """Wake each client once when the block ends, not once per delivery in it.

        For a caller that delivers a batch of messages without yielding (a cluster link
        batch): a subscriber of many of them is told once that output is pending.
        """
        wake, pending = self._wake, set()
        self._wake = pending.add
        try:
            yield
        finally:
            self._wake = wake
            for cid in pending:
                wake(cid)

    def _targets(self, topic: str) -> dict[str, int]:
        """client id -> best granted QoS for a topic, cached until subscriptions change
        (telemetry topics repeat; the trie walk is a third of a delivery's cost)."""
        cache = self._match_cache
        targets = cache.get(topic)
        if targets is None:
            targets = {}
            for cid, granted in self.subscriptions.match(topic):
                if targets.get(cid, -1) < granted:
                    targets[cid] = granted
            if len(cache) >= MATCH_CACHE_SIZE:
                cache.clear()
            cache[topic] = targets
        return targets

    def subscribe_now(self, session: Session, topic_filter: str, qos: int) -> None:
        self.add_subscription(session, topic_filter, qos)

    def add_subscription(self, session: Session, topic_filter: str, qos: int) -> None:
        session.subscriptions[topic_filter] = qos
        if is_shared(topic_filter):  # parsed by the core: a malformed one got SUBACK 0x80
            self.shared.add(topic_filter, session.client_id, qos)
            self._metrics.shared_groups = len(self.shared)
            return
        self._match_cache.clear()
        self.subscriptions.add(topic_filter, session.client_id, qos)  # replaces a re-subscribe

    def unsubscribe(self, session: Session, topic_filter: str) -> None:
        if session.subscriptions.pop(topic_filter, None) is None:
            return
        if is_shared(topic_filter):
            self.shared.remove(topic_filter, session.client_id)
            self._metrics.shared_groups = len(self.shared)
            return
        self._match_cache.clear()
        self.subscriptions.remove(topic_filter, session.client_id)

    def drop_subscriptions(self, session: Session) -> None:
        """Take a session's subscriptions out of the lookup structures (it ends, or its
        home moves); ``session.subscriptions`` stays as it is."""
        self._match_cache.clear()
        for topic_filter in session.subscriptions:
            if is_shared(topic_filter):
                self.shared.remove(topic_filter, session.client_id)
            else:
                self.subscriptions.remove(topic_filter, session.client_id)
        self._metrics.shared_groups = len(self.shared)

    def forget(self, session: Session) -> None:
        """A session ends: drop its subscriptions, and what it got through shares without
        acknowledging goes to other members."""
        lost = self.take_orphans(session)
        self.drop_subscriptions(session)
        if lost:
            self.redispatch(lost, session.client_id)

    async def retained(self, topic_filter: str,
                       stalled: Callable[[], None] | None = None) -> list[Message]:
        return self.retained_now(topic_filter)

    def retained_now(self, topic_filter: str) -> list[Message]:
        """``retained``, in the caller's turn (``Subscriptions.subscribe_early``)."""
        return self._retained.matching(topic_filter)

    def retained_current(self, topic: str) -> Message | None:
        """The retained message ``topic`` holds now (the object ``retained_now`` gave)."""
        return self._retained.current(topic)

    def restore(self, sessions: Sequence[Session]) -> None:
        """Re-register the subscriptions of sessions read back from the store."""
        self._match_cache.clear()
        for session in sessions:
            for topic_filter, qos in session.subscriptions.items():
                if is_shared(topic_filter):
                    self.shared.add(topic_filter, session.client_id, qos)
                else:
                    self.subscriptions.add(topic_filter, session.client_id, qos)
        self._metrics.shared_groups = len(self.shared)
