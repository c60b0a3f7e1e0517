"""``MetadataService``: one node's membership in the cluster metadata, for trio code.

It owns the pysyncobj node (through ``RaftBridge``, ``bridge.py``), the cluster RPC server
on ``config.cluster``, and small loops: heartbeats to every member (``heartbeats.py``), the
leader's failure detector, the quorum watch, and a watcher that notices leader changes (which
are not log entries); what the detector and the quorum proof decide is in ``liveness.py``.
Readers get immutable ``ClusterView`` snapshots: ``view()`` returns the latest,
``subscribe()`` pushes each new one.  Nothing here blocks the trio loop: the bridge awaits
pysyncobj's callbacks, and each view applied on the Raft thread comes back through
``TrioToken.run_sync_soon``.  This module decides what to commit and whom to admit; the
bridge only gets pysyncobj to do it.

Joining (``config.join`` or, after a restart, the members remembered in
``<data_dir>/raft/peers.json``)::

    new node --info--> any member         (Raft peers, leader)
    new node starts pysyncobj with those peers
    new node --join--> any member --join--> leader   (forwarded if needed)
    leader: commit ``joining`` -> addNodeToCluster (one at a time) -> commit ``up``

A node that restarts (or finds itself marked down) joins again the same way and gets a new
incarnation; its shards come back to it only through ``mark_caught_up``.

Quorum (``in_quorum``): the data plane must know whether this node can still prove that it
belongs to the majority's view, because a node that cannot must stop serving before the
majority takes its shards and sessions over (see ``mqttring.cluster.plane``, fencing).  The
leader proves it by being leader: pysyncobj makes a leader that hears from no majority for
``leader_fallback`` (2 s) step down.  A follower proves it by a heartbeat answered by a node
that is leader at that moment and still counts it up in this incarnation.  Both proofs are
dated ``leader_fallback`` before the moment they were had (for a follower: before its
heartbeat was *sent*): a deposed leader on the minority side of a split believes it leads for
up to that long, and the answers it gives meanwhile must not look fresher than they are.
With ``fence_after < failure_grace`` a cut-off node therefore stops serving at least
``failure_grace - fence_after`` seconds before any leader can declare it down.

Who calls ``mark_caught_up``: the data plane (``mqttring.cluster.plane``), once it has
copied a shard it is catching up on (``view.catching_up_for(node_id)``); until then the
shard's old holders serve it.  The metadata-only member (``mqttring.raft.member``) holds no
shard data, so it uses ``CatchUp.NOTHING_TO_COPY`` and claims its shards at once.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import logging
import math
import shutil
from dataclasses import replace
from typing import Any

import trio

from mqttring.cluster_tls import ClusterTls
from mqttring.config import BrokerConfig, ConfigError, parse_hostport
from mqttring.errors import JoinError
from mqttring.logs import WaitLog
from mqttring.raft import state as sm
from mqttring.raft.bridge import CommitError, RaftBridge
from mqttring.raft.heartbeats import Heartbeats
from mqttring.raft.liveness import Admission, FailureDetector, QuorumProof, admission
from mqttring.raft.peers import PeersFile
from mqttring.raft.replicated import DEFAULT_TIMEOUTS, RAFT_PASSWORD_PURPOSE, RaftTimeouts
from mqttring.raft.requests import RPC_BODIES, RPC_KINDS, MetadataRequests
from mqttring.raft.view import EMPTY_VIEW, ClusterView, MemberState
from mqttring.rpc import (
    RPC_KEY_PURPOSE,
    ProtocolError,
    RpcError,
    RpcServer,
    call_once,
    cluster_secret,
    derive_key,
)

log = logging.getLogger(__name__)

#: Seconds an admitted node waits for its own replica before it logs the wait (a replica
#: usually catches up within a heartbeat or two).
ADMISSION_QUIET = 3.0

#: Seconds between two looks at this node's quorum proof, for the lost/regained log lines.
QUORUM_LOG_POLL = 0.25
#: How long a leaving node keeps asking to be removed (handing the lead over as needed):
#: the "plus a few seconds" of ``leave``'s bound.
LEAVE_REMOVAL_BOUND = 15.0



def failure_reason(exc: BaseException) -> str:
    """Why asking a member failed, in words: a timeout or a connection closed without an
    answer has an empty ``str()``, and the log said "join via HOST:PORT failed: " (a probe
    that joined through a node's MQTT port got that for 30 s)."""
    if isinstance(exc, trio.TooSlowError):
        return "no answer in time (is it the cluster address of a member?)"
    if isinstance(exc, EOFError):
        return "closed without an answer (is it the cluster address of a member?)"
    return str(exc) or type(exc).__name__

class CatchUp(enum.Enum):
    DATA_PLANE = "data-plane"  # the data plane calls mark_caught_up after copying a shard
    NOTHING_TO_COPY = "nothing-to-copy"  # metadata-only node: it holds no shard data


def default_raft_address(cluster: str) -> str:
    """Raft listens on the cluster port + 1 unless told otherwise (it must be a fixed port)."""
    host, port = parse_hostport(cluster)
    if port == 0:
        raise ConfigError("with --cluster HOST:0 give --raft HOST:PORT explicitly")
    return f"{host}:{port + 1}"


class MetadataService(MetadataRequests):
    """See the module docstring; the public surface is the five methods below (the
    requests it serves on the cluster port: ``MetadataRequests``)."""

    def __init__(self, config: BrokerConfig, *, tls: ClusterTls | None,
                 catch_up: CatchUp = CatchUp.DATA_PLANE,
                 timeouts: RaftTimeouts = DEFAULT_TIMEOUTS) -> None:
        if config.cluster is None:
            raise ConfigError("a cluster member needs a cluster address")
        if config.raft is None:
            config = replace(config, raft=default_raft_address(config.cluster))
        secret = cluster_secret(config)
        if importlib.util.find_spec("cryptography") is None:
            raise ConfigError("cluster mode needs the 'cryptography' package: pysyncobj "
                              "encrypts Raft traffic with it (pip install cryptography)")
        self.config = config
        self.node_id = config.node_id
        self.catch_up = catch_up
        # A leader cut off from the majority must step down well inside the failure grace:
        # quorum proofs are dated ``leader_fallback`` back (see the module docstring).
        self.timeouts = replace(timeouts, leader_fallback=min(timeouts.leader_fallback,
                                                              config.failure_grace / 4))
        self._rpc_key = derive_key(secret, RPC_KEY_PURPOSE)
        #: Mutual TLS on the cluster address, when configured (``mqttring.cluster_tls``):
        #: loaded once by the node (``mqttring.broker.files``) and handed in.
        self.tls = tls
        #: The context for connections this node makes to members (None: plain TCP).
        self.client_tls = None if self.tls is None else self.tls.client
        self._raft = RaftBridge(config.raft or "", derive_key(secret, RAFT_PASSWORD_PURPOSE).hex(),
                                config.data_dir, self.timeouts)
        self._cluster_address = config.cluster
        #: MQTT address announced to other members (``advertise_mqtt``).
        self._advertised_mqtt: str | None = config.mqtt or None
        self._view = EMPTY_VIEW
        self._subscribers: list[trio.MemorySendChannel[ClusterView]] = []
        self._view_changed = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._membership_lock = trio.Lock()
        #: The leader's record of heartbeats (``liveness.py``).
        # A gap of half the grace between two checks (made every half heartbeat) is this
        # node's own stall, not the members' silence (``liveness.py``).
        self._detector = FailureDetector(config.failure_grace, stall=config.failure_grace / 2)
        self._left = trio.Event()
        self._peers = PeersFile(config.data_dir, self.node_id)
        #: The latest proof that this node is in the majority's view (``liveness.py``).
        self._quorum = QuorumProof(self.timeouts.leader_fallback)
        #: Set once ``leave`` starts: losing the proof of quorum is then expected, not news.
        self._leaving = False
        self.rpc = RpcServer(self._rpc_key, self.node_id,
                             tls=None if self.tls is None else self.tls.server)
        for kind in RPC_KINDS:
            self.rpc.register(kind, getattr(self, f"_rpc_{kind}"), RPC_BODIES.get(kind))

    # -- public surface ---------------------------------------------------------------

    def view(self) -> ClusterView:
        return self._view

    def subscribe(self) -> trio.MemoryReceiveChannel[ClusterView]:
        """Every view installed from now on; unbounded because epochs are rare."""
        send, receive = trio.open_memory_channel[ClusterView](math.inf)
        self._subscribers.append(send)
        return receive

    def in_quorum(self, within: float) -> bool:
        """Proved, at most ``within`` seconds ago, to be up in the majority's view."""
        me = self._view.members.get(self.node_id)
        if me is None or me.state not in (MemberState.UP, MemberState.LEAVING):
            return False
        now = trio.current_time()
        if self._raft.is_leader():
            self._quorum.proved(now)
        return self._quorum.holds(now, within)

    @property
    def incarnation(self) -> int:
        member = self._view.members.get(self.node_id)
        return member.incarnation if member else 0

    async def mark_caught_up(self, shards: list[int]) -> dict[str, Any]:
        """The data plane holds these shards' data now: let them be served from here."""
        return await self._raft.commit(sm.cmd_caught_up(self.node_id, self.incarnation, shards),
                                  timeout=2.0)

    async def pin(self, subtree: str, shard: int | None = None) -> dict[str, Any]:
        return await self._raft.commit(sm.cmd_pin(subtree, shard))

    async def run(self, *, task_status: trio.TaskStatus[ClusterView] =
                  trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as nursery:
                port = await nursery.start(self.rpc.serve, self.config.cluster)
                host = self.config.cluster.rpartition(":")[0]
                self._cluster_address = f"{host}:{port}"
                await self._start_raft()
                nursery.start_soon(self._watch_leader)
                view = await self._become_member()
                task_status.started(view)
                nursery.start_soon(self._heartbeat_loop)
                nursery.start_soon(self._leader_loop)
                nursery.start_soon(self._watch_quorum)
                if self.catch_up is CatchUp.NOTHING_TO_COPY:
                    nursery.start_soon(self._claim_empty_shards)
                await self._left.wait()
                await trio.sleep(0.2)  # let the reply to a remote "leave" go out
                nursery.cancel_scope.cancel()
        finally:
            for send in self._subscribers:
                send.close()  # subscribers' ``async for`` ends with the service
            self._subscribers.clear()
            with trio.CancelScope(shield=True):
                await self._raft.stop()

    async def leave(self) -> bool:
        """Hand this node's shards away (epoch without it as owner), then leave Raft.

        Takes up to ``config.leave_timeout`` waiting for shards only this node holds to be
        caught up elsewhere, plus a few seconds for the Raft removal: a caller that bounds
        it should allow ``leave_timeout + 15`` s.  Returns False when there was nothing to
        leave (not a member, or the last one up); raises ``CommitError`` or
        ``trio.TooSlowError`` when the cluster could not commit a step (no quorum).
        """
        me = self._view.members.get(self.node_id)
        if not self._raft.running or me is None:
            return False
        if not self._others_up():
            log.warning("%s is the last member; stopping without handing shards away",
                        self.node_id)
            return False
        self._leaving = True
        if me.state is MemberState.UP:
            await self._raft.commit(sm.cmd_leaving(self.node_id))
        # Wait (bounded) until no shard is served only from here.
        with trio.move_on_after(self.config.leave_timeout):
            while any(a.owner == self.node_id for a in self._view.shards):
                await self._wait_view()
        sole = sum(1 for a in self._view.shards if a.owner == self.node_id)
        if sole:
            log.warning("%s leaves as the only holder of %d shards: their data goes with it",
                        self.node_id, sole)
        await self._removed()
        await self._raft.stop()
        if self.config.data_dir is not None:
            # Our journal says we are a member; a restart must join afresh, not resurrect.
            shutil.rmtree(self.config.data_dir / "raft", ignore_errors=True)
            self._peers.remember_left(self._view)
        return True

    async def _removed(self) -> None:
        """Have the leader remove this node, handing the lead over first if it is ours.

        The lead can come back between the hand-over and the request (an election this node
        wins again): the leader would refuse to remove itself, and the node would stop still
        a member ("the leader cannot remove itself", 2 of 7 leaves of a 5-node leader).  So
        it hands the lead over again and asks again, within ``_leader_call``'s bound.
        """
        with trio.fail_after(LEAVE_REMOVAL_BOUND):
            while True:
                if self._raft.is_leader():
                    await self._raft.transfer_leadership()
                    if self._raft.is_leader():
                        continue  # not taken this time: transfer_leadership waited 5 s
                try:
                    await self._leader_call("remove", {"node_id": self.node_id})
                    return
                except RpcError:
                    if not self._raft.is_leader():
                        raise  # a refusal of its own, not the lead coming back
                    log.info("%s: the lead came back before its removal; handing it over "
                             "again", self.node_id)

    def _others_up(self) -> bool:
        return any(m.node_id != self.node_id and m.state is MemberState.UP
                   for m in self._view.members.values())

    # -- Raft plumbing ----------------------------------------------------------------

    def _on_applied(self, state: sm.MetadataState) -> None:
        """Raft thread: snapshot now, install on the trio thread."""
        try:
            view = state.view(leader=self._leader_id(state.members))
            if self._token is not None:
                self._token.run_sync_soon(self._install, view)
        except trio.RunFinishedError:
            pass
        except Exception:  # never let a bug here kill pysyncobj's thread
            log.exception("building a ClusterView failed")

    def _install(self, view: ClusterView) -> None:
        if view.epoch < self._view.epoch or view == self._view:
            return  # stale, or a refused command (same state, nothing new to tell)
        self._view = view
        self._view_changed.set()
        self._view_changed = trio.Event()
        for send in list(self._subscribers):
            try:
                send.send_nowait(view)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.remove(send)
        self._peers.save(view)

    async def _wait_view(self) -> None:
        await self._view_changed.wait()

    def _leader_id(self, members: Any) -> str | None:
        leader = self._raft.leader_address()
        if leader is None:
            return None
        for member in members.values():
            if member.raft == leader:
                return member.node_id
        return None

    async def _start_raft(self) -> None:
        peers = self._peers.load()
        self._join_via = [self.config.join] if self.config.join else []
        self._join_via += [p["cluster"] for n, p in sorted(peers.items()) if n != self.node_id]
        if not self._join_via:
            # It left a cluster (SIGTERM) and is started again with the command it was
            # first started with: it rejoins, as docs/operations.md says.
            self._join_via = self._peers.load_left()
            if self._join_via:
                log.info("%s left its cluster before: rejoining it through %s (to found a "
                         "new cluster with this data dir instead, remove %s)", self.node_id,
                         ", ".join(self._join_via), self._peers.left_path)
        raft_peers = [p["raft"] for n, p in peers.items() if n != self.node_id]
        # One bound for the whole join (the peers, then the admission): ``join_timeout``.
        self._join_deadline = trio.current_time() + self.config.join_timeout
        if self._join_via and not raft_peers:
            info = await self._first_answer("info", {}, self._join_deadline)
            raft_peers = [r for r in info["raft_peers"] if r != self.config.raft]
        await self._raft.start(raft_peers, self._on_applied)

    async def _become_member(self) -> ClusterView:
        """Bootstrap or join, then wait until our own replica shows us a member.

        Each wait is bounded by ``join_timeout`` (``JoinError``), and logged while it lasts:
        an admitted node whose Raft address the members cannot reach (a firewall, an
        address that is not this host's for them) would otherwise sit silent for ever,
        its ports closed, its replica never receiving the log that admits it."""
        incarnation, admitted = 1, 0
        bound = self.config.join_timeout
        if not self._join_via:
            formed = False
            with trio.move_on_after(bound):
                await self._bootstrap()
                formed = True
            if not formed:
                raise JoinError(f"this node's Raft ({self.config.raft}) did not elect itself "
                                f"the leader of its new one-node cluster within "
                                f"join_timeout = {bound:g} s")
        else:
            incarnation, admitted = await self._join(self._join_deadline)
        # Our own replica may lag the leader: wait until it shows us up in this incarnation,
        # at the epoch that admitted us or later.  (The incarnation alone is not enough: a
        # node that left was removed, and its new life counts from 1 again, so the replay
        # showed it up in its previous life, and the plane started on that view, then
        # acted on the view in which it was leaving: it refused every client.)
        raft = self.config.raft
        waiting = WaitLog(log, f"this node's Raft replica ({raft}) to receive the cluster's "
                               "log that admits it (if this lasts: can the members reach "
                               f"{raft}?)")
        quiet_until = trio.current_time() + ADMISSION_QUIET  # the common wait: no lines
        with trio.move_on_after(bound) as scope:
            while True:
                standing = admission(self._view, self.node_id, incarnation, admitted)
                if standing is Admission.MEMBER:
                    waiting.done(f"{self.node_id} admitted")
                    # Just admitted (or bootstrapped) by a leader: a proof of quorum.
                    self._quorum.proved(trio.current_time())
                    return self._view
                if standing is Admission.REJOIN and self._join_via:
                    log.warning("%s was marked down before it saw itself up (incarnation "
                                "%d); joining again", self.node_id, incarnation)
                    incarnation, admitted = await self._join()
                    scope.deadline = trio.current_time() + bound
                    continue
                if trio.current_time() >= quiet_until:
                    waiting.failed(f"admitted at epoch {admitted}, this replica is at "
                                   f"epoch {self._view.epoch}")
                # Woken every second at least, so that the wait's log lines come.
                with trio.move_on_after(1.0):
                    await self._wait_view()
        raise JoinError(f"admitted by the cluster at epoch {admitted}, but this node's Raft "
                        f"replica ({raft}) did not receive the log that admits it within "
                        f"join_timeout = {bound:g} s: can the members reach {raft}?")

    async def _bootstrap(self) -> None:
        """Form a one-node cluster (or, after a restart, resume it from the journal)."""
        while not self._raft.is_ready_leader():
            await trio.sleep(0.02)
        if self._raft.applied_state().num_shards == 0:
            await self._raft.commit(sm.cmd_bootstrap(self.config.num_shards,
                                                     self.config.replication,
                                                     self._member_info()))
        # Otherwise this is the restart of a one-node cluster, resumed from its journal.  It
        # keeps its incarnation: no other node can have taken writes while it was away.

    async def _join(self, deadline: float | None = None) -> tuple[int, int]:
        """Join through a member; the incarnation given and the epoch that admitted us.
        ``deadline`` (trio time): give up then (``JoinError``); None: ``join_timeout`` from
        now."""
        answer = await self._first_answer("join", {"member": self._member_info()}, deadline)
        self._peers.forget_left()
        return int(answer["incarnation"]), int(answer.get("epoch", 0))

    async def _first_answer(self, kind: str, body: dict[str, Any],
                            deadline: float | None = None) -> dict[str, Any]:
        """Ask each known member in turn until one answers (members may be restarting),
        until ``deadline`` (trio time; None: ``join_timeout`` from now), then ``JoinError``.

        Tries come every 0.2 s; ``WaitLog`` logs the wait, not each try.  The deadline also
        cuts a try short (an address that accepts and never answers)."""
        if deadline is None:
            deadline = trio.current_time() + self.config.join_timeout
        asked = " or ".join(self._join_via)
        waiting = WaitLog(log, f"an answer to {kind} from {asked}")
        last = "no answer yet"
        with trio.move_on_at(deadline):
            while True:
                for address in self._join_via:
                    # Cut short by the deadline, this try is what the error names: an
                    # address that took the request and never answered (a member whose
                    # cluster cannot commit the join without a Raft majority, or a service
                    # that is not a member's cluster address).
                    last = (f"{address}: asked, no answer in time (is a Raft "
                            "majority of the cluster up? is it a member's cluster address?)")
                    try:
                        answer = await call_once(address, self._rpc_key, self.node_id, kind,
                                                 body, timeout=10.0, tls=self.client_tls)
                    except (OSError, RpcError, ProtocolError, trio.TooSlowError,
                            EOFError) as exc:
                        # (ProtocolError: that address answered garbage; the next may not.)
                        last = f"{address}: {failure_reason(exc)}"
                        waiting.failed(f"{kind} via {address} failed: {failure_reason(exc)}")
                        continue
                    waiting.done(f"{kind} answered by {address}")
                    return answer
                await trio.sleep(0.2)
        raise JoinError(f"no answer to {kind} from {asked} within join_timeout = "
                        f"{self.config.join_timeout:g} s (last: {last})")

    def advertise_mqtt(self, address: str | None) -> None:
        """The MQTT address this member announces when it bootstraps or joins (so, before
        ``run``): the bound one once the listener is up (a configured port 0 names none),
        None for a member that serves no MQTT (``mqttring.raft.member``)."""
        self._advertised_mqtt = address

    def _member_info(self) -> dict[str, Any]:
        return sm.member_info(self.node_id, self._cluster_address, self.config.raft or "",
                              self._advertised_mqtt, self.config.node_weight)

    # -- loops ------------------------------------------------------------------------

    async def _watch_leader(self) -> None:
        """Leader changes are not log entries: fold them into the view when they happen."""
        while True:
            view = self._view
            leader = self._leader_id(view.members)
            if leader != view.leader:
                self._install(replace(view, leader=leader))
            await trio.sleep(0.05)

    async def _heartbeat_loop(self) -> None:
        """Heartbeats to every member (``heartbeats.py``), and a new incarnation whenever
        the view says this node was marked down."""
        beats = Heartbeats(self.node_id, self._rpc_key, self.client_tls,
                           self.config.heartbeat_interval, self.view,
                           lambda: self.incarnation, self._quorum.proved)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(beats.run)
            while True:
                await trio.sleep(self.config.heartbeat_interval)
                me = self._view.members.get(self.node_id)
                if me is None or me.state is not MemberState.DOWN:
                    continue
                log.warning("%s was marked down; rejoining with a new incarnation", self.node_id)
                self._join_via = [m.cluster for m in self._view.members.values()
                                  if m.node_id != self.node_id] or self._join_via
                with contextlib.suppress(JoinError):
                    await self._join()
                    # Admitted again by the leader: that is a proof of quorum.
                    self._quorum.proved(trio.current_time())

    async def _watch_quorum(self) -> None:
        """Log when this node loses and regains its proof of quorum: without a majority the
        member states it reports are frozen at the last commit, and only these lines (and
        ``quorum`` in ``mqttring status``) tell an operator that nothing can commit."""
        within = self.config.fence_seconds
        had = True  # just admitted: ``_become_member`` recorded the proof
        while True:
            await trio.sleep(QUORUM_LOG_POLL)
            has = self.in_quorum(within)
            if has == had or self._leaving:
                continue
            had = has
            if has:
                log.info("%s: quorum regained (leader %s, epoch %d)", self.node_id,
                         self._view.leader, self._view.epoch)
            else:
                log.warning("%s: lost quorum: no Raft leader has counted this node up for "
                            "%.1fs; membership and shard changes cannot commit (leader %s)",
                            self.node_id, within, self._view.leader or "unknown")

    async def _leader_loop(self) -> None:
        """Failure detection, on the leader only: silence past the grace period -> down."""
        while True:
            await trio.sleep(self.config.heartbeat_interval / 2)
            if not self._raft.is_leader():
                self._detector.not_leading()
                continue
            due = self._detector.silent(trio.current_time(), self._view.members.values(),
                                        self.node_id)
            for member, quiet in due:
                log.warning("no heartbeat from %s for %.1fs: marking it down",
                            member.node_id, quiet)
                try:
                    await self._raft.commit(sm.cmd_down(member.node_id, member.incarnation))
                except (CommitError, trio.TooSlowError) as exc:
                    log.info("could not mark %s down: %s", member.node_id, exc)

    async def _claim_empty_shards(self) -> None:
        """NOTHING_TO_COPY: this node holds no shard data, so catching up is immediate."""
        while True:
            pending = self._view.catching_up_for(self.node_id)
            me = self._view.members.get(self.node_id)
            if pending and me is not None and me.state is MemberState.UP:
                try:
                    result = await self.mark_caught_up(list(pending))
                except (CommitError, trio.TooSlowError) as exc:
                    log.info("caught_up not committed: %s", exc)
                    await trio.sleep(0.2)
                    continue
                if result.get("accepted"):
                    continue  # the view it produced may already assign more shards
            await self._wait_view()
