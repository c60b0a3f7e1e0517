"""``DataPlane``: what turns one broker node into a cluster member.

It composes the metadata service (Raft, ``mqttring.raft``), the inter-node links, shard
replication, the cluster router and the cluster session manager around the node's
``BrokerCore``, dispatches inbound link messages to them, and applies every new
``ClusterView``:

* links follow the membership;
* routes whose target changed are re-sent (``RouteRegistry.on_view``);
* shards this node now owns have their persistent sessions loaded from the local store (a
  replica already holds their data) and their routes registered; shards it no longer owns
  are unloaded and their clients sent to reconnect to the new home;
* shards it must catch up on are copied from their owner, then reported through Raft;
* wills of clients whose edge node died are published (``ClusterSessions.on_view``).

Netsplit policy (fencing).  A node that cannot prove, for ``fence_after`` seconds, that it is
up in the majority's view (``MetadataService.in_quorum``) stops serving: it disconnects its
clients, answers every CONNECT with CONNACK 3 (server unavailable), publishes no will and
takes over no session, until it is back in the view.  Its clients reconnect to the majority
side, which declares it down ``failure_grace`` after its last heartbeat (always later than
the node stopped), takes over its shards and sessions and publishes its clients' wills.  When
it learns it was declared down it drops everything it queued for its peers (they would refuse
it anyway: frames carry the sender's incarnation) and rejoins as a catching-up replica.  Why
this and not "keep serving and merge after the heal" (EMQX's autoheal) or VerneMQ's
"refuse writes during a split": see docs/design.md.

Inbound handlers never block the link reader (see ``mqttring.cluster.links``): quick ones run
inline, in arrival order; anything that waits runs in a task of this nursery.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from mqttring.broker.core import BrokerCore
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shared import Strategy
from mqttring.cluster.delivery import Deliveries
from mqttring.cluster.fencing import admit_frame
from mqttring.cluster.life import LifeTasks
from mqttring.cluster.links import STREAM_KIND, Links, frame_limit
from mqttring.cluster.messages import (
    Batch,
    CatchUp,
    Dlv,
    Handoff,
    InboundQos2,
    LinkMessage,
    Pub,
    Redispatch,
    Repl,
    RetainedQuery,
    RouteAdd,
    RouteDel,
    RouteDigest,
    RoutePull,
    RouteSync,
    SessionAck,
    SessionBytes,
    SessionClose,
    SessionKick,
    SessionOpen,
    SessionSubscribe,
    SessionUnsubscribe,
    SharedDone,
    ShareTrack,
    WillDelete,
    WillRegister,
    WireMessage,
)
from mqttring.cluster.registry import RouteRegistry
from mqttring.cluster.replication import ShardReplicator
from mqttring.cluster.router import ClusterRouter, request_timeout
from mqttring.cluster.sessions import ClusterSessions
from mqttring.cluster.shard_moves import ShardMoves
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.cluster_tls import ClusterTls
from mqttring.config import BrokerConfig
from mqttring.lsm import Delete, Durability, LsmStore, Put
from mqttring.protocol.session import Session
from mqttring.raft.service import MetadataService
from mqttring.raft.view import EMPTY_VIEW, ClusterView, MemberState
from mqttring.rpc import RPC_KEY_PURPOSE, cluster_secret, derive_key

log = logging.getLogger("mqttring.cluster")

#: Seconds between two looks at this node's quorum proof.
QUORUM_POLL = 0.1


class DataPlane(ShardMoves):
    """A node's cluster membership (``mqttring.broker.membership.ClusterMember``).

    Built before the broker core (it supplies the core's stores), then asked by the core for
    its router and session manager (``make_router``/``make_sessions``), which need the core.
    How shards and their sessions arrive and leave: ``ShardMoves`` (``shard_moves.py``).
    """

    def __init__(self, config: BrokerConfig, store: LsmStore, metrics: BrokerMetrics,
                 tls: ClusterTls | None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.metrics = metrics
        self.metadata = MetadataService(config, tls=tls)
        self.admin = self.metadata.rpc
        key = derive_key(cluster_secret(config), RPC_KEY_PURPOSE)
        self.links = Links(self.node_id, key, self._on_message,
                           max_frame=frame_limit(config.limits.max_packet_size),
                           stamp=self._stamp, admit=self._admit,
                           on_connected=self._on_link_connected,
                           tls=self.metadata.client_tls,
                           stall_timeout=config.link_stall_timeout,
                           ack_interval=config.link_ack_interval,
                           max_unacked_bytes=config.link_replay_window,
                           max_queued=config.link_queue_messages)
        self.metadata.rpc.register_stream(STREAM_KIND, self.links.serve_stream)
        self.view: ClusterView = EMPTY_VIEW
        #: Wakes whatever retries "by the newer view" (router, deliveries, replication).
        self.view_changes = ViewChanges()
        #: True while this node cannot prove it is in the majority's view (module docstring).
        self.fenced = False
        self.fence_count = 0
        #: Set once this node asked to leave (or its view says it is leaving): its clients
        #: were sent to other nodes, new CONNECTs are refused, and what closes a client
        #: from then on (a fence, once it is out of the view) tells it so (0x8B).
        self.leaving = False
        self.replicator = ShardReplicator(self.node_id, store, self.links, self.current_view,
                                          self._on_replicated, self.view_changes.wait,
                                          accept_ops=self._accept_replicated,
                                          patience=config.cluster_write_patience)
        self.retained = RetainedStore(store, config.num_shards, self.replicator,
                                      lambda topic: self.current_view().shard_for_topic(topic),
                                      lambda: self.current_view().epoch,
                                      max_bytes=config.limits.max_retained_bytes,
                                      max_topics=config.limits.max_retained_messages)
        self.session_store = SessionStore(store, config.num_shards, self.replicator)
        #: Shards this node owns and whose persistent sessions are loaded in memory.
        self.held: set[int] = set()
        self._nursery: trio.Nursery | None = None
        #: The tasks this life of the node started (``_end_life`` ends them).
        self._life = LifeTasks()
        self._copying: set[int] = set()
        #: Shards whose stale local rows were already dropped by the current catch-up.
        self._dropped: set[int] = set()
        #: Message type -> handler; filled by ``make_sessions``, the last part the core asks
        #: for (the handlers belong to the router and session manager).
        self._handlers: dict[type, Callable[[str, Any], None]] = {}

    # -- the parts the broker core asks for (it calls these from its constructor) ----------

    def make_router(self, core: BrokerCore) -> ClusterRouter:
        config = self.config
        local = LocalRouter(core.sessions, self.retained, self.session_store, self.metrics,
                            core.wake, flow=core.flow,
                            strategy=Strategy(config.shared_subscription_strategy))
        patience = config.cluster_write_patience
        self.deliveries = Deliveries(self.node_id, local, self.links, self.current_view,
                                     self._persist, self.spawn, self.held.__contains__,
                                     self.view_changes, patience=patience,
                                     request_timeout=request_timeout(patience, patience))
        registry = RouteRegistry(self.node_id, self.links, self.current_view, self.spawn,
                                 lambda: self.held, routes_wait=patience)
        self.router = ClusterRouter(self.node_id, local, self.retained, self.links,
                                    self.current_view, self.metrics, self.deliveries,
                                    self.spawn, registry)
        return self.router

    def make_sessions(self, core: BrokerCore) -> ClusterSessions:
        self.core = core
        self.sessions = ClusterSessions(core, self.node_id, self.links, self.current_view,
                                        self.spawn, self.is_fenced, self.held.__contains__,
                                        self.view_changes.wait,
                                        self.config.cluster_write_patience,
                                        self.config.moved_session_grace,
                                        leaving=lambda: self.leaving)
        self._handlers = self._dispatch_table()
        return self.sessions

    # -- what the node asks of its membership ----------------------------------------------

    def advertise_mqtt(self, address: str) -> None:
        self.metadata.advertise_mqtt(address)

    def owned_shards(self) -> list[int]:
        return sorted(self.held)

    def replica_shards(self) -> list[int]:
        view, me = self.view, self.node_id
        return [s for s in range(view.num_shards) if me in view.replicas(s)]

    def link_stats(self) -> dict[str, dict[str, int]]:
        return self.links.stats()

    def current_view(self) -> ClusterView:
        return self.view

    def is_fenced(self) -> bool:
        return self.fenced

    # -- fencing ----------------------------------------------------------------------------

    def _stamp(self) -> tuple[int, int]:
        me = self.view.members.get(self.node_id)
        return (me.incarnation if me is not None else 0, self.view.epoch)

    def _admit(self, node: str, incarnation: int, epoch: int) -> bool:
        return admit_frame(self.view, self.node_id, node, incarnation, epoch)

    def _on_link_connected(self, node: str) -> None:
        if self.view.epoch and not self.fenced:
            self.router.registry.sync_to(node)

    async def _guard_quorum(self) -> None:
        """Fence this node while it cannot prove it is in the majority's view."""
        within = self.config.fence_seconds
        while True:
            await trio.sleep(QUORUM_POLL)
            ok = self.metadata.in_quorum(within)
            if not ok and not self.fenced:
                self._fence()
            elif ok and self.fenced:
                self._unfence()

    def _fence(self) -> None:
        self.fenced = True
        self.fence_count += 1
        handlers = list(self.sessions.by_token.values())
        if self.leaving:  # out of the view on purpose: not a fault
            log.info("node %s: out of the view while leaving; disconnecting %d clients and "
                     "refusing CONNECT", self.node_id, len(handlers))
        else:
            log.warning("node %s: no proof of quorum for more than %.1fs; fencing: "
                        "disconnecting %d clients and refusing CONNECT until it is back in "
                        "the view", self.node_id, self.config.fence_seconds, len(handlers))
        for handler in handlers:
            # MQTT 5: 0x9C "use another server" (no Server Reference: any node of the
            # majority will do, and the client knows them better than a fenced node), or
            # 0x8B when this node is leaving (out of the view, it fences, then stops).
            handler.kick("node cut off from the cluster majority (fenced)",
                         0x8B if self.leaving else 0x9C)

    def _unfence(self) -> None:
        self.fenced = False
        log.warning("node %s: back in the majority's view (epoch %d); serving again",
                    self.node_id, self.view.epoch)
        self.sessions.wills.publish_owed()
        for node in self.router.registry.sync_peers(self.view):
            self.router.registry.sync_to(node)

    async def _anti_entropy(self) -> None:
        while True:
            await trio.sleep(self.config.route_sync_interval)
            if not self.fenced:
                self.router.registry.send_digests()

    async def _persist(self, sessions: list[Session]) -> None:
        await self.sessions.persist(sessions, Durability.DURABLE)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None
        self._life.spawn(self._nursery, fn, *args)

    def _end_life(self) -> int:
        """Declared down: cancel what this life started, drop what it queued.

        A task started before (a publish being accepted on a view the cluster has moved
        past) would otherwise go on after the node rejoins, and its messages would leave
        stamped with the new incarnation, which peers accept.
        """
        self._life.end()
        self.sessions.wills.on_declared_down()
        return self.links.clear()

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[ClusterView] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        await self.retained.load()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.links.run)
            views = self.metadata.subscribe()

            async def run_metadata(task_status: trio.TaskStatus[ClusterView]) -> None:
                await self.metadata.run(task_status=task_status)
                # It returns only after a remote leave (``mqttring leave``): so does the plane.
                nursery.cancel_scope.cancel()

            first = await nursery.start(run_metadata)
            await self._install(first)
            nursery.start_soon(self._follow, views)
            nursery.start_soon(self._guard_quorum)
            nursery.start_soon(self._anti_entropy)
            nursery.start_soon(self.router.shares.report_gone)
            task_status.started(first)

    async def _follow(self, views: trio.MemoryReceiveChannel[ClusterView]) -> None:
        async for view in views:
            # The channel also holds what the Raft journal replayed at start-up, older than
            # the view we started with: never step back to one (a restarted node would act
            # on its own earlier death).  Same epoch, new leader: only the leader changed.
            if view.epoch > self.view.epoch or (view.epoch == self.view.epoch
                                                 and view.leader != self.view.leader):
                await self._install(view)

    async def leave(self) -> bool:
        self._send_clients_away()
        return await self.metadata.leave()

    def _send_clients_away(self) -> None:
        """A leaving node serves no client: it disconnects them all before its shards move
        (they reconnect to other nodes; each one's will waits ``moved_session_grace`` for
        it, as for a moved session) and refuses new CONNECTs (CONNACK 3).  Its peers stop
        routing to it once they see it leaving, so a client kept here would miss messages,
        and its will would go out while it was still connected."""
        if self.leaving:
            return
        self.leaving = True
        count = self.sessions.send_away("node leaving the cluster")
        log.info("node %s leaving: disconnected %d clients, to reconnect to other nodes",
                 self.node_id, count)

    # -- views ------------------------------------------------------------------------------

    async def _install(self, new: ClusterView) -> None:
        if new.epoch < self.view.epoch:
            return
        old, self.view = self.view, new
        if new.epoch == old.epoch:
            return  # only the leader changed
        me_before, me_now = old.members.get(self.node_id), new.members.get(self.node_id)
        if me_now is not None and me_now.state is MemberState.LEAVING:
            self._send_clients_away()  # an operator's ``mqttring leave`` to this node
        if (me_now is not None and me_now.state is MemberState.DOWN
                and (me_before is None or me_before.state is not MemberState.DOWN)):
            # Declared down while cut off: what we queued belongs to an ended life.
            dropped = self._end_life()
            log.warning("node %s was declared down (epoch %d): dropped %d queued messages; "
                        "rejoining", self.node_id, new.epoch, dropped)
        self.links.update_peers({
            node: member.cluster for node, member in new.members.items()
            if member.state in (MemberState.UP, MemberState.LEAVING)
        })
        # Peers hold routes of our previous life until our first full route set replaces
        # them: ``registry.settle_view`` below sends it (and again on every link
        # connection).  Until then only what depends on the members that went is done.
        self.router.on_view(old, new, settle_later=True)
        me = self.node_id
        owned_before = {s for s in range(old.num_shards) if old.epoch and old.owner(s) == me}
        owned_now = {s for s in range(new.num_shards) if new.owner(s) == me}
        lost = owned_before - owned_now
        if lost:
            self.held.difference_update(lost)
            self._unload(lost, new)
        # What is left of the route work is proportional to all routes and local filters:
        # done in slices, after the unload (a handoff is confirmed once our view is this
        # one, and its sessions must be gone by then), serialized with the rest of this
        # install (no newer view is installed before it returns).
        await self.router.registry.settle_view(new)
        gained = owned_now - owned_before
        if gained:
            # Shards taken from a live owner wait for its handoff (``_take_over``); shards
            # of a dead or departed owner are loaded at once.  A leaving owner is alive: it
            # takes deliveries for its shards' sessions until it sees this view (loading
            # without its handoff lost what it acknowledged meanwhile: a 5-node fault run,
            # its Raft leader leaving under 800 msg/s).
            handed: dict[str, set[int]] = {}
            live = set(new.serving_members())
            for shard in gained:
                previous = old.owner(shard) if old.epoch else None
                if previous is not None and previous != me and previous in live:
                    handed.setdefault(previous, set()).add(shard)
            free = gained.difference(*handed.values())
            if free:
                await self._load(free)
                self.held.update(s for s in free if self.view.owner(s) == me)
                self.router.notify_changed()
            for previous, shards in handed.items():
                self.spawn(self._take_over, previous, shards, new.epoch)
        await self._forget_retained(old, new)
        await self.sessions.on_view(old, new)
        pending = [s for s in new.catching_up_for(me) if s not in self._copying]
        if pending:
            self._copying.update(pending)
            self.spawn(self._catch_up, pending)

    async def _forget_retained(self, old: ClusterView, new: ClusterView) -> None:
        """Forget the retained topics of shards this node no longer holds: only theirs,
        in slices ("What a view change costs", docs/design.md).  Every topic is looked at
        (in slices too) only for the first view (what ``run`` loaded was filed under none)
        and when the pins change (they move topics between shards)."""
        me = self.node_id
        if not old.epoch or old.pins != new.pins:
            await self.retained.reindex(lambda s: me in new.replicas(s))
            return
        dropped = sorted(s for s in self.retained.shards_held() if me not in new.replicas(s))
        if dropped:
            await self.retained.drop_shards(dropped)

    def _accept_replicated(self, ops: list[Put | Delete]) -> list[Put | Delete]:
        """Incoming replicated/copied ops minus retained rows older than those held."""
        return self.retained.accept_ops(ops)

    def _on_replicated(self, ops: list[Put | Delete]) -> None:
        self.retained.apply_ops(ops)

    # -- inbound dispatch -------------------------------------------------------------------

    def _dispatch_table(self) -> dict[type[WireMessage], Callable[[str, Any], None]]:
        """Message type -> handler: quick ones inline, in arrival order; ``task`` for those
        that wait.  Every type of ``LinkMessage`` but ``Ack`` (``Links`` handles it) is here;
        ``tests/test_cluster_messages.py`` checks that none is missing."""
        router, sessions, replicator = self.router, self.sessions, self.replicator
        relay = sessions.relay

        def task(fn: Callable[..., Awaitable[Any]], with_node: bool = True
                 ) -> Callable[[str, Any], None]:
            if with_node:
                return lambda node, msg: self.spawn(fn, node, msg)
            return lambda node, msg: self.spawn(fn, msg)

        def then(fn: Callable[[str, Any], Callable[[], Awaitable[None]] | None]
                 ) -> Callable[[str, Any], None]:
            """Acts inline, in arrival order; what it returns to finish runs in a task."""
            def handle(node: str, msg: Any) -> None:
                finish = fn(node, msg)
                if finish is not None:
                    self.spawn(finish)
            return handle

        return {
            Pub: router.on_pub,
            Dlv: self.deliveries.on_dlv,
            Batch: router.on_batch,
            Redispatch: task(router.on_redispatch),
            SharedDone: router.on_shared_done,
            ShareTrack: lambda node, msg: router.shares.on_track(node, msg),
            RouteAdd: router.registry.on_route,
            RouteDel: router.registry.on_route,
            Handoff: task(self.on_hoff),
            RouteSync: router.registry.on_rsync,
            RouteDigest: router.registry.on_rdig,
            RoutePull: router.registry.on_rpull,
            RetainedQuery: task(router.on_retained_query),
            Repl: then(replicator.on_repl),
            CatchUp: task(replicator.serve_catch_up),
            SessionOpen: task(sessions.on_sopen),
            SessionClose: task(sessions.on_sclose),
            SessionKick: sessions.on_skick,
            WillRegister: lambda node, msg: sessions.on_wreg(msg),
            WillDelete: lambda node, msg: sessions.on_wdel(msg),
            SessionBytes: lambda node, msg: relay.on_sbytes(msg),
            SessionAck: task(relay.on_sack, with_node=False),
            InboundQos2: task(relay.on_q2),
            SessionSubscribe: then(relay.on_ssub),
            SessionUnsubscribe: then(relay.on_sunsub),
        }

    def _on_message(self, node: str, msg: LinkMessage) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ValueError(f"no handler for {type(msg).__name__} messages")
        handler(node, msg)


__all__ = ["DataPlane"]
