"""Byte transports under an MQTT connection: TCP streams and WebSocket messages.

MQTT over WebSocket (3.1.1 section 6) sends packets in binary frames, and a packet may span
frames or a frame hold several packets; since the codec is incremental, a WebSocket is just
another byte stream once frames are unwrapped.  A text frame is a protocol error [MQTT-6.0.0-1].
"""

from __future__ import annotations

from typing import Protocol

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from mqttring.protocol.errors import ProtocolViolation

RECEIVE_SIZE = 65536


class Transport(Protocol):
    peer: str

    async def receive(self) -> bytes:
        """Next chunk of bytes; ``b""`` when the peer closed."""

    async def send(self, data: bytes) -> None: ...

    async def aclose(self) -> None: ...


class TcpTransport:
    """A TCP connection on the bare trio socket.

    Not ``trio.SocketStream``: its per-stream conflict detectors and wrapper cost about a
    kilobyte per connection, which is an eighth of the idle-connection budget; the reader
    and the writer of a connection are distinct tasks by construction anyway.
    """

    __slots__ = ("peer", "sock")

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"
        except OSError:
            self.peer = "?"

    async def receive(self) -> bytes:
        try:
            return await self.sock.recv(RECEIVE_SIZE)
        except OSError:
            return b""

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        sock = self.sock
        try:
            while view:
                sent = await sock.send(view)
                view = view[sent:]
        except OSError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def aclose(self) -> None:
        self.sock.close()
        await trio.lowlevel.checkpoint()


class WebSocketTransport:
    __slots__ = ("peer", "ws")

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        remote = ws.remote
        self.peer = f"ws:{getattr(remote, 'address', remote)}:{getattr(remote, 'port', '')}"

    async def receive(self) -> bytes:
        try:
            message = await self.ws.get_message()
        except ConnectionClosed:
            return b""
        if isinstance(message, str):
            raise ProtocolViolation("MQTT-6.0.0-1", "MQTT over WebSocket needs binary frames")
        return message

    async def send(self, data: bytes) -> None:
        try:
            await self.ws.send_message(data)
        except ConnectionClosed as exc:
            raise trio.BrokenResourceError("websocket closed") from exc

    async def aclose(self) -> None:
        await self.ws.aclose()
