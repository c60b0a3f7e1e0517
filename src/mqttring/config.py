"""Node configuration: one frozen value built from defaults, a TOML file, the environment
and CLI flags (later wins), checked against one schema whichever way it is built.

Every limit the broker enforces lives here so that it is configurable and documented in
one place (``docs/configuration.md`` mirrors this file).  Each field declares its type and
range as its annotation (``mqttring.config_fields`` explains the vocabulary); the check runs
in ``__post_init__``, so a value built in Python (an embedding program, ``dataclasses.replace``)
is held to the same rules as one read from a file, and a bad setting stops the node at
start-up with one line naming the key, the value and what is allowed, rather than at the first
client.  Rules that tie several fields together follow the per-field checks.

Adding a setting is one line: ``name: Annotated[int, Meta(ge=1, le=100)] = 10`` (or one of
the aliases below); the file key, ``MQTTRING_NAME`` and a flag passed through
``flag_overrides`` all follow from it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta

from mqttring.config_fields import (
    OFF,
    SECRET,
    ConfigError,
    Invalid,
    Rule,
    build,
    check_fields,
    check_value,
    error,
    field_specs,
    parse_text,
    show,
    suggest,
    table_values,
)
from mqttring.protocol.errors import InvalidTopic
from mqttring.protocol.topics import validate_topic_filter

__all__ = ["ENV_PREFIX", "BrokerConfig", "ConfigError", "Limits", "StoreSettings",
           "environment_overrides", "flag_overrides", "format_hostport", "parse_hostport"]

#: ``MQTTRING_NODE_ID``, ``MQTTRING_LIMITS__MAX_INFLIGHT``: see ``environment_overrides``.
ENV_PREFIX = "MQTTRING_"
SECRET_ENV = "MQTTRING_CLUSTER_SECRET"
#: The longest client id a persistent session's store keys can hold: LMDB's 511-byte key
#: limit less the shard (2 bytes), the id's length (2) and a queued message's sequence (8)
#: (``mqttring.broker.session_store``; a test writes one that long).
MAX_CLIENT_ID_BYTES = 511 - 2 - 2 - 8


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


def format_hostport(host: str, port: int) -> str:
    """``parse_hostport``'s inverse: ``[::1]:8080`` for an IPv6 host, else ``host:port``.

    ``::1:8080`` (what ``f"{host}:{port}"`` gives) is no address a reader or a browser can
    use: the port cannot be told from the address's own colons.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _address(text: str) -> str:
    parse_hostport(text)
    return text


def _utf8_property(text: str) -> str:
    if "\x00" in text or len(text.encode("utf-8")) > 1024:
        raise ValueError(text)  # (a lone surrogate fails the encode: a ValueError too)
    return text


def _topic_filters(filters: tuple[str, ...]) -> tuple[str, ...]:
    for topic_filter in filters:
        try:
            validate_topic_filter(topic_filter)
        except InvalidTopic as exc:
            raise Invalid(f"expected MQTT topic filters: {exc}") from None
    return filters


# Aliases for the annotations used more than once; each says what the field allows.
#: An integer >= 1 (a count, a bound that must let something through).
Count = Annotated[int, Meta(ge=1)]
#: Seconds, 0 allowed (0 usually turns the feature off; the field's comment says).
Seconds = Annotated[float, Meta(ge=0)]
#: Seconds > 0 (a period or a timeout that cannot be zero).
Interval = Annotated[float, Meta(gt=0)]
#: HOST:PORT the node binds or dials; ``""`` or ``false`` turn it off (``None``).
Address = Annotated[str | None, OFF, Rule(_address, "HOST:PORT with a port in 0..65535")]
#: 1..65535: what 16-bit MQTT packet identifiers can number at once.
Window16 = Annotated[int, Meta(ge=1, le=65535)]


def is_loopback(host: str) -> bool:
    """Whether a listener bound to ``host`` is reachable from this machine only."""
    if host.lower() == "localhost":  # host names are case-insensitive (RFC 4343)
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def _token(token: str) -> str:
    if len(token) < 16:
        raise ValueError(token)
    return token


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may cost the node; each limit has one documented outcome."""

    TABLE: ClassVar[str] = "limits"

    #: Largest packet accepted (remaining length); a bigger one closes the connection.
    max_packet_size: Annotated[int, Meta(ge=16, le=268_435_455)] = 1 * 1024 * 1024
    #: Outbound QoS 1/2 messages awaiting acknowledgement per client; more wait in its queue.
    max_inflight: Window16 = 32
    #: Messages queued per session (offline or behind the inflight window).  When full, the
    #: oldest QoS 0 message is dropped first, then the oldest QoS 1/2 message; drops are counted.
    max_queued: Count = 1000
    #: Open client connections per node; CONNECT beyond it gets CONNACK 3 (server unavailable).
    max_connections: Count = 100_000
    #: Seconds a socket may stay open without sending CONNECT before it is closed.
    connect_timeout: Interval = 10.0
    #: Bytes of encoded packets buffered for one connection before QoS 0 deliveries to it are
    #: dropped (and counted); QoS 1/2 are bounded by ``max_inflight`` instead.
    max_outgoing_buffer: Count = 4 * 1024 * 1024
    #: Subscriptions per client; more are refused with SUBACK 0x80.
    max_subscriptions: Count = 10_000
    #: Bytes of retained messages (payloads and topic names) one node holds in memory, as
    #: owner or replica: past it a retained message that would add bytes (a new topic, a
    #: bigger payload) is delivered but not retained.  0 = no limit.
    max_retained_bytes: Annotated[int, Meta(ge=0)] = 1024 * 1024 * 1024
    #: Retained topics one node holds: past it a retained message for a new topic is
    #: delivered but not retained.  0 = no limit.
    max_retained_messages: Annotated[int, Meta(ge=0)] = 0
    #: Seconds a queued message for an offline session is kept (0 = forever).
    queued_message_ttl: Seconds = 0.0
    #: QoS 2 messages a session remembers at most (by the identity a cluster gives each QoS
    #: 2 publish, for twice ``cluster_write_patience``) so that a copy made by a cluster's
    #: retry is delivered once (0: off).
    qos2_dedup_window: Annotated[int, Meta(ge=0)] = 4096
    #: Seconds a publish may be held back (not acknowledged, its connection reading no
    #: further PUBLISH) while a connected subscriber it feeds has ``max_queued`` messages
    #: waiting; past it that subscriber is disconnected as a slow consumer.  0: never hold,
    #: drop the oldest queued message instead (``mqttring.broker.flow``).
    slow_subscriber_hold: Seconds = 10.0
    #: Packets one connection may have read and not yet handled: how many of its QoS 1/2
    #: publishes can be in flight at once (accepted in batches, acknowledged in order).  At
    #: the bound the connection stops reading until a batch is handled (back-pressure).
    publish_window: Window16 = 256
    #: The same bound in payload bytes (whichever is reached first; one packet always fits):
    #: the read-ahead memory of one connection.
    publish_window_bytes: Count = 1024 * 1024
    #: Seconds a PINGRESP may wait behind the answers to the packets read before its
    #: PINGREQ (it follows them, as from one broker); past it, it goes out anyway, so that a
    #: client whose publishes are held (``slow_subscriber_hold``, a cluster owner's wait) is
    #: not closed by its own keep alive.  0 = answer a PINGREQ as soon as it is read.
    pingresp_wait: Seconds = 1.0
    #: Seconds a SUBACK waits for its new subscriptions' retained messages to be gathered
    #: (from their owners, in a cluster), so that it and they leave together, ahead of any
    #: message published after the client saw the SUBACK, as from one broker.  Past it, or
    #: at once when a node holding some does not answer (a failover under way), the SUBACK
    #: leaves alone and they follow once gathered; a message published meanwhile may then
    #: reach the client before them.  0 = SUBACK at once.
    suback_retained_wait: Seconds = 2.0
    #: Seconds without a byte either way after which a TCP connection gives up its task and
    #: waits in the node's parking lot (``mqttring.broker.parking``): an idle connection then
    #: costs its state, not a task.  0 = never park.
    park_idle_after: Seconds = 0.25
    #: MQTT 5: topic aliases the node may set up towards one client connection (at most
    #: the client's own Topic Alias Maximum).  0 = never: paho-mqtt 2.x announces a maximum
    #: it cannot resolve (docs/configuration.md).
    topic_alias_maximum_out: Annotated[int, Meta(ge=0, le=65535)] = 0
    #: Longest keep alive a client may ask for (mosquitto's ``max_keepalive``): a v5 client
    #: asking for 0 or more is told this value (Server Keep Alive), a 3.1.1 client is
    #: refused (CONNACK 2).  65535 = any.
    max_keepalive: Annotated[int, Meta(ge=1, le=65535)] = 65535
    #: Seconds an MQTT 3.1.1 persistent session (CleanSession 0) is kept after its
    #: connection closes, as if it had asked for this MQTT 5 Session Expiry Interval
    #: (mosquitto's ``persistent_client_expiration``).  0 = until its client returns.
    persistent_session_expiry: Annotated[int, Meta(ge=0, le=0xFFFFFFFF)] = 0
    #: Longest client id accepted, in UTF-8 bytes; a longer one is refused (CONNACK 2,
    #: MQTT 5: 0x85).  MQTT obliges a server to take 1..23 bytes; the ceiling is what a
    #: persistent session's store keys can hold (LMDB keys end at 511 bytes).
    max_client_id_bytes: Annotated[int, Meta(ge=23, le=MAX_CLIENT_ID_BYTES)] = MAX_CLIENT_ID_BYTES
    #: MQTT 5: User Properties one packet (or a will) may carry; one more is refused as it
    #: is read: DISCONNECT 0x97 (quota exceeded), for a CONNECT CONNACK 0x97.  Each costs
    #: the decoder microseconds on the event loop, and a 1 MiB packet holds 140,000.
    max_user_properties: Annotated[int, Meta(ge=1, le=65535)] = 128

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Tuning of the node's LMDB store (see ``docs/storage.md``)."""

    TABLE: ClassVar[str] = "store"

    #: Initial LMDB map size in bytes (it grows when full); 64 KiB at least.
    map_size: Annotated[int, Meta(ge=64 * 1024)] = 256 * 1024 * 1024
    #: Milliseconds within which lazily written data is synced to disk (0: at once).
    lazy_sync_ms: Annotated[int, Meta(ge=0)] = 200
    memtable_max_bytes: Count = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Everything one node needs to run; ``BrokerConfig()`` is a working single node."""

    node_id: Annotated[str, Meta(min_length=1)] = "node1"
    mqtt: Address = "127.0.0.1:1883"
    ws: Address = None
    #: MQTT over TLS listener HOST:PORT (conventionally 8883); needs certfile and keyfile.
    mqtts: Address = None
    #: MQTT over WebSocket over TLS listener HOST:PORT; needs certfile and keyfile.
    wss: Address = None
    #: PEM server certificate (chain) and its private key for the TLS listeners
    #: (``docs/security.md``); read again by ``BrokerNode.tls.reload()``.
    certfile: Path | None = None
    keyfile: Path | None = None
    #: PEM CA certificate(s) that client certificates must be signed by.
    cafile: Path | None = None
    #: PEM certificate revocation list(s) of ``cafile``: a client certificate it lists is
    #: refused in the handshake.  Read again with the certificate (SIGHUP); a CRL past its
    #: next update refuses every client certificate of its CA (OpenSSL's rule).
    crlfile: Path | None = None
    #: Oldest TLS version accepted: "1.2" or "1.3".  Ciphers are the ``ssl`` module's defaults.
    tls_min_version: Literal["1.2", "1.3"] = "1.2"
    #: TLS clients must present a certificate signed by ``cafile``.
    require_certificate: bool = False
    #: The CN of a TLS client's certificate is its username (mosquitto's option of that
    #: name): the certificate authenticates it, CONNECT's username/password are not used.
    use_identity_as_username: bool = False
    #: Where the node store lives; None (embedded use only) keeps everything in memory.
    data_dir: Path | None = Path("data")
    #: Seconds between ``$SYS`` updates; 0 disables ``$SYS``.
    sys_interval: Seconds = 10.0
    #: Bind the MQTT and WebSocket ports with SO_REUSEPORT, so that several nodes on one
    #: machine share them (``--workers``; ``mqttring.broker.listeners``).
    reuse_port: bool = False
    #: Seconds a cleared retained topic's tombstone is kept before it is collected (0 =
    #: kept for ever): longer than any retry or replay of an older write of the topic can
    #: take to arrive (``mqttring.broker.retained``).
    retained_tombstone_seconds: Seconds = 3600.0
    limits: Limits = field(default_factory=Limits)
    store: StoreSettings = field(default_factory=StoreSettings)
    num_shards: Count = 1024
    #: Topic filters whose messages are archived for analytics (``docs/analytics.md``).
    archive: Annotated[tuple[str, ...], Rule(_topic_filters, "a list of MQTT topic filters")
                       ] = ()
    #: Archived messages older than this many seconds are removed (0 keeps them).
    archive_max_age: Seconds = 7 * 24 * 3600.0
    #: Archive size bound in bytes of topics and payloads, oldest removed first (0 = none).
    archive_max_bytes: Annotated[int, Meta(ge=0)] = 1024 * 1024 * 1024
    #: Seconds between archive retention passes.
    archive_expiry_interval: Interval = 60.0
    #: Accept CONNECTs without a username (else CONNACK 5, not authorized).
    allow_anonymous: bool = True
    #: mosquitto-format password file (``mqttring passwd``, ``mosquitto_passwd``); a wrong
    #: username/password pair gets CONNACK 4 (``docs/security.md``).
    password_file: Path | None = None
    #: mosquitto-format ACL file; with one, anything it does not grant is denied.
    acl_file: Path | None = None
    #: Failed logins one source address may make per ``auth_failure_window`` seconds before
    #: its CONNECTs are refused unchecked (CONNACK 5); 0 = no limit.
    auth_failures_allowed: Annotated[int, Meta(ge=0)] = 10
    auth_failure_window: Interval = 60.0
    #: Admin RPC (stats, snapshots) of a single node, HOST:PORT; needs ``cluster_secret``.
    #: A cluster node serves the same requests on its ``cluster`` address.
    admin: Address = None
    #: HTTP API, ``/metrics`` and dashboard listener, HOST:PORT (``:PORT`` is loopback); off
    #: when None.  Bound beyond loopback it needs ``http_token`` (``docs/operations.md``).
    http: Address = None
    #: Bearer token every HTTP request must carry (or ``$MQTTRING_HTTP_TOKEN``).
    http_token: Annotated[str | None, SECRET, Rule(_token, "a string of at least 16 characters")
                          ] = None
    #: Seconds the HTTP listener waits for each read of a request (headers or body) before
    #: closing the connection: a client that opens connections and sends nothing, or a
    #: request a byte at a time, cannot hold them open for ever.
    http_read_timeout: Interval = 10.0
    #: Which member of a shared subscription (``$share/{group}/{filter}``) gets each
    #: message: ``round_robin``, ``random``, or ``local_first`` (a member on the node that
    #: owns the topic's shard when there is one: no inter-node message; docs/design.md).
    shared_subscription_strategy: Literal["round_robin", "random", "local_first"] = \
        "round_robin"
    #: MQTT 5 Response Information: sent in the CONNACK of a client whose Request Response
    #: Information is 1, typically the root of its response topics.  "": never sent.
    response_information: Annotated[str, Rule(_utf8_property, "a string of at most 1024 "
                                              "UTF-8 bytes without U+0000")] = ""
    # Cluster settings (used when a node joins or forms a cluster).
    cluster: Address = None
    raft: Address = None
    join: Address = None
    #: Seconds a node starting with ``join`` (or with known peers after a restart) keeps
    #: asking them for the cluster's Raft peers and for its admission before it gives up
    #: (one line, exit 1): a seed that never answers must not hold a start for ever, and a
    #: deploy may want to fail sooner (or wait longer for a seed being restarted).
    join_timeout: Interval = 30.0
    cluster_secret: Annotated[str | None, SECRET] = None
    #: Mutual TLS on the cluster address (``mqttring.cluster_tls``): the cluster's own CA,
    #: and this node's certificate and key signed by it.  All three, or none (plain TCP).
    cluster_cafile: Path | None = None
    cluster_certfile: Path | None = None
    cluster_keyfile: Path | None = None
    replication: Count = 2
    #: Seconds between a member's heartbeats to each other member (the Raft leader's answers
    #: prove it is in the majority's view).
    heartbeat_interval: Interval = 0.5
    #: Seconds without a heartbeat before the leader marks a member down and moves its shards.
    failure_grace: Interval = 5.0
    #: Seconds a node may go without proof that it is in the majority's view before it
    #: stops serving (disconnects its clients, answers CONNECT with CONNACK 3).  0 means
    #: ``failure_grace - heartbeat_interval``; it must stay below ``failure_grace`` so the node
    #: stops before the majority takes its shards over (see docs/design.md, netsplits).
    fence_after: Seconds = 0.0
    #: A client connected to one node whose persistent session's home moves to another (its
    #: home died, left or rejoined) is disconnected to reconnect to the session there.  It
    #: is alive, only its session moved: for this many seconds its will waits (and is not
    #: published if the client id connects again meanwhile), and the session at its new
    #: home queues past ``limits.max_queued`` instead of dropping its oldest messages (what
    #: piled up for it during the failover is acknowledged data).  0: neither.
    moved_session_grace: Seconds = 15.0
    #: Seconds between route digests sent to each peer (anti-entropy; docs/design.md).
    route_sync_interval: Interval = 2.0
    #: Longest an owner holds a QoS >= 1 publish while its routes are not known complete,
    #: and longest a durable write waits for a replica the view still names; past it the
    #: publish is refused (no PUBACK) rather than acknowledged on incomplete state.
    cluster_write_patience: Interval = 15.0
    #: A data link whose frames see no acknowledgement for this long while TCP retransmits
    #: (or twice this long with every byte delivered) is replaced by a fresh connection,
    #: which sends them again (``cluster/replay.py``).
    link_stall_timeout: Interval = 3.0
    #: A node acknowledges the frames of each peer's link at most this often: more often
    #: frees senders' windows sooner and costs a write per burst.
    link_ack_interval: Interval = 0.01
    #: Bytes of frames a data link keeps until its peer acknowledges them (for replay); a
    #: link with this much unacknowledged stops sending until acknowledgements arrive.
    #: Raised to two of the largest frames if set below (``limits.max_packet_size``).
    link_replay_window: Count = 32 * 1024 * 1024
    #: Messages a data link's queue to one peer holds (each packed QoS 0 PUBLISH counts).
    #: Past it, QoS 0 traffic to that peer is dropped (counted), acknowledged traffic waits
    #: for room, and a persistent session whose relayed output is dropped has its client's
    #: connection there closed (the client resends on reconnect).
    link_queue_messages: Count = 50_000
    #: Relative share of shards this node takes on the ring (an integer >= 1).
    node_weight: Count = 1
    #: Seconds a leaving node waits for its shards to be caught up elsewhere before it goes.
    leave_timeout: Seconds = 30.0
    #: SIGINT/SIGTERM: leave the cluster (hand the shards away) before stopping.  False:
    #: stop and stay a member, as for a restart (``--workers`` stops all its nodes at once,
    #: with nobody to hand shards to).
    leave_on_stop: bool = True
    #: ``python -m mqttring.node`` only (an embedding process owns its own GC): a full
    #: garbage collection at most once per this many middle-generation ones (CPython: 10).
    #: Every full collection walks every connection's objects; see ``docs/operations.md``.
    gc_full_every: Count = 100
    #: ``python -m mqttring.node`` only: move what start-up allocated out of the collector's
    #: reach once the node listens (it lives as long as the process anyway).
    gc_freeze: bool = True
    #: Log level of the node process: debug, info, warning or error (SIGHUP reloads it).
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: Append the log to this file instead of stderr (reopened when rotated away).
    log_file: Path | None = None
    #: ``text`` (one human line per record) or ``json`` (one JSON object per line).
    log_format: Literal["text", "json"] = "text"

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_together()

    def _check_together(self) -> None:
        """Rules over several fields; each message names every field it involves."""
        if self.mqtt is None and self.ws is None and self.mqtts is None and self.wss is None:
            raise ConfigError('mqtt and ws are both off: at least one listener is needed '
                              '(mqtt = "HOST:PORT", ws, mqtts or wss)')
        self._check_tls()
        self._check_cluster_tls()
        beat, grace = self.heartbeat_interval, self.failure_grace
        if grace <= beat:
            raise ConfigError(f"failure_grace = {grace}: must exceed heartbeat_interval "
                              f"= {beat}")
        if self.fence_after >= grace:
            raise ConfigError(f"fence_after = {self.fence_after}: must be below failure_grace "
                              f"= {grace} (0: failure_grace - heartbeat_interval)")
        if self.fence_seconds <= grace / 4:
            raise ConfigError(f"fence_after = {self.fence_after} (in effect "
                              f"{self.fence_seconds}s): must exceed failure_grace / 4 = "
                              f"{grace / 4}: a heartbeat cannot prove quorum for less than that")
        if self.link_ack_interval * 4 > self.link_stall_timeout:
            raise ConfigError(f"link_ack_interval = {self.link_ack_interval}: must be at most "
                              f"link_stall_timeout / 4 = {self.link_stall_timeout / 4}: links "
                              "acknowledged that seldom would look stalled")
        hold = self.limits.slow_subscriber_hold
        if hold >= self.cluster_write_patience:
            raise ConfigError(f"limits.slow_subscriber_hold = {hold}: must be below "
                              f"cluster_write_patience = {self.cluster_write_patience}: a "
                              "publish held longer would be refused by the node waiting for it")
        if self.cluster is None:
            for name in ("join", "raft"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} = {show(getattr(self, name))}: needs cluster = "
                                      "HOST:PORT (this node's own cluster address); without "
                                      "it the node would run alone, apart from that cluster")
        for name in ("cluster", "admin"):
            address = getattr(self, name)
            if address is not None and not (self.cluster_secret or os.environ.get(SECRET_ENV)):
                raise ConfigError(f"{name} = {show(address)}: needs cluster_secret (or "
                                  f"${SECRET_ENV}): the {name} port authenticates every peer "
                                  "with it")
        if self.cluster is not None and self.raft is None and parse_hostport(self.cluster)[1] == 0:
            raise ConfigError(f"cluster = {show(self.cluster)}: with port 0 give raft = "
                              "HOST:PORT explicitly (Raft needs a fixed port: cluster port + 1 "
                              "by default)")
        if self.http is not None and self.http_token is None \
                and not is_loopback(parse_hostport(self.http)[0]):
            # The API can kick clients and publish: beyond this machine it demands a token.
            raise ConfigError(f"http = {show(self.http)}: reachable beyond this machine, so "
                              "it needs http_token (or $MQTTRING_HTTP_TOKEN)")

    def _check_tls(self) -> None:
        """What can be told without loading the files (``mqttring.broker.tls`` loads them)."""
        if self.use_identity_as_username and not self.require_certificate:
            raise ConfigError("use_identity_as_username needs require_certificate")
        if self.require_certificate and self.cafile is None:
            raise ConfigError("require_certificate needs cafile (the CA of client certificates)")
        if self.crlfile is not None and not self.require_certificate:
            # Without it no client certificate is asked for, so nothing would be checked.
            raise ConfigError("crlfile needs require_certificate")
        if self.mqtts is None and self.wss is None:
            return
        if self.certfile is None or self.keyfile is None:
            raise ConfigError("a TLS listener (mqtts, wss) needs certfile and keyfile")
        _check_files(self, ("certfile", "keyfile", "cafile", "crlfile"))

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
    def from_toml(cls, path: str | Path, *, environ: Mapping[str, str] | None = None,
                  **overrides: Any) -> BrokerConfig:
        """Read a TOML file (top-level keys plus the ``[limits]`` and ``[store]`` tables);
        then ``from_mapping`` (environment, then ``overrides``)."""
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            hint = ""
            if re.search(r"=\s*null\b", Path(path).read_text(errors="replace")):
                hint = ('; TOML has no null: leave the key out, or write "" or false to '
                        "turn a listener off")
            raise ConfigError(f"cannot read config {path}: not valid TOML: {exc}{hint}"
                              ) from None
        return cls.from_mapping(raw, environ=environ, **overrides)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, environ: Mapping[str, str] | None = None,
                     **overrides: Any) -> BrokerConfig:
        """Settings as TOML would give them, then ``MQTTRING_*`` variables of ``environ``
        (``os.environ`` unless given), then ``overrides`` (typed values; None: not given).

        Each layer is checked as it comes, so an error names the key, variable or flag that
        holds the bad value; rules over several fields run on the result.
        """
        if "users" in raw:
            raise ConfigError(_USERS_REMOVED)
        values = table_values(cls, raw)
        env = os.environ if environ is None else environ
        _merge(values, environment_overrides(env, cls))
        specs = field_specs(cls)
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in specs:
                raise ConfigError(f"{key} = {show(value)}: unknown setting{suggest(key, specs)}")
            values[key] = value
        result: BrokerConfig = build(cls, values)
        return result


def _merge(into: dict[str, Any], more: Mapping[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _env_names(cls: type, prefix: str) -> dict[str, tuple[str, ...]]:
    """Every variable name a settings class answers to, and the key path it sets."""
    names: dict[str, tuple[str, ...]] = {}
    for name, spec in field_specs(cls).items():
        names[f"{prefix}{name.upper()}"] = (name,)
        if spec.table is not None:
            for sub in field_specs(spec.table):
                names[f"{prefix}{name.upper()}__{sub.upper()}"] = (name, sub)
    return names


def environment_overrides(environ: Mapping[str, str],
                          cls: type = BrokerConfig) -> dict[str, Any]:
    """``MQTTRING_<KEY>`` and ``MQTTRING_<TABLE>__<KEY>`` variables, parsed and checked.

    A string becomes the field's type (``"32"`` an integer, ``"true"``/``"false"`` a boolean,
    a list or table a TOML value); an error names the variable.  Any other ``MQTTRING_``
    variable is refused (with the closest name): a mistyped one would otherwise be ignored.
    """
    names = _env_names(cls, ENV_PREFIX)
    values: dict[str, Any] = {}
    for var, text in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        path = names.get(var)
        if path is None:
            raise ConfigError(f"{var}: no such setting{suggest(var, names)}")
        spec = field_specs(cls)[path[0]]
        if spec.table is not None and len(path) == 1:
            first = next(iter(field_specs(spec.table))).upper()
            raise ConfigError(f"{var}: [{path[0]}] is a table: set its keys one by one, as "
                              f"{var}__<KEY> (e.g. {var}__{first})")
        if len(path) == 2:
            assert spec.table is not None
            spec = field_specs(spec.table)[path[1]]
            values.setdefault(path[0], {})[path[1]] = parse_text(spec, text, var)
        else:
            values[path[0]] = parse_text(spec, text, var)
    return values


def flag_overrides(flags: Mapping[str, Any], cls: type = BrokerConfig) -> dict[str, Any]:
    """Command-line values by field name, checked; a string is parsed as in the environment.

    An error names the flag (``--max-inflight``, from the field name).  None (a flag not
    given) is left out, so that the file's and the environment's values stand.
    """
    specs = field_specs(cls)
    values: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if name not in specs:
            raise error(flag, value, "unknown setting")
        if isinstance(value, str):
            parsed = parse_text(specs[name], value, flag)
            # "" turns a listener off; kept as "" so that it is not taken for "not given".
            values[name] = "" if parsed is None and specs[name].off else parsed
        else:
            values[name] = check_value(specs[name], value, flag)
    return values


#: The unsalted ``[users]`` table of earlier versions is refused, saying how to migrate.
_USERS_REMOVED = ("users: the [users] table (unsalted SHA-256) was removed: put each user in a "
                  "password file with `mqttring passwd -c -b FILE USER PASSWORD` (then "
                  "without -c for more) and set password_file = \"FILE\"")


def _check_files(config: BrokerConfig, names: tuple[str, ...]) -> None:
    for name in names:
        path = getattr(config, name)
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"{name} = {show(str(path))}: not a readable file")
