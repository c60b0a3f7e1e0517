"""Taking consistent snapshots of running nodes over the admin RPC (``mqttring snapshot``).

The node does the work (``snapshot`` kind of ``mqttring.broker.admin``): it writes
``<out>/<node id>/`` on *its own* filesystem while it keeps serving.  This module only asks.
With ``--all`` it first asks the given node for the cluster view (``status`` kind), then
every member that is up, one after the other, and records the view's shard owners in
``<out>/SNAPSHOT-SET.json`` so that the export keeps exactly one copy of each shard (the
owner's) although every shard is in R snapshots.

The node snapshots of a set are not one global instant: each is consistent in itself (one
store sequence), and they are taken seconds apart at most.  A message published during the
run may be in one node's snapshot and not in another's; within one shard it is all or
nothing.
"""

from __future__ import annotations

import json
import os
import ssl
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from mqttring.rpc import RPC_KEY_PURPOSE, call_once, derive_key

#: Written by ``--all`` next to the node snapshots; read by the export (owners per shard).
SNAPSHOT_SET = "SNAPSHOT-SET.json"
SNAPSHOT_SET_FORMAT = "mqttring-snapshot-set"
#: Caller name in the RPC handshake (shows up in the node's logs).
CALLER = "cli"


@dataclass(frozen=True, slots=True)
class NodeSnapshotReply:
    node_id: str
    address: str
    path: str
    manifest: dict[str, Any]


async def snapshot_node(address: str, key: bytes, out: str, timeout: float, *,
                        tls: ssl.SSLContext | None = None) -> NodeSnapshotReply:
    """Ask one node for a snapshot under ``out`` (a path on the node's filesystem)."""
    reply = await call_once(address, key, CALLER, "snapshot", {"out": out}, timeout, tls=tls)
    manifest = reply["manifest"]
    return NodeSnapshotReply(str(manifest.get("node_id") or Path(reply["path"]).name), address,
                             str(reply["path"]), manifest)


async def snapshot_cluster(address: str, key: bytes, out: str, timeout: float, *,
                           tls: ssl.SSLContext | None = None
                           ) -> tuple[list[NodeSnapshotReply], dict[str, Any]]:
    """Snapshot every member that is up, in the view ``address`` holds; returns the view."""
    status = await call_once(address, key, CALLER, "status", {}, timeout, tls=tls)
    view = status["view"]
    members = {n: m for n, m in view["members"].items() if m["state"] == "up"}
    if not members:
        raise RuntimeError(f"{address} knows no member that is up")
    replies = [await snapshot_node(m["cluster"], key, out, timeout, tls=tls)
               for _n, m in sorted(members.items())]
    return replies, view


def write_snapshot_set(out: Path, replies: list[NodeSnapshotReply], view: dict[str, Any]) -> Path:
    """SNAPSHOT-SET.json: which nodes were snapshotted and who owned each shard."""
    owners = [replicas[0] if replicas else None for replicas, _catching_up in view["shards"]]
    record = {
        "format": SNAPSHOT_SET_FORMAT,
        "format_version": 1,
        "created_at": time.time(),
        "epoch": view["epoch"],
        "num_shards": view["num_shards"],
        "replication": view["replication"],
        "owners": owners,
        "nodes": {r.node_id: {"address": r.address, "path": r.path,
                              "sequence": r.manifest["sequence"]} for r in replies},
    }
    path = out / SNAPSHOT_SET
    tmp = path.with_name(f".{SNAPSHOT_SET}.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    os.replace(tmp, path)
    return path


def take_snapshots(node: str, secret: str, out: Path, *, all_nodes: bool,
                   timeout: float, tls: ssl.SSLContext | None = None
                   ) -> list[NodeSnapshotReply]:
    """Blocking entry point used by the CLI (runs its own trio loop)."""
    key = derive_key(secret, RPC_KEY_PURPOSE)
    if not all_nodes:
        return [trio.run(partial(snapshot_node, node, key, str(out), timeout, tls=tls))]
    replies, view = trio.run(partial(snapshot_cluster, node, key, str(out), timeout, tls=tls))
    if out.is_dir():  # the set file is only useful where the CLI can also see the snapshots
        write_snapshot_set(out, replies, view)
    return replies
