"""MQTT over WebSocket (MQTT 3.1.1 section 6)."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from mqtt_client import (
    CONNACK,
    PINGREQ_BYTES,
    PINGRESP,
    PUBACK,
    PUBLISH,
    SUBACK,
    Packet,
    RawClient,
    StreamDecoder,
    connect,
    puback,
    publish,
    subscribe,
)
from ws_support import ws_frame

pytestmark = pytest.mark.timeout(60)


def test_paho_websocket_round_trip_both_ways(paho, uid):
    """A paho client over WebSocket and one over TCP exchange QoS 0/1/2 messages both ways."""
    topic = uid("ws")
    ws = paho(uid("ws"), transport="websockets")
    ws.connect()
    tcp = paho(uid("tcp"))
    tcp.connect()
    ws.subscribe(f"{topic}/to-ws", 2)
    tcp.subscribe(f"{topic}/to-tcp", 2)
    for q in (0, 1, 2):
        tcp.publish(f"{topic}/to-ws", f"t{q}".encode(), qos=q)
        ws.publish(f"{topic}/to-tcp", f"w{q}".encode(), qos=q)
    assert sorted((m.payload, m.qos) for m in ws.collect(3)) == [(b"t0", 0), (b"t1", 1), (b"t2", 2)]
    assert sorted((m.payload, m.qos) for m in tcp.collect(3)) == [
        (b"w0", 0), (b"w1", 1), (b"w2", 2)
    ]  # fmt: skip
    big = bytes(range(256)) * 400  # > 64 KiB: a multi-frame / extended-length payload
    tcp.publish(f"{topic}/to-ws", big, qos=1)
    assert ws.get().payload == big


async def _recv_packet(ws, decoder: StreamDecoder, timeout: float = 5.0) -> Packet:
    with trio.fail_after(timeout):
        while True:
            pkt = decoder.next_packet()
            if pkt is not None:
                return pkt
            message = await ws.get_message()
            assert isinstance(message, bytes), "[MQTT-6.0.0-1] packets must be in binary frames"
            decoder.feed(message)


async def test_packets_split_across_and_packed_into_frames(broker, paho, uid):
    """[MQTT-6.0.0-2]: the receiver MUST NOT assume packets are aligned on frame boundaries;
    [MQTT-6.0.0-4]: the selected subprotocol is "mqtt".  The CONNECT is sent byte by byte
    in several frames, then SUBSCRIBE + PUBLISH + PINGREQ are packed into one frame."""
    topic = uid("split")
    url = f"ws://{broker.host}:{broker.ws_port}/mqtt"
    decoder = StreamDecoder()
    async with open_websocket_url(url, subprotocols=["mqtt"]) as ws:
        assert ws.subprotocol == "mqtt"
        data = connect(uid("wsraw"), keepalive=30)
        for cut in (data[:1], data[1:2], data[2:7], data[7:]):
            await ws.send_message(cut)
        ack = await _recv_packet(ws, decoder)
        assert (ack.type, ack.return_code) == (CONNACK, 0)
        await ws.send_message(
            subscribe(3, [(topic, 1)]) + publish(topic, b"self", qos=1, packet_id=9) + b"\xc0\x00"
        )
        got: list[Packet] = []
        with trio.fail_after(5):
            while len(got) < 4:
                got.append(await _recv_packet(ws, decoder))
        by_type = {p.type: p for p in got}
        assert set(by_type) == {SUBACK, PUBACK, PINGRESP, PUBLISH}, got
        assert by_type[SUBACK].return_codes == [1]
        assert by_type[PUBACK].packet_id == 9
        delivered = by_type[PUBLISH]
        assert (delivered.topic, delivered.payload, delivered.qos) == (topic, b"self", 1)
        await ws.send_message(puback(delivered.packet_id))
        # A publish split mid-payload across two frames from the WebSocket side reaches TCP.
        tcp = paho(uid("tcp"))
        await trio.to_thread.run_sync(tcp.connect)
        await trio.to_thread.run_sync(tcp.subscribe, topic, 0)
        frame = publish(topic, b"0123456789" * 10, qos=0)
        await ws.send_message(frame[:20])
        await trio.sleep(0.05)
        await ws.send_message(frame[20:])
        msg = await trio.to_thread.run_sync(tcp.get)
        assert msg.payload == b"0123456789" * 10


async def test_text_frame_closes_connection(broker, uid, caplog):
    """[MQTT-6.0.0-1]: a non-binary data frame MUST close the network connection: with
    close code 1003 (RFC 6455: a data type it cannot accept), as a protocol error of the
    client's (it was logged as an internal error, with a traceback, and closed with 1000)."""
    url = f"ws://{broker.host}:{broker.ws_port}/mqtt"
    decoder = StreamDecoder()
    with caplog.at_level("DEBUG", logger="mqttring"):
        async with open_websocket_url(url, subprotocols=["mqtt"]) as ws:
            await ws.send_message(connect(uid("txt")))
            assert (await _recv_packet(ws, decoder)).type == CONNACK
            await ws.send_message("\xc0\x00")  # a PINGREQ, but in a text frame
            with trio.fail_after(5), pytest.raises(ConnectionClosed) as closed:
                while True:
                    await ws.get_message()
            assert closed.value.reason.code == 1003, closed.value.reason
        await trio.sleep(0.2)  # the node's side of the close, logged
    errors = [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, errors


async def test_subprotocol_selected_from_list_and_will_on_ws_close(broker, paho, uid):
    """[MQTT-6.0.0-4]: with several offered subprotocols the server selects "mqtt"; closing the
    WebSocket without an MQTT DISCONNECT publishes the will (3.1.2.5)."""
    topic = uid("wswill")
    watcher = paho(uid("watch"))
    await trio.to_thread.run_sync(watcher.connect)
    await trio.to_thread.run_sync(watcher.subscribe, topic, 1)
    url = f"ws://{broker.host}:{broker.ws_port}/mqtt"
    decoder = StreamDecoder()
    async with open_websocket_url(url, subprotocols=["x-unknown", "mqtt"]) as ws:
        assert ws.subprotocol == "mqtt"
        await ws.send_message(connect(uid("w"), will=(topic, b"ws-gone", 1, False)))
        assert (await _recv_packet(ws, decoder)).return_code == 0
    msg = await trio.to_thread.run_sync(watcher.get)
    assert (msg.topic, msg.payload) == (topic, b"ws-gone")


async def test_malformed_packet_over_websocket_closes_only_it(broker, paho, uid):
    """4.8 over WebSocket: a malformed packet closes that connection; TCP clients continue."""
    topic = uid("wsbad")
    good = paho(uid("good"))
    await trio.to_thread.run_sync(good.connect)
    await trio.to_thread.run_sync(good.subscribe, topic, 0)
    url = f"ws://{broker.host}:{broker.ws_port}/mqtt"
    decoder = StreamDecoder()
    async with open_websocket_url(url, subprotocols=["mqtt"]) as ws:
        await ws.send_message(connect(uid("bad")))
        assert (await _recv_packet(ws, decoder)).type == CONNACK
        await ws.send_message(publish(topic, b"x", qos=3, packet_id=1))
        with trio.fail_after(5), pytest.raises(ConnectionClosed):
            while True:
                await ws.get_message()
    await trio.to_thread.run_sync(lambda: good.publish(topic, b"ok", qos=1))
    msg = await trio.to_thread.run_sync(good.get)
    assert msg.payload == b"ok"


def test_a_websocket_peer_that_never_upgrades_is_closed_within_connect_timeout(
        broker_factory):
    """A TCP connection to the WebSocket port that sends no upgrade is closed after
    ``connect_timeout`` like any other that sends no CONNECT (trio-websocket's own default
    held it 60 s, and one that the peer closed sat in CLOSE-WAIT as long)."""
    broker = broker_factory(connect_timeout=1.0)
    with socket.create_connection((broker.host, broker.ws_port), timeout=10) as sock:
        started = time.monotonic()
        assert sock.recv(1) == b"", "the node should close, not answer"
        assert time.monotonic() - started < 5.0


def _ws_upgrade(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /mqtt HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                 b"Sec-WebSocket-Protocol: mqtt\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


class _RawWs:
    """A WebSocket MQTT client on a raw socket: packets out in binary frames, packets in
    from the node's (unmasked) frames."""

    def __init__(self, port: int) -> None:
        self.sock = _ws_upgrade(port)
        self.frames = b""
        self.decoder = StreamDecoder()

    def send(self, packet: bytes) -> None:
        self.sock.sendall(ws_frame(packet))

    def recv_packet(self, timeout: float = 5.0) -> Packet:
        deadline = time.monotonic() + timeout
        while (packet := self.decoder.next_packet()) is None:
            buf = self.frames
            n, at = (buf[1] & 0x7F, 2) if len(buf) >= 2 else (0, 2)
            if n == 126:
                n, at = int.from_bytes(buf[2:4], "big"), 4
            elif n == 127:
                n, at = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) >= 2 and len(buf) >= at + n:
                assert buf[0] & 0x0F == 2, f"frame opcode {buf[0] & 0x0F}"
                self.decoder.feed(buf[at:at + n])
                self.frames = buf[at + n:]
                continue
            assert time.monotonic() < deadline, "no packet"
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = self.sock.recv(65536)
            assert chunk, "closed"
            self.frames += chunk
        return packet


def test_a_websocket_subscribe_is_handled_before_a_later_publish_of_another_client(
        broker, raw, uid):
    """A WebSocket client's SUBSCRIBE, then at once a TCP client's PUBLISH to that topic: the
    WebSocket client gets the message every time, as a TCP one does
    (``tests/test_e2e_ordering.py``) and as mosquitto's WebSocket listener does.  Through
    trio-websocket's reader task it got 1-13 of 100 (a probe of 2026-11-28)."""
    pub = raw()
    pub.send(connect(uid("wsorder-pub")))
    pub.expect(CONNACK)
    sub = _RawWs(broker.ws_port)
    try:
        sub.send(connect(uid("wsorder-sub")))
        assert sub.recv_packet().type == CONNACK
        topics = [uid(f"wsorder-{i}") for i in range(40)]
        seen: list[str] = []
        for i, topic in enumerate(topics):
            sub.send(subscribe(i + 2, [(topic, 0)]))
            pub.send(publish(topic, b"m"))
            while (got := sub.recv_packet()).type == PUBLISH:
                seen.append(got.topic)
            assert got.type == SUBACK and got.packet_id == i + 2, got
            sub.send(PINGREQ_BYTES)  # rounds apart, as in tests/test_e2e_ordering.py
            while (got := sub.recv_packet()).type == PUBLISH:
                seen.append(got.topic)
            assert got.type == PINGRESP, got
            pub.send(PINGREQ_BYTES)
            pub.expect(PINGRESP)
        missed = [t for t in topics if t not in seen]
        assert not missed, f"{len(missed)} of {len(topics)} missed"
    finally:
        sub.sock.close()


def _until_close_frame(sock: socket.socket) -> None:
    """Read the node's (unmasked) frames until its close frame."""
    buf = b""
    deadline = time.monotonic() + 5
    while True:
        while len(buf) >= 2:
            n, at = buf[1] & 0x7F, 2
            if n == 126:
                n, at = int.from_bytes(buf[2:4], "big"), 4
            elif n == 127:
                n, at = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) < at + n:
                break
            if buf[0] & 0x0F == 8:
                return
            buf = buf[at + n:]
        assert time.monotonic() < deadline, "no close frame"
        chunk = sock.recv(65536)
        assert chunk, "closed without a close frame"
        buf += chunk


@pytest.mark.parametrize("opening", ["text frame", "DISCONNECT"])
def test_a_message_over_the_limit_while_the_node_closes_ends_only_that_connection(
        node_factory, opening):
    """The node starts the close handshake (a text frame breaks [MQTT-6.0.0-1]; after a
    DISCONNECT it closes anyway), and the client then sends a message over
    ``max_packet_size``: trio-websocket raised in its reader task, and the node exited
    (found by a probe, 2026-11-28: no CONNECT needed; MQTT.js publishing past the announced
    Maximum Packet Size did it too).  Now that connection ends and the node serves on."""
    node = node_factory(ws=True)
    handle = node.start()
    assert handle.ws_port is not None
    sock = _ws_upgrade(handle.ws_port)
    try:
        if opening == "text frame":
            sock.sendall(ws_frame(b"hello", opcode=1))
        else:
            sock.sendall(ws_frame(connect("ws-closing")) + ws_frame(b"\xe0\x00"))
        _until_close_frame(sock)  # the node is closing
        with contextlib.suppress(OSError):
            sock.sendall(ws_frame(b"\0" * (2**20 + 100)))
    finally:
        sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and node.proc.poll() is None:
        time.sleep(0.1)  # (it exited within a second when it did)
    assert node.proc.poll() is None, node.log_tail()
    client = RawClient(handle.host, handle.port)
    client.send(connect("after-ws"))
    assert client.expect(CONNACK).return_code == 0
    client.close()
    assert "node failed" not in node.log_tail(200)
