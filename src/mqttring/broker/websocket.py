"""MQTT over WebSocket (``ws``, and ``wss`` over TLS) with wsproto's sans-IO machine.

Not trio-websocket: its reader task reads the socket and hands each message to the
connection's task through a channel, a scheduler pass later than a TCP connection's bytes
are handled.  A WebSocket client's SUBSCRIBE then lost the race to another client's PUBLISH
sent right after it (a probe of 2026-11-28: 1 to 13 of 100 rounds delivered, against 100
over TCP and over mosquitto's WebSocket listener), which is the arrival order
``broker/scheduling.py`` keeps for TCP.  Here a ``ws`` read waits for epoll first and its
bytes go to the MQTT decoder in that pass, as ``TcpTransport.receive`` does (a ``wss`` read
is the TLS stream's, as for ``mqtts``).  Also:

* Binary data goes to the decoder as it arrives, frame by frame, so a WebSocket message may
  hold any number of MQTT packets (3.1.1 section 6) and no message is buffered whole; the
  decoder's ``max_packet_size`` is the bound.  trio-websocket refused a message over its
  size limit even when it held several legal packets.  A packet over that bound ends the
  connection with close code 1009 (Message Too Big, RFC 6455 7.4.1), not 1000
  (``_PacketSizes``).
* A frame the WebSocket protocol forbids gets a close frame with wsproto's code (1002...),
  a text frame 1003 [MQTT-6.0.0-1]; a handshake that is not a WebSocket upgrade gets
  wsproto's HTTP answer (400, 426 with the supported version), and so does one that offers
  subprotocols none of which is MQTT's (MQTT 3.1.1 and 5 section 6: the server selects
  "mqtt"; an upgrade that offers none at all is still accepted, as it always was) or whose
  ``Sec-WebSocket-Key`` is not 16 bytes in base64 (RFC 6455 4.2.1; wsproto checks only
  that there is one).
* The client's first frames may come in the same read as its upgrade request (RFC 6455
  lets a client send them before the 101 arrives; mosquitto answers such a CONNECT).
  wsproto 1.3 drops whatever follows the request when the handshake is accepted (its
  ``H11Handshake._accept`` builds the connection without h11's trailing data), so
  ``accept`` gives wsproto the request alone and its bytes after the request once the
  upgrade is accepted (before 2026-11-29 such a CONNECT was lost and the client closed
  after ``connect_timeout``, over ``ws`` and ``wss`` alike).
* Every write goes through one buffer (``_outbox``), so a pong or a close frame written by
  the reader never lands inside a data frame the writer is half-way through.
* The reader's own output (pongs, close frames) is bounded as the connection's output is
  (``max_output``, ``limits.max_outgoing_buffer``): once it has queued that much that the
  socket has not taken, it stops reading until the socket takes the buffer (``_drain``),
  the back-pressure a TCP client feels when the node stops reading.  Frames the writer
  queued do not count: a subscriber slow to read its deliveries is still read (its acks),
  as over TCP.
  Until 2026-11-29 a client that sent PING frames and never read made the node buffer
  every PONG (a probe's 40 MB of PINGs grew the node by 32 MiB; ``ws`` and ``wss`` alike);
  such a client is closed by its keep-alive timeout now, as a silent one over TCP.
* An upgrade over HTTP/1.0 is refused with 400: RFC 6455 4.1 needs HTTP/1.1 at least (h11,
  which wsproto uses, takes both).

``wss`` (``TlsWebSocketTransport``) used trio-websocket until 2026-11-29; it shares all of
the above now, over the TLS stream.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import re
import socket

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from mqttring.broker.tls import TlsTransport
from mqttring.broker.transport import TcpTransport
from mqttring.protocol.errors import ProtocolViolation

log = logging.getLogger("mqttring.websocket")

#: Close codes (RFC 6455 7.4.1).
NORMAL_CLOSURE = 1000
UNSUPPORTED_DATA = 1003
MESSAGE_TOO_BIG = 1009

#: The subprotocols of MQTT over WebSocket, preferred first: "mqtt" [MQTT-6.0.0-3], and
#: "mqttv3.1" too, as mosquitto: what MQTT.js and older paho offer for MQTT 3.1.
MQTT_SUBPROTOCOLS = ("mqtt", "mqttv3.1")

#: Bytes of the reader's own output (pongs, close frames) the socket has not taken yet
#: before the reader stops reading: the default of ``limits.max_outgoing_buffer``, for a
#: transport built without the configured one.
DEFAULT_MAX_OUTPUT = 4 * 1024 * 1024

#: The end of an HTTP request's head, as h11 (which wsproto uses) finds it: a blank line,
#: with or without its CR.
_END_OF_HEAD = re.compile(b"\n\r?\n")


def _end_of_head(head: bytes | bytearray, start: int) -> int | None:
    """Where the bytes after the request's head begin in ``head`` (searched from
    ``start``), or None while the head is incomplete."""
    found = _END_OF_HEAD.search(head, start)
    return None if found is None else found.end()


def _http_version(head: bytes | bytearray) -> bytes:
    """The HTTP version of the request line at the start of ``head`` (b"HTTP/1.1"); h11
    skips blank lines before it, and so does this."""
    head = bytes(head).lstrip(b"\r\n")
    line = head[:head.find(b"\n")].rstrip(b"\r")
    return line.rpartition(b" ")[2]


def _valid_key(request: Request) -> bool:
    """Whether the request's ``Sec-WebSocket-Key`` is a base64-encoded 16-byte value
    (RFC 6455 4.2.1, item 5); wsproto checks only that the header is there."""
    key = next((value for name, value in request.extra_headers
                if name == b"sec-websocket-key"), b"")
    try:
        return len(base64.b64decode(bytes(key).strip(), validate=True)) == 16
    except (binascii.Error, ValueError):
        return False


class _PacketSizes:
    """Follows the MQTT fixed headers in the inbound byte stream, for one answer: did a
    packet over ``limit`` (the decoder's ``max_packet_size``, on the remaining length) come?

    The decoder refuses such a packet and the connection closes; this lets the close frame
    say why, 1009 Message Too Big, where it said 1000 Normal Closure.  It reads only the
    headers (a packet's body is skipped by its length), and stops at the first packet over
    the limit, the last one the decoder reads.
    """

    __slots__ = ("_shift", "_skip", "_value", "limit", "over")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.over = False
        #: Bytes of the current packet still to skip (its body), before the next header.
        self._skip = 0
        #: Reading a remaining length: its value so far and the shift of its next byte
        #: (-1: at a packet's first byte).
        self._value = 0
        self._shift = -1

    def feed(self, data: bytes) -> None:
        if self.over:
            return
        size = len(data)
        pos = self._skip
        if pos >= size:
            self._skip = pos - size
            return
        value, shift, limit = self._value, self._shift, self.limit
        while pos < size:
            if shift < 0:  # the packet type and flags
                pos += 1
                value = shift = 0
                continue
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if value > limit:  # as the decoder, before the length's last byte if need be
                self.over = True
                return
            shift += 7
            if byte & 0x80 and shift < 28:
                continue
            pos += value  # a malformed fifth length byte: the decoder refuses it anyway
            shift = -1
        self._skip = pos - size
        self._value, self._shift = value, shift


class _WsprotoTransport:
    """What ``ws`` and ``wss`` share: the handshake and the frames, over a byte transport
    each subclass brings (a ``TcpTransport``, a ``TlsTransport``)."""

    __slots__ = ("_control", "_eof", "_max_output", "_outbox", "_sizes", "peer", "ws")

    secure = False
    identity: str | None = None

    def __init__(self, peer: str, max_packet_size: int | None,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self.peer = peer
        #: Bytes of control frames queued since the outbox was last taken whole, and how
        #: many make the reader stop reading until it is (``_drain``).
        self._control = 0
        self._max_output = max_output
        self.ws = WSConnection(ConnectionType.SERVER)
        #: Encoded frames not yet taken by the socket, in order.
        self._outbox = bytearray()
        #: The peer closed (a close frame, or its end of the socket).
        self._eof = False
        #: Whether a packet over the decoder's limit came (None: not watched).
        self._sizes = None if max_packet_size is None else _PacketSizes(max_packet_size)

    # -- the byte transport underneath --------------------------------------------------

    async def read(self) -> bytes:
        """The next bytes (b"": closed)."""
        raise NotImplementedError

    async def _write_queued(self) -> None:
        """Write what is queued (``_outbox``) now; raises ``trio.BrokenResourceError``."""
        raise NotImplementedError

    def _control_queued(self) -> None:
        """A control frame (pong, close) was queued: written now if that needs no wait
        (a plain socket); else ``_reader_flush`` or the next write takes it."""

    async def _reader_flush(self) -> None:
        """Frames are still queued after the reader's events: a transport that cannot
        write them without waiting (TLS) writes them here, unless its writer is about to,
        so that a pong does not wait for the next outbound packet."""

    async def _close_inner(self) -> None:
        raise NotImplementedError

    # -- the handshake ----------------------------------------------------------------------

    async def accept(self, timeout: float) -> bool:
        """Read the client's upgrade request and answer it, within ``timeout``; False (and
        the connection closed) if it was refused, or the client left or was too slow.

        The bytes after the request (the client's first frames, sent without waiting for
        the 101) are kept from wsproto until the upgrade is accepted: it drops those it has
        when it accepts (see the module docstring)."""
        ws = self.ws
        head = bytearray()
        with trio.move_on_after(timeout):
            while True:
                data = await self.read()
                if not data:
                    break
                start = max(len(head) - 2, 0)  # a blank line may straddle two reads
                head += data
                end = _end_of_head(head, start)
                after = b""
                if end is not None and end < len(head):
                    after = bytes(head[end:])
                    data = data[:len(data) - len(after)]
                try:
                    ws.receive_data(data)
                    request = next((e for e in ws.events() if isinstance(e, Request)), None)
                    subprotocol = None if request is None else self._check(request, head)
                except RemoteProtocolError as exc:  # not a WebSocket upgrade, or not ours
                    log.debug("websocket upgrade from %s refused: %s", self.peer, exc)
                    if exc.event_hint is not None:
                        with contextlib.suppress(LocalProtocolError):
                            self.queue(ws.send(exc.event_hint))
                        with contextlib.suppress(trio.BrokenResourceError):
                            await self._write_queued()
                    break
                if request is not None:
                    self.queue(ws.send(AcceptConnection(subprotocol=subprotocol)))
                    try:
                        await self._write_queued()
                    except trio.BrokenResourceError:
                        break
                    if after:
                        self._received(after)  # handed to the decoder by ``receive``
                    return True
                if end is not None:
                    break  # a whole head that made no request: h11 would have said why
        await self._close_inner()
        return False

    @staticmethod
    def _check(request: Request, head: bytes | bytearray) -> str | None:
        """The subprotocol to answer ``request`` (whose bytes begin ``head``) with; raises
        ``RemoteProtocolError`` (with a 400 to send) for an upgrade this broker refuses where
        wsproto does not."""
        version = _http_version(head)
        if version != b"HTTP/1.1":
            raise RemoteProtocolError(
                f"a WebSocket upgrade needs HTTP/1.1, not {version[:20]!r}",
                event_hint=RejectConnection(status_code=400))
        if not _valid_key(request):
            raise RemoteProtocolError("Sec-WebSocket-Key is not 16 bytes in base64",
                                      event_hint=RejectConnection(status_code=400))
        offered = request.subprotocols
        subprotocol = next((name for name in MQTT_SUBPROTOCOLS if name in offered), None)
        if offered and subprotocol is None:
            raise RemoteProtocolError(
                f"no MQTT subprotocol offered ({', '.join(offered)[:200]})",
                event_hint=RejectConnection(status_code=400))
        return subprotocol

    # -- reading ----------------------------------------------------------------------------

    def _received(self, raw: bytes) -> None:
        try:
            self.ws.receive_data(raw)
        except LocalProtocolError:  # bytes after the close: nothing more to read
            self._eof = True

    async def receive(self) -> bytes:
        """The MQTT bytes of the next data frames (b"": the peer closed)."""
        while True:
            if self._eof:
                return b""
            data = self._take_events()
            if self._outbox:
                await self._reader_flush()
            if data:
                if self._sizes is not None:
                    self._sizes.feed(data)
                return data
            if self._eof:
                return b""
            if self._control > self._max_output:
                await self._drain()
                continue
            raw = await self.read()
            if not raw:
                self._eof = True
                return b""
            self._received(raw)

    async def _drain(self) -> None:
        """Write the queued frames before reading more: what the reader answers (a pong
        for each PING) is bounded by what the peer reads, not by what it sends.  A peer
        that never reads keeps the reader here until its keep-alive timeout ends it."""
        try:
            await self._write_queued()
        except trio.BrokenResourceError:
            self._outbox.clear()
            self._eof = True  # the peer is gone: nothing more to read either
        self._control = 0

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

    def _send_control(self, event: Event) -> None:
        try:
            frame = self.ws.send(event)
        except LocalProtocolError:
            return  # closing already
        self._outbox += frame
        self._control += len(frame)
        self._control_queued()

    def queue(self, data: bytes) -> None:
        self._outbox += data

    # -- writing ----------------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        try:
            self._outbox += self.ws.send(BytesMessage(data=data))
        except LocalProtocolError as exc:  # closing: nobody to send to
            raise trio.BrokenResourceError("websocket closed") from exc
        await trio.lowlevel.checkpoint_if_cancelled()
        await self._write_queued()

    async def aclose(self) -> None:
        """Say goodbye with a close frame (if the peer has not closed first): 1009 if a
        packet over the size limit is why, else 1000; then close the connection."""
        if self.ws.state is ConnectionState.OPEN:
            sizes = self._sizes
            self._send_control(CloseConnection(
                MESSAGE_TOO_BIG if sizes is not None and sizes.over else NORMAL_CLOSURE))
        if self._outbox:
            # One second, shielded from the connection's own cancellation.  Not a shield
            # inside ``move_on_after(1)``: that shielded the write from its own deadline,
            # and a peer that had stopped reading held the connection's task (its socket,
            # and the node's shutdown) for ever, until 2026-11-29.
            with (trio.CancelScope(deadline=trio.current_time() + 1, shield=True),
                  contextlib.suppress(trio.BrokenResourceError)):
                await self._write_queued()
        await self._close_inner()


class PlainWebSocketTransport(_WsprotoTransport):
    """A ``ws`` connection: MQTT bytes in binary frames over the plain socket."""

    __slots__ = ("_flushed", "_flushing", "tcp")

    def __init__(self, sock: socket.socket, max_packet_size: int | None = None,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        self.tcp = TcpTransport(sock)
        super().__init__(f"ws:{self.tcp.peer}", max_packet_size, max_output)
        #: A task (the writer, or the reader in ``_drain``) waits for the socket to take
        #: the outbox: trio lets one task at a time wait for a socket to be writable ...
        self._flushing = False
        #: ... and the other waits for it here (made when needed) if it must.
        self._flushed: trio.Event | None = None

    async def read(self) -> bytes:
        """The socket's next bytes (b"": closed), read once epoll reports them."""
        return await self.tcp.receive()

    def _control_queued(self) -> None:
        self.flush_now()

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
                self._control = 0
                return True
            del outbox[:sent]
        self._control = 0
        return True

    async def _write_queued(self) -> None:
        """Write the outbox, or wait while the other task (the writer, the reader's
        ``_drain``) writes it: both write from its start, so whoever waits for the socket
        takes the other's frames too.  No lock: it would cost every write a scheduler pass."""
        sock = self.tcp.sock
        while not self.flush_now():
            if self._flushing:
                if self._flushed is None:
                    self._flushed = trio.Event()
                await self._flushed.wait()
                continue  # written, or that task gave up (cancelled): carry on
            self._flushing = True
            try:
                await trio.lowlevel.wait_writable(sock)
            except (OSError, trio.ClosedResourceError) as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
            finally:
                self._flushing = False
                event, self._flushed = self._flushed, None
                if event is not None:
                    event.set()

    async def _close_inner(self) -> None:
        """As ``TcpTransport.aclose``: what we sent last is read before the close.  Closed
        even if cancelled in its linger (the caller's second spent on a peer that stopped
        reading): ``TcpTransport.aclose`` would leave the socket open then."""
        try:
            await self.tcp.aclose()
        finally:
            sock = self.tcp.sock
            if sock.fileno() != -1:
                trio.lowlevel.notify_closing(sock)
                sock.close()


class TlsWebSocketTransport(_WsprotoTransport):
    """A ``wss`` connection: a WebSocket over a TLS stream the node handshook itself.

    The stream takes one writer at a time: the connection's writer and the reader's pongs
    take turns (``_writing``), whoever holds it writing what the other queued too.
    """

    __slots__ = ("_writing", "identity", "tls")

    secure = True

    def __init__(self, stream: trio.SSLStream[trio.SocketStream], peer: str,
                 identity: str | None, max_packet_size: int | None = None,
                 max_output: int = DEFAULT_MAX_OUTPUT) -> None:
        super().__init__(f"wss:{peer}", max_packet_size, max_output)
        self.tls = TlsTransport(stream, peer, identity)
        self.identity = identity  # type: ignore[misc]
        self._writing = trio.Lock()

    async def read(self) -> bytes:
        """The stream's next bytes (b"": closed or broken)."""
        return await self.tls.receive()

    async def _reader_flush(self) -> None:
        if self._writing.locked():
            return  # the writer takes them along
        try:
            await self._write_queued()
        except trio.BrokenResourceError:
            self._eof = True  # the peer is gone: nothing more to read either

    async def _write_queued(self) -> None:
        outbox = self._outbox
        async with self._writing:
            while outbox:
                chunk = bytes(outbox)
                outbox.clear()
                self._control = 0  # the reader may queue as much again while it goes
                await self.tls.send(chunk)

    async def _close_inner(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, OSError):
            await self.tls.aclose()
