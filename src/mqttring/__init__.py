"""mqttring: a distributed MQTT 3.1.1 broker (Raft metadata, hash ring, trio, LMDB).

The public names below are imported on first use (PEP 562), not with the package: every
``python -m mqttring.node`` imports this package before its first line runs, and importing
the broker takes about a second, during which the node must already hold stop signals
(``mqttring.stop_signals``).  ``from mqttring import MqttRingBroker`` works as before.
"""

from __future__ import annotations

from mqttring.lazy_exports import lazy_exports

__version__ = "0.1.0"

TYPE_CHECKING = False  # type checkers take it as typing.TYPE_CHECKING; importing typing: 10 ms

if TYPE_CHECKING:
    from mqttring.config import BrokerConfig, ConfigError, Limits, StoreSettings
    from mqttring.embedded import BoundPorts, MqttRingBroker
    from mqttring.errors import ListenError
    from mqttring.lsm.ops import StoreError

#: Public name -> the module that defines it.
_EXPORTS = {
    "BoundPorts": "mqttring.embedded",
    "BrokerConfig": "mqttring.config",
    "ConfigError": "mqttring.config",
    "Limits": "mqttring.config",
    "ListenError": "mqttring.errors",
    "MqttRingBroker": "mqttring.embedded",
    "StoreError": "mqttring.lsm.ops",
    "StoreSettings": "mqttring.config",
}


__getattr__, __dir__ = lazy_exports('mqttring', _EXPORTS, globals())


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
