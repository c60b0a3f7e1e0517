"""Retained messages for a new subscription, gathered from the nodes that own them.

A node holds the retained messages of the shards it owns (and replicates); a SUBSCRIBE at
any node must see all that match its filter, as on one broker.  An exact filter lives in
one shard, so one owner is asked; a wildcard may match any shard, so every node the route
registry names for it is asked (``RouteRegistry.route_targets``), in parallel, each
answering in pages (``RetainedQuery``/``RetainedRows``) that fit a link frame.  A node that
does not answer still owns its shards until the view says otherwise: the query waits for a
view in which others own them and asks those (``patience`` bounds it), rather than answer
the subscriber with a silent part of the matches.

Apart from ``ClusterRouter`` (which answers ``Router.retained`` with it) because it is a
read of stored state, not routing: it never touches a publish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter
from mqttring.cluster.delivery import in_frames, message_size
from mqttring.cluster.errors import PeerUnavailable, RemoteError
from mqttring.cluster.links import Links
from mqttring.cluster.messages import RetainedQuery, RetainedRow, RetainedRows
from mqttring.cluster.registry import RouteRegistry
from mqttring.cluster.routes import route_shard
from mqttring.cluster.viewchanges import ViewChanges
from mqttring.protocol.message import Message
from mqttring.protocol.session5 import PublishProps, props_to_wire
from mqttring.raft.view import ClusterView

log = logging.getLogger("mqttring.cluster.router")

#: Rounds of a retained query at most: the first by this node's view, then one per newer
#: view an owner answered by (views change a few times in a failover, not continually).
GATHER_ROUNDS = 4


class RetainedQueries:
    def __init__(self, node_id: str, local: LocalRouter, retained: RetainedStore, links: Links,
                 view: Callable[[], ClusterView], registry: RouteRegistry,
                 view_changes: ViewChanges, patience: float) -> None:
        self.node_id = node_id
        self.local = local
        self.retained_store = retained
        self.links = links
        self.view = view
        self.registry = registry
        self.view_changes = view_changes
        #: How long a query waits for the shards of a node that does not answer to move.
        self.patience = patience

    def _owned_retained(self, topic_filter: str) -> list[Message]:
        view = self.view()
        return self.retained_store.matching(
            topic_filter, lambda shard: view.owner(shard) == self.node_id
        )

    async def gather(self, topic_filter: str,
                     stalled: Callable[[], None] | None = None) -> list[Message]:
        """Gather from the owner of the one shard that may hold matches, or from all.

        Each owner answers for the shards it owns in a view at least as new as the one it
        was chosen by (``RetainedQuery.epoch``); one that answered under a newer view may
        have lost some of them meanwhile, so the query is asked again by the newer view
        (what was found is kept: an answer adds topics, never removes one), a few times at
        most and within ``patience``.  A probe killed a node and subscribed at once: the
        owners that took its shards over had not seen that view yet and answered for none
        of them, and the subscriber got 28 of 30 retained messages, silently.

        ``stalled``: called when a node does not answer and the query waits for a view in
        which others own its shards (the SUBACK then leaves without waiting for it)."""
        if topic_filter.startswith("$SYS"):
            return await self.local.retained(topic_filter)  # each node's own vital signs
        found: dict[str, Message] = {}
        deadline = trio.current_time() + self.patience
        for _ in range(GATHER_ROUNDS):
            view = self.view()
            if not await self._gather_once(topic_filter, view, found, deadline, stalled):
                break
            if trio.current_time() >= deadline:
                break
        return list(found.values())

    async def _gather_once(self, topic_filter: str, view: ClusterView,
                           found: dict[str, Message], deadline: float,
                           stalled: Callable[[], None] | None = None) -> bool:
        """One round of ``gather`` by ``view``; True if an owner answered by a newer view
        (the round may have missed shards it no longer owned there)."""
        targets = self.registry.route_targets(topic_filter, view)
        newer = False

        async def ask(node: str, asked_in: ClusterView) -> None:
            nonlocal newer
            if node == self.node_id:
                for message in self._owned_retained(topic_filter):
                    found[message.topic] = message
                newer = newer or self.view().epoch > asked_in.epoch
                return
            after = ""
            while True:
                try:
                    answer = await self.links.request(
                        node, RetainedQuery(0, topic_filter, after, asked_in.epoch),
                        expect=RetainedRows)
                except (PeerUnavailable, RemoteError) as exc:
                    await ask_instead(node, asked_in, exc)
                    return
                newer = newer or answer.epoch > asked_in.epoch
                for row in answer.rows:
                    found[row.topic] = Message(row.topic, row.payload, row.qos, True,
                                               PublishProps.from_wire(row.props), row.mid)
                if not answer.more or not answer.rows:
                    return
                after = answer.rows[-1].topic

        async def ask_instead(node: str, asked_in: ClusterView, failure: Exception) -> None:
            """A node that does not answer (killed a moment ago, cut off) still owns its
            shards until the view says otherwise; their replicas hold the same retained
            messages.  Wait (bounded by ``patience``, as a publish waits for an owner) for
            a view in which others own them, and ask those; returning without them gave a
            subscriber a silent two thirds of the matches (a probe: 688 of 1000)."""
            # Only the shards it owned that may hold matches: a replica asked for an exact
            # filter answers for none of them (waiting on it held a SUBACK through a
            # failover for nothing).
            one = route_shard(topic_filter, asked_in)
            lost = [s for s in (range(asked_in.num_shards) if one is None else (one,))
                    if asked_in.owner(s) == node]
            if not lost:
                return
            if stalled is not None:
                stalled()
            while (remaining := deadline - trio.current_time()) > 0:
                now = self.view()
                owners = {now.owner(s) for s in lost} - {None}
                if now.epoch != asked_in.epoch and node not in owners:
                    for owner in sorted(owners):  # (an answer covers all its shards)
                        nursery.start_soon(ask, owner, now)
                    return
                await self.view_changes.wait(min(remaining, 0.5))
            log.warning("retained query %r: %s did not answer (%s) and still owns %d shards; "
                        "their retained messages are left out", topic_filter, node, failure,
                        len(lost))

        async with trio.open_nursery() as nursery:
            for node in targets:
                nursery.start_soon(ask, node, view)
        return newer

    async def on_query(self, node: str, msg: RetainedQuery) -> None:
        """One page of the answer (see ``RetainedQuery``), once this node's view is at
        least the asker's (bounded by ``patience``: past it, what this view owns).  Each
        page sorts the matches again: O(n log n) per page, paid only by answers of more
        than one page."""
        deadline = trio.current_time() + self.patience
        while self.view().epoch < msg.epoch and (left := deadline - trio.current_time()) > 0:
            await self.view_changes.wait(min(left, 0.5))
        epoch = self.view().epoch
        after = msg.after
        matches = sorted((m for m in self._owned_retained(msg.topic_filter) if m.topic > after),
                         key=lambda m: m.topic)
        page = next(in_frames(matches, message_size, self.links.max_frame // 2), [])
        rows = [RetainedRow(m.topic, m.payload, m.qos, props_to_wire(m.props), m.mid)
                for m in page]
        self.links.reply(node, msg.req, True,
                         RetainedRows(rows, len(rows) < len(matches), epoch))
