"""How a client connection's packets are read and handed to the broker core, in order.

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

Three things are settled as a packet is read rather than when its turn comes: a SUBSCRIBE
with nothing of its connection ahead of it is registered at once (``_read_ahead``), so that
another client's PUBLISH read after it finds it; a PINGREQ with nothing ahead of it is
answered at once, and one behind answers still due waits for them, at most
``limits.pingresp_wait`` (``answer_ping``); and at the window the reader stops.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from mqttring.broker.subscribing import EarlySubscribe
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

if TYPE_CHECKING:
    from mqttring.broker.arrival import ArrivalTurns
    from mqttring.broker.core import BrokerCore
    from mqttring.broker.transport import Transport
    from mqttring.protocol.session import Session

log = logging.getLogger("mqttring.client")


class ReadPath:
    """The reader and the acceptor of ``ClientHandler``, which holds their state (its
    ``__slots__``, documented in its ``__init__``) and the rest of the connection's life:
    ``wake`` (write the output), ``kick``, the timers (``_arm``) and parking."""

    __slots__ = ()

    core: BrokerCore
    conn: ServerConnection
    transport: Transport
    session: Session | None
    close_reason: str
    early: dict[int, EarlySubscribe] | None
    _turns: ArrivalTurns | None
    _nursery: trio.Nursery | None
    _pending: list[Event]
    _pending_bytes: int
    _busy: int
    _busy_bytes: int
    _unregistered: int
    _accepting: bool
    _progress: trio.Event | None
    _pings: list[PingRequested] | None
    _ping_timer: trio.CancelScope | None

    async def _wait_progress(self) -> None:
        if self._progress is None:
            self._progress = trio.Event()
        await self._progress.wait()

    def _signal_progress(self) -> None:
        event, self._progress = self._progress, None
        if event is not None:
            event.set()

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
        # Answers the client does not read (PINGRESPs to a PINGREQ flood) stop its reading
        # past twice the output bound: deliveries alone stay below it (QoS 0 is dropped at
        # the bound, QoS 1/2 wait in the session), so only such answers reach it.  Read on,
        # they grew without bound: +20.8 MiB for 24.7 MB of PINGREQs.
        output_bound = 2 * core.limits.max_outgoing_buffer
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
                while conn.pending_output > output_bound and not conn.closed:
                    # The writer signals each send; none for the hold (it reads nothing
                    # of what it is sent): shed like a slow consumer (``flow``), since its
                    # keep alive cannot run out while this node does not read it.
                    with trio.move_on_after(max(core.limits.slow_subscriber_hold, 1.0)):
                        await self._wait_progress()
                        continue
                    metrics.slow_subscribers_disconnected += 1
                    log.info("closing %s: it reads nothing of what it is sent (%d bytes "
                             "waiting)", transport.peer, conn.pending_output)
                    self.close_reason = "it reads nothing of what it is sent"
                    return
                self._receiving = True
                try:
                    data = await transport.receive()
                except MQTTError as exc:  # the transport's own framing (a WebSocket text frame)
                    metrics.protocol_errors += 1
                    log.debug("closing %s: %s", transport.peer, exc)
                    self.close_reason = self.close_reason or f"protocol error: {exc}"
                    return
                finally:
                    self._receiving = False
                if self._park_requested:
                    # Read as the timers parked it (reported before their decision, in
                    # this pass): handled in this cancelled nursery, a cluster SUBSCRIBE
                    # lost its SUBACK.  ``run`` serves on, starting with them, in the turn
                    # they got here.
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
                kind = type(event)
                if kind is PingRequested:
                    if not (self._pending or self._accepting) or not core.limits.pingresp_wait:
                        self.answer_ping(event)  # nothing ahead of it to answer first
                        continue
                    self._ping_behind(event)
                while self._busy >= window or self._busy_bytes >= window_bytes:
                    if turns:
                        turns.end(self)  # its acceptor has the first events: no wait on it
                    await self._wait_progress()
                if kind is PublishReceived:  # ``_read_ahead``'s case for it, inline
                    self._unregistered += 1
                    size = len(event.message.payload)  # type: ignore[union-attr]
                    self._busy_bytes += size
                    self._pending_bytes += size
                else:
                    self._read_ahead(event)
                self._pending.append(event)
                self._busy += 1
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
            self._arm(restart=True)  # no timeout ran while it was busy: from now

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
