"""``$SYS/broker/...``: the node's vital signs as retained messages, mosquitto's names.

Published through the router like any retained message, so a ``$SYS/#`` subscriber gets the
latest values at once and updates every ``sys_interval`` seconds.  Kept out of the store: a
restarted node republishes fresh values within one interval.
"""

from __future__ import annotations

import trio

from mqttring import __version__
from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import Router
from mqttring.protocol.message import Message


def sys_values(metrics: BrokerMetrics, retained: RetainedStore) -> dict[str, str]:
    return {
        "$SYS/broker/version": f"mqttring {__version__}",
        "$SYS/broker/uptime": f"{int(metrics.uptime())} seconds",
        "$SYS/broker/clients/connected": str(metrics.clients_connected),
        "$SYS/broker/clients/total": str(metrics.connections_total),
        "$SYS/broker/clients/parked": str(metrics.clients_parked),
        "$SYS/broker/messages/received": str(metrics.messages_received),
        "$SYS/broker/messages/sent": str(metrics.messages_sent),
        "$SYS/broker/messages/dropped": str(metrics.messages_dropped),
        "$SYS/broker/bytes/received": str(metrics.bytes_received),
        "$SYS/broker/bytes/sent": str(metrics.bytes_sent),
        "$SYS/broker/tls/handshake_failures": str(metrics.tls_handshake_failures),
        "$SYS/broker/retained messages/count": str(retained.count_user_topics()),
        "$SYS/broker/cluster/forwarded_to_owner": str(metrics.forwarded_to_owner),
        "$SYS/broker/cluster/deliveries_to_nodes": str(metrics.deliveries_to_nodes),
        # Shared subscriptions (no mosquitto names for these): see docs/operations.md.
        "$SYS/broker/shared/groups": str(metrics.shared_groups),
        "$SYS/broker/shared/placed": str(metrics.shared_placed),
        "$SYS/broker/shared/declined": str(metrics.shared_declined),
        "$SYS/broker/shared/redispatched": str(metrics.shared_redispatched),
        "$SYS/broker/shared/untracked": str(metrics.shared_untracked),
    }


async def publish_sys_topics(
    router: Router, metrics: BrokerMetrics, retained: RetainedStore, interval: float
) -> None:
    """Runs until cancelled; one round of updates every ``interval`` seconds."""
    while True:
        for topic, value in sys_values(metrics, retained).items():
            await router.publish_local(Message(topic, value.encode(), 0, True))
        await trio.sleep(interval)
