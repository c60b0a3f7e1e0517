"""``MqttRingBroker``: the composition root of a node, single or clustered.

The broker layer (``mqttring.broker``) runs one node and knows clustering only through the
``ClusterMember`` seam; the cluster layer (``mqttring.cluster``) builds on the broker layer.
This module sits above both and decides which parts a node gets: with ``config.cluster``
set, the cluster data plane; otherwise a single node's local router and sessions.  With
``config.http`` set it also runs the HTTP API (``mqttring.http``) beside the node.
"""

from __future__ import annotations

import trio

from mqttring.broker.files import NodeFiles
from mqttring.broker.server import BoundPorts, BrokerNode
from mqttring.cluster.plane import DataPlane
from mqttring.config import BrokerConfig


class MqttRingBroker(BrokerNode):
    """An MQTT node: one broker, or a cluster member when ``config.cluster`` is set.

    See ``docs/embedding.md`` for running it inside a trio program (``async with``,
    ``nursery.start(broker.serve)``) or a plain Python one (``start()``/``stop()``).
    """

    def __init__(self, config: BrokerConfig | None = None, *,
                 files: NodeFiles | None = None) -> None:
        """``files``: what ``config`` names, already loaded (``NodeFiles.load(config)``);
        None: ``serve`` loads it."""
        super().__init__(config, cluster=DataPlane, files=files)
        #: The bound port of the HTTP API (``config.http``), once serving; None when off.
        self.http_port: int | None = None

    async def serve(
        self, *, task_status: trio.TaskStatus[BoundPorts] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The node, then its HTTP listener, in one nursery: cancelling it stops both."""
        async with trio.open_nursery() as nursery:
            ports = await nursery.start(super().serve)
            if self.config.http is not None:
                from mqttring.http.server import serve_http  # its libraries load only if used
                self.http_port = await nursery.start(serve_http, self)
            task_status.started(ports)


__all__ = ["BoundPorts", "MqttRingBroker"]
