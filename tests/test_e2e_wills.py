"""Will messages (MQTT 3.1.1 section 3.1.2.5 and 3.14.4)."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from mqtt_client import DISCONNECT_BYTES, read_until

pytestmark = pytest.mark.timeout(60)

PAHO_CHILD = textwrap.dedent(
    """
    import sys, time
    import paho.mqtt.client as mqtt
    host, port, cid, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv311)
    c.will_set(topic, b"child died", qos=1, retain=False)
    c.on_connect = lambda *a: print("CONNECTED", flush=True)
    c.connect(host, port, keepalive=60)
    c.loop_forever()
    """
)


@pytest.mark.parametrize("client_kind", ["paho", "mosquitto_sub"])
def test_will_published_when_client_process_is_killed(broker, paho, processes, uid, client_kind):
    """[MQTT-3.1.2-8]: the will is published when the network connection is closed without
    DISCONNECT, here by SIGKILL of the client process (the kernel closes its socket)."""
    topic = uid("will")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(topic, 1)
    if client_kind == "paho":
        child = processes(
            [sys.executable, "-c", PAHO_CHILD, broker.host, str(broker.port), uid("c"), topic]
        )
        read_until(child, b"CONNECTED", timeout=10)
    else:
        child = processes([
            "stdbuf", "-oL", "mosquitto_sub", "-h", broker.host, "-p", str(broker.port),
            "-i", uid("c"),
            "-t", uid("dummy"), "-d", "-k", "60",
            "--will-topic", topic, "--will-payload", "child died", "--will-qos", "1",
        ])  # fmt: skip
        read_until(child, b"received SUBACK", timeout=10)
    assert watcher.drain(0.3) == [], "will published while the client was alive"
    child.kill()
    child.wait(5)
    m = watcher.get(timeout=5)
    assert (m.topic, m.payload, m.qos, m.retain) == (topic, b"child died", 1, False)
    assert watcher.drain(0.3) == [], "will published twice"


def test_will_not_published_after_disconnect(raw, paho, uid):
    """[MQTT-3.1.2-10]/[MQTT-3.14.4-3]: DISCONNECT discards the will."""
    topic = uid("will")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(topic, 1)
    c = raw()
    assert c.connect(uid("c"), will=(topic, b"bye", 1, False)).return_code == 0
    c.send(DISCONNECT_BYTES)
    assert c.wait_closed(5), "[MQTT-3.14.4-1] the server closes after DISCONNECT"
    c.close()
    assert watcher.drain(1.0) == []


def test_will_published_on_abrupt_socket_close(raw, paho, uid):
    """[MQTT-3.1.2-8]: plain TCP close without DISCONNECT."""
    topic = uid("will")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(topic, 2)
    c = raw()
    assert c.connect(uid("c"), will=(topic, b"gone", 2, False)).return_code == 0
    c.close()
    m = watcher.get()
    assert (m.payload, m.qos) == (b"gone", 2)


def test_will_retain_is_honoured(raw, paho, uid):
    """[MQTT-3.1.2-17]: Will Retain = 1 publishes the will as a retained message, so a client
    subscribing afterwards receives it with RETAIN=1."""
    topic = uid("willret")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(topic, 1)
    c = raw()
    assert c.connect(uid("c"), will=(topic, b"offline", 1, True)).return_code == 0
    c.close()
    live = watcher.get()
    assert (live.payload, live.retain) == (b"offline", False), "[MQTT-3.3.1-9] live delivery"
    late = paho(uid("late"))
    late.connect()
    late.subscribe(topic, 1)
    m = late.get()
    assert (m.payload, m.retain, m.qos) == (b"offline", True, 1)


def test_will_published_on_keepalive_expiry(raw, paho, uid):
    """[MQTT-3.1.2-8] + [MQTT-3.1.2-24]: a client silent for 1.5 x keepalive is disconnected
    by the server and its will is published."""
    topic = uid("willka")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(topic, 1)
    c = raw()
    t0 = time.monotonic()
    assert c.connect(uid("c"), keepalive=1, will=(topic, b"timeout", 1, False)).return_code == 0
    m = watcher.get(timeout=6)
    elapsed = time.monotonic() - t0
    assert m.payload == b"timeout"
    assert elapsed >= 1.0, f"will after {elapsed:.2f}s: before even 1x keepalive"
    assert elapsed <= 3.5, f"will only after {elapsed:.2f}s; 1.5 x keepalive is 1.5 s"
    assert c.wait_closed(2), "the server must also close the silent client's connection"


@pytest.mark.parametrize(
    "violation",
    [b"\xf0\x00", b"\x10\x00", b"\x80\x02\x00\x01"],
    ids=["reserved-type-15", "second-connect-garbage", "subscribe-bad-flags-empty"],
)
def test_will_published_on_protocol_violation(raw, paho, uid, violation):
    """Section 3.1.2.5: the will is published when the server closes the connection because
    of a protocol error; 4.8: a protocol violation closes the connection [MQTT-4.8.0-1]."""
    topic = uid("willpv")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(topic, 1)
    c = raw()
    assert c.connect(uid("c"), will=(topic, b"violated", 1, False)).return_code == 0
    c.send(violation)
    assert c.wait_closed(5), "the broker must close a connection that violates the protocol"
    m = watcher.get()
    assert m.payload == b"violated"


def test_will_of_persistent_client_and_session_kept(raw, paho, uid):
    """The will is tied to the network connection, the session to the client id: a
    CleanSession=0 client that dies has its will published [MQTT-3.1.2-8] and its session
    kept [MQTT-3.1.2-4], so it comes back with session-present=1 and its queued message."""
    from mqtt_client import PUBLISH

    will_topic, topic, cid = uid("will"), uid("t"), uid("persist")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(will_topic, 1)
    c = raw()
    ack = c.connect(cid, clean_session=False, will=(will_topic, b"lost", 1, False))
    assert ack.return_code == 0
    assert c.subscribe([(topic, 1)]) == [1]
    c.close()
    assert watcher.get().payload == b"lost"
    watcher.publish(topic, b"while-away", qos=1)
    c2 = raw()
    ack2 = c2.connect(cid, clean_session=False)
    assert (ack2.return_code, ack2.session_present) == (0, True)
    p = c2.expect(PUBLISH)
    assert (p.topic, p.payload) == (topic, b"while-away")
