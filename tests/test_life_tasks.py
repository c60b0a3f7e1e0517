"""What a node's life ends: its cluster tasks (``LifeTasks``) and its links' unsent bytes
(``discard_unsent``), with real trio tasks and real loopback sockets."""

from __future__ import annotations

import logging
import socket

import pytest
import trio

from mqttring.cluster.errors import PeerUnavailable
from mqttring.cluster.life import LifeTasks
from mqttring.tcp_options import discard_unsent


async def test_a_task_spawned_just_before_the_life_ends_never_runs() -> None:
    life = LifeTasks()
    ran: list[str] = []

    async def accept_stale_publish() -> None:
        ran.append("first step")  # e.g. a synchronous send before the first checkpoint
        await trio.sleep(0)
        ran.append("second step")

    async with trio.open_nursery() as nursery:
        life.spawn(nursery, accept_stale_publish)
        assert len(life) == 1
        assert life.end() == 1  # same scheduler batch: the task has not run yet
    assert ran == []
    assert len(life) == 0


async def test_ending_a_life_cancels_its_running_tasks_but_not_the_next_lifes() -> None:
    life = LifeTasks()
    started = trio.Event()
    finished: list[str] = []

    async def waiter(name: str) -> None:
        started.set()
        await trio.sleep_forever()
        finished.append(name)  # pragma: no cover - never reached

    async def short(name: str) -> None:
        await trio.sleep(0)
        finished.append(name)

    async with trio.open_nursery() as nursery:
        life.spawn(nursery, waiter, "old")
        await started.wait()
        assert life.end() == 1
        life.spawn(nursery, short, "new")
    assert finished == ["new"]
    assert len(life) == 0


async def test_a_failing_task_is_logged_and_does_not_take_the_nursery_down(
        caplog: pytest.LogCaptureFixture) -> None:
    life = LifeTasks()

    async def peer_gone() -> None:
        raise PeerUnavailable("n2")

    async def bug() -> None:
        raise KeyError("oops")

    with caplog.at_level(logging.WARNING, logger="mqttring.cluster.life"):
        async with trio.open_nursery() as nursery:
            life.spawn(nursery, peer_gone)
            life.spawn(nursery, bug)
    assert "cluster task peer_gone: n2" in caplog.text
    assert "cluster task bug failed" in caplog.text
    assert len(life) == 0


async def _send_until_full(sock: socket.socket) -> int:
    """Hand the kernel bytes until the send buffer (and the peer's receive buffer) is full."""
    sent = 0
    chunk = b"x" * 65536
    for _ in range(10_000):
        try:
            sent += sock.send(chunk)
        except BlockingIOError:
            await trio.sleep(0.01)  # let loopback move what it can, then try once more
            try:
                sent += sock.send(chunk)
            except BlockingIOError:
                return sent
    raise AssertionError("the send buffer never filled")


async def _read_all(sock: trio.socket.SocketType) -> tuple[int, bool]:
    """Bytes read until end of stream or reset, and whether it ended in a reset."""
    got = 0
    with trio.fail_after(10):
        while True:
            try:
                data = await sock.recv(1 << 20)
            except ConnectionResetError:
                return got, True
            if not data:
                return got, False
            got += len(data)


@pytest.mark.parametrize("discard", [False, True])
async def test_a_reset_drops_what_the_send_buffer_still_holds(discard: bool) -> None:
    """A link abandoned because its peer left the view must not deliver, after a heal, what
    the kernel was still retransmitting; a plain close would (the control case)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    client.connect(listener.getsockname())
    client.setblocking(False)
    server, _ = await listener.accept()
    with listener, server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sent = await _send_until_full(client)  # the peer reads nothing meanwhile
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(client))
        if discard:
            discard_unsent(stream)
        await trio.aclose_forcefully(stream)
        got, reset = await _read_all(server)
    if discard:
        assert reset and got < sent
    else:
        assert (got, reset) == (sent, False)
