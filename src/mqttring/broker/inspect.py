"""What one node can tell an operator about its own clients, and the one thing it can do.

Plain functions over the broker core that return JSON/msgpack-friendly dicts: the admin RPC
(``mqttring.broker.admin``) serves them to other nodes and the HTTP API
(``mqttring.http``) calls them directly for the node it runs on, then merges the answers of
all members.  They read in-memory state only (no store, no I/O), so they run on the trio
loop; their cost is one pass over this node's clients or sessions, bounded by ``limit``.

A node reports the connections it holds (its ``clients``), and the subscriptions of the
sessions it holds (``core.sessions``).  In a cluster a persistent session lives at its home
node while its connection may be on another (``mqttring.cluster.relay``): the connection's
node holds only a stand-in, whose figures are not the session's, so the HTTP layer asks the
home for them (``session_counts``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mqttring.broker.client import ClientHandler
    from mqttring.broker.core import BrokerCore


def client_info(handler: ClientHandler, node_id: str) -> dict[str, Any]:
    """One connected client, as the HTTP API shows it."""
    session = handler.session
    return {
        "client_id": handler.client_id,
        "node": node_id,
        "address": handler.transport.peer,
        "clean_session": session.clean_session if session is not None else None,
        "keepalive": handler.conn.keepalive,
        "connected_since": handler.connected_at,
        "subscriptions": len(session.subscriptions) if session is not None else 0,
        "queued": len(session.queue) if session is not None else 0,
        "inflight": len(session.inflight) if session is not None else 0,
    }


def list_clients(core: BrokerCore, node_id: str, *, after: str = "", limit: int = 100
                 ) -> list[dict[str, Any]]:
    """Connected clients with an id above ``after``, in id order, at most ``limit``."""
    ids = sorted(cid for cid in core.clients if cid > after)[:limit]
    return [client_info(core.clients[cid], node_id) for cid in ids]


def find_client(core: BrokerCore, node_id: str, client_id: str) -> dict[str, Any] | None:
    handler = core.clients.get(client_id)
    return client_info(handler, node_id) if handler is not None else None


def kick_client(core: BrokerCore, client_id: str) -> bool:
    """Close a client's connection on this node (its will is published, as for any
    connection that ends without DISCONNECT); False when it is not connected here."""
    handler = core.clients.get(client_id)
    if handler is None:
        return False
    handler.kick("kicked by an operator (HTTP API)", 0x98)  # administrative action
    return True


def list_subscriptions(core: BrokerCore, node_id: str, *, client: str | None = None,
                       after: tuple[str, str] = ("", ""), limit: int = 100
                       ) -> list[dict[str, Any]]:
    """(client id, filter) pairs above ``after`` in that order, at most ``limit``; only of
    ``client`` if given."""
    if client is not None:
        session = core.sessions.get(client)
        sessions = [session] if session is not None else []
    else:
        sessions = [s for cid, s in core.sessions.items() if cid >= after[0]]
    rows: list[tuple[str, str, int]] = []
    for session in sessions:
        for topic_filter, qos in session.subscriptions.items():
            if (session.client_id, topic_filter) > after:
                rows.append((session.client_id, topic_filter, qos))
    rows.sort()
    return [{"client_id": cid, "filter": f, "qos": qos, "node": node_id}
            for cid, f, qos in rows[:limit]]


def session_counts(core: BrokerCore, client_ids: list[str]) -> dict[str, dict[str, int]]:
    """Subscriptions, queued and inflight messages of the sessions held here, by client id
    (ids of sessions not held here are left out)."""
    counts: dict[str, dict[str, int]] = {}
    for client_id in client_ids:
        session = core.sessions.get(client_id)
        if session is not None:
            counts[client_id] = {"subscriptions": len(session.subscriptions),
                                 "queued": len(session.queue),
                                 "inflight": len(session.inflight)}
    return counts
