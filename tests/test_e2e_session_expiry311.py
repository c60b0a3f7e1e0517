"""``limits.persistent_session_expiry``: MQTT 3.1.1 persistent sessions that end.

MQTT 3.1.1 keeps a CleanSession 0 session until its client returns, so a device gone for
good keeps its subscriptions and a growing queue forever.  With the setting (mosquitto's
``persistent_client_expiration``) such a session is kept that many seconds after its
connection closes, as if an MQTT 5 client had asked for that Session Expiry Interval; a
reconnect within it resumes the session (and restarts the count at the next close).  The
expiry is wall-clock time by nature, so the tests wait for it to pass.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster_support import Clients, NodeCluster
from mqtt_client import DISCONNECT_BYTES, PUBACK, PUBLISH, puback, publish

pytestmark = pytest.mark.timeout(120)

EXPIRY = 2


def park_session(b, raw, cid: str, topic: str) -> None:
    """A persistent session subscribed to ``topic`` whose client has left."""
    client = raw(b)
    assert client.connect(cid, clean_session=False).return_code == 0
    assert client.subscribe([(topic, 1)]) == [1]
    client.send(DISCONNECT_BYTES)
    assert client.wait_closed()


def queue_one(b, raw, uid, topic: str, payload: bytes) -> None:
    pub = raw(b)
    assert pub.connect(uid("pub")).return_code == 0
    pub.send(publish(topic, payload, qos=1, packet_id=1))
    assert pub.expect(PUBACK).packet_id == 1


def test_a_311_persistent_session_expires_after_the_configured_interval(
        broker_factory, raw, uid):
    expiring = broker_factory(persistent_session_expiry=EXPIRY)
    kept = broker_factory()  # the default: 3.1.1's "until the client returns"
    cid, topic = uid("p311"), uid("t")
    for b in (expiring, kept):
        park_session(b, raw, cid, topic)
        queue_one(b, raw, uid, topic, b"queued")
    # Within the interval it resumes, queue and all; leaving again restarts the count,
    # this time without a DISCONNECT.
    back = raw(expiring)
    ack = back.connect(cid, clean_session=False)
    assert (ack.return_code, ack.session_present) == (0, True)
    got = back.expect(PUBLISH)
    assert got.payload == b"queued"
    back.send(puback(got.packet_id))
    back.close()
    left = time.monotonic()
    queue_one(expiring, raw, uid, topic, b"never delivered")
    time.sleep(max(0.0, left + EXPIRY + 1.0 - time.monotonic()))

    gone = raw(expiring)
    ack = gone.connect(cid, clean_session=False)
    assert (ack.return_code, ack.session_present) == (0, False), "expired"
    assert gone.no_packet_within(0.5) is None, "its queue went with it"
    still = raw(kept)
    ack = still.connect(cid, clean_session=False)
    assert (ack.return_code, ack.session_present) == (0, True), "0 keeps it, as 3.1.1 says"
    assert still.expect(PUBLISH).payload == b"queued"


def test_the_expiry_runs_at_a_remote_home(tmp_path: Path, clients: Clients) -> None:
    """A session homed at B, its client connected through A: A tells B the interval when
    the connection closes, and B ends the session when it runs out."""
    cluster = NodeCluster(tmp_path / "c")
    cluster.extra_toml = f"[limits]\npersistent_session_expiry = {EXPIRY}\n"
    try:
        cluster.form_sync("a", "b")
        view = cluster.settle(("a", "b"))
        cid = view.client_homed_at("b", "p311-remote")
        topic = f"t/{cid}"
        sub = clients.make(cluster.port("a"), cid, clean_session=False)
        sub.connect()
        sub.subscribe(topic, 1)
        sub.disconnect()
        pub = clients.connected(cluster.port("b"), "p311-pub")
        pub.publish(topic, b"queued", qos=1)
        back = clients.make(cluster.port("a"), cid, clean_session=False)
        assert back.connect() is True
        assert [d.payload for d in back.collect(1)] == [b"queued"]
        back.close()
        # The home ends it by its own clock, once the edge has told it of the close (a
        # reconnect before that would resume it): wait for the home's word, then look.
        expired = f"session of {cid!r} expired"
        deadline = time.monotonic() + EXPIRY + 15
        while expired not in cluster.log("b") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert expired in cluster.log("b"), cluster.logs_of_interest(("a", "b"))
        gone = clients.make(cluster.port("a"), cid, clean_session=False)
        assert gone.connect() is False, "the home ended the session when it ran out"
    finally:
        cluster.close()
