"""A member's heartbeats (``mqttring.raft.heartbeats``): real RPC servers on loopback stand
in for the other members, answering as leader or not as each test says.

What matters for fencing: the connection to a member is open before that member becomes
leader, so a leader change costs no new TCP connection (whose lost SYNs cost 1 s and 2 s
more under loss), and a member that does not answer holds up no proof from another."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import trio

from mqttring.raft.heartbeats import Heartbeats
from mqttring.raft.view import ClusterView, Member, MemberState
from mqttring.rpc import Peer, RpcServer, derive_key

KEY = derive_key("s3cret", "mqttring-rpc-v1")
INTERVAL = 0.05


class FakeMember:
    """An RPC server answering ``heartbeat`` the way a member would, leader or not."""

    def __init__(self, node_id: str) -> None:
        self.server = RpcServer(KEY, node_id)
        self.server.register("heartbeat", self.heartbeat)
        self.leader = False
        self.hang = False
        self.heard = 0
        self.peers: set[str] = set()
        self.address = ""

    async def heartbeat(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        self.heard += 1
        self.peers.add(peer.address)  # the connection's remote end
        if self.hang:
            await trio.sleep_forever()
        return {"epoch": 1, "leader": self.leader, "member_up": True}

    async def start(self, nursery: trio.Nursery) -> None:
        port = await nursery.start(self.server.serve, "127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"


def view_of(members: dict[str, str]) -> ClusterView:
    return ClusterView(1, None, 16, 2, MappingProxyType({
        node: Member(node, None, address, "", MemberState.UP, 1)
        for node, address in members.items()}))


async def test_a_leader_change_finds_its_connection_open(nursery: trio.Nursery) -> None:
    b, c = FakeMember("b"), FakeMember("c")
    await b.start(nursery)
    await c.start(nursery)
    b.leader = True
    proofs: list[float] = []
    view = view_of({"a": "127.0.0.1:1", "b": b.address, "c": c.address})
    beats = Heartbeats("a", KEY, None, INTERVAL, lambda: view, lambda: 1, proofs.append)
    nursery.start_soon(beats.run)
    with trio.fail_after(5):
        while c.heard < 3 or not proofs:
            await trio.sleep(INTERVAL)
    # c, not leader, is heartbeated too: the connection to it is open already.
    assert len(c.peers) == 1
    b.leader, c.leader = False, True
    changed = trio.current_time()
    with trio.fail_after(5):
        while not proofs or proofs[-1] < changed:
            await trio.sleep(INTERVAL / 5)
    assert trio.current_time() - changed < 3 * INTERVAL + 0.5
    assert len(c.peers) == 1 and len(b.peers) == 1  # no connection opened anew


async def test_a_member_that_never_answers_holds_up_no_proof(nursery: trio.Nursery) -> None:
    b, c = FakeMember("b"), FakeMember("c")
    await b.start(nursery)
    await c.start(nursery)
    b.hang, c.leader = True, True
    proofs: list[float] = []
    view = view_of({"a": "127.0.0.1:1", "b": b.address, "c": c.address})
    beats = Heartbeats("a", KEY, None, INTERVAL, lambda: view, lambda: 1, proofs.append)
    nursery.start_soon(beats.run)
    with trio.fail_after(5):
        while len(proofs) < 10:
            await trio.sleep(INTERVAL)
    assert b.heard >= 1


async def test_heartbeats_follow_the_membership(nursery: trio.Nursery) -> None:
    """A member that leaves the view is no longer heartbeated; one that joins is."""
    b, c = FakeMember("b"), FakeMember("c")
    await b.start(nursery)
    await c.start(nursery)
    view = view_of({"a": "127.0.0.1:1", "b": b.address})
    beats = Heartbeats("a", KEY, None, INTERVAL, lambda: view, lambda: 1, lambda at: None)
    nursery.start_soon(beats.run)
    with trio.fail_after(5):
        while b.heard < 2:
            await trio.sleep(INTERVAL)
    assert c.heard == 0
    view = view_of({"a": "127.0.0.1:1", "c": c.address})
    with trio.fail_after(5):
        while c.heard < 2:
            await trio.sleep(INTERVAL)
    heard = b.heard
    await trio.sleep(5 * INTERVAL)  # what b would have got, had it still been heartbeated
    assert b.heard <= heard + 1  # one heartbeat may have been on its way


async def test_a_peer_that_sends_garbage_ends_only_its_own_connection(
    nursery: trio.Nursery,
) -> None:
    """Bad input from a peer is that connection's end, never the heartbeats' (nor the
    node's): the heartbeats to the other members go on."""
    accepted = 0

    async def garbage(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        await stream.send_all(b"\x00\x00\x00\x05not msgpack at all")
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, garbage, listeners)
    bad = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    c = FakeMember("c")
    await c.start(nursery)
    c.leader = True
    proofs: list[float] = []
    view = view_of({"a": "127.0.0.1:1", "b": bad, "c": c.address})
    beats = Heartbeats("a", KEY, None, INTERVAL, lambda: view, lambda: 1, proofs.append)
    nursery.start_soon(beats.run)
    with trio.fail_after(5):
        while accepted < 3 or len(proofs) < 3:
            await trio.sleep(INTERVAL)
