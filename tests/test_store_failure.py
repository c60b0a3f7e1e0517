"""A node whose store fails (disk full, I/O error) stops, in one line, losing nothing it
acknowledged.

Found by filling a small tmpfs under a node: every QoS 1 publish that needed a durable write
logged a full traceback as an "internal error" and closed its connection, while the node
stayed up refusing every durable write (in a cluster, a grey failure: it still answers
heartbeats, so its shards never move to replicas that can write).  Now the node logs one
warning per connection it closes and one error, prints one line and exits with code 5
(``ExitCode.STORE_FAILED``), for a supervisor to restart it once the disk is fixed.

The failure is real: the node runs under a file size limit (``RLIMIT_FSIZE``, SIGXFSZ
ignored), so LMDB's writes past it fail with EFBIG as they would with ENOSPC.
"""

from __future__ import annotations

import resource
import signal

import pytest

from mqtt_client import PUBACK, PUBLISH, ConnectionClosed, puback, publish, subscribe
from mqttring.lifecycle import ExitCode

pytestmark = pytest.mark.timeout(120)

#: Bytes any file of the node may reach: the store fills it within a few dozen messages.
FILE_LIMIT = 3 * 1024 * 1024
PAYLOAD = b"r" * 60_000


def _file_size_limit() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def test_a_node_whose_store_fails_stops_in_one_line_and_keeps_what_it_acknowledged(
        node_factory, raw, uid) -> None:
    node = node_factory()
    node.preexec = _file_size_limit
    handle = node.start()
    base = uid("fill")
    pub = raw(handle)
    assert pub.connect(uid("pub")).return_code == 0
    acked: list[str] = []
    unanswered = None
    for i in range(200):  # 12 MB: far past the limit
        topic = f"{base}/{i}"
        pub.send(publish(topic, PAYLOAD, qos=1, retain=True, packet_id=i % 65535 + 1))
        try:
            ack = pub.expect(PUBACK, 10)
        except ConnectionClosed:
            unanswered = topic  # closed instead: never acknowledged
            break
        assert ack.packet_id == i % 65535 + 1
        acked.append(topic)
    assert unanswered is not None, "the store never failed: the limit did not apply"
    assert len(acked) >= 10

    assert node.proc is not None
    assert node.proc.wait(30) == ExitCode.STORE_FAILED
    log = node.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "internal error" not in log
    assert "its store at" in log and "stopping, since no write can be made durable" in log
    assert log.count("mqttring: node failed: the store at") == 1

    # Restarted without the limit: every acknowledged message is there, intact.
    node.preexec = None
    handle = node.start()
    sub = raw(handle)
    assert sub.connect(uid("sub")).return_code == 0
    sub.send(subscribe(1, [(f"{base}/#", 1)]))
    got: dict[str, bytes] = {}
    while True:
        pkt = sub.recv_packet(10)
        if pkt.type == PUBLISH:
            got[pkt.topic] = pkt.payload
            sub.send(puback(pkt.packet_id))
        if len(got) >= len(acked) and sub.no_packet_within(0.5) is None:
            break
    assert set(acked) <= set(got) <= set(acked) | {unanswered}
    assert all(payload == PAYLOAD for payload in got.values())
