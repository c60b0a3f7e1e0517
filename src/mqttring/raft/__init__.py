"""Cluster metadata on Raft: who is in the cluster and who owns which shard.

``MetadataService`` runs one node's part; readers use the immutable ``ClusterView`` it
publishes.  The state machine (``state.py``) is plain and deterministic; pysyncobj is a thin
shell around it (``replicated.py``).  See ``docs/cluster.md``.
"""

from __future__ import annotations

import _socket
import socket

import pysyncobj  # noqa: F401  (imported first, for the repair below)

# pysyncobj's win_inet_pton replaces socket.inet_ntop on every platform with a shim that
# only works on Windows: anything in a node process decoding an address (psutil, TLS
# libraries, user code embedding the broker) would fail.  Put the real one back.
socket.inet_ntop = _socket.inet_ntop

from mqttring.raft.service import CatchUp, CommitError, MetadataService  # noqa: E402
from mqttring.raft.state import MetadataState  # noqa: E402
from mqttring.raft.view import (  # noqa: E402
    ClusterView,
    Member,
    MemberState,
    ShardAssignment,
    ShardState,
)

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
