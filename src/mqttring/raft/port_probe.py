"""What listens at an address that did not answer like a node's cluster address.

``mqttring status`` (and ``leave``, ``pin``) talk to a node's cluster address (``--cluster``).
Pointed at another port of the node, they got no cluster handshake and said, after their
whole ``--timeout``, "no answer in time (is a Raft majority of the cluster reachable?)":
true of no such case, and no hint that the port was wrong.  A node's other listeners do
answer something when spoken to in their own protocol, so ``identify`` asks, each on its own
connection and at once:

* MQTT: a CONNECT (3.1.1, clean session, a random client id that collides with no client);
  a broker answers CONNACK (whatever its code: refusing an anonymous client still is one),
  and the probe then sends DISCONNECT;
* HTTP: ``GET /``; the node's HTTP API and its WebSocket listeners answer ``HTTP/1.1 ...``;
* TLS (only for a caller without cluster TLS): a TLS handshake that verifies nothing; it
  completes with an ``mqtts``/``wss`` listener, and with a cluster address that runs mutual
  TLS (whose client certificate is checked after the client's side of the handshake).

Each probe is bounded by ``PROBE_TIMEOUT``; what answers none of them (pysyncobj's Raft
port, say) is reported as before.  Nothing here is ever sent to an address that completed
the cluster handshake.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Awaitable, Callable

import trio

from mqttring.config import parse_hostport

#: Seconds each probe waits for its answer.
PROBE_TIMEOUT = 2.0

#: The listener kinds ``identify`` tells apart, in words for "HOST:PORT answered like ...".
MQTT = "an MQTT broker (a CONNACK to a CONNECT)"
HTTP = "an HTTP server (a node's --http API or its --ws listener)"
TLS = ("a TLS server (a node's --mqtts or --wss listener, or a cluster address with "
       "mutual TLS: give --cluster-cafile, --cluster-certfile and --cluster-keyfile)")


def _mqtt_connect() -> bytes:
    """A minimal MQTT 3.1.1 CONNECT: clean session, keep-alive 10 s, a unique client id."""
    client_id = f"mqttring-probe-{os.urandom(6).hex()}".encode()
    variable = b"\x00\x04MQTT\x04\x02\x00\x0a"
    payload = len(client_id).to_bytes(2, "big") + client_id
    body = variable + payload
    return bytes([0x10, len(body)]) + body


async def _answer(address: str, request: bytes) -> bytes:
    """The first bytes ``address`` sends back to ``request`` (b"": none, closed, refused)."""
    host, port = parse_hostport(address)
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        return b""
    async with stream:
        try:
            await stream.send_all(request)
            answer = await stream.receive_some(64)
            if answer[:1] == b"\x20":  # a CONNACK: leave as a client does
                await stream.send_all(b"\xe0\x00")
            return bytes(answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return b""


async def _is_mqtt(address: str) -> bool:
    return (await _answer(address, _mqtt_connect()))[:1] == b"\x20"


async def _is_http(address: str) -> bool:
    request = b"GET / HTTP/1.1\r\nHost: mqttring-probe\r\nConnection: close\r\n\r\n"
    return (await _answer(address, request)).startswith(b"HTTP/")


async def _is_tls(address: str) -> bool:
    host, port = parse_hostport(address)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only "does it speak TLS?"; nothing is trusted
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError:
        return False
    tls = trio.SSLStream(stream, context, server_hostname=host)
    try:
        await tls.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        return False
    finally:
        await trio.aclose_forcefully(tls)
    return True


async def identify(address: str, *, tls: bool = True) -> str | None:
    """What answers at ``address`` (``MQTT``, ``HTTP`` or ``TLS``), or None: none of them
    within ``PROBE_TIMEOUT``.  ``tls``: probe for TLS too (a caller that used cluster TLS
    itself knows the address speaks TLS and learns nothing from it)."""
    found: list[str] = []
    probes: list[tuple[str, Callable[[str], Awaitable[bool]]]] = [(MQTT, _is_mqtt),
                                                                   (HTTP, _is_http)]
    if tls:
        probes.append((TLS, _is_tls))

    async def run(what: str, probe: Callable[[str], Awaitable[bool]],
                  done: trio.CancelScope) -> None:
        if await probe(address):
            found.append(what)
            done.cancel()  # the first answer is the answer

    with trio.move_on_after(PROBE_TIMEOUT):
        async with trio.open_nursery() as nursery:
            for what, probe in probes:
                nursery.start_soon(run, what, probe, nursery.cancel_scope)
    return found[0] if found else None


__all__ = ["HTTP", "MQTT", "PROBE_TIMEOUT", "TLS", "identify"]
