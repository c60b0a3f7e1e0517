"""``MqttRingBroker``: the composition root of a node, single or clustered.

The broker layer (``mqttring.broker``) runs one node and knows clustering only through the
``ClusterMember`` seam; the cluster layer (``mqttring.cluster``) builds on the broker layer.
This module sits above both and decides which parts a node gets: with ``config.cluster``
set, the cluster data plane; otherwise a single node's local router and sessions.
"""

from __future__ import annotations

from mqttring.broker.server import BoundPorts, BrokerNode
from mqttring.cluster.plane import DataPlane
from mqttring.config import BrokerConfig


class MqttRingBroker(BrokerNode):
    """An MQTT node: one broker, or a cluster member when ``config.cluster`` is set.

    See ``docs/embedding.md`` for running it inside a trio program (``async with``,
    ``nursery.start(broker.serve)``) or a plain Python one (``start()``/``stop()``).
    """

    def __init__(self, config: BrokerConfig | None = None) -> None:
        super().__init__(config, cluster=DataPlane)


__all__ = ["BoundPorts", "MqttRingBroker"]
