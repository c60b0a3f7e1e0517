"""Cluster metadata on Raft: who is in the cluster and who owns which shard.

``MetadataService`` runs one node's part; readers use the immutable ``ClusterView`` it
publishes.  The state machine (``state.py``) is plain and deterministic; pysyncobj is a thin
shell around it (``replicated.py``, which also undoes what importing pysyncobj does to
``socket.inet_ntop``).  See ``docs/cluster.md``.

The public names below are imported on first use (PEP 562), not with the package: ``python
-m mqttring.raft.member`` imports this package before its first line runs, and the service
with pysyncobj takes most of a second to import, during which the member must already hold
stop signals (``mqttring.stop_signals``).
"""

from __future__ import annotations

from mqttring.lazy_exports import lazy_exports

TYPE_CHECKING = False  # type checkers take it as typing.TYPE_CHECKING; importing typing: 10 ms

if TYPE_CHECKING:
    from mqttring.raft.service import CatchUp, CommitError, MetadataService
    from mqttring.raft.state import MetadataState
    from mqttring.raft.view import ClusterView, Member, MemberState, ShardAssignment, ShardState

#: Public name -> the module that defines it.
_EXPORTS = {
    "CatchUp": "mqttring.raft.service",
    "ClusterView": "mqttring.raft.view",
    "CommitError": "mqttring.raft.service",
    "Member": "mqttring.raft.view",
    "MemberState": "mqttring.raft.view",
    "MetadataService": "mqttring.raft.service",
    "MetadataState": "mqttring.raft.state",
    "ShardAssignment": "mqttring.raft.view",
    "ShardState": "mqttring.raft.view",
}


__getattr__, __dir__ = lazy_exports('mqttring.raft', _EXPORTS, globals())


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
