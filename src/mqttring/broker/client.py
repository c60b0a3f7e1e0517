"""The trio adapter of one client connection: a reader task, and a writer task while needed.

The reader feeds bytes to the sans-IO ``ServerConnection`` and hands the resulting events to
``BrokerCore``.  A writer task is started when output appears and ends when the buffer is
empty (an idle connection then costs one task, which matters at 10,000 connections); it
sends everything queued while it was busy (many deliveries, acks) in one write.
Deliveries never wait for a socket: routers append to the buffer and call ``wake``; a slow
reader only grows its own buffer, where the session drops QoS 0 past the configured limit
and the inflight window bounds QoS 1/2, so one slow client costs at most
``max_outgoing_buffer + max_inflight x message size`` and never blocks anyone else.  A client
that stops reading *and* sending is closed by the keepalive timeout.

Timeouts are the deadline of the connection's own cancel scope while it waits for bytes:
``connect_timeout`` until CONNECT arrives, then 1.5 x keepalive [MQTT-3.1.2-24] (none for
keepalive 0); the deadline is lifted while received packets are handled.
"""

from __future__ import annotations

import contextlib
import logging
import math

import trio

from mqttring.broker.core import BrokerCore
from mqttring.broker.transport import Transport
from mqttring.protocol.connection import ConnState, ServerConnection
from mqttring.protocol.errors import MQTTError
from mqttring.protocol.packets import Will
from mqttring.protocol.session import Session

log = logging.getLogger("mqttring.client")

FINAL_FLUSH_SECONDS = 5.0


class ClientHandler:
    __slots__ = (
        "_nursery",
        "_writing",
        "clean_disconnect",
        "client_id",
        "conn",
        "core",
        "finished",
        "session",
        "token",
        "transport",
        "will",
    )

    def __init__(self, core: BrokerCore, transport: Transport) -> None:
        self.core = core
        self.transport = transport
        self.conn = ServerConnection(core.limits.max_packet_size)
        self.session: Session | None = None
        self.client_id: str | None = None
        #: Identifies this connection to the client id's home node (cluster), so that a late
        #: message about an older connection with the same id is recognised and ignored.
        self.token = ""
        self.will: Will | None = None
        self.clean_disconnect = False
        self.finished = False
        self._writing = False
        self._nursery: trio.Nursery | None = None

    def wake(self) -> None:
        """Output is pending: make sure a writer task is draining it."""
        if self._writing or self._nursery is None:
            return
        try:
            self._nursery.start_soon(self._writer)
        except RuntimeError:
            return  # the connection is shutting down; there is nobody left to write to
        self._writing = True

    def kick(self) -> None:
        """Close this connection now (takeover, slow consumer, shutdown)."""
        self.conn.close()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def run(self) -> None:
        core = self.core
        timed_out = False
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    await self._reader(nursery.cancel_scope)
                finally:
                    # The writer gets a bounded time to flush the last packets (a CONNACK
                    # refusal, a PUBACK) to a peer that may have stopped reading.
                    nursery.cancel_scope.deadline = trio.current_time() + FINAL_FLUSH_SECONDS
                    if self.conn.pending_output:
                        self.wake()
            timed_out = nursery.cancel_scope.cancelled_caught and not self.conn.closed
        except Exception:
            # A bug of ours while serving this client: close this connection, say so loudly,
            # and keep the node serving everyone else.
            core.metrics.internal_errors += 1
            log.exception("internal error on connection %s; closing it", self.transport.peer)
        finally:
            self._nursery = None
            if timed_out:
                log.debug("closing %s: timeout in state %s", self.transport.peer,
                          self.conn.state.name)
            with trio.CancelScope(shield=True):
                try:
                    await core.connection_lost(self)
                finally:
                    with trio.move_on_after(1):
                        with contextlib.suppress(trio.BrokenResourceError, OSError):
                            await self.transport.aclose()

    async def _reader(self, timer: trio.CancelScope) -> None:
        """Feed the protocol machine until the peer leaves, breaks a rule or times out.

        ``timer`` is the connection's own scope: its deadline is the receive timeout while
        waiting for bytes and infinite while they are handled (a timeout must never cut a
        store write or a routing step short); expiring cancels the whole connection.
        """
        core = self.core
        conn = self.conn
        metrics = core.metrics
        transport = self.transport
        connect_deadline = trio.current_time() + core.limits.connect_timeout
        while True:
            if conn.state is ConnState.AWAIT_CONNECT:
                timer.deadline = connect_deadline
            elif conn.keepalive:
                timer.deadline = trio.current_time() + 1.5 * conn.keepalive
            data = await transport.receive()
            timer.deadline = math.inf
            if not data:
                return  # peer closed
            metrics.bytes_received += len(data)
            try:
                events = conn.receive_data(data)
            except MQTTError as exc:
                metrics.protocol_errors += 1
                log.debug("closing %s: %s", transport.peer, exc)
                return
            if events:
                await core.handle(self, events)
            if conn.pending_output:
                self.wake()
            if conn.closed:
                return

    async def _writer(self) -> None:
        """Drain the output buffer, one send per batch, then exit (idle costs no task)."""
        conn = self.conn
        metrics = self.core.metrics
        transport = self.transport
        try:
            while True:
                data = conn.data_to_send()
                if not data:
                    return
                metrics.bytes_sent += len(data)
                await transport.send(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # The peer went away: end the connection (the reader may be waiting for bytes
            # that will never come); its will is published as for any unclean close.
            log.debug("connection %s: write failed: %s", transport.peer, exc)
            self.kick()
        finally:
            self._writing = False
