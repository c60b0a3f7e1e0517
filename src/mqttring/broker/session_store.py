"""Persistent sessions on the node store.

Theory of operation
-------------------
Only CleanSession=0 sessions are stored; a clean session lives and dies with its connection.
Three record kinds, all keyed by ``shard(client id)`` first so that one shard's sessions are
a single range scan (what a shard handoff or an export reads):

* ``sessions``  ``shard | cid``           -> the session's header, ``{"v": 2}`` plus, each
  only when there is something to say, ``"ends": UNIX time`` (its Session Expiry Interval
  runs out then) or, while its client is connected, ``"cut": seconds`` (the interval to
  count from a restart if the node dies first: ``Session.cut_expiry``).
* ``sessions``  ``shard | FFFF | h(cid) | h(filter)`` -> ``[cid, filter, qos]``, or ``[cid,
  filter, qos, bits]`` when the filter has MQTT 5 subscription options
  (``Session.subscription_options``: No Local, Retain As Published, subscription
  identifier; kept while a 3.1.1 client resumed the session).  One row per subscription,
  so that a SUBSCRIBE writes what it changed, not every filter the session holds (a
  whole-record rewrite made subscribing one filter at a time quadratic in bytes written).
  ``h`` is BLAKE2b-128: a client id of up to 499 bytes and a filter of up to 65,535 then
  fit LMDB's 511-byte keys, and the rows sort after every header of their shard (a length
  prefix of ``FFFF`` is longer than any client id may be).  Headers of version 1 carried
  ``"subs": [[filter, qos], ...]`` and ``"opts": {filter: bits}`` inline; they are still
  read, and the session's next save rewrites it in this form.
* ``queues``    ``shard | cid | seq(8)``  -> ``[topic, payload, qos, retain, packet id,
  state, expires_at]``: one outbound QoS 1/2 message, queued or inflight.  ``expires_at`` is
  a wall-clock UNIX timestamp (seconds, float; 0 = never), so it keeps its meaning on the
  node that loads the session next, after a restart, and in an export.  Rows from before
  this rule hold a monotonic deadline; ``StoredSession.to_session`` re-bases them.  A
  message with MQTT 5 properties has an eighth element, ``PublishProps.to_wire()``; 3.1.1
  messages keep the seven-element row.  A QoS 2 message a cluster gave an identity
  (``Message.mid``) has a ninth, that identity (the eighth is then None without
  properties): the session's next owner remembers it, so that a copy a retry brings there
  is not delivered a second time.  A shared subscription's copy (``SharedMessage``) has a
  tenth, its share's filter (the eighth and ninth then None and 0 where unset): loaded
  after a restart or at the session's next home, it still goes by the share's options
  (its Subscription Identifier) and back to the share if the session ends with it.
  A QoS 2 message with an identity that its client completed leaves ``[None, None, 2,
  False, None, 4, completed_at, None, mid]`` under its key (state 4: ``Completed``) for
  ``limits.qos2_dedup_seconds``: the session's next owner remembers that identity too.
* ``inflight``  ``shard | cid | pid(2)``  -> ``mid``: an inbound QoS 2 id between PUBLISH
  and PUBREL, with its message's identity until the PUBREC was sent, ``1`` after (rows from
  before 2026-11-28 were written at PUBREC and hold ``1``; ``Message.mid`` is never 1).

``cid`` is length-prefixed (2 bytes) so that one client's prefix never is a prefix of
another's.  The session (``mqttring.protocol.session.Session``) marks what changed; this
module turns those marks into one batch of puts and deletes.  Durability is the caller's
choice: *durable* before an acknowledgement that promises the data (PUBACK/PUBREC of a queued
message, SUBACK, PUBREC of an inbound QoS 2 id), *lazy* for progress that at worst causes a
permitted redelivery after a crash (a PUBACK received, a packet id assigned).  A PUBREC
received is neither: the PUBREL it calls for is held until its record is durable
(``release_when_stored``), because a crash after the client released the message and before
the record would make the next owner send the PUBLISH again, which QoS 2 forbids.

With no store (``data_dir`` unset) every method is a no-op: sessions are then kept in memory
only, for as long as the process runs.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from hashlib import blake2b

import trio

from mqttring.broker.refusals import WriteCancelled
from mqttring.broker.shard_writes import LocalShardWriter, ShardWriter
from mqttring.broker.shared import SharedMessage
from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.protocol.message import Message
from mqttring.protocol.outbound import Completed
from mqttring.protocol.session import Outbound, OutState, Session, SessionLimits
from mqttring.protocol.session5 import PublishProps, V5Session
from mqttring.ring.hashing import shard_of

log = logging.getLogger("mqttring.session_store")

_SEQ = struct.Struct(">Q")
_PID = struct.Struct(">H")
#: Where a shard's subscription rows start in ``sessions``: no client id is this long.
_SUBSCRIPTIONS = b"\xff\xff"


def _digest(text: str) -> bytes:
    return blake2b(text.encode("utf-8"), digest_size=16).digest()


@dataclass(slots=True)
class StoredSession:
    client_id: str
    subscriptions: dict[str, int]
    outbound: list[Outbound]
    #: Inbound QoS 2 id -> ``mid`` (0: its PUBREC was sent), as ``Session.inbound_qos2``.
    inbound_qos2: dict[int, int]
    #: MQTT 5 subscription options by filter (``V5Session.options``); None: a 3.1.1 session.
    options: dict[str, int] | None = None
    #: MQTT 5: when the (offline) session ends, wall-clock; 0: never.
    ends_at: float = 0.0
    #: ``Session.cut_expiry`` of a session stored while connected (no ``ends_at``).
    cut_expiry: int = 0
    #: (seq, marker) of the QoS 2 messages its client completed lately.
    completed: list[tuple[int, Completed]] = field(default_factory=list)

    def to_session(self, limits: SessionLimits, now: float | None = None,
                   grace: float = 0.0) -> Session:
        """The offline persistent session this record describes.

        ``now`` is the wall-clock load time (``time.time()`` unless given, so tests can pin
        it); legacy monotonic ``expires_at`` values are re-based against it (see
        ``Session.restore``).

        A session stored while its client was connected (no ``ends_at``, a ``cut_expiry``)
        lost that connection when its node died: its expiry interval runs from ``now`` (the
        death is no later), plus ``grace`` where a live client may still be connected to
        another node and registers it again (a cluster's new home: ``moved_session_grace``).
        Before 2026-11-29 such a session never ended (a probe: a 2 s session still present,
        queueing, a minute after the restart).
        """
        now = time.time() if now is None else now
        session = Session(self.client_id, False, limits)
        session.subscriptions = dict(self.subscriptions)
        session.ends_at = self.ends_at
        session.cut_expiry = self.cut_expiry
        if not self.ends_at and self.cut_expiry:
            session.ends_at = now + self.cut_expiry + grace
        if self.options is not None:
            session.v5 = V5Session(self.client_id, 0, dict(self.options))
        session.restore(self.outbound, self.inbound_qos2, now, self.completed)
        return session


class _Flush:
    """One durable write of session changes, for callers whose changes it carries."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class SessionStore:
    def __init__(
        self, store: LsmStore | None, num_shards: int, writer: ShardWriter | None = None
    ) -> None:
        self._store = store
        self._num_shards = num_shards
        self._writer: ShardWriter | None = writer or (
            LocalShardWriter(store) if store is not None else None
        )
        #: client id -> the durable write now carrying its changes (``save_changes``).
        self._flushing: dict[str, _Flush] = {}
        #: ``id()`` of the sessions whose held PUBRELs a ``release_when_stored`` is sending.
        self._releasing: set[int] = set()
        #: Sessions loaded from a version 1 record (subscriptions inline in the header):
        #: their next save rewrites every row.  Every session read from the store is read by
        #: ``load``, so this needs no read on the SUBSCRIBE path.
        self._inline: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self._store is not None

    def shard(self, client_id: str) -> int:
        return shard_of(client_id, self._num_shards)

    def _prefix(self, client_id: str) -> bytes:
        cid = client_id.encode("utf-8")
        return shard_key(self.shard(client_id), _PID.pack(len(cid)) + cid)

    # -- writes -----------------------------------------------------------------------------

    def releasing(self, session: Session) -> bool:
        """Whether a ``release_when_stored`` runs for ``session`` (and will see new PUBRELs)."""
        return id(session) in self._releasing

    async def release_when_stored(self, session: Session, wake: Callable[[str], None]) -> None:
        """Send a persistent session's held PUBRELs once the PUBRECs that called for them
        are stored durably (``Session.on_pubrec``), in order, and ``wake`` its connection.

        One run per session at a time, looping while PUBRECs keep coming; a second caller
        returns at once and the running one sends its PUBRELs too.  A write that fails leaves
        them held (and logged): the session's next PUBREC or connection tries again, and a
        client that waits for a PUBREL never gets one its record could not promise."""
        key = id(session)
        if key in self._releasing:
            return
        self._releasing.add(key)
        try:
            while session.held_releases:
                count = session.take_held_releases()
                try:
                    await self.save_changes([session], Durability.DURABLE)
                except Exception as exc:  # the store failed, or replicas are out of reach
                    log.warning("PUBRELs for %r held: their record was not stored: %s",
                                session.client_id, exc)
                    return
                if session.release(count):
                    wake(session.client_id)
        finally:
            self._releasing.discard(key)

    def _subscriptions_prefix(self, client_id: str) -> bytes:
        return shard_key(self.shard(client_id), _SUBSCRIPTIONS, _digest(client_id))

    def _subscription_op(self, session: Session, prefix: bytes, topic_filter: str,
                         options: dict[str, int] | None) -> Put | Delete:
        key = prefix + _digest(topic_filter)
        qos = session.subscriptions.get(topic_filter)
        if qos is None:
            return Delete("sessions", key)
        row: list[object] = [session.client_id, topic_filter, qos]
        bits = options.get(topic_filter) if options else None
        if bits:
            row.append(bits)
        return Put("sessions", key, row)

    async def save_subscriptions(self, session: Session,
                                 changed: Iterable[str] | None = None) -> None:
        """Durably record the session's header and the subscriptions named in ``changed``
        (before SUBACK/UNSUBACK): a filter the session holds is written, one it does not is
        deleted; ``()`` writes the header alone.  ``None`` rewrites every subscription row
        and deletes stored ones the session no longer has: for a session new to the store,
        whose client id may have left rows behind.  A header still in the version 1 form
        (subscriptions inline) is rewritten whole too."""
        if self._store is None or not session.persistent:
            return
        assert self._writer is not None
        client_id = session.client_id
        key = self._prefix(client_id)
        if client_id in self._inline:
            changed = None  # version 1: its subscriptions live in the header
        header: dict[str, object] = {"v": 2}
        if session.ends_at:
            header["ends"] = session.ends_at
        elif session.cut_expiry:
            header["cut"] = session.cut_expiry
        ops: list[Put | Delete] = [Put("sessions", key, header)]
        prefix = self._subscriptions_prefix(client_id)
        options = session.subscription_options
        if changed is None:
            stored_rows = await self._store.scan("sessions", prefix)
            keep = {prefix + _digest(f) for f in session.subscriptions}
            ops.extend(Delete("sessions", k) for k, _ in stored_rows if k not in keep)
            changed = list(session.subscriptions)
        ops.extend(self._subscription_op(session, prefix, f, options) for f in changed)
        await self._writer.write([(self.shard(client_id), ops)], Durability.DURABLE)
        self._inline.discard(client_id)

    def change_ops(self, session: Session) -> list[Put | Delete]:
        """Turn the session's dirty marks into store operations (and clear the marks)."""
        dirty, qos2 = session.take_changes()
        prefix = self._prefix(session.client_id)
        ops: list[Put | Delete] = []
        for seq, entry in dirty.items():
            key = prefix + _SEQ.pack(seq)
            if entry is None:
                ops.append(Delete("queues", key))
            elif isinstance(entry, Completed):
                ops.append(Put("queues", key, [None, None, 2, False, None,
                                               int(OutState.COMPLETED), entry.at, None,
                                               entry.mid]))
            else:
                msg = entry.message
                row = [
                    msg.topic,
                    msg.payload,
                    entry.qos,
                    entry.retain,
                    entry.packet_id,
                    int(entry.state),
                    entry.expires_at,
                ]
                share = msg.share if type(msg) is SharedMessage else None
                if msg.props is not None or msg.mid or share:
                    row.append(None if msg.props is None else msg.props.to_wire())
                    if msg.mid or share:
                        row.append(msg.mid)
                    if share:
                        # A shared subscription's copy goes by its share's options when it
                        # is sent (its Subscription Identifier), and back to the share
                        # should the session end without acknowledging it.
                        row.append(share)
                ops.append(Put("queues", key, row))
        for pid, mid in qos2.items():
            key = prefix + _PID.pack(pid)
            ops.append(Delete("inflight", key) if mid is None
                       else Put("inflight", key, mid or 1))
        return ops

    async def save_changes(self, sessions: Iterable[Session], durability: Durability) -> None:
        """Write what changed in ``sessions``; with DURABLE, return once it is durable.

        Several tasks persist one session (the delivery that must be durable before its
        PUBACK, the lazy write after the client's acknowledgements), and whichever comes
        first takes all the changes.  So a lazy write that takes a change due to be durable
        writes durably, and a durable call that finds nothing left to take waits for the
        write that took it: acknowledged messages never rest on a lazy write.
        """
        if self._writer is None:
            for session in sessions:
                session.take_changes()
            return
        batches = []
        taken: list[str] = []
        waits: list[_Flush] = []
        for session in sessions:
            if session.has_changes():
                if session.durable_due:
                    durability = Durability.DURABLE
                batches.append((self.shard(session.client_id), self.change_ops(session)))
                taken.append(session.client_id)
            elif durability is Durability.DURABLE:
                flush = self._flushing.get(session.client_id)
                if flush is not None:
                    waits.append(flush)
        if batches:
            if durability is not Durability.DURABLE:
                await self._writer.write(batches, durability)
            else:
                flush = _Flush()
                for client_id in taken:
                    self._flushing[client_id] = flush
                try:
                    await self._writer.write(batches, durability)
                except BaseException as exc:
                    # The callers whose changes it carried must not take them as stored.
                    flush.error = (exc if isinstance(exc, Exception)
                                   else WriteCancelled("the durable write carrying these "
                                                       "changes was cancelled"))
                    raise
                finally:
                    for client_id in taken:
                        if self._flushing.get(client_id) is flush:
                            del self._flushing[client_id]
                    flush.done.set()
        for flush in waits:
            await flush.done.wait()
            if flush.error is not None:
                raise flush.error

    async def delete(self, client_id: str) -> None:
        """Forget a stored session entirely (a clean-session CONNECT replaces it)."""
        if self._store is None or self._writer is None:
            return
        self._inline.discard(client_id)
        prefix = self._prefix(client_id)
        ops: list[Put | Delete] = [Delete("sessions", prefix)]
        for db, rows_prefix in (("sessions", self._subscriptions_prefix(client_id)),
                                ("queues", prefix), ("inflight", prefix)):
            rows = await self._store.scan(db, rows_prefix)
            ops.extend(Delete(db, key) for key, _ in rows)
        await self._writer.write([(self.shard(client_id), ops)], Durability.DURABLE)

    # -- reads ------------------------------------------------------------------------------

    async def load_all(self) -> list[StoredSession]:
        """Every stored session with its messages in sequence order (node start-up)."""
        return await self.load(b"")

    async def load(self, prefix: bytes) -> list[StoredSession]:
        """The stored sessions under ``prefix``, read and decoded in a worker thread."""
        return await self._load_prefixes([prefix])

    async def load_shards(self, shards: Iterable[int]) -> list[StoredSession]:
        """The stored sessions of ``shards`` only, one range scan per shard and database:
        what a node that takes shards over reads (not the whole store; "What a view change
        costs" in docs/design.md).  Read and decoded in a worker thread."""
        return await self._load_prefixes([shard_key(shard) for shard in sorted(shards)])

    async def _load_prefixes(self, prefixes: list[bytes]) -> list[StoredSession]:
        if self._store is None or not prefixes:
            return []
        sessions, inline = await trio.to_thread.run_sync(self._read_prefixes, prefixes)
        self._inline.update(inline)
        return sessions

    def _read_prefixes(self, prefixes: list[bytes]) -> tuple[list[StoredSession], set[str]]:
        """``load``'s reads and decoding (a worker thread: it touches no shared state)."""
        found: list[StoredSession] = []
        inline: set[str] = set()
        for prefix in prefixes:
            found.extend(self._read_prefix(prefix, inline))
        return found, inline

    def _read_prefix(self, prefix: bytes, inline: set[str]) -> list[StoredSession]:
        store = self._store
        assert store is not None
        sessions: dict[bytes, StoredSession] = {}
        rows: list[list] = []
        for key, record in store.scan_sync("sessions", prefix):
            if key[2:4] == _SUBSCRIPTIONS:
                rows.append(record)
                continue
            cid = _client_id(key)
            if "subs" in record:
                inline.add(cid)
            opts = record.get("opts")  # version 1: subscriptions inline
            sessions[key] = StoredSession(
                cid, {f: int(q) for f, q in record.get("subs", ())}, [], {},
                dict(opts) if opts else None, float(record.get("ends", 0.0)),
                int(record.get("cut", 0)))
        for row in rows:
            owner = sessions.get(self._prefix(row[0]))
            if owner is None:
                continue  # orphan of a deleted session
            owner.subscriptions[row[1]] = int(row[2])
            if len(row) > 3:
                if owner.options is None:
                    owner.options = {}
                owner.options[row[1]] = int(row[3])
        for key, value in store.scan_sync("queues", prefix):
            owner = sessions.get(key[:-8])
            if owner is None:
                continue  # orphan of a deleted session
            topic, payload, qos, retain, pid, state, expires_at = value[:7]
            if state == OutState.COMPLETED:
                owner.completed.append((_SEQ.unpack(key[-8:])[0],
                                        Completed(int(value[8]), float(expires_at))))
                continue
            props = PublishProps.from_wire(value[7]) if len(value) > 7 else None
            mid = int(value[8]) if len(value) > 8 else 0
            message = Message(topic, payload, qos, False, props, mid)
            if len(value) > 9:
                message = SharedMessage(message, str(value[9]))
            owner.outbound.append(
                Outbound(
                    _SEQ.unpack(key[-8:])[0],
                    message,
                    qos,
                    retain,
                    pid,
                    OutState(state),
                    expires_at,
                )
            )
        for key, value in store.scan_sync("inflight", prefix):
            owner = sessions.get(key[:-2])
            if owner is not None:
                mid = int(value)  # type: ignore[call-overload]
                owner.inbound_qos2[_PID.unpack(key[-2:])[0]] = 0 if mid == 1 else mid
        return list(sessions.values())


def _client_id(key: bytes) -> str:
    (length,) = _PID.unpack(key[2:4])
    return key[4 : 4 + length].decode("utf-8")
