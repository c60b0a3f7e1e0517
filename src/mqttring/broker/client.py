"""The trio adapter of one client connection: a reader task and a writer task.

The reader feeds bytes to the sans-IO ``ServerConnection`` and hands the resulting events to
``BrokerCore``; the writer drains the connection's output buffer with one ``send`` per wake-up,
so everything queued while the writer was busy (many deliveries, acks) leaves in one write.
Deliveries never wait for a socket: routers append to the buffer and call ``wake``; a slow
reader only grows its own buffer, where the session drops QoS 0 past the configured limit
and the inflight window bounds QoS 1/2, so one slow client costs at most
``max_outgoing_buffer + max_inflight x message size`` and never blocks anyone else.  A client
that stops reading *and* sending is closed by the keepalive timeout.

Timeouts are cancel scopes around the receive: ``connect_timeout`` until CONNECT arrives,
then 1.5 x keepalive [MQTT-3.1.2-24] (none for keepalive 0).
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
        "_cancel_scope",
        "_reader_done",
        "_wakeup",
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
        self._wakeup = trio.Event()
        self._reader_done = False
        self._cancel_scope: trio.CancelScope | None = None

    def wake(self) -> None:
        self._wakeup.set()

    def kick(self) -> None:
        """Close this connection now (takeover, slow consumer, shutdown)."""
        self.conn.close()
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    async def run(self) -> None:
        core = self.core
        try:
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                nursery.start_soon(self._writer)
                try:
                    await self._reader()
                finally:
                    self._reader_done = True
                    self._wakeup.set()
                    # The writer gets a bounded time to flush the last packets (a CONNACK
                    # refusal, a PUBACK) to a peer that may have stopped reading.
                    nursery.cancel_scope.deadline = trio.current_time() + FINAL_FLUSH_SECONDS
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("connection %s: %s", self.transport.peer, exc)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await core.connection_lost(self)
                finally:
                    with trio.move_on_after(1):
                        with contextlib.suppress(trio.BrokenResourceError, OSError):
                            await self.transport.aclose()

    async def _reader(self) -> None:
        core = self.core
        conn = self.conn
        metrics = core.metrics
        transport = self.transport
        connect_deadline = trio.current_time() + core.limits.connect_timeout
        while True:
            if conn.state is ConnState.AWAIT_CONNECT:
                deadline = connect_deadline
            elif conn.keepalive:
                deadline = trio.current_time() + 1.5 * conn.keepalive
            else:
                deadline = math.inf
            with trio.move_on_at(deadline) as timer:
                data = await transport.receive()
            if timer.cancelled_caught:
                log.debug("closing %s: timeout in state %s", transport.peer, conn.state.name)
                return
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
                self._wakeup.set()
            if conn.closed:
                return

    async def _writer(self) -> None:
        conn = self.conn
        metrics = self.core.metrics
        transport = self.transport
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            data = conn.data_to_send()
            if data:
                metrics.bytes_sent += len(data)
                await transport.send(data)
            if self._reader_done and not conn.pending_output:
                return
