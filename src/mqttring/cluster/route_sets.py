"""``RouteSets``: which of this node's routes each peer should hold, and their digests.

Apart from ``RouteRegistry`` because it answers one pure question, "under view V, which of
our local routes belong at node N, and what is the digest of that set?", that anti-entropy
asks for every peer after every view change and every digest round.  The registry decides
*when* sets and digests go out; this module only computes them, cheaply:

* where a local filter's route goes (``route_shard``) is hashed once per filter and kept
  while the view places filters the same way (same shard count and pins);
* which shards and whether the wildcard routes a peer holds is computed once per view
  (``peer_targets``), so membership of a route in a peer's set is one lookup, not a walk
  of ``route_targets`` per filter;
* each peer's digest is hashed once per view and then kept up to date route by route
  (``change``): before, one SUBSCRIBE a second made every anti-entropy round hash every
  local route again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mqttring.cluster.routes import RouteKey, route_digest, route_shard
from mqttring.raft.view import ClusterView, MemberState

#: Member states whose nodes hold every wildcard route: a joining node may still own the
#: shards it held last (their last holder, back from a power loss), but until it is up no
#: peer counts it a target; a leaving one owns shards until it has handed them over.
ROUTED_STATES = (MemberState.UP, MemberState.LEAVING)

#: Whether a node holds wildcard routes, and the shards whose exact routes it holds.
Targets = tuple[bool, frozenset[int]]


def wildcard_targets(view: ClusterView) -> list[str]:
    """The nodes a wildcard filter's route is registered at (``RouteRegistry.route_targets``)."""
    return sorted(n for n, m in view.members.items() if m.state in ROUTED_STATES)


class RouteSets:
    """The route sets and digests of ``local`` (this node's wanted routes, owned by the
    registry and only read here) as each peer should hold them."""

    def __init__(self, node_id: str, local: dict[RouteKey, int]) -> None:
        self.node_id = node_id
        self.local = local
        #: filter -> ``route_shard`` under ``_shards_under`` (num_shards, pins).
        self._filter_shards: dict[str, int | None] = {}
        self._shards_under: tuple[int, Any] = (0, None)
        #: peer -> (view epoch, ``targets_at`` it).
        self._targets: dict[str, tuple[int, Targets]] = {}
        #: peer -> (view epoch, digest of the routes it should hold for us).
        self._digests: dict[str, tuple[int, int]] = {}

    def targets_at(self, node: str, view: ClusterView) -> Targets:
        """Whether ``node`` holds wildcard routes under ``view``, and the shards whose exact
        routes it holds: ``node in route_targets(f, view)`` without a walk per filter."""
        me = self.node_id
        wildcard = node in (wildcard_targets(view) or [me])
        shards = frozenset(s for s in range(view.num_shards)
                           if node in (view.replicas(s) or (me,)))
        return wildcard, shards

    def peer_targets(self, node: str, view: ClusterView) -> Targets:
        """``targets_at``, computed once per view and peer."""
        cached = self._targets.get(node)
        if cached is None or cached[0] != view.epoch:
            cached = self._targets[node] = (view.epoch, self.targets_at(node, view))
        return cached[1]

    def shard_of(self, topic_filter: str, view: ClusterView) -> int | None:
        """``route_shard``, hashed once per filter while ``view`` places filters alike."""
        count, pins = self._shards_under
        if count != view.num_shards or (pins is not view.pins and pins != view.pins):
            self._filter_shards.clear()
            self._shards_under = (view.num_shards, view.pins)
        cache = self._filter_shards
        if topic_filter in cache:
            return cache[topic_filter]
        shard = cache[topic_filter] = route_shard(topic_filter, view)
        return shard

    def forget_filter(self, topic_filter: str) -> None:
        """A local filter went (recomputed if another target still has it)."""
        self._filter_shards.pop(topic_filter, None)

    def among(self, keys: Iterable[RouteKey], at: Targets, view: ClusterView) -> list[RouteKey]:
        """Those of ``keys`` whose route goes to the node ``at`` describes."""
        wildcard, shards = at
        shard_of = self.shard_of
        found = []
        for key in keys:
            shard = shard_of(key[0], view)
            if wildcard if shard is None else shard in shards:
                found.append(key)
        return found

    def expected_at(self, node: str, view: ClusterView) -> set[RouteKey]:
        """The routes ``node`` should hold on our behalf under ``view``."""
        return set(self.among(self.local, self.targets_at(node, view), view))

    # -- digests ---------------------------------------------------------------------------

    def digest(self, node: str, view: ClusterView) -> int | None:
        """The digest of ``node``'s set under ``view``, if known (None: not computed in
        this view yet)."""
        cached = self._digests.get(node)
        return cached[1] if cached is not None and cached[0] == view.epoch else None

    def compute_digest(self, node: str, view: ClusterView) -> int:
        """Hash ``node``'s whole set under ``view`` and keep it up to date from now on."""
        digest = route_digest(self.expected_at(node, view))
        self._digests[node] = (view.epoch, digest)
        return digest

    def remember_digest(self, node: str, epoch: int, digest: int) -> None:
        """The digest of a set computed elsewhere (in slices), kept up to date from now on."""
        self._digests[node] = (epoch, digest)

    def change(self, key: RouteKey, view: ClusterView) -> None:
        """A local route ``key`` appeared or went: toggle it in the digests of the peers
        that hold it (a digest is the XOR of its routes' hashes)."""
        if not self._digests:
            return
        shard = self.shard_of(key[0], view)
        hashed = 0
        for node, (epoch, digest) in list(self._digests.items()):
            if epoch != view.epoch or node not in view.members:
                continue  # recomputed whole at the next round
            wildcard, shards = self.peer_targets(node, view)
            if wildcard if shard is None else shard in shards:
                hashed = hashed or route_digest((key,))
                self._digests[node] = (epoch, digest ^ hashed)
