"""Session takeover and keepalive (MQTT 3.1.1 sections 3.1.4, 3.1.2.10, 3.12)."""

from __future__ import annotations

import contextlib
import time

import pytest

from mqtt_client import CONNACK, PINGREQ_BYTES, PINGRESP, PUBLISH, ConnectionClosed, connect

pytestmark = pytest.mark.timeout(60)


def test_second_connect_with_same_id_closes_first_and_publishes_its_will(raw, paho, uid):
    """[MQTT-3.1.4-2]: if the ClientId is already connected, the server MUST disconnect the
    existing client.  The old connection did not send DISCONNECT, so its will is published
    (3.1.2.5; issue 2 lists takeover explicitly)."""
    cid, will_topic = uid("dup"), uid("will")
    watcher = paho(uid("watch"))
    watcher.connect()
    watcher.subscribe(will_topic, 1)
    first = raw()
    assert first.connect(cid, will=(will_topic, b"taken over", 1, False)).return_code == 0
    second = raw()
    assert second.connect(cid).return_code == 0
    assert first.wait_closed(5), "[MQTT-3.1.4-2] the first connection must be closed"
    m = watcher.get()
    assert (m.topic, m.payload) == (will_topic, b"taken over")
    # The new connection is the live one.
    second.send(PINGREQ_BYTES)
    assert second.expect(PINGRESP).flags == 0


def test_takeover_keeps_persistent_session(raw, paho, uid):
    """A CleanSession=0 takeover resumes the same session: SP=1 and subscriptions continue."""
    cid, topic = uid("dup"), uid("t")
    first = raw()
    assert first.connect(cid, clean_session=False).return_code == 0
    assert first.subscribe([(topic, 1)]) == [1]
    second = raw()
    ack = second.connect(cid, clean_session=False)
    assert (ack.return_code, ack.session_present) == (0, True)
    assert first.wait_closed(5)
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"to-new", qos=1)
    p = second.expect(PUBLISH)
    assert p.payload == b"to-new"


def test_keepalive_expiry_at_one_and_a_half_times(raw, paho, uid):
    """[MQTT-3.1.2-24]: no packet within 1.5 x Keep Alive -> the server MUST disconnect.
    Keep Alive 2 s: still open at 2.4 s (not a 1x timer), closed by 3 s + slack."""
    c = raw()
    assert c.connect(uid("ka"), keepalive=2).return_code == 0
    t0 = time.monotonic()
    assert not c.wait_closed(2.4), "closed before 1.2 x keepalive: the grace is 1.5 x"
    assert c.wait_closed(2.6), "still open 5 s after CONNACK with keepalive=2 (limit is 3 s)"
    elapsed = time.monotonic() - t0
    assert 2.4 <= elapsed <= 5.0


def test_pingreq_keeps_connection_alive(raw, uid):
    """[MQTT-3.12.4-1]: PINGREQ is answered with PINGRESP, and any packet resets the keepalive
    timer, so a client pinging every second with Keep Alive 1 stays connected."""
    c = raw()
    assert c.connect(uid("ping"), keepalive=1).return_code == 0
    for _ in range(5):
        time.sleep(0.8)
        c.send(PINGREQ_BYTES)
        resp = c.expect(PINGRESP, timeout=2)
        assert (resp.flags, resp.body) == (0, b"")


def test_keepalive_zero_means_no_timeout(raw, uid):
    """3.1.2.10: Keep Alive 0 turns the mechanism off; the server must not time the client out."""
    c = raw()
    assert c.connect(uid("ka0"), keepalive=0).return_code == 0
    assert not c.wait_closed(3.0)
    c.send(PINGREQ_BYTES)
    assert c.expect(PINGRESP)


def test_takeover_resends_inflight_on_new_connection(raw, paho, uid):
    """[MQTT-3.1.4-2] + [MQTT-4.4.0-1]: a CleanSession=0 takeover keeps the session, so a QoS 1
    message the old connection never acknowledged is re-sent to the new one with DUP=1."""
    from mqtt_client import puback

    cid, topic = uid("dup"), uid("t")
    first = raw()
    assert first.connect(cid, clean_session=False).return_code == 0
    assert first.subscribe([(topic, 1)]) == [1]
    pub = paho(uid("pub"))
    pub.connect()
    pub.publish(topic, b"unacked", qos=1)
    p = first.expect(PUBLISH)
    second = raw()
    assert second.connect(cid, clean_session=False).session_present is True
    again = second.expect(PUBLISH)
    assert (again.payload, again.packet_id, again.dup) == (b"unacked", p.packet_id, True)
    second.send(puback(again.packet_id))
    assert first.wait_closed(5)


def test_any_packet_resets_keepalive(raw, uid):
    """3.1.2.10: the timer runs from the last Control Packet received, not only PINGREQ: a
    client publishing QoS 0 every 0.5 s with Keep Alive 1 stays connected for 4 s."""
    from mqtt_client import publish

    c = raw()
    assert c.connect(uid("busy"), keepalive=1).return_code == 0
    for _ in range(8):
        time.sleep(0.5)
        assert c.try_send(publish(uid("busy"), b"tick")), "connection closed while active"
    c.send(PINGREQ_BYTES)
    assert c.expect(PINGRESP)


@pytest.mark.parametrize("clean", [False, True])
def test_connects_of_one_id_that_come_together_leave_one_connection(raw, paho, uid, clean):
    """[MQTT-3.1.4-2] when the CONNECTs arrive at once: each waits for the store before it
    is registered, and unserialized each found no connection to take over, so two stayed
    live (a probe: 2 of 3 in 20 of 20 rounds, CleanSession 0 with a new id, or 1 with a
    stored session), one of them receiving nothing.  Rounds with a persistent session
    stored first (``clean``) and without."""
    for round_no in range(5):
        cid = uid(f"together{round_no}")
        if clean:  # a stored session for the id, so that CleanSession=1 deletes one
            first = raw()
            assert first.connect(cid, clean_session=False).return_code == 0
            first.close()
        conns = [raw() for _ in range(3)]
        wire = connect(cid, clean_session=clean)
        for conn in conns:  # as close together as three writes can be
            conn.send(wire)
        for conn in conns:
            # Each is accepted, then taken over by the next (its CONNACK comes first).
            assert conn.expect(CONNACK).return_code == 0
        live = []
        for conn in conns:
            if conn.try_send(PINGREQ_BYTES):
                with contextlib.suppress(ConnectionClosed):  # taken over: closed, no answer
                    conn.expect(PINGRESP, timeout=2)
                    live.append(conn)
        assert len(live) == 1, f"round {round_no}: {len(live)} of 3 connections live"
        for conn in conns:
            conn.close()
