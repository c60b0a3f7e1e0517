"""``RouteChanges``: a node-level route added or withdrawn one at a time, as subscriptions
come and go, here and at every node that must hold it.

Apart from ``registry.py`` because it is the fast path a SUBSCRIBE waits for, while the
registry's anti-entropy is the slow path that repairs whatever this one lost; each is
correct only together with the other, but neither needs the other's state.

Registration
------------
A subscription registers a node-level route (``radd``/``rdel``, see
``mqttring.cluster.routes``) at every replica of its filter's shard, or at every up or
leaving node for a wildcard filter; the SUBACK waits for ``add_now``'s answers, so a
client's SUBACK means what it says on every node.  Local subscriptions are counted per
(filter, route target): only the first registers, only the last withdraws.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import trio

from mqttring.cluster.errors import PeerUnavailable, RemoteError
from mqttring.cluster.links import Links
from mqttring.cluster.messages import RouteAdd, RouteDel
from mqttring.cluster.route_sets import RouteSets, wildcard_targets
from mqttring.cluster.routes import RouteKey, RouteTable, registrar_for, route_shard
from mqttring.protocol.session import Session
from mqttring.raft.view import ClusterView

#: A route change's answer, awaited after the change was queued (``Links.request_now``).
Answer = Coroutine[Any, Any, None]

log = logging.getLogger("mqttring.cluster.registry")


class PendingRoute:
    """A route registration announced in its SUBSCRIBE's turn, its answers still to come
    (``RouteRegistry.add_now``): the SUBACK awaits ``confirmed``; a connection that ends
    before that ``abandon``s it (the announcement stands; nobody waits for the answers).
    Not a task: one spawned for it could be cancelled unstarted when this node's life
    ends, and the SUBACK would then wait for ever."""

    __slots__ = ("_answers", "_registry", "_topic_filter")

    def __init__(self, registry: RouteChanges, topic_filter: str,
                 answers: list[tuple[str, Answer]]) -> None:
        self._registry = registry
        self._topic_filter = topic_filter
        self._answers = answers

    async def confirmed(self) -> None:
        answers, self._answers = self._answers, []
        await self._registry._confirm("radd", self._topic_filter, answers)

    def abandon(self) -> None:
        for _, answer in self._answers:
            answer.close()  # never awaited: closed, so that it is not reported as a leak
        self._answers = []


class RouteChanges:
    """Route changes for ``RouteRegistry``, which inherits them and holds their state (set
    up and documented in its ``__init__``)."""

    __slots__ = ()

    node_id: str
    links: Links
    view: Callable[[], ClusterView]
    spawn: Callable[..., None]
    routes: RouteTable
    local_filters: dict[tuple[str, str], int]
    sets: RouteSets
    _local_version: int
    _touched: set[RouteKey] | None

    # -- this node's subscriptions ----------------------------------------------------------

    def route_target(self, session: Session) -> str:
        """Clean sessions live here; persistent ones at the owner of their shard."""
        if session.clean_session:
            return self.node_id
        return f"s:{self.view().shard_for_client(session.client_id)}"

    def add_now(self, key: tuple[str, str]) -> PendingRoute | None:
        """One more local subscription to ``key``; the first registers it, announced in the
        caller's turn, and the caller awaits the answers through what it returns (None:
        another local subscription holds the route already)."""
        count = self.local_filters.get(key, 0)
        self.local_filters[key] = count + 1
        if count:
            return None
        self._local_version += 1
        self.sets.change(key, self.view())
        if self._touched is not None:
            self._touched.add(key)
        return PendingRoute(self, key[0], self._announce(key, "radd"))

    def add_soon(self, key: tuple[str, str]) -> None:
        """``add_now`` without waiting for the registration (sessions restored at load)."""
        count = self.local_filters.get(key, 0)
        self.local_filters[key] = count + 1
        if count == 0:
            self._local_version += 1
            self.sets.change(key, self.view())
            if self._touched is not None:
                self._touched.add(key)
            self.spawn(self._confirm, "radd", key[0], self._announce(key, "radd"))

    def release(self, key: tuple[str, str], announce: bool = True) -> None:
        """One local subscription to ``key`` fewer; the last withdraws it (``announce``)."""
        count = self.local_filters.get(key, 0) - 1
        if count > 0:
            self.local_filters[key] = count
            return
        if self.local_filters.pop(key, None) is not None:
            self.sets.change(key, self.view())
            self.sets.forget_filter(key[0])
        self._local_version += 1
        if self._touched is not None:
            self._touched.add(key)
        if announce:
            self.spawn(self._confirm, "rdel", key[0], self._announce(key, "rdel"))

    def route_targets(self, topic_filter: str, view: ClusterView) -> list[str]:
        """Nodes that must hold a filter's route: every replica of its one shard (so a
        promoted replica already knows them), or every live node for a wildcard filter."""
        shard = route_shard(topic_filter, view)
        if shard is None:
            return wildcard_targets(view) or [self.node_id]
        return list(view.replicas(shard)) or [self.node_id]

    def _announce(self, key: tuple[str, str], kind: str) -> list[tuple[str, Answer]]:
        """Apply a route change here and queue it to every other node that holds the route,
        now, in the caller's turn: each answer is awaited later (``_confirm``).

        Queued before anything awaits, a SUBSCRIBE's registration goes out ahead of a publish
        that another client sends right after it (links are FIFO), so the owner knows the
        route when the publish comes, as on one broker.  Spawned instead, it went out a
        scheduler pass later, and Eclipse Paho's ``client_test5.py`` (which subscribes with
        one client and publishes with another without waiting for the SUBACK) missed
        ``test_request_response``'s message on a cluster node about one run in six."""
        topic_filter, target = key
        change = (RouteAdd if kind == "radd" else RouteDel)(0, topic_filter, target)
        answers = []
        for node in self.route_targets(topic_filter, self.view()):
            if node == self.node_id:
                self._apply(change, self.node_id)
                continue
            try:
                answers.append((node, self.links.request_now(node, change)))
            except PeerUnavailable as exc:
                self._not_confirmed(kind, topic_filter, node, exc)
        return answers

    async def _confirm(self, kind: str, topic_filter: str,
                       answers: list[tuple[str, Answer]]) -> None:
        async def one(node: str, answer: Answer) -> None:
            try:
                await answer
            except (PeerUnavailable, RemoteError) as exc:
                self._not_confirmed(kind, topic_filter, node, exc)

        async with trio.open_nursery() as nursery:
            for node, answer in answers:
                nursery.start_soon(one, node, answer)

    @staticmethod
    def _not_confirmed(kind: str, topic_filter: str, node: str, exc: Exception) -> None:
        # Not lost: the next digest round (or the rsync after the link or the view
        # changes) finds the difference and repairs it.
        log.info("route %s %r at %s not confirmed: %s", kind, topic_filter, node, exc)

    # -- a route change from a peer ---------------------------------------------------------

    def on_route(self, node: str, msg: RouteAdd | RouteDel) -> None:
        self._apply(msg, node)
        self.links.reply(node, msg.req, True)

    def _apply(self, change: RouteAdd | RouteDel, origin: str) -> None:
        """One route change from ``origin`` (this node or a peer) into the table, held in
        the name ``registrar_for`` gives, the same whichever way the change arrived."""
        registrar = registrar_for(change.target, origin)
        if type(change) is RouteAdd:
            self.routes.add(change.topic_filter, change.target, registrar)
        else:
            self.routes.remove(change.topic_filter, change.target, registrar)
