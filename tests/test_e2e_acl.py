"""ACLs against a real node process (``python -m mqttring.node --acl-file``), real sockets:
subscriptions refused with 0x80, denied publishes acknowledged but never delivered nor
retained, wildcard subscribers that never see a topic they may not read (live, retained or
queued), ``%c``/``%u`` patterns, and a reload that reaches connected clients."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest

from mqtt_client import DISCONNECT_BYTES, PUBACK, PUBLISH, RawClient, publish

pytestmark = pytest.mark.timeout(90)

ACL = """\
# anonymous clients may read public/
topic read public/#

user alice
topic readwrite alice/#
topic read shared/#
topic deny shared/secret

user bob
topic write shared/#
topic write alice/inbox

pattern readwrite devices/%c/#
pattern read users/%u/#
"""


@pytest.fixture
def acl_node(node_factory, tmp_path):
    pw = tmp_path / "passwords"
    for args in (["-c", "-b", str(pw), "alice", "a-pw"], ["-b", str(pw), "bob", "b-pw"]):
        done = subprocess.run(["mosquitto_passwd", *args], capture_output=True, timeout=10)
        assert done.returncode == 0, done.stderr
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    node = node_factory()
    node.extra_args = ["--password-file", str(pw), "--acl-file", str(acl)]
    node.start()
    node.acl = acl
    yield node
    assert node.terminate() == 0


def client(port: int, client_id: str, user: str | None = None) -> RawClient:
    c = RawClient("127.0.0.1", port, timeout=10)
    password = {"alice": b"a-pw", "bob": b"b-pw"}.get(user or "")
    ack = c.connect(client_id, username=user, password=password, timeout=10)
    assert ack.return_code == 0, ack
    return c


#: PUBLISHes a client read while waiting for its own PUBACK, by client.
_early: dict[int, list] = {}


def pub(c: RawClient, topic: str, payload: bytes, retain: bool = False, pid: int = 1) -> None:
    """QoS 1, waiting for its PUBACK: a denied publish is acknowledged too (as mosquitto)."""
    c.send(publish(topic, payload, qos=1, retain=retain, packet_id=pid))
    for _ in range(100):
        p = c.recv_packet(10)
        if p.type == PUBACK:
            assert p.packet_id == pid
            return
        assert p.type == PUBLISH, p
        _early.setdefault(id(c), []).append(p)  # a delivery may overtake the PUBACK
    raise AssertionError("no PUBACK")


def received(c: RawClient, marker_topic: str) -> list[tuple[str, bytes, bool]]:
    """Everything that arrives up to the message on ``marker_topic`` (sent last, readable):
    proves what did *not* arrive without waiting on a clock."""
    got = []
    early = _early.pop(id(c), [])
    for _ in range(100):
        p = early.pop(0) if early else c.expect(PUBLISH, 10)
        if p.topic == marker_topic:
            return got
        got.append((p.topic, p.payload, p.retain))
    raise AssertionError(f"no marker; got {got}")


def test_subscribe_publish_and_delivery_follow_the_acl(acl_node):
    bob = client(acl_node.port, "bob-1", "bob")
    # Retained before anybody subscribes: one readable, one denied to alice.
    pub(bob, "shared/open", b"r-open", retain=True, pid=1)
    pub(bob, "shared/secret", b"r-secret", retain=True, pid=2)
    alice = client(acl_node.port, "alice-1", "alice")
    assert alice.subscribe([("shared/#", 1), ("bob/#", 1), ("alice/#", 1),
                            ("users/alice/#", 0), ("users/bob/#", 0)]) == [1, 0x80, 1, 0, 0x80]
    retained = [alice.expect(PUBLISH, 10)]
    # Live: bob writes where alice reads, where she is denied, and where bob may not write.
    pub(bob, "shared/secret", b"live-secret", pid=3)
    pub(bob, "shared/x", b"live-x", pid=4)
    pub(bob, "alice/news", b"forged", retain=True, pid=5)  # bob may only write alice/inbox
    pub(bob, "alice/inbox", b"hello", pid=6)
    assert [(p.topic, p.payload, p.retain) for p in retained] == [("shared/open", b"r-open", True)]
    assert received(alice, "alice/inbox") == [("shared/x", b"live-x", False)]
    # The denied publish was not retained either: a new reader of alice/# gets nothing.
    alice2 = client(acl_node.port, "alice-2", "alice")
    assert alice2.subscribe([("alice/#", 1)]) == [1]
    marker = client(acl_node.port, "alice-3", "alice")
    pub(marker, "alice/marker", b"m", pid=1)
    assert received(alice2, "alice/marker") == []
    log = acl_node.log_path.read_text()
    assert "denied a publish of 'bob-1' on 'alice/news' by the ACL" in log


def test_patterns_and_anonymous_rules(acl_node):
    dev = client(acl_node.port, "dev1")  # anonymous, allowed by the default allow_anonymous
    assert dev.subscribe([("devices/dev1/#", 1), ("devices/dev2/#", 1), ("public/#", 1),
                          ("users/+/x", 1)]) == [1, 0x80, 1, 0x80]
    pub(dev, "devices/dev2/state", b"not mine", pid=1)  # denied: not delivered anywhere
    pub(dev, "public/news", b"not allowed", pid=2)       # anonymous may only read public/
    pub(dev, "devices/dev1/state", b"mine", pid=3)
    assert received(dev, "devices/dev1/state") == []
    # A will the client could not publish itself refuses the CONNECT (as mosquitto).
    willing = RawClient("127.0.0.1", acl_node.port, timeout=10)
    assert willing.connect("dev3", will=("public/will", b"w", 0, False)).return_code == 5
    willing.close()
    other = client(acl_node.port, "dev2")
    assert other.subscribe([("devices/dev2/#", 1)]) == [1]
    pub(other, "devices/dev2/marker", b"m", pid=1)
    assert received(other, "devices/dev2/marker") == []


def in_process_broker(tmp_path):
    """A broker in this process (so that a test can call its reload hook) with alice's and
    bob's passwords and ``ACL``; not started.  Returns it and its ACL file."""
    from mqttring import BrokerConfig, MqttRingBroker
    from mqttring.security.passwords import format_entries, hash_password

    pw, acl = tmp_path / "passwords", tmp_path / "acl"
    pw.write_text(format_entries([("alice", hash_password(b"a-pw")),
                                  ("bob", hash_password(b"b-pw"))]))
    acl.write_text(ACL)
    return MqttRingBroker(BrokerConfig(mqtt="127.0.0.1:0", ws=None, data_dir=tmp_path / "d",
                                       sys_interval=0, password_file=pw, acl_file=acl)), acl


def test_a_reload_reaches_connected_and_queued_clients(tmp_path):
    """``BrokerCore.reload_security`` (what the SIGHUP hook calls) on a running broker: messages
    queued for an away persistent session before the change, and live ones after it, obey
    the new rules.  In-process, so the test can call the hook itself."""
    broker, acl = in_process_broker(tmp_path)
    ports = broker.start()
    try:
        away = RawClient("127.0.0.1", ports.mqtt, timeout=10)
        assert away.connect("alice-q", clean_session=False, username="alice",
                            password=b"a-pw").return_code == 0
        assert away.subscribe([("shared/#", 1)]) == [1]
        away.send(DISCONNECT_BYTES)
        assert away.wait_closed(10)
        bob = client(ports.mqtt, "bob-q", "bob")
        pub(bob, "shared/a", b"queued-a", pid=1)
        pub(bob, "shared/b", b"queued-b", pid=2)
        acl.write_text(ACL.replace("topic read shared/#", "topic read shared/b/#"))
        assert broker.core is not None
        broker.core.reload_security()  # what the SIGHUP hook calls
        back = RawClient("127.0.0.1", ports.mqtt, timeout=10)
        assert back.connect("alice-q", clean_session=False, username="alice",
                            password=b"a-pw").return_code == 0
        pub(bob, "shared/a", b"live-a", pid=3)
        pub(bob, "shared/b/end", b"marker", pid=4)
        assert received(back, "shared/b/end") == [("shared/b", b"queued-b", False)]
    finally:
        broker.stop()


def test_a_will_whose_topic_a_reload_revoked_is_not_published(tmp_path, caplog):
    """One node: the will goes out only if the ACL as it is then lets its client write its
    topic (mosquitto's rule too); the control, published before the reload, does."""
    broker, acl = in_process_broker(tmp_path)
    caplog.set_level(logging.INFO, logger="mqttring")
    ports = broker.start()
    try:
        alice = client(ports.mqtt, "alice-w", "alice")
        assert alice.subscribe([("shared/#", 1)]) == [1]

        def bob_with_will(tag: str) -> RawClient:
            c = RawClient("127.0.0.1", ports.mqtt, timeout=10)
            ack = c.connect(f"bob-{tag}", username="bob", password=b"b-pw",
                            will=(f"shared/{tag}", tag.encode(), 1, False))
            assert ack.return_code == 0
            return c

        bob_with_will("control").close()
        assert alice.expect(PUBLISH, 10).payload == b"control"
        revoked = bob_with_will("revoked")
        acl.write_text(ACL.replace("topic write shared/#", "topic write shared/marker"))
        assert broker.core is not None
        broker.core.reload_security()
        revoked.close()
        bob = client(ports.mqtt, "bob-marker", "bob")
        # The will's turn comes when the server sees the close; the marker is published
        # after the log says so, and must be the next thing alice reads.
        deadline = time.monotonic() + 10
        while not any("not published: the ACL no longer" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no log of the will being withheld"
            time.sleep(0.02)
        pub(bob, "shared/marker", b"marker")
        assert received(alice, "shared/marker") == []
    finally:
        broker.stop()


def test_repeated_denials_are_counted_and_logged_once_clipped(tmp_path, caplog):
    """A client repeating a denied publish with a 30 KB topic wrote one log line per packet,
    each holding the whole topic (240 MB of log in 2 s, a black-box probe).  Now every
    denial is counted (``acl_denials``), the first of the client is logged at info with the
    topic clipped, the rest at debug; the same for denied subscriptions."""
    broker, _ = in_process_broker(tmp_path)
    caplog.set_level(logging.INFO, logger="mqttring")
    ports = broker.start()
    try:
        bob = client(ports.mqtt, "bob-flood", "bob")
        topic = "denied/" + "x" * 30_000
        for pid in range(1, 41):
            pub(bob, topic, b"no", pid=pid)  # acknowledged, as mosquitto, never routed
        assert bob.subscribe([(topic, 0)]) == [0x80]
        assert broker.metrics.acl_denials == 41
        lines = [r.getMessage() for r in caplog.records if "by the ACL" in r.getMessage()]
        assert len(lines) == 1, lines[:3]
        assert "denied a publish of 'bob-flood'" in lines[0] and len(lines[0]) < 400
        assert "(30007 characters)" in lines[0]
    finally:
        broker.stop()
