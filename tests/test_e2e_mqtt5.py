"""MQTT 5.0 end to end on one node: paho MQTTv5 and mosquitto clients beside 3.1.1 ones.

Properties end to end and stripped for 3.1.1, subscription options and identifiers,
reason codes, session expiry, will delay and message expiry."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import time
from collections.abc import Callable

import pytest

from conftest import BrokerHandle, PahoClient, unique
from mqtt5_support import WAIT, Paho5, props

PUBLISH, SUBSCRIBE, CONNECT, DISCONNECT, WILL = 3, 8, 1, 14, 99


def test_connack_properties_and_assigned_client_id(v5: Callable[..., Paho5]) -> None:
    _, connack = v5("").connect()
    assert connack.AssignedClientIdentifier
    assert connack.ReceiveMaximum > 0 and connack.TopicAliasMaximum > 0
    assert connack.MaximumPacketSize > 0
    assert connack.RetainAvailable == 1 and connack.WildcardSubscriptionAvailable == 1
    assert connack.SubscriptionIdentifierAvailable == 1
    assert connack.SharedSubscriptionAvailable == 1


def test_properties_end_to_end_and_stripped_for_311(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient]) -> None:
    topic = unique("p5")
    sub5 = v5()
    sub5.connect()
    assert sub5.subscribe(f"{topic}/#", 1, props(SUBSCRIBE, SubscriptionIdentifier=42)) == [1]
    sub3 = paho()
    sub3.connect()
    assert sub3.subscribe(f"{topic}/#", 1) == [1]
    pub = v5()
    pub.connect()
    pub.publish(f"{topic}/a", b"v5", 1, properties=props(
        PUBLISH, UserProperty=[("k", "v"), ("k", "w")], ContentType="text/plain",
        PayloadFormatIndicator=1, ResponseTopic="reply/here", CorrelationData=b"\x00id",
        MessageExpiryInterval=120))
    got = sub5.get()
    assert (got.topic, got.payload, got.qos) == (f"{topic}/a", b"v5", 1)
    p = got.properties
    assert p.UserProperty == [("k", "v"), ("k", "w")]
    assert p.ContentType == "text/plain" and p.PayloadFormatIndicator == 1
    assert p.ResponseTopic == "reply/here" and p.CorrelationData == b"\x00id"
    assert 0 < p.MessageExpiryInterval <= 120
    assert p.SubscriptionIdentifier == [42]
    plain = sub3.get()
    assert (plain.topic, plain.payload) == (f"{topic}/a", b"v5")
    # A 3.1.1 publish reaches the v5 subscriber without properties (but its identifier).
    old = paho()
    old.connect()
    old.publish(f"{topic}/b", b"v3", 1)
    got = sub5.get()
    assert got.payload == b"v3"
    assert not hasattr(got.properties, "UserProperty")
    assert got.properties.SubscriptionIdentifier == [42]


def test_topic_alias_inbound(v5: Callable[..., Paho5]) -> None:
    topic = unique("alias")
    sub = v5()
    sub.connect()
    sub.subscribe(topic, 0)
    pub = v5()
    pub.connect()
    pub.publish(topic, b"one", 1, properties=props(PUBLISH, TopicAlias=3))
    pub.publish("", b"two", 1, properties=props(PUBLISH, TopicAlias=3))
    assert [sub.get().payload for _ in range(2)] == [b"one", b"two"]


def test_no_local_and_retain_as_published(v5: Callable[..., Paho5]) -> None:
    topic = unique("nl")
    client = v5()
    client.connect()
    client.subscribe(f"{topic}/own", 0, noLocal=True)
    client.subscribe(f"{topic}/rap", 0, retainAsPublished=True)
    client.subscribe(f"{topic}/plain", 0)
    client.publish(f"{topic}/own", b"mine", 1)  # not echoed back
    client.publish(f"{topic}/rap", b"kept", 1, retain=True)
    got = client.get()
    assert (got.topic, got.retain) == (f"{topic}/rap", True)
    client.publish(f"{topic}/plain", b"x", 1, retain=True)
    got = client.get()
    assert (got.topic, got.retain) == (f"{topic}/plain", False)  # live: RETAIN 0


def test_a_311_client_resuming_a_v5_session_keeps_its_subscription_options(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient]) -> None:
    """Subscription options are session state: a 3.1.1 client resuming a v5 session
    (Clean Session 0) still gets No Local and Retain As Published on the filters subscribed
    with them (identifiers: 3.1.1 has none), and a v5 client resuming after it has all
    three again."""
    topic, cid = unique("keep"), unique("keep")
    first = v5(cid)
    first.connect(properties=props(CONNECT, SessionExpiryInterval=300))
    first.subscribe(f"{topic}/own", 1, props(SUBSCRIBE, SubscriptionIdentifier=4), noLocal=True)
    first.subscribe(f"{topic}/rap", 1, props(SUBSCRIBE, SubscriptionIdentifier=5),
                    retainAsPublished=True)
    first.disconnect()
    other = v5()
    other.connect()
    old = paho(cid, clean_session=False)
    assert old.connect()
    old.publish(f"{topic}/own", b"mine", 1)  # not echoed back: No Local
    other.publish(f"{topic}/rap", b"kept", 1, retain=True)
    got = old.get()
    assert (got.topic, got.payload, got.retain) == (f"{topic}/rap", b"kept", True)
    old.disconnect()
    again = v5(cid)
    present, _ = again.connect(clean_start=False,
                               properties=props(CONNECT, SessionExpiryInterval=300))
    assert present
    again.publish(f"{topic}/own", b"mine again", 1)
    other.publish(f"{topic}/rap", b"again", 1, retain=True)
    got = again.get()
    assert (got.topic, got.payload, got.retain) == (f"{topic}/rap", b"again", True)
    assert got.properties.SubscriptionIdentifier == [5]


def test_retain_handling(v5: Callable[..., Paho5]) -> None:
    topic = unique("rh")
    pub = v5()
    pub.connect()
    pub.publish(topic, b"r", 1, retain=True)
    sub = v5()
    sub.connect()
    sub.subscribe(topic, 0, retainHandling=2)  # never
    sub.subscribe(f"{topic}/none", 0)
    sub.subscribe(topic, 0, retainHandling=1)  # exists already: not sent again
    sub.subscribe(f"{topic}-x", 0)
    pub.publish(f"{topic}-x", b"sentinel")
    sub.nothing_before(f"{topic}-x")
    sub.unsubscribe(topic)
    sub.subscribe(topic, 0, retainHandling=1)  # new: sent
    got = sub.get()
    assert (got.payload, got.retain) == (b"r", True)
    sub.subscribe(topic, 0, retainHandling=0)  # always
    assert sub.get().payload == b"r"


def test_reason_codes_in_suback_and_unsuback(v5: Callable[..., Paho5]) -> None:
    client = v5()
    client.connect()
    assert client.subscribe("$share//t", 1) == [0x8F]  # topic filter invalid: empty group
    assert client.unsubscribe(unique("never")) == [0x11]
    topic = unique("u")
    client.subscribe(topic, 2)
    assert client.unsubscribe(topic) == [0]


def test_takeover_sends_disconnect_0x8e(v5: Callable[..., Paho5]) -> None:
    cid = unique("to")
    first = v5(cid)
    first.connect()
    v5(cid).connect()
    assert first.disconnects.get(timeout=WAIT) == 0x8E


def test_session_expiry(v5: Callable[..., Paho5]) -> None:
    cid, topic = unique("se"), unique("se")
    client = v5(cid)
    client.connect(clean_start=True, properties=props(CONNECT, SessionExpiryInterval=300))
    client.subscribe(topic, 1)
    client.disconnect()
    pub = v5()
    pub.connect()
    pub.publish(topic, b"queued", 1)
    again = v5(cid)
    present, _ = again.connect(clean_start=False,
                               properties=props(CONNECT, SessionExpiryInterval=1))
    assert present
    assert again.get().payload == b"queued"
    again.disconnect()
    time.sleep(1.5)  # the wall clock is what expires it
    last = v5(cid)
    present, _ = last.connect(clean_start=False)
    assert not present


def test_session_expiry_zero_ends_with_the_connection(v5: Callable[..., Paho5]) -> None:
    cid = unique("se0")
    client = v5(cid)
    client.connect(clean_start=False)  # no Session Expiry Interval: 0
    client.subscribe(unique("t"), 1)
    client.disconnect()
    present, _ = v5(cid).connect(clean_start=False)
    assert not present


def test_clean_start_0_with_expiry_0_resumes_the_kept_session(
        v5: Callable[..., Paho5]) -> None:
    """[MQTT-3.1.2-4]: Clean Start 0 resumes the session an earlier connection left (with
    a Session Expiry Interval of 60), whatever this connection's own interval; this one's
    (0, absent) then applies: the session ends when it closes [MQTT-3.1.2-23]."""
    cid, topic = unique("rs"), unique("rs")
    client = v5(cid)
    client.connect(clean_start=True, properties=props(CONNECT, SessionExpiryInterval=60))
    assert client.subscribe(topic, 1) == [1]
    client.disconnect()
    pub = v5()
    pub.connect()
    for payload in (b"one", b"two"):
        pub.publish(topic, payload, 1)
    again = v5(cid)
    present, _ = again.connect(clean_start=False)  # no Session Expiry Interval: 0
    assert present
    assert [again.get().payload for _ in range(2)] == [b"one", b"two"]
    pub.publish(topic, b"live", 1)  # its subscription goes on while connected
    assert again.get().payload == b"live"
    again.disconnect()
    pub.publish(topic, b"after", 1)
    last = v5(cid)
    present, _ = last.connect(clean_start=False)
    assert not present
    last.subscribe(f"{topic}/sentinel", 1)
    pub.publish(f"{topic}/sentinel", b"s", 1)  # nothing of the ended session's arrives
    last.nothing_before(f"{topic}/sentinel")


def test_a_session_resumed_until_close_does_not_outlive_a_crash(node_factory) -> None:
    """The session resumed with expiry 0 ends with its connection, also when the node dies
    under it: its stored deadline says so, and the restarted node does not resume it."""
    node = node_factory()
    handle = node.start()
    cid, topic = unique("rc"), unique("rc")
    made: list[Paho5] = []

    def client(port: int) -> Paho5:
        made.append(Paho5(handle.host, port, cid))
        return made[-1]

    try:
        first = client(handle.port)
        first.connect(properties=props(CONNECT, SessionExpiryInterval=60))
        first.subscribe(topic, 1)
        first.disconnect()
        present, _ = client(handle.port).connect(clean_start=False)
        assert present
        node.kill9()
        handle = node.start()
        present, _ = client(handle.port).connect(clean_start=False)
        assert not present
    finally:
        for c in made:
            c.client.loop_stop()
            with contextlib.suppress(Exception):
                c.client.disconnect()


def test_a_session_connected_when_its_node_dies_expires_from_the_restart(node_factory) -> None:
    """The node never saw the connection close, so its Session Expiry Interval counts from
    the restart (stored at CONNECT): 2 s ends it, 60 s keeps it.  Before, a session
    connected at the crash was kept for ever (a probe: present a minute later, queueing)."""
    node = node_factory()
    handle = node.start()
    short, long_, topic = unique("cut2"), unique("cut60"), unique("cut")
    made: list[Paho5] = []

    def client(cid: str) -> Paho5:
        made.append(Paho5(handle.host, handle.port, cid))
        return made[-1]

    try:
        for cid, expiry in ((short, 2), (long_, 60)):
            connected = client(cid)
            connected.connect(properties=props(CONNECT, SessionExpiryInterval=expiry))
            connected.subscribe(topic, 1)
        node.kill9()  # both still connected
        handle = node.start()
        restarted = time.monotonic()
        time.sleep(max(0.0, restarted + 2 + 1.0 - time.monotonic()))  # the interval itself
        present, _ = client(short).connect(clean_start=False)
        assert not present, "ended 2 s after the restart"
        present, _ = client(long_).connect(clean_start=False)
        assert present, "60 s: still there"
    finally:
        for c in made:
            c.client.loop_stop()
            with contextlib.suppress(Exception):
                c.client.disconnect()


def test_node_stopping_says_0x8b_server_shutting_down(node_factory, paho) -> None:
    """SIGTERM: every v5 client is told DISCONNECT 0x8B before its connection closes:
    one idle long enough to be parked (TCP), one over WebSocket (never parked), one busy
    receiving; a 3.1.1 client, which has no server DISCONNECT, just sees the close."""
    node = node_factory(ws=True)
    handle = node.start()
    made = [Paho5(handle.host, handle.port, unique("idle")),
            Paho5(handle.host, handle.ws_port, unique("ws"), transport="websockets"),
            Paho5(handle.host, handle.port, unique("busy"))]
    try:
        for client in made:
            client.connect()
        busy = made[2]
        topic = unique("stop")
        busy.subscribe(topic, 1)
        old = paho(unique("v311"), target=handle)
        old.connect()
        old.subscribe("$SYS/broker/clients/parked", 0)
        busy.publish(topic, b"x", 1)
        assert busy.get().payload == b"x"
        # The idle and the busy one, quiet since, are in the parking lot (the 3.1.1
        # watcher is woken by every $SYS round; WebSocket connections never park).
        deadline = time.monotonic() + 10
        while int(old.get(max(deadline - time.monotonic(), 0.1)).payload) < 2:
            pass
        assert node.terminate() == 0
        for client in made:
            assert client.disconnects.get(timeout=WAIT) == 0x8B, client.client._client_id
        assert old.disconnected.wait(WAIT)
    finally:
        for client in made:
            client.client.loop_stop()


def test_disconnect_may_shorten_session_expiry(v5: Callable[..., Paho5]) -> None:
    cid = unique("sd")
    client = v5(cid)
    client.connect(properties=props(CONNECT, SessionExpiryInterval=300))
    client.disconnect(props(DISCONNECT, SessionExpiryInterval=0))
    present, _ = v5(cid).connect(clean_start=False)
    assert not present


def test_will_delay_cancelled_by_reconnect(v5: Callable[..., Paho5]) -> None:
    cid, topic = unique("wd"), unique("will")
    watcher = v5()
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    session = props(CONNECT, SessionExpiryInterval=60)
    client = v5(cid)
    client.connect(properties=session, will=(f"{topic}/w", b"gone", 1, False,
                                             props(WILL, WillDelayInterval=2)))
    client.drop()
    again = v5(cid)
    again.connect(clean_start=False, properties=session)
    time.sleep(3)  # past the delay: the will would be out by now
    again.publish(f"{topic}/sentinel", b"s", 1)
    watcher.nothing_before(f"{topic}/sentinel")


@pytest.mark.parametrize("expiry", [60, 0])
def test_a_takeover_that_resumes_the_session_publishes_no_will(
        v5: Callable[..., Paho5], expiry: int) -> None:
    """[MQTT-3.1.3-9]: the new connection to the session came before the old one closed,
    so before any Will Delay Interval, 0 included, had passed: no will (mosquitto's
    07-will-takeover.py; before 2026-11-25 the will went out).  ``expiry``: the new
    connection's Session Expiry Interval (0: it resumes the session until it closes)."""
    cid, topic = unique("tk"), unique("will")
    watcher = v5()
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    first = v5(cid)
    first.connect(properties=props(CONNECT, SessionExpiryInterval=60),
                  will=(f"{topic}/w", b"gone", 1, False, None))
    second = v5(cid)
    present, _ = second.connect(clean_start=False,
                                properties=props(CONNECT, SessionExpiryInterval=expiry))
    assert present
    second.publish(f"{topic}/sentinel", b"s", 1)
    watcher.nothing_before(f"{topic}/sentinel")


@pytest.mark.parametrize("first_expiry,second_expiry", [(60, 60), (0, 60), (60, 0)])
def test_a_takeover_that_ends_the_session_publishes_the_will(
        v5: Callable[..., Paho5], first_expiry: int, second_expiry: int) -> None:
    """Taken over by a Clean Start, or from a connection whose session ended with it
    (expiry 0): the old session ends, and its will goes out (section 3.1.3.2.2)."""
    cid, topic = unique("tk"), unique("will")
    watcher = v5()
    watcher.connect()
    watcher.subscribe(f"{topic}/#", 1)
    first = v5(cid)
    first.connect(properties=props(CONNECT, SessionExpiryInterval=first_expiry),
                  will=(f"{topic}/w", b"gone", 1, False, None))
    second = v5(cid)
    present, _ = second.connect(clean_start=bool(first_expiry),
                                properties=props(CONNECT, SessionExpiryInterval=second_expiry))
    assert not present
    got = watcher.get()
    assert (got.topic, got.payload) == (f"{topic}/w", b"gone")


def test_will_delay_then_published_with_properties(v5: Callable[..., Paho5]) -> None:
    topic = unique("will")
    watcher = v5()
    watcher.connect()
    watcher.subscribe(topic, 1)
    client = v5(unique("wd"))
    client.connect(properties=props(CONNECT, SessionExpiryInterval=60),
                   will=(topic, b"gone", 1, False,
                         props(WILL, WillDelayInterval=1, ContentType="x/y")))
    dropped_at = time.monotonic()
    client.drop()
    got = watcher.get(timeout=WAIT + 2)
    assert got.payload == b"gone" and got.properties.ContentType == "x/y"
    assert time.monotonic() - dropped_at >= 0.9


def test_disconnect_with_will_message(v5: Callable[..., Paho5]) -> None:
    topic = unique("will")
    watcher = v5()
    watcher.connect()
    watcher.subscribe(topic, 1)
    client = v5()
    client.connect(will=(topic, b"sent", 1, False, None))
    from paho.mqtt.reasoncodes import ReasonCode

    client.client.disconnect(reasoncode=ReasonCode(DISCONNECT, identifier=0x04))
    assert watcher.get().payload == b"sent"


@pytest.mark.parametrize("reason", [0x80, 0x83, 0x97])
def test_only_a_disconnect_with_success_discards_the_will(
        v5: Callable[..., Paho5], reason: int) -> None:
    """[MQTT-3.14.4-3], 3.1.2.5: only DISCONNECT 0x00 discards the will; a client that
    disconnects with an error reason still has its will published (a probe found the will
    dropped for every reason but 0x04)."""
    topic = unique("will-err")
    watcher = v5()
    watcher.connect()
    watcher.subscribe(topic, 1)
    client = v5()
    client.connect(will=(topic, b"failed", 1, False, None))
    from paho.mqtt.reasoncodes import ReasonCode

    client.client.disconnect(reasoncode=ReasonCode(DISCONNECT, identifier=reason))
    assert watcher.get().payload == b"failed"


def test_message_expiry_of_queued_and_retained(v5: Callable[..., Paho5]) -> None:
    cid, topic = unique("me"), unique("me")
    sub = v5(cid)
    sub.connect(properties=props(CONNECT, SessionExpiryInterval=300))
    sub.subscribe(f"{topic}/#", 1)
    sub.disconnect()
    pub = v5()
    pub.connect()
    pub.publish(f"{topic}/short", b"old", 1, retain=True,
                properties=props(PUBLISH, MessageExpiryInterval=1))
    pub.publish(f"{topic}/long", b"new", 1, properties=props(PUBLISH, MessageExpiryInterval=300))
    time.sleep(1.5)
    again = v5(cid)
    assert again.connect(clean_start=False,
                         properties=props(CONNECT, SessionExpiryInterval=300))[0]
    got = again.get()
    assert got.payload == b"new" and got.properties.MessageExpiryInterval <= 300
    fresh = v5()
    fresh.connect()
    fresh.subscribe(f"{topic}/#", 1)  # the expired retained message is not replayed
    pub.publish(f"{topic}/sentinel", b"s")
    fresh.nothing_before(f"{topic}/sentinel")


def test_mosquitto_clients_v5(broker: BrokerHandle, paho: Callable[..., PahoClient]) -> None:
    topic = unique("mq5")
    sub = subprocess.Popen(
        ["mosquitto_sub", "-V", "mqttv5", "-h", broker.host, "-p", str(broker.port),
         "-t", topic, "-C", "1", "-F", "%p|%P", "-W", "20",
         "-D", "connect", "session-expiry-interval", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    watcher = paho()
    watcher.connect()
    watcher.subscribe("$SYS/broker/clients/connected", 0)
    deadline = time.monotonic() + WAIT
    try:
        # Publish until the subscriber is there (it subscribes right after connecting).
        while sub.poll() is None and time.monotonic() < deadline + 10:
            subprocess.run(
                ["mosquitto_pub", "-V", "mqttv5", "-h", broker.host, "-p", str(broker.port),
                 "-t", topic, "-m", "hello", "-q", "1",
                 "-D", "publish", "user-property", "k", "v"],
                check=True, timeout=WAIT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                sub.wait(0.5)
        out = sub.communicate(timeout=WAIT)[0].decode()
    finally:
        if sub.poll() is None:
            sub.kill()
    assert "hello|k:v" in out, out


def test_shared_subscription_between_v5_and_311_members(
        v5: Callable[..., Paho5], paho: Callable[..., PahoClient]) -> None:
    """A v5 member and a 3.1.1 member of one group: each QoS 1 message reaches exactly one
    of them; the v5 member gets the publisher's properties, the 3.1.1 one none."""
    topic = unique("jobs")
    member5 = v5()
    member5.connect()
    assert member5.subscribe(f"$share/g/{topic}/#", 1) == [1]
    member3 = paho()
    member3.connect()
    assert member3.subscribe(f"$share/g/{topic}/#", 1) == [1]
    pub = v5()
    pub.connect()
    sent = {f"{topic}/{i}".encode() for i in range(6)}
    for payload in sorted(sent):
        pub.publish(payload.decode(), payload, qos=1,
                    properties=props(PUBLISH, UserProperty=[("k", "v")]))
    got5, got3 = [], []
    deadline = time.monotonic() + 15
    while len(got5) + len(got3) < len(sent) and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            message = member5.messages.get(timeout=0.2)
            assert message.properties.UserProperty == [("k", "v")]
            got5.append(message.payload)
        with contextlib.suppress(queue.Empty):
            got3.append(member3.messages.get(timeout=0.2).payload)
    assert sorted(got5 + got3) == sorted(sent), (got5, got3)
    assert got5 and got3, "round robin gives both members a share"
