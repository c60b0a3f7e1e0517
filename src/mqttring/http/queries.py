"""``ClusterQueries``: the HTTP API's questions, answered for the whole cluster by one member.

Why a member fans out instead of each node answering for itself: an operator (or the
dashboard) talks to any one node and sees every client, subscription and counter.  The
node answers for itself from memory (``mqttring.broker.inspect``) and asks every other
member that is not down over the admin RPC (``mqttring.rpc``: the cluster address, the
cluster secret).  Answers are merged in key order, so paging with ``after`` is exact: each
node returns its first ``limit`` rows past the cursor, the merge keeps the first ``limit``
of the union.  A member that does not answer within ``FANOUT_TIMEOUT`` is named in
``unreachable``; the answer is then partial, never an error.
"""

from __future__ import annotations

import base64
import heapq
import logging
from typing import TYPE_CHECKING, Any

import trio

from mqttring.broker import inspect
from mqttring.broker.admin import node_stats
from mqttring.broker.refusals import PublishRefused
from mqttring.cluster.plane import DataPlane
from mqttring.protocol.message import Message
from mqttring.raft.view import MemberState
from mqttring.rpc import (
    RPC_KEY_PURPOSE,
    AuthError,
    ProtocolError,
    RpcError,
    call_once,
    cluster_secret,
    derive_key,
)

if TYPE_CHECKING:
    from mqttring.embedded import MqttRingBroker

log = logging.getLogger("mqttring.http")

#: Seconds one member may take to answer a fanned-out request.
FANOUT_TIMEOUT = 5.0
#: Bytes of a retained payload shown in a listing.
PREVIEW_BYTES = 256


class NotFound(LookupError):
    """The thing named in the request does not exist (HTTP 404)."""


class Unavailable(RuntimeError):
    """The cluster cannot do it now (HTTP 503): no quorum, refused write, node unreachable."""


class ClusterQueries:
    """See the module docstring; one per HTTP listener, built with the app."""

    def __init__(self, broker: MqttRingBroker) -> None:
        self.broker = broker
        self.node_id = broker.config.node_id
        self._key = (derive_key(cluster_secret(broker.config), RPC_KEY_PURPOSE)
                     if broker.config.cluster is not None else b"")

    # -- the cluster ---------------------------------------------------------------------

    @property
    def plane(self) -> DataPlane | None:
        """The node's cluster data plane (the only ``ClusterMember`` mqttring builds)."""
        plane = self.broker.plane
        assert plane is None or isinstance(plane, DataPlane)
        return plane

    def quorum(self) -> bool:
        """Whether this node can prove it is in the majority's view (a single node: yes).

        The same proof the node's fence uses (``DataPlane._guard_quorum``), taken now."""
        plane = self.plane
        if plane is None:
            return True
        return plane.metadata.in_quorum(self.broker.config.fence_seconds)

    def cluster(self) -> dict[str, Any]:
        broker, config = self.broker, self.broker.config
        plane = self.plane
        if plane is None:
            ports = broker.ports
            mqtt = f"{config.mqtt.rpartition(':')[0] or '127.0.0.1'}:{ports.mqtt}" \
                if config.mqtt is not None and ports is not None else None
            return {
                "node_id": self.node_id, "clustered": False, "leader": self.node_id,
                "epoch": 0, "term": None, "commit_index": None, "quorum": True,
                "fenced": False, "num_shards": config.num_shards, "replication": 1,
                "members": [{"id": self.node_id, "state": "up", "mqtt": mqtt,
                             "cluster": None, "raft": None, "incarnation": 0,
                             "shards": {"owner": config.num_shards,
                                        "replica": config.num_shards, "catching_up": 0}}],
            }
        status = plane.metadata.status(brief=True)
        view, raft = status["view"], status["raft"]
        counts = view["shard_counts"]
        empty = {"owner": 0, "replica": 0, "catching_up": 0}
        return {
            "node_id": self.node_id, "clustered": True, "leader": view["leader"],
            "epoch": view["epoch"], "term": raft.get("term"),
            "commit_index": raft.get("commit_index"), "quorum": self.quorum(),
            "fenced": plane.fenced,
            "num_shards": view["num_shards"], "replication": view["replication"],
            "members": [{"id": node, "state": m["state"], "mqtt": m["mqtt"],
                         "cluster": m["cluster"], "raft": m["raft"],
                         "incarnation": m["incarnation"], "shards": counts.get(node, empty)}
                        for node, m in sorted(view["members"].items())],
        }

    def _members(self) -> dict[str, str]:
        """Members worth asking (not down), id -> cluster address; this node included."""
        plane = self.plane
        if plane is None:
            return {self.node_id: ""}
        view = plane.view
        return {n: m.cluster for n, m in view.members.items() if m.state is not MemberState.DOWN}

    async def _ask(self, node: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        address = self._members().get(node)
        if address is None:
            raise NotFound(f"no member {node!r} that is not down")
        try:
            return await call_once(address, self._key, f"http@{self.node_id}", kind, body,
                                   FANOUT_TIMEOUT)
        except (OSError, EOFError, AuthError, ProtocolError, RpcError,
                trio.TooSlowError) as exc:
            raise Unavailable(f"member {node!r} did not answer: {exc!r}") from None

    async def _fanout(self, local: Any, kind: str, body: dict[str, Any]
                      ) -> tuple[list[dict[str, Any]], list[str]]:
        """``local()`` here, ``kind`` on every other member; answers and who did not."""
        answers: list[dict[str, Any]] = []
        unreachable: list[str] = []

        async def one(node: str) -> None:
            try:
                answers.append(local() if node == self.node_id
                               else await self._ask(node, kind, body))
            except Unavailable as exc:
                log.debug("%s", exc)
                unreachable.append(node)

        async with trio.open_nursery() as nursery:
            for node in sorted(self._members()):
                nursery.start_soon(one, node)
        return answers, sorted(unreachable)

    async def node_stats(self, node: str) -> dict[str, Any]:
        if node == self.node_id:
            return node_stats(self.broker)
        return await self._ask(node, "stats", {})

    # -- clients -------------------------------------------------------------------------

    def _core(self) -> Any:
        if self.broker.core is None:
            raise Unavailable("the node is not serving yet")
        return self.broker.core

    async def clients(self, after: str, limit: int) -> dict[str, Any]:
        body = {"after": after, "limit": limit}
        answers, unreachable = await self._fanout(
            lambda: {"clients": inspect.list_clients(self._core(), self.node_id, after=after,
                                                     limit=limit)}, "clients", body)
        rows = sorted((c for a in answers for c in a["clients"]), key=lambda c: c["client_id"])
        page = rows[:limit]
        await self._session_figures(page)
        return {"clients": page, "unreachable": unreachable,
                "next": page[-1]["client_id"] if len(rows) > limit or len(page) == limit
                else None}

    async def client(self, client_id: str) -> dict[str, Any]:
        def local() -> dict[str, Any]:
            found = inspect.find_client(self._core(), self.node_id, client_id)
            return {"clients": [found] if found else []}
        answers, _ = await self._fanout(local, "clients", {"client_id": client_id})
        for answer in answers:
            if answer["clients"]:
                row: dict[str, Any] = answer["clients"][0]
                await self._session_figures([row])
                return row
        raise NotFound(f"client {client_id!r} is not connected")

    async def _session_figures(self, rows: list[dict[str, Any]]) -> None:
        """Patch in the subscriptions, queued and inflight counts of persistent sessions
        from their home nodes (the connection's node holds a stand-in whose figures are
        not the session's); None where the home did not answer."""
        plane = self.plane
        if plane is None:
            return
        view = plane.view
        by_home: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            if row["clean_session"] is False:
                home = view.owner(view.shard_for_client(row["client_id"]))
                if home is not None and home != row["node"]:
                    by_home.setdefault(home, []).append(row)

        async def one(home: str, wanted: list[dict[str, Any]]) -> None:
            ids = [row["client_id"] for row in wanted]
            try:
                counts = (inspect.session_counts(self._core(), ids) if home == self.node_id
                          else (await self._ask(home, "session_counts",
                                                {"clients": ids}))["sessions"])
            except (Unavailable, NotFound):
                counts = {}
            unknown = dict.fromkeys(("subscriptions", "queued", "inflight"))
            for row in wanted:
                row.update(counts.get(row["client_id"], unknown))

        async with trio.open_nursery() as nursery:
            for home, wanted in by_home.items():
                nursery.start_soon(one, home, wanted)

    async def kick(self, client_id: str) -> dict[str, Any]:
        kicked: list[str] = []

        async def one(node: str) -> None:
            if node == self.node_id:
                done = inspect.kick_client(self._core(), client_id)
            else:
                try:
                    done = (await self._ask(node, "kick", {"client_id": client_id}))["kicked"]
                except Unavailable:
                    return
            if done:
                kicked.append(node)

        async with trio.open_nursery() as nursery:
            for node in sorted(self._members()):
                nursery.start_soon(one, node)
        if not kicked:
            raise NotFound(f"client {client_id!r} is not connected")
        log.info("client %r kicked through the HTTP API (on %s)", client_id, ", ".join(kicked))
        return {"kicked": client_id, "nodes": sorted(kicked)}

    async def subscriptions(self, client: str | None, after: tuple[str, str], limit: int
                            ) -> dict[str, Any]:
        body: dict[str, Any] = {"after_client": after[0], "after_filter": after[1],
                                "limit": limit}
        if client is not None:
            body["client"] = client
        answers, unreachable = await self._fanout(
            lambda: {"subscriptions": inspect.list_subscriptions(
                self._core(), self.node_id, client=client, after=after, limit=limit)},
            "subscriptions", body)
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        for answer in answers:
            for row in answer["subscriptions"]:
                merged.setdefault((row["client_id"], row["filter"]), row)
        page = [merged[k] for k in sorted(merged)][:limit]
        return {"subscriptions": page, "unreachable": unreachable,
                "next": encode_cursor(page[-1]["client_id"], page[-1]["filter"])
                if len(page) == limit else None}

    # -- messages ------------------------------------------------------------------------

    async def retained(self, topic_filter: str, after: str, limit: int) -> dict[str, Any]:
        """A page of what a subscriber to ``topic_filter`` would get.  The router gathers
        every match (from the owners of the shards concerned) before the page is cut: a
        narrow filter is cheaper on a large store."""
        router = self.broker.router
        if router is None:
            raise Unavailable("the node is not serving yet")
        # The page's limit + 1 smallest topics (one more says whether a next page exists):
        # a heap of that size, not a sort of every match, on the event loop.
        found = heapq.nsmallest(limit + 1, (m for m in await router.retained(topic_filter)
                                            if m.topic > after), key=lambda m: m.topic)
        page = found[:limit]
        return {"retained": [retained_row(m) for m in page],
                "next": page[-1].topic if len(found) > limit else None}

    async def retained_message(self, topic: str) -> dict[str, Any]:
        """The retained message of exactly ``topic`` (a topic name, no wildcards), with its
        whole payload; ``NotFound`` when the topic holds none.  A topic name is a filter
        that matches only itself, so the router asks just the owner of its shard."""
        router = self.broker.router
        if router is None:
            raise Unavailable("the node is not serving yet")
        for message in await router.retained(topic):
            if message.topic == topic:
                return retained_row(message, whole=True)
        raise NotFound(f"no retained message on topic {topic!r}")

    async def publish(self, message: Message) -> None:
        """Through the node's router, like a client's PUBLISH (cluster delivery included)."""
        router = self.broker.router
        if router is None:
            raise Unavailable("the node is not serving yet")
        try:
            await router.publish(message)
        except PublishRefused as exc:
            raise Unavailable(f"the cluster did not accept the publish: {exc}") from None


def retained_row(message: Message, whole: bool = False) -> dict[str, Any]:
    """A listing's row; ``whole``: with the whole payload too (``payload``, in the same
    ``encoding`` as the preview)."""
    payload = bytes(message.payload)
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        preview, encoding = text[:PREVIEW_BYTES], "utf8"
    else:
        preview, encoding = base64.b64encode(payload[:PREVIEW_BYTES]).decode(), "base64"
    row: dict[str, Any] = {
        "topic": message.topic, "qos": message.qos, "size": len(payload),
        "preview": preview, "encoding": encoding,
        "truncated": len(preview) < len(text) if text is not None
        else len(payload) > PREVIEW_BYTES}
    if whole:
        row["payload"] = text if text is not None else base64.b64encode(payload).decode()
    return row


def encode_cursor(client_id: str, topic_filter: str) -> str:
    """An opaque paging cursor for (client id, filter) pairs."""
    raw = f"{client_id}\x00{topic_filter}".encode()
    return base64.urlsafe_b64encode(raw).decode()


def decode_cursor(cursor: str) -> tuple[str, str]:
    """The pair back; ``ValueError`` for a cursor this API did not hand out."""
    try:
        client_id, sep, topic_filter = base64.urlsafe_b64decode(cursor.encode()).decode() \
            .partition("\x00")
    except (ValueError, UnicodeError):
        raise ValueError(f"bad cursor {cursor!r}") from None
    if not sep:
        raise ValueError(f"bad cursor {cursor!r}")
    return client_id, topic_filter
