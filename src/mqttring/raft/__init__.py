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

import importlib

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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mqttring.raft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups do not come here again
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


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
