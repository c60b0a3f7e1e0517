"""``ClusterRouter``: one-hop publish routing over the hash ring.

Theory of operation
-------------------
A PUBLISH received by any node (the *edge*) goes, in one hop, to the owner of its topic's
shard (zero hops when the edge owns it).  The owner

1. updates the retained message if RETAIN is set (stored on the shard's R replicas, durably
   for QoS >= 1, before anything is acknowledged);
2. looks up which nodes have matching subscribers (``RouteTable``: node-level routes, never
   per client) and sends the message once to each of them (``dlv``), and to no other node;
3. answers the edge, for QoS >= 1, once every node that got a ``dlv`` has accepted it (a
   node accepts after storing the copies it queues for persistent sessions, whose homes
   replicate them), so the edge's PUBACK/PUBREC promises what a node loss cannot take back.

No loops by construction: a ``dlv`` is only ever delivered to local sessions, never routed
again, and a ``pub`` is routed only by the owner of its shard.  A ``pub`` that reaches a
node that no longer owns its shard (the view changed in flight) is re-sent to the owner of
the newer epoch; every hop increments a counter and a message past ``MAX_HOPS`` is refused,
a safety net against views that disagree for a moment.

The Raft leader has no part in any of this: routing reads the local ``ClusterView`` only.

Shared subscriptions (``$share/{group}/{filter}``) are routed by ``ShareDispatch``
(``mqttring.cluster.shared``): the owner picks one member target per share and message and
asks that node alone; ``accept`` runs it beside the ordinary deliveries, and its
acknowledgement waits for both.  Without shares the cost is one attribute check.

Subscriptions register node-level routes (``radd``/``rdel``) as described in
``mqttring.cluster.routes``; ``subscribe`` returns only when the route is registered where
publishes will look for it, so a client's SUBACK means what it says on every node.

Routes heal themselves (anti-entropy): after every view change and every link
(re)connection this node sends each peer the full set of routes it should hold for us
(``rsync``), and every ``route_sync_interval`` a digest of it (``rdig``), which the peer
answers with ``rpull`` when its copy differs.  An owner refuses to *acknowledge* a QoS >= 1
publish on a shard until every peer that was live when it became the shard's replica has
sent it a full route set since (``routes_complete``): until then the publisher waits, and
past ``routes_wait`` it gets no PUBACK at all, rather than an acknowledgement for a message
that may have missed a subscriber.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import trio

from mqttring.broker.archive import TelemetryArchive
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.cluster.delivery import (
    ByNode,
    Deliveries,
    Item,
    in_frames,
    message_size,
    resolve,
)
from mqttring.cluster.errors import (
    NotOwner,
    PeerFailure,
    PeerUnavailable,
    RemoteError,
    RoutesIncomplete,
    peer_failures_unwrapped,
)
from mqttring.cluster.links import Links
from mqttring.cluster.messages import (
    Batch,
    Dlv,
    DlvEntry,
    Pub,
    PubEntry,
    Redispatch,
    RetainedQuery,
    RetainedRow,
    RetainedRows,
    RouteAdd,
    RouteDel,
    RouteDigest,
    RoutePull,
    RouteSync,
    SharedDone,
)
from mqttring.cluster.routes import (
    RouteKey,
    RouteTable,
    registrar_for,
    route_digest,
    route_shard,
)
from mqttring.cluster.shared import ShareDispatch
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.cluster.wire import DELIVER, ROUTE, runs, unpack
from mqttring.protocol.session import Message, Session
from mqttring.protocol.session5 import PublishProps, props_to_wire
from mqttring.raft.view import ClusterView, MemberState

log = logging.getLogger("mqttring.cluster.router")

#: Rebuilds the ``Message`` objects of encoded QoS 0 frames (see ``LocalRouter.deliver_frames``).
Unpack = Callable[[memoryview | bytes], Iterable[Message]]


class Route(NamedTuple):
    """Where one topic's messages go under one view (cached per topic: ``route``)."""

    #: The owner of the topic's shard (None: no member yet).
    owner: str | None
    #: The nodes with subscribers, and which of their sessions.
    targets: ByNode
    shard: int


MAX_HOPS = 4
#: Topics whose routing answer is cached (cleared when full, a new epoch, a route change).
ROUTE_CACHE_SIZE = 50_000
#: A request to another node may take as long as that node's own patience (it waits for
#: replicas and deliveries on our behalf) plus this; a shorter timeout would re-send a
#: message still being accepted, and the late first copy could overtake newer ones.
REQUEST_SLACK = 5.0
#: Default bound on how long an acknowledged delivery keeps retrying a node that is still
#: in the view but does not answer (the failure detector decides well within it).
DELIVERY_PATIENCE = 30.0


def request_timeout(routes_wait: float, delivery_patience: float) -> float:
    """How long a request to another node may take (see ``REQUEST_SLACK``)."""
    return max(routes_wait, delivery_patience) + REQUEST_SLACK


class ClusterRouter:
    def __init__(
        self,
        node_id: str,
        local: LocalRouter,
        retained: RetainedStore,
        links: Links,
        view: Callable[[], ClusterView],
        metrics: BrokerMetrics,
        deliveries: Deliveries,
        spawn: Callable[..., None],
        held: Callable[[], Iterable[int]] = tuple,
        *,
        routes_wait: float = 10.0,
    ) -> None:
        self.node_id = node_id
        #: How long an owner holds back an acknowledgement while its routes are incomplete.
        self.routes_wait = routes_wait
        #: Owner -> nodes with subscribers; its patience bounds our forwards too.
        self.deliveries = deliveries
        #: Shared with ``deliveries``: both retry by the newer view.
        self.view_changes: ViewChanges = deliveries.view_changes
        self.local = local
        self.retained_store = retained
        self.links = links
        self.view = view
        self.metrics = metrics
        self.spawn = spawn
        #: Every shard ``deliveries.holds`` is true for: whose session routes we assert
        #: (``rsync``).
        self.held = held
        self.routes = RouteTable()
        #: Local subscriptions per (filter, route target); a route is registered while > 0.
        self.local_filters: dict[tuple[str, str], int] = {}
        #: topic -> its ``Route``: valid for one (epoch, routes version); spares the hash,
        #: the wildcard trie walk and the resolution per message.
        self._route_cache: dict[str, Route] = {}
        self._cache_key: tuple[int, int] = (-1, -1)
        #: Set by the server when ``config.archive`` lists topic filters (owner side only).
        self.archive: TelemetryArchive | None = None
        # Anti-entropy state (see the module docstring).
        #: peer -> view epoch of the last full route set it sent us (this incarnation of it).
        self.synced: dict[str, int] = {}
        #: peer -> (incarnation, epoch from which we have seen it in that incarnation).
        self.peer_since: dict[str, tuple[int, int]] = {}
        #: shard -> epoch from which this node holds it as a replica (routes must be complete).
        self.replica_since: dict[int, int] = {}
        self._routes_changed = trio.Event()
        #: Bumped whenever the set of locally wanted routes changes (digest cache key).
        self._local_version = 0
        self._digest_cache: dict[str, tuple[tuple[int, int, int], int]] = {}
        self.route_syncs_sent = 0
        self.route_repairs = 0
        #: One member per share and message (``mqttring.cluster.shared``).
        self.shares = ShareDispatch(node_id, local.chooser.strategy, self.routes.shares_for,
                                    deliveries.deliver, view, links, self.view_changes,
                                    local.copies, metrics, patience=deliveries.patience,
                                    request_timeout=deliveries.request_timeout)

    def route(self, topic: str, view: ClusterView) -> Route:
        """The topic's shard, its owner and {node: the sessions there to deliver to} under
        ``view``."""
        cache = self._route_cache
        epoch, version = self._cache_key
        if view.epoch != epoch or self.routes.version != version or len(cache) >= ROUTE_CACHE_SIZE:
            cache.clear()
            self._cache_key = (view.epoch, self.routes.version)
        else:
            hit = cache.get(topic)
            if hit is not None:
                return hit
        shard = view.shard_for_topic(topic)
        hit = cache[topic] = Route(view.owner(shard), resolve(self.routes.nodes_for(topic), view),
                                   shard)
        return hit

    # -- publish: edge side -----------------------------------------------------------------

    async def publish(self, message: Message) -> None:
        await self.publish_many((message,))

    async def publish_many(self, messages: Sequence[Message]) -> None:
        """Route what one connection had waiting, in order; return once all is accepted.

        Plain QoS 0 leaves at once (packed, unanswered).  The rest goes, per owner, in one
        ``Pub``: one request and one answer for the batch, so a connection with many QoS 1
        publishes in flight pays a round trip per batch, not per message.  Order holds per
        topic: a topic's messages go to one owner, in one ``Pub``, delivered in order.
        """
        view = self.view()
        me = self.node_id
        acked: list[Message] = []
        for message in messages:
            owner, targets, _ = self.route(message.topic, view)
            if owner is not None and owner != me:
                self.metrics.forwarded_to_owner += 1
            if message.qos or message.retain or message.props is not None:
                # (MQTT 5 properties do not fit the packed QoS 0 frames: a ``Pub`` carries
                # them, answered like QoS 1.)
                acked.append(message)
            elif owner is None or owner == me:
                self._accept_plain(message, targets)
            else:
                self.links.send_frames(owner, ROUTE, message.topic, message.encode_qos0(False))
        if acked:
            await self.forward(acked, 1)

    def _pub(self, messages: list[Message], req: int, hops: int, view: ClusterView) -> Pub:
        return Pub(req, [PubEntry(m.topic, m.payload, m.qos, m.retain,
                                  None if m.props is None else m.props.to_wire())
                         for m in messages], self.node_id, view.epoch, hops)

    async def forward(self, messages: list[Message], hops: int) -> None:
        """Have the owners of ``messages`` accept them (this node for its own shards);
        return once all did, following view changes.

        Bounded in time, not attempts: an owner that died is replaced only after the
        failure grace (plus an election when it was the Raft leader), and the publisher's
        acknowledgement must survive that wait rather than give up just before it ends.
        What an owner refused or could not be asked is sent again, in order, to the owner
        of the newer view; what it accepted is not.
        """
        deadline = trio.current_time() + self.deliveries.patience
        while True:
            view = self.view()
            groups: dict[str | None, list[Message]] = {}
            for message in messages:
                groups.setdefault(self.route(message.topic, view).owner, []).append(message)
            failed: list[Message] = []
            if len(groups) == 1:
                [(owner, group)] = groups.items()
                await self._forward_to(owner, group, hops, view, failed)
            else:
                with peer_failures_unwrapped():
                    async with trio.open_nursery() as nursery:
                        for owner, group in groups.items():
                            nursery.start_soon(self._forward_to, owner, group, hops, view,
                                               failed)
            if not failed:
                return
            if trio.current_time() >= deadline:
                raise NotOwner(f"no owner accepted {failed[0].topic!r} "
                               f"(and {len(failed) - 1} more)")
            again = {id(m) for m in failed}
            messages = [m for m in messages if id(m) in again]
            await self.view_changes.wait(0.5)

    async def _forward_to(self, owner: str | None, messages: list[Message], hops: int,
                          view: ClusterView, failed: list[Message]) -> None:
        if owner is None or owner == self.node_id:
            await self.accept(messages, view)
            return
        done = 0
        for run in in_frames(messages, message_size, self.deliveries.frame_budget):
            try:
                await self.links.request(owner, self._pub(run, 0, hops, view),
                                         self.deliveries.request_timeout)
            except (PeerUnavailable, RemoteError) as exc:
                log.debug("forward of %d messages (first %r) to %s failed (%s); retrying",
                          len(messages) - done, run[0].topic, owner, exc)
                failed.extend(messages[done:])
                return
            done += len(run)

    # -- publish: owner side ----------------------------------------------------------------

    async def accept(self, messages: list[Message], view: ClusterView) -> None:
        """Route messages whose shards this node owns, in order; return once all are
        accepted: retained updates stored (one write), every node with subscribers served
        (one ``Dlv`` per node)."""
        for shard in {self.route(m.topic, view).shard for m in messages if m.qos}:
            if not self.routes_complete(shard, view):
                view = await self._await_routes(shard)
        retained = [m for m in messages if m.retain]
        if retained:
            await self.retained_store.update_many(retained, epoch=view.epoch)
        me = self.node_id
        archive = self.archive
        by_node: dict[str, list[Item]] = {}
        shares = self.routes.shares_for
        shared = ([m for m in messages if m.qos and shares(m.topic)]
                  if self.routes.shared_routes else None)
        for message in messages:
            targets = self.route(message.topic, view).targets
            if message.qos == 0:
                self._accept_plain(message, targets)
                continue
            if archive is not None:
                archive.append(message)
            for node, node_targets in targets.items():
                by_node.setdefault(node, []).append((message, node_targets))
                if node != me:
                    self.metrics.deliveries_to_nodes += 1
        if len(by_node) == 1 and not shared:
            [(node, items)] = by_node.items()
            await self.deliveries.deliver(node, items)
        elif by_node or shared:
            with peer_failures_unwrapped():
                async with trio.open_nursery() as nursery:
                    for node, items in by_node.items():
                        nursery.start_soon(self.deliveries.deliver, node, items)
                    if shared:
                        nursery.start_soon(self.shares.run, shared)

    def _accept_plain(self, message: Message, by_node: ByNode) -> None:
        """``accept`` for QoS 0 (retained state already updated): nothing to wait for."""
        if self.archive is not None:
            self.archive.append(message)
        self._fan_out_qos0(message, by_node)

    def _fan_out_qos0(self, message: Message, by_node: dict[str, list[int]]) -> None:
        """QoS 0 needs no acknowledgement: deliver and send without waiting or yielding.

        Not yielding matters beyond this message: a reader that handles a whole chunk of
        publishes without a checkpoint lets each link writer send them as one frame.
        """
        # A retained one as well: the packed frames say RETAIN 0, and a v5 subscriber with
        # Retain As Published must see RETAIN 1 as on one broker (rare: the cost is fine).
        self._fan_out_run(message.topic, message.encode_qos0(False), 1, by_node,
                          lambda _frames: (message,),
                          message.props is not None or message.retain)

    def _fan_out_run(self, topic: str, frames: bytes | memoryview, count: int,
                     by_node: ByNode, unpack: Unpack, props: bool = False) -> None:
        """``count`` encoded QoS 0 PUBLISHes of one topic to every node with routes.

        A node with clean sessions only gets the bytes as they are, appended to its packed
        batch; sessions of a shard (persistent, or one still loading here) need each
        ``Message`` (``unpack(frames)``) for its own path, and so do messages the 3.1.1
        frames cannot carry whole (``props``): MQTT 5 properties, or RETAIN (which Retain
        As Published subscribers see).  Shares choose their member in a task
        (``mqttring.cluster.shared``).
        """
        if self.routes.shared_routes and self.routes.shares_for(topic):
            self.spawn(self.shares.run, list(unpack(frames)))
        for node, targets in by_node.items():
            shards = targets.shards
            if node == self.node_id:
                if shards and not all(self.deliveries.holds(s) for s in shards):
                    # Sessions loading here, or moved away: delivered where they are.
                    self.spawn(self.deliveries.deliver, node,
                               [(m, targets) for m in unpack(frames)])
                else:
                    self.local.deliver_frames(topic, frames, count, unpack)
                continue
            self.metrics.deliveries_to_nodes += count
            if not shards and not props:
                self.links.send_frames(node, DELIVER, topic, frames, count)
                continue
            self.links.send(node, Dlv(0, [DlvEntry(m.topic, m.payload, 0, shards, targets.clean,
                                                   props=props_to_wire(m.props),
                                                   retain=m.retain)
                                          for m in unpack(frames)]))

    # -- inbound messages -------------------------------------------------------------------

    def on_pub(self, node: str, msg: Pub) -> None:
        messages = [Message(e.topic, e.payload, e.qos, e.retain, PublishProps.from_wire(e.props))
                    for e in msg.messages]
        if msg.req == 0 and all(m.qos == 0 and not m.retain for m in messages):
            # QoS 0 re-sent by a node whose view was older: what we own is handled inline,
            # so that arrival order is kept (first hops come in packed batches: ``on_batch``).
            view = self.view()
            rest: list[Message] = []
            for message in messages:
                owner, targets, _ = self.route(message.topic, view)
                if owner == self.node_id:
                    self._accept_plain(message, targets)
                else:
                    rest.append(message)
            if rest:
                self.spawn(self._pub_task, node, 0, rest, msg.hops)
            return
        self.spawn(self._pub_task, node, msg.req, messages, msg.hops)

    def on_batch(self, node: str, msg: Batch) -> None:
        """A packed QoS 0 batch (``mqttring.cluster.wire``), one run of frames at a time.

        ROUTE runs come from an edge (first hop): ``on_pub``'s hot path, with one route
        lookup and one fan-out per run.  DELIVER runs are for this node's clean sessions.
        """
        blob = msg.blob
        view = self.view()
        archive = self.archive
        frames = memoryview(blob)
        deliver = self.local.deliver_frames
        with self.local.wakes_deferred():
            for section, topic, start, stop, count in runs(blob, msg.index):
                if section == DELIVER:
                    deliver(topic, frames[start:stop], count, unpack)
                    continue
                owner, targets, _ = self.route(topic, view)
                if owner is not None and owner != self.node_id:
                    # The view changed in flight: pass them on by ours.
                    self.spawn(self._pub_task, node, 0, list(unpack(frames[start:stop])), 1)
                    continue
                if archive is not None:
                    for message in unpack(frames[start:stop]):
                        archive.append(message)
                self._fan_out_run(topic, frames[start:stop], count, targets, unpack)

    async def _pub_task(self, node: str, req: int, messages: list[Message], hops: int) -> None:
        """Route a ``Pub`` from ``node``: accept what we own, pass the rest on by our view,
        answer once all is accepted (or refuse all of it)."""
        try:
            view = self.view()
            me = self.node_id
            passed = [m for m in messages
                      if self.route(m.topic, view).owner not in (None, me)]
            if passed and hops >= MAX_HOPS:
                raise NotOwner(f"{passed[0].topic!r} exceeded {MAX_HOPS} hops")
            if req == 0 and all(m.qos == 0 and not m.retain for m in messages):
                for message in passed:  # QoS 0 nobody waits for: passed on, unanswered
                    owner = self.route(message.topic, view).owner
                    if owner is not None:
                        self.links.send(owner, self._pub([message], 0, hops + 1, view))
                gone = {id(m) for m in passed}
                mine = [m for m in messages if id(m) not in gone]
                if mine:
                    await self.accept(mine, view)
                return
            await self.forward(messages, hops + 1)  # ours accepted here, the rest passed on
            self.links.reply(node, req, True)
        except PeerFailure as exc:
            log.warning("publish of %d messages (first %r) refused: %s", len(messages),
                        messages[0].topic, exc)
            self.links.reply(node, req, False, str(exc))

    async def on_redispatch(self, node: str, msg: Redispatch) -> None:
        """A peer's share member ended with copies unacknowledged (``cluster.shared``)."""
        await self.shares.on_redispatch(node, msg)

    def on_shared_done(self, node: str, msg: SharedDone) -> None:
        self.shares.on_done(node, msg)

    def on_route(self, node: str, msg: RouteAdd | RouteDel) -> None:
        registrar = registrar_for(msg.target, node)
        if type(msg) is RouteAdd:
            self.routes.add(msg.topic_filter, msg.target, registrar)
        else:
            self.routes.remove(msg.topic_filter, msg.target, registrar)
        self.links.reply(node, msg.req, True)

    def on_rsync(self, node: str, msg: RouteSync) -> None:
        """A peer's full route set for us: it replaces what that peer registered here in
        its own name, and, for each session shard it is the loaded home of, what is
        registered in that home's name."""
        by_registrar: dict[str, set[RouteKey]] = {node: set()}
        for shard in msg.homes:
            by_registrar[f"home:{shard}"] = set()
        for key in msg.routes:
            keys = by_registrar.get(registrar_for(key[1], node))
            if keys is not None:
                keys.add(key)
        # A set computed under a newer view than ours may leave out routes that our view
        # still needs (a shard we still own, that the sender already sees elsewhere): add
        # what it has, remove nothing; our own view change drops what we no longer hold,
        # and the next digest round settles the rest.
        remove = msg.epoch <= self.view().epoch
        added = removed = 0
        for registrar, keys in by_registrar.items():
            a, r = self.routes.replace(registrar, keys, remove)
            added, removed = added + a, removed + r
        if added or removed:
            log.info("routes from %s repaired: %d added, %d removed", node, added, removed)
            self.route_repairs += 1
        self.synced[node] = msg.epoch
        self._signal_routes()

    def on_rdig(self, node: str, msg: RouteDigest) -> None:
        """A peer's digest of its route set for us: ask for the set if ours differs."""
        ours = self.routes.digest_of(node)
        for shard in msg.homes:
            ours ^= self.routes.digest_of(f"home:{shard}")
        if ours != msg.digest:
            self.links.send(node, RoutePull())

    def on_rpull(self, node: str, msg: RoutePull) -> None:
        self.sync_to(node)

    async def on_retained_query(self, node: str, msg: RetainedQuery) -> None:
        rows = [RetainedRow(m.topic, m.payload, m.qos, props_to_wire(m.props))
                for m in self._owned_retained(msg.topic_filter)]
        self.links.reply(node, msg.req, True, RetainedRows(rows))

    # -- subscriptions ----------------------------------------------------------------------

    def route_target(self, session: Session) -> str:
        """Clean sessions live here; persistent ones at the owner of their shard."""
        if session.clean_session:
            return self.node_id
        return f"s:{self.view().shard_for_client(session.client_id)}"

    async def subscribe(self, session: Session, topic_filter: str, qos: int) -> None:
        new = topic_filter not in session.subscriptions
        self.local.add_subscription(session, topic_filter, qos)
        if new:
            key = (topic_filter, self.route_target(session))
            count = self.local_filters.get(key, 0)
            self.local_filters[key] = count + 1
            if count == 0:
                self._local_version += 1
                await self._register(key, "radd")

    def unsubscribe(self, session: Session, topic_filter: str) -> None:
        if topic_filter in session.subscriptions:
            self.local.unsubscribe(session, topic_filter)
            self._release((topic_filter, self.route_target(session)))

    def forget(self, session: Session, *, moving: bool = False) -> None:
        """Drop a session's subscriptions here.  ``moving``: its shard moved to another
        home, which asserts the same session-shard routes once it has loaded the session,
        so they are not withdrawn in between (see ``registrar_for``)."""
        target = self.route_target(session)
        lost = [] if moving else self.local.take_orphans(session)
        self.local.drop_subscriptions(session)
        announce = not (moving and target.startswith("s:"))
        for topic_filter in list(session.subscriptions):
            self._release((topic_filter, target), announce)
        if lost:  # it ended with copies of shares unacknowledged: to other members
            self.spawn(self.shares.redispatch, lost)

    def _release(self, key: tuple[str, str], announce: bool = True) -> None:
        count = self.local_filters.get(key, 0) - 1
        if count > 0:
            self.local_filters[key] = count
            return
        self.local_filters.pop(key, None)
        self._local_version += 1
        if announce:
            self.spawn(self._register, key, "rdel")

    def _route_targets(self, topic_filter: str, view: ClusterView) -> list[str]:
        """Nodes that must hold a filter's route: every replica of its one shard (so a
        promoted replica already knows them), or every live node for a wildcard filter."""
        shard = route_shard(topic_filter, view)
        if shard is None:
            return list(view.live_members()) or [self.node_id]
        return list(view.replicas(shard)) or [self.node_id]

    async def _register(self, key: tuple[str, str], kind: str,
                        nodes: list[str] | None = None) -> None:
        topic_filter, target = key
        if kind == "rdel" and key in self.local_filters:
            return  # subscribed again before the removal went out
        view = self.view()
        async with trio.open_nursery() as nursery:
            for node in nodes or self._route_targets(topic_filter, view):
                nursery.start_soon(self._register_at, node, kind, topic_filter, target)

    async def _register_at(self, node: str, kind: str, topic_filter: str, target: str) -> None:
        if node == self.node_id:
            registrar = registrar_for(target, self.node_id)
            if kind == "radd":
                self.routes.add(topic_filter, target, registrar)
            else:
                self.routes.remove(topic_filter, target, registrar)
            return
        try:
            change = RouteAdd if kind == "radd" else RouteDel
            await self.links.request(node, change(0, topic_filter, target))
        except (PeerUnavailable, RemoteError) as exc:
            # Not lost: the next digest round (or the rsync after the link or the view
            # changes) finds the difference and repairs it.
            log.info("route %s %r at %s not confirmed: %s", kind, topic_filter, node, exc)

    def restore(self, sessions: list[Session]) -> None:
        self.local.restore(sessions)
        for session in sessions:
            target = self.route_target(session)
            for topic_filter in session.subscriptions:
                key = (topic_filter, target)
                count = self.local_filters.get(key, 0)
                self.local_filters[key] = count + 1
                if count == 0:
                    self._local_version += 1
                    self.spawn(self._register, key, "radd")

    # -- retained ---------------------------------------------------------------------------

    def _owned_retained(self, topic_filter: str) -> list[Message]:
        view = self.view()
        return self.retained_store.matching(
            topic_filter, lambda shard: view.owner(shard) == self.node_id
        )

    async def retained(self, topic_filter: str) -> list[Message]:
        """Gather from the owner of the one shard that may hold matches, or from all."""
        if topic_filter.startswith("$SYS"):
            return await self.local.retained(topic_filter)  # each node's own vital signs
        view = self.view()
        targets = self._route_targets(topic_filter, view)
        found: dict[str, Message] = {}

        async def ask(node: str) -> None:
            if node == self.node_id:
                for message in self._owned_retained(topic_filter):
                    found[message.topic] = message
                return
            try:
                answer = await self.links.request(node, RetainedQuery(0, topic_filter),
                                                  expect=RetainedRows)
            except (PeerUnavailable, RemoteError) as exc:
                log.info("retained query %r at %s failed: %s", topic_filter, node, exc)
                return
            for row in answer.rows:
                found[row.topic] = Message(row.topic, row.payload, row.qos, True,
                                           PublishProps.from_wire(row.props))

        async with trio.open_nursery() as nursery:
            for node in targets:
                nursery.start_soon(ask, node)
        return list(found.values())

    # -- membership changes -----------------------------------------------------------------

    def notify_changed(self) -> None:
        """Wake everything waiting for ownership to settle (a new view, shards loaded)."""
        self.view_changes.notify()

    def on_view(self, old: ClusterView, new: ClusterView) -> None:
        """Drop routes to nodes that left; send every peer its full route set again."""
        self.notify_changed()
        me = self.node_id
        live = set(new.live_members())
        for node in old.members:
            if node not in live:
                self.routes.drop_node(node)
            if node not in new.members:
                self.routes.drop_registrar(node)
                self.synced.pop(node, None)
                self.peer_since.pop(node, None)
        held = {s for s in range(new.num_shards) if me in new.replicas(s)}
        self.routes.drop_exact_where(held, new)
        # Our own routes, as a peer's ``rsync`` brings theirs: a shard we just became a
        # replica of (its former replicas all gone) needs the exact routes of our own
        # subscribers too, which ``subscribe`` registered only where it was held then.
        for topic_filter, target in self.local_filters:
            if me in self._route_targets(topic_filter, new):
                self.routes.add(topic_filter, target, registrar_for(target, me))
        lost = self.shares.on_view(new)
        if lost:  # copies held by clean members of a node that died: to other members
            self.spawn(self.shares.redispatch, lost)
        for shard in list(self.replica_since):
            if shard not in held:
                del self.replica_since[shard]
        for shard in held:
            self.replica_since.setdefault(shard, new.epoch)
        for node in self.sync_peers(new):
            incarnation = new.members[node].incarnation
            seen = self.peer_since.get(node)
            if seen is None or seen[0] != incarnation:
                self.peer_since[node] = (incarnation, new.epoch)
            self.sync_to(node, new)
        self._signal_routes()

    # -- anti-entropy -----------------------------------------------------------------------

    def sync_peers(self, view: ClusterView) -> list[str]:
        """Peers that may hold routes for us: every member not marked down."""
        return [n for n, m in view.members.items()
                if n != self.node_id and m.state is not MemberState.DOWN]

    def expected_at(self, node: str, view: ClusterView) -> set[RouteKey]:
        """The routes ``node`` should hold on our behalf under ``view``."""
        return {key for key in self.local_filters if node in self._route_targets(key[0], view)}

    def sync_to(self, node: str, view: ClusterView | None = None) -> None:
        """Send ``node`` the full set of routes it should hold for us."""
        view = view or self.view()
        if node not in view.members:
            return
        keys = self.expected_at(node, view)
        self.links.send_control(node, RouteSync(view.epoch, sorted(keys), sorted(self.held())))
        self.route_syncs_sent += 1

    def send_digests(self) -> None:
        """One anti-entropy round: a digest of our route set to every peer."""
        view = self.view()
        for node in self.sync_peers(view):
            homes = sorted(self.held())
            key = (view.epoch, self._local_version, len(homes))
            cached = self._digest_cache.get(node)
            if cached is None or cached[0] != key:
                digest = route_digest(self.expected_at(node, view))
                cached = self._digest_cache[node] = (key, digest)
            self.links.send(node, RouteDigest(view.epoch, cached[1], homes))

    def routes_complete(self, shard: int, view: ClusterView) -> bool:
        """Has every live peer told us its routes since we became this shard's replica?"""
        since = self.replica_since.get(shard)
        if since is None:
            return True  # not a replica here (forwarding or a view in flight): not our call
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

    async def _await_routes(self, shard: int) -> ClusterView:
        """Wait (bounded by ``routes_wait``) until the shard's routes are known complete."""
        with trio.move_on_after(self.routes_wait):
            while True:
                view = self.view()
                if self.routes_complete(shard, view):
                    return view
                await self._routes_changed.wait()
        missing = sorted(n for n in self.peer_since
                         if self.synced.get(n, -1) < self.replica_since.get(shard, 0))
        raise RoutesIncomplete(f"shard {shard}: no route set yet from {missing}")

    async def publish_local(self, message: Message) -> None:
        """Node-local traffic ($SYS): this node's subscribers only, never the cluster."""
        await self.local.publish_local(message)
