"""How a node's shards arrive and leave: sessions loaded and unloaded, shards copied.

Apart from ``DataPlane`` (``plane.py``), which decides *which* shards moved when a view is
installed; this module does the moving, each step bounded so the loop keeps serving:

* a shard gained from a dead or departed owner is loaded at once (``_load``: its persistent
  sessions read and decoded in a worker thread, registered ``LOAD_SLICE`` at a time); one
  taken from a live owner only once that owner confirmed the handoff (``_take_over``,
  ``on_hoff``), since until it has seen the new view it may still accept deliveries for
  those sessions;
* a shard lost is unloaded in one step (``_unload``), its connected clients sent to
  reconnect at the new home;
* a shard this node must catch up on is copied from its owner (``_catch_up``,
  ``_copy_one``), retried on every view change until done or re-placed, and reported
  through Raft (``_report_caught_up``); the stale rows of an earlier life are dropped once
  per catch-up, before the copy (``_drop_local_shard``).

``ShardMoves`` is a mixin of ``DataPlane``: it holds no state of its own and uses the
plane's (declared below for the type checker).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from mqttring.cluster.errors import PeerFailure, PeerUnavailable
from mqttring.cluster.messages import Handoff
from mqttring.cluster.relay import RemoteSession
from mqttring.cluster.replication import SHARD_DATABASES
from mqttring.lsm import Delete, Durability, Put, shard_key
from mqttring.raft.service import CommitError
from mqttring.raft.view import ClusterView, MemberState

if TYPE_CHECKING:
    from mqttring.broker.core import BrokerCore
    from mqttring.broker.session_store import SessionStore
    from mqttring.cluster.delivery import Deliveries
    from mqttring.cluster.links import Links
    from mqttring.cluster.replication import ShardReplicator
    from mqttring.cluster.router import ClusterRouter
    from mqttring.cluster.sessions import ClusterSessions
    from mqttring.cluster.viewchanges import ViewChanges
    from mqttring.config import BrokerConfig
    from mqttring.raft.service import MetadataService

log = logging.getLogger("mqttring.cluster")

#: Tries to report shards caught up through Raft before waiting for the next view.
CAUGHT_UP_ATTEMPTS = 10
#: The longest wait between two tries of a catch-up that failed (it doubles from 0.2 s).
CATCH_UP_RETRY_MAX = 2.0
#: Sessions taken over between two checkpoints (each registers its routes).
LOAD_SLICE = 50
#: Shards copied at once during a catch-up.  Each copy is a few round trips to its source
#: and a durable write, so latency, not work, sets its pace: one at a time, a node joining
#: a fresh 3-node cluster on a loaded 2-core VM took ~40 ms a shard (~35 s for its ~860),
#: and a node lost meanwhile left the shards not yet copied with no other copy (an interop
#: probe killed one 3-15 s after start).  Fresh 3-node cluster, time until no shard was
#: catching up (loaded VM): 21-24 s one at a time, 11.6 s with 8, 9.0 with 16, 5.7 with 32.
#: Memory: at most this many answers in flight, each at most half a link frame.
CATCH_UP_PARALLEL = 32
#: Seconds between two caught-up reports while a catch-up goes on: what is copied counts
#: (as a replica the cluster can fail over to) within about this long, not at the end.
CATCH_UP_REPORT_EVERY = 1.0


class ShardMoves:
    """Loading, unloading and copying shards for ``DataPlane`` (see the module docstring)."""

    __slots__ = ()

    config: BrokerConfig
    node_id: str
    view: ClusterView
    held: set[int]
    links: Links
    metadata: MetadataService
    replicator: ShardReplicator
    session_store: SessionStore
    view_changes: ViewChanges
    core: BrokerCore
    router: ClusterRouter
    sessions: ClusterSessions
    deliveries: Deliveries
    _copying: set[int]
    _dropped: set[int]

    if TYPE_CHECKING:
        def _on_replicated(self, ops: list[Put | Delete]) -> None: ...

    async def _take_over(self, previous: str, shards: set[int], epoch: int) -> None:
        """Load shards taken from a live owner once it confirmed the handoff.

        Until the previous owner has seen this epoch it may still accept deliveries for
        the shards' sessions, and its durable writes of them reach us (as a replica) only
        when they complete: loading before both are over would leave a message it
        acknowledged out of the session we serve.  Deliveries meanwhile are refused here
        and retried by their senders (``ClusterRouter``).
        """
        started = trio.current_time()
        try:
            await self.links.request(previous, Handoff(0, sorted(shards), epoch),
                                     self.deliveries.request_timeout)
            log.info("node %s: %s handed %d shards over in %.3fs", self.node_id, previous,
                     len(shards), trio.current_time() - started)
        except PeerFailure as exc:
            # It died or was cut off: it can no longer write these shards here.
            log.info("handoff of %d shards from %s not confirmed (%s); loading them",
                     len(shards), previous, exc)
        me = self.node_id
        mine = {s for s in shards if self.view.owner(s) == me and s not in self.held}
        if not mine:
            return
        await self._load(mine)
        gone = {s for s in mine if self.view.owner(s) != me}
        if gone:
            self._unload(gone, self.view)  # lost again while loading
        self.held.update(mine - gone)
        self.router.notify_changed()

    async def on_hoff(self, node: str, msg: Handoff) -> None:
        """A new owner asks us to confirm we let go of shards (see ``_take_over``)."""
        ok = await self.deliveries.handed_off(msg.shards, msg.epoch,
                                          self.config.cluster_write_patience)
        self.links.reply(node, msg.req, ok, None if ok else "handoff not confirmed in time")

    async def _load(self, shards: set[int]) -> None:
        """Load the persistent sessions of ``shards`` (only theirs: one range scan per shard,
        read and decoded in a worker thread) and register their routes, ``LOAD_SLICE``
        sessions between two checkpoints.  The shards are not held yet: nothing is
        delivered to their sessions until the caller holds them."""
        stored = await self.session_store.load_shards(shards)
        # Its client, if it was connected, was disconnected because of this move and is
        # on its way: its queue keeps what comes meanwhile (``Session.keep_until``).
        keep_until = time.time() + self.config.moved_session_grace
        count = 0
        for start in range(0, len(stored), LOAD_SLICE):
            if start:
                await trio.lowlevel.checkpoint()
            loaded = []
            for record in stored[start:start + LOAD_SLICE]:
                if record.client_id in self.core.sessions:
                    continue
                # A client connected elsewhere registers again within the grace; one whose
                # edge died with it starts its expiry now (``StoredSession.to_session``).
                session = record.to_session(self.core.session_limits,
                                            grace=self.config.moved_session_grace)
                session.keep_until = keep_until
                self.core.sessions[record.client_id] = session
                loaded.append(session)
            self.router.restore(loaded)
            count += len(loaded)
        if count:
            log.info("node %s: took over %d persistent sessions", self.node_id, count)

    def _unload(self, shards: set[int], view: ClusterView) -> None:
        """Unload the persistent sessions of ``shards`` (no longer ours), in one step: the
        new home loads them once we confirm the handoff, which we do as soon as our view
        is the new one.  The walk hashes only persistent local sessions' ids."""
        session_shard = self.session_store.shard
        for client_id, session in [
            item for item in self.core.sessions.items()
            if not item[1].clean_session and not isinstance(item[1], RemoteSession)
            and session_shard(item[0]) in shards
        ]:
            handler = self.core.clients.get(client_id)
            if handler is not None:
                # It reconnects and finds the session at its new home.
                self.sessions.kick_moved(handler)
            self.router.forget(session, moving=True)
            del self.core.sessions[client_id]
            self.sessions.relay.proxies.pop(client_id, None)
            self.core.wakers.pop(client_id, None)

    async def _catch_up(self, shards: list[int]) -> None:
        """Copy the shards we are catching up on, retrying until done or re-placed.

        A copy fails when its source dies or a link breaks, or while the shard's only
        holder is not up (``_copy_one``); the view then names another source, drops us as
        a target, or brings the holder back, so we wait for a change and try what is
        still ours to copy again, never giving up while the view still waits for us.  A
        shard that fails does not hold up the others: each pass copies what it can and
        reports it caught up, so a shard waiting for a dead last holder costs only itself.
        """
        remaining = list(shards)
        delay = 0.2
        try:
            while True:
                remaining = [s for s in remaining
                             if self.node_id in self.view.shards[s].catching_up]
                failed, failure = await self._copy_pass(remaining)
                remaining = failed
                if not remaining:
                    return
                log.info("catch-up of %d shards interrupted (%s); retrying", len(remaining),
                         failure)
                await self.view_changes.wait(delay)
                delay = min(delay * 2, CATCH_UP_RETRY_MAX)
        finally:
            self._copying.difference_update(shards)
            self._dropped.difference_update(shards)

    async def _copy_pass(self, shards: list[int]) -> tuple[list[int], PeerFailure | None]:
        """One pass of a catch-up: copy ``shards``, ``CATCH_UP_PARALLEL`` at a time, and
        report what is copied every ``CATCH_UP_REPORT_EVERY`` seconds and at the end.
        Returns the shards that failed and the last failure."""
        done: list[int] = []
        failed: list[int] = []
        failure: PeerFailure | None = None
        pending = iter(shards)  # shared by the copiers: each shard is taken once

        async def copier() -> None:
            nonlocal failure
            for shard in pending:
                try:
                    if await self._copy_one(shard):
                        done.append(shard)
                except PeerFailure as exc:
                    failed.append(shard)
                    failure = exc

        async def report_done() -> None:
            batch, done[:] = list(done), []
            if not batch:
                return
            try:
                await self._report_caught_up(batch)
            except BaseException:
                done.extend(batch)  # cut short (the copiers finished): reported at the end
                raise

        async def reporter() -> None:
            while True:
                await trio.sleep(CATCH_UP_REPORT_EVERY)
                await report_done()

        async with trio.open_nursery() as outer:
            outer.start_soon(reporter)
            async with trio.open_nursery() as copiers:
                for _ in range(min(CATCH_UP_PARALLEL, len(shards))):
                    copiers.start_soon(copier)
            outer.cancel_scope.cancel()
        await report_done()
        return failed, failure

    async def _report_caught_up(self, done: list[int]) -> None:
        for attempt in range(CAUGHT_UP_ATTEMPTS):
            still = [s for s in done if self.node_id in self.view.shards[s].catching_up]
            if not still:
                return
            try:
                await self.metadata.mark_caught_up(still)
                log.info("node %s caught up on %d shards", self.node_id, len(still))
                return
            except (CommitError, trio.TooSlowError) as exc:
                # No leader for a moment, or this node is leaving: try again while the
                # view still says these shards wait for us.
                log.info("caught-up report not committed (%s), attempt %d", exc, attempt + 1)
                await trio.sleep(0.2 * (attempt + 1))

    async def _copy_one(self, shard: int) -> bool:
        """Copy one shard from its owner; False if there is no other node to copy from."""
        view = self.view
        source = view.owner(shard)
        if source is None or source == self.node_id:
            return False
        member = view.members.get(source)
        if member is None or member.state not in (MemberState.UP, MemberState.LEAVING):
            # The shard's last holder is down or rejoining (``raft/state.py``): wait for it,
            # and keep our own older copy meanwhile, the best one left should the operator
            # remove that node for good.  (A leaving one is handing its shards over: copy.)
            raise PeerUnavailable(f"{source}, the only holder of shard {shard}, is not up")
        if shard not in self._dropped:
            # Once per catch-up: a retry must keep what live replication wrote since.  Before
            # the copy begins, so that its bookkeeping of live writes (which the copy must
            # not overwrite) covers everything written after the drop.
            await self._drop_local_shard(shard)
            self._dropped.add(shard)
        rows = await self.replicator.copy_shard(shard, source)
        log.debug("shard %d: copied %d rows from %s", shard, rows, source)
        return True

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
