"""Exactly once from a persistent QoS 2 publisher whose session's home fails mid-publish.

Found by a black-box probe (2026-11-28): a QoS 2 message came twice to QoS 2 subscribers in
6 of 7 runs where a persistent QoS 2 publisher's session moved.  Its edge routed the PUBLISH
before the packet id reached the session's home; the home, frozen, never stored it; the
client, with no PUBREC, resent the PUBLISH to the session's next home, which did not know
the id and routed it again, as a new message.  The id and the message's identity are now
stored at the home before the message is routed (``Session.begin_inbound_qos2``).

Real node processes on loopback; the home is frozen with SIGSTOP, then killed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from cluster_support import HOST, WAIT, NodeCluster, unique
from mqtt_client import PUBCOMP, PUBLISH, PUBREC, PUBREL, RawClient, pubcomp, publish, pubrec

pytestmark = pytest.mark.timeout(150)


def test_a_qos2_publish_is_delivered_once_when_the_publishers_home_freezes_mid_publish(
        fresh_cluster: Callable[..., NodeCluster]) -> None:
    cluster = fresh_cluster()
    view = cluster.view("a")
    home, edge, owner = "b", "c", "a"
    topic = view.topic_owned_by(owner, unique("q2pub"))
    publisher_id = view.client_homed_at(home, unique("q2pub"))
    subscriber_id = view.client_homed_at(owner, unique("q2sub"))
    sub = RawClient(HOST, cluster.port(owner))
    pub = RawClient(HOST, cluster.port(edge))
    got: list[bytes] = []

    def take_deliveries(seconds: float) -> None:
        """Complete every QoS 2 delivery that comes within ``seconds`` (as a client does)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            packet = sub.no_packet_within(left)
            if packet is None:
                return
            if packet.type == PUBLISH:
                got.append(packet.payload)
                sub.send(pubrec(packet.packet_id))
            elif packet.type == PUBREL:
                sub.send(pubcomp(packet.packet_id))

    try:
        assert sub.connect(subscriber_id, clean_session=False).return_code == 0
        assert sub.subscribe([(topic, 2)]) == [2]
        assert pub.connect(publisher_id, clean_session=False).return_code == 0
        frozen = cluster.procs[home].popen
        assert frozen is not None
        frozen.send_signal(signal.SIGSTOP)  # the session's home hears nothing now
        pub.send(publish(topic, b"once", qos=2, packet_id=1))
        # No PUBREC can come while the session's home is frozen; the edge closes the
        # connection once the home is declared down (the session moves) or the request
        # to it times out.
        assert pub.wait_closed(timeout=30), "the publisher's connection outlived its home"
        take_deliveries(0.5)
        cluster.kill(home)
    finally:
        pub.close()
    cluster.settle(("a", "c"), timeout=30)
    deadline = time.monotonic() + 20
    while True:  # the session's next home may still be loading its shard
        again = RawClient(HOST, cluster.port(edge))
        ack = again.connect(publisher_id, clean_session=False)
        if ack.return_code == 0 or time.monotonic() > deadline:
            break
        again.close()
        time.sleep(0.2)
    try:
        assert ack.return_code == 0, ack
        # The client never got a PUBREC: it resends the PUBLISH [MQTT-4.4.0-1].
        again.send(publish(topic, b"once", qos=2, dup=True, packet_id=1))
        assert again.expect(PUBREC, timeout=WAIT).packet_id == 1
        again.send(b"\x62\x02\x00\x01")  # PUBREL 1
        assert again.expect(PUBCOMP, timeout=WAIT).packet_id == 1
        take_deliveries(3.0)
        assert got == [b"once"], f"the subscriber got {got}\n{cluster.logs_of_interest()}"
    finally:
        again.close()
        sub.close()
