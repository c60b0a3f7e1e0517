"""Keys to shards (``hashing``) and shards to nodes (``placement``)."""

from __future__ import annotations

from mqttring.ring.hashing import shard_of, stable_hash
from mqttring.ring.placement import owner_counts, place_shards

__all__ = ["owner_counts", "place_shards", "shard_of", "stable_hash"]
