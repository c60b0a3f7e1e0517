"""The state of one MQTT session, apart from any connection.

Theory of operation
-------------------
MQTT 3.1.1 separates the *session* (section 3.1.2.4: subscriptions, QoS 1/2 messages sent but
not completely acknowledged, QoS 1/2 messages pending transmission, QoS 2 messages received but
not completely acknowledged) from the *network connection* that carries it.  A persistent
session (CleanSession=0) outlives its connections, and, through the store, the process.

``Session`` is that state and the rules that move messages through it; it does no I/O and
knows nothing of trio, sockets or LMDB:

* ``deliver(message, qos)`` is how a router hands it a message.  QoS 0 goes straight to the
  output when online (or is queued only while the client is away, never persisted); QoS 1/2
  is queued, then moved into the *inflight window* (``max_inflight`` unacknowledged
  messages) with a fresh packet id.  Messages leave the window in the order they entered
  the queue, which is what [MQTT-4.6.0-6] asks of ordered topics.
* ``attach(output)`` binds a connection's output buffer; encoded packets are appended to it.
  On (re)attach, every inflight message is sent again, PUBLISH with DUP=1 or PUBREL for those
  that reached PUBREC [MQTT-4.4.0-1], before any new message (but see access control).
* The client's PUBACK/PUBREC/PUBCOMP move messages on; each freed slot pulls the next queued
  message into the window.
* QoS 2 adds steps both ways (PUBREC/PUBREL/PUBCOMP for ours, inbound packet ids held from
  PUBLISH to PUBREL for the client's): ``qos2.QoS2Handshakes``, which ``Session`` inherits,
  explains them and their crash rules.

MQTT 5.0: ``v5`` (``session5.V5Session``) is set while the client speaks v5 and changes
only how messages are encoded and which are skipped (No Local, expired, too large for the
client); ``ends_at`` is its Session Expiry deadline while offline.  Both are None/0 for a
3.1.1 client, whose deliveries take one extra attribute test.

Access control: ``access`` (None unless the node has an ACL file) answers whether a topic
may reach this client.  It is asked where a message enters the session (``deliver``) and
again where a queued one leaves for the connection (``_pump``), so a message queued before
an ACL change, or while the client's identity was unknown (a session restored from the
store), never reaches a client the current rules do not let read it.  For the same reason
``attach`` drops, rather than sends again, an unacknowledged PUBLISH the connecting client
may not read (it went out before an ACL change, or to another user who had the same client
id): the ACL outranks [MQTT-4.4.0-1], as in mosquitto, which drops such messages on
reconnect.  A PUBREL is still sent, it carries no payload.

Persistence is by *dirty sets*, not callbacks: every change to a persistent session marks the
outbound message (by its sequence number) or the inbound QoS 2 id it touched.  Whoever owns
the store drains them with ``take_changes()`` and writes the latest state of each; several
changes between two drains coalesce into one write.  Clean sessions never mark anything.

Expiry (``SessionLimits.message_ttl``) is in *wall-clock* time: ``Outbound.expires_at`` is a
UNIX timestamp (``time.time()`` seconds), 0 meaning "never".  It is persisted, exported as a
UTC timestamp and read back by whichever node owns the session next, possibly after a reboot,
so a monotonic clock (meaningful only within one process on one host) would not do.  This
module still does no I/O: callers pass the wall-clock ``now``.  Rows written before this rule
held monotonic deadlines; ``restore`` re-bases them (see ``LEGACY_EXPIRY_CUTOFF``).

Invariants: a packet id identifies at most one inflight message; ``inflight`` and ``queue``
hold disjoint messages; ``len(queue) <= max_queued`` (overflow drops the oldest QoS 0 message,
else the oldest QoS 1/2 message, and counts it in ``dropped``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from mqttring.protocol.codec import encode as encode_packet
from mqttring.protocol.codec import encode_publish
from mqttring.protocol.message import Message
from mqttring.protocol.outbound import Completed, Outbound, OutState
from mqttring.protocol.packets import PubRel
from mqttring.protocol.qos2 import QoS2Handshakes
from mqttring.protocol.recent import RecentIds
from mqttring.protocol.session5 import V5Session, retain_flag

#: ``expires_at`` values in (0, this) are taken for monotonic deadlines written before expiry
#: moved to wall-clock time: no UNIX timestamp this small (2001-09-09) is ever written now,
#: and a monotonic clock (seconds since boot) stays far below it.
LEGACY_EXPIRY_CUTOFF = 1_000_000_000.0


@dataclass(slots=True)
class SessionLimits:
    max_inflight: int = 32
    max_queued: int = 1000
    #: Pending output bytes above which QoS 0 deliveries are dropped (slow consumer).
    max_output: int = 4 * 1024 * 1024
    #: How many QoS 2 message identities (``Message.mid``) a session remembers at most, to
    #: take a copy that a cluster's retry delivers again only once (0: none) ...
    qos2_dedup_window: int = 4096
    #: ... and for how long (seconds): as long as a retry can come (``recent.py``).
    qos2_dedup_seconds: float = 30.0
    #: Seconds a queued message may wait for an offline client (0 = forever); deadlines are
    #: wall-clock (``now + message_ttl`` with ``now`` from ``time.time()``).
    message_ttl: float = 0.0
    #: While the client is connected, a full queue takes QoS 1/2 messages past
    #: ``max_queued`` instead of dropping the oldest: the deliverer holds the publisher back
    #: (``congested``; ``mqttring.broker.flow``).  Off: drop as for an offline client.
    hold_when_online: bool = True


class ReadAccess(Protocol):
    def may_read(self, topic: str) -> bool: ...


@dataclass(slots=True)
class Session(QoS2Handshakes):
    client_id: str
    clean_session: bool
    limits: SessionLimits = field(default_factory=SessionLimits)
    #: Subscriptions: topic filter -> granted QoS.
    subscriptions: dict[str, int] = field(default_factory=dict)
    #: Inflight outbound messages by packet id, in the order they were sent.
    inflight: dict[int, Outbound] = field(default_factory=dict)
    #: Waiting messages, oldest first.  A list, not a deque: an empty deque costs ~600 bytes
    #: per session, and the queue is bounded (``max_queued``) and drained in batches.
    queue: list[Outbound] = field(default_factory=list)
    #: Packet ids of inbound QoS 2 messages between PUBLISH and PUBREL -> the message's
    #: ``mid`` until its PUBREC was sent, 0 after (a resend is then answered, not routed).
    inbound_qos2: dict[int, int] = field(default_factory=dict)
    next_seq: int = 1
    next_packet_id: int = 1
    dropped: int = 0
    #: Bound by ``attach``; None while the client is away.
    output: bytearray | None = None
    _dirty: dict[int, Outbound | Completed | None] = field(default_factory=dict)
    #: Inbound QoS 2 ids changed: id -> its ``inbound_qos2`` value, None when released.
    _dirty_qos2: dict[int, int | None] = field(default_factory=dict)
    #: Some change since ``take_changes`` was acknowledged to a client on the promise of
    #: being stored durably (a queued QoS 1/2 message, an inbound QoS 2 id): whoever takes
    #: the changes must write them durably, even a lazy writer that got there first.
    durable_due: bool = False
    #: PUBRELs not sent yet, in PUBREC order: the PUBREC that calls for each is not stored
    #: durably yet (persistent sessions; None: none held).  Sent before, a crash could leave
    #: the session's next owner resending a PUBLISH the client had already released to its
    #: application, which takes it for a new message: a second delivery at QoS 2.  The
    #: store's ``release_when_stored`` writes them and sends them (``take_held_releases``,
    #: ``release``).
    held_releases: list[int] | None = None
    #: Wall clock (UNIX seconds) until which ``limits.max_queued`` drops nothing while the
    #: client is away: the session has just moved to this node (a cluster failover) and its
    #: client, disconnected only for that, is on its way; what was held back for it during
    #: the failover arrives at once and is acknowledged data.  0: the limit applies.
    keep_until: float = 0.0
    #: Packet ids of inflight PUBLISHes not sent again on this connection yet, in order:
    #: more were inflight than the client's window (MQTT 5 Receive Maximum, smaller than on
    #: its last connection) lets out at once [MQTT-3.3.4-7].  Sent, with their ids and DUP,
    #: as acknowledgements free the window and before any queued message (None: none).
    unsent: list[int] | None = None
    #: ``Message.mid`` of the QoS 2 messages delivered lately (None until the first): a
    #: cluster node that retries a delivery whose answer it did not get (the owner refused
    #: after routing, a link failed after the message arrived) makes a second copy, which
    #: is a second message at QoS 2.
    recent_qos2: RecentIds | None = None
    #: (seq, completed at) of the ``Completed`` markers in the store, oldest first (None:
    #: none): each is deleted once a retry of its message can no longer come (``qos2``).
    completed: deque[tuple[int, float]] | None = None
    #: What the client may read (``mqttring.security.acl.ClientAccess``); None: anything.
    #: Set by whoever binds the client's connection; it is not stored.
    access: ReadAccess | None = None
    #: Who the client logged in as (None: anonymous), set with ``access``: a reload that
    #: changes the ACL file gives the session the new file's view of it.  Not stored.
    username: str | None = None
    #: The MQTT 5.0 side (``session5.V5Session``) while the client speaks v5; None: 3.1.1.
    v5: V5Session | None = None
    #: MQTT 5 Session Expiry Interval: the wall-clock time (UNIX seconds) at which this
    #: session, now offline, ends; 0 while connected or when it never expires.
    ends_at: float = 0.0
    #: Seconds the session is to outlive a connection that ends without our seeing it end
    #: (the node died with the client connected): the expiry interval in force at CONNECT
    #: (``limits.persistent_session_expiry`` for 3.1.1); 0 when it never expires.  Stored,
    #: so that a restart starts that count (``StoredSession.to_session``) instead of keeping
    #: the session for ever.
    cut_expiry: int = 0
    #: The v5 subscription options (``V5Session.options``) of a session a 3.1.1 client
    #: resumed: part of the session state, so No Local and Retain As Published still apply
    #: to what it receives (identifiers are not sent on 3.1.1), and a v5 client resuming
    #: later has them again.  None whenever ``v5`` is set (the options live there then).
    kept_options: dict[str, int] | None = None

    @property
    def persistent(self) -> bool:
        return not self.clean_session

    @property
    def subscription_options(self) -> dict[str, int] | None:
        """The v5 subscription options, wherever they live now (what the store keeps)."""
        return self.v5.options if self.v5 is not None else self.kept_options

    def forget_options(self, topic_filters: Iterable[str]) -> None:
        """Unsubscribed filters lose their options (a later SUBSCRIBE brings its own)."""
        options = self.subscription_options
        if options:
            for topic_filter in topic_filters:
                options.pop(topic_filter, None)

    @property
    def online(self) -> bool:
        return self.output is not None

    @property
    def congested(self) -> bool:
        """Connected with ``max_queued`` messages waiting: hold publishers back (unless
        ``hold_when_online`` is off)."""
        return (self.output is not None and len(self.queue) >= self.limits.max_queued
                and self.limits.hold_when_online)

    # -- delivery -------------------------------------------------------------------------

    def deliver(
        self, message: Message, qos: int, retain: bool = False, now: float = 0.0
    ) -> None:
        """Hand over a message to be delivered at ``qos`` (already min'd with the grant).

        ``now`` is wall-clock UNIX seconds (``time.time()``), not a monotonic clock: the
        deadline ``now + message_ttl`` is stored and read on other nodes and after restarts.
        It only matters when a message TTL is configured.
        """
        access = self.access
        if access is not None and not access.may_read(message.topic):
            return
        if qos == 2 and message.mid and self._delivered_before(message.mid, now) and not retain:
            # (A retained copy sent for a new subscription is noted, so that a live copy
            # after it is known, but never refused: it is no retry, and a client that got a
            # message live, then subscribes again, gets it again, retained.)
            return
        v5 = self.v5
        if v5 is not None:
            flag = v5.retain_flag(message, retain, self.subscriptions)
            if flag is None:
                return  # No Local: the client's own message
            retain = flag
        elif self.kept_options:
            flag = retain_flag(self.client_id, self.kept_options, message, retain,
                               self.subscriptions)
            if flag is None:
                return
            retain = flag
        out = self.output
        if qos == 0:
            if out is not None:  # deliver_encoded inlined: this runs once per subscriber
                if len(out) > self.limits.max_output:
                    self.dropped += 1
                    return
                if v5 is None:
                    out += message.encode_qos0(retain)
                else:
                    v5.send(out, message, 0, retain, False, None)
                return
            if self.clean_session:
                return
        limits = self.limits
        if (out is not None and v5 is None and not self.queue and message.props is None
                and not limits.message_ttl and len(self.inflight) < limits.max_inflight
                and self.unsent is None):
            # Nothing waits ahead of it and the window has room: straight to the wire, as
            # ``_pump`` would send it, without the trip through the queue (the common case
            # of a subscriber that keeps up; a third of this method's cost).
            entry = Outbound(self.next_seq, message, qos, retain)
            self.next_seq += 1
            self._launch(entry, self._allocate_packet_id(), out)
            if not self.clean_session:
                self.durable_due = True
            return
        entry = Outbound(self.next_seq, message, qos, retain)
        if self.limits.message_ttl > 0:
            entry.expires_at = now + self.limits.message_ttl
        props = message.props
        if props is not None and props.expires_at and (
                not entry.expires_at or props.expires_at < entry.expires_at):
            entry.expires_at = props.expires_at  # MQTT 5 message expiry interval
        self.next_seq += 1
        if (out is None or not self.limits.hold_when_online) and now >= self.keep_until:
            self._make_room()
        self.queue.append(entry)
        if qos and not self.clean_session:
            self._dirty[entry.seq] = entry
            self.durable_due = True
        if out is not None and qos and len(self.inflight) < self.limits.max_inflight:
            self._pump(out)

    def delivered_since(self, mid: int, since: float) -> bool:
        """Whether the QoS 2 message ``mid`` was delivered live at ``since`` (wall clock)
        or later: a new subscription's retained copy of it is then the same message twice
        (``Subscriptions.acknowledge``)."""
        recent = self.recent_qos2
        return recent is not None and recent.came_since(mid, since)

    def _delivered_before(self, mid: int, now: float) -> bool:
        """Whether the QoS 2 message ``mid`` came lately (``RecentIds``); notes it."""
        recent = self.recent_qos2
        if recent is None:
            limits = self.limits
            if limits.qos2_dedup_window <= 0:
                return False
            recent = self.recent_qos2 = RecentIds(limits.qos2_dedup_window,
                                                  limits.qos2_dedup_seconds)
        return recent.seen_before(mid, now)

    def deliver_encoded(self, frames: bytes | bytearray | memoryview, count: int) -> bool:
        """Hand over ``count`` QoS 0 PUBLISHes already encoded back to back.

        Only an online 3.1.1 session can take them as bytes; False means it is offline (or
        speaks MQTT 5) and the caller must ``deliver`` them one ``Message`` at a time
        (queued or discarded as the session's rules say).  The output limit is checked
        once for the whole run, so it may be exceeded by at most one run, as it may by one
        large PUBLISH.
        """
        out = self.output
        if out is None or self.v5 is not None or self.kept_options:
            # (An MQTT 5 client needs v5 PUBLISHes, and kept v5 options may change the
            # RETAIN flag or skip a message: one ``deliver`` each.)
            return False
        if len(out) > self.limits.max_output:
            self.dropped += count
        else:
            out += frames
        return True

    def expire(self, now: float) -> int:
        """Drop queued (not inflight) messages past their deadline; returns how many.

        ``now`` is wall-clock UNIX seconds, the clock ``deliver`` stamped deadlines with.
        """
        if not self.queue:
            return 0
        kept: list[Outbound] = []
        expired = 0
        for entry in self.queue:
            if 0 < entry.expires_at <= now:
                expired += 1
                self._forget(entry)
            else:
                kept.append(entry)
        self.queue = kept
        self.dropped += expired
        return expired

    def _make_room(self) -> None:
        if len(self.queue) < self.limits.max_queued:
            return
        victim = next((e for e in self.queue if e.qos == 0), None) or self.queue[0]
        self.queue.remove(victim)
        self._forget(victim)
        self.dropped += 1

    def _forget(self, entry: Outbound) -> None:
        if entry.qos and not self.clean_session:
            self._dirty[entry.seq] = None

    def _allocate_packet_id(self) -> int:
        pid = self.next_packet_id
        inflight = self.inflight
        while pid in inflight:
            pid = pid % 0xFFFF + 1
        self.next_packet_id = pid % 0xFFFF + 1
        return pid

    def _launch(self, entry: Outbound, pid: int, out: bytearray | None) -> None:
        """Make ``entry`` inflight under ``pid``, and write its 3.1.1 PUBLISH to ``out``
        (None: already written); from the queue (``_pump``) or straight from ``deliver``."""
        entry.packet_id = pid
        entry.state = OutState.AWAIT_PUBACK if entry.qos == 1 else OutState.AWAIT_PUBREC
        self.inflight[pid] = entry
        if not self.clean_session:
            self._dirty[entry.seq] = entry
        if out is not None:
            message = entry.message
            out += encode_publish(message.topic_bytes, message.payload, entry.qos,
                                  entry.retain, False, pid)

    def _pump(self, out: bytearray) -> None:
        queue = self.queue
        inflight = self.inflight
        window = self.limits.max_inflight
        access = self.access
        v5 = self.v5
        taken = 0
        if self.unsent is not None:
            self._send_unsent(out)
        for entry in queue:
            if entry.qos and len(inflight) >= window:
                break
            taken += 1
            if access is not None and not access.may_read(entry.message.topic):
                self._forget(entry)  # queued before an ACL change, or before we knew who
                continue
            if entry.qos == 0:
                if v5 is None:
                    out += entry.message.encode_qos0(entry.retain)
                else:
                    v5.send(out, entry.message, 0, entry.retain, False, None)
                continue
            pid = self._allocate_packet_id()
            if v5 is None:
                self._launch(entry, pid, out)
            elif v5.send(out, entry.message, entry.qos, entry.retain, False, pid):
                self._launch(entry, pid, None)  # (the v5 PUBLISH is written already)
            else:
                self._forget(entry)  # expired, or too large for the client: as if sent
        if taken:
            del queue[:taken]

    # -- connection lifecycle ---------------------------------------------------------------

    def attach(self, output: bytearray, now: float = 0.0) -> None:
        """Bind a new connection: resend everything inflight, then fill the window.

        Queued messages whose deadline is at or before ``now`` (wall-clock UNIX seconds) are
        dropped first; with the default 0 nothing expires.
        """
        self.output = output
        self.expire(now)
        held = self.held_releases
        inflight = self.inflight
        # In the order first sent [MQTT-4.6.0-1], as far as the window goes (every message
        # awaiting PUBCOMP counts); the rest wait in ``unsent``.
        room = self.limits.max_inflight - sum(
            1 for e in inflight.values() if e.state == OutState.AWAIT_PUBCOMP)
        unsent: list[int] = []
        dropped: list[int] = []
        for pid, entry in inflight.items():
            if entry.state == OutState.AWAIT_PUBCOMP:
                # Only the PUBREL goes again: no payload, and the client holds the id.  One
                # whose PUBREC is not stored yet waits for ``release``.
                if held is None or pid not in held:
                    output += encode_packet(PubRel(entry.packet_id))  # type: ignore[arg-type]
            elif room <= 0 or unsent:
                unsent.append(pid)
            elif self._resend(entry, output):
                room -= 1
            else:
                dropped.append(pid)
        for pid in dropped:
            self._forget(inflight.pop(pid))
        self.unsent = unsent or None
        self._pump(output)

    def _resend(self, entry: Outbound, out: bytearray) -> bool:
        """Write an inflight PUBLISH again (DUP, its packet id); False if it is to be
        dropped instead."""
        if self.access is not None and not self.access.may_read(entry.message.topic):
            return False  # sent before an ACL change, or to another identity
        if self.v5 is not None:
            # An inflight copy is resent even past its expiry: its onward delivery started
            # [MQTT-3.3.2-5].  Only a client that now accepts smaller packets can refuse it:
            # dropped as if delivered [MQTT-3.1.2-25].
            return self.v5.send(out, entry.message, entry.qos, entry.retain, True,
                                entry.packet_id, resend=True)
        out += entry.message.encode(entry.qos, entry.retain, True, entry.packet_id)
        return True

    def _send_unsent(self, out: bytearray) -> None:
        """Send inflight PUBLISHes again (``unsent``), in order, as far as the window
        goes; the window counts every inflight message not waiting in ``unsent``."""
        inflight = self.inflight
        # Those acknowledged meanwhile (a client may answer a copy it kept) are not waiting.
        unsent = [pid for pid in self.unsent or ()
                  if pid in inflight and inflight[pid].state != OutState.AWAIT_PUBCOMP]
        room = self.limits.max_inflight - (len(inflight) - len(unsent))
        sent = 0
        for pid in unsent:
            if room <= 0:
                break
            sent += 1
            if self._resend(inflight[pid], out):
                room -= 1
            else:
                self._forget(inflight.pop(pid))
        del unsent[:sent]
        self.unsent = unsent or None

    def detach(self) -> None:
        self.output = None

    # -- acknowledgements from the client ---------------------------------------------------

    def on_puback(self, packet_id: int, pump: bool = True) -> bool:
        """A PUBACK freed a window slot.  ``pump=False``: the caller calls ``pump`` once
        after a run of acknowledgements (a connection's read), so the queue is refilled
        (and shifted) once per read rather than once per acknowledgement."""
        entry = self.inflight.get(packet_id)
        if entry is None or entry.state != OutState.AWAIT_PUBACK:
            return False  # unknown id: ignore, as a late ack after a resend can be legal
        del self.inflight[packet_id]
        self._forget(entry)
        if pump and self.output is not None:
            self._pump(self.output)
        return True

    def pump(self) -> None:
        """Fill the inflight window from the queue (see ``on_puback``)."""
        if self.output is not None and (self.queue or self.unsent is not None):
            self._pump(self.output)

    # -- persistence ------------------------------------------------------------------------

    def has_changes(self) -> bool:
        return bool(self._dirty or self._dirty_qos2)

    def take_changes(self) -> tuple[dict[int, Outbound | Completed | None],
                                    dict[int, int | None]]:
        """Hand the store what changed since the last call: seq -> message (None = gone,
        ``Completed``: its marker), and inbound QoS 2 id -> its ``inbound_qos2`` value
        (None = released)."""
        dirty, qos2 = self._dirty, self._dirty_qos2
        self._dirty, self._dirty_qos2 = {}, {}
        self.durable_due = False
        return dirty, qos2

    def restore(
        self, entries: list[Outbound], inbound_qos2: Mapping[int, int], now: float = 0.0,
        completed: Iterable[tuple[int, Completed]] = (),
    ) -> None:
        """Rebuild state read back from the store (entries in sequence order).

        ``now`` is the wall-clock load time (UNIX seconds).  Entries stored before expiry was
        wall-clock carry a monotonic deadline (``0 < expires_at < LEGACY_EXPIRY_CUTOFF``),
        which means nothing on this host or after a restart: taken literally, every one would
        be long expired.  Their age is unknown, so they are re-based to ``now + message_ttl``
        (a full TTL from load), or to 0 (never) when no TTL is configured; the re-based
        entries are marked changed so the next write of the session persists the new
        deadline and a later load does not extend it again.  With ``now`` 0 (no clock given)
        nothing is re-based.

        ``completed``: the ``Completed`` markers stored, by seq.  Their identities are
        remembered like those of the messages held (a retry's copy is not a new message),
        and a marker past its time is deleted (with ``now`` 0, only beyond the count).
        """
        ttl = self.limits.message_ttl
        for entry in entries:
            if now > 0 and 0 < entry.expires_at < LEGACY_EXPIRY_CUTOFF:
                entry.expires_at = now + ttl if ttl > 0 else 0.0
                if self.persistent:
                    self._dirty[entry.seq] = entry
            if entry.packet_id is not None and entry.state != OutState.QUEUED:
                self.inflight[entry.packet_id] = entry
            else:
                entry.state = OutState.QUEUED
                entry.packet_id = None
                self.queue.append(entry)
            self.next_seq = max(self.next_seq, entry.seq + 1)
        if self.inflight:
            self.next_packet_id = max(self.inflight) % 0xFFFF + 1
        self.inbound_qos2 = dict(inbound_qos2)
        # The QoS 2 messages it holds came before: a retry's copy of one is not a new one.
        for entry in entries:
            if entry.qos == 2 and entry.message.mid:
                self._delivered_before(entry.message.mid, now)
        for seq, marker in sorted(completed, key=lambda item: item[1].at):
            self.next_seq = max(self.next_seq, seq + 1)  # never a new message's key
            if self.persistent:
                self.note_completed(seq, marker.at, now or marker.at)
            if not now or marker.at >= now - self.limits.qos2_dedup_seconds:
                self._delivered_before(marker.mid, now)
