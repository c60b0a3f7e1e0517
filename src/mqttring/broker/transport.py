"""Byte transports under an MQTT connection: what every transport offers, and TCP's.

(TLS connections have their own transport in ``mqttring.broker.tls``; ``ws`` and ``wss``
connections theirs in ``mqttring.broker.websocket``.)
"""

from __future__ import annotations

import socket
from typing import Protocol

import trio

from mqttring.config import format_hostport

RECEIVE_SIZE = 65536
#: Closing: how long, and how many bytes, to read and drop from a client that keeps sending
#: after our last packet, so that closing does not reset the connection (``aclose``).
LINGER_SECONDS = 0.5
LINGER_BYTES = 1 << 20


class Transport(Protocol):
    peer: str
    #: Encrypted (TLS): ``use_identity_as_username`` applies (``mqttring.broker.tls``).
    secure: bool
    #: The CN of the client's verified certificate; None without TLS or without one.
    identity: str | None

    async def receive(self) -> bytes:
        """Next chunk of bytes; ``b""`` when the peer closed."""

    async def send(self, data: bytes) -> None: ...

    async def aclose(self) -> None: ...


class TcpTransport:
    """A TCP connection on the plain (non-blocking) socket, waited on with trio's I/O hooks.

    Not ``trio.SocketStream`` (its conflict detectors and wrapper cost about a kilobyte per
    connection), and not even trio's socket object: an idle connection is a task suspended
    in ``receive``, and every coroutine frame between the reader and the epoll wait is
    memory each of 10,000 idle connections keeps; trio's socket methods add two (a wrapper
    and a helper) and an object.  Every read waits for epoll first (``receive``).
    """

    __slots__ = ("peer", "sock")

    # Class attributes, not slots: a plain connection pays nothing for TLS's fields.
    secure = False
    identity: str | None = None

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        try:
            host, port = sock.getpeername()[:2]
            self.peer = format_hostport(host, port)
        except OSError:
            self.peer = "?"

    def fileno(self) -> int:
        return self.sock.fileno()

    def send_now(self, data: memoryview) -> int:
        """Write what the socket takes without waiting (0 if its buffer is full); raises
        ``OSError`` if the connection is broken."""
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0

    async def receive(self) -> bytes:
        """The next bytes, read only once epoll has reported them, never before.

        epoll reports ready sockets in the order their bytes arrived (a socket that already
        holds bytes when it is armed counts from then, which only makes it later), so two
        connections' bytes are handled in arrival order (``broker/scheduling.py``).  Until
        2026-11-28 a reader that found bytes at once read them without waiting (and
        yielded a pass after every read): a connection that had just been active was a
        pass ahead of an idle one whose bytes came first, and a SUBSCRIBE lost the race
        to a later PUBLISH of another client (up to 59 of 60 rounds in
        ``tests/test_e2e_ordering.py`` on a loaded machine).  The wait is also the pass
        that lets other connections run (a busy client cannot starve them), and bytes are
        handled in the pass that reported them (no further yield: latency).  Parked
        connections' bytes are ordered by the lot's turns (``broker/arrival.py``).
        """
        sock = self.sock
        while True:
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:
                return b""
            try:
                return sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                return b""

    def has_bytes(self) -> bool:
        """Whether the socket holds bytes (or the peer's close) now, without taking them."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            pass
        return True

    def receive_ready(self) -> bytes | None:
        """What the socket holds now, without waiting or yielding; None if nothing (b"":
        closed).  For a connection the parking lot resumed because it was readable: the
        lot's wake-up was its scheduler pass."""
        try:
            return self.sock.recv(RECEIVE_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        sock = self.sock
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        try:
            while view:
                try:
                    view = view[sock.send(view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)
                    waited = True
        except (OSError, trio.ClosedResourceError) as exc:
            raise trio.BrokenResourceError(str(exc)) from exc
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def aclose(self) -> None:
        """Close so that the client reads what we sent last.

        Closing a socket that still holds unread bytes makes the kernel send a reset, and a
        reset throws away what the client had not read yet: the DISCONNECT that says why
        (MQTT 5: 0x93 receive maximum exceeded, 0x82 protocol error...) or a refusing
        CONNACK, precisely when the client is still sending (Paho's ``client_test5.py``
        ``test_flow_control2`` got a reset instead of its 0x93 in 4 runs of 5).  So: FIN
        after our bytes (``shutdown``), then read and drop what the client still sends
        until it closes too, at most ``LINGER_SECONDS`` and ``LINGER_BYTES``, then close.
        """
        sock = self.sock
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # already reset or closed by the peer: nothing to protect
        else:
            with trio.move_on_after(LINGER_SECONDS):
                drained = 0
                while drained < LINGER_BYTES:
                    try:
                        data = sock.recv(RECEIVE_SIZE)
                    except BlockingIOError:
                        await trio.lowlevel.wait_readable(sock)
                        continue
                    except OSError:
                        break
                    if not data:
                        break  # the client closed its side: nothing left to reset us
                    drained += len(data)
        # Wakes (with ClosedResourceError) any task still waiting on this descriptor, as
        # trio requires before a descriptor it may be polling is closed.
        trio.lowlevel.notify_closing(sock)
        sock.close()
        await trio.lowlevel.checkpoint()
