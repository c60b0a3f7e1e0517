"""Idle connections parked without a task (``mqttring.broker.parking``), seen from real clients.

A parked connection must be indistinguishable from one with a task: deliveries reach it,
PINGREQ is answered, its keepalive closes it on time, a takeover or the node's shutdown
closes it, and its will is published exactly when the client left without DISCONNECT.  Each
test first waits until ``$SYS/broker/clients/parked`` shows the connection parked, so none
of them passes by never parking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from mqtt_client import (
    DISCONNECT_BYTES,
    PINGREQ_BYTES,
    PINGRESP,
    PUBLISH,
    RawClient,
    puback,
)

pytestmark = pytest.mark.timeout(60)

PARKED = "$SYS/broker/clients/parked"


def wait_parked(watcher: Any, at_least: int, timeout: float = 10.0) -> int:
    """The first ``$SYS`` parked count >= ``at_least`` (the watcher itself may be one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = watcher.get(max(0.1, deadline - time.monotonic()))
        except Exception:
            break
        if message.topic == PARKED and int(message.payload) >= at_least:
            return int(message.payload)
    raise AssertionError(f"never saw {at_least} connections parked")


@pytest.fixture
def parking_broker(broker_factory: Callable[..., Any]) -> Any:
    return broker_factory(sys_interval=0.3, ws=False, park_idle_after=0.1)


def watch(paho_any: Callable[..., Any], broker: Any, uid: Callable[[str], str]) -> Any:
    watcher = paho_any(broker, uid("watch"))
    watcher.connect()
    watcher.subscribe(PARKED, 0)
    return watcher


def test_a_parked_subscriber_gets_deliveries_and_pings_answered(
        parking_broker, raw, paho_any, uid):
    topic = uid("parked/in")
    watcher = watch(paho_any, parking_broker, uid)
    sub: RawClient = raw(parking_broker)
    assert sub.connect(uid("sub"), keepalive=60).return_code == 0
    assert sub.subscribe([(topic, 1)]) == [1]
    wait_parked(watcher, 2)  # the subscriber and the watcher, both idle between $SYS rounds
    pub = paho_any(parking_broker, uid("pub"))
    pub.connect()
    for n in range(3):
        pub.publish(topic, f"m{n}".encode(), qos=1)
        got = sub.expect(PUBLISH)
        assert got.payload == f"m{n}".encode() and got.qos == 1
        sub.send(puback(got.packet_id))
        wait_parked(watcher, 2)  # parks again once quiet, and is woken again
    sub.send(PINGREQ_BYTES)
    assert sub.expect(PINGRESP), "a parked connection answers PINGREQ"


def test_a_parked_connections_keepalive_still_closes_it_on_time(parking_broker, raw, paho_any,
                                                                uid):
    watcher = watch(paho_any, parking_broker, uid)
    quiet: RawClient = raw(parking_broker)
    started = time.monotonic()
    assert quiet.connect(uid("quiet"), keepalive=2).return_code == 0
    wait_parked(watcher, 2)
    assert quiet.wait_closed(6), "a silent client must be closed after 1.5 x keepalive"
    waited = time.monotonic() - started
    assert 2.9 <= waited <= 4.5, f"closed after {waited:.2f}s; 1.5 x keepalive is 3 s"


def test_a_parked_connection_taken_over_is_closed_and_its_will_published(
        parking_broker, raw, paho_any, uid):
    client_id, will_topic = uid("same"), uid("will/taken")
    watcher = watch(paho_any, parking_broker, uid)
    watcher.subscribe(will_topic, 1)
    first: RawClient = raw(parking_broker)
    assert first.connect(client_id, will=(will_topic, b"gone", 1, False)).return_code == 0
    wait_parked(watcher, 2)
    second: RawClient = raw(parking_broker)
    assert second.connect(client_id).return_code == 0
    assert first.wait_closed(5), "the parked connection must be closed by the takeover"
    wills = [m for m in watcher.drain(2) if m.topic == will_topic]
    assert [m.payload for m in wills] == [b"gone"]


def test_a_parked_client_that_leaves_gets_its_will_only_without_disconnect(
        parking_broker, raw, paho_any, uid):
    watcher = watch(paho_any, parking_broker, uid)
    rude_topic, polite_topic = uid("will/rude"), uid("will/polite")
    watcher.subscribe(rude_topic, 1)
    watcher.subscribe(polite_topic, 1)
    rude: RawClient = raw(parking_broker)
    polite: RawClient = raw(parking_broker)
    assert rude.connect(uid("rude"), will=(rude_topic, b"r", 1, False)).return_code == 0
    assert polite.connect(uid("polite"), will=(polite_topic, b"p", 1, False)).return_code == 0
    wait_parked(watcher, 3)
    polite.send(DISCONNECT_BYTES)
    assert polite.wait_closed(5)
    rude.close()  # TCP closed without DISCONNECT
    wills = [m for m in watcher.drain(2) if m.topic in (rude_topic, polite_topic)]
    assert [(m.topic, m.payload) for m in wills] == [(rude_topic, b"r")]


def test_shutdown_closes_parked_connections(tmp_path):
    from mqttring import BrokerConfig, Limits, MqttRingBroker

    broker = MqttRingBroker(BrokerConfig(mqtt="127.0.0.1:0", ws=None, data_dir=tmp_path,
                                         sys_interval=0, limits=Limits(park_idle_after=0.1)))
    ports = broker.start()
    try:
        clients = [RawClient("127.0.0.1", ports.mqtt) for _ in range(20)]
        for n, client in enumerate(clients):
            assert client.connect(f"idle-{n}").return_code == 0
        deadline = time.monotonic() + 10
        while broker.metrics.clients_parked < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broker.metrics.clients_parked == 20
    finally:
        broker.stop()
    assert all(client.wait_closed(5) for client in clients)
    for client in clients:
        client.close()


def test_parking_off_keeps_every_connection_on_its_task(broker_factory, raw, paho_any, uid):
    broker = broker_factory(sys_interval=0.3, ws=False, park_idle_after=0)
    watcher = watch(paho_any, broker, uid)
    idle: RawClient = raw(broker)
    assert idle.connect(uid("idle")).return_code == 0
    counts = {int(m.payload) for m in watcher.drain(1.5) if m.topic == PARKED}
    assert counts == {0}
    idle.send(PINGREQ_BYTES)
    assert idle.expect(PINGRESP)
