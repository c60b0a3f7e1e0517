"""The seam through which a cluster plugs into one broker node.

The broker layer does not know clustering; it knows that a node may be a *member* of
something larger, which then supplies the parts that differ (router, session manager,
shard-aware stores) and runs beside the listeners.  ``mqttring.cluster.plane.DataPlane`` is
the one implementation; ``mqttring.embedded.MqttRingBroker`` (the composition root) hands its
factory to the node when the configuration names a cluster address.  Layers import
downward only: cluster imports broker, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from mqttring.broker.metrics import BrokerMetrics
from mqttring.broker.retained import RetainedStore
from mqttring.broker.router import Router
from mqttring.broker.session_store import SessionStore
from mqttring.broker.sessions import SessionManager
from mqttring.cluster_tls import ClusterTls
from mqttring.config import BrokerConfig
from mqttring.lsm import LsmStore
from mqttring.rpc import RpcServer

if TYPE_CHECKING:
    from mqttring.broker.core import BrokerCore


class ClusterMember(Protocol):
    """What a node needs from the cluster it belongs to (built before the broker core)."""

    retained: RetainedStore
    #: Both write through the cluster's replication (a ``ShardWriter``), which the broker
    #: layer never calls itself.
    session_store: SessionStore
    #: The authenticated RPC server on the cluster address (admin requests go there too).
    admin: RpcServer

    def make_router(self, core: BrokerCore) -> Router:
        """The clustered router, bound to the core's sessions (called by the core)."""

    def make_sessions(self, core: BrokerCore) -> SessionManager:
        """The clustered session manager, bound to the core (called by the core)."""

    def owned_shards(self) -> Iterable[int]:
        """Shards this node owns now (archive retention runs over them)."""

    def replica_shards(self) -> list[int]:
        """Shards this node holds a copy of (what a snapshot of this node covers)."""

    def advertise_mqtt(self, address: str) -> None:
        """The MQTT address other members should hand out for this node."""

    def link_stats(self) -> dict[str, dict[str, int]]: ...

    async def run(self, *, task_status: trio.TaskStatus[Any] = ...) -> None:
        """Join the cluster and serve it until cancelled; ``started`` once a member.

        Returns by itself once the node has been asked to leave over the admin RPC
        (``mqttring leave``) and has left: the node then stops.
        """

    async def leave(self) -> bool:
        """Hand this node's shards away and leave the cluster (graceful shutdown).

        False when there was nothing to leave (not a member, or the last one); raises when
        the cluster could not commit a step of it.
        """


#: Builds the member for a node; called once the node store is open, with the cluster's
#: mutual-TLS contexts as the node loaded them at start-up (None: plain TCP).
ClusterFactory = Callable[[BrokerConfig, LsmStore, BrokerMetrics, ClusterTls | None],
                          ClusterMember]

__all__ = ["ClusterFactory", "ClusterMember"]
