"""Node-side admin requests on the authenticated RPC port (``mqttring.rpc``).

A cluster node serves them on its cluster address; a single node on ``admin`` if set.
Both need the cluster secret (``cluster_secret`` / ``$MQTTRING_CLUSTER_SECRET``): a snapshot
request writes files on the node's machine, so it is never open to anyone.

Kinds:
* ``stats``: the node's counters (``$SYS`` values plus per-link figures in a cluster);
* ``snapshot``: a consistent point-in-time copy of the node store under
  ``<out>/<node id>/`` (a path on the *node's* filesystem), taken while the node serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mqttring.rpc import Peer, RpcError, RpcServer

if TYPE_CHECKING:
    from mqttring.broker.server import BrokerNode


def register_admin(rpc: RpcServer, broker: BrokerNode) -> None:
    async def stats(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        result: dict[str, Any] = {"node_id": broker.config.node_id,
                                  "metrics": broker.metrics.as_dict()}
        if broker.plane is not None:
            result["links"] = broker.plane.link_stats()
        if broker.store is not None:
            result["store"] = broker.store.stats()
        if broker.archive is not None:
            result["archive"] = {"appended": broker.archive.appended,
                                 "bytes": broker.archive.bytes,
                                 "expired": broker.archive.expired,
                                 "dropped": broker.archive.dropped}
        return result

    async def snapshot(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        store = broker.store
        if store is None:
            raise RpcError("this node has no store (data_dir unset)")
        out = body.get("out")
        if not isinstance(out, str) or not out:
            raise RpcError("snapshot needs an output directory 'out'")
        dest = Path(out) / broker.config.node_id
        if dest.exists() and any(dest.iterdir()):
            raise RpcError(f"{dest} exists and is not empty")
        shards = None
        if broker.plane is not None:
            # A node's own shards: those it owns or replicates in the current view.
            shards = broker.plane.replica_shards()
        manifest = await store.snapshot(dest, shards=shards, node_id=broker.config.node_id)
        return {"path": str(dest), "manifest": manifest.to_json()}

    rpc.register("stats", stats)
    rpc.register("snapshot", snapshot)
