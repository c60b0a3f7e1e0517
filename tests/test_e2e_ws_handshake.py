"""WebSocket upgrades and closes over ``ws`` and ``wss``, on raw (TLS) sockets.

What a library client never does, and RFC 6455 or MQTT section 6 still decide:

* a CONNECT sent in the same segment (or TLS record) as the upgrade request, before the
  101 (allowed: mosquitto answers it); wsproto drops what follows the request when it
  accepts, and until 2026-11-29 such a client got its 101 and then nothing, closed after
  ``connect_timeout``, over ``ws`` and ``wss`` alike;
* an upgrade offering only subprotocols that are not MQTT's: the server selects "mqtt"
  (MQTT 3.1.1 and 5 section 6), so it is refused with 400 (one offering none is accepted,
  as it always was, for clients that send no ``Sec-WebSocket-Protocol``);
* a ``Sec-WebSocket-Key`` that is not 16 bytes in base64 (RFC 6455 4.2.1): 400;
* a packet over ``max_packet_size``: close code 1009 (Message Too Big), not 1000.
"""

from __future__ import annotations

import base64
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from mqtt_client import CONNACK, StreamDecoder, connect, publish
from ws_support import server_cert, ws_frame

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
#: The node's ``limits.max_packet_size`` here.
MAX_PACKET = 1024
#: Longer than any wait below: a connection left waiting for it fails the test first.
CONNECT_TIMEOUT = 20.0
WAIT = 5.0


@dataclass(frozen=True)
class WsNode:
    ws: int
    wss: int
    client_context: ssl.SSLContext


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WsNode]:
    """A node (in this process) with ``ws`` and ``wss`` listeners and a small
    ``max_packet_size``."""
    from mqttring import BrokerConfig, Limits, MqttRingBroker

    tmp = Path(tmp_path_factory.mktemp("ws-handshake"))
    ca = trustme.CA()
    cert, key = server_cert(ca, tmp)
    config = BrokerConfig(node_id="ws-handshake", mqtt=f"{HOST}:0", ws=f"{HOST}:0",
                          wss=f"{HOST}:0", certfile=cert, keyfile=key, data_dir=None,
                          sys_interval=0,
                          limits=Limits(max_packet_size=MAX_PACKET,
                                        connect_timeout=CONNECT_TIMEOUT))
    broker = MqttRingBroker(config)
    ports = broker.start()
    assert ports.ws and ports.wss, ports
    context = ssl.create_default_context()
    ca.configure_trust(context)
    try:
        yield WsNode(ports.ws, ports.wss, context)
    finally:
        broker.stop()


Opener = Callable[[], socket.socket]


@pytest.fixture(params=["ws", "wss"])
def open_socket(request: pytest.FixtureRequest, node: WsNode) -> Opener:
    """Opens a connection to the node's ``ws`` or ``wss`` listener (TLS handshake done)."""
    def opener() -> socket.socket:
        sock = socket.create_connection((HOST, node.ws if request.param == "ws" else node.wss),
                                        timeout=WAIT)
        if request.param == "wss":
            return node.client_context.wrap_socket(sock, server_hostname=HOST)
        return sock
    return opener


def _key() -> str:
    return base64.b64encode(os.urandom(16)).decode()


def _upgrade(key: str | None = None, protocols: str | None = "mqtt") -> bytes:
    lines = ["GET /mqtt HTTP/1.1", f"Host: {HOST}", "Upgrade: websocket",
             "Connection: Upgrade", f"Sec-WebSocket-Key: {key or _key()}",
             "Sec-WebSocket-Version: 13"]
    if protocols is not None:
        lines.append(f"Sec-WebSocket-Protocol: {protocols}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _Peer:
    """The client's end: the node's answer to the upgrade, then its (unmasked) frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"nothing more within {WAIT}s; have {self.buf[:200]!r}"
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            chunk = None
        except (ssl.SSLError, ConnectionResetError):
            chunk = b""
        assert chunk is not None, f"nothing more within {WAIT}s; have {self.buf[:200]!r}"
        assert chunk, f"the node closed; have {self.buf[:200]!r}"
        self.buf += chunk

    def response(self) -> str:
        """The HTTP answer's status line and headers."""
        deadline = time.monotonic() + WAIT
        while b"\r\n\r\n" not in self.buf:
            self._more(deadline)
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head.decode("latin-1")

    def frame(self) -> tuple[int, bytes]:
        """The node's next frame: (opcode, payload)."""
        deadline = time.monotonic() + WAIT
        while True:
            buf = self.buf
            if len(buf) >= 2:
                n, at = buf[1] & 0x7F, 2
                if n == 126:
                    n, at = int.from_bytes(buf[2:4], "big"), 4
                elif n == 127:
                    n, at = int.from_bytes(buf[2:10], "big"), 10
                if len(buf) >= at + n:
                    self.buf = buf[at + n:]
                    return buf[0] & 0x0F, buf[at:at + n]
            self._more(deadline)


def _status(response: str) -> int:
    return int(response.split(" ", 2)[1])


def test_a_connect_in_the_same_segment_as_the_upgrade_is_answered(open_socket: Opener) -> None:
    """Upgrade request and CONNECT frame in one write: 101, then the CONNACK (at once, not
    a close after ``connect_timeout``)."""
    with open_socket() as sock:
        sock.sendall(_upgrade() + ws_frame(connect("ws-pipelined")))
        peer = _Peer(sock)
        response = peer.response()
        assert _status(response) == 101, response
        assert "sec-websocket-protocol: mqtt" in response.lower(), response
        decoder = StreamDecoder()
        while (packet := decoder.next_packet()) is None:
            opcode, payload = peer.frame()
            assert opcode == 2, (opcode, payload)
            decoder.feed(payload)
        assert packet.type == CONNACK and packet.return_code == 0, packet


@pytest.mark.parametrize(("protocols", "status"), [
    ("foo", 400),
    ("foo, bar", 400),
    ("foo, mqtt", 101),
    ("mqttv3.1", 101),
    (None, 101),  # no Sec-WebSocket-Protocol at all: accepted, as always
])
def test_an_upgrade_must_offer_an_mqtt_subprotocol_if_it_offers_any(
        open_socket: Opener, protocols: str | None, status: int) -> None:
    with open_socket() as sock:
        sock.sendall(_upgrade(protocols=protocols))
        response = _Peer(sock).response()
        assert _status(response) == status, response


@pytest.mark.parametrize(("key", "status"), [
    ("abc", 400),  # not base64
    (base64.b64encode(b"fifteen bytes!!").decode(), 400),
    (base64.b64encode(b"seventeen bytes!!").decode(), 400),
    ("!!!!!!!!!!!!!!!!!!!!!!==", 400),
    ("dGhlIHNhbXBsZSBub25jZQ==", 101),  # RFC 6455's own example
])
def test_an_upgrade_needs_a_16_byte_key(open_socket: Opener, key: str, status: int) -> None:
    with open_socket() as sock:
        sock.sendall(_upgrade(key=key))
        response = _Peer(sock).response()
        assert _status(response) == status, response


def test_a_packet_over_the_limit_closes_with_1009(open_socket: Opener) -> None:
    """A PUBLISH whose remaining length is over ``max_packet_size`` ends the connection with
    close code 1009 (Message Too Big), where ``ws`` said 1000."""
    with open_socket() as sock:
        sock.sendall(_upgrade())
        peer = _Peer(sock)
        assert _status(peer.response()) == 101
        sock.sendall(ws_frame(connect("ws-too-big")))
        assert peer.frame() == (2, bytes([0x20, 2, 0, 0])), "CONNACK"
        sock.sendall(ws_frame(publish("ws/big", b"x" * (2 * MAX_PACKET))))
        while (frame := peer.frame())[0] != 8:
            assert frame[0] == 2, frame
        assert int.from_bytes(frame[1][:2], "big") == 1009, frame


def test_pings_are_answered_and_a_close_is_returned(open_socket: Opener) -> None:
    """A ping between packets gets its pong at once (``wss`` writes it from the reader now,
    no longer from trio-websocket's task), and the client's close gets the node's."""
    with open_socket() as sock:
        sock.sendall(_upgrade())
        peer = _Peer(sock)
        assert _status(peer.response()) == 101
        sock.sendall(ws_frame(connect("ws-ping")))
        assert peer.frame() == (2, bytes([0x20, 2, 0, 0])), "CONNACK"
        sock.sendall(ws_frame(b"are you there", opcode=9))
        assert peer.frame() == (10, b"are you there")
        sock.sendall(ws_frame((1000).to_bytes(2, "big"), opcode=8))
        opcode, payload = peer.frame()
        assert (opcode, payload[:2]) == (8, (1000).to_bytes(2, "big"))
