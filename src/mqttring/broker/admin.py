"""Node-side admin requests on the authenticated RPC port (``mqttring.rpc``).

A cluster node serves them on its cluster address; a single node on ``admin`` if set.
Both need the cluster secret (``cluster_secret`` / ``$MQTTRING_CLUSTER_SECRET``): a snapshot
request writes files on the node's machine, so it is never open to anyone.

Kinds:
* ``stats``: the node's counters (``$SYS`` values plus per-link figures in a cluster);
* ``clients`` / ``subscriptions`` / ``session_counts`` / ``kick``: this node's connected
  clients, the subscriptions and figures of the sessions it holds, and closing one client's
  connection here
  (``mqttring.broker.inspect``; the HTTP API of any member merges them cluster-wide);
* ``snapshot``: a consistent point-in-time copy of the node store under
  ``<out>/<node id>/`` (a path on the *node's* filesystem), taken while the node serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mqttring.broker import inspect
from mqttring.rpc import Peer, RpcError, RpcServer

if TYPE_CHECKING:
    from mqttring.broker.core import BrokerCore
    from mqttring.broker.server import BrokerNode


def node_stats(broker: BrokerNode) -> dict[str, Any]:
    """The node's counters: what the ``stats`` request answers (and the HTTP API shows)."""
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


def register_admin(rpc: RpcServer, broker: BrokerNode) -> None:
    async def stats(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return node_stats(broker)

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

    def core() -> BrokerCore:
        if broker.core is None:
            raise RpcError("this node is not serving yet")
        return broker.core

    def text(body: dict[str, Any], key: str, default: str = "") -> str:
        value = body.get(key, default)
        if not isinstance(value, str):
            raise RpcError(f"{key!r} must be a string")
        return value

    def limit(body: dict[str, Any]) -> int:
        value = body.get("limit", 100)
        if not isinstance(value, int) or not 1 <= value <= 10_000:
            raise RpcError("'limit' must be an integer in 1..10000")
        return value

    async def clients(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        node_id = broker.config.node_id
        if "client_id" in body:
            found = inspect.find_client(core(), node_id, text(body, "client_id"))
            return {"clients": [found] if found is not None else []}
        return {"clients": inspect.list_clients(core(), node_id, after=text(body, "after"),
                                                limit=limit(body))}

    async def subscriptions(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        client = body.get("client")
        if client is not None and not isinstance(client, str):
            raise RpcError("'client' must be a string")
        after = (text(body, "after_client"), text(body, "after_filter"))
        return {"subscriptions": inspect.list_subscriptions(
            core(), broker.config.node_id, client=client, after=after, limit=limit(body))}

    async def session_counts(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        ids = body.get("clients")
        if not isinstance(ids, list) or len(ids) > 10_000 \
                or not all(isinstance(i, str) for i in ids):
            raise RpcError("'clients' must be a list of at most 10000 client ids")
        return {"sessions": inspect.session_counts(core(), ids)}

    async def kick(body: dict[str, Any], peer: Peer) -> dict[str, Any]:
        return {"kicked": inspect.kick_client(core(), text(body, "client_id"))}

    rpc.register("stats", stats)
    rpc.register("clients", clients)
    rpc.register("subscriptions", subscriptions)
    rpc.register("session_counts", session_counts)
    rpc.register("kick", kick)
    rpc.register("snapshot", snapshot)
