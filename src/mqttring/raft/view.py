"""The immutable cluster snapshot that the data plane reads: ``ClusterView``.

The metadata state machine builds a new ``ClusterView`` after every applied command and the
service swaps it in with a single reference assignment, so a reader holding a view sees one
consistent epoch for as long as it keeps it (no locks, no torn reads across the Raft
thread).  Everything here is frozen; lookups are plain tuple and dict indexing so that the
per-publish cost of routing is one hash and one index.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from mqttring.ring.hashing import shard_of


class MemberState(enum.StrEnum):
    """Lifecycle of a member; only ``UP`` members are given shards."""

    JOINING = "joining"  # accepted by the leader, Raft membership change not yet committed
    UP = "up"  # in Raft, heartbeating, eligible for shards
    LEAVING = "leaving"  # handing its shards away before being removed from Raft
    DOWN = "down"  # missed heartbeats past the grace period; its shards moved away


class ShardState(enum.StrEnum):
    """Whether every target replica of a shard already holds its data."""

    STABLE = "stable"
    CATCHING_UP = "catching-up"  # some target replica is still receiving the shard's data


@dataclass(frozen=True, slots=True)
class Member:
    node_id: str
    mqtt: str | None
    cluster: str
    raft: str
    state: MemberState
    incarnation: int
    weight: int = 1
    #: The epoch in which this incarnation began (its ``up``): frames stamped with an older
    #: epoch were packed for an earlier life of this member and are refused by it.
    since: int = 0

    def __setstate__(self, state: list[Any]) -> None:
        """Unpickle (pysyncobj dumps), also a state written before ``since`` existed."""
        names = [f.name for f in fields(self)]
        defaults = {"weight": 1, "since": 0}
        for name, value in zip(names, state, strict=False):
            object.__setattr__(self, name, value)
        for name in names[len(state):]:
            object.__setattr__(self, name, defaults[name])

    def __getstate__(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True, slots=True)
class ShardAssignment:
    """Who holds one shard in this epoch.

    ``replicas`` is ordered owner first: the target replicas that hold the data (ring
    order), then *donors* (former holders kept only while some target replica is still
    catching up, so the data has a source), then the target replicas still catching up.
    The owner is therefore always a node that holds the data.
    """

    replicas: tuple[str, ...]
    catching_up: frozenset[str] = frozenset()

    @property
    def state(self) -> ShardState:
        return ShardState.CATCHING_UP if self.catching_up else ShardState.STABLE

    @property
    def owner(self) -> str | None:
        return self.replicas[0] if self.replicas else None


@dataclass(frozen=True, slots=True)
class ClusterView:
    """One epoch of cluster metadata.  Build a new one to change anything."""

    epoch: int
    leader: str | None
    num_shards: int
    replication: int
    members: Mapping[str, Member] = field(default_factory=lambda: MappingProxyType({}))
    shards: tuple[ShardAssignment, ...] = ()
    #: Pinned topic subtrees (without the trailing ``/#``) and the shard each is pinned to.
    pins: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def shard_for_topic(self, topic: str) -> int:
        """Shard of a topic name: that of its longest pinned subtree, else of the topic."""
        if self.pins:
            levels = topic.split("/")
            for n in range(len(levels), 0, -1):
                pinned = self.pins.get("/".join(levels[:n]))
                if pinned is not None:
                    return pinned
        return shard_of(topic, self.num_shards)

    def shard_for_client(self, client_id: str) -> int:
        return shard_of(client_id, self.num_shards)

    def owner(self, shard: int) -> str | None:
        """Node that serves ``shard`` in this epoch (None in an empty cluster, and before
        a node's first view: ``EMPTY_VIEW`` has no shards)."""
        replicas = self.replicas(shard)
        return replicas[0] if replicas else None

    def replicas(self, shard: int) -> tuple[str, ...]:
        shards = self.shards
        return shards[shard].replicas if shard < len(shards) else ()

    def shard_state(self, shard: int) -> ShardState:
        return self.shards[shard].state

    def live_members(self) -> tuple[str, ...]:
        return tuple(sorted(m.node_id for m in self.members.values() if m.state is MemberState.UP))

    def serving_members(self) -> tuple[str, ...]:
        """Members still running: ``up`` and ``leaving`` ones (a leaving node holds its
        shards until they are handed over, but no client: it sent them away)."""
        return tuple(sorted(m.node_id for m in self.members.values()
                            if m.state in (MemberState.UP, MemberState.LEAVING)))

    def shard_counts(self) -> dict[str, dict[str, int]]:
        """Per node: shards owned, replicas held (incl. owned), replicas catching up."""
        counts = {
            node: {"owner": 0, "replica": 0, "catching_up": 0} for node in sorted(self.members)
        }
        for assignment in self.shards:
            for i, node in enumerate(assignment.replicas):
                entry = counts.setdefault(node, {"owner": 0, "replica": 0, "catching_up": 0})
                if i == 0:
                    entry["owner"] += 1
                if node in assignment.catching_up:
                    entry["catching_up"] += 1
                else:
                    entry["replica"] += 1
        return counts

    def catching_up_for(self, node_id: str) -> tuple[int, ...]:
        """Shards that ``node_id`` is still catching up on (what its data plane must fetch)."""
        return tuple(i for i, a in enumerate(self.shards) if node_id in a.catching_up)


EMPTY_VIEW = ClusterView(epoch=0, leader=None, num_shards=1, replication=1)


def view_to_wire(view: ClusterView) -> dict[str, Any]:
    """A msgpack/JSON-friendly rendering of a view, for status and tests."""
    return {
        "epoch": view.epoch,
        "leader": view.leader,
        "num_shards": view.num_shards,
        "replication": view.replication,
        "members": {n: {"state": m.state.value, "incarnation": m.incarnation, "since": m.since,
                        "mqtt": m.mqtt,
                        "cluster": m.cluster, "raft": m.raft, "weight": m.weight}
                    for n, m in view.members.items()},
        "shard_counts": view.shard_counts(),
        "pins": dict(view.pins),
        "shards": [[list(a.replicas), sorted(a.catching_up)] for a in view.shards],
    }
