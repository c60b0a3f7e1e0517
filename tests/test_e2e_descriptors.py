"""Out of file descriptors: the node keeps serving its clients and says so once.

A node process under a low ``RLIMIT_NOFILE``; more clients than descriptors connect.  Its
accept loop retries every 0.1 s while none is free; the log has one line when accepting
starts to fail and one when it works again (it had one per retry, ten a second for as long
as the shortage lasted), and the clients it had keep being served.
"""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Callable

import pytest

from conftest import HOST, NodeProcess
from mqtt_client import CONNACK, PINGREQ_BYTES, PINGRESP, RawClient, connect

pytestmark = pytest.mark.timeout(60)

NOFILE = 96


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def test_running_out_of_descriptors_is_logged_once_and_served_through(
        node_factory: Callable[..., NodeProcess]) -> None:
    node = node_factory()
    node.preexec = _low_nofile
    handle = node.start()
    first = RawClient(HOST, handle.port)
    first.send(connect("first"))
    first.expect(CONNACK)
    held: list[socket.socket] = []
    try:
        # More connections than the node has descriptors, all at once: the listen backlog
        # holds what it has not accepted yet, so how fast it accepts does not matter (a
        # loop that stopped at the first log line raced a slow runner's accepts).
        for _ in range(NOFILE + 32):
            held.append(socket.create_connection((HOST, handle.port), timeout=5))
        deadline = time.monotonic() + 20
        while "accept failed" not in node.log_tail(400):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.05)
        time.sleep(1.0)  # the shortage lasts: about ten retries
        first.send(PINGREQ_BYTES)  # a client it had is still served meanwhile
        first.expect(PINGRESP)
        for sock in held:
            sock.close()
        held.clear()
        deadline = time.monotonic() + 20
        while "accepting connections again" not in node.log_tail(400):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.05)
        late = RawClient(HOST, handle.port)
        late.send(connect("late"))
        late.expect(CONNACK)
        late.close()
        log = node.log_tail(400)
        assert log.count("accept failed") == 1, log
    finally:
        for sock in held:
            sock.close()
        first.close()
