"""The malformed-input cases of ``test_e2e_bad_input.py`` again, over the ``mqtts`` listener.

Why again: TLS adds its own reader between the socket and the MQTT parser (the record
layer, its buffering, a close that is a ``close_notify`` or a bare FIN).  A protocol
violation must still close only the offending connection there, and the node must keep
serving every other client, TLS or not (MQTT 3.1.1 section 4.8).

Real parts: a ``trustme`` CA and server certificate, an in-process node with both a plain
and an mqtts listener, the bytes sent through a TLS-wrapped raw socket (``ssl`` module), a
paho client over mqtts as the bystander.  The case lists are imported, not copied, so a case
added there is run here too.
"""

from __future__ import annotations

import socket
import ssl
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

from conftest import HOST, BrokerHandle
from mqtt_client import CONNACK, ConnectionClosed, RawClient, StreamDecoder, publish
from test_e2e_bad_input import AFTER_CONNECT, BEFORE_CONNECT

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class TlsNode:
    """Where the node listens and what a client needs to trust it."""

    tls: BrokerHandle  #: the mqtts listener as ``port``
    plain: BrokerHandle
    ca: Path
    context: ssl.SSLContext


@pytest.fixture
def tls_node(tmp_path: Path) -> Iterator[TlsNode]:
    from mqttring import BrokerConfig, MqttRingBroker

    ca = trustme.CA()
    leaf = ca.issue_cert(HOST, "localhost")
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(ca_file))
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    config = BrokerConfig(node_id=f"badtls-{uuid.uuid4().hex[:6]}", mqtt=f"{HOST}:0",
                          mqtts=f"{HOST}:0", data_dir=data_dir, sys_interval=0,
                          certfile=cert, keyfile=key)
    broker = MqttRingBroker(config)
    ports = broker.start()
    try:
        assert ports.mqtts, ports
        yield TlsNode(BrokerHandle(HOST, ports.mqtts, None, data_dir),
                      BrokerHandle(HOST, ports.mqtt, None, data_dir), ca_file,
                      ssl.create_default_context(cafile=str(ca_file)))
    finally:
        broker.stop()


class TlsRawClient(RawClient):
    """``RawClient`` over TLS: the same bytes, inside TLS records.

    A TLS peer that closes may do so without ``close_notify`` (``SSLEOFError``) or with it
    (``SSLZeroReturnError``); both are the end of the connection, like a FIN in plain TCP.
    """

    def __init__(self, node: TlsNode, timeout: float = 5.0) -> None:
        sock = socket.create_connection((HOST, node.tls.port), timeout=timeout)
        try:
            self.sock = node.context.wrap_socket(sock, server_hostname=HOST)
        except BaseException:
            sock.close()
            raise
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = StreamDecoder()
        self.eof = False

    def _fill(self, deadline: float) -> None:
        try:
            super()._fill(deadline)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            self.eof = True
            raise ConnectionClosed("broker closed the TLS connection") from None

    def try_send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
        except (OSError, ssl.SSLError):
            return False
        return True


@pytest.fixture
def tls_raw(tls_node: TlsNode) -> Iterator[Callable[[], TlsRawClient]]:
    made: list[TlsRawClient] = []

    def make() -> TlsRawClient:
        client = TlsRawClient(tls_node)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def tls_paho(paho: Callable[..., Any], node: TlsNode, client_id: str) -> Any:
    client = paho(client_id, target=node.tls)
    client.client.tls_set(ca_certs=str(node.ca))
    return client


def still_serving(paho: Callable[..., Any], tls_raw: Callable[[], TlsRawClient],
                  node: TlsNode, good: Any, topic: str, uid: Callable[[str], str]) -> None:
    """The bystander over mqtts still gets a message, a new TLS client and a plain client
    are still accepted."""
    good.publish(topic, b"still-serving", qos=1)
    assert good.get().payload == b"still-serving"
    assert tls_raw().connect(uid("fresh")).return_code == 0
    plain = RawClient(HOST, node.plain.port)
    try:
        assert plain.connect(uid("plain")).return_code == 0
    finally:
        plain.close()


@pytest.mark.parametrize("bad", list(AFTER_CONNECT.values()), ids=list(AFTER_CONNECT))
def test_malformed_packet_over_tls_closes_only_that_client(tls_node, tls_raw, paho, uid, bad):
    topic = uid("ok")
    good = tls_paho(paho, tls_node, uid("good"))
    good.connect()
    good.subscribe(topic, 1)
    c = tls_raw()
    assert c.connect(uid("bad")).return_code == 0
    c.send(bad)
    got, closed = c.packets_until_closed(5)
    # An answer such as SUBACK 0x80 before closing is tolerated; staying open is not (4.8).
    assert closed, f"TLS connection still open after {bad!r}; received {got}"
    still_serving(paho, tls_raw, tls_node, good, topic, uid)


@pytest.mark.parametrize("bad", list(BEFORE_CONNECT.values()), ids=list(BEFORE_CONNECT))
def test_bad_first_packet_over_tls_closes_without_connack(tls_node, tls_raw, paho, uid, bad):
    topic = uid("ok")
    good = tls_paho(paho, tls_node, uid("good"))
    good.connect()
    good.subscribe(topic, 1)
    c = tls_raw()
    c.send(bad)
    got, closed = c.packets_until_closed(5)
    assert closed, f"TLS connection still open after {bad!r}"
    # At most a refusing CONNACK may precede the close; never CONNACK 0 or another reply.
    assert all(p.type == CONNACK and p.return_code != 0 for p in got), got
    still_serving(paho, tls_raw, tls_node, good, topic, uid)


def test_truncated_packet_over_tls_then_close(tls_node, tls_raw, paho, uid):
    """A TLS client that dies mid-packet (half a PUBLISH, then a bare close without
    ``close_notify``) delivers nothing and hurts no one."""
    topic = uid("half")
    good = tls_paho(paho, tls_node, uid("good"))
    good.connect()
    good.subscribe(topic, 0)
    c = tls_raw()
    assert c.connect(uid("half")).return_code == 0
    c.send(publish(topic, b"y" * 1000)[:300])
    c.close()  # ssl's close() sends no close_notify: the TCP connection just ends
    assert good.drain(0.5) == [], "a partial PUBLISH must not be delivered"
    still_serving(paho, tls_raw, tls_node, good, topic, uid)
