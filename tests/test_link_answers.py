"""Cluster connections on a bad network: requests fail at once when the connection carrying
their answers breaks (callers retry instead of waiting out their timeouts), and links use
TCP's linear retransmission timeouts.  Real sockets, real RPC servers, two real ``Links``."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import trio

from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.links import STREAM_KIND, Links
from mqttring.cluster.messages import CatchUp, RoutePull
from mqttring.rpc import RpcClient, RpcServer, derive_key
from mqttring.tcp_options import TCP_THIN_LINEAR_TIMEOUTS, leave_bbr, socket_of

KEY = derive_key("s3cret", "mqttring-rpc-v1")


async def _server(nursery: trio.Nursery, node_id: str) -> tuple[RpcServer, str]:
    server = RpcServer(KEY, node_id)
    port = await nursery.start(server.serve, "127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


async def test_a_request_fails_at_once_when_the_connection_carrying_its_answer_breaks(
    nursery: trio.Nursery,
) -> None:
    asked = trio.Event()
    heard_from_b = trio.Event()

    def on_a(node: str, message: Any) -> None:
        if node == "b":
            heard_from_b.set()

    def on_b(node: str, message: Any) -> None:
        if type(message) is CatchUp:
            asked.set()  # and never answered: the answer is "lost"

    a = Links("a", KEY, on_a)
    b = Links("b", KEY, on_b)
    server_a, address_a = await _server(nursery, "a")
    server_b, address_b = await _server(nursery, "b")
    server_a.register_stream(STREAM_KIND, a.serve_stream)
    server_b.register_stream(STREAM_KIND, b.serve_stream)
    await nursery.start(a.run)
    await nursery.start(b.run)
    a.update_peers({"b": address_b})
    b.update_peers({"a": address_a})
    b.send_control("a", RoutePull())  # opens b's link to a, which carries b's answers
    with trio.fail_after(10):
        await heard_from_b.wait()

    outcome: list[BaseException | None] = []

    async def ask() -> None:
        try:
            await a.request("b", CatchUp(0, 1, "retained", b""), timeout=60.0)
            outcome.append(None)
        except PeerUnavailable as exc:
            outcome.append(exc)

    # Far below the request's own 60 s timeout: the break itself fails the request.
    with trio.fail_after(10):
        async with trio.open_nursery() as asking:
            asking.start_soon(ask)
            await asked.wait()
            b.clear()  # b's connection to a ends (a reset), with whatever answers it carried
    assert isinstance(outcome[0], PeerUnavailable)


async def test_a_bbr_connection_is_switched_to_a_congestion_control_with_thin_streams(
    nursery: trio.Nursery,
) -> None:
    """Linux applies thin-stream linear timeouts only out of initial slow start, which BBR
    never leaves; ``leave_bbr`` gives such a connection CUBIC (or Reno) instead, and leaves
    any other congestion control as the operator chose it."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, lambda stream: trio.sleep_forever(), listeners)
    port = listeners[0].socket.getsockname()[1]
    stream = await trio.open_tcp_stream("127.0.0.1", port)

    def congestion() -> bytes:
        return stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")

    try:
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"bbr")
    except OSError:  # no BBR in this kernel: whatever it has must stay
        before = congestion()
        assert not leave_bbr(stream)
        assert congestion() == before
    else:
        assert leave_bbr(stream)
        assert congestion() in (b"cubic", b"reno")
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"reno")
    assert not leave_bbr(stream)
    assert congestion() == b"reno"
    await stream.aclose()


async def test_a_cluster_connection_leaves_bbr_and_retries_at_linear_timeouts(
    nursery: trio.Nursery,
) -> None:
    """Every connection a node opens to a peer (its data link, an RPC) is a thin stream
    from its first byte: TCP_THIN_LINEAR_TIMEOUTS set, and out of BBR, which would keep
    Linux from applying them.  Waiting for a first retransmission before switching (the
    code of c37f073) left the first loss episode to double its timeout, and the fault
    suite's longest stalls under loss with it."""
    _server_b, address = await _server(nursery, "b")
    client = await RpcClient.connect(address, KEY, "a")
    tcp = socket_of(client.stream)
    assert tcp is not None
    default = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip().encode()
    congestion = tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0")
    if default == b"bbr":
        assert congestion in (b"cubic", b"reno")
    else:  # the operator's choice stands
        assert congestion == default
    assert tcp.getsockopt(socket.IPPROTO_TCP, TCP_THIN_LINEAR_TIMEOUTS) == 1
    await client.aclose()
