"""Cluster metadata on Raft: who is in the cluster and who owns which shard.

``MetadataService`` runs one node's part; readers use the immutable ``ClusterView`` it
publishes.  The state machine (``state.py``) is plain and deterministic; pysyncobj is a thin
shell around it (``replicated.py``).  See ``docs/cluster.md``.
"""

from __future__ import annotations

from mqttring.raft.service import CatchUp, CommitError, MetadataService
from mqttring.raft.state import MetadataState
from mqttring.raft.view import ClusterView, Member, MemberState, ShardAssignment, ShardState

__all__ = [
    "CatchUp",
    "ClusterView",
    "CommitError",
    "Member",
    "MemberState",
    "MetadataService",
    "MetadataState",
    "ShardAssignment",
    "ShardState",
]
