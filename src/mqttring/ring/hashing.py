"""Stable key-to-shard hashing shared by every node.

Python's ``hash`` is salted per process, so two nodes would disagree; blake2b is stable,
fast in C and spreads short keys well.  Shard ids are stable for the life of a cluster
(``num_shards`` is fixed at creation), so stored keys can be prefixed with them.
"""

from __future__ import annotations

from hashlib import blake2b


def stable_hash(key: str) -> int:
    return int.from_bytes(blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def shard_of(key: str, num_shards: int) -> int:
    """Shard of a topic's shard key or of a client id, in ``range(num_shards)``."""
    return stable_hash(key) % num_shards
