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

Node-level routes are kept true by ``RouteRegistry`` (``mqttring.cluster.registry``),
handed in: it registers subscriptions (``subscribe`` returns only once the route is
registered where publishes will look for it) and heals the route table after view changes
and lost messages.  Its one effect on publishes: an owner acknowledges a QoS >= 1 publish
only once ``routes_complete`` holds for its shard, and past ``routes_wait`` not at all.
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
    message_runs,
    resolve,
)
from mqttring.cluster.errors import (
    NotOwner,
    PeerFailure,
    PeerUnavailable,
    RemoteError,
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
    SharedDone,
)
from mqttring.cluster.registry import RouteRegistry
from mqttring.cluster.retained_query import RetainedQueries
from mqttring.cluster.route_changes import PendingRoute
from mqttring.cluster.shared import ShareDispatch
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.cluster.wire import DELIVER, ROUTE, runs, unpack
from mqttring.protocol.message import Message, new_mid
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import PublishProps, props_to_wire
from mqttring.raft.view import ClusterView

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
    #: A subscription waits for its routes to be registered at other nodes (and a
    #: persistent session's write for its replicas): a reader waiting on that would leave
    #: its client's PINGREQs unanswered through a partition.
    answers_locally = False

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
        registry: RouteRegistry,
    ) -> None:
        self.node_id = node_id
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
        #: Registers our subscriptions and keeps ``routes`` true (``cluster.registry``).
        self.registry = registry
        #: The registry's table, read per message (``route``).
        self.routes = registry.routes
        #: topic -> its ``Route``: valid for one (epoch, routes version); spares the hash,
        #: the wildcard trie walk and the resolution per message.
        self._route_cache: dict[str, Route] = {}
        self._cache_key: tuple[int, int] = (-1, -1)
        #: Set by the server when ``config.archive`` lists topic filters (owner side only).
        self.archive: TelemetryArchive | None = None
        #: One member per share and message (``mqttring.cluster.shared``).
        self.shares = ShareDispatch(node_id, local.chooser.strategy, self.routes.shares_for,
                                    deliveries.deliver, view, links, self.view_changes,
                                    local.copies, metrics, patience=deliveries.patience,
                                    request_timeout=deliveries.request_timeout)
        #: Retained messages for new subscriptions, from their owners (``retained_query``).
        self.retained_queries = RetainedQueries(node_id, local, retained, links, view,
                                                registry, self.view_changes,
                                                deliveries.patience)

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
        route = self.route
        routes = [route(m.topic, view) for m in messages]
        for m in messages:
            if m.qos == 2 and not m.mid:
                # Before the first hop: every retry and hop carries the same identity, so
                # a session that gets two copies takes one (``Session.deliver``).
                m.mid = new_mid()
        self.metrics.forwarded_to_owner += len([r for r in routes if r.owner not in (None, me)])
        # (MQTT 5 properties do not fit the packed QoS 0 frames: a ``Pub`` carries them,
        # answered like QoS 1.)
        plain = [m.qos == 0 and not m.retain and m.props is None for m in messages]
        if not any(plain):  # the QoS 1/2 stream's case: no copies of the lists
            await self.forward(list(messages), 1, (view, routes))
            return
        acked: list[Message] = []
        acked_routes: list[Route] = []
        for message, route_, is_plain in zip(messages, routes, plain, strict=True):
            owner = route_.owner
            if not is_plain or acked:
                # Once one is forwarded, the rest follow it in order: a plain QoS 0 sent
                # packed at once overtook a retained one (or one with properties) before
                # it, on the same topic [MQTT-4.6.0-6].
                acked.append(message)
                acked_routes.append(route_)
            elif owner is None or owner == me:
                self._accept_plain(message, route_.targets)
            else:
                self.links.send_frames(owner, ROUTE, message.topic, message.encode_qos0(False))
        if acked:
            await self.forward(acked, 1, (view, acked_routes))

    def _pub(self, messages: list[Message], req: int, hops: int, view: ClusterView) -> Pub:
        return Pub(req, [PubEntry(m.topic, m.payload, m.qos, m.retain,
                                  None if m.props is None else m.props.to_wire(), m.mid)
                         for m in messages], self.node_id, view.epoch, hops)

    async def forward(self, messages: list[Message], hops: int,
                      routed: tuple[ClusterView, list[Route]] | None = None) -> None:
        """Have the owners of ``messages`` accept them (this node for its own shards);
        return once all did, following view changes.

        Bounded in time, not attempts: an owner that died is replaced only after the
        failure grace (plus an election when it was the Raft leader), and the publisher's
        acknowledgement must survive that wait rather than give up just before it ends.
        What an owner refused or could not be asked is sent again, in order, to the owner
        of the newer view; what it accepted is not.

        ``routed``: the view the caller routed ``messages`` under and their routes, which
        the first round uses if that view is still current (one lookup per message).
        """
        deadline = trio.current_time() + self.deliveries.patience
        while True:
            view = self.view()
            if routed is not None and routed[0] is view:
                routes = routed[1]
            else:
                route = self.route
                routes = [route(m.topic, view) for m in messages]
            routed = None
            failed: list[Message] = []
            owners = {r.owner for r in routes}
            if len(owners) == 1:  # the common case: no grouping
                await self._forward_to(owners.pop(), messages, hops, view, failed, routes)
            else:
                groups: dict[str | None, tuple[list[Message], list[Route]]] = {}
                for message, route_ in zip(messages, routes, strict=True):
                    group = groups.get(route_.owner)
                    if group is None:
                        group = groups[route_.owner] = ([], [])
                    group[0].append(message)
                    group[1].append(route_)
                with peer_failures_unwrapped():
                    async with trio.open_nursery() as nursery:
                        for owner, (group, group_routes) in groups.items():
                            nursery.start_soon(self._forward_to, owner, group, hops, view,
                                               failed, group_routes)
            if not failed:
                return
            if trio.current_time() >= deadline:
                raise NotOwner(f"no owner accepted {failed[0].topic!r} "
                               f"(and {len(failed) - 1} more)")
            again = {id(m) for m in failed}
            messages = [m for m in messages if id(m) in again]
            await self.view_changes.wait(0.5)

    async def _forward_to(self, owner: str | None, messages: list[Message], hops: int,
                          view: ClusterView, failed: list[Message], routes: list[Route],
                          ) -> None:
        if owner is None or owner == self.node_id:
            await self.accept(messages, view, routes)
            return
        done = 0
        for run in message_runs(messages, self.deliveries.frame_budget):
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

    async def accept(self, messages: list[Message], view: ClusterView,
                     routes: list[Route] | None = None) -> None:
        """Route messages whose shards this node owns, in order; return once all are
        accepted: retained updates stored (one write), every node with subscribers served
        (one ``Dlv`` per node).  ``routes``: the messages' routes under ``view``, if the
        caller has them."""
        route = self.route
        if routes is None:
            routes = [route(m.topic, view) for m in messages]
        waited = False
        for shard in {r.shard for r, m in zip(routes, messages, strict=True) if m.qos}:
            if not self.registry.routes_complete(shard, view):
                view = await self.registry.await_routes(shard)
                waited = True
        if waited:
            # Looked up again, in the table that is now complete (and under the view that
            # has it): the routes looked up before the wait lacked what it waited for, and
            # sent on, the owner acknowledged a message that reached no persistent session
            # (the 5-node power-loss run).
            routes = [route(m.topic, view) for m in messages]
        retained = [m for m in messages if m.retain]
        if retained:
            await self.retained_store.update_many(retained, epoch=view.epoch)
        me = self.node_id
        archive = self.archive
        by_node: dict[str, list[Item]] = {}
        shares = self.routes.shares_for
        shared = ([m for m in messages if m.qos and shares(m.topic)]
                  if self.routes.shared_routes else None)
        for message, (_, targets, _) in zip(messages, routes, strict=True):
            if message.qos == 0:
                self._accept_plain(message, targets)
                continue
            if archive is not None:
                archive.append(message)
            for node, node_targets in targets.items():
                by_node.setdefault(node, []).append((message, node_targets))
        self.metrics.deliveries_to_nodes += sum(len(items) for node, items in by_node.items()
                                                if node != me)
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
        messages = [Message(e.topic, e.payload, e.qos, e.retain, PublishProps.from_wire(e.props),
                            e.mid)
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

            def passed_on() -> list[Message]:
                """Those this node does not own (only needed at the hop limit or for QoS 0:
                ``forward`` sorts the rest out itself)."""
                return [m for m in messages if self.route(m.topic, view).owner not in (None, me)]

            if hops >= MAX_HOPS and (passed := passed_on()):
                raise NotOwner(f"{passed[0].topic!r} exceeded {MAX_HOPS} hops")
            if req == 0 and all(m.qos == 0 and not m.retain for m in messages):
                passed = passed_on()
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

    # -- subscriptions ----------------------------------------------------------------------

    def route_target(self, session: Session) -> str:
        return self.registry.route_target(session)

    def subscribe_now(self, session: Session, topic_filter: str, qos: int
                      ) -> PendingRoute | None:
        new = topic_filter not in session.subscriptions
        self.local.add_subscription(session, topic_filter, qos)
        if new:
            return self.registry.add_now((topic_filter, self.route_target(session)))
        return None

    def unsubscribe(self, session: Session, topic_filter: str) -> None:
        if topic_filter in session.subscriptions:
            self.local.unsubscribe(session, topic_filter)
            self.registry.release((topic_filter, self.route_target(session)))

    def forget(self, session: Session, *, moving: bool = False) -> None:
        """Drop a session's subscriptions here.  ``moving``: its shard moved to another
        home, which asserts the same session-shard routes once it has loaded the session,
        so they are not withdrawn in between (see ``registrar_for``)."""
        target = self.route_target(session)
        lost = [] if moving else self.local.take_orphans(session)
        self.local.drop_subscriptions(session)
        announce = not (moving and target.startswith("s:"))
        for topic_filter in list(session.subscriptions):
            self.registry.release((topic_filter, target), announce)
        if lost:  # it ended with copies of shares unacknowledged: to other members
            self.spawn(self.shares.redispatch, lost)

    def restore(self, sessions: list[Session]) -> None:
        self.local.restore(sessions)
        for session in sessions:
            target = self.route_target(session)
            for topic_filter in session.subscriptions:
                self.registry.add_soon((topic_filter, target))

    # -- retained ---------------------------------------------------------------------------

    async def retained(self, topic_filter: str,
                       stalled: Callable[[], None] | None = None) -> list[Message]:
        return await self.retained_queries.gather(topic_filter, stalled)

    async def on_retained_query(self, node: str, msg: RetainedQuery) -> None:
        await self.retained_queries.on_query(node, msg)

    # -- membership changes -----------------------------------------------------------------

    def notify_changed(self) -> None:
        """Wake everything waiting for ownership to settle (a new view, shards loaded)."""
        self.view_changes.notify()

    def on_view(self, old: ClusterView, new: ClusterView, *,
                settle_later: bool = False) -> None:
        """Wake what waits on ownership; re-place copies of shares held at nodes that
        left; have the registry drop their routes and send every peer its route set
        (``settle_later``: the caller awaits ``registry.settle_view`` for the part of that
        proportional to all routes)."""
        self.notify_changed()
        lost = self.shares.on_view(new)
        if lost:  # copies held by clean members of a node that died: to other members
            self.spawn(self.shares.redispatch, lost)
        self.registry.on_view(old, new, settle_later=settle_later)

    async def publish_local(self, message: Message) -> None:
        """Node-local traffic ($SYS): this node's subscribers only, never the cluster."""
        await self.local.publish_local(message)
