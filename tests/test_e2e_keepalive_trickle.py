"""The keep alive counts complete Control Packets, not bytes [MQTT-3.1.2-24]: "If the Keep
Alive value is non-zero and the Server does not receive a Control Packet from the Client
within one and a half times the Keep Alive time period, it MUST disconnect".

Once the deadline restarted on any bytes read, so a client trickling one byte a second of
a PUBLISH it never finished stayed connected for ever (mosquitto closes it after 1.5 x
keep alive); such a connection is now closed as a silent one is, and its will goes out.
Real sockets and real time: time is what is under test, so the trickle's pauses are
sleeps, and every wait for the close is bounded.
"""

from __future__ import annotations

import time

import pytest

from mqtt_client import PINGREQ_BYTES, PINGRESP, ConnectionClosed, RawClient, publish

pytestmark = pytest.mark.timeout(60)

#: Keep alive 1 s: the broker must close within 1.5 s of the last complete packet; the
#: bound leaves a second for the timers' look and the scheduler.
KEEPALIVE = 1
CLOSE_BY = 2.5


def _trickle_until_closed(client: RawClient, data: bytes, gap: float, limit: float) -> bool:
    """Send ``data`` one byte every ``gap`` seconds (never the last one, so the packet is
    never complete) until the broker closes the connection (True) or ``limit`` seconds
    pass (False)."""
    start = time.monotonic()
    for byte in data[:-1]:
        if not client.try_send(bytes([byte])) or client.wait_closed(gap):
            return True
        if time.monotonic() - start > limit:
            break
    return False


@pytest.mark.parametrize("park_idle_after", [0.0, 0.1], ids=["with-task", "parking"])
def test_a_never_finished_publish_does_not_keep_the_connection_alive(
        broker_factory, raw, paho_any, uid, park_idle_after: float) -> None:
    """A byte every 0.4 s of a 100-byte PUBLISH with keep alive 1: closed within 2.5 s of
    the CONNACK (the last complete packet the client sent was its CONNECT), and the will is
    published, since the client never sent DISCONNECT.  Also on a node that parks a quiet
    connection after 0.1 s: it parks between bytes, and the deadline it parks and resumes
    with is its last complete packet's, not its last byte's."""
    node = broker_factory(ws=False, park_idle_after=park_idle_after)
    will_topic = uid("trickle-will")
    watcher = paho_any(node, uid("watch"))
    watcher.connect()
    watcher.subscribe(will_topic, 1)
    client = raw(node)
    ack = client.connect(uid("trickle"), keepalive=KEEPALIVE,
                         will=(will_topic, b"gone", 1, False))
    assert ack.return_code == 0
    connected = time.monotonic()
    closed = _trickle_until_closed(client, publish(uid("t"), b"y" * 100), 0.4, 8.0)
    waited = time.monotonic() - connected
    assert closed, f"still open {waited:.1f} s after CONNACK with keep alive {KEEPALIVE} s"
    assert waited <= CLOSE_BY, f"closed {waited:.2f} s after CONNACK; limit 1.5 s + slack"
    message = watcher.get()
    assert (message.topic, message.payload) == (will_topic, b"gone")


def test_complete_packets_in_pieces_keep_the_connection_alive(raw, uid) -> None:
    """The other side: PUBLISHes that do complete, each sent in two halves 0.4 s apart with
    keep alive 1 s, keep the connection open for 4 s (every complete packet restarts the
    deadline)."""
    client = raw()
    assert client.connect(uid("pieces"), keepalive=KEEPALIVE).return_code == 0
    topic = uid("pieces")
    start = time.monotonic()
    while time.monotonic() - start < 4.0:
        data = publish(topic, b"tick")
        half = len(data) // 2
        assert client.try_send(data[:half]), "closed while its packets kept coming"
        time.sleep(0.4)  # the pause between the halves is what is under test
        assert client.try_send(data[half:]), "closed while its packets kept coming"
        time.sleep(0.4)
    client.send(PINGREQ_BYTES)
    try:
        assert client.expect(PINGRESP, timeout=5)
    except ConnectionClosed:
        pytest.fail("closed although a complete packet came every 0.8 s (keep alive 1 s)")
