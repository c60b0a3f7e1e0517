"""The trio adapter of one client connection: a reader, an acceptor, and a writer while needed.

The reader feeds bytes to the sans-IO ``ServerConnection``, which applies what needs no
decision at once (the client's PUBACK/PUBREC/PUBCOMP of our deliveries, PUBREL); the
events it returns (PUBLISH, SUBSCRIBE, ..., PINGREQ: its PINGRESP must not overtake the
answers due before it, ``answer_ping``) go, in order, to the acceptor task, which
hands them to ``BrokerCore`` one batch at a time (the acceptor runs only while there are
events, like the writer while there is output).  So a connection whose publish waits (for
its shard's owner, a group commit, or a congested subscriber: ``mqttring.broker.flow``)
still reads the acknowledgements that free its own session's window; the reader runs at
most ``publish_window`` events (or ``publish_window_bytes`` of payload) ahead of the
acceptor and then stops reading, which is the back-pressure a publisher feels.  The
acceptor takes everything that waits as one batch, and the core accepts consecutive
PUBLISHes of a batch together (one round trip per owner, one group commit), so a client
with many publishes in flight is not held to one round trip per message: while one batch
is being accepted the next one gathers.  Batches are accepted one
after another and acknowledged in order, so PUBACK/PUBREC leave in the order the PUBLISHes
came [MQTT-4.6.0-2/3] and messages keep their order.  Events that never wait for this
connection's next packets (QoS 0 publishes, subscriptions: ``_handled_inline``) the reader of
a single node hands to the core itself while no acceptor is busy, a scheduler pass less per
QoS 0 message (a cluster node's subscription waits for other nodes: its acceptor does it).

A writer task is started when output appears and ends when the buffer is
empty; it sends everything queued while it was busy (many deliveries, acks) in one write.
A TCP connection quiet both ways for ``park_idle_after`` gives up even its reader task
(``mqttring.broker.parking``): ``run`` returns without closing, and the parking lot runs it
again on the next byte, delivery (``wake``), close (``kick``) or keepalive expiry, so an
idle connection costs its state and no task (which matters at 10,000 connections).
Deliveries never wait for a socket: routers append to the buffer and call ``wake``; a slow
reader only grows its own buffer, where the session drops QoS 0 past the configured limit
and the inflight window bounds QoS 1/2, so one slow client costs at most
``max_outgoing_buffer + max_inflight x message size`` and never blocks anyone else.  A client
that stops reading *and* sending is closed by the keepalive timeout.

Timeouts run while the reader waits for bytes: ``connect_timeout`` until CONNECT arrives,
then 1.5 x keepalive [MQTT-3.1.2-24] (none for keepalive 0; the keepalive in force: a v5
client told a Server Keep Alive is held to that); none while the acceptor has events to
handle (a client waiting for our PUBACK owes us no packet).  A read only notes when it
started waiting; the node's ``ConnectionTimers`` looks at the connection when a timeout
could be due (``on_timer``) and cancels its scope, or parks it: a trio deadline restarted
on every read cost a fifth of a QoS 0 message's path (``mqttring.broker.timers``).
"""

from __future__ import annotations

import contextlib
import logging
import math

import trio

from mqttring.broker.core import BrokerCore
from mqttring.broker.parking import ParkingLot
from mqttring.broker.subscribing import EarlySubscribe
from mqttring.broker.timers import ConnectionTimers
from mqttring.broker.transport import TcpTransport, Transport
from mqttring.lsm import StoreError
from mqttring.protocol.connection import (
    ConnState,
    Event,
    PingRequested,
    PublishReceived,
    ServerConnection,
    SubscribeRequested,
    UnsubscribeRequested,
)
from mqttring.protocol.errors import MQTTError
from mqttring.protocol.packets import Will
from mqttring.protocol.session import Session

log = logging.getLogger("mqttring.client")

FINAL_FLUSH_SECONDS = 5.0


class ClientHandler:
    __slots__ = (
        "__weakref__",
        "_accepting",
        "_active",
        "_busy",
        "_busy_bytes",
        "_closing",
        "_connect_deadline",
        "_due",
        "_farewell",
        "_nursery",
        "_park_after",
        "_park_requested",
        "_parked",
        "_parking",
        "_pending",
        "_pending_bytes",
        "_ping_timer",
        "_pings",
        "_progress",
        "_quiet_since",
        "_receiving",
        "_resume_deadline",
        "_tcp",
        "_timer_at",
        "_timers",
        "_turns",
        "_unread",
        "_unregistered",
        "_writing",
        "clean_disconnect",
        "client_id",
        "close_reason",
        "conn",
        "connected_at",
        "core",
        "early",
        "finished",
        "owed_will",
        "session",
        "token",
        "transport",
        "will",
    )

    def __init__(self, core: BrokerCore, transport: Transport, timers: ConnectionTimers,
                 parking: ParkingLot | None = None) -> None:
        self.core = core
        self.transport = transport
        #: Who looks at this connection when a receive timeout could be due (``_arm``).
        self._timers = timers
        #: Where this connection goes while idle (``mqttring.broker.parking``); None: never.
        self._parking = parking
        self._parked = False
        #: Arrival order with connections moving in or out of the lot (``broker/arrival.py``).
        self._turns = parking.turns if parking is not None else None
        #: Quiet seconds after which the connection parks (0: never).
        self._park_after = core.limits.park_idle_after if parking is not None else 0.0
        #: The timers cancelled this stretch to park it (not a timeout).
        self._park_requested = False
        #: Bytes read as that happened: the next stretch handles them.
        self._unread: bytes | None = None
        #: The reader waits for bytes (the only time a timeout may end the connection).
        self._receiving = False
        #: When the current wait for bytes started, and when it times out (inf: never).
        self._quiet_since = 0.0
        self._due = math.inf
        #: The time of this connection's live entry in the timers (inf: none).
        self._timer_at = math.inf
        #: A TCP socket can be written without waiting (``wake``).
        self._tcp = isinstance(transport, TcpTransport)
        #: Bytes moved either way since the idle timer started (a connection parks only
        #: after a whole quiet ``park_idle_after``).
        self._active = False
        #: The keepalive deadline a parked connection resumes with.
        self._resume_deadline: float | None = None
        self.conn = ServerConnection(core.limits.max_packet_size, core.limits5,
                                     core.limits.max_keepalive,
                                     core.limits.max_client_id_bytes)
        self.session: Session | None = None
        self.client_id: str | None = None
        #: UNIX time the CONNECT was accepted (0 before): the HTTP API's "connected since".
        self.connected_at = 0.0
        #: Identifies this connection to the client id's home node (cluster), so that a late
        #: message about an older connection with the same id is recognised and ignored.
        self.token = ""
        self.will: Will | None = None
        self.clean_disconnect = False
        #: Why the connection ended, for the log line (the first reason given wins).
        self.close_reason = ""
        self.finished = False
        #: Decided once when the connection ends: whether its will is owed (it closed
        #: without DISCONNECT, and not because the broker is shutting down).
        self.owed_will = False
        self._writing = False
        #: MQTT 5: a DISCONNECT saying why we close is queued (``goodbye``); ``_close``
        #: makes sure it is written, whatever cancelled the tasks that would have.
        self._farewell = False
        #: Events read and not yet handled (the acceptor's backlog, at most the window),
        #: and the payload bytes of those that are publishes.
        self._busy = 0
        self._busy_bytes = 0
        self._pending_bytes = 0
        self._connect_deadline = math.inf
        #: Events read, waiting for the acceptor (a task only while there are any).  Plain
        #: attributes, created when needed: 10,000 idle connections pay for none of it.
        self._pending: list[Event] = []
        self._accepting = False
        #: Of those (and of the batch the acceptor is handling), how many the reader did not
        #: register at once: a SUBSCRIBE is registered as it is read only when none is ahead
        #: of it (``_read_ahead``).
        self._unregistered = 0
        #: SUBSCRIBEs registered as they were read, by id of their event, for the acceptor to
        #: finish (``Subscriptions.on_subscribe``); None while there are none.
        self.early: dict[int, EarlySubscribe] | None = None
        #: PINGREQs waiting for the answers ahead of them, and the bound on that wait
        #: (``limits.pingresp_wait``, ``_ping_behind``); None while there are none.
        self._pings: list[PingRequested] | None = None
        self._ping_timer: trio.CancelScope | None = None
        #: Set when the acceptor handled a batch or stopped, for whoever waits for that.
        self._progress: trio.Event | None = None
        #: The core closed the connection: end it once the output is flushed.
        self._closing = False
        self._nursery: trio.Nursery | None = None

    def wake(self) -> None:
        """Output is pending: write it now if the socket takes it all, else make sure a
        writer task is draining it.

        Writing here, in the task that produced the output, saves a delivery the start of a
        writer task and a pass of the scheduler (latency), and a batch's deliveries still
        leave in one write per subscriber (routers wake each subscriber once per batch).
        """
        if self._parked:
            self._unpark()  # its task comes back and starts the writer
            return
        if self._writing or self._nursery is None:
            return
        if self._tcp:
            conn = self.conn
            try:
                sent = conn.send_into(self.transport.send_now)  # type: ignore[attr-defined]
            except OSError as exc:
                log.debug("connection %s: write failed: %s", self.transport.peer, exc)
                self.kick(f"write failed: {exc}")
                return
            if sent:
                self.core.metrics.bytes_sent += sent
                self._active = True
            if not conn.pending_output:
                if self._closing:
                    self._end()
                return
        if self._park_requested:
            # The stretch is being cancelled to park: a writer started in it would be
            # cancelled with bytes in hand.  ``run`` finds the output and serves on.
            return
        try:
            self._nursery.start_soon(self._writer)
        except RuntimeError:
            return  # the connection is shutting down; there is nobody left to write to
        self._writing = True

    def release_soon(self) -> None:
        """Have the session's held PUBRELs sent once their PUBRECs are stored durably
        (``SessionStore.release_when_stored``), unless that runs already.  A task of this
        stretch: the connection does not park while PUBRELs are held (``_idle``), and one
        that ends leaves them to its session's next connection."""
        session = self.session
        store = self.core.session_store
        if (session is None or not session.held_releases or self._nursery is None
                or store.releasing(session)):
            return
        try:
            self._nursery.start_soon(store.release_when_stored, session, self.core.wake)
        except RuntimeError:
            return  # the connection is shutting down; its next one sends them

    def _end(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def kick(self, reason: str = "closed by the broker", code: int | None = None) -> None:
        """Close this connection now (takeover, slow consumer, shutdown); ``code``: the
        MQTT 5 reason its client is told in a DISCONNECT (``goodbye``; none: just closed)."""
        if code is not None:
            self.goodbye(code)
        self.close_reason = self.close_reason or reason
        self.conn.close()
        if self._parked:
            self._unpark()  # its task comes back, finds it closed, and ends it
        elif self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def goodbye(self, reason_code: int) -> None:
        """MQTT 5: queue DISCONNECT with ``reason_code``; nothing for a 3.1.1 client.

        Always followed by a close, so ``_close`` writes it once the connection's task has
        stopped.  Not woken here: a writer task started now would take the bytes and then be
        cancelled by the close before sending them (a WebSocket client then saw no
        DISCONNECT at all)."""
        if self.conn.v5 is not None and not self.conn.closed:
            self.conn.disconnect(reason_code)
            self._farewell = True

    def _unpark(self) -> None:
        assert self._parking is not None
        self._parking.resume(self, self.transport.fileno())  # type: ignore[attr-defined]

    async def run(self) -> None:
        """Serve the connection until it ends, or until it parks (idle: its task ends and
        the parking lot runs this again when there is something to do)."""
        core = self.core
        resumed, self._parked = self._parked, False
        timed_out = parked = False
        try:
            while True:
                park, timed_out = await self._serve(resumed)
                resumed = False
                if not park:
                    break
                if self._park():
                    parked = True
                    return
                # Something arrived between the decision and now: serve on, reading what
                # came at once if it holds a turn for it (``broker/arrival.py``).
                resumed = self._turns is not None and self._turns.holds(self)
        except Exception:
            # A bug of ours while serving this client: close this connection, say so loudly,
            # and keep the node serving everyone else.
            core.metrics.internal_errors += 1
            log.exception("internal error on connection %s; closing it", self.transport.peer)
        except trio.Cancelled:
            # Only the node's own nursery cancels this task from outside (our own cancels
            # stay inside ``_serve``): the node is stopping.  Also the path of a parked
            # connection, which the lot hands a task back at shutdown.
            self.kick("node shutting down", 0x8B)  # MQTT 5: "server shutting down"
            raise
        finally:
            self._nursery = None
            if self._turns is not None:
                self._turns.end(self)
            if not parked:
                if self.early:  # SUBSCRIBEs registered as read, never finished
                    for early in self.early.values():
                        early.abandon()
                    self.early = None
                await self._close(timed_out)

    async def _serve(self, resumed: bool = False) -> tuple[bool, bool]:
        """One stretch of the connection's life with a task: (parks now, timed out).
        ``resumed``: by the parking lot (its bytes, if that is why, are read at once)."""
        self._park_requested = False
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                if self.conn.pending_output:
                    self.wake()  # resumed for a delivery
                await self._reader(resumed)
                # What was read is still handled (a PUBLISH sent just before the client
                # closed its socket is routed); the acceptor runs only while there are
                # events, like the writer, so an idle connection costs no task for it.
                while self._accepting:
                    await self._wait_progress()
            finally:
                # Parks only if the timers cancelled it for that (``on_timer``).
                park = self._park_requested
                if not park:
                    # The writer gets a bounded time to flush the last packets (a CONNACK
                    # refusal, a PUBACK) to a peer that may have stopped reading.
                    nursery.cancel_scope.deadline = trio.current_time() + FINAL_FLUSH_SECONDS
                    # A closing v5 connection's DISCONNECT is left to ``_close``: a writer
                    # started in this cancelled nursery would take it and never send it.
                    if self.conn.pending_output and not (
                            self._farewell and nursery.cancel_scope.cancel_called):
                        self.wake()
        self._nursery = None
        if self.conn.closed:
            return False, False
        return park, nursery.cancel_scope.cancelled_caught and not park

    def _idle(self) -> bool:
        """Nothing read ahead, being accepted, written or waiting to be: may park."""
        conn = self.conn
        return (not self._busy and not self._accepting and not self._writing
                and not self._closing and not conn.pending_output and self._unread is None
                and conn.state is ConnState.CONNECTED and self.session is not None
                and not self.session.held_releases
                and not self.finished and not self.core.shutting_down)

    def _park(self) -> bool:
        if self._parking is None or not self._idle():
            return False
        if self._parking.turns.holds(self) and self.transport.has_bytes():  # type: ignore[attr-defined]
            return False  # bytes came as it was parking: ``run`` serves on, them first
        # The keepalive runs on from the last read: ``_due`` as the last ``_arm`` set it,
        # which may be later than when the timers decided to park (bytes can be read
        # between that decision and the cancellation reaching the reader).  ``_arm``
        # takes it back when the lot resumes the connection.
        self._parked = self._parking.park(self, self.transport.fileno(),  # type: ignore[attr-defined]
                                          self._due)
        if self._parked:
            self._resume_deadline = self._due
        return self._parked

    async def _close(self, timed_out: bool) -> None:
        core = self.core
        if timed_out:
            log.debug("closing %s: timeout in state %s", self.transport.peer,
                      self.conn.state.name)
            self.close_reason = self.close_reason or (
                "keepalive timeout" if self.conn.state is ConnState.CONNECTED
                else "no CONNECT within connect_timeout")
        with trio.CancelScope(shield=True):
            if timed_out and self.conn.v5 is not None and self.conn.state is ConnState.CONNECTED:
                self.goodbye(0x8D)  # MQTT 5: keep alive timeout
            if self._farewell and self.conn.pending_output:
                # MQTT 5: say why (the DISCONNECT queued last), in at most a second.
                with trio.move_on_after(1):
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError,
                                             OSError):
                        await self.transport.send(self.conn.data_to_send())
            try:
                await core.connection_lost(self)
            finally:
                with trio.move_on_after(1):
                    with contextlib.suppress(trio.BrokenResourceError, OSError):
                        await self.transport.aclose()

    async def _wait_progress(self) -> None:
        if self._progress is None:
            self._progress = trio.Event()
        await self._progress.wait()

    def _signal_progress(self) -> None:
        event, self._progress = self._progress, None
        if event is not None:
            event.set()

    def _arm(self) -> None:
        """Start the receive timeouts from now (a wait for bytes begins, or the acceptor
        ran dry), and make sure the timers look at this connection by the first of them."""
        conn = self.conn
        now = trio.current_time()
        if self._resume_deadline is not None:
            # Back from the parking lot: the keepalive runs from before it parked.
            due, self._resume_deadline = self._resume_deadline, None
        elif conn.state is ConnState.AWAIT_CONNECT:
            due = self._connect_deadline
        elif conn.keepalive:
            due = now + 1.5 * conn.keepalive
        else:
            due = math.inf
        self._due = due
        self._quiet_since = now
        at = min(due, now + self._park_after) if self._park_after else due
        if at < self._timer_at:
            self._timer_at = at
            self._timers.watch(self, at)

    def wants_timer(self, at: float) -> bool:
        return at == self._timer_at

    def on_timer(self, at: float, now: float) -> float:
        """The timers' look at ``at`` (``_arm``): close the connection if its receive timed
        out, park it if it was quiet ``park_idle_after``; the next look's time (inf: none
        until the next ``_arm``, which every wait for bytes and the acceptor's end do)."""
        if at != self._timer_at:
            return math.inf  # an entry this connection no longer waits for
        self._timer_at = math.inf
        nursery = self._nursery
        if nursery is None or not self._receiving or self._busy or self._park_requested:
            return math.inf  # handling bytes (no timeout runs), parked, or ended
        if now >= self._due:
            nursery.cancel_scope.cancel()  # ``_serve`` reports it timed out
            return math.inf
        again = self._due
        if self._park_after:
            park_at = self._quiet_since + self._park_after
            if now >= park_at:
                if not self._active and self._idle():
                    self._park_requested = True
                    nursery.cancel_scope.cancel()  # only the reader runs: it is idle
                    return math.inf
                # Bytes went out meanwhile (or it is not idle yet): a new quiet stretch.
                self._active = False
                self._quiet_since = now
                park_at = now + self._park_after
            again = min(again, park_at)
        self._timer_at = again
        return again

    async def _reader(self, resumed: bool = False) -> None:
        """Feed the protocol machine until the peer leaves or breaks a rule.

        The timers (``on_timer``) end it from outside: a timeout, or ``park_idle_after`` of
        quiet (then ``_park_requested``: park).  Events wait in ``_pending`` for the
        acceptor; at ``publish_window`` events not yet handled the reader stops until one
        is.
        """
        conn = self.conn
        core = self.core
        metrics = core.metrics
        flow = core.flow
        window = core.limits.publish_window
        window_bytes = core.limits.publish_window_bytes
        inline = core.router.answers_locally
        transport = self.transport
        if conn.state is ConnState.AWAIT_CONNECT:
            self._connect_deadline = trio.current_time() + core.limits.connect_timeout
        # Resumed because bytes came: take them now, with no further scheduler pass, so they
        # are handled no later than a connection with a task would handle its own (arrival
        # order across connections, ``broker/scheduling.py``).  Only TCP connections park.
        ready, self._unread = self._unread, None
        if ready is None and resumed:
            ready = transport.receive_ready()  # type: ignore[attr-defined]
        turns = self._turns
        while True:
            if conn.closed:
                return  # kicked (while parked, say)
            # Also while busy: the connection may fall idle during this wait (its CONNECT
            # accepted, its output flushed), and is checked when it ends.
            self._active = False
            self._arm()
            # Bytes the parking lot resumed this connection for were noticed a scheduler
            # pass before this task could read them (the lot's pass): its acceptor makes up
            # for that pass (``_acceptor``).
            prompt = ready is not None
            if ready is not None:
                data, ready = ready, None
            else:
                if turns:
                    turns.end(self)  # a resume with nothing to read (not its bytes)
                self._receiving = True
                try:
                    data = await transport.receive()
                except MQTTError as exc:  # the transport's own framing (a WebSocket text frame)
                    metrics.protocol_errors += 1
                    log.debug("closing %s: %s", transport.peer, exc)
                    self.close_reason = self.close_reason or f"protocol error: {exc}"
                    return
                except trio.Cancelled:
                    if self._park_requested and turns is not None:
                        # No task reads its socket until it is parked (``_park``): bytes
                        # that come meanwhile go first.
                        turns.take(self)
                    raise
                finally:
                    self._receiving = False
                if self._park_requested:
                    # Parked as they came: handled in this cancelled nursery, a cluster
                    # SUBSCRIBE lost its SUBACK.  ``run`` serves on, starting with them.
                    self._unread = data
                    if turns is not None:
                        turns.take(self)
                    return
            if not data:
                self.close_reason = self.close_reason or "connection closed by the client"
                return
            if turns:
                # Bytes of a connection that had no task as they came, and came first.
                await turns.wait(self)
            metrics.bytes_received += len(data)
            try:
                received = conn.receive_data(data)
            except MQTTError as exc:
                metrics.protocol_errors += 1
                log.debug("closing %s: %s", transport.peer, exc)
                self.close_reason = self.close_reason or f"protocol error: {exc}"
                return
            if conn.pending_output:
                self.wake()  # PUBCOMP: written by the protocol machine itself
            session = self.session
            if session is not None:
                flow.room_made(session.client_id)  # its acks may have made room
                if session.held_releases:
                    self.release_soon()  # PUBRECs came: their PUBRELs wait for the store
            if inline and not self._accepting and received and _handled_inline(received):
                ended = await self._handle(received)
                if turns:
                    turns.end(self)
                if ended:
                    return
                continue
            for event in received:
                if type(event) is PingRequested:
                    if not (self._pending or self._accepting) or not core.limits.pingresp_wait:
                        self.answer_ping(event)  # nothing ahead of it to answer first
                        continue
                    self._ping_behind(event)
                while self._busy >= window or self._busy_bytes >= window_bytes:
                    if turns:
                        turns.end(self)  # its acceptor has the first events: no wait on it
                    await self._wait_progress()
                self._read_ahead(event)
                self._pending.append(event)
                self._busy += 1
                if type(event) is PublishReceived:
                    size = len(event.message.payload)  # type: ignore[union-attr]
                    self._busy_bytes += size
                    self._pending_bytes += size
                if not self._accepting:
                    self._accepting = True
                    assert self._nursery is not None
                    self._nursery.start_soon(self._acceptor, prompt)
            if turns:
                turns.end(self)  # handed on (its acceptor is due first), or a partial packet
            if conn.closed:
                return

    async def _acceptor(self, prompt: bool = False) -> None:
        """Hand the waiting events to the core in order, as many as there are at a time;
        exit when none is left.  Stops the reader once the core closed the connection (a
        refused CONNECT).

        ``prompt``: started for bytes the parking lot resumed this connection for.  The lot
        noticed them one scheduler pass before this connection's task could read them, so
        this acceptor skips the batching pass below: otherwise a parked client's SUBSCRIBE
        was handled after a PUBLISH that a client with a task sent just after it, and the
        subscriber missed the message (Eclipse Paho's ``client_test5.py``,
        ``test_request_response``, against a cluster node: about one run in ten)."""
        try:
            if not prompt and not self.core.router.answers_locally:
                # A cluster node: one more pass before taking the batch lets this
                # connection's reader (and the node's other readers) add what arrived
                # meanwhile, so a batch costs one request and one answer per owner for more
                # messages.  Measured on the scale-out pair, four interleaved rounds each:
                # QoS 1 110.0k -> 115.6k deliveries/s, 12.2 -> 11.8 us of CPU per delivery.
                # A single node answers its publishes locally and skips it (latency).
                await trio.lowlevel.cancel_shielded_checkpoint()
            while self._pending:
                batch, self._pending = self._pending, []
                size, self._pending_bytes = self._pending_bytes, 0
                early = self.early
                plain = (len(batch) if not early
                         else sum(1 for event in batch if id(event) not in early))
                try:
                    ended = await self._handle(batch)
                finally:
                    self._busy -= len(batch)
                    self._busy_bytes -= size
                    self._unregistered -= plain
                    self._signal_progress()
                if ended:
                    return
        finally:
            self._accepting = False
            self._signal_progress()
            self._arm()

    def answer_ping(self, ping: PingRequested) -> None:
        """PINGRESP, in its turn (the core, behind the answers read before it) or at once
        (nothing ahead of it, or the bound on its wait ran out)."""
        self.conn.send_pingresp(ping)
        self.wake()
        pings = self._pings
        if pings is None:
            return
        for i, waiting in enumerate(pings):
            if waiting is ping:
                del pings[i]
                break
        if not pings:
            self._pings = None
            if self._ping_timer is not None:
                self._ping_timer.cancel()
                self._ping_timer = None

    def _ping_behind(self, ping: PingRequested) -> None:
        """A PINGREQ read behind packets still being answered: its PINGRESP waits for
        them, as from one broker, but at most ``limits.pingresp_wait`` seconds: a client
        whose publishes are held (flow control, a cluster owner's wait) would otherwise
        close the connection when its keep alive sees no answer."""
        if self._pings is None:
            self._pings = []
        self._pings.append(ping)
        if self._ping_timer is None:
            scope = trio.CancelScope(
                deadline=trio.current_time() + self.core.limits.pingresp_wait)
            self._ping_timer = scope
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_pings_by, scope)

    async def _answer_pings_by(self, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep_forever()
        if self._ping_timer is scope:  # the bound ran out (``answer_ping`` cancels it)
            self._ping_timer = None
            pings, self._pings = self._pings, None
            for ping in pings or ():
                self.conn.send_pingresp(ping)
            self.wake()

    def _read_ahead(self, event: Event) -> None:
        """Register a SUBSCRIBE as it is read when nothing else of this connection is ahead
        of it: then a PUBLISH of another client read after it finds the subscription, as on
        one broker, however long the SUBSCRIBEs ahead take (a cluster's wait for its route
        registrations).  The acceptor finishes it in order (SUBACK, retained messages).
        Anything else ahead (a PUBLISH, an UNSUBSCRIBE, the CONNECT) must act first."""
        if (type(event) is SubscribeRequested and not self._unregistered
                and self.session is not None and not self.conn.closed):
            early = self.core.subscriptions.subscribe_early(self, event)  # type: ignore[arg-type]
            if self.early is None:
                self.early = {}
            self.early[id(event)] = early
            return
        self._unregistered += 1

    async def _handle(self, batch: list[Event]) -> bool:
        """Hand ``batch`` to the core.  True if the core closed the connection (a refused
        CONNECT, a takeover): reading stops once the answer is flushed (the writer ends the
        connection when its buffer is empty)."""
        conn = self.conn
        refused: BaseException | None = None
        try:
            await self.core.handle(self, batch)
        except* StoreError as group:
            refused = group
        if refused is not None:
            # Not a bug: the store refuses writes, and the node is stopping
            # (``BrokerNode._stop_when_store_fails``).  Nothing unstored was acknowledged.
            while isinstance(refused, BaseExceptionGroup):
                refused = refused.exceptions[0]
            log.warning("closing connection %s: %s", self.transport.peer, refused)
            self.kick("the node store refuses writes", 0x80)  # MQTT 5: unspecified error
            return True
        if conn.pending_output:
            self.wake()
        if conn.disconnected and not self._pending and self._receiving:
            # A DISCONNECT read with the CONNECT, taken by the CONNECT's acceptance: the
            # reader, waiting for more, never saw it (the node kept the connection open
            # until the keepalive ran out).  Closed once the CONNACK is out.
            self._closing = True
            if not self._writing and not conn.pending_output:
                self._end()
            return True
        if conn.closed and not conn.disconnected:
            if conn.protocol_error is not None and self.close_reason is None:
                # Found by the CONNECT's acceptance in bytes read with it (``accept``).
                self.core.metrics.protocol_errors += 1
                log.debug("closing %s: %s", self.transport.peer, conn.protocol_error)
                self.close_reason = f"protocol error: {conn.protocol_error}"
            self._pending, self._pending_bytes, self._unregistered = [], 0, 0
            self._closing = True
            if not self._writing and not conn.pending_output:
                self._end()
            return True
        return False

    async def _writer(self) -> None:
        """Drain the output buffer, one send per batch, then exit (idle costs no task)."""
        conn = self.conn
        metrics = self.core.metrics
        transport = self.transport
        try:
            while True:
                data = conn.data_to_send()
                if not data:
                    if self._closing:
                        self._end()
                    return
                metrics.bytes_sent += len(data)
                self._active = True
                await transport.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # The peer went away: end the connection (the reader may be waiting for bytes
            # that will never come); its will is published as for any unclean close.
            log.debug("connection %s: write failed: %s", transport.peer, exc)
            self.kick(f"write failed: {exc}")
        finally:
            self._writing = False


def _handled_inline(events: list[Event]) -> bool:
    """Whether the reader may hand ``events`` to the core itself (when no acceptor is busy,
    and on a node whose router ``answers_locally``) instead of starting the acceptor task:
    it saves that task's scheduler pass on the path of every QoS 0 message (latency).

    Only events whose handling never waits: an UNSUBSCRIBE, a PINGREQ, and a PUBLISH at QoS 0, not
    retained, without MQTT 5 properties (no owner's answer, no group commit, no congested
    subscriber to wait for).  Not a SUBSCRIBE: the reader registers it as it is read
    (``_read_ahead``), which keeps it ahead of another client's PUBLISH read after it
    (``broker/scheduling.py``), and its SUBACK may wait (a persistent session's durable
    write): handled here, it kept the reader from the next SUBSCRIBE meanwhile."""
    for event in events:
        kind = type(event)
        if kind is PublishReceived:
            message = event.message  # type: ignore[union-attr]
            if message.qos or message.retain or message.props is not None:
                return False
        elif kind is not UnsubscribeRequested and kind is not PingRequested:
            return False
    return True
