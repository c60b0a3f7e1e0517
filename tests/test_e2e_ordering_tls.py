"""``mqtts`` connections keep the arrival order across connections that plain TCP keeps
(``tests/test_e2e_ordering.py``): a SUBSCRIBE from B followed at once by A's PUBLISH to
that topic reaches B every time, with both connections idle before.

What is not promised (``docs/design.md``, ``broker/scheduling.py``): trio's TLS stream
takes bytes its socket already holds without waiting for epoll, so a TLS connection that is
busy reading may overtake an idle one whose bytes came first.  Tried with the publisher
sending 40 KB of other messages just before each round: still 60 of 60 here.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mqtt_client import RawClient
from test_e2e_ordering import order_rounds
from test_e2e_tls import HOST, Pki, client_context, pki, tls_broker  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(90)


def test_a_subscribe_over_mqtts_is_handled_before_a_later_publish_of_another_client(
        tls_broker: Callable[..., object], pki: Pki, uid: Callable[[str], str]) -> None:  # noqa: F811
    port = tls_broker().mqtts  # type: ignore[attr-defined]
    context = client_context(pki.ca)

    def tls_client() -> RawClient:
        client = RawClient(HOST, port)
        client.sock = context.wrap_socket(client.sock, server_hostname=HOST)
        return client

    pub, sub = tls_client(), tls_client()
    try:
        order_rounds(pub, sub, uid, "tls-order")
    finally:
        pub.close()
        sub.close()
