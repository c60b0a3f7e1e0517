"""mqttring: a distributed MQTT 3.1.1 broker (Raft metadata, hash ring, trio, LMDB)."""

from __future__ import annotations

__version__ = "0.1.0"

from mqttring.config import BrokerConfig, ConfigError, Limits, StoreSettings
from mqttring.embedded import BoundPorts, MqttRingBroker
from mqttring.errors import ListenError
from mqttring.lsm.ops import StoreError

__all__ = [
    "BoundPorts",
    "BrokerConfig",
    "ConfigError",
    "Limits",
    "ListenError",
    "MqttRingBroker",
    "StoreError",
    "StoreSettings",
    "__version__",
]
