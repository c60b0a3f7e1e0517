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
from pathlib import Path

import psutil
import pytest

from cluster_support import NodeCluster
from mqttring.raft.replicated import RAFT_MAX_BUFFERED

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
