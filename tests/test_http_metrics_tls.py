"""``/metrics`` of a node process with a TLS listener: failed handshakes are exported.

``tls_handshake_failures`` was counted (``BrokerMetrics``) and published in ``$SYS`` but
missing from the Prometheus exposition, so a scrape could not alert on a client hammering
a TLS port with plaintext or a bad certificate.  A real node process, a real certificate
(``trustme``), a real failed handshake (plaintext MQTT on the ``mqtts`` port) and a good
one; and every counter ``BrokerMetrics`` keeps must be on ``/metrics``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from http_support import HOST, HttpNode, scrape, wait_for
from mqttring.broker.metrics import BrokerMetrics

pytestmark = pytest.mark.timeout(90)

FAILURES = ("mqttring_tls_handshake_failures_total", ())
#: MQTT 3.1.1 CONNECT, sent in the clear: what a client that forgot TLS sends.
PLAIN_CONNECT = bytes.fromhex("101100044d5154540402003c0005706c61696e")


@pytest.fixture
def tls_node(tmp_path: Path) -> Iterator[tuple[HttpNode, int, ssl.SSLContext]]:
    ca = trustme.CA()
    leaf = ca.issue_cert(HOST, "localhost")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    node = HttpNode(tmp_path, extra=("--mqtts", f"{HOST}:0", "--certfile", str(cert),
                                     "--keyfile", str(key)))
    try:
        mqtts = int(json.loads(node.ready.read_text())["mqtts"])
        context = ssl.create_default_context()
        ca.configure_trust(context)
        yield node, mqtts, context
    finally:
        node.stop()


def test_a_failed_tls_handshake_is_counted_on_metrics(tls_node) -> None:
    node, mqtts, context = tls_node
    with node.http() as client:
        before = scrape(client)
        assert before[FAILURES] == 0, "counter missing or not zero on a fresh node"
        # A handshake that fails: plaintext MQTT on the TLS port.  The node answers with a
        # TLS alert (or nothing) and closes; read until it does.
        with socket.create_connection((HOST, mqtts), timeout=10) as plain, \
                contextlib.suppress(ConnectionResetError):
            plain.sendall(PLAIN_CONNECT)
            while plain.recv(4096):
                pass
        wait_for(lambda: scrape(client)[FAILURES] == 1, 10, "the failed handshake counted")
        # One that succeeds is not counted.
        with socket.create_connection((HOST, mqtts), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=HOST) as tls:
            assert tls.version() is not None
        assert scrape(client)[FAILURES] == 1


def test_every_counter_the_broker_keeps_is_on_metrics(tls_node) -> None:
    """A counter added to ``BrokerMetrics`` without a line in ``/metrics`` fails here.

    Integer fields are counters (``mqttring_<name>_total``, a ``_total`` of the field name
    not repeated) or, for the few gauges, ``mqttring_<name>``."""
    node, _, _ = tls_node
    with node.http() as client:
        names = {name for name, _labels in scrape(client)}
    fields = [f.name for f in dataclasses.fields(BrokerMetrics) if f.type in ("int", int)]
    missing = [f for f in fields if f"mqttring_{f.removesuffix('_total')}_total" not in names
               and f"mqttring_{f}" not in names]
    assert "tls_handshake_failures" in fields
    assert not missing, f"BrokerMetrics counters not exported on /metrics: {missing}"
