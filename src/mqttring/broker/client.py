"""The trio adapter of one client connection: a reader, an acceptor, and a writer while needed.

How packets are read and handed to the core, in order, is ``mqttring.broker.reading``
(``ReadPath``, which ``ClientHandler`` extends); this module is the rest of a connection's
life: its tasks, its output, its timeouts, parking, and its end.

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
then 1.5 x keepalive from the last complete packet [MQTT-3.1.2-24] (none for keepalive 0;
the keepalive in force: a v5 client told a Server Keep Alive is held to that); none while
the acceptor has events to handle (a client waiting for our PUBACK owes us no packet).
Bytes of a packet not yet complete do not restart it: a client trickling a PUBLISH it never
finishes is closed (and its will published) like a silent one.  A read only notes when it
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
from mqttring.broker.reading import ReadPath
from mqttring.broker.subscribing import EarlySubscribe
from mqttring.broker.timers import ConnectionTimers
from mqttring.broker.transport import TcpTransport, Transport
from mqttring.protocol.connection import (
    ConnState,
    Event,
    PingRequested,
    ServerConnection,
)
from mqttring.protocol.packets import Will
from mqttring.protocol.session import Session

log = logging.getLogger("mqttring.client")

FINAL_FLUSH_SECONDS = 5.0


class ClientHandler(ReadPath):
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
        "_has_task",
        "_nursery",
        "_packets_seen",
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
        "will_forfeited",
    )

    def __init__(self, core: BrokerCore, transport: Transport, timers: ConnectionTimers,
                 parking: ParkingLot | None = None) -> None:
        self.core = core
        self.transport = transport
        #: Who looks at this connection when a receive timeout could be due (``_arm``).
        self._timers = timers
        #: Where this connection goes while idle (``mqttring.broker.parking``); None: never.
        self._parking = parking
        #: Handed to the lot (from the timers' decision until a task takes it back).
        self._parked = False
        #: A task runs ``run`` (stopping to park counts: the lot starts no second one).
        self._has_task = False
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
        #: ``conn.packets_received`` when the keepalive last started again: only a complete
        #: packet restarts it (``_arm``), never bytes of one still incomplete.
        self._packets_seen = 0
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
        #: The will is not published whatever ends the connection: the broker closed it
        #: because its login no longer holds (``forfeit_will``).
        self.will_forfeited = False
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

    def forfeit_will(self) -> None:
        """No will for this connection: its identity was revoked (a reload of the login
        settings or the password file), and what it left to say in that name is not said
        (mosquitto does not publish it either)."""
        self.will_forfeited = True

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

    @property
    def has_task(self) -> bool:
        """A task serves this connection, or is stopping to park it (``ParkingLot.resume``:
        that task then serves on, and no second one starts)."""
        return self._has_task

    async def run(self) -> None:
        """Serve the connection until it ends, or until it parks (idle: its task ends and
        the parking lot runs this again when there is something to do)."""
        core = self.core
        resumed, self._parked = self._parked, False
        self._has_task = True
        timed_out = parked = False
        try:
            while True:
                park, timed_out = await self._serve(resumed)
                if not park:
                    break
                if self._stays_parked():
                    parked = True
                    return
                # The lot handed it back as its task stopped (its bytes: the lot took a
                # turn for them, ``broker/arrival.py``; a delivery; a close), or something
                # came that keeps it busy: serve on, reading what came at once.
                self._parked = False
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
            if not parked and self._parked:
                # Handed to the lot as it stopped for another reason: it closes instead.
                assert self._parking is not None
                self._parking.withdraw(self, self.transport.fileno())  # type: ignore[attr-defined]
                self._parked = False
            self._has_task = False
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

    def _enter_lot(self) -> bool:
        """Hand the socket to the parking lot now, as the timers decide to park it, before
        its reader is cancelled: no byte can then arrive unwatched.  Bytes that come from
        now on are the lot's to report, in epoll's order with every other connection's
        (``broker/arrival.py``); bytes already there were reported to the reader in their
        order, so it does not park (False) and reads them.  (Until 2026-11-29 the lot took
        over only once the reader had stopped, and bytes coming in between could not be
        placed: a publisher parking just as it sent had its PUBLISH handled before an
        earlier SUBSCRIBE of a parked subscriber, 3 rounds in 150.)

        The keepalive runs on from the last complete packet (``_due``); ``_arm`` takes it
        back when a task serves the connection again."""
        assert self._parking is not None
        fd = self.transport.fileno()  # type: ignore[attr-defined]
        if not self._parking.park(self, fd, self._due):
            return False
        if self.transport.has_bytes():  # type: ignore[attr-defined]
            self._parking.withdraw(self, fd)
            return False
        self._parked = True
        self._resume_deadline = self._due
        return True

    def _stays_parked(self) -> bool:
        """The stretch the timers cancelled to park it has ended: whether the connection
        stays in the lot (its task ends), or serves on (the lot handed it back meanwhile,
        or something came as it stopped: output, bytes its reader had already read)."""
        assert self._parking is not None
        fd = self.transport.fileno()  # type: ignore[attr-defined]
        if not self._parking.holds(self, fd):
            return False
        # ``_resume_deadline`` taken: a packet was read and the timeouts armed again since
        # the decision (the lot's deadline is stale); serve on, and park when quiet again.
        if self._idle() and self._resume_deadline is not None:
            return True
        self._parking.withdraw(self, fd)
        return False

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

    def _arm(self, restart: bool = False) -> None:
        """Start the receive timeouts (a wait for bytes begins, or the acceptor ran dry),
        and make sure the timers look at this connection by the first of them.

        The keepalive starts again from now only if a complete packet was read since it
        last did [MQTT-3.1.2-24] (one integer compare per read), or on ``restart``: the
        acceptor ran dry, and no timeout ran while it was busy (a client waiting for our
        PUBACK owes us no packet).  Once any bytes restarted it, and a client sending a
        byte of a PUBLISH every second with keepalive 2 was never closed."""
        conn = self.conn
        now = trio.current_time()
        resumed, self._resume_deadline = self._resume_deadline, None
        if conn.state is ConnState.AWAIT_CONNECT:
            due = self._connect_deadline
        elif restart or conn.packets_received != self._packets_seen:
            self._packets_seen = conn.packets_received
            keepalive = conn.keepalive
            due = now + 1.5 * keepalive if keepalive else math.inf
        elif resumed is not None:
            due = resumed  # back from the parking lot: the keepalive runs from before
        else:
            due = self._due  # part of a packet only: the keepalive runs on
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
                if not self._active and self._idle() and self._enter_lot():
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
                if self._progress is not None:
                    self._signal_progress()  # a reader held by its unread output reads on
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # The peer went away: end the connection (the reader may be waiting for bytes
            # that will never come); its will is published as for any unclean close.
            log.debug("connection %s: write failed: %s", transport.peer, exc)
            self.kick(f"write failed: {exc}")
        finally:
            self._writing = False
