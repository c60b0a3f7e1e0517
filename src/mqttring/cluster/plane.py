"""``DataPlane``: what turns one broker node into a cluster member.

It composes the metadata service (Raft, ``mqttring.raft``), the inter-node links, shard
replication, the cluster router and the cluster session manager around the node's
``BrokerCore``, dispatches inbound link messages to them, and applies every new
``ClusterView``:

* links follow the membership;
* routes whose target changed are re-sent (``ClusterRouter.on_view``);
* shards this node now owns have their persistent sessions loaded from the local store (a
  replica already holds their data) and their routes registered; shards it no longer owns
  are unloaded and their clients sent to reconnect to the new home;
* shards it must catch up on are copied from their owner, then reported through Raft;
* wills of clients whose edge node died are published (``ClusterSessions.on_view``).

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
from mqttring.cluster.links import STREAM_KIND, Links, frame_limit
from mqttring.cluster.replication import SHARD_DATABASES, ShardReplicator
from mqttring.cluster.router import ClusterRouter
from mqttring.cluster.sessions import ClusterSessions, RemoteSession
from mqttring.cluster.wire import BATCH
from mqttring.config import BrokerConfig
from mqttring.lsm import Delete, Durability, LsmStore, Put, shard_key
from mqttring.protocol.session import Session
from mqttring.raft.rpc import derive_key
from mqttring.raft.service import (
    RPC_KEY_PURPOSE,
    CommitError,
    MetadataService,
    cluster_secret,
)
from mqttring.raft.view import EMPTY_VIEW, ClusterView, MemberState

log = logging.getLogger("mqttring.cluster")

CAUGHT_UP_ATTEMPTS = 10


class DataPlane:
    def __init__(self, config: BrokerConfig, store: LsmStore, core: BrokerCore,
                 metrics: BrokerMetrics) -> None:
        self.config = config
        self.node_id = config.node_id
        self.core = core
        self.metadata = MetadataService(config)
        key = derive_key(cluster_secret(config), RPC_KEY_PURPOSE)
        self.links = Links(self.node_id, key, self._on_message,
                           max_frame=frame_limit(config.limits.max_packet_size))
        self.metadata.rpc.register_stream(STREAM_KIND, self.links.serve_stream)
        self.view: ClusterView = EMPTY_VIEW
        self.replicator = ShardReplicator(self.node_id, store, self.links, self.current_view,
                                          self._on_replicated, self._accept_replicated)
        self.retained = RetainedStore(store, config.num_shards, self.replicator,
                                      lambda topic: self.current_view().shard_for_topic(topic),
                                      lambda: self.current_view().epoch)
        self.session_store = SessionStore(store, config.num_shards, self.replicator)
        core.session_store = self.session_store
        local = LocalRouter(core.sessions, self.retained, self.session_store, metrics, core.wake)
        #: Shards this node owns and whose persistent sessions are loaded in memory.
        self.held: set[int] = set()
        self.router = ClusterRouter(self.node_id, local, self.retained, self.links,
                                    self.current_view, metrics, self._persist, self.spawn,
                                    self.held.__contains__)
        core.router = self.router
        self.sessions = ClusterSessions(core, self.node_id, self.links, self.current_view,
                                        self.spawn)
        core.manager = self.sessions
        self._nursery: trio.Nursery | None = None
        self._copying: set[int] = set()
        self._handlers = self._dispatch_table()

    def current_view(self) -> ClusterView:
        return self.view

    async def _persist(self, sessions: list[Session]) -> None:
        await self.core.manager.persist(sessions, Durability.DURABLE)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._guarded, fn, *args)

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            await fn(*args)
        except trio.Cancelled:
            raise
        except Exception:
            # One message's failure must not take the node down with it.
            log.exception("cluster task %s failed", getattr(fn, "__name__", fn))

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[ClusterView] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        await self.retained.load()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.links.run)
            views = self.metadata.subscribe()
            first = await nursery.start(self.metadata.run)
            await self._install(first)
            nursery.start_soon(self._follow, views)
            task_status.started(first)

    async def _follow(self, views: trio.MemoryReceiveChannel[ClusterView]) -> None:
        async for view in views:
            if view.epoch > self.view.epoch or view.leader != self.view.leader:
                await self._install(view)

    async def leave(self) -> None:
        await self.metadata.leave()

    # -- views ------------------------------------------------------------------------------

    async def _install(self, new: ClusterView) -> None:
        old, self.view = self.view, new
        if new.epoch == old.epoch:
            return  # only the leader changed
        self.links.update_peers({
            node: member.cluster for node, member in new.members.items()
            if member.state is not MemberState.DOWN
        })
        if old.epoch == 0:
            # A (re)started node: peers may still hold routes of its previous life.
            for node in new.live_members():
                if node != self.node_id:
                    self.links.send(node, ["rreset", 0])
        self.router.on_view(old, new)
        me = self.node_id
        owned_before = {s for s in range(old.num_shards) if old.epoch and old.owner(s) == me}
        owned_now = {s for s in range(new.num_shards) if new.owner(s) == me}
        lost = owned_before - owned_now
        if lost:
            self.held.difference_update(lost)
            self._unload(lost, new)
        gained = owned_now - owned_before
        if gained:
            await self._load(gained)
            self.held.update(s for s in gained if self.view.owner(s) == me)
            self.router.notify_changed()
        self.retained.forget_shards(lambda s: me in new.replicas(s))
        await self.sessions.on_view(old, new)
        pending = [s for s in new.catching_up_for(me) if s not in self._copying]
        if pending:
            self._copying.update(pending)
            self.spawn(self._catch_up, pending)

    async def _load(self, shards: set[int]) -> None:
        stored = [s for s in await self.session_store.load_all()
                  if self.session_store.shard(s.client_id) in shards]
        loaded = []
        for record in stored:
            if record.client_id in self.core.sessions:
                continue
            session = record.to_session(self.core.session_limits)
            self.core.sessions[record.client_id] = session
            loaded.append(session)
        self.router.restore(loaded)
        if loaded:
            log.info("node %s: took over %d persistent sessions", self.node_id, len(loaded))

    def _unload(self, shards: set[int], view: ClusterView) -> None:
        for client_id, session in list(self.core.sessions.items()):
            if session.clean_session or isinstance(session, RemoteSession):
                continue
            if self.session_store.shard(client_id) not in shards:
                continue
            handler = self.core.clients.get(client_id)
            if handler is not None:
                handler.kick()  # it reconnects and finds the session at its new home
            self.router.forget(session)
            del self.core.sessions[client_id]
            self.sessions.proxies.pop(client_id, None)
            self.core.wakers.pop(client_id, None)

    async def _catch_up(self, shards: list[int]) -> None:
        done: list[int] = []
        try:
            for shard in shards:
                view = self.view
                if self.node_id not in view.shards[shard].catching_up:
                    continue
                source = view.owner(shard)
                if source is None or source == self.node_id:
                    continue
                await self._drop_local_shard(shard)
                rows = await self.replicator.copy_shard(shard, source)
                log.debug("shard %d: copied %d rows from %s", shard, rows, source)
                done.append(shard)
            for attempt in range(CAUGHT_UP_ATTEMPTS):
                still = [s for s in done if self.node_id in self.view.shards[s].catching_up]
                if not still:
                    break
                try:
                    await self.metadata.mark_caught_up(still)
                    log.info("node %s caught up on %d shards", self.node_id, len(still))
                    break
                except CommitError as exc:
                    # No leader for a moment, or this node is leaving: try again while
                    # the view still says these shards wait for us.
                    log.info("caught-up report not committed (%s), attempt %d", exc, attempt + 1)
                    await trio.sleep(0.2 * (attempt + 1))
        finally:
            self._copying.difference_update(shards)

    async def _drop_local_shard(self, shard: int) -> None:
        """Forget what an earlier life of this node held for ``shard`` before copying it."""
        store = self.replicator.store
        prefix = shard_key(shard)
        ops: list[Put | Delete] = []
        for db in SHARD_DATABASES:
            ops.extend(Delete(db, key) for key, _ in await store.scan(db, prefix))
        if ops:
            await store.write(ops, Durability.LAZY)
            self._on_replicated(ops)

    def _accept_replicated(self, ops: list[Put | Delete]) -> list[Put | Delete]:
        """Incoming replicated/copied ops minus retained rows older than those held."""
        return self.retained.accept_ops(ops)

    def _on_replicated(self, ops: list[Put | Delete]) -> None:
        for op in ops:
            if op.db != "retained":
                continue
            if isinstance(op, Put):
                self.retained.apply_row(op.value)
            else:
                self.retained.apply_row(None, RetainedStore.topic_of_key(op.key))

    # -- inbound dispatch -------------------------------------------------------------------

    def _dispatch_table(self) -> dict[str, Callable[[str, list[Any]], None]]:
        router, sessions, replicator = self.router, self.sessions, self.replicator

        def task(fn: Callable[..., Awaitable[Any]], with_node: bool = True
                 ) -> Callable[[str, list[Any]], None]:
            if with_node:
                return lambda node, msg: self.spawn(fn, node, msg)
            return lambda node, msg: self.spawn(fn, msg)

        def rreset(node: str, msg: list[Any]) -> None:
            router.routes.drop_node(node)

        return {
            "pub": router.on_pub,
            "dlv": router.on_dlv,
            BATCH: router.on_batch,
            "radd": router.on_route,
            "rdel": router.on_route,
            "rreset": rreset,
            "retq": task(router.on_retained_query),
            "repl": task(replicator.on_repl),
            "cu": task(replicator.serve_catch_up),
            "sopen": task(sessions.on_sopen),
            "sclose": task(sessions.on_sclose, with_node=False),
            "skick": lambda node, msg: sessions.on_skick(msg),
            "wreg": lambda node, msg: sessions.on_wreg(msg),
            "wdel": lambda node, msg: sessions.on_wdel(msg),
            "sbytes": lambda node, msg: sessions.on_sbytes(msg),
            "sack": task(sessions.on_sack, with_node=False),
            "q2": task(sessions.on_q2),
            "ssub": task(sessions.on_ssub, with_node=False),
            "sunsub": task(sessions.on_sunsub, with_node=False),
        }

    def _on_message(self, node: str, msg: list[Any]) -> None:
        handler = self._handlers.get(msg[0])
        if handler is None:
            raise ValueError(f"unknown message kind {msg[0]!r}")
        handler(node, msg)


__all__ = ["DataPlane"]
