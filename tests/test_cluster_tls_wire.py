"""With cluster TLS, what nodes send each other cannot be read on the wire.

A real two-node cluster carries publishes with a distinctive marker from a publisher on one
node to a subscriber on the other (topics owned by either node, some retained, so the
marker crosses the links both ways and through replication), while a raw ``AF_PACKET``
socket on ``lo`` records every TCP segment to or from the nodes' cluster and Raft ports.
With cluster TLS the marker must appear in none of them, reassembled or not.  The same run
without cluster TLS is the control: there the marker must be found, which proves that the
capture sees the links' bytes at all (and that this test can fail).

MQTT client connections carry the marker too, in the clear; their ports are not the
cluster's, so they are left out by the port filter.  The capture needs root (CAP_NET_RAW),
as the fault suite does; without it the test fails and says so, it does not skip.
"""

from __future__ import annotations

import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster_support import Clients, NodeCluster
from mqttring.certs import make_ca, make_node_cert
from mqttring.cluster_tls import ClusterTls

pytestmark = pytest.mark.timeout(120)

NODES = ("a", "b")
ETH_P_ALL = 0x0003
ETH_P_IP = b"\x08\x00"
SOL_PACKET = 263
PACKET_STATISTICS = 6
MESSAGES = 40


@dataclass
class LoopbackCapture:
    """Every TCP segment on ``lo`` whose source or destination port is in ``ports``,
    recorded by a thread until ``close()``."""

    ports: set[int]
    segments: list[tuple[tuple[int, int], int, bytes]] = field(default_factory=list)
    drops: int = 0

    def __post_init__(self) -> None:
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW,
                                      socket.htons(ETH_P_ALL))
        except PermissionError as exc:
            pytest.fail(f"cannot open a raw AF_PACKET socket to capture loopback traffic "
                        f"({exc}): this test must run as root (or with CAP_NET_RAW), as the "
                        f"fault suite does", pytrace=False)
        try:
            # Generous, and forced past rmem_max (root): a busy runner must not make the
            # kernel drop the frames this test is looking for.
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
            self.sock.bind(("lo", 0))
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lo-capture", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                frame = self.sock.recv(1 << 18)
            except TimeoutError:
                continue
            self._take(frame)
        self.sock.setblocking(False)  # what arrived before the stop is read too
        while True:
            try:
                self._take(self.sock.recv(1 << 18))
            except BlockingIOError:
                return

    def _take(self, frame: bytes) -> None:
        # lo frames carry an Ethernet header (zero addresses): type at 12, IPv4 at 14.
        if len(frame) < 14 + 20 + 20 or frame[12:14] != ETH_P_IP or frame[14 + 9] != 6:
            return
        ip = frame[14:]
        header = (ip[0] & 0x0F) * 4
        (total,) = struct.unpack_from("!H", ip, 2)
        tcp = ip[header:total]
        sport, dport, seq = struct.unpack_from("!HHI", tcp)
        if sport in self.ports or dport in self.ports:
            payload = tcp[(tcp[12] >> 4) * 4:]
            if payload:
                self.segments.append(((sport, dport), seq, bytes(payload)))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the capture thread did not stop"
        _packets, drops = struct.unpack("II", self.sock.getsockopt(SOL_PACKET,
                                                                  PACKET_STATISTICS, 8))
        self.drops = drops
        self.sock.close()

    def streams(self) -> dict[tuple[int, int], bytes]:
        """Each direction of each connection, reassembled by sequence number (lo shows a
        frame twice, going out and coming in; the copies coincide)."""
        by_flow: dict[tuple[int, int], dict[int, bytes]] = {}
        for flow, seq, payload in self.segments:
            pieces = by_flow.setdefault(flow, {})
            if len(payload) > len(pieces.get(seq, b"")):
                pieces[seq] = payload
        out = {}
        for flow, pieces in by_flow.items():
            first = next(iter(pieces))  # the first seen; lo does not reorder
            data, end = bytearray(), 0
            for seq in sorted(pieces, key=lambda s: (s - first) % 2**32):
                offset = (seq - first) % 2**32
                piece = pieces[seq]
                if offset + len(piece) > end:
                    data += piece[max(end - offset, 0):]
                    end = offset + len(piece)
            out[flow] = bytes(data)
        return out

    def found(self, marker: bytes) -> list[str]:
        """Where ``marker`` shows: in a segment or in a reassembled stream."""
        where = [f"segment {flow}" for flow, _, payload in self.segments if marker in payload]
        where += [f"stream {flow}" for flow, data in self.streams().items() if marker in data]
        return where

    @property
    def payload_bytes(self) -> int:
        return sum(len(p) for _, _, p in self.segments)


def carry_marked_publishes(tmp_path: Path, clients: Clients, tls: bool,
                           marker: bytes) -> LoopbackCapture:
    """A two-node cluster (with or without cluster TLS) carries ``MESSAGES`` publishes
    holding ``marker`` from a publisher on a to a subscriber on b, under capture."""
    root = tmp_path / ("tls" if tls else "plain")
    root.mkdir()
    cluster = NodeCluster(root)
    if tls:
        pki = root / "pki"
        make_ca(pki)
        for name in (*NODES, "admin"):
            make_node_cert(pki, name)
        for node in NODES:
            cluster.node_toml[node] = (f'cluster_cafile = "{pki / "ca.pem"}"\n'
                                        f'cluster_certfile = "{pki / node}.pem"\n'
                                        f'cluster_keyfile = "{pki / node}.key"\n')
        cluster.tls = ClusterTls.from_files(pki / "ca.pem", pki / "admin.pem",
                                            pki / "admin.key").client
    try:
        cluster.form_sync(*NODES)
        view = cluster.settle(NODES)
        ports = {int(address.rsplit(":", 1)[1]) for proc in cluster.procs.values()
                 for address in (proc.cluster, proc.raft)}
        # One topic owned by each node: a's publishes to b's topic cross to b as owner,
        # those to its own cross to b for delivery; retained ones are replicated.
        topics = [view.topic_owned_by(node, f"wire/{node}") for node in NODES]
        sub = clients.connected(cluster.port("b"))
        assert sub.subscribe([("wire/#", 1)]) == [1]
        pub = clients.connected(cluster.port("a"))
        capture = LoopbackCapture(ports)
        try:
            for i in range(MESSAGES):
                pub.publish(topics[i % len(topics)], marker + b"-%03d" % i, qos=1,
                            retain=i % 4 == 0)
            got = sub.collect(MESSAGES)
        finally:
            capture.close()
        assert sorted(d.payload for d in got) == sorted(marker + b"-%03d" % i
                                                        for i in range(MESSAGES))
        return capture
    finally:
        for client in clients.made:
            client.close()
        cluster.close()


def test_cluster_links_are_not_readable_on_the_wire(tmp_path: Path, clients: Clients) -> None:
    marker = b"WIRE-MARKER-" + uuid.uuid4().hex.encode()
    plain = carry_marked_publishes(tmp_path, clients, tls=False, marker=marker)
    assert plain.drops == 0, f"the kernel dropped {plain.drops} captured frames"
    # The control: in the clear, the links show the marker (so the capture works).
    assert plain.found(marker), (
        f"the marker was not seen on the cluster ports without TLS: the capture is broken "
        f"({len(plain.segments)} segments, {plain.payload_bytes} bytes)")
    tls = carry_marked_publishes(tmp_path, clients, tls=True, marker=marker)
    assert tls.drops == 0, f"the kernel dropped {tls.drops} captured frames"
    # The links did carry the messages, over the captured ports: at least their payloads'
    # worth of bytes went by (counted once per copy lo shows).
    assert tls.payload_bytes >= MESSAGES * len(marker), (
        f"only {tls.payload_bytes} bytes on the cluster ports with TLS: was it captured?")
    assert tls.found(marker) == [], "the marker is readable on a TLS cluster link"
