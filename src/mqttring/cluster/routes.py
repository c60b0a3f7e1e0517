"""Node-level routes: which nodes have at least one subscriber matching a topic.

Theory of operation
-------------------
A publish is fanned out by the owner of its topic's shard, so the owner must know every
node with a matching subscriber, and nothing per subscriber: routes are *node* granular
(one entry per filter and target, however many clients share it).  A route's *target* is
either a node id (clean sessions live on the node they are connected to) or ``s:N``, the
persistent sessions of client shard N, which live at that shard's owner: resolving ``s:N``
at delivery time means a session's routes follow it when its home fails over, with no
re-registration window in which acknowledged messages could miss it.

Where a filter's route is registered depends on which topics it can match:

* a filter without wildcards matches one topic, whose shard has R replicas: the route is
  registered on all of them ("exact" routes), so a replica promoted to owner already has it;
* a wildcard filter whose literal prefix lies inside a pinned subtree (``factory/line1/#``
  pinned to one shard) can only match topics of that shard: registered on its replicas;
* any other wildcard filter may match topics of every shard: it is registered on every node
  (each keeps a ``TopicTrie`` of wildcard routes), so any owner can consult it.

Registration is a control message (``radd``/``rdel``) sent when a node's first local
subscription to a filter appears or its last one goes; never Raft.  Routes are soft state:
when a shard's replicas change or a member joins, nodes re-send the registrations whose
target set changed; when a member goes down or restarts, everyone drops its node routes.
"""

from __future__ import annotations

from mqttring.protocol.topics import TopicTrie
from mqttring.raft.view import ClusterView

WILDCARDS = ("+", "#")


def has_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def literal_prefix(topic_filter: str) -> str:
    """Levels before the first wildcard: ``a/b/+/c`` -> ``a/b``."""
    levels = []
    for level in topic_filter.split("/"):
        if level in WILDCARDS:
            break
        levels.append(level)
    return "/".join(levels)


def route_shard(topic_filter: str, view: ClusterView) -> int | None:
    """The one shard whose owner must hold this filter's route, or None for everywhere."""
    if not has_wildcard(topic_filter):
        return view.shard_for_topic(topic_filter)
    if view.pins:
        prefix = literal_prefix(topic_filter)
        levels = prefix.split("/") if prefix else []
        for n in range(len(levels), 0, -1):
            shard = view.pins.get("/".join(levels[:n]))
            if shard is not None:
                return shard
    return None


class RouteTable:
    """Routes held by this node: exact ones for topics it owns, wildcard ones from all."""

    def __init__(self) -> None:
        self.exact: dict[str, set[str]] = {}
        self.wildcard: TopicTrie[str, int] = TopicTrie()
        #: Bumped by every change, so callers can cache answers per topic.
        self.version = 0

    def add(self, topic_filter: str, node: str) -> None:
        self.version += 1
        if has_wildcard(topic_filter):
            self.wildcard.add(topic_filter, node, 1)
        else:
            self.exact.setdefault(topic_filter, set()).add(node)

    def remove(self, topic_filter: str, node: str) -> None:
        self.version += 1
        if has_wildcard(topic_filter):
            self.wildcard.remove(topic_filter, node)
            return
        nodes = self.exact.get(topic_filter)
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self.exact[topic_filter]

    def drop_node(self, node: str) -> None:
        """Forget a node's own routes (``s:N`` session-shard targets outlive any node)."""
        for topic in [t for t, nodes in self.exact.items() if node in nodes]:
            self.remove(topic, node)
        for topic_filter in [f for f in self.wildcard.filters()]:
            self.wildcard.remove(topic_filter, node)

    def drop_exact_where(self, keep: set[int], view: ClusterView) -> None:
        """Forget exact routes of topics whose shard this node no longer holds."""
        for topic in [t for t in self.exact if view.shard_for_topic(t) not in keep]:
            del self.exact[topic]
        self.version += 1

    def nodes_for(self, topic: str) -> set[str]:
        """Route targets (node ids, or ``s:N`` for the persistent sessions of shard N)."""
        nodes = set(self.exact.get(topic, ()))
        for node, _ in self.wildcard.match(topic):
            nodes.add(node)
        return nodes
