"""``BrokerNode``: one node, embeddable in a trio program or in plain Python.

(Applications use ``mqttring.MqttRingBroker``, the composition root that hands this node the
cluster data plane when the configuration asks for one; this layer knows clustering only
through ``mqttring.broker.membership``.)

Lifecycle (all under one nursery, so shutdown is just cancellation):

1. open the node store in a worker thread and read back retained messages and persistent
   sessions;
2. bind the TCP and WebSocket listeners and report the bound ports through ``task_status``
   (port 0 in the config means "any free port" — tests rely on it);
3. serve until cancelled; then close every client connection (no wills: the node, not the
   client, is going away), write what the sessions still hold, and close the store.

From plain Python, ``start()`` runs the same ``serve`` in a background thread with its own
trio loop and returns the ports; ``stop()`` cancels it from outside through the trio token.
"""

from __future__ import annotations

import errno
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterable
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Self

import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, WebSocketServer

from mqttring.broker.admin import register_admin
from mqttring.broker.archive import TelemetryArchive
from mqttring.broker.client import ClientHandler
from mqttring.broker.core import BrokerCore
from mqttring.broker.listeners import open_listeners
from mqttring.broker.membership import ClusterFactory, ClusterMember
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.parking import ParkingLot, parking_supported
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter, Router
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter, ShardWriter
from mqttring.broker.sys_topics import publish_sys_topics
from mqttring.broker.transport import TcpTransport, WebSocketTransport
from mqttring.config import BrokerConfig, ConfigError, parse_hostport
from mqttring.lsm import Durability, LsmStore
from mqttring.ring.hashing import shard_of
from mqttring.rpc import RPC_KEY_PURPOSE, RpcServer, cluster_secret, derive_key

log = logging.getLogger("mqttring.broker")

#: Extra room a WebSocket message may take over the largest MQTT packet (header bytes).
_WS_FRAME_SLACK = 16
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_ACCEPT_BACKOFF = 0.1


@dataclass(frozen=True, slots=True)
class BoundPorts:
    mqtt: int | None
    ws: int | None


class BrokerNode:
    """One MQTT 3.1.1 node; see ``docs/embedding.md`` for both ways of running it.

    ``cluster`` builds the node's cluster membership when ``config.cluster`` is set.
    """

    def __init__(self, config: BrokerConfig | None = None, *,
                 cluster: ClusterFactory | None = None) -> None:
        self.config = config or BrokerConfig()
        self._cluster_factory = cluster
        self.metrics = BrokerMetrics()
        self.ports: BoundPorts | None = None
        self.store: LsmStore | None = None
        self.core: BrokerCore | None = None
        self.router: Router | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread_scope: trio.CancelScope | None = None
        #: The node's cluster membership (the data plane), when ``config.cluster`` is set.
        self.plane: ClusterMember | None = None
        #: The telemetry archive, when ``config.archive`` lists topic filters.
        self.archive: TelemetryArchive | None = None
        #: The admin RPC server (the cluster RPC in a cluster, ``config.admin`` alone).
        self.admin: RpcServer | None = None
        self.admin_port: int | None = None
        #: Idle TCP connections without a task (None: parking off, or no epoll here).
        self.parking: ParkingLot | None = None
        #: The node's retained messages (the shards it holds, in a cluster).
        self.retained: RetainedStore | None = None

    # -- trio API ---------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundPorts] = trio.TASK_STATUS_IGNORED
    ) -> None:
        config = self.config
        store = None
        if config.data_dir is not None:
            path = config.data_dir / "store"
            store = await trio.to_thread.run_sync(
                lambda: LsmStore.from_settings(path, config.store)
            )
            store.start()
        self.store = store
        try:
            plane: ClusterMember | None = None
            if config.cluster is not None:
                if store is None:
                    raise ConfigError("a cluster node needs a data_dir")
                if self._cluster_factory is None:
                    raise ConfigError("this node was built without cluster support; use "
                                      "mqttring.MqttRingBroker for a cluster member")
                plane = self._cluster_factory(config, store, self.metrics)
                self.plane = plane
                core = BrokerCore(config, plane.session_store, self.metrics,
                                  router=plane.make_router, manager=plane.make_sessions)
                retained = plane.retained
            else:
                retained = RetainedStore(store, config.num_shards)
                metrics = self.metrics

                def local_router(core: BrokerCore) -> Router:
                    return LocalRouter(core.sessions, retained, core.session_store, metrics,
                                       core.wake, flow=core.flow)

                core = BrokerCore(config, SessionStore(store, config.num_shards), self.metrics,
                                  router=local_router)
            self.core, self.retained = core, retained
            async with trio.open_nursery() as nursery:
                nursery.start_soon(core.delayed_wills.run)  # MQTT 5 will delay
                nursery.start_soon(core.run_session_expiry)  # MQTT 5 session expiry
                tcp_listeners: list[trio.SocketListener] | None = None
                if plane is not None:
                    self.admin = plane.admin
                    register_admin(self.admin, self)
                    if config.mqtt is not None:
                        # Bind first, so members see the real port (config may say :0).
                        host, port = parse_hostport(config.mqtt)
                        tcp_listeners = await open_listeners(host, port,
                                                             reuse_port=config.reuse_port)
                        bound = tcp_listeners[0].socket.getsockname()[1]
                        plane.advertise_mqtt(f"{host}:{bound}")
                    await nursery.start(plane.run)
                else:
                    n_retained = await retained.load()
                    n_sessions = await core.restore_sessions()
                    log.info("node %s: %d retained, %d sessions restored", config.node_id,
                             n_retained, n_sessions)
                router = core.router
                self.router = router
                if config.archive and store is not None:
                    self.archive = self._start_archive(nursery, store)
                if config.admin is not None and self.plane is None:
                    self.admin = RpcServer(
                        derive_key(cluster_secret(config), RPC_KEY_PURPOSE), config.node_id
                    )
                    register_admin(self.admin, self)
                    self.admin_port = await nursery.start(self.admin.serve, config.admin)
                mqtt_port = ws_port = None
                if config.mqtt is not None:
                    if tcp_listeners is None:
                        host, port = parse_hostport(config.mqtt)
                        tcp_listeners = await open_listeners(host, port,
                                                             reuse_port=config.reuse_port)
                    listeners = tcp_listeners
                    mqtt_port = listeners[0].socket.getsockname()[1]
                    parking = None
                    if config.limits.park_idle_after > 0 and parking_supported():
                        parking = ParkingLot(nursery, self.metrics)
                        nursery.start_soon(parking.run)
                    self.parking = parking
                    for listener in listeners:
                        nursery.start_soon(self._accept_loop, listener, nursery, parking)
                if config.ws is not None:
                    host, port = parse_hostport(config.ws)
                    ws_server = WebSocketServer(
                        self._on_websocket,
                        await open_listeners(host, port, reuse_port=config.reuse_port),
                        max_message_size=config.limits.max_packet_size + _WS_FRAME_SLACK,
                    )
                    await nursery.start(ws_server.run)
                    ws_port = ws_server.port
                if config.sys_interval > 0:
                    nursery.start_soon(
                        publish_sys_topics, router, self.metrics, retained, config.sys_interval
                    )
                self.ports = BoundPorts(mqtt_port, ws_port)
                log.info("node %s listening: mqtt=%s ws=%s", config.node_id, mqtt_port, ws_port)
                task_status.started(self.ports)
                try:
                    await trio.sleep_forever()
                finally:
                    core.shutting_down = True
                    for handler in list(core.clients.values()):
                        handler.kick("node shutting down")
        finally:
            with trio.CancelScope(shield=True):
                await self._close_store()

    def _start_archive(self, nursery: trio.Nursery, store: LsmStore) -> TelemetryArchive:
        config, plane = self.config, self.plane
        if plane is not None:
            writer: ShardWriter = plane.replicator
            shard_for_topic = plane.retained.shard_for_topic
            owned: Callable[[], Iterable[int]] = lambda: sorted(plane.owned_shards())  # noqa: E731
        else:
            writer = LocalShardWriter(store)
            shard_for_topic = partial(shard_of, num_shards=config.num_shards)
            owned = lambda: range(config.num_shards)  # noqa: E731
        archive = TelemetryArchive(config.archive, store, writer, shard_for_topic,
                                   config.archive_max_age, config.archive_max_bytes)
        self.router.archive = archive  # type: ignore[union-attr]
        nursery.start_soon(archive.run_writer)
        nursery.start_soon(archive.run_expiry, config.archive_expiry_interval, owned)
        return archive

    async def _close_store(self) -> None:
        core, store = self.core, self.store
        if store is None:
            return
        if self.archive is not None:
            await self.archive.flush()  # rows queued after the writer's last batch
        if core is not None:
            dirty = [s for s in core.sessions.values() if s.persistent and s.has_changes()]
            if dirty:
                await core.session_store.save_changes(dirty, Durability.DURABLE)
        await trio.to_thread.run_sync(store.close)
        self.store = None

    async def _accept_loop(
        self, listener: trio.SocketListener, nursery: trio.Nursery, parking: ParkingLot | None
    ) -> None:
        """Accept forever; each connection is one task of the node's nursery.

        (Our own loop rather than ``trio.serve_listeners``: it saves a wrapper task frame per
        idle connection, which matters at 10,000 connections.)
        """
        listen_socket = listener.socket
        async with listener:
            while True:
                try:
                    accepted, _ = await listen_socket.accept()
                    # The plain socket from here on (see ``TcpTransport``).
                    sock = socket.socket(fileno=accepted.detach())
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    # Out of descriptors or memory: existing clients keep working; retry.
                    log.warning("accept failed (%s); retrying in %.1fs", exc, _ACCEPT_BACKOFF)
                    await trio.sleep(_ACCEPT_BACKOFF)
                    continue
                assert self.core is not None
                nursery.start_soon(ClientHandler(self.core, TcpTransport(sock), parking).run)

    async def _on_websocket(self, request: WebSocketRequest) -> None:
        assert self.core is not None
        subprotocol = "mqtt" if "mqtt" in request.proposed_subprotocols else None
        try:
            ws = await request.accept(subprotocol=subprotocol)
        except (ConnectionClosed, trio.BrokenResourceError, OSError) as exc:
            log.debug("websocket handshake failed: %s", exc)
            return
        await ClientHandler(self.core, WebSocketTransport(ws)).run()

    async def __aenter__(self) -> Self:
        stack = AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            self.ports = await nursery.start(self.serve)
        except BaseException:
            await stack.aclose()
            raise
        self._exit_stack, self._nursery = stack, nursery
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._nursery is not None and self._exit_stack is not None
        self._nursery.cancel_scope.cancel()
        return await self._exit_stack.__aexit__(exc_type, exc, tb)

    # -- plain Python API -------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> BoundPorts:
        """Run the broker in a background thread; returns once it listens."""
        if self._thread is not None:
            raise RuntimeError("broker already started")
        result: queue.Queue[BoundPorts | BaseException] = queue.Queue()

        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            with trio.CancelScope() as scope:
                self._thread_scope = scope
                async with trio.open_nursery() as nursery:
                    result.put(await nursery.start(self.serve))

        def run() -> None:
            try:
                trio.run(main)
            except BaseException as exc:  # reported to start(), or logged after it
                result.put(exc)
                log.exception("broker thread failed")

        self._thread = threading.Thread(target=run, name="mqttring-broker", daemon=True)
        self._thread.start()
        outcome = result.get(timeout=timeout)
        if isinstance(outcome, BaseException):
            self._thread.join()
            self._thread = None
            raise outcome
        return outcome

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the background broker down cleanly and wait for it."""
        if self._thread is None:
            return
        token, scope = self._token, self._thread_scope
        if token is not None and scope is not None:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
        self._thread.join(timeout)
        self._thread = None
