"""``RouteRegistry``: where node-level routes are registered, and how they heal.

Apart from ``ClusterRouter`` because it answers a different question.  The router asks,
per message, "where does this go?" and reads the ``RouteTable`` for the answer; the registry
keeps that table true: it registers this node's subscriptions where publishes will look for
them, accepts what peers register here, and repairs both after view changes and lost
messages.  Its state (counts of local filters, which peer synced when) is never read on the
publish path except through ``routes_complete``, the one question the owner asks before it
acknowledges.

Registration (a route added or withdrawn as subscriptions come and go, here and at the nodes
that hold it) is ``RouteChanges`` (``mqttring.cluster.route_changes``), which
``RouteRegistry`` inherits; this module is how the table heals.

Anti-entropy
------------
After every view change and every link (re)connection this node sends each peer the full set
of routes it should hold for us (``rsync``), and every ``route_sync_interval`` a digest of it
(``rdig``), which the peer answers with ``rpull`` when its copy differs.  An owner refuses to
*acknowledge* a QoS >= 1 publish on a shard until every peer that was live when it became the
shard's replica has sent it a full route set since (``routes_complete``): until then the
publisher waits, and past ``routes_wait`` it gets no PUBACK at all, rather than an
acknowledgement for a message that may have missed a subscriber.

Persistent sessions' routes (``s:N``) are asserted by the loaded home of session shard N,
and a node keeps them when that home goes.  A node that starts afresh (a restart, a power
loss of the whole cluster) knows none of them until, for every session shard, a loaded home
has sent its set (``RouteSync.homes``) or this node is that home: until then it counts no
shard's routes complete (``_all_homes_known``).  Without that, an owner back from a power
loss acknowledged messages that it queued for none of the persistent sessions whose home
had not loaded yet.  With that, only a set (or digest) computed under the receiver's own view
epoch counts, and only it is exact (see ``_apply_rsync``): before both rules the fault
suite's 5-node `power-loss` run lost 1-3 acknowledged messages in 4 of 8 runs.

A wildcard filter's route goes to the nodes that are ``UP`` or ``LEAVING`` (``ROUTED_STATES``)
only, yet a node rejoining after a power loss is the owner of what it held last while it is
still ``JOINING``.  The sets its peers send it meanwhile leave every wildcard route out, so
none of them counts towards completeness: only sets sent under a view in which it is a
wildcard target (``live_since``) do, for its peers and for the homes they name.  Before,
an owner counted a set from its joining view as complete once it was up, and acknowledged
messages that reached none of the wildcard subscribers whose routes were still on the way
(the 5-node `power-loss` run).  With that, and with the owner looking a message's routes up
again after such a wait (``ClusterRouter.accept``), 10 of 10 such runs lost nothing,
against 1 of 6 losing 3 acknowledged messages before (2026-11-28).

What a view change costs the loop: the data plane installs a view with
``on_view(settle_later=True)``, which does at once only what depends on the members that
went, then awaits ``settle_view``: dropping the exact routes of shards no longer held, adding
our own routes where we became a target, and computing each peer's set, all in slices of
``SETTLE_SLICE`` with a checkpoint between them (one step of 1-4 s with 50k local filters and
100k routes made nodes fence themselves).  A shard we became a replica of in that view is
not complete until our own routes are in; a set computed in slices goes out in one step,
after the local routes added or released meanwhile were looked at again.  Which routes
each peer should hold, and the digests of those sets, are computed by ``RouteSets``
(``mqttring.cluster.route_sets``), which hashes each filter and each digest once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from mqttring.cluster.errors import RoutesIncomplete
from mqttring.cluster.links import Links, in_frames
from mqttring.cluster.messages import RouteDigest, RoutePull, RouteSync
from mqttring.cluster.route_changes import RouteChanges
from mqttring.cluster.route_sets import ROUTED_STATES, RouteSets, wildcard_targets
from mqttring.cluster.routes import (
    RouteKey,
    RouteTable,
    registrar_for,
    route_digest,
)
from mqttring.raft.view import ClusterView, MemberState

log = logging.getLogger("mqttring.cluster.registry")

__all__ = ["ROUTED_STATES", "RouteRegistry", "route_key_size", "wildcard_targets"]

#: Routes or local filters looked at between two checkpoints after a view change.
SETTLE_SLICE = 1000


def route_key_size(key: RouteKey) -> int:
    """What one route takes in a ``RouteSync`` (its two strings and their msgpack headers)."""
    return len(key[0].encode()) + len(key[1].encode()) + 8


class RouteRegistry(RouteChanges):
    def __init__(
        self,
        node_id: str,
        links: Links,
        view: Callable[[], ClusterView],
        spawn: Callable[..., None],
        held: Callable[[], Iterable[int]] = tuple,
        *,
        routes_wait: float = 10.0,
    ) -> None:
        self.node_id = node_id
        self.links = links
        self.view = view
        self.spawn = spawn
        #: How long an owner holds back an acknowledgement while its routes are incomplete.
        self.routes_wait = routes_wait
        #: Every shard ``deliveries.holds`` is true for: whose session routes we assert
        #: (``rsync``).
        self.held = held
        self.routes = RouteTable()
        #: Local subscriptions per (filter, route target); a route is registered while > 0.
        self.local_filters: dict[tuple[str, str], int] = {}
        # Anti-entropy state (see the module docstring).
        #: peer -> view epoch of the last full route set it sent us (this incarnation of it).
        self.synced: dict[str, int] = {}
        #: peer -> (incarnation, epoch from which we have seen it in that incarnation).
        self.peer_since: dict[str, tuple[int, int]] = {}
        #: shard -> epoch from which this node holds it as a replica (routes must be complete).
        self.replica_since: dict[int, int] = {}
        #: Session shards whose persistent sessions' routes we have from their loaded home
        #: (its ``RouteSync.homes``), in this process's life; see the module docstring.
        self.homes_known: set[int] = set()
        self._all_homes_known = False
        #: Epoch from which this node is a wildcard route target in this life (``UP`` or
        #: ``LEAVING``), None while it is not: a set a peer sent before that left out
        #: every wildcard route (see ``routes_complete``).
        self.live_since: int | None = None
        self._routes_changed = trio.Event()
        #: Bumped whenever the set of locally wanted routes changes.
        self._local_version = 0
        #: Which of ``local_filters`` each peer should hold, and the digests of those sets.
        self.sets = RouteSets(node_id, self.local_filters)
        #: peer -> (epoch, next part, routes so far) of a route set arriving in parts.
        self._rsync_parts: dict[str, tuple[int, int, list[RouteKey]]] = {}
        #: peer -> (epoch, homes) of a full set it sent under a newer view than ours.
        self._ahead: dict[str, tuple[int, list[int]]] = {}
        self.route_syncs_sent = 0
        self.route_repairs = 0
        #: Epoch of a view whose own-route work (``settle_view``) is still to do: shards we
        #: became a replica of in it are not complete until it is done.
        self._settling: int | None = None
        #: Epoch of the view ``settle_view`` is sending full sets for (meanwhile a digest
        #: round skips the peers whose digest it has not computed yet).
        self._sets_coming: int | None = None
        #: Local route keys added or released while ``settle_view`` computes sets in
        #: slices: looked at again before the sets go out.
        self._touched: set[RouteKey] | None = None


    def on_rsync(self, node: str, msg: RouteSync) -> None:
        """A peer's full route set for us, or one part of it (see ``RouteSync``)."""
        gathered = self._rsync_parts.pop(node, None)  # a new set replaces one cut short
        if msg.part == 0:
            routes = msg.routes if msg.last else list(msg.routes)
        elif gathered is None or gathered[:2] != (msg.epoch, msg.part):
            log.info("route set from %s: part %d out of sequence, dropped (it is sent "
                     "again)", node, msg.part)
            return
        else:
            routes = gathered[2]
            routes.extend(msg.routes)
        if not msg.last:
            self._rsync_parts[node] = (msg.epoch, msg.part + 1, routes)
            return
        self._apply_rsync(node, msg.epoch, routes, msg.homes)

    def _apply_rsync(self, node: str, epoch: int, routes: list[RouteKey],
                     homes: list[int]) -> None:
        """It replaces what that peer registered here in its own name, and, for each
        session shard it is the loaded home of, what is registered in that home's name."""
        by_registrar: dict[str, set[RouteKey]] = {node: set()}
        for shard in homes:
            by_registrar[f"home:{shard}"] = set()
        for key in routes:
            keys = by_registrar.get(registrar_for(key[1], node))
            if keys is not None:
                keys.add(key)
        # Only a set computed under our own view is exact.  One from a newer view may leave
        # out routes that our view still needs (a shard we still own, that the sender
        # already sees elsewhere); one from an older view may leave out routes we became a
        # target of since (we were not live in it: a node back from a power loss is the
        # owner of what it held last while it rejoins).  Of those: add what it has, remove
        # nothing; our own view change drops what we no longer hold, and the sender's next
        # set (each of its view changes sends one) settles the rest.
        ours = self.view().epoch
        remove = epoch == ours
        added = removed = 0
        for registrar, keys in by_registrar.items():
            a, r = self.routes.replace(registrar, keys, remove)
            added, removed = added + a, removed + r
        if added or removed:
            log.info("routes from %s repaired: %d added, %d removed", node, added, removed)
            self.route_repairs += 1
        if epoch == ours:
            self._count_synced(node, epoch, homes)
        elif epoch > ours:
            # Complete only under that view: counted once we have it (``on_view``).
            self._ahead[node] = (epoch, homes)
        # An older set counts for nothing: the sender sends another with each view change.
        self._signal_routes()

    def _count_synced(self, node: str, epoch: int, homes: Iterable[int]) -> None:
        """``node``'s routes for us are complete as of ``epoch`` (our own view's), and so
        are those of the session shards it is the loaded home of."""
        self.synced[node] = max(self.synced.get(node, -1), epoch)
        if self.live_since is not None and epoch >= self.live_since:
            # A set computed while we were no wildcard target left out the wildcard routes
            # of those homes' sessions: it tells us nothing about them.
            self.homes_known.update(homes)

    def on_rdig(self, node: str, msg: RouteDigest) -> None:
        """A peer's digest of its route set for us: ask for the set if ours differs.  If it
        is the same, we hold the routes of the session shards it is home of (a shard it
        loaded since its last full set is named here first)."""
        ours = self.routes.digest_of(node)
        for shard in msg.homes:
            ours ^= self.routes.digest_of(f"home:{shard}")
        if ours != msg.digest:
            self.links.send(node, RoutePull())
        elif msg.epoch == self.view().epoch and (self.synced.get(node, -1) < msg.epoch or
                                                 not self.homes_known.issuperset(msg.homes)):
            self._count_synced(node, msg.epoch, msg.homes)
            self._signal_routes()

    def on_rpull(self, node: str, msg: RoutePull) -> None:
        self.sync_to(node)

    # -- membership changes -----------------------------------------------------------------

    def on_view(self, old: ClusterView, new: ClusterView, *,
                settle_later: bool = False) -> None:
        """Drop routes to nodes that left; send every peer its full route set again.

        ``settle_later``: what is proportional to every route and local filter (dropping
        the exact routes of shards no longer held, our own routes for shards newly held,
        the route sets) is left to ``settle_view``, which the caller awaits next, with no
        other view installed in between (the data plane's install)."""
        me = self.node_id
        self._track_life(old, new)
        live = set(new.live_members())
        for node in old.members:
            if node not in live:
                self.routes.drop_node(node)
            if node not in new.members:
                self.routes.drop_registrar(node)
                self.synced.pop(node, None)
                self.peer_since.pop(node, None)
                self._rsync_parts.pop(node, None)
                self._ahead.pop(node, None)
        held = {s for s in range(new.num_shards) if me in new.replicas(s)}
        if not settle_later:
            self.routes.drop_exact_where(held, new)
            self._add_own_routes(list(self.local_filters), new)
        for shard in list(self.replica_since):
            if shard not in held:
                del self.replica_since[shard]
        for shard in held:
            self.replica_since.setdefault(shard, new.epoch)
        for node, (epoch, homes) in list(self._ahead.items()):
            if epoch <= new.epoch:
                del self._ahead[node]
                if epoch == new.epoch:
                    self._count_synced(node, epoch, homes)
        for node in self.sync_peers(new):
            incarnation = new.members[node].incarnation
            seen = self.peer_since.get(node)
            if seen is None or seen[0] != incarnation:
                self.peer_since[node] = (incarnation, new.epoch)
            if not settle_later:
                self.sync_to(node, new)
        self._settling = new.epoch if settle_later else None
        self._signal_routes()

    def _add_own_routes(self, keys: Iterable[RouteKey], view: ClusterView) -> None:
        """Our own routes, as a peer's ``rsync`` brings theirs: a shard we just became a
        replica of (its former replicas all gone) needs the exact routes of our own
        subscribers too, which ``add_now`` registered only where it was held then."""
        me = self.node_id
        local = self.local_filters
        for topic_filter, target in self.sets.among(keys, self.sets.targets_at(me, view), view):
            if (topic_filter, target) in local:
                self.routes.add(topic_filter, target, registrar_for(target, me))

    async def settle_view(self, view: ClusterView, *, slice_size: int = SETTLE_SLICE) -> None:
        """``on_view(..., settle_later=True)``'s remaining work, ``slice_size`` routes or
        filters between two checkpoints: drop the exact routes of shards no longer held
        here, add our own routes where we are now a target, then send each peer its full
        route set (computed in slices, sent in one step, see ``_sync_sliced``).  Shards we
        became a replica of in ``view`` count as complete only once it is done."""
        if self._settling != view.epoch:
            return
        self._sets_coming = view.epoch
        try:
            await self._settle(view, slice_size)
        finally:
            self._sets_coming = None

    async def _settle(self, view: ClusterView, slice_size: int) -> None:
        me = self.node_id
        held = {s for s in range(view.num_shards) if me in view.replicas(s)}
        routes = self.routes
        pending = routes.keys()
        for start in range(0, len(pending), slice_size):
            await trio.lowlevel.checkpoint()
            routes.drop_exact_among(pending[start:start + slice_size], held, view)
        own = list(self.local_filters)
        for start in range(0, len(own), slice_size):
            await trio.lowlevel.checkpoint()
            self._add_own_routes(own[start:start + slice_size], view)
        self._settling = None
        self._signal_routes()
        for node in self.sync_peers(view):
            await self._sync_sliced(node, view, slice_size)

    async def _sync_sliced(self, node: str, view: ClusterView, slice_size: int) -> None:
        """``sync_to`` with the set computed, hashed and cut into parts in slices.  Its
        parts go out together, after the keys added or released meanwhile were looked at
        again: a set that left out a route registered while it was computed would remove
        it at the peer (the ``radd`` went out before the set)."""
        if node not in view.members:
            return
        touched: set[RouteKey] = set()
        outer, self._touched = self._touched, touched
        digest = 0
        budget = self.links.max_frame // 2
        keys: set[RouteKey] = set()
        parts: list[list[RouteKey]] = [[]]
        used = 0
        try:
            local = list(self.local_filters)
            at = self.sets.peer_targets(node, view)
            for start in range(0, len(local), slice_size):
                await trio.lowlevel.checkpoint()
                found = self.sets.among(local[start:start + slice_size], at, view)
                keys.update(found)
                digest ^= route_digest(found)
                for key in found:  # ``in_frames``, a slice at a time
                    size = route_key_size(key)
                    if parts[-1] and used + size > budget:
                        parts.append([])
                        used = 0
                    parts[-1].append(key)
                    used += size
        finally:
            self._touched = outer
            if outer is not None:
                outer.update(touched)
        for key in touched:
            now = key in self.local_filters and bool(self.sets.among((key,), at, view))
            if now == (key in keys):
                continue
            digest ^= route_digest((key,))
            if now:
                keys.add(key)
                if parts[-1] and used + route_key_size(key) > budget:
                    parts.append([])
                    used = 0
                parts[-1].append(key)
                used += route_key_size(key)
            else:
                keys.discard(key)
                next(part for part in parts if key in part).remove(key)
        if self.view().epoch == view.epoch:
            self._send_parts(node, view, [part for part in parts if part] or [[]])
            # The digest of exactly that set: the next rounds need not hash it all again.
            self.sets.remember_digest(node, view.epoch, digest)

    def _track_life(self, old: ClusterView, new: ClusterView) -> None:
        """Start ``live_since`` when we become a wildcard route target (again, or in a new
        life); clear it while we are not one."""
        before, now = old.members.get(self.node_id), new.members.get(self.node_id)
        if now is None or now.state not in ROUTED_STATES:
            self.live_since = None
        elif (self.live_since is None or before is None or before.state not in ROUTED_STATES
              or before.incarnation != now.incarnation):
            self.live_since = new.epoch

    # -- anti-entropy -----------------------------------------------------------------------

    def sync_peers(self, view: ClusterView) -> list[str]:
        """Peers that may hold routes for us: every member not marked down."""
        return [n for n, m in view.members.items()
                if n != self.node_id and m.state is not MemberState.DOWN]

    def expected_at(self, node: str, view: ClusterView) -> set[RouteKey]:
        """The routes ``node`` should hold on our behalf under ``view``."""
        return self.sets.expected_at(node, view)

    def sync_to(self, node: str, view: ClusterView | None = None) -> None:
        """Send ``node`` the full set of routes it should hold for us."""
        view = view or self.view()
        if node not in view.members:
            return
        self._send_set(node, view, self.expected_at(node, view))

    def _send_set(self, node: str, view: ClusterView, expected: set[RouteKey]) -> None:
        # In parts of at most half a frame: a part too big for any frame would be dropped,
        # and the peer would never count our routes complete.
        keys = sorted(expected)
        self._send_parts(node, view,
                         list(in_frames(keys, route_key_size, self.links.max_frame // 2))
                         or [[]])

    def _send_parts(self, node: str, view: ClusterView, parts: list[list[RouteKey]]) -> None:
        homes = sorted(self.held())
        self.homes_known.update(homes)  # ours, for good (see ``routes_complete``)
        for number, part in enumerate(parts):
            self.links.send_control(node, RouteSync(view.epoch, part, homes, number,
                                                    number == len(parts) - 1))
        self.route_syncs_sent += 1

    def send_digests(self) -> None:
        """One anti-entropy round: a digest of our route set to every peer (computed once
        per view and peer, then updated route by route: ``RouteSets.change``)."""
        view = self.view()
        homes = sorted(self.held())
        self.homes_known.update(homes)
        for node in self.sync_peers(view):
            digest = self.sets.digest(node, view)
            if digest is None:
                if self._sets_coming == view.epoch:
                    continue  # its full set is on its way, with the digest computed in slices
                digest = self.sets.compute_digest(node, view)
            self.links.send(node, RouteDigest(view.epoch, digest, homes))

    def routes_complete(self, shard: int, view: ClusterView) -> bool:
        """Has every live peer told us its routes since we became this shard's replica, and
        do we know the persistent sessions' routes of every session shard?"""
        since = self.replica_since.get(shard)
        if since is None:
            return True  # not a replica here (forwarding or a view in flight): not our call
        if self.live_since is None:
            return False  # no peer sends us its wildcard routes (we are joining, or down)
        # Sets sent before we became a wildcard target left those routes out.
        since = max(since, self.live_since)
        if self._settling is not None and since >= self._settling:
            return False  # our own routes for it are still being added (``settle_view``)
        if not self._all_homes_known:
            # Ours count too, for good: a home that hands a shard on keeps its routes.
            self.homes_known.update(self.held())
            if len(self.homes_known) < view.num_shards:
                return False
            self._all_homes_known = True  # for good: a home that goes leaves its routes
        synced = self.synced
        for node, (_, first) in self.peer_since.items():
            if synced.get(node, -1) < max(since, first):
                member = view.members.get(node)
                if member is not None and member.state is MemberState.UP:
                    return False
        return True

    def _signal_routes(self) -> None:
        event, self._routes_changed = self._routes_changed, trio.Event()
        event.set()

    async def await_routes(self, shard: int) -> ClusterView:
        """Wait (bounded by ``routes_wait``) until the shard's routes are known complete."""
        with trio.move_on_after(self.routes_wait):
            while True:
                view = self.view()
                if self.routes_complete(shard, view):
                    return view
                await self._routes_changed.wait()
        since = max(self.replica_since.get(shard, 0), self.live_since or 0)
        missing = sorted(n for n in self.peer_since if self.synced.get(n, -1) < since)
        unknown = self.view().num_shards - len(self.homes_known)
        if self.live_since is None:
            raise RoutesIncomplete(f"shard {shard}: this node is not up yet (no peer sends "
                                   "it wildcard routes)")
        raise RoutesIncomplete(f"shard {shard}: no route set yet from {missing}"
                               + (f"; {unknown} session shards have no loaded home yet"
                                  if unknown > 0 else ""))
