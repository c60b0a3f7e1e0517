"""A trivial MQTT sink: proves the load generator is not the bottleneck.

It accepts connections, answers CONNECT with CONNACK and SUBSCRIBE with SUBACK, discards
every other byte a publisher sends (counting bytes only: parsing would make the sink the
bottleneck), and floods a subscriber with pre-encoded QoS 0 PUBLISH frames.  Whatever rate
the generator reaches against it is the ceiling of any figure measured against a broker;
the report prints it next to the best broker figure.

It runs in its own process (one thread per connection; ``recv``/``sendall`` release the GIL)
and stops when its parent sets the stop event or after ``max_seconds``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

from benchmarks import wire


def _serve_conn(conn: socket.socket, flood: bytes, counter: list[int], until: float) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        conn.settimeout(None)  # daemon thread: dies with the sink process
        try:
            while time.monotonic() < until:
                frame = wire.next_frame(buf, 0, len(buf))
                if frame is None:
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        return
                    buf += chunk
                    continue
                first, body, end = frame
                if first == 0x10:
                    conn.sendall(b"\x20\x02\x00\x00")
                elif first == 0x82:
                    pid = bytes(buf[body : body + 2])
                    conn.sendall(b"\x90\x03" + pid + b"\x00")
                    while time.monotonic() < until:
                        conn.sendall(flood)
                    return
                else:
                    # A publisher: from here on only count bytes.
                    counter[0] += len(buf)
                    buf.clear()
                    while time.monotonic() < until:
                        n = conn.recv(1 << 20)
                        if not n:
                            return
                        counter[0] += len(n)
                del buf[:end]
        except OSError:
            return


def serve(port_out: Any, stop: Any, topic: str, payload_size: int, max_seconds: float) -> None:
    """Process entry point: bind a free loopback port, report it, serve until ``stop``."""
    until = time.monotonic() + max_seconds
    frame = wire.publish(topic, wire.payload(payload_size))
    flood = frame * max(1, 65536 // len(frame))
    counter = [0]
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", 0))
        srv.listen(128)
        srv.settimeout(0.1)
        port_out.put(srv.getsockname()[1])
        while not stop.is_set() and time.monotonic() < until:
            with contextlib.suppress(TimeoutError):
                conn, _ = srv.accept()
                threading.Thread(
                    target=_serve_conn, args=(conn, flood, counter, until), daemon=True
                ).start()
