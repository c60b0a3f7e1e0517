"""MQTT 5 flow control across a reconnect: the resend honours the new Receive Maximum.

A client left 12 QoS 1 messages unacknowledged, then came back announcing Receive Maximum 4.
The server resends inflight PUBLISHes [MQTT-4.4.0-1] but may not have more than 4
unacknowledged at once [MQTT-3.3.4-7]: the first 4 come with DUP and their first packet
ids, each PUBACK lets one more out, in order, and messages queued meanwhile come after
all of them.  (Before 2026-11-28 all 12 were resent at once, as mosquitto 2.0 does.)
"""

from __future__ import annotations

import pytest

from conftest import BrokerHandle, unique
from mqtt5_support import Raw5
from mqtt_client import RawClient
from mqtt_client import publish as publish311
from mqttring.protocol.codec5 import encode5
from mqttring.protocol.packets5 import PubAck5, Publish5, SubOptions, Subscribe5

pytestmark = pytest.mark.timeout(60)


def test_inflight_resent_after_reconnect_stays_within_the_new_receive_maximum(
        broker: BrokerHandle) -> None:
    topic, client_id = unique("flow"), unique("flow-client")
    sub = Raw5(broker.host, broker.port)
    pub = RawClient(broker.host, broker.port)
    try:
        assert sub.connect(client_id, clean_start=False, session_expiry_interval=300,
                           receive_maximum=20).reason_code == 0
        sub.send(encode5(Subscribe5(1, ((topic, SubOptions(qos=1)),))))
        sub.recv()  # SUBACK
        pub.connect(unique("flow-pub"))
        for i in range(12):
            pub.send(publish311(topic, f"m{i}".encode(), qos=1, packet_id=i + 1))
        first = [sub.recv() for _ in range(12)]  # not acknowledged
        ids = {p.payload: p.packet_id for p in first}
        assert sorted(ids) == sorted(f"m{i}".encode() for i in range(12))
        sub.close()
        for i in range(12, 15):  # queued while it is away
            pub.send(publish311(topic, f"m{i}".encode(), qos=1, packet_id=i + 1))
        sub = Raw5(broker.host, broker.port)
        connack = sub.connect(client_id, clean_start=False, session_expiry_interval=300,
                              receive_maximum=4)
        assert connack.reason_code == 0 and connack.session_present
        got = [sub.recv() for _ in range(4)]
        assert all(isinstance(p, Publish5) and p.dup for p in got), got
        with pytest.raises(TimeoutError):
            sub.recv(timeout=0.5)  # a fifth would exceed Receive Maximum
        order = [p.payload for p in got]
        for _ in range(11):  # each PUBACK lets the next one out
            sub.send(encode5(PubAck5(got[-4].packet_id)))
            got.append(sub.recv())
            order.append(got[-1].payload)
        assert order == [f"m{i}".encode() for i in range(15)]
        assert [p.packet_id for p in got[:12]] == [ids[f"m{i}".encode()] for i in range(12)]
        assert all(p.dup for p in got[:12]) and not any(p.dup for p in got[12:])
    finally:
        sub.close()
        pub.close()
