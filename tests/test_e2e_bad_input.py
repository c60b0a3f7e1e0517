"""Malformed input and CONNECT rules (MQTT 3.1.1 sections 2, 3.1, 3.2, 4.8).

Section 4.8: "Unless stated otherwise, if either the Server or Client encounters a protocol
violation, it MUST close the Network Connection on which it received that Control Packet".
Every case below must close the offending connection only: a second client keeps working.
"""

from __future__ import annotations

import struct

import pytest

from mqtt_client import (
    CONNACK,
    PINGREQ_BYTES,
    PINGRESP,
    connect,
    mqtt_string,
    packet,
    publish,
    subscribe,
)

pytestmark = pytest.mark.timeout(60)

# Sent after a successful CONNECT.
AFTER_CONNECT = {
    # 2.2.3: the Remaining Length uses at most four bytes.
    "remaining-length-5-bytes": b"\x30\xff\xff\xff\xff\x7f",
    # 2.2.1: packet types 0 and 15 are reserved.
    "reserved-type-0": b"\x00\x00",
    "reserved-type-15": b"\xf0\x00",
    # [MQTT-3.3.1-4]: a PUBLISH with both QoS bits set (QoS 3).
    "publish-qos-3": publish("a/b", b"x", qos=3, packet_id=1),
    # [MQTT-3.3.1-2]: DUP must be 0 for QoS 0.
    "publish-qos0-dup": publish("a/b", b"x", qos=0, dup=True),
    # [MQTT-3.3.2-2]: no wildcards in a PUBLISH topic name.
    "publish-wildcard-topic": publish("a/+", b"x"),
    "publish-hash-topic": publish("a/#", b"x"),
    # [MQTT-4.7.3-1]: topic names are at least one character long.
    "publish-empty-topic": publish("", b"x"),
    # [MQTT-1.5.3-1]: ill-formed UTF-8 (a lone continuation byte).
    "publish-invalid-utf8": publish(b"a/\x80", b"x"),
    # [MQTT-1.5.3-2]: U+0000 in a string.
    "publish-nul-in-topic": publish(b"a\x00b", b"x"),
    # [MQTT-2.3.1-1]: QoS > 0 PUBLISH needs a non-zero packet id.
    "publish-packet-id-0": publish("a/b", b"x", qos=1, packet_id=0),
    # [MQTT-3.8.1-1]: SUBSCRIBE fixed-header flags MUST be 0010.
    "subscribe-bad-flags": subscribe(1, [("a/b", 0)], first=0x80),
    # [MQTT-3.8.3-3]: SUBSCRIBE with no topic filter.
    "subscribe-empty": packet(0x82, struct.pack("!H", 1)),
    # [MQTT-3-8.3-4]: requested QoS 3.
    "subscribe-qos-3": subscribe(1, [("a/b", 3)]),
    # [MQTT-4.7.1-2]: '#' must be last and follow a separator.
    "subscribe-hash-not-last": subscribe(1, [("a/#/b", 0)]),
    # [MQTT-4.7.1-3]: '+' must occupy an entire level.
    "subscribe-plus-inside-level": subscribe(1, [("a+", 0)]),
    # [MQTT-4.7.3-1]: filters are at least one character long; [MQTT-1.5.3-2] no U+0000.
    "subscribe-empty-filter": subscribe(1, [("", 0)]),
    "subscribe-nul-in-filter": subscribe(1, [(b"a/\x00", 0)]),
    # [MQTT-3.10.3-2]: UNSUBSCRIBE with no topic filter.
    "unsubscribe-empty": packet(0xA2, struct.pack("!H", 2)),
    # [MQTT-3.6.1-1]: PUBREL flags must be 0010.
    "pubrel-bad-flags": packet(0x60, struct.pack("!H", 1)),
    # [MQTT-3.1.0-2]: a second CONNECT is a protocol violation.
    "second-connect": connect("again"),
    # The server must not receive CONNACK/SUBACK/PINGRESP (server-to-client only, 2.2.1).
    "client-sends-connack": b"\x20\x02\x00\x00",
    "client-sends-pingresp": b"\xd0\x00",
}


@pytest.mark.parametrize("bad", list(AFTER_CONNECT.values()), ids=list(AFTER_CONNECT))
def test_malformed_packet_closes_only_that_client(raw, paho, uid, bad):
    topic = uid("ok")
    good = paho(uid("good"))
    good.connect()
    good.subscribe(topic, 1)
    c = raw()
    assert c.connect(uid("bad")).return_code == 0
    c.send(bad)
    got, closed = c.packets_until_closed(5)
    # An answer such as SUBACK 0x80 before closing is tolerated; staying open is not (4.8).
    assert closed, f"connection still open after {bad!r}; received {got}"
    good.publish(topic, b"still-serving", qos=1)
    assert good.get().payload == b"still-serving"
    fresh = raw()
    assert fresh.connect(uid("fresh")).return_code == 0


BEFORE_CONNECT = {
    # [MQTT-3.1.0-1]: the first packet from the client MUST be CONNECT.
    "pingreq-first": PINGREQ_BYTES,
    "publish-first": publish("a/b", b"x"),
    "subscribe-first": subscribe(1, [("a/b", 0)]),
    # [MQTT-3.1.2-3]: reserved CONNECT flag must be zero.
    "connect-reserved-flag": connect("r", reserved_flag=True),
    # [MQTT-3.1.2-13]: Will Flag 0 requires Will QoS 0 ... [MQTT-3.1.2-15] and Will Retain 0.
    "connect-will-qos-without-will": connect("w", flags_override=0x02 | 0x08),
    "connect-will-retain-without-will": connect("w", flags_override=0x02 | 0x20),
    # [MQTT-3.1.2-14]: Will QoS 3.
    "connect-will-qos-3": connect("w", will=("t", b"p", 3, False)),
    # [MQTT-3.1.2-22]: password flag without user name flag.
    "connect-password-without-username": connect("p", password=b"secret"),
    # [MQTT-3.1.3-?] / 1.5.3: client id with invalid UTF-8.
    "connect-invalid-utf8-client-id": connect(b"\xff\xfe"),
    # CONNECT with remaining length shorter than its variable header.
    "connect-truncated": packet(0x10, mqtt_string("MQTT") + b"\x04"),
    # [MQTT-2.2.2-2]: CONNECT fixed-header flags are reserved (0000).
    "connect-bad-fixed-flags": b"\x11" + connect("f")[1:],
}


@pytest.mark.parametrize("bad", list(BEFORE_CONNECT.values()), ids=list(BEFORE_CONNECT))
def test_bad_first_packet_closes_without_connack(raw, paho, uid, bad):
    c = raw()
    c.send(bad)
    got, closed = c.packets_until_closed(5)
    assert closed, f"connection still open after {bad!r}"
    # At most a refusing CONNACK may precede the close; never CONNACK 0 or another reply.
    assert all(p.type == CONNACK and p.return_code != 0 for p in got), got
    ok = paho(uid("ok"))
    ok.connect()


@pytest.mark.parametrize(
    ("name", "level"), [("MQTT", 3), ("MQTT", 6), ("MQTT", 0)], ids=["level3", "level6", "level0"]
)
def test_unsupported_protocol_level_connack_1(raw, uid, name, level):
    """[MQTT-3.1.2-2]: unsupported Protocol Level -> CONNACK 0x01, then close [MQTT-3.2.2-5].
    (Level 3 with name "MQTT" is not MQTT 3.1 either: 3.1 used the name "MQIsdp".  Level 5,
    MQTT 5.0, is supported: tests/test_e2e_mqtt5.py.)"""
    c = raw()
    c.send(connect(uid("lvl"), protocol_name=name, protocol_level=level))
    got, closed = c.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 1)], got
    assert got[0].session_present is False, "[MQTT-3.2.2-4] SP=0 with a non-zero return code"
    assert closed, "[MQTT-3.2.2-5] the server must close after a non-zero CONNACK"


def test_empty_client_id_rules(raw, uid):
    """[MQTT-3.1.3-8]: empty ClientId with CleanSession=0 -> CONNACK 0x02 and close;
    [MQTT-3.1.3-6]/[MQTT-3.1.3-7]: with CleanSession=1 it is accepted (server assigns one)."""
    c = raw()
    c.send(connect("", clean_session=False))
    got, closed = c.packets_until_closed(5)
    assert [(p.type, p.return_code) for p in got] == [(CONNACK, 2)], got
    assert closed
    ok = raw()
    ack = ok.connect("", clean_session=True)
    assert (ack.return_code, ack.session_present) == (0, False)
    ok.send(PINGREQ_BYTES)
    assert ok.expect(PINGRESP)
    # Two anonymous clients must not take each other over.
    ok2 = raw()
    assert ok2.connect("", clean_session=True).return_code == 0
    ok.send(PINGREQ_BYTES)
    assert ok.expect(PINGRESP)


def test_client_id_longer_than_23_and_any_utf8_accepted(raw, uid):
    """[MQTT-3.1.3-5] allows 1-23 [0-9a-zA-Z]; servers MAY accept more; mqttring accepts any
    valid UTF-8 id (issue 2 lists only the empty-id rule as a rejection)."""
    c = raw()
    ack = c.connect("client-é-" + "x" * 60 + uid(""))
    assert ack.return_code == 0


def test_truncated_packet_then_close_does_not_hurt_broker(raw, paho, uid):
    """A client that dies mid-packet (half a PUBLISH) must not affect anyone else."""
    topic = uid("half")
    good = paho(uid("good"))
    good.connect()
    good.subscribe(topic, 0)
    c = raw()
    assert c.connect(uid("half")).return_code == 0
    c.send(publish(topic, b"y" * 1000)[:300])
    c.close()
    assert good.drain(0.5) == [], "a partial PUBLISH must not be delivered"
    good.publish(topic, b"fine", qos=1)
    assert good.get().payload == b"fine"


def test_username_and_password_accepted_without_auth(raw, uid):
    """3.1.2.8/3.1.2.9 and 3.1.3.4/3.1.3.5: a CONNECT with user name and password is well formed;
    with no authentication configured the node accepts it (CONNACK 0)."""
    c = raw()
    ack = c.connect(uid("auth"), username="user", password=b"\x00binary\xff")
    assert (ack.return_code, ack.session_present) == (0, False)
    c2 = raw()
    assert c2.connect(uid("useronly"), username="only-user").return_code == 0


@pytest.mark.parametrize("bad", ["publish-wildcard-topic", "publish-qos-3", "second-connect",
                                 "remaining-length-5-bytes"])
def test_a_bad_packet_in_the_same_write_as_connect_is_a_protocol_error(raw, paho, uid, bad,
                                                                      caplog):
    """Bytes behind the CONNECT in one write (one TCP segment) are read while the CONNECT is
    accepted.  A rule they break closed the connection as an *internal* error, with a
    traceback in the log, and counted as one; it is the same protocol-error close as when
    they come in a later read: CONNACK, then the close, and the will published (4.8)."""
    will_topic = uid("will")
    watcher = paho(uid("watcher"))
    watcher.connect()
    watcher.subscribe(will_topic, 1)
    c = raw()
    with caplog.at_level("DEBUG", logger="mqttring"):
        c.send(connect(uid("piped"), will=(will_topic, b"gone", 1, False)) + AFTER_CONNECT[bad])
        got, closed = c.packets_until_closed(5)
        assert [(p.type, p.return_code) for p in got] == [(CONNACK, 0)], got
        assert closed
        assert watcher.get().payload == b"gone"
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors]
