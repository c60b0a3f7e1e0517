"""Two CONNECTs of one client id racing at a node that is not the session's home.

A black-box soak probe found that two CONNECTs with the same client id arriving together
at an edge (each followed at once by a SUBSCRIBE, both connections then dropped without
DISCONNECT) left a "ghost" at the home: the session stayed attached to the relay of a
connection that no longer existed, so it never expired, kept its subscription, filled its
inflight window and queued past ``max_queued`` (v5 11/12 and 3.1.1 8/12 attempts).  The
home let the loser of the takeover attach the session after the winner had taken over
(``ClusterSessions.on_sopen``: the id's lock covered the registration, not the bind and
the attachment that followed it).

Here: a real 3-node cluster (``python -m mqttring.node`` processes, raw MQTT sockets),
rounds of two concurrent CONNECTs of one id homed at ``a``, at ``b``; then every session
must expire at ``a`` on time (its ``/metrics`` ``sessions`` gauge back to 0) and what was
published to the subscribed topic meanwhile must not stay queued there.  And, without
processes, the home's decisions in the interleavings a run hits only sometimes: the
takeover between the loser's registration and its attachment, a refusal after the
registration, and an edge's "abandoned" close that overtakes its ``sopen``.
"""

from __future__ import annotations

import json
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from cluster_support import HOST, NodeCluster, unique
from decision_support import NUM_SHARDS, Metadata, RecordingLinks
from mqtt_client import connect, encode_remaining_length, mqtt_string, packet
from mqttring.broker.core import BrokerCore
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.broker.sessions import SessionUnavailable
from mqttring.cluster.messages import Ack, SessionClose, SessionOpen
from mqttring.cluster.sessions import ClusterSessions
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.config import BrokerConfig
from mqttring.raft.view import ClusterView

NODES = ("a", "b", "c")
HOME, EDGE = "a", "b"
EXPIRY = 2  # seconds: the v5 Session Expiry Interval, and 3.1.1's persistent_session_expiry
ROUNDS = 10  # per protocol version


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    root = Path(tmp_path_factory.mktemp("connect-race"))
    c = NodeCluster(root)
    c.extra_args = ["--http", f"{HOST}:0"]
    c.extra_toml = (f"[limits]\npersistent_session_expiry = {EXPIRY}\n"
                    "max_queued = 20\n")
    try:
        c.form_sync(*NODES)
        c.settle(NODES)
    except BaseException:
        c.close()
        raise
    yield c
    c.close()


# -- raw MQTT: exact control over what is sent when, with nothing waited for in between ----

def connect_packet(client_id: str, v5: bool) -> bytes:
    """CONNECT, clean session / clean start 0, keepalive 0; v5 with Session Expiry
    Interval ``EXPIRY``."""
    header = mqtt_string("MQTT") + bytes([5 if v5 else 4, 0]) + struct.pack("!H", 0)
    if v5:
        props = b"\x11" + struct.pack("!I", EXPIRY)
        header += encode_remaining_length(len(props)) + props
    return packet(0x10, header + mqtt_string(client_id))


def subscribe_packet(packet_id: int, topic_filter: str, qos: int, v5: bool) -> bytes:
    return packet(0x82, struct.pack("!H", packet_id) + (b"\x00" if v5 else b"")
                  + mqtt_string(topic_filter) + bytes([qos]))


def publish_packet(topic: str, payload: bytes, packet_id: int, v5: bool) -> bytes:
    return packet(0x32, mqtt_string(topic) + struct.pack("!H", packet_id)
                  + (b"\x00" if v5 else b"") + payload)


def read_packets(sock: socket.socket, buffer: bytearray) -> list[int]:
    """The packet types complete in ``buffer`` after one read (-1 once the peer closed)."""
    try:
        data = sock.recv(65536)
    except TimeoutError:
        data = None
    except OSError:
        data = b""
    if data == b"":
        return [-1]
    if data:
        buffer += data
    types = []
    while len(buffer) >= 2:
        length, shift, i = 0, 0, 1
        while i < len(buffer):
            length |= (buffer[i] & 0x7F) << shift
            shift += 7
            i += 1
            if not buffer[i - 1] & 0x80:
                break
        else:
            break
        if len(buffer) < i + length:
            break
        types.append(buffer[0] >> 4)
        del buffer[:i + length]
    return types


def settle_connection(sock: socket.socket, deadline: float) -> set[int]:
    """Read until the connection has its SUBACK (9) or was closed (-1), by ``deadline``;
    returns the packet types seen (CONNACK 2, DISCONNECT 14, ...)."""
    seen: set[int] = set()
    buffer = bytearray()
    sock.settimeout(0.2)
    while time.monotonic() < deadline and not seen & {9, -1}:
        seen.update(read_packets(sock, buffer))
    return seen


# -- the home's view of its sessions ------------------------------------------------------

def http_port(cluster: NodeCluster, node: str) -> int:
    return int(json.loads(cluster.procs[node].ready_file.read_text())["http"])


def gauges(cluster: NodeCluster, node: str) -> dict[str, float]:
    url = f"http://{HOST}:{http_port(cluster, node)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_home_empty(cluster: NodeCluster, timeout: float) -> dict[str, float]:
    """Poll the home's gauges until it holds no session and nothing queued or inflight;
    returns the last reading (asserted on by the caller)."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(cluster, HOME)
        if (now["mqttring_sessions"] == 0 and now["mqttring_messages_queued"] == 0
                and now["mqttring_messages_inflight"] == 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def race_round(cluster: NodeCluster, client_id: str, topic_filter: str, v5: bool
               ) -> tuple[set[int], set[int]]:
    """Two connections of ``client_id`` at the edge, each CONNECT followed at once by a
    SUBSCRIBE (no wait for the CONNACK), sent back to back; both closed without DISCONNECT
    once each has its SUBACK or was closed by the broker."""
    port = cluster.port(EDGE)
    socks = [socket.create_connection((HOST, port), timeout=5) for _ in range(2)]
    try:
        for sock in socks:
            sock.sendall(connect_packet(client_id, v5)
                         + subscribe_packet(1, topic_filter, 1, v5))
        deadline = time.monotonic() + 10
        first, second = (settle_connection(sock, deadline) for sock in socks)
        return first, second
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("v5", [True, False], ids=["mqtt5", "mqtt311"])
def test_racing_connects_leave_no_session_that_outlives_its_expiry(
        cluster: NodeCluster, v5: bool) -> None:
    view = cluster.settle(NODES, timeout=30)
    assert wait_home_empty(cluster, 15)["mqttring_sessions"] == 0  # (the other version's)
    prefix = unique("race5" if v5 else "race3")
    topic_filter = f"{prefix}/data/#"
    taken: list[str] = []
    outcomes = []
    for _ in range(ROUNDS):
        client_id = view.client_homed_at(HOME, prefix, avoid=taken)
        taken.append(client_id)
        outcomes.append(race_round(cluster, client_id, topic_filter, v5))
    # At most one of each pair kept its connection: the other saw it closed (v5: after a
    # DISCONNECT 0x8E) before its SUBACK, or never got one.
    for first, second in outcomes:
        assert not (9 in first and -1 not in first and 9 in second and -1 not in second), \
            outcomes
    # Messages for the sessions while they are offline (within their expiry): they queue
    # at the home, bounded, and go with the sessions.
    pub = socket.create_connection((HOST, cluster.port("c")), timeout=5)
    try:
        pub.sendall(_publisher_connect())
        for n in range(30):
            pub.sendall(publish_packet(f"{prefix}/data/{n % 3}", b"x" * 100, n + 1, v5=False))
        deadline = time.monotonic() + 10
        acks, buffer = 0, bytearray()
        pub.settimeout(0.2)
        while acks < 30 and time.monotonic() < deadline:
            types = read_packets(pub, buffer)
            assert -1 not in types, "the publisher was closed"
            acks += types.count(4)
        assert acks == 30
    finally:
        pub.close()
    # Every session expires EXPIRY s after its close (sweeps every 2 s): 12 s is ample.
    left = wait_home_empty(cluster, EXPIRY + 12)
    ghosts = int(left["mqttring_sessions"])
    assert ghosts == 0 and left["mqttring_messages_queued"] == 0 \
        and left["mqttring_messages_inflight"] == 0, (
            f"{ghosts} of {ROUNDS} sessions outlived their {EXPIRY} s expiry at their home "
            f"{HOME} (queued {left['mqttring_messages_queued']:.0f}, inflight "
            f"{left['mqttring_messages_inflight']:.0f}); connections' packets: {outcomes}\n"
            + cluster.logs_of_interest())


def _publisher_connect() -> bytes:
    """A clean 3.1.1 publisher's CONNECT."""
    return connect(unique("race-pub"), keepalive=0)


# -- the home's decisions, without processes ----------------------------------------------

def make_home() -> tuple[BrokerCore, ClusterSessions, RecordingLinks, str]:
    """Node n1 of n1..n3 as a home, on recorded links; a client id it is home to."""
    meta = Metadata("n1", "n2", "n3")
    views: list[ClusterView] = [meta.view()]
    links = RecordingLinks()
    holder: dict[str, ClusterSessions] = {}

    def manager(core: BrokerCore) -> ClusterSessions:
        holder["sessions"] = ClusterSessions(
            core, "n1", links, lambda: views[-1],  # type: ignore[arg-type]
            lambda fn, *args: None, lambda: False, lambda shard: True,
            ViewChanges().wait, patience=2.0)
        return holder["sessions"]

    store = SessionStore(None, NUM_SHARDS, None)  # type: ignore[arg-type]
    core = BrokerCore(
        BrokerConfig(), store, BrokerMetrics(),
        lambda core: LocalRouter(core.sessions, RetainedStore(None, NUM_SHARDS), store,
                                 core.metrics, lambda client_id: None),
        manager)
    view = views[-1]
    client_id = next(f"device-{k}" for k in range(1000)
                     if view.owner(view.shard_for_client(f"device-{k}")) == "n1")
    return core, holder["sessions"], links, client_id


def sopen(client_id: str, token: str, req: int) -> SessionOpen:
    """A 3.1.1 persistent session's CONNECT at edge n2."""
    return SessionOpen(req, client_id, "n2", token, False, None)


def answers(links: RecordingLinks) -> dict[int, bool]:
    return {m.req: m.ok for _, m in links.sent if type(m) is Ack}


async def test_a_takeover_during_an_open_leaves_the_session_with_the_winner() -> None:
    """A's ``sopen`` is registered and binding when B's arrives: B takes over, and the
    session ends up attached to B's relay only, and offline once B closes (before: A
    attached it after the takeover, and it stayed attached to A's dead relay)."""
    core, home, links, client_id = make_home()
    release_a = trio.Event()
    bind = home.bind

    async def bind_slowly_for_a(*args: object, **kwargs: object) -> object:
        if not release_a.is_set():
            await release_a.wait()  # the first bind (A's) waits: a slow store write
        return await bind(*args, **kwargs)  # type: ignore[arg-type]

    home.bind = bind_slowly_for_a  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(home.on_sopen, "n2", sopen(client_id, "n2:x:1", 1))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(home.on_sopen, "n2", sopen(client_id, "n2:x:2", 2))
        await trio.testing.wait_all_tasks_blocked()
        release_a.set()
    assert home.registrations[client_id].token == "n2:x:2"
    proxy = home.relay.proxies[client_id]
    session = core.sessions[client_id]
    assert proxy.token == "n2:x:2" and session.output is proxy.output
    assert core.wakers[client_id] is proxy
    # B's connection closes: the session is offline, its expiry running.
    await home.on_sclose("n2", SessionClose(3, client_id, "n2:x:2", True, 5))
    assert client_id not in home.registrations and client_id not in home.relay.proxies
    assert session.output is None and session.ends_at > 0
    assert answers(links)[3]


async def test_a_refusal_after_the_registration_leaves_nothing_at_the_home() -> None:
    core, home, links, client_id = make_home()

    async def bind_fails(*args: object, **kwargs: object) -> object:
        raise SessionUnavailable("the store is gone")

    home.bind = bind_fails  # type: ignore[method-assign]
    await home.on_sopen("n2", sopen(client_id, "n2:x:1", 1))
    assert answers(links) == {1: False}
    assert client_id not in home.registrations and client_id not in home.relay.proxies
    assert client_id not in core.wakers


async def test_an_abandoned_close_that_overtakes_its_open_refuses_the_open() -> None:
    """The edge gave up on the connection (it closed while its ``sopen`` was out); its
    close reaches the home first (the two run as separate tasks): the ``sopen`` that
    follows must not register the connection nor attach the session to it."""
    core, home, links, client_id = make_home()
    await home.on_sclose("n2", SessionClose(1, client_id, "n2:x:1", False, 5,
                                            abandoned=True))
    await home.on_sopen("n2", sopen(client_id, "n2:x:1", 2))
    assert answers(links) == {1: True, 2: False}
    assert client_id not in home.registrations and client_id not in home.relay.proxies
    session = core.sessions.get(client_id)
    assert session is None or session.output is None
    # Once registered, the same close ends it, and the session's expiry runs.
    await home.on_sopen("n2", sopen(client_id, "n2:x:3", 3))
    await home.on_sclose("n2", SessionClose(4, client_id, "n2:x:3", False, 5,
                                            abandoned=True))
    assert answers(links)[3] and answers(links)[4]
    assert client_id not in home.registrations and client_id not in home.relay.proxies
    assert core.sessions[client_id].output is None and core.sessions[client_id].ends_at > 0
