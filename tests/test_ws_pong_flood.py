"""WebSocket clients that misbehave below MQTT: a PING flood that never reads its PONGs,
and an upgrade over HTTP/1.0 (from a fuzz probe of 2026-11-29).

Until then every PONG went to the transport's outbox and the reader kept reading: 40 MB
of PINGs from a client that never read grew the node by 32 MiB, eight times
``max_outgoing_buffer``.  The reader stops reading now once the outbox is over that bound,
as a TCP connection's peer feels the node stop reading; the flood stalls in the client's
own send.  The node is a real process (its RSS is the measure), over ``ws`` and ``wss``.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from mqtt_client import (
    CONNACK,
    PUBACK,
    SUBACK,
    Packet,
    RawClient,
    StreamDecoder,
    connect,
    publish,
    subscribe,
)
from ws_support import server_cert, ws_frame

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"
#: The node's ``max_outgoing_buffer``, which bounds its outbox: smaller than the default
#: 4 MiB so that the floods stall after about a second of the node's reading, not ten.
OUTGOING_BUFFER = 512 * 1024
#: The node's ``slow_subscriber_hold`` (default 10 s): how long a client that reads nothing
#: keeps its connection.
HOLD_SECONDS = 2
#: Bytes of PING frames the flood offers at most: well past what the kernel's socket
#: buffers take (several MB on loopback) and the node's bound.
FLOOD_BYTES = 24_000_000
#: A send blocked this long means the node stopped reading (it reads 64 KiB a pass).
STALL_SECONDS = 3.0
#: The node's RSS may grow by this much over the flood: the outbox's bound and change.
#: Unbounded, the 24 MB flood grew it by about 20 MiB.
MAX_GROWTH_KIB = 12 * 1024


@dataclass
class FloodNode:
    proc: subprocess.Popen[bytes]
    mqtt: int
    ws: int
    wss: int
    client_context: ssl.SSLContext

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, log: Path) -> dict[str, int]:
    deadline = time.monotonic() + 30
    delay = 0.02
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"node exited early:\n{log.read_text()}")
        try:
            return json.loads(ready.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        assert time.monotonic() < deadline, "node not ready within 30 s"
        time.sleep(delay)  # polling the ready file, bounded
        delay = min(delay * 2, 0.25)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FloodNode]:
    """A node process with ``ws`` and ``wss`` listeners, ``OUTGOING_BUFFER`` and
    ``HOLD_SECONDS``."""
    tmp = Path(tmp_path_factory.mktemp("ws-flood"))
    ca = trustme.CA()
    cert, key = server_cert(ca, tmp)
    ready, log = tmp / "ready.json", tmp / "node.log"
    config = tmp / "node.toml"
    config.write_text(f"[limits]\nmax_outgoing_buffer = {OUTGOING_BUFFER}\n"
                      f"slow_subscriber_hold = {HOLD_SECONDS}\n")
    cmd = [sys.executable, "-m", "mqttring.node", "--node-id", "ws-flood", "--config", str(config),
           "--mqtt", f"{HOST}:0", "--ws", f"{HOST}:0", "--wss", f"{HOST}:0",
           "--certfile", str(cert), "--keyfile", str(key),
           "--data-dir", str(tmp / "data"), "--sys-interval", "0",
           "--ready-file", str(ready)]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        info = _wait_ready(proc, ready, log)
        context = ssl.create_default_context()
        ca.configure_trust(context)
        yield FloodNode(proc, int(info["mqtt"]), int(info["ws"]), int(info["wss"]), context)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]


def _open(node: FloodNode, scheme: str) -> socket.socket:
    sock = socket.socket()
    # A small receive buffer: the node's pongs fill it at once, and then its own.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((HOST, node.ws if scheme == "ws" else node.wss))
    if scheme == "wss":
        return node.client_context.wrap_socket(sock, server_hostname=HOST)
    return sock


def _upgrade(version: str = "1.1") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET /mqtt HTTP/{version}\r\nHost: {HOST}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n").encode()


def _read_until(sock: socket.socket, done: Callable[[bytes], bool], what: str) -> bytes:
    buf = b""
    while not done(buf):
        chunk = sock.recv(65536)
        assert chunk, f"the node closed before {what}; have {buf[:200]!r}"
        buf += chunk
    return buf


class _Frames:
    """The MQTT packets in the node's binary frames, read as they are needed."""

    def __init__(self, sock: socket.socket, buf: bytes) -> None:
        self.sock, self.buf, self.decoder = sock, buf, StreamDecoder()

    def packet(self) -> Packet:
        while (packet := self.decoder.next_packet()) is None:
            buf = self.buf
            if len(buf) >= 2:
                n, at = buf[1] & 0x7F, 2
                if n == 126:
                    n, at = int.from_bytes(buf[2:4], "big"), 4
                if n < 127 and len(buf) >= at + n:
                    assert buf[0] & 0x0F == 2, buf[:20]
                    self.decoder.feed(buf[at:at + n])
                    self.buf = buf[at + n:]
                    continue
            chunk = self.sock.recv(65536)
            assert chunk, f"the node closed; have {buf[:200]!r}"
            self.buf += chunk
        return packet


def _connected(node: FloodNode, scheme: str, client_id: str,
               keepalive: int = 0) -> tuple[socket.socket, _Frames]:
    """A WebSocket connection whose CONNECT was accepted, and its reader."""
    sock = _open(node, scheme)
    sock.sendall(_upgrade())
    head = _read_until(sock, lambda b: b"\r\n\r\n" in b, "the 101")
    assert head.startswith(b"HTTP/1.1 101"), head[:200]
    frames = _Frames(sock, head.partition(b"\r\n\r\n")[2])
    sock.sendall(ws_frame(connect(client_id, keepalive=keepalive)))
    connack = frames.packet()
    assert connack.type == CONNACK and connack.return_code == 0, connack
    return sock, frames


def _flood(sock: socket.socket) -> tuple[int, str]:
    """PINGs until ``FLOOD_BYTES`` went, a send blocked ``STALL_SECONDS`` or the node
    closed: (bytes sent, "read all" / "stalled" / "closed")."""
    chunk = ws_frame(b"P" * 125, opcode=0x9) * 2000  # 262 KB of the largest PINGs
    sock.settimeout(STALL_SECONDS)
    sent = 0
    try:
        while sent < FLOOD_BYTES:
            sock.sendall(chunk)
            sent += len(chunk)
    except TimeoutError:
        return sent, "stalled"
    except OSError:  # reset, broken pipe, TLS EOF
        return sent, "closed"
    return sent, "read all"


@pytest.mark.parametrize("scheme", ["ws", "wss"])
def test_a_ping_flood_that_never_reads_stalls_instead_of_growing_the_node(
        node: FloodNode, scheme: str) -> None:
    """The client subscribes, deliveries it does not read keep the node's writer waiting
    (over ``wss`` the reader wrote the pongs itself unless the writer was busy), and then
    it floods PINGs: the node stops reading, and its RSS stays within the bound."""
    topic = f"flood/{scheme}"
    sock, frames = _connected(node, scheme, f"flood-{scheme}")
    with sock:
        sock.sendall(ws_frame(subscribe(1, [(topic, 0)])))
        assert frames.packet().type == SUBACK

        # 6 MB of deliveries the client does not read: more than the sockets hold.
        publisher = RawClient(HOST, node.mqtt)
        try:
            assert publisher.connect(f"feeder-{scheme}").return_code == 0
            for packet_id in range(1, 7):
                publisher.send(publish(topic, b"d" * 1_000_000, qos=1, packet_id=packet_id))
                assert publisher.expect(PUBACK).packet_id == packet_id
        finally:
            publisher.close()

        before = node.rss_kib()
        sent, outcome = _flood(sock)
        after = node.rss_kib()
        figures = (f"{scheme}: {sent / 1e6:.1f} MB of PINGs sent, node RSS {before} -> "
                   f"{after} KiB (+{(after - before) / 1024:.1f} MiB)")
        print(figures)
        assert outcome == "stalled", f"{outcome}: {figures}"
        assert after - before < MAX_GROWTH_KIB, figures

    # The node serves on: a client over TCP connects and is answered.
    client = RawClient(HOST, node.mqtt)
    try:
        assert client.connect(f"after-flood-{scheme}").return_code == 0
    finally:
        client.close()


@pytest.mark.parametrize("scheme", ["ws", "wss"])
def test_a_flooder_that_never_reads_is_closed_by_its_keepalive(
        node: FloodNode, scheme: str) -> None:
    """The stalled reader still times the keep-alive out (1.5 x 1 s here), and the close
    is bounded too: until 2026-11-29 the closing write waited for the peer to read, shielded
    from its own one-second bound, and held the connection (and the node's shutdown) for
    ever."""
    sock, _ = _connected(node, scheme, f"silent-{scheme}", keepalive=1)
    with sock:
        _, outcome = _flood(sock)
        assert outcome != "read all"
        chunk = ws_frame(b"P" * 125, opcode=0x9) * 100
        sock.settimeout(1)
        deadline = time.monotonic() + 20
        while outcome != "closed":
            assert time.monotonic() < deadline, "the node did not close the connection in 20 s"
            try:
                sock.send(chunk)
            except TimeoutError:
                continue  # the node is not reading: its close has not come yet
            except OSError:
                outcome = "closed"  # reset or broken pipe: the node closed it


def test_an_upgrade_over_http_1_0_is_refused(node: FloodNode) -> None:
    """RFC 6455 4.1: the upgrade needs HTTP/1.1 (h11 took 1.0 too, and it was accepted)."""
    with _open(node, "ws") as sock:
        sock.sendall(_upgrade("1.0"))
        head = _read_until(sock, lambda b: b"\r\n\r\n" in b, "an answer")
        assert head.split(b" ", 2)[1] == b"400", head[:200]


def test_a_pingreq_flood_over_tcp_that_never_reads_stalls_too(node: FloodNode) -> None:
    """The same below WebSocket: MQTT PINGREQs over TCP from a client that never reads its
    PINGRESPs.  They piled up in the connection's output while its reader read on (+20.8
    MiB for 24.7 MB of PINGREQs); past twice ``max_outgoing_buffer`` of unread answers the
    reader stops now, and the flood stalls in the client's send."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((HOST, node.mqtt))
    try:
        sock.sendall(connect("tcp-flood", keepalive=0))
        decoder = StreamDecoder()
        while (connack := decoder.next_packet()) is None:
            data = sock.recv(4096)
            assert data, "closed before the CONNACK"
            decoder.feed(data)
        assert connack.type == CONNACK and connack.return_code == 0, connack
        before = node.rss_kib()
        chunk = b"\xc0\x00" * 131072  # 262 KB of PINGREQs
        sock.settimeout(STALL_SECONDS)
        sent, outcome = 0, "read all"
        try:
            while sent < FLOOD_BYTES:
                sock.sendall(chunk)
                sent += len(chunk)
        except TimeoutError:
            outcome = "stalled"
        growth = node.rss_kib() - before
        assert outcome == "stalled", f"the node read all {sent} bytes (+{growth} KiB)"
        assert growth < 16 * 1024, f"+{growth} KiB after {sent} bytes of PINGREQs"
        # Its keep alive (none here) cannot end it while the node does not read it: the
        # node sheds it after ``slow_subscriber_hold`` (``HOLD_SECONDS``) without a byte read.  Seen
        # from here as the socket leaving ESTABLISHED (TCP_INFO state 1): the node's FIN,
        # or its RST, since it closes with our PINGREQs unread.
        deadline = time.monotonic() + 30
        while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == 1:
            assert time.monotonic() < deadline, "a client that reads nothing stays connected"
            time.sleep(0.2)  # polling the socket's state, bounded
    finally:
        sock.close()
    client = RawClient(HOST, node.mqtt)  # the node serves on
    try:
        assert client.connect("after-tcp-flood").return_code == 0
    finally:
        client.close()
