"""``Heartbeats``: a member's heartbeats to every other member, each over a connection of its
own that stays open.

A follower proves it is in the majority's view (``service.py``'s module docstring) by a
heartbeat that the leader answers.  Sent to the leader alone, over a connection opened when
the leader changed, that proof leaned on a fresh TCP connection at the worst moment: a
network lossy enough to make Raft elect a new leader is lossy enough to lose the new
connection's SYN, which Linux resends after 1 s, then 2 s more.  In the fault suite's 15%
loss a follower so spent 3 s connecting to the new leader and 2 s more on a heartbeat whose
answer was lost, proved nothing for 4.5 s, and fenced itself: every client of a healthy
node disconnected, and their wills published (docs/faults.md).

So every member heartbeats every other member, in a task per peer, over a connection kept
open between heartbeats and opened before it is needed: when leadership moves, the
connection to the new leader is already there, and its answers prove quorum at once.  A
peer's silence holds up only its own task.  Any answer that says "leader, and you are up"
is a proof, as before; a non-leader's answer proves nothing.  The cost is N - 1 small
requests per member per ``heartbeat_interval`` instead of one, fine for the few voters a
cluster has (at 100 members a leader-only scheme with standby connections would be due).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable

import trio

from mqttring.raft.view import ClusterView
from mqttring.rpc import AuthError, ProtocolError, RpcClient, RpcError

log = logging.getLogger(__name__)

#: Seconds a connection attempt or a heartbeat's answer may take before the connection is
#: dropped and opened again (Linux resends a lost SYN only after 1 s, then 2 s more: a new
#: attempt after this long does better than waiting).
HEARTBEAT_TIMEOUT = 2.0

#: What a peer or the network can do to one heartbeat; each ends that connection only (a
#: peer that sends garbage, ``ProtocolError``, must not take this node's membership down).
FAILURES = (OSError, RpcError, EOFError, AuthError, ProtocolError, trio.TooSlowError,
            trio.BrokenResourceError, trio.ClosedResourceError)


class Heartbeats:
    """Keeps a heartbeat task for every other member of the current view (see the module
    docstring); ``proved(sent)`` is called with the send time of every heartbeat that the
    leader answered with this node up."""

    def __init__(self, node_id: str, key: bytes, tls: ssl.SSLContext | None, interval: float,
                 view: Callable[[], ClusterView], incarnation: Callable[[], int],
                 proved: Callable[[float], None]) -> None:
        self.node_id = node_id
        self.key = key
        self.tls = tls
        self.interval = interval
        self.view = view
        self.incarnation = incarnation
        self.proved = proved

    def peers(self) -> dict[str, str]:
        """Whom to heartbeat: every other member of the view, at its cluster address."""
        return {m.node_id: m.cluster for m in self.view().members.values()
                if m.node_id != self.node_id and m.cluster}

    async def run(self) -> None:
        """Follow the membership: a task per peer, restarted if its address changes."""
        #: Peer -> (the address its task heartbeats, that task's cancel scope).
        tasks: dict[str, tuple[str, trio.CancelScope]] = {}
        async with trio.open_nursery() as nursery:
            while True:
                wanted = self.peers()
                for peer, (address, scope) in list(tasks.items()):
                    if wanted.get(peer) != address:
                        scope.cancel()
                        del tasks[peer]
                for peer, address in wanted.items():
                    if peer not in tasks:
                        scope = trio.CancelScope()
                        tasks[peer] = (address, scope)
                        nursery.start_soon(self._beat, peer, address, scope)
                await trio.sleep(self.interval)

    async def _beat(self, peer: str, address: str, scope: trio.CancelScope) -> None:
        client: RpcClient | None = None
        with scope:
            try:
                while True:
                    try:
                        if client is None:
                            client = await RpcClient.connect(address, self.key, self.node_id,
                                                             HEARTBEAT_TIMEOUT, tls=self.tls)
                        sent = trio.current_time()
                        answer = await client.call("heartbeat",
                                                   {"node_id": self.node_id,
                                                    "incarnation": self.incarnation()},
                                                   timeout=HEARTBEAT_TIMEOUT)
                        if answer.get("leader") and answer.get("member_up"):
                            self.proved(sent)
                    except FAILURES as exc:
                        # (AuthError: the peer refused our certificate, say an expired one;
                        # we go on trying, and the leader declares us down after the grace.)
                        level = logging.WARNING if isinstance(exc, AuthError) else logging.DEBUG
                        log.log(level, "heartbeat to %s failed: %s", peer, exc)
                        if client is not None:
                            # A call cut off mid-way leaves the stream unusable: open anew.
                            await trio.aclose_forcefully(client.stream)
                            client = None
                    await trio.sleep(self.interval)
            finally:
                if client is not None:
                    with trio.CancelScope(shield=True):
                        await trio.aclose_forcefully(client.stream)


__all__ = ["HEARTBEAT_TIMEOUT", "Heartbeats"]
