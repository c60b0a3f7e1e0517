"""A client that vanishes mid-stream costs its own connection, never the node."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from mqttring.protocol.codec import PacketDecoder, encode
from mqttring.protocol.packets import ConnAck, Connect, PingReq, PingResp, Publish, Subscribe


def connect(port: int, client_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(encode(Connect(client_id)))
    decoder = PacketDecoder()
    while True:
        decoder.feed(sock.recv(4096))
        packet = decoder.next_packet()
        if packet is not None:
            assert packet == ConnAck(False)
            return sock


def test_subscriber_reset_with_queued_output_does_not_end_the_node(tmp_path):
    ready = tmp_path / "ready.json"
    node = subprocess.Popen(
        [sys.executable, "-m", "mqttring.node", "--mqtt", "127.0.0.1:0", "--data-dir",
         str(tmp_path / "data"), "--sys-interval", "0", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert node.poll() is None and time.monotonic() < deadline, "node did not start"
            time.sleep(0.05)
        port = json.loads(ready.read_text())["mqtt"]
        # A subscriber that stops reading, so the node has output queued for it...
        sub = connect(port, "vanishing")
        sub.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sub.sendall(encode(Subscribe(1, (("reset/t", 1),))))
        time.sleep(0.2)
        pub = connect(port, "flooder")
        batch = b"".join(encode(Publish("reset/t", b"x" * 512)) for _ in range(200))
        for _ in range(40):
            pub.sendall(batch)
        # ...then disappears with unread bytes (the kernel answers with RST).
        sub.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sub.close()
        for _ in range(40):
            pub.sendall(batch)
        # The node still serves: the publisher's connection and a brand-new client answer.
        probe = connect(port, "probe")
        probe.sendall(encode(PingReq()))
        decoder = PacketDecoder()
        decoder.feed(probe.recv(16))
        assert decoder.next_packet() == PingResp()
        assert node.poll() is None, node.stderr.read().decode()[-2000:] if node.stderr else ""
        pub.close()
        probe.close()
    finally:
        node.terminate()
        node.wait(10)
    assert node.returncode == 0
    if node.stderr is not None:
        assert b"Traceback" not in node.stderr.read(), "an internal error was logged"
        node.stderr.close()
