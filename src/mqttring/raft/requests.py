"""The metadata requests a member serves on the cluster port, and their bodies.

Apart from ``MetadataService`` (``service.py``) because they are what *other* nodes ask of
this one: join and remove (run on the Raft leader, forwarded there by any member), the
heartbeat that feeds the leader's failure detector and a follower's quorum proof, leave,
status, pins and caught-up claims.  Every body is checked against ``RPC_BODIES`` by the RPC
dispatch before a handler runs, so a handler reads its fields without re-checking their
types; what the schema cannot say (an address that must parse, a weight >= 1) is checked
here, and refused with ``BadRequest``.  A step the cluster could not commit is an
``RpcError`` for the asking peer to retry, never a handler traceback.

``MetadataRequests`` is a mixin of ``MetadataService``: it holds no state of its own and
uses the service's (declared below for the type checker).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from mqttring.config import BrokerConfig, ConfigError, parse_hostport
from mqttring.errors import describe_error
from mqttring.logs import WaitLog
from mqttring.raft import state as sm
from mqttring.raft.bridge import CommitError, RaftBridge
from mqttring.raft.liveness import FailureDetector
from mqttring.raft.view import ClusterView, MemberState, view_to_wire
from mqttring.rpc import (
    BadRequest,
    Field,
    Peer,
    ProtocolError,
    RpcError,
    RpcServer,
    Schema,
    call_once,
)

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("mqttring.raft.service")

#: Metadata RPC kinds served on the cluster port (the data plane adds its own).
RPC_KINDS = ("info", "join", "remove", "heartbeat", "status", "leave", "caught_up", "pin",
             "unpin")

_STR = (str,)
#: What a joining member announces (``state.member_info``): checked before the leader
#: commits it, since a member's record is replicated to every node and read everywhere.
_MEMBER: Schema = {"node_id": Field(_STR, required=True),
                   "cluster": Field(_STR, required=True),
                   "raft": Field(_STR, required=True),
                   "mqtt": Field((str, type(None))),
                   "weight": Field((int,))}
#: The body each metadata kind needs, checked by the RPC dispatch before the handler runs:
#: a peer's wrong shape is refused there with a ``BadRequest`` saying what is wrong.
RPC_BODIES: dict[str, Schema] = {
    "join": {"member": Field((dict,), required=True, fields=_MEMBER)},
    "remove": {"node_id": Field(_STR, required=True)},
    "heartbeat": {"node_id": Field(_STR, required=True), "incarnation": Field((int,))},
    "status": {"brief": Field((bool, type(None)))},
    "caught_up": {"shards": Field((list,), items=int)},
    "pin": {"subtree": Field(_STR, required=True), "shard": Field((int, type(None)))},
    "unpin": {"subtree": Field(_STR, required=True)},
}


class MetadataRequests:
    """The ``_rpc_<kind>`` handlers (``RPC_KINDS``) and the ``_leader_<kind>`` steps they
    run on the Raft leader."""

    __slots__ = ()

    config: BrokerConfig
    node_id: str
    client_tls: ssl.SSLContext | None
    rpc: RpcServer
    _rpc_key: bytes
    _raft: RaftBridge
    _view: ClusterView
    _membership_lock: trio.Lock
    _detector: FailureDetector
    _left: trio.Event
    _leaving: bool

    if TYPE_CHECKING:
        @property
        def incarnation(self) -> int: ...

        def in_quorum(self, within: float) -> bool: ...

        def _leader_id(self, members: Any) -> str | None: ...

        def _others_up(self) -> bool: ...

        async def leave(self) -> bool: ...

    async def _leader_call(self, kind: str, body: dict[str, Any],
                           timeout: float = 20.0) -> dict[str, Any]:
        """Run ``kind`` on the Raft leader: here, or forwarded to its cluster address.

        Tries come every 0.1 s; ``WaitLog`` logs the wait, not each try."""
        waiting = WaitLog(log, f"the Raft leader to take {kind}")
        with trio.fail_after(timeout):
            while True:
                if self._raft.is_leader():
                    waiting.done(f"{kind}: this node leads now")
                    return await getattr(self, f"_leader_{kind}")(body)
                leader = self._view.members.get(self._leader_id(self._view.members) or "")
                if leader is not None and leader.node_id != self.node_id:
                    try:
                        answer = await call_once(leader.cluster, self._rpc_key, self.node_id,
                                                 kind, {**body, "forwarded": True}, timeout,
                                                 tls=self.client_tls)
                    except (OSError, EOFError, ProtocolError, trio.TooSlowError) as exc:
                        waiting.failed(f"forwarding {kind} to {leader.node_id} failed: {exc}")
                    else:
                        waiting.done(f"{kind} forwarded to {leader.node_id}")
                        return answer
                await trio.sleep(0.1)

    async def _peer_leader_call(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """``_leader_call`` for a peer's request: a step the cluster could not commit now
        (the leader changed or died mid-way: a worker killed again and again) is the
        peer's refusal to retry, not a handler failure with a traceback."""
        try:
            return await self._leader_call(kind, body)
        except (CommitError, trio.TooSlowError) as exc:
            raise RpcError(f"{kind} not committed: {describe_error(exc)}") from None

    async def _rpc_info(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        if not self._raft.running:
            raise RpcError("raft not started")
        return {"raft_peers": sorted(self._raft.nodes()), "leader": self._view.leader,
                "epoch": self._view.epoch}

    async def _rpc_join(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """Body checked against ``RPC_BODIES``; the addresses must also parse, or the
        leader would commit a member that no node can reach (nor Raft add)."""
        member = body["member"]
        for key in ("cluster", "raft"):
            try:
                parse_hostport(member[key])
            except ConfigError as exc:
                raise BadRequest(f"join: member.{key}: {exc}") from None
        if member.get("weight", 1) < 1:
            raise BadRequest("join: member.weight must be >= 1")
        return await self._peer_leader_call("join", {"member": member})

    async def _leader_join(self, body: dict[str, Any]) -> dict[str, Any]:
        info = body["member"]
        async with self._membership_lock:  # one membership change at a time
            old = self._view.members.get(info["node_id"])
            if old is not None and old.raft != info["raft"]:
                raise RpcError(f"{old.node_id} is a member with raft address {old.raft}; "
                               "remove it before rejoining from another address")
            # The grace period starts now, not when this leader took over.
            self._detector.heard(info["node_id"], trio.current_time())
            await self._raft.commit(sm.cmd_joining(info))
            if info["raft"] not in self._raft.nodes():
                await self._raft.change_membership("add", info["raft"])
            result = await self._raft.commit(sm.cmd_up(info["node_id"]))
            self._detector.heard(info["node_id"], trio.current_time())
        log.info("%s joined with incarnation %s", info["node_id"], result["incarnation"])
        return {"incarnation": result["incarnation"], "epoch": result["epoch"]}

    async def _rpc_remove(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return await self._peer_leader_call("remove", {"node_id": body["node_id"]})

    async def _leader_remove(self, body: dict[str, Any]) -> dict[str, Any]:
        member = self._view.members.get(body["node_id"])
        if member is None:
            raise RpcError(f"unknown member {body['node_id']!r}")
        if member.node_id == self.node_id:
            raise RpcError("the leader cannot remove itself; transfer leadership first")
        async with self._membership_lock:
            result = await self._raft.commit(sm.cmd_remove(member.node_id))
            if member.raft in self._raft.nodes():
                await self._raft.change_membership("remove", member.raft)
        return {"epoch": result["epoch"]}

    async def _rpc_heartbeat(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """Note the member alive; tell it whether this is the leader and counts it up, so a
        follower can tell a live majority from a deposed leader on its side of a split."""
        node_id = body["node_id"]  # a string: checked against ``RPC_BODIES``
        self._detector.heard(node_id, trio.current_time())
        member = self._view.members.get(node_id)
        member_up = (member is not None and member.state is not MemberState.DOWN
                     and member.incarnation == body.get("incarnation"))
        return {"epoch": self._view.epoch,
                "leader": self._raft.is_leader(),
                "member_up": member_up}

    async def _rpc_status(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return self.status(brief=bool(body.get("brief")))

    def status(self, brief: bool = False) -> dict[str, Any]:
        """This member's Raft figures and applied view (``mqttring status``, the HTTP API)."""
        raft = self._raft.figures()
        view = self._view
        wire = view_to_wire(view)
        if brief:
            del wire["shards"]  # ~30 kB with 1024 shards; pollers rarely need it
        return {"node_id": self.node_id, "raft": raft, "leader": view.leader,
                "view": wire, "rpc_refused": self.rpc.refused,
                "quorum": self.in_quorum(self.config.fence_seconds)}

    async def _rpc_leave(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """Leave, then make ``run`` return (after this reply is sent): the node stops.

        The reply says what happened; a leave that cannot happen (last member) or did not
        complete is an error and the node keeps running.
        """
        if self._view.members.get(self.node_id) is None:
            raise RpcError(f"{self.node_id} is not a member")
        if not self._others_up():
            raise RpcError(f"{self.node_id} is the last member up: there is nobody to hand "
                           "its shards to (stop it with SIGTERM instead)")
        try:
            await self.leave()
        except (CommitError, trio.TooSlowError) as exc:
            self._leaving = False
            raise RpcError(f"leave did not complete: {describe_error(exc)}") from None
        self._left.set()
        return {"left": True, "epoch": self._view.epoch}

    async def _rpc_caught_up(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        """For tests and operators standing in for the data plane (see module docstring)."""
        return await self._commit_rpc(sm.cmd_caught_up(
            self.node_id, self.incarnation, body.get("shards", [])))

    async def _rpc_pin(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return await self._commit_rpc(sm.cmd_pin(body["subtree"], body.get("shard")))

    async def _rpc_unpin(self, body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return await self._commit_rpc(sm.cmd_unpin(body["subtree"]))

    async def _commit_rpc(self, command: sm.Command) -> dict[str, Any]:
        try:
            return await self._raft.commit(command, timeout=float(command.get("timeout", 5.0)))
        except (CommitError, trio.TooSlowError) as exc:
            raise RpcError(f"not committed: {describe_error(exc)}") from None

