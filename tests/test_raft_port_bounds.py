"""The Raft port holds a bounded amount of an unfinished frame from anyone.

pysyncobj reads a frame whose 4-byte header may announce 2 GiB and keeps every byte until
the frame is complete, before it can tell that the sender does not know the cluster's key.
A node closes such a connection once it holds ``RAFT_MAX_BUFFERED`` bytes (found by the
security probe of 2026-11-28: 200 MB sent to one node's Raft port stayed in its memory).
A real node process on loopback; the cluster keeps working afterwards.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import psutil
import pytest

from cluster_support import NodeCluster
from mqttring.raft.replicated import (
    RAFT_IDENTIFY_TIMEOUT,
    RAFT_MAX_BUFFERED,
    RAFT_MAX_UNIDENTIFIED,
)

pytestmark = pytest.mark.timeout(120)


def test_an_endless_frame_on_the_raft_port_is_cut_off(tmp_path: Path) -> None:
    cluster = NodeCluster(tmp_path / "cluster")
    try:
        cluster.form_sync("a")
        cluster.settle(("a",))
        proc = cluster.procs["a"]
        assert proc.popen is not None
        rss_before = psutil.Process(proc.popen.pid).memory_info().rss
        host, port = proc.raft.rsplit(":", 1)
        chunk = b"\0" * 2**20
        sent = 0
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(struct.pack("i", 2**31 - 1))
            with pytest.raises(OSError):  # reset or broken pipe once the node gives up
                while sent < 4 * RAFT_MAX_BUFFERED:
                    sock.sendall(chunk)
                    sent += len(chunk)
        assert sent <= RAFT_MAX_BUFFERED + 16 * 2**20, sent  # plus what the kernels buffer
        grown = psutil.Process(proc.popen.pid).memory_info().rss - rss_before
        assert grown < 2 * RAFT_MAX_BUFFERED, f"the node grew by {grown / 2**20:.0f} MiB"
        cluster.settle(("a",))  # still the leader of its one-node cluster, still serving
        assert cluster.status_sync("a")["leader"] == "a"
    finally:
        cluster.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)  # (with a timeout set, recv waits for bytes first)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_silent_connections_to_the_raft_port_are_bounded_in_number_and_time(
        tmp_path: Path) -> None:
    """Connections that never say which member they are: beyond ``RAFT_MAX_UNIDENTIFIED``
    the oldest are closed at once, and every one within ``RAFT_IDENTIFY_TIMEOUT`` (pysyncobj
    kept them for ever: anyone reaching the port could take every descriptor)."""
    cluster = NodeCluster(tmp_path / "cluster")
    held: list[socket.socket] = []
    try:
        cluster.form_sync("a")
        cluster.settle(("a",))
        host, port = cluster.procs["a"].raft.rsplit(":", 1)
        extra = 20
        for _ in range(RAFT_MAX_UNIDENTIFIED + extra):
            # Not all at once: pysyncobj listens with a backlog of 5, and connections that
            # overflow it are accepted later, in no particular order.
            held.append(socket.create_connection((host, int(port)), timeout=10))
            time.sleep(0.01)
        deadline = time.monotonic() + RAFT_IDENTIFY_TIMEOUT - 1
        while sum(map(_closed_by_peer, held)) < extra:  # those past the bound, at once
            assert time.monotonic() < deadline, "the connections past the bound stayed open"
            time.sleep(0.05)
        closed = [i for i, sock in enumerate(held) if _closed_by_peer(sock)]
        assert len(closed) == extra, closed  # those within the bound are kept meanwhile
        assert closed[0] < extra  # (the oldest go)
        deadline = time.monotonic() + RAFT_IDENTIFY_TIMEOUT + 10
        while not all(map(_closed_by_peer, held)):
            assert time.monotonic() < deadline, "silent connections were never closed"
            time.sleep(0.1)
        cluster.settle(("a",))
        assert cluster.status_sync("a")["leader"] == "a"
        assert cluster.grep("a", "did not identify as a member")
    finally:
        for sock in held:
            sock.close()
        cluster.close()
