"""``RaftBridge``: one pysyncobj node, driven from trio without blocking the loop.

pysyncobj runs its own thread (``RaftHost``, see ``replicated.py``) and answers through
callbacks on that thread.  This bridge is the only code that touches the ``SyncObj``: a
command goes to pysyncobj's queue with a callback, and the callback comes back to the trio
thread through ``TrioToken.run_sync_soon`` and a one-slot channel, so every method here is
either a cheap read of pysyncobj's own fields or an ``await``.

It knows nothing of members, joins or heartbeats: that is ``MetadataService``
(``service.py``), which decides *what* to commit and *which* Raft node to add or remove.
The bridge decides only how to get pysyncobj to do it: retrying while there is no leader
or a membership change is still in flight, and turning pysyncobj's error codes into
``CommitError``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from pysyncobj import FAIL_REASON, SyncObj

from mqttring.config import parse_hostport
from mqttring.errors import ListenError
from mqttring.raft import state as sm
from mqttring.raft.replicated import RaftHost, RaftTimeouts, ReplicatedMetadata, make_syncobj

log = logging.getLogger(__name__)


class CommitError(Exception):
    """Raft did not commit a command (no leader, leader changed) or the state refused it."""


class RaftBridge:
    """The trio side of one pysyncobj node: start, stop, commit, membership, figures."""

    def __init__(self, address: str, password: str, data_dir: Path | None,
                 timeouts: RaftTimeouts) -> None:
        #: This node's Raft address (``host:port``), fixed: peers remember it.
        self.address = address
        self._password = password
        self._data_dir = data_dir
        self._timeouts = timeouts
        self._syncobj: SyncObj | None = None
        self._host: RaftHost | None = None
        self._consumer: ReplicatedMetadata | None = None
        self._token: trio.lowlevel.TrioToken | None = None

    # -- life -------------------------------------------------------------------------

    async def start(self, peers: list[str],
                    on_applied: Callable[[sm.MetadataState], None]) -> None:
        """Start pysyncobj with these Raft peers; ``on_applied`` runs on the Raft thread."""
        self._token = trio.lowlevel.current_trio_token()
        await self._wait_bindable()
        self._consumer = consumer = ReplicatedMetadata(on_applied)
        host = RaftHost(lambda: make_syncobj(self.address, peers, consumer, self._password,
                                             self._data_dir, self._timeouts))
        self._host = host
        host.start()
        self._syncobj = await trio.to_thread.run_sync(host.wait_ready)

    async def _wait_bindable(self) -> None:
        """``check_bindable``, tried again for ``BIND_PATIENCE`` while the address is in
        use: what holds it may be a moment's (another program's outgoing connection given
        this port as its source port), and pysyncobj would have got it a second later."""
        deadline = trio.current_time() + BIND_PATIENCE
        for attempt in itertools.count():
            try:
                await trio.to_thread.run_sync(check_bindable, self.address)
                return
            except ListenError as exc:
                if exc.errno != errno.EADDRINUSE or trio.current_time() >= deadline:
                    raise
                if not attempt:
                    log.info("%s; trying again for up to %g s", exc, BIND_PATIENCE)
                await trio.sleep(0.25)

    async def stop(self) -> None:
        host, self._host = self._host, None
        self._syncobj = None
        if host is not None:
            await trio.to_thread.run_sync(host.stop)

    @property
    def running(self) -> bool:
        return self._syncobj is not None

    # -- reads (pysyncobj's fields; safe from the trio thread and the Raft thread) ---------

    def is_leader(self) -> bool:
        syncobj = self._syncobj
        return syncobj is not None and syncobj._isLeader()

    def is_ready_leader(self) -> bool:
        """Leader, and its log replayed: a bootstrap may look at the state now."""
        syncobj = self._syncobj
        assert syncobj is not None
        return syncobj._isLeader() and syncobj.isReady()

    def leader_address(self) -> str | None:
        syncobj = self._syncobj
        leader = syncobj._getLeader() if syncobj is not None else None
        return None if leader is None else leader.address

    def applied_state(self) -> sm.MetadataState:
        """The local replica's state (read-only: only pysyncobj's thread applies to it)."""
        consumer = self._consumer
        assert consumer is not None
        return consumer.state

    def nodes(self) -> set[str]:
        """Every Raft address in the current configuration, this node's included."""
        syncobj = self._syncobj
        assert syncobj is not None
        return {n.address for n in syncobj.otherNodes} | {syncobj.selfNode.address}

    def figures(self) -> dict[str, Any]:
        """Term, commit index and configuration for ``status``; empty when not running."""
        syncobj = self._syncobj
        if syncobj is None:
            return {}
        return {"term": syncobj.raftCurrentTerm, "commit_index": syncobj.raftCommitIndex,
                "is_leader": syncobj._isLeader(), "address": self.address,
                "nodes": sorted(self.nodes())}

    # -- writes -----------------------------------------------------------------------

    async def _call(self, start: Any, timeout: float) -> Any:
        """Run a pysyncobj async call (``start(callback)``) and await its callback."""
        token = self._token
        assert token is not None
        send, receive = trio.open_memory_channel[tuple[Any, int]](1)

        def callback(result: Any, error: int) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(send.send_nowait, (result, error))

        start(callback)
        with trio.fail_after(timeout):
            return await receive.receive()

    async def commit(self, command: sm.Command, timeout: float = 5.0) -> dict[str, Any]:
        """Commit through Raft (forwarded to the leader by pysyncobj); retry while leaderless."""
        with trio.fail_after(timeout):
            while True:
                consumer = self._consumer
                if consumer is None or self._syncobj is None:
                    raise CommitError("not running")
                result, error = await self._call(
                    lambda cb, c=consumer: c.apply(command, callback=cb), timeout)
                if error == FAIL_REASON.SUCCESS:
                    if not result.get("ok"):
                        raise CommitError(result.get("error", "refused"))
                    return result
                if error not in (FAIL_REASON.MISSING_LEADER, FAIL_REASON.QUEUE_FULL):
                    raise CommitError(f"{command['op']} not committed (pysyncobj error {error})")
                await trio.sleep(0.1)

    async def change_membership(self, op: str, raft: str) -> None:
        """addNodeToCluster / removeNodeFromCluster, retried while a change is in flight."""
        syncobj = self._syncobj
        assert syncobj is not None
        method = syncobj.addNodeToCluster if op == "add" else syncobj.removeNodeFromCluster
        with trio.fail_after(15.0):
            while True:
                _, error = await self._call(lambda cb: method(raft, callback=cb), 15.0)
                if error == FAIL_REASON.SUCCESS:
                    return
                log.info("raft %s %s: pysyncobj error %s, retrying", op, raft, error)
                await trio.sleep(0.2)

    async def transfer_leadership(self) -> None:
        syncobj = self._syncobj
        assert syncobj is not None
        with trio.move_on_after(5.0):
            while syncobj._isLeader():
                await self._call(lambda cb: syncobj.transferLeadership(callback=cb), 2.0)
                await trio.sleep(0.5)


#: Seconds a Raft address in use is tried again before the node gives up (``_wait_bindable``).
BIND_PATIENCE = 10.0


def check_bindable(address: str) -> None:
    """Raise ``ListenError`` unless this node can bind its Raft ``address`` now.

    pysyncobj retries a bind it cannot make every second, for ever and silently: a node
    whose Raft port was taken (or whose address is not one of this machine's) sat there
    with its other ports open, no log line and no ready file.  Checked first, it is the
    one line and exit code of any listener that cannot bind.  (A port taken in the moment
    between this check and pysyncobj's bind still goes unnoticed.)
    """
    host, port = parse_hostport(address)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(f"raft {address}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in found[:1]:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as pysyncobj does
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                raise ListenError(f"raft {address}", exc) from None
