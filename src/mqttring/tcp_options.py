"""TCP options for cluster connections (links, RPC, Raft): how they behave on a bad network.

Linux only, like the fault suite that found each of them; elsewhere, or where the kernel
refuses, a connection keeps TCP's defaults.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import socket
import struct
import termios
from typing import NamedTuple, Protocol

import trio

#: Linux's TCP_THIN_LINEAR_TIMEOUTS (not in Python's socket module).
TCP_THIN_LINEAR_TIMEOUTS = 16


#: Congestion controls that never set a slow-start threshold, and so keep a connection "in
#: initial slow start" for Linux, which then never applies thin-stream linear timeouts.
_NO_THIN_STREAMS = (b"bbr",)
#: What such a connection is switched to: the first one the kernel lets us set.
_THIN_STREAM_CONGESTION = (b"cubic", b"reno")


class SocketOptions(Protocol):
    """What the helpers below need: a ``socket.socket`` or a ``trio.SocketStream``."""

    def setsockopt(self, level: int, option: int, value: int | bytes) -> None: ...

    def getsockopt(self, level: int, option: int, buffersize: int) -> bytes: ...


def thin_stream_timeouts(stream: SocketOptions) -> None:
    """Retransmit at a linear, not doubling, timeout while few packets are in flight.

    Cluster connections are thin streams most of the time (a request, a frame of a few
    messages), and on a lossy network a segment lost a few times in a row otherwise holds
    everything behind it for seconds (0.2 + 0.4 + 0.8 + 1.6 + 3.2 + 6.4 s of backoff for
    six losses), stalling the publishers whose messages wait in that frame.  The fault
    suite's 15% loss saw a link carry nothing for 13 s that way, with every publisher
    stalled behind it.  Linux applies linear timeouts (the first six retries) only to a
    connection out of initial slow start, which BBR never leaves: see ``leave_bbr``.
    Linux only; elsewhere, or where refused, TCP's default backoff stays.

    The connection itself is never abandoned for a stall (no TCP_USER_TIMEOUT): much of what
    the links carry is sent once, unacknowledged (relayed session bytes, client
    acknowledgements, closes), on the promise that a link loses data only with a node.
    """
    with contextlib.suppress(OSError):
        stream.setsockopt(socket.IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS, 1)


def leave_bbr(stream: SocketOptions) -> bool:
    """Switch a connection under BBR to CUBIC (or Reno, which every user may set), so that
    Linux applies its thin-stream linear timeouts; True if it was switched.

    Done when every cluster connection opens (``for_cluster``: ``RpcClient.connect`` and Raft's
    transport), not when one is first seen retransmitting: that version (c37f073) let the first
    loss episode of a link double its timeout before the switch: under the fault suite's 15%
    loss its longest publish gaps were 1.5-12.1 s in six runs against 0.8-4.6 s in six switched
    up front (docs/faults.md). What BBR gives up, pacing and short queues under load, matters on
    long, shared paths, not between brokers on one network; on loopback the pair benchmark could
    not tell the two apart (QoS 0 at 275-309k/s with BBR links, 271-285k/s with CUBIC, within
    this VM's run-to-run spread). Any other congestion control is the operator's choice and
    stays.
    """
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        return False
    try:
        current = stream.getsockopt(socket.IPPROTO_TCP, option, 16).rstrip(b"\0")
    except OSError:
        return False
    if current not in _NO_THIN_STREAMS:
        return False
    for name in _THIN_STREAM_CONGESTION:
        try:
            stream.setsockopt(socket.IPPROTO_TCP, option, name)
            return True
        except OSError:
            continue
    return False


def for_cluster(stream: SocketOptions) -> None:
    """Every connection between nodes (data links, heartbeats, RPC, Raft), as it opens:
    thin-stream timeouts, and out of BBR so that Linux applies them."""
    thin_stream_timeouts(stream)
    leave_bbr(stream)


def socket_of(stream: trio.abc.Stream) -> trio.SocketStream | None:
    """The TCP stream under ``stream`` (under TLS, its transport), if there is one."""
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    return stream if isinstance(stream, trio.SocketStream) else None


def discard_unsent(stream: trio.abc.Stream) -> None:
    """Make the stream's coming close a TCP reset, which drops unsent data (SO_LINGER 0)."""
    tcp = socket_of(stream)
    if tcp is not None:
        with contextlib.suppress(OSError):
            tcp.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


#: ``struct tcp_info`` (Linux): ``tcpi_retransmits`` and ``tcpi_backoff`` are bytes 2 and
#: 4; only its first word is read.
_TCP_INFO_LEN = 8
#: ``SIOCOUTQ`` (Linux, the same number as ``TIOCOUTQ``): bytes in a socket's send queue,
#: sent but not acknowledged by the peer's TCP, or not sent yet.
_SIOCOUTQ = getattr(termios, "TIOCOUTQ", None)


class SendState(NamedTuple):
    """What the kernel says of a connection's sending side (``send_state``)."""

    #: TCP is retransmitting now (``tcpi_retransmits`` or ``tcpi_backoff``).
    retransmitting: bool
    #: Bytes written and not yet acknowledged by the peer's TCP (``SIOCOUTQ``).
    queued: int


def send_state(stream: trio.abc.Stream) -> SendState | None:
    """``stream``'s sending side as Linux's ``TCP_INFO`` and ``SIOCOUTQ`` tell it; None
    where they cannot be read (no TCP socket, another kernel): the caller's own evidence
    then decides alone."""
    tcp = socket_of(stream)
    if tcp is None or _SIOCOUTQ is None:
        return None
    try:
        sock = tcp.socket
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        queued = array.array("i", [0])
        fcntl.ioctl(sock.fileno(), _SIOCOUTQ, queued, True)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return SendState(info[2] > 0 or info[4] > 0, queued[0])


__all__ = ["TCP_THIN_LINEAR_TIMEOUTS", "SendState", "SocketOptions", "discard_unsent",
           "for_cluster", "leave_bbr", "send_state", "socket_of", "thin_stream_timeouts"]
