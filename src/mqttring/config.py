"""Node configuration: one frozen value built from defaults, a TOML file and CLI flags.

Every limit the broker enforces lives here so that it is configurable and documented in
one place (``docs/configuration.md`` mirrors this file).  A value is validated when the
config is built, so a bad setting stops the node at start-up rather than at the first client.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


def parse_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"host:port"``, ``":port"`` or ``"[::1]:port"`` to a tuple; port 0 means any free port."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    host = host.strip("[]") or default_host
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"port is not a number in {text!r}") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"port out of range in {text!r}")
    return host, number


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may cost the node; each limit has one documented outcome."""

    #: Largest packet accepted (remaining length); a bigger one closes the connection.
    max_packet_size: int = 1 * 1024 * 1024
    #: Outbound QoS 1/2 messages awaiting acknowledgement per client; more wait in its queue.
    max_inflight: int = 32
    #: Messages queued per session (offline or behind the inflight window).  When full, the
    #: oldest QoS 0 message is dropped first, then the oldest QoS 1/2 message; drops are counted.
    max_queued: int = 1000
    #: Open client connections per node; CONNECT beyond it gets CONNACK 3 (server unavailable).
    max_connections: int = 100_000
    #: Seconds a socket may stay open without sending CONNECT before it is closed.
    connect_timeout: float = 10.0
    #: Bytes of encoded packets buffered for one connection before QoS 0 deliveries to it are
    #: dropped (and counted); QoS 1/2 are bounded by ``max_inflight`` instead.
    max_outgoing_buffer: int = 4 * 1024 * 1024
    #: Subscriptions per client; more are refused with SUBACK 0x80.
    max_subscriptions: int = 10_000
    #: Seconds a queued message for an offline session is kept (0 = forever).
    queued_message_ttl: float = 0.0
    #: Seconds a publish may be held back (not acknowledged, its connection reading no
    #: further PUBLISH) while a connected subscriber it feeds has ``max_queued`` messages
    #: waiting; past it that subscriber is disconnected as a slow consumer.  0: never hold,
    #: drop the oldest queued message instead (``mqttring.broker.flow``).
    slow_subscriber_hold: float = 10.0
    #: Packets one connection may have read and not yet handled: how many of its QoS 1/2
    #: publishes can be in flight at once (accepted in batches, acknowledged in order).  At
    #: the bound the connection stops reading until a batch is handled (back-pressure).
    publish_window: int = 256
    #: The same bound in payload bytes (whichever is reached first; one packet always fits):
    #: the read-ahead memory of one connection.
    publish_window_bytes: int = 1024 * 1024
    #: Seconds without a byte either way after which a TCP connection gives up its task and
    #: waits in the node's parking lot (``mqttring.broker.parking``): an idle connection then
    #: costs its state, not a task.  0 = never park.
    park_idle_after: float = 0.25


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Tuning of the node's LMDB store (see ``docs/storage.md``)."""

    map_size: int = 256 * 1024 * 1024
    lazy_sync_ms: int = 200
    memtable_max_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Everything one node needs to run; ``BrokerConfig()`` is a working single node."""

    node_id: str = "node1"
    mqtt: str | None = "127.0.0.1:1883"
    ws: str | None = None
    #: MQTT over TLS listener HOST:PORT (conventionally 8883); needs certfile and keyfile.
    mqtts: str | None = None
    #: MQTT over WebSocket over TLS listener HOST:PORT; needs certfile and keyfile.
    wss: str | None = None
    #: PEM server certificate (chain) and its private key for the TLS listeners
    #: (``docs/security.md``); read again by ``BrokerNode.tls.reload()``.
    certfile: Path | None = None
    keyfile: Path | None = None
    #: PEM CA certificate(s) that client certificates must be signed by.
    cafile: Path | None = None
    #: Oldest TLS version accepted: "1.2" or "1.3".  Ciphers are the ``ssl`` module's defaults.
    tls_min_version: str = "1.2"
    #: TLS clients must present a certificate signed by ``cafile``.
    require_certificate: bool = False
    #: The CN of a TLS client's certificate is its username (mosquitto's option of that
    #: name): the certificate authenticates it, CONNECT's username/password are not used.
    use_identity_as_username: bool = False
    data_dir: Path | None = Path("data")
    sys_interval: float = 10.0
    #: Bind the MQTT and WebSocket ports with SO_REUSEPORT, so that several nodes on one
    #: machine share them (``--workers``; ``mqttring.broker.listeners``).
    reuse_port: bool = False
    limits: Limits = field(default_factory=Limits)
    store: StoreSettings = field(default_factory=StoreSettings)
    num_shards: int = 1024
    #: Topic filters whose messages are archived for analytics (``docs/analytics.md``).
    archive: tuple[str, ...] = ()
    #: Archived messages older than this many seconds are removed (0 keeps them).
    archive_max_age: float = 7 * 24 * 3600.0
    #: Archive size bound in bytes of topics and payloads, oldest removed first (0 = none).
    archive_max_bytes: int = 1024 * 1024 * 1024
    #: Seconds between archive retention passes.
    archive_expiry_interval: float = 60.0
    #: Accept CONNECTs without a username (else CONNACK 5, not authorized).
    allow_anonymous: bool = True
    #: username -> SHA-256 hex digest of the password; a wrong pair gets CONNACK 4.
    users: dict[str, str] | None = None
    #: Admin RPC (stats, snapshots) of a single node, HOST:PORT; needs ``cluster_secret``.
    #: A cluster node serves the same requests on its ``cluster`` address.
    admin: str | None = None
    # Cluster settings (used when a node joins or forms a cluster).
    cluster: str | None = None
    raft: str | None = None
    join: str | None = None
    cluster_secret: str | None = None
    #: Mutual TLS on the cluster address (``mqttring.cluster_tls``): the cluster's own CA,
    #: and this node's certificate and key signed by it.  All three, or none (plain TCP).
    cluster_cafile: Path | None = None
    cluster_certfile: Path | None = None
    cluster_keyfile: Path | None = None
    replication: int = 2
    #: Seconds between a member's heartbeats to the Raft leader.
    heartbeat_interval: float = 0.5
    #: Seconds without a heartbeat before the leader marks a member down and moves its shards.
    failure_grace: float = 5.0
    #: Seconds a node may go without proof that it is in the majority's view before it
    #: stops serving (disconnects its clients, answers CONNECT with CONNACK 3).  0 means
    #: ``failure_grace - heartbeat_interval``; it must stay below ``failure_grace`` so the node
    #: stops before the majority takes its shards over (see docs/design.md, netsplits).
    fence_after: float = 0.0
    #: Seconds between route digests sent to each peer (anti-entropy; docs/design.md).
    route_sync_interval: float = 2.0
    #: Longest an owner holds a QoS >= 1 publish while its routes are not known complete,
    #: and longest a durable write waits for a replica the view still names; past it the
    #: publish is refused (no PUBACK) rather than acknowledged on incomplete state.
    cluster_write_patience: float = 15.0
    #: Relative share of shards this node takes on the ring (an integer >= 1).
    node_weight: int = 1
    #: Seconds a leaving node waits for its shards to be caught up elsewhere before it goes.
    leave_timeout: float = 30.0
    #: SIGINT/SIGTERM: leave the cluster (hand the shards away) before stopping.  False:
    #: stop and stay a member, as for a restart (``--workers`` stops all its nodes at once,
    #: with nobody to hand shards to).
    leave_on_stop: bool = True
    #: ``python -m mqttring.node`` only (an embedding process owns its own GC): a full
    #: garbage collection at most once per this many middle-generation ones (CPython: 10).
    #: Every full collection walks every connection's objects; see ``docs/operations.md``.
    gc_full_every: int = 100
    #: ``python -m mqttring.node`` only: move what start-up allocated out of the collector's
    #: reach once the node listens (it lives as long as the process anyway).
    gc_freeze: bool = True

    def __post_init__(self) -> None:
        for name in ("mqtt", "ws", "mqtts", "wss", "cluster", "raft", "join", "admin"):
            value = getattr(self, name)
            if value is not None:
                parse_hostport(value)
        if self.mqtt is None and self.ws is None and self.mqtts is None and self.wss is None:
            raise ConfigError("at least one of the mqtt, ws, mqtts or wss listeners is needed")
        self._check_tls()
        self._check_cluster_tls()
        if self.sys_interval < 0:
            raise ConfigError("sys_interval must be >= 0 (0 disables $SYS)")
        if self.num_shards < 1:
            raise ConfigError("num_shards must be >= 1")
        if self.replication < 1:
            raise ConfigError("replication must be >= 1")
        if self.gc_full_every < 1:
            raise ConfigError("gc_full_every must be >= 1")
        if self.heartbeat_interval <= 0 or self.failure_grace <= self.heartbeat_interval:
            raise ConfigError("need 0 < heartbeat_interval < failure_grace")
        if self.fence_after < 0 or self.fence_after >= self.failure_grace:
            raise ConfigError("need 0 <= fence_after < failure_grace (0: derived)")
        if self.fence_seconds <= self.failure_grace / 4:
            raise ConfigError("fence_after (default failure_grace - heartbeat_interval) must "
                              "exceed failure_grace / 4: a heartbeat cannot prove quorum "
                              "for less than that")
        if self.route_sync_interval <= 0:
            raise ConfigError("route_sync_interval must be > 0")
        if self.cluster_write_patience <= 0:
            raise ConfigError("cluster_write_patience must be > 0")
        if self.node_weight < 1:
            raise ConfigError("node_weight must be >= 1")
        if self.leave_timeout < 0:
            raise ConfigError("leave_timeout must be >= 0")
        lim = self.limits
        if lim.max_packet_size < 16 or lim.max_packet_size > 268_435_455:
            raise ConfigError("limits.max_packet_size must be in 16..268435455")
        if not 1 <= lim.max_inflight <= 65535:
            raise ConfigError("limits.max_inflight must be in 1..65535")
        for name in ("max_queued", "max_connections", "max_subscriptions"):
            if getattr(lim, name) < 1:
                raise ConfigError(f"limits.{name} must be >= 1")
        if lim.connect_timeout <= 0:
            raise ConfigError("limits.connect_timeout must be > 0")
        if lim.slow_subscriber_hold < 0:
            raise ConfigError("limits.slow_subscriber_hold must be >= 0")
        if lim.slow_subscriber_hold >= self.cluster_write_patience:
            raise ConfigError("limits.slow_subscriber_hold must be below cluster_write_patience "
                              f"({self.cluster_write_patience}s): a publish held longer would "
                              "be refused by the node waiting for it")
        if not 1 <= lim.publish_window <= 65535:
            raise ConfigError("limits.publish_window must be in 1..65535")
        if lim.publish_window_bytes < 1:
            raise ConfigError("limits.publish_window_bytes must be >= 1")
        if not lim.park_idle_after >= 0:
            raise ConfigError("limits.park_idle_after must be >= 0 (0 = never park)")

    def _check_tls(self) -> None:
        """What can be told without loading the files (``mqttring.broker.tls`` loads them)."""
        if self.tls_min_version not in ("1.2", "1.3"):
            raise ConfigError(f"tls_min_version must be \"1.2\" or \"1.3\", "
                              f"not {self.tls_min_version!r}")
        if self.use_identity_as_username and not self.require_certificate:
            raise ConfigError("use_identity_as_username needs require_certificate")
        if self.require_certificate and self.cafile is None:
            raise ConfigError("require_certificate needs cafile (the CA of client certificates)")
        if self.mqtts is None and self.wss is None:
            return
        if self.certfile is None or self.keyfile is None:
            raise ConfigError("a TLS listener (mqtts, wss) needs certfile and keyfile")
        _check_files(self, ("certfile", "keyfile", "cafile"))

    def _check_cluster_tls(self) -> None:
        names = ("cluster_cafile", "cluster_certfile", "cluster_keyfile")
        given = [getattr(self, name) is not None for name in names]
        if any(given) and not all(given):
            raise ConfigError("cluster TLS needs all of cluster_cafile, cluster_certfile and "
                              "cluster_keyfile")
        _check_files(self, names)

    @property
    def fence_seconds(self) -> float:
        """``fence_after``, or its default: a heartbeat short of the failure grace."""
        return self.fence_after or self.failure_grace - self.heartbeat_interval

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> BrokerConfig:
        """Read a TOML file (top-level keys plus ``[limits]`` and ``[store]`` tables)."""
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from exc
        return cls.from_mapping(raw, **overrides)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any], **overrides: Any) -> BrokerConfig:
        raw = dict(raw)
        limits = _build(Limits, raw.pop("limits", {}), "limits")
        store = _build(StoreSettings, raw.pop("store", {}), "store")
        # Flags join the file's settings before the checks, so that settings that go
        # together (a TLS listener and its certfile) may come one from each.
        raw.update({k: v for k, v in overrides.items() if v is not None})
        base = _build(cls, raw, "")
        return replace(base, limits=limits, store=store)


_PATHS = frozenset({"data_dir", "certfile", "keyfile", "cafile", "cluster_cafile",
                    "cluster_certfile", "cluster_keyfile"})


def _check_files(config: BrokerConfig, names: tuple[str, ...]) -> None:
    for name in names:
        path = getattr(config, name)
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"{name} {path} is not a readable file")


def _build(kind: type, raw: dict[str, Any], section: str) -> Any:
    known = {f.name: f for f in fields(kind)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known or name in ("limits", "store"):
            where = f"[{section}] " if section else ""
            raise ConfigError(f"unknown setting {where}{key!r}")
        if name in _PATHS and isinstance(value, str):
            value = Path(value)
        if name == "archive":
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ConfigError("archive must be a list of topic filters")
            value = tuple(value)
        kwargs[name] = value
    try:
        return kind(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
