"""TCP listeners for the MQTT and WebSocket ports, optionally shared between processes.

``reuse_port`` binds with ``SO_REUSEPORT``: several node processes on one machine (``python
-m mqttring.node --workers N``) then listen on the same port and the kernel spreads new
connections over them, so one address uses every core.  Every process must set it (the
kernel refuses a second bind otherwise), and only processes of the same user may share.
"""

from __future__ import annotations

import socket

import trio

from mqttring.config import format_hostport
from mqttring.errors import ListenError

#: Pending connections the kernel may queue per listener (capped by net.core.somaxconn).
BACKLOG = 4096


async def open_listeners(host: str, port: int, *, reuse_port: bool = False
                         ) -> list[trio.SocketListener]:
    """Listen on ``host:port`` (every address it resolves to, as ``trio.open_tcp_listeners``).

    A bind that fails raises ``ListenError`` naming the address (``127.0.0.1:1883: address
    already in use``), not trio's group of per-address errors.
    """
    try:
        return await _open(host, port, reuse_port)
    except OSError as exc:
        raise ListenError(format_hostport(host, port), exc) from None


async def _open(host: str, port: int, reuse_port: bool) -> list[trio.SocketListener]:
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host or None, backlog=BACKLOG)
    infos = await trio.socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                          flags=socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    try:
        for family, kind, proto, _, address in infos:
            sock = trio.socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(address)
                sock.listen(BACKLOG)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            await listener.aclose()
        raise
    return listeners
