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
subscription to a filter appears or its last one goes; never Raft.  Routes are soft state,
and *who registered a route* is part of it: a route (filter, target) stays while at least one
registrar holds it.  That matters for ``s:N`` targets, which two homes can register at once
while a session shard moves (the old home's ``rdel`` must not remove the new home's route).

Shared subscriptions (``$share/{group}/{filter}``, ``mqttring.broker.shared``) register
routes like any other filter, keyed by the full share filter (so registration, removal and
anti-entropy need nothing new), placed by their *inner* filter, and held apart from the
ordinary ones (``shared``): an ordinary lookup never sees them, and ``shares_for`` gives the
owner each matching share with its targets, from which it picks one per message
(``mqttring.cluster.shared``).

Anti-entropy (``RouteRegistry``): each node knows exactly which routes it should hold at each
peer, so it can send the full set (``rsync``) and the receiver replaces what that registrar
had.  Full sets go out after every view change and every link (re)connection; in between, a
periodic digest (``rdig``, an order-independent hash of the set) lets the receiver notice a
divergence and pull the set (``rpull``).  A lost ``radd`` therefore heals within one digest
period, and a node that restarts or was cut off gets every route back without anyone
remembering what it missed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from mqttring.broker.shared import inner_filter, is_shared
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
    """The one shard whose owner must hold this filter's route, or None for everywhere
    (a share's inner filter decides for it)."""
    if is_shared(topic_filter):
        topic_filter = inner_filter(topic_filter)
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


RouteKey = tuple[str, str]  # (topic filter, target: a node id or ``s:N``)


def registrar_for(target: str, node: str) -> str:
    """Who holds a route registered by ``node`` for ``target``.

    A node's own routes (its clean sessions) are held in its name.  A session shard's
    routes are held in the name of the shard's home *role* (``home:N``), not of the node
    that plays it: while the shard moves, the old home stops asserting them and the new one
    starts only once it has loaded the sessions, and the routes must stay in between.
    """
    if target.startswith("s:"):
        return "home:" + target[2:]
    return node


def route_digest(keys: Iterable[RouteKey]) -> int:
    """Order-independent 64-bit digest of a route set (XOR of per-route hashes).

    XOR lets either side compute it from a set in any order; a collision needs two sets that
    differ yet hash alike, which the next full ``rsync`` after any view change repairs anyway.
    """
    digest = 0
    for topic_filter, target in keys:
        h = hashlib.blake2b(f"{topic_filter}\x00{target}".encode(), digest_size=8).digest()
        digest ^= int.from_bytes(h, "big")
    return digest


class RouteTable:
    """Routes held by this node: exact ones for topics it owns, wildcard ones from all.

    Each route remembers its registrars (the nodes that asked for it); the lookup structures
    (``exact``, ``wildcard``) hold a route while any registrar does.
    """

    def __init__(self) -> None:
        self.exact: dict[str, set[str]] = {}
        self.wildcard: TopicTrie[str, int] = TopicTrie()
        #: Routes of shares, by inner filter: (share filter, target) -> 1.
        self.shared: TopicTrie[RouteKey, int] = TopicTrie()
        #: How many: the hot path's one check (an attribute, not ``len``).
        self.shared_routes = 0
        #: Bumped by every change, so callers can cache answers per topic.
        self.version = 0
        self._holders: dict[RouteKey, set[str]] = {}
        self._by_registrar: dict[str, set[RouteKey]] = {}
        self._digests: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    # -- the lookup structures -------------------------------------------------------------

    def _insert(self, topic_filter: str, target: str) -> None:
        if is_shared(topic_filter):
            self.shared.add(inner_filter(topic_filter), (topic_filter, target), 1)
            self.shared_routes = len(self.shared)
        elif has_wildcard(topic_filter):
            self.wildcard.add(topic_filter, target, 1)
        else:
            self.exact.setdefault(topic_filter, set()).add(target)

    def _delete(self, topic_filter: str, target: str) -> None:
        if is_shared(topic_filter):
            self.shared.remove(inner_filter(topic_filter), (topic_filter, target))
            self.shared_routes = len(self.shared)
            return
        if has_wildcard(topic_filter):
            self.wildcard.remove(topic_filter, target)
            return
        targets = self.exact.get(topic_filter)
        if targets is not None:
            targets.discard(target)
            if not targets:
                del self.exact[topic_filter]

    # -- registrations ---------------------------------------------------------------------

    def add(self, topic_filter: str, target: str, registrar: str) -> None:
        key = (topic_filter, target)
        holders = self._holders.get(key)
        if holders is None:
            holders = self._holders[key] = set()
            self._insert(topic_filter, target)
        if registrar not in holders:
            holders.add(registrar)
            self._by_registrar.setdefault(registrar, set()).add(key)
            self._digests.pop(registrar, None)
        self.version += 1

    def remove(self, topic_filter: str, target: str, registrar: str) -> None:
        key = (topic_filter, target)
        self.version += 1
        holders = self._holders.get(key)
        if holders is None or registrar not in holders:
            return
        holders.discard(registrar)
        self._forget_registration(registrar, key)
        if not holders:
            del self._holders[key]
            self._delete(topic_filter, target)

    def _forget_registration(self, registrar: str, key: RouteKey) -> None:
        keys = self._by_registrar.get(registrar)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_registrar[registrar]
        self._digests.pop(registrar, None)

    def _drop_key(self, key: RouteKey) -> None:
        for registrar in self._holders.pop(key, ()):
            self._forget_registration(registrar, key)
        self._delete(*key)

    def replace(self, registrar: str, keys: set[RouteKey],
                remove: bool = True) -> tuple[int, int]:
        """Make ``keys`` exactly what ``registrar`` holds here (anti-entropy); (added, removed).

        ``remove=False`` only adds (see ``RouteRegistry.on_rsync``)."""
        current = self._by_registrar.get(registrar, set())
        stale = current - keys if remove else set()
        fresh = keys - current
        for topic_filter, target in stale:
            self.remove(topic_filter, target, registrar)
        for topic_filter, target in fresh:
            self.add(topic_filter, target, registrar)
        self.version += 1
        return len(fresh), len(stale)

    def registered_by(self, registrar: str) -> frozenset[RouteKey]:
        return frozenset(self._by_registrar.get(registrar, ()))

    def digest_of(self, registrar: str) -> int:
        """The digest of what ``registrar`` holds here (cached until that set changes)."""
        digest = self._digests.get(registrar)
        if digest is None:
            digest = self._digests[registrar] = route_digest(self._by_registrar.get(registrar, ()))
        return digest

    def drop_node(self, node: str) -> None:
        """Forget routes *to* a node (its clean sessions are gone with it), by whomever.

        ``s:N`` session-shard targets outlive any node, including the home that registered
        them: the next home re-registers them, and its ``rsync`` replaces the stale holder.
        """
        for key in [k for k in self._holders if k[1] == node]:
            self._drop_key(key)
        self.version += 1

    def drop_registrar(self, node: str) -> None:
        """Forget everything ``node`` registered (it left the cluster for good)."""
        for topic_filter, target in list(self._by_registrar.get(node, ())):
            self.remove(topic_filter, target, node)
        self.version += 1

    def keys(self) -> list[RouteKey]:
        """Every route held, as a list taken now (to walk in slices while it changes)."""
        return list(self._holders)

    def drop_exact_where(self, keep: set[int], view: ClusterView) -> None:
        """Forget exact routes of topics whose shard this node no longer holds."""
        self.drop_exact_among(self.keys(), keep, view)
        self.version += 1

    def drop_exact_among(self, keys: Iterable[RouteKey], keep: set[int],
                         view: ClusterView) -> None:
        """``drop_exact_where`` for ``keys`` only (a slice of ``keys()``; those gone since
        are skipped), so that a view change can do it a slice per loop step."""
        holders = self._holders
        dropped = False
        for key in keys:
            if (key in holders and not has_wildcard(key[0])
                    and view.shard_for_topic(inner_filter(key[0])) not in keep):
                self._drop_key(key)
                dropped = True
        if dropped:
            self.version += 1

    def nodes_for(self, topic: str) -> set[str]:
        """Route targets (node ids, or ``s:N`` for the persistent sessions of shard N)."""
        nodes = set(self.exact.get(topic, ()))
        for node, _ in self.wildcard.match(topic):
            nodes.add(node)
        return nodes

    def shares_for(self, topic: str) -> dict[str, list[str]]:
        """Share filter -> its route targets (sorted: every owner sees one order), for the
        shares whose inner filter matches ``topic``."""
        found: dict[str, list[str]] = {}
        for (share, target), _ in self.shared.match(topic):
            found.setdefault(share, []).append(target)
        for targets in found.values():
            targets.sort()
        return found
