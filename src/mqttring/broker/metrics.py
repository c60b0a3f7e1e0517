"""Counters one node keeps about its traffic, read by ``$SYS`` and ``mqttring status``.

Plain integer attributes bumped inline on the hot path (an attribute add is the cheapest
thing Python does); nothing is logged per message.  The cluster counters are zero on a single
node and let the benchmark derive inter-node messages per publish.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class BrokerMetrics:
    started_at: float = field(default_factory=time.time)
    clients_connected: int = 0
    connections_total: int = 0
    #: Idle TCP connections waiting in the parking lot, without a task (a gauge).
    clients_parked: int = 0
    #: Times a parked connection got its task back (data, a delivery, a close, a timeout).
    connections_resumed: int = 0
    #: PUBLISH packets received from clients (including wills published for them).
    messages_received: int = 0
    #: The same by the QoS the client published with (index 0, 1, 2), for ``/metrics``.
    received_by_qos: list[int] = field(default_factory=lambda: [0, 0, 0])
    #: PUBLISH packets written, or queued to be written, to local clients' connections
    #: (deliveries).  A QoS 0 message dropped for a client over its output limit counts in
    #: ``messages_dropped`` only; a QoS 1/2 message queued for an online client counts here
    #: when queued, even if it is dropped later (queue full, expired) or the client leaves.
    messages_sent: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    #: Messages dropped for slow or away clients (queue full, output full, expired).
    messages_dropped: int = 0
    #: Connections closed because the peer broke the protocol.
    protocol_errors: int = 0
    #: TLS connections closed before their handshake completed: plaintext or garbage on a
    #: TLS port, a client certificate the CA did not sign, a stall past connect_timeout.
    tls_handshake_failures: int = 0
    #: Publishes and subscriptions the ACL denied (the first of each connection is logged
    #: at info, the rest at debug: a client repeating one could flood the log).
    acl_denials: int = 0
    #: Connections closed because of an error in mqttring itself (logged with a traceback).
    internal_errors: int = 0
    #: Publishes not acknowledged because the cluster could not accept them (faults); the
    #: publisher's connection was closed so that it resends.
    publishes_refused: int = 0
    #: Publishes whose acknowledgement waited for a congested subscriber (flow control).
    publishes_held: int = 0
    #: Subscribers disconnected for making no room within ``slow_subscriber_hold``.
    slow_subscribers_disconnected: int = 0
    #: Cluster: publishes forwarded to a shard owner on another node.
    forwarded_to_owner: int = 0
    #: Cluster: delivery messages sent to other nodes that hold subscribers.
    deliveries_to_nodes: int = 0
    #: Shared subscriptions (``$share/g/f``) with members on this node (a gauge).
    shared_groups: int = 0
    #: Messages this node gave to one of its members of a share.
    shared_placed: int = 0
    #: Times this node was to give a message to a member of a share and had none to give it
    #: to (none left, or only offline ones while an online one was wanted): the dispatcher
    #: tries the next node, or the share has no member.
    shared_declined: int = 0
    #: Copies of shares sent back to their share because the member that had them ended
    #: unacknowledged, or (cluster, counted by the dispatcher) its node left the view.
    shared_redispatched: int = 0
    #: Cluster: copies placed with members on other nodes no longer tracked against that
    #: node's death (``MAX_UNCONFIRMED`` reached).
    shared_untracked: int = 0

    def uptime(self) -> float:
        return time.time() - self.started_at

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["uptime"] = self.uptime()
        return data
