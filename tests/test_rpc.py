"""The cluster RPC: framing, HMAC handshake both ways, dispatch and the stream extension."""

from __future__ import annotations

import logging

import pytest
import trio

from mqttring.rpc import (
    HANDSHAKE_MAX_FRAME,
    AuthError,
    FramedStream,
    Peer,
    RpcClient,
    RpcError,
    RpcServer,
    call_once,
    derive_key,
)

KEY = derive_key("s3cret", "mqttring-rpc-v1")


async def start_server(nursery: trio.Nursery) -> tuple[RpcServer, str]:
    server = RpcServer(KEY, "srv")

    async def echo(body: dict, peer: Peer) -> dict:
        return {"echo": body, "from": peer.node_id}

    async def fail(body: dict, peer: Peer) -> dict:
        raise RpcError("not today")

    async def upper(fs: FramedStream, peer: Peer, body: dict) -> None:
        while True:
            message = await fs.receive()
            await fs.send({"up": message["s"].upper()})

    server.register("echo", echo)
    server.register("fail", fail)
    server.register_stream("data.upper", upper)
    port = await nursery.start(server.serve, "127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


async def test_request_response_and_errors(nursery: trio.Nursery) -> None:
    _, address = await start_server(nursery)
    assert await call_once(address, KEY, "cli", "echo", {"a": b"\x00", "n": [1, 2]}) == {
        "echo": {"a": b"\x00", "n": [1, 2]}, "from": "cli"}
    client = await RpcClient.connect(address, KEY, "cli")
    assert client.peer == "srv"
    with pytest.raises(RpcError, match="not today"):
        await client.call("fail")
    with pytest.raises(RpcError, match="unknown kind"):
        await client.call("nope")
    assert (await client.call("echo", {"x": 1}))["echo"] == {"x": 1}
    await client.aclose()


async def test_stream_kind_takes_over_connection(nursery: trio.Nursery) -> None:
    _, address = await start_server(nursery)
    client = await RpcClient.connect(address, KEY, "cli")
    fs = await client.open_stream("data.upper")
    for word in ("a", "bc"):
        await fs.send({"s": word})
        assert (await fs.receive()) == {"up": word.upper()}
    await fs.aclose()


async def test_wrong_secret_is_refused_and_logged(nursery: trio.Nursery, caplog) -> None:
    server, address = await start_server(nursery)
    caplog.set_level(logging.WARNING)
    with pytest.raises(AuthError):
        await call_once(address, derive_key("wrong", "mqttring-rpc-v1"), "intruder", "echo")
    await trio.sleep(0.05)
    assert server.refused == 1
    assert any("refused cluster connection" in r.message for r in caplog.records)


async def test_client_refuses_server_without_secret(nursery: trio.Nursery) -> None:
    impostor = RpcServer(derive_key("other", "mqttring-rpc-v1"), "fake")
    port = await nursery.start(impostor.serve, "127.0.0.1:0")
    with pytest.raises(AuthError):
        await call_once(f"127.0.0.1:{port}", KEY, "cli", "echo")


async def test_oversized_frame_closes_connection(nursery: trio.Nursery) -> None:
    _, address = await start_server(nursery)
    client = await RpcClient.connect(address, KEY, "cli")
    await client._fs.stream.send_all(b"\xff\xff\xff\xff")
    with pytest.raises(EOFError):
        await client._fs.receive()


async def test_a_peer_that_has_not_proved_the_secret_may_not_announce_a_large_frame(
        nursery: trio.Nursery) -> None:
    """Before the handshake, a frame may be no larger than ``HANDSHAKE_MAX_FRAME``: a
    length prefix of 15 MiB is refused at once, not buffered (each unauthenticated
    connection could make the node hold 16 MiB until the handshake timed out)."""
    server, address = await start_server(nursery)
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    fs = FramedStream(stream)
    assert (await fs.receive())["t"] == "challenge"
    await stream.send_all((15 * 1024 * 1024).to_bytes(4, "big") + b"x" * 1000)
    with trio.fail_after(2):
        assert await stream.receive_some(1) == b""  # closed without waiting for the rest
    assert server.refused == 1
    assert HANDSHAKE_MAX_FRAME < 1024 * 1024
    await stream.aclose()


async def test_a_peer_that_never_answers_the_challenge_is_refused_with_a_reason(
        nursery: trio.Nursery, caplog, monkeypatch) -> None:
    """The refusal line said nothing after its colon (``TooSlowError`` has no text)."""
    import mqttring.rpc as rpc

    monkeypatch.setattr(rpc, "HANDSHAKE_TIMEOUT", 0.2)
    server, address = await start_server(nursery)
    caplog.set_level(logging.WARNING)
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    with trio.fail_after(5):
        while server.refused == 0:
            await trio.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "refused cluster" in r.getMessage()]
    assert lines and lines[0].endswith("no handshake within 0.2 s"), lines
    await stream.aclose()
