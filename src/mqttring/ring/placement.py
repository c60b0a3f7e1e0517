"""Shard placement: which nodes hold each shard, computed from the member list.

Theory of operation
-------------------
The cluster has a fixed number of shards (``num_shards``, chosen when the cluster is
created).  A topic's shard key (the topic, or its pinned subtree) and a client id map to a
shard with :func:`mqttring.ring.hashing.shard_of`; that part never changes.  What changes
as nodes come and go is *placement*: the ordered replica list of each shard, owner first.

Placement is a pure function of ``(eligible members and their weights, num_shards, R)``.
Every node that applies the same Raft log computes it from the same inputs and so gets the
same answer; nothing here reads the clock, the process, or Python's salted ``hash``.

We place shard ``s`` by looking up the key ``"shard:<s>"`` on a consistent-hash ring
(uhashring, md5 points, ``VNODES`` virtual nodes per unit of weight) and walking clockwise,
collecting the first ``min(R, len(members))`` *distinct* nodes.  Consequences, relied on by
the state machine and checked by ``tests/test_ring_placement.py``:

* Adding node X changes a shard's list only by inserting X somewhere in it (and dropping
  the old last replica when the list is full).  So a shard's owner changes only *to* X, and
  about ``weight(X) / total weight`` of the shards change owner (≈ 1/(N+1) for equal
  weights).  Removing X is the exact reverse.
* Weights scale the number of virtual nodes, so a node of weight 2 owns about twice the
  shards of a node of weight 1.

Placement is the *target*.  Whether a target replica already holds a shard's data is the
state machine's business (``catching-up``), not the ring's.
"""

from __future__ import annotations

from collections.abc import Mapping

from uhashring import HashRing

#: Virtual nodes per unit of weight.  160 is ketama's customary figure: with 1024 shards it
#: keeps each node's share within roughly ±25% of fair for N ≤ 10 while the ring stays
#: cheap to rebuild (a few milliseconds), which happens only when membership changes.
VNODES = 160


def shard_key(shard: int) -> str:
    """Ring key of a shard; a string so that uhashring hashes it the same on every node."""
    return f"shard:{shard}"


def place_shards(
    weights: Mapping[str, int], num_shards: int, replication: int
) -> tuple[tuple[str, ...], ...]:
    """Target replica list (owner first) of every shard, for the given eligible members.

    ``weights`` maps node id to a positive integer weight.  With no members every list is
    empty; with fewer members than ``replication`` every list holds all of them.
    """
    if num_shards < 1 or replication < 1:
        raise ValueError("num_shards and replication must be >= 1")
    if not weights:
        return ((),) * num_shards
    for node, weight in weights.items():
        if weight < 1:
            raise ValueError(f"weight of {node!r} must be >= 1, got {weight}")
    ring = HashRing(
        nodes={node: {"weight": 1, "vnodes": VNODES * w} for node, w in sorted(weights.items())}
    )
    size = min(replication, len(weights))
    return tuple(
        tuple(conf["nodename"] for conf in ring.range(shard_key(s), size, unique=True))
        for s in range(num_shards)
    )


def owner_counts(placement: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    """Shards owned per node (first replica), for status output and balance checks."""
    counts: dict[str, int] = {}
    for replicas in placement:
        if replicas:
            counts[replicas[0]] = counts.get(replicas[0], 0) + 1
    return counts
