"""MQTT over a plain WebSocket (``ws``), on the socket itself, with wsproto's sans-IO machine.

Not trio-websocket (still used for ``wss``, over TLS): its reader task reads the socket and
hands each message to the connection's task through a channel, a scheduler pass later than
a TCP connection's bytes are handled.  A WebSocket client's SUBSCRIBE then lost the race to
another client's PUBLISH sent right after it (a probe of 2026-11-28: 1 to 13 of 100 rounds
delivered, against 100 over TCP and over mosquitto's WebSocket listener), which is the
arrival order ``broker/scheduling.py`` keeps for TCP.  Here a read waits for epoll first
and its bytes go to the MQTT decoder in that pass, as ``TcpTransport.receive`` does.  Also:

* Binary data goes to the decoder as it arrives, frame by frame, so a WebSocket message may
  hold any number of MQTT packets (3.1.1 section 6) and no message is buffered whole; the
  decoder's ``max_packet_size`` is the bound.  trio-websocket refused a message over its
  size limit even when it held several legal packets.
* A frame the WebSocket protocol forbids gets a close frame with wsproto's code (1002...),
  a text frame 1003 [MQTT-6.0.0-1]; a handshake that is not a WebSocket upgrade gets
  wsproto's HTTP answer (400, 426 with the supported version).
* Every write goes through one buffer (``_outbox``), so a pong or a close frame written by
  the reader never lands inside a data frame the writer is half-way through.
"""

from __future__ import annotations

import contextlib
import logging
import socket

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from mqttring.broker.transport import TcpTransport
from mqttring.protocol.errors import ProtocolViolation

log = logging.getLogger("mqttring.websocket")

#: Close codes (RFC 6455 7.4.1).
NORMAL_CLOSURE = 1000
UNSUPPORTED_DATA = 1003


class PlainWebSocketTransport:
    """A ``ws`` connection: MQTT bytes in binary frames over the plain socket."""

    __slots__ = ("_eof", "_outbox", "peer", "tcp", "ws")

    secure = False
    identity: str | None = None

    def __init__(self, sock: socket.socket) -> None:
        self.tcp = TcpTransport(sock)
        self.peer = f"ws:{self.tcp.peer}"
        self.ws = WSConnection(ConnectionType.SERVER)
        #: Encoded frames not yet taken by the socket, in order.
        self._outbox = bytearray()
        #: The peer closed (a close frame, or its end of the socket).
        self._eof = False

    async def accept(self, timeout: float) -> bool:
        """Read the client's upgrade request and answer it, within ``timeout``; False (and
        the socket closed) if it was refused, or the client left or was too slow."""
        ws = self.ws
        with trio.move_on_after(timeout):
            while True:
                data = await self.read()
                if not data:
                    break
                try:
                    ws.receive_data(data)
                    request = next((e for e in ws.events() if isinstance(e, Request)), None)
                except RemoteProtocolError as exc:  # not a WebSocket upgrade
                    log.debug("websocket upgrade from %s refused: %s", self.peer, exc)
                    if exc.event_hint is not None:
                        with contextlib.suppress(LocalProtocolError):
                            self.queue(ws.send(exc.event_hint))
                        self.flush_now()
                    break
                if request is not None:
                    # "mqttv3.1" too, as mosquitto: what MQTT.js offers for MQTT 3.1.
                    subprotocol = next((name for name in ("mqtt", "mqttv3.1")
                                        if name in request.subprotocols), None)
                    self.queue(ws.send(AcceptConnection(subprotocol=subprotocol)))
                    self.flush_now()
                    return True
        await self.tcp.aclose()
        return False

    async def read(self) -> bytes:
        """The socket's next bytes (b"": closed), read once epoll reports them."""
        return await self.tcp.receive()

    async def receive(self) -> bytes:
        """The MQTT bytes of the next data frames (b"": the peer closed)."""
        ws = self.ws
        while True:
            if self._eof:
                return b""
            data = self._take_events()
            if data:
                return data
            if self._eof:
                return b""
            raw = await self.tcp.receive()
            if not raw:
                self._eof = True
                return b""
            try:
                ws.receive_data(raw)
            except LocalProtocolError:  # bytes after the close: nothing more to read
                self._eof = True

    def _take_events(self) -> bytes:
        ws = self.ws
        chunks: list[bytes] = []
        for event in ws.events():
            kind = type(event)
            if kind is BytesMessage:
                chunks.append(event.data)  # type: ignore[attr-defined]
            elif kind is Ping:
                self._send_control(event.response())  # type: ignore[attr-defined]
            elif kind is CloseConnection:
                # The peer's close (answered), or a frame wsproto refused (its code said).
                self._send_control(event.response() if ws.state is ConnectionState.REMOTE_CLOSING  # type: ignore[attr-defined]
                                   else CloseConnection(event.code, event.reason))  # type: ignore[attr-defined]
                self._eof = True
                break
            elif kind is TextMessage:
                self._send_control(CloseConnection(UNSUPPORTED_DATA,
                                                   "MQTT needs binary frames"))
                self._eof = True
                raise ProtocolViolation("MQTT-6.0.0-1", "MQTT over WebSocket needs binary frames")
        return b"".join(chunks)

    def _send_control(self, event: CloseConnection | object) -> None:
        try:
            self.queue(self.ws.send(event))  # type: ignore[arg-type]
        except LocalProtocolError:
            return  # closing already
        self.flush_now()

    def queue(self, data: bytes) -> None:
        self._outbox += data

    def flush_now(self) -> bool:
        """Write what the socket takes now; True if the outbox is empty."""
        outbox = self._outbox
        while outbox:
            try:
                sent = self.tcp.sock.send(outbox)
            except BlockingIOError:
                return False
            except OSError:
                outbox.clear()  # the peer is gone: the reader finds out
                return True
            del outbox[:sent]
        return True

    async def send(self, data: bytes) -> None:
        try:
            self._outbox += self.ws.send(BytesMessage(data=data))
        except LocalProtocolError as exc:  # closing: nobody to send to
            raise trio.BrokenResourceError("websocket closed") from exc
        await trio.lowlevel.checkpoint_if_cancelled()
        sock = self.tcp.sock
        try:
            while not self.flush_now():
                await trio.lowlevel.wait_writable(sock)
        except (OSError, trio.ClosedResourceError) as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def aclose(self) -> None:
        """Say goodbye with a close frame (if the peer has not closed first), then close the
        socket as ``TcpTransport.aclose`` does."""
        if self.ws.state is ConnectionState.OPEN:
            self._send_control(CloseConnection(NORMAL_CLOSURE))
        if self._outbox:
            with trio.move_on_after(1), trio.CancelScope(shield=True):
                while not self.flush_now():
                    await trio.lowlevel.wait_writable(self.tcp.sock)
        await self.tcp.aclose()
