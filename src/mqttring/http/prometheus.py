"""``/metrics``: the node's counters in the Prometheus text format, read at scrape time.

A ``prometheus_client`` custom collector: nothing on the hot path changes (the broker keeps
bumping plain integers in ``BrokerMetrics``); each scrape reads them, plus the store's,
the cluster links' and Raft's figures, into fresh metric families.  It runs on the trio
loop: every read is an attribute or a short lock (the store's commit queue), and the sums
over sessions are one pass over memory.  Each node has its own registry (never the global
one), so several embedded nodes in one process do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from mqttring.embedded import MqttRingBroker
    from mqttring.http.queries import ClusterQueries

#: BrokerMetrics attribute -> (metric name without ``mqttring_``, help); all counters.
_COUNTERS = {
    "connections_total": ("connections", "Client connections accepted (CONNACK 0)."),
    "connections_resumed": ("connections_resumed", "Parked connections given a task back."),
    "messages_received": ("messages_received", "PUBLISH packets received (wills included)."),
    "messages_sent": ("messages_sent", "PUBLISH packets handed to local clients."),
    "bytes_received": ("bytes_received", "Bytes read from clients."),
    "bytes_sent": ("bytes_sent", "Bytes written to clients."),
    "messages_dropped": ("messages_dropped", "Messages dropped for slow or away clients."),
    "protocol_errors": ("protocol_errors", "Connections closed for a protocol violation."),
    "tls_handshake_failures": ("tls_handshake_failures", "TLS connections closed before "
                               "their handshake completed (plaintext or garbage on a TLS "
                               "port, a refused client certificate, a stall past "
                               "limits.connect_timeout)."),
    "internal_errors": ("internal_errors", "Connections closed for an error in mqttring."),
    "acl_denials": ("acl_denials", "Publishes and subscriptions denied by the ACL."),
    "publishes_refused": ("publishes_refused", "Publishes not accepted by the cluster."),
    "publishes_held": ("publishes_held", "Publishes held back for a congested subscriber."),
    "slow_subscribers_disconnected": ("slow_subscribers_disconnected",
                                      "Subscribers disconnected as slow consumers."),
    "forwarded_to_owner": ("forwarded_to_owner",
                           "Publishes forwarded to a shard owner on another node."),
    "deliveries_to_nodes": ("deliveries_to_nodes",
                            "Delivery messages sent to nodes that hold subscribers."),
    "shared_placed": ("shared_placed", "Messages given to a member of a share here."),
    "shared_declined": ("shared_declined", "Messages for a share this node had no member "
                        "to give to (none left, or only offline ones while online wanted)."),
    "shared_redispatched": ("shared_redispatched", "Copies of shares sent back to their "
                            "share: their member ended unacknowledged, or its node left."),
    "shared_untracked": ("shared_untracked", "Copies with members on other nodes no longer "
                         "tracked against that node's death (too many unacknowledged)."),
}

#: LsmStore.stats() key -> (metric name, help, counter?).
_STORE = {
    "commits": ("store_commits", "LMDB write transactions committed.", True),
    "committed_ops": ("store_committed_ops", "Puts and deletes committed.", True),
    "syncs": ("store_syncs", "fsyncs of the store.", True),
    "commit_seconds": ("store_commit_seconds", "Seconds spent in LMDB write transactions "
                       "(mean commit latency: its rate over the rate of commits).", True),
    "sync_seconds": ("store_sync_seconds", "Seconds spent in fsyncs (mean: over syncs).",
                     True),
    "durable_writes": ("store_durable_writes", "Writes that waited for an fsync.", True),
    "backpressure_waits": ("store_backpressure_waits",
                           "Writers that waited for a full memtable to drain.", True),
    "memtable_bytes": ("store_memtable_bytes", "Bytes written and not yet committed.", False),
    "map_size": ("store_map_size_bytes", "Size of the LMDB map.", False),
    "used_bytes": ("store_used_bytes", "High-water mark of the LMDB file (up to its last "
                   "page used; freed pages are reused, the file never shrinks).", False),
}

#: Links.stats() key -> (metric name, help, counter?); labelled by peer.
_LINKS = {
    "queued": ("link_queued_messages", "Messages waiting in the link to a peer.", False),
    "sent": ("link_sent_messages", "Messages sent to a peer.", True),
    "frames": ("link_sent_frames", "Frames (batches) sent to a peer.", True),
    "bytes": ("link_sent_bytes", "Bytes of frames sent to a peer.", True),
    "dropped": ("link_dropped_messages", "Messages dropped at a full link.", True),
    "connected": ("link_connected", "1 while the link to a peer is connected.", False),
    "protocol_errors": ("link_protocol_errors", "Malformed frames from a peer.", True),
    "unacked": ("link_unacked_frames", "Frames sent to a peer and not yet acknowledged "
                "(kept for replay).", False),
    "replaced": ("link_replaced_connections", "Connections to a peer replaced because "
                 "they stalled (no acknowledgement while TCP retransmitted, or none for "
                 "twice link_stall_timeout with every byte delivered).", True),
    "replayed": ("link_replayed_frames", "Frames sent to a peer again, on a new "
                 "connection.", True),
}


class NodeCollector(Collector):
    def __init__(self, broker: MqttRingBroker, queries: ClusterQueries) -> None:
        self.broker = broker
        self.queries = queries

    def collect(self) -> Iterator[Metric]:
        broker = self.broker
        m = broker.metrics
        node = broker.config.node_id
        yield _gauge("up", "1 while the node serves.", 1)
        yield _gauge("start_time_seconds", "UNIX time the node started.", m.started_at)
        yield _gauge("uptime_seconds", "Seconds since the node started.",
                     time.time() - m.started_at)
        yield _gauge("clients_connected", "Connected clients.", m.clients_connected)
        yield _gauge("clients_parked", "Idle connections in the parking lot.", m.clients_parked)
        yield _gauge("shared_groups", "Shared subscriptions with members on this node.",
                     m.shared_groups)
        for attr, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(f"mqttring_{name}", doc, value=getattr(m, attr))
        by_qos = CounterMetricFamily("mqttring_publishes_received_by_qos",
                                     "Client PUBLISH packets received, by QoS.", labels=["qos"])
        for qos, count in enumerate(m.received_by_qos):
            by_qos.add_metric([str(qos)], count)
        yield by_qos
        core = broker.core
        if core is not None:
            sessions = core.sessions.values()
            yield _gauge("sessions", "Sessions held by this node (online or not).",
                         len(core.sessions))
            yield _gauge("messages_queued", "Messages waiting in sessions' queues.",
                         sum(len(s.queue) for s in sessions))
            yield _gauge("messages_inflight", "Outbound QoS 1/2 messages awaiting an ack.",
                         sum(len(s.inflight) for s in sessions))
            yield _gauge("subscriptions", "Subscriptions of the sessions held here.",
                         sum(len(s.subscriptions) for s in sessions))
        if broker.retained is not None:
            yield _gauge("retained_messages", "Retained topics held by this node ($SYS aside).",
                         broker.retained.count_user_topics())
            yield _gauge("retained_bytes", "Payload and topic bytes of the retained messages "
                         "held by this node (what limits.max_retained_bytes bounds).",
                         broker.retained.held_bytes)
            yield _gauge("retained_tombstones", "Cleared retained topics whose tombstone "
                         "this node still holds (collected retained_tombstone_seconds after "
                         "the clear).", broker.retained.tombstones)
            yield CounterMetricFamily("mqttring_retained_refused",
                                      "Retained messages delivered but not retained: this "
                                      "node was at limits.max_retained_bytes or "
                                      "max_retained_messages.", value=broker.retained.refused)
        if broker.store is not None:
            stats = broker.store.stats()
            for key, (name, doc, counter) in _STORE.items():
                if key in stats:
                    yield (CounterMetricFamily(f"mqttring_{name}", doc, value=stats[key])
                           if counter else _gauge(name, doc, stats[key]))
        yield from self._cluster(node)

    def _cluster(self, node: str) -> Iterator[Metric]:
        quorum = self.queries.quorum()
        yield _gauge("cluster_quorum", "1 while this node can prove it is in the majority's "
                     "view (always 1 on a single node).", int(quorum))
        plane = self.queries.plane
        if plane is None:
            return
        yield _gauge("cluster_fenced", "1 while this node refuses clients (no quorum).",
                     int(plane.fenced))
        links = plane.link_stats()
        for key, (name, doc, counter) in _LINKS.items():
            family = (CounterMetricFamily(f"mqttring_{name}", doc, labels=["peer"])
                      if counter else
                      GaugeMetricFamily(f"mqttring_{name}", doc, labels=["peer"]))
            for peer, values in sorted(links.items()):
                family.add_metric([peer], values.get(key, 0))
            yield family
        status = plane.metadata.status(brief=True)
        raft, view = status["raft"], status["view"]
        if raft:
            yield _gauge("raft_term", "Current Raft term.", raft["term"])
            yield _gauge("raft_commit_index", "Raft commit index.", raft["commit_index"])
            yield _gauge("raft_leader", "1 while this node is the Raft leader.",
                         int(raft["is_leader"]))
        yield _gauge("cluster_epoch", "Epoch of the view this node applied.", view["epoch"])
        states = GaugeMetricFamily("mqttring_cluster_members", "Members by state.",
                                   labels=["state"])
        counted: dict[str, int] = {"joining": 0, "up": 0, "leaving": 0, "down": 0}
        for member in view["members"].values():
            counted[member["state"]] = counted.get(member["state"], 0) + 1
        for state, count in sorted(counted.items()):
            states.add_metric([state], count)
        yield states
        shards = GaugeMetricFamily("mqttring_shards", "Shards of this node by role (owner, "
                                   "replica held, replica still catching up).", labels=["role"])
        mine = view["shard_counts"].get(node, {})
        for role in ("owner", "replica", "catching_up"):
            shards.add_metric([role], mine.get(role, 0))
        yield shards


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mqttring_{name}", doc, value=value)


def node_registry(broker: MqttRingBroker, queries: ClusterQueries) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(broker, queries))
    ProcessCollector(registry=registry)  # CPU, memory, open files of the node process
    return registry
