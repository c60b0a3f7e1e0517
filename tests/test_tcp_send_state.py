"""``tcp_options.send_state`` reads the kernel's word on a real loopback connection: what
the stall guard of the links (``replay.StallJudge``) decides on."""

from __future__ import annotations

import trio
import trio.testing

from mqttring.tcp_options import send_state


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    await listeners[0].aclose()
    return client, server


async def test_bytes_the_peer_has_not_taken_are_queued_then_not() -> None:
    client, server = await _pair()
    async with client, server:
        state = send_state(client)
        assert state is not None
        assert state.queued == 0 and not state.retransmitting
        # The peer reads nothing: its receive buffer fills, the rest stays in ours.
        chunk = b"x" * 65536
        with trio.move_on_after(5):
            while True:
                with trio.move_on_after(0.2) as blocked:
                    await client.send_all(chunk)
                if blocked.cancelled_caught:
                    break
        queued = send_state(client)
        assert queued is not None and queued.queued > 0
        # Once the peer reads it all, the peer's TCP has acknowledged every byte.
        with trio.fail_after(10):
            while True:
                with trio.move_on_after(0.05):  # the last ACK may still be on its way
                    await server.receive_some(1 << 20)
                now = send_state(client)
                assert now is not None
                if now.queued == 0:
                    break


async def test_a_stream_without_a_tcp_socket_has_no_state() -> None:
    left, _ = trio.testing.memory_stream_pair()
    assert send_state(left) is None
