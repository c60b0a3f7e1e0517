"""``BrokerNode``: one node, embeddable in a trio program or in plain Python.

(Applications use ``mqttring.MqttRingBroker``, the composition root that hands this node the
cluster data plane when the configuration asks for one; this layer knows clustering only
through ``mqttring.broker.membership``.)

Lifecycle (all under one nursery, so shutdown is just cancellation):

1. open the node store in a worker thread and read back retained messages and persistent
   sessions;
2. bind the TCP and WebSocket listeners (and their TLS twins, ``mqtts`` and ``wss``, whose
   certificates are loaded before anything else starts) and report the bound ports through
   ``task_status`` (port 0 in the config means "any free port" — tests rely on it);
3. serve until cancelled (or, for a cluster member, until it has left the cluster at an
   operator's request: ``mqttring leave``); then close every client connection (no wills:
   the node, not the client, is going away), write what the sessions still hold, and close
   the store.

Leaving: a cluster member with ``leave_on_stop`` hands its shards away before it stops, when
stopped through ``async with``, ``stop()`` or a signal to ``python -m mqttring.node``
(``leave_cluster``, bounded by ``leave_timeout + LEAVE_SLACK``).  Cancelling ``serve``
directly stops without leaving (the cluster marks the node down after ``failure_grace``).

From plain Python, ``start()`` runs the same ``serve`` in a background thread with its own
trio loop and returns the ports; ``stop()`` ends it from outside through the trio token
(``mqttring.broker.background``).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Self

import trio

from mqttring.broker.admin import register_admin
from mqttring.broker.archive import TelemetryArchive
from mqttring.broker.background import LEAVE_SLACK, BackgroundThread
from mqttring.broker.client import ClientHandler
from mqttring.broker.core import BrokerCore
from mqttring.broker.files import NodeFiles
from mqttring.broker.listeners import open_listeners
from mqttring.broker.membership import ClusterFactory, ClusterMember
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.parking import ParkingLot, parking_supported
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import LocalRouter, Router
from mqttring.broker.scheduling import keep_arrival_order
from mqttring.broker.session_store import SessionStore
from mqttring.broker.shard_writes import LocalShardWriter, ShardWriter
from mqttring.broker.shared import Strategy
from mqttring.broker.sys_topics import publish_sys_topics
from mqttring.broker.timers import ConnectionTimers
from mqttring.broker.tls import (
    TlsContext,
    TlsTransport,
    certificate_identity,
    handshake,
    peer_of,
)
from mqttring.broker.transport import TcpTransport
from mqttring.broker.websocket import PlainWebSocketTransport, TlsWebSocketTransport
from mqttring.config import BrokerConfig, ConfigError, parse_hostport
from mqttring.errors import describe_error, sole_exception
from mqttring.lsm import Durability, LsmStore, StoreError
from mqttring.ring.hashing import shard_of
from mqttring.rpc import RPC_KEY_PURPOSE, RpcServer, cluster_secret, derive_key

log = logging.getLogger("mqttring.broker")

_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_ACCEPT_BACKOFF = 0.1
#: The longest pause between two retained tombstone collections (seconds); shorter for a
#: short ``retained_tombstone_seconds`` (a quarter of it, at least a second).
TOMBSTONE_SWEEP_MAX = 60.0

#: Serves one TLS connection once its handshake is done: (stream, peer, certificate CN).
TlsServe = Callable[[trio.SSLStream[trio.SocketStream], str, str | None], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class BoundPorts:
    mqtt: int | None
    ws: int | None
    mqtts: int | None = None
    wss: int | None = None


class BrokerNode(BackgroundThread):
    """One MQTT 3.1.1 node; see ``docs/embedding.md`` for both ways of running it.

    ``cluster`` builds the node's cluster membership when ``config.cluster`` is set.
    """

    def __init__(self, config: BrokerConfig | None = None, *,
                 cluster: ClusterFactory | None = None, files: NodeFiles | None = None) -> None:
        self.config = config or BrokerConfig()
        self._cluster_factory = cluster
        #: The files ``config`` names, loaded by the caller (``mqttring.broker.files``) for
        #: the first ``serve``; None: ``serve`` loads them.
        self._files = files
        self.metrics = BrokerMetrics()
        self.ports: BoundPorts | None = None
        self.store: LsmStore | None = None
        self.core: BrokerCore | None = None
        self.router: Router | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        #: The node's cluster membership (the data plane), when ``config.cluster`` is set.
        self.plane: ClusterMember | None = None
        #: The telemetry archive, when ``config.archive`` lists topic filters.
        self.archive: TelemetryArchive | None = None
        #: The admin RPC server (the cluster RPC in a cluster, ``config.admin`` alone).
        self.admin: RpcServer | None = None
        self.admin_port: int | None = None
        #: Idle TCP connections without a task (None: parking off, or no epoll here).
        self.parking: ParkingLot | None = None
        #: Every connection's receive timeouts (``mqttring.broker.timers``), from start-up.
        self.timers: ConnectionTimers | None = None
        #: The node's retained messages (the shards it holds, in a cluster).
        self.retained: RetainedStore | None = None
        #: True once this node has left its cluster (then it stops, or has stopped).
        self.left = False
        self._left_event = trio.Event()
        self._stop_requested: trio.Event | None = None
        #: The TLS listeners' certificate (None: no ``mqtts``/``wss``); ``tls.reload()``
        #: (``reload_in_thread`` from trio) renews it for new connections.
        self.tls: TlsContext | None = None

    # -- trio API ---------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundPorts] = trio.TASK_STATUS_IGNORED
    ) -> None:
        config = self.config
        keep_arrival_order()  # packets of different clients handled in arrival order
        # A broker started again after it left its cluster joins as a new member: a ``left``
        # kept from the last run would end this one at once and skip its leave at stop.
        self.left = False
        self._left_event = trio.Event()
        # Files first: a bad certificate, password or ACL file stops the node before it
        # opens or binds anything.  Handed in (loaded once, by the node process) or loaded
        # here; a later ``serve`` (start again after a stop) reads them as they are then.
        files, self._files = self._files, None
        if files is None:
            files = NodeFiles.load(config)
        self.tls = None if files.tls is None else TlsContext(config, files.tls)
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
                plane = self._cluster_factory(config, store, self.metrics, files.cluster_tls)
                self.plane = plane
                core = BrokerCore(config, plane.session_store, self.metrics,
                                  router=plane.make_router, manager=plane.make_sessions,
                                  passwords=files.passwords, acl_rules=files.acl)
                retained = plane.retained
            else:
                retained = RetainedStore(store, config.num_shards,
                                         max_bytes=config.limits.max_retained_bytes,
                                         max_topics=config.limits.max_retained_messages)
                metrics = self.metrics

                def local_router(core: BrokerCore) -> Router:
                    return LocalRouter(core.sessions, retained, core.session_store, metrics,
                                       core.wake, flow=core.flow,
                                       strategy=Strategy(config.shared_subscription_strategy))

                core = BrokerCore(config, SessionStore(store, config.num_shards), self.metrics,
                                  router=local_router, passwords=files.passwords,
                                  acl_rules=files.acl)
            self.core, self.retained = core, retained
            async with trio.open_nursery() as nursery:
                if store is not None:
                    nursery.start_soon(self._stop_when_store_fails, store)
                nursery.start_soon(core.delayed_wills.run)  # MQTT 5 will delay
                nursery.start_soon(core.run_session_expiry)  # MQTT 5 session expiry
                if store is not None and config.retained_tombstone_seconds > 0:
                    age = config.retained_tombstone_seconds
                    nursery.start_soon(retained.collect_tombstones_every, age,
                                       min(max(age / 4, 1.0), TOMBSTONE_SWEEP_MAX))
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
                    await nursery.start(self._run_member, plane, nursery)
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
                    admin_tls = files.cluster_tls
                    self.admin = RpcServer(
                        derive_key(cluster_secret(config), RPC_KEY_PURPOSE), config.node_id,
                        tls=None if admin_tls is None else admin_tls.server,
                    )
                    register_admin(self.admin, self)
                    self.admin_port = await nursery.start(self.admin.serve, config.admin)
                # Every connection's receive timeouts, whatever its transport (``timers``).
                timers = self.timers = ConnectionTimers()
                nursery.start_soon(timers.run)
                mqtt_port = None
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
                ws_port = await self._listen_streams(nursery, config.ws, self._ws_connection)
                mqtts_port = await self._listen_tls(nursery, config.mqtts, self._serve_mqtts)
                wss_port = await self._listen_tls(nursery, config.wss, self._serve_wss)
                if config.sys_interval > 0:
                    nursery.start_soon(
                        publish_sys_topics, router, self.metrics, retained, config.sys_interval
                    )
                self.ports = BoundPorts(mqtt_port, ws_port, mqtts_port, wss_port)
                log.info("node %s listening: mqtt=%s ws=%s%s", config.node_id, mqtt_port,
                         ws_port, "" if self.tls is None
                         else f" mqtts={mqtts_port} wss={wss_port}")
                task_status.started(self.ports)
                try:
                    await trio.sleep_forever()
                finally:
                    core.shutting_down = True
                    for handler in list(core.clients.values()):
                        handler.kick("node shutting down", 0x8B)  # MQTT 5: server shutting down
        finally:
            with trio.CancelScope(shield=True):
                await self._close_store()

    async def _stop_when_store_fails(self, store: LsmStore) -> None:
        """Fail-stop.  A store that cannot write (disk full, I/O error) cannot back a PUBACK,
        a SUBACK or a replica's copy any more, and a node that stayed up refusing every
        durable write would be a grey failure: clients closed at each QoS 1 publish, and in
        a cluster its shards never moving to replicas that can still write, since it keeps
        answering heartbeats.  Stopping ends that: the cluster declares it down and moves
        its shards on, and a supervisor restarts it once the disk is fixed."""
        error = await store.failed()
        log.error("node %s: its store at %s failed (%s); stopping, since no write can be "
                  "made durable. Free the disk or fix the device, then restart the node.",
                  self.config.node_id, store.path, error)
        raise StoreError(f"the store at {store.path} failed: {error}")

    async def _run_member(self, plane: ClusterMember, nursery: trio.Nursery, *,
                          task_status: trio.TaskStatus[object]) -> None:
        await plane.run(task_status=task_status)
        # ``run`` returns only once the node has left at an operator's request: stop.
        log.info("node %s left the cluster; stopping", self.config.node_id)
        self.left = True
        self._left_event.set()
        nursery.cancel_scope.cancel()

    async def wait_left(self) -> None:
        """Return once the node has left its cluster at an operator's request: whoever runs
        ``serve`` beside other tasks (an HTTP listener, a process lifecycle) then stops them."""
        await self._left_event.wait()

    def apply_settings(self, config: BrokerConfig) -> None:
        """Run with ``config`` from now on (a SIGHUP reload; ``mqttring.reload`` says which
        settings may differ and when each takes effect)."""
        if self.core is not None:
            self.core.apply_settings(config)  # first: it may refuse (a bad file), then nothing
        self.config = config

    def reload_files(self) -> None:
        """Re-read the files named by settings (password file, ACL, the TLS listeners'
        certificate and key) as they are now; each is swapped whole or kept
        (``BrokerCore.reload_security``, ``TlsContext.reload``).  Blocking: call it in a
        thread.  Raises the first ``ConfigError``."""
        failed: list[ConfigError] = []
        if self.core is not None:
            try:
                self.core.reload_security()
            except ConfigError as exc:
                failed.append(exc)
        if self.tls is not None:
            try:  # a certificate that no longer loads must not stop the other reloads
                self.tls.reload()
            except ConfigError as exc:
                log.warning("TLS certificate not reloaded, the previous one stays in use: %s",
                            exc)
                failed.append(exc)
        if failed:
            raise failed[0]

    async def leave_cluster(self) -> bool:
        """Leave the cluster before stopping, if a member and ``leave_on_stop`` says so.

        Bounded by ``leave_timeout + LEAVE_SLACK``; never raises (but ``Cancelled``): a stop
        must not fail because the cluster could not be told.  False when the leave did not
        complete (the cluster then marks the node down after ``failure_grace``).
        """
        plane, node_id = self.plane, self.config.node_id
        if plane is None or not self.config.leave_on_stop or self.left:
            return True
        bound = self.config.leave_timeout + LEAVE_SLACK
        log.info("node %s leaving the cluster (at most %.0f s)", node_id, bound)
        try:
            with trio.move_on_after(bound) as scope:
                self.left = await plane.leave()
        except Exception as exc:  # whatever the cluster answered, the node stops
            log.warning("node %s: leave did not complete: %s; stopping anyway (the cluster "
                        "marks it down after failure_grace)", node_id, describe_error(exc))
            log.debug("leave failed", exc_info=True)
            return False
        if scope.cancelled_caught:
            log.warning("node %s: leave did not complete within %.0f s; stopping anyway (the "
                        "cluster marks it down after failure_grace)", node_id, bound)
            return False
        if self.left:
            log.info("node %s left the cluster", node_id)
        return True

    def _start_archive(self, nursery: trio.Nursery, store: LsmStore) -> TelemetryArchive:
        """The telemetry archive (``docs/analytics.md``): appended once, at its shard's owner.

        Its writer is this node's store only, in a cluster too: archive rows are not
        replicated (``mqttring.cluster.replication`` refuses an ``archive`` op, so handing
        them to the replicator made every replica log a failed ``on_repl`` per write), and
        the export merges each shard's archive from every node that holds some.  Retention
        runs over every shard, not only those owned now: rows this node archived while it
        owned a shard stay here after the shard moves, and only this node can expire them
        (the size it enforces counts them too).
        """
        config, plane = self.config, self.plane
        writer: ShardWriter = LocalShardWriter(store)
        if plane is not None:
            shard_for_topic = plane.retained.shard_for_topic
        else:
            shard_for_topic = partial(shard_of, num_shards=config.num_shards)
        shards: Callable[[], Iterable[int]] = lambda: range(config.num_shards)  # noqa: E731
        archive = TelemetryArchive(config.archive, store, writer, shard_for_topic,
                                   config.archive_max_age, config.archive_max_bytes)
        self.router.archive = archive  # type: ignore[union-attr]
        nursery.start_soon(archive.run_writer)
        nursery.start_soon(archive.run_expiry, config.archive_expiry_interval, shards)
        return archive

    async def _close_store(self) -> None:
        core, store = self.core, self.store
        if store is None:
            return
        try:
            # A failed store takes no more writes; what it acknowledged is on disk.
            if store.failure is None and self.archive is not None:
                await self.archive.flush()  # rows queued after the writer's last batch
            if store.failure is None and core is not None:
                dirty = [s for s in core.sessions.values() if s.persistent and s.has_changes()]
                if dirty:
                    await core.session_store.save_changes(dirty, Durability.DURABLE)
        finally:
            await trio.to_thread.run_sync(store.close)
            self.store = None

    def _timers(self) -> ConnectionTimers:
        assert self.timers is not None  # made before any listener opens
        return self.timers

    async def _accept_loop(
        self, listener: trio.SocketListener, nursery: trio.Nursery, parking: ParkingLot | None
    ) -> None:
        """Accept forever; each connection is one task of the node's nursery.

        (Our own loop rather than ``trio.serve_listeners``: it saves a wrapper task frame per
        idle connection, which matters at 10,000 connections.)
        """
        listen_socket = listener.socket
        #: A stretch of failed accepts: when it began, and how many (logged at its two ends
        #: only: one line per retry was ten a second for as long as descriptors ran out).
        failing_since: float | None = None
        failures = 0
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
                    failures += 1
                    if failing_since is None:
                        failing_since = trio.current_time()
                        log.warning("accept failed (%s); retrying every %.1f s (logged again "
                                    "when it works)", exc, _ACCEPT_BACKOFF)
                    await trio.sleep(_ACCEPT_BACKOFF)
                    continue
                if failing_since is not None:
                    log.warning("accepting connections again, after %d failed attempts in "
                                "%.1f s", failures, trio.current_time() - failing_since)
                    failing_since, failures = None, 0
                assert self.core is not None
                nursery.start_soon(ClientHandler(self.core, TcpTransport(sock), self._timers(),
                                                 parking).run)

    # -- TLS listeners (mqtts, wss) ---------------------------------------------------------

    async def _listen_tls(self, nursery: trio.Nursery, address: str | None,
                          serve: TlsServe) -> int | None:
        """Bind a TLS listener (if configured) and accept on it; returns the bound port."""
        return await self._listen_streams(nursery, address,
                                          partial(self._tls_connection, serve=serve))

    async def _listen_streams(self, nursery: trio.Nursery, address: str | None,
                              handle: Callable[[socket.socket], Awaitable[None]]
                              ) -> int | None:
        """Bind a listener (if configured) whose connections ``handle`` serves after a
        handshake of their own (TLS, WebSocket); returns the bound port."""
        if address is None:
            return None
        host, port = parse_hostport(address)
        listeners = await open_listeners(host, port, reuse_port=self.config.reuse_port)
        for listener in listeners:
            nursery.start_soon(self._accept_streams, listener, nursery, handle)
        return int(listeners[0].socket.getsockname()[1])

    async def _accept_streams(self, listener: trio.SocketListener, nursery: trio.Nursery,
                              handle: Callable[[socket.socket], Awaitable[None]]) -> None:
        """Accept only: each connection's handshakes run in its own task, so a client that
        stalls one delays nobody."""
        listen_socket = listener.socket
        async with listener:
            while True:
                try:
                    accepted, _ = await listen_socket.accept()
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.warning("accept failed (%s); retrying in %.1fs", exc, _ACCEPT_BACKOFF)
                    await trio.sleep(_ACCEPT_BACKOFF)
                    continue
                sock = socket.socket(fileno=accepted.detach())
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nursery.start_soon(handle, sock)

    async def _tls_connection(self, sock: socket.socket, serve: TlsServe) -> None:
        assert self.tls is not None
        tcp = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        stream = await handshake(tcp, self.tls, self.config.limits.connect_timeout,
                                 self.metrics)
        if stream is None:
            return
        peer = peer_of(tcp)
        try:
            await serve(stream, peer, certificate_identity(stream))
        except Exception:
            # A bug of ours (the WebSocket layer, say): this connection ends, the node goes on.
            self.metrics.internal_errors += 1
            log.exception("internal error on TLS connection %s; closing it", peer)
            await trio.aclose_forcefully(stream)

    async def _serve_mqtts(self, stream: trio.SSLStream[trio.SocketStream], peer: str,
                           identity: str | None) -> None:
        assert self.core is not None
        # No parking lot: see ``mqttring.broker.tls`` for why a TLS connection keeps its task.
        await ClientHandler(self.core, TlsTransport(stream, peer, identity), self._timers()).run()

    async def _ws_connection(self, sock: socket.socket) -> None:
        """A plain ``ws`` connection, on its socket (``broker/websocket.py``); as
        ``_tls_connection``, its errors end it alone."""
        assert self.core is not None
        transport = PlainWebSocketTransport(sock, self.config.limits.max_packet_size,
                                            self.config.limits.max_outgoing_buffer)
        try:
            if await transport.accept(self.config.limits.connect_timeout):
                await ClientHandler(self.core, transport, self._timers()).run()
        except Exception:
            self.metrics.internal_errors += 1
            log.exception("internal error on WebSocket connection %s; closing it",
                          transport.peer)
            sock.close()

    async def _serve_wss(self, stream: trio.SSLStream[trio.SocketStream], peer: str,
                         identity: str | None) -> None:
        """A WebSocket over the TLS stream: ``ws`` over TLS (``TlsWebSocketTransport``,
        ``broker/websocket.py``), the upgrade bounded by ``connect_timeout``.

        Until 2026-11-29 trio-websocket served it, which lost a CONNECT sent in the same
        read as the upgrade request (wsproto drops the bytes after the request when it
        accepts, and trio-websocket fed it whole reads: the client got its 101, then
        nothing until ``connect_timeout``), refused a message over its size limit even when
        it held several legal packets, handed messages over from a reader task a scheduler
        pass late, and needed a nursery of its own for that task (whose exception, 1009
        answered after the close handshake began, had once taken the node down).  The
        subprotocols accepted and refused, the close codes and the size limit are those of
        ``ws`` now.
        """
        assert self.core is not None
        limits = self.config.limits
        transport = TlsWebSocketTransport(stream, peer, identity, limits.max_packet_size,
                                          limits.max_outgoing_buffer)
        if await transport.accept(limits.connect_timeout):
            await ClientHandler(self.core, transport, self._timers()).run()
        # (Closes the socket even if cancelled; the TLS goodbye gets a second at most.)
        with trio.move_on_after(1), suppress(trio.BrokenResourceError, OSError):
            await stream.aclose()

    async def __aenter__(self) -> Self:
        stack = AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            self.ports = await nursery.start(self.serve)
        except BaseException as exc:
            failure: BaseException = exc
            try:
                await stack.aclose()
            except BaseException as group:  # trio wraps it again on the way out
                failure = group
            # One failure (a busy port: ``ListenError``) is raised as itself, not a group.
            raise sole_exception(failure) from None
        self._exit_stack, self._nursery = stack, nursery
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Stop the node.  The body's own exception comes out as itself: trio's nursery
        wraps it in an ``ExceptionGroup`` on its way through, and ``except KeyError``
        around the block would not catch a ``KeyError`` raised inside it.  A node that
        failed on its own during a clean body is raised as its one exception too; a body's
        exception together with a failure of the node stays a group (both are real)."""
        assert self._nursery is not None and self._exit_stack is not None
        if exc is None:  # a clean exit; on an error (or cancellation) stop at once
            await self.leave_cluster()
        self._nursery.cancel_scope.cancel()

        def leaves(error: BaseException) -> list[BaseException]:
            if isinstance(error, BaseExceptionGroup):
                return [leaf for inner in error.exceptions for leaf in leaves(inner)]
            return [error]

        try:
            return await self._exit_stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            failures = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
            own = [] if exc is None else [id(e) for e in leaves(exc)]  # a group of its own too
            if own and failures and all(id(e) in own for e in failures):
                return False  # not suppressed: the interpreter raises ``exc`` as it was
            if exc is not None or len(failures) != 1:
                raise
            failure = failures[0]
        raise failure  # outside the ``except``: the group is not its context
