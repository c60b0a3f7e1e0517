"""Sans-IO MQTT 3.1.1 and 5.0: packets, codecs, topics and the per-connection session machine.

MQTT 5.0 lives beside 3.1.1 in its own modules (``properties``, ``packets5``, ``decoder5``,
``codec5``, ``connection5``, ``session5``), so the 3.1.1 paths keep their cost.

Nothing in this package does I/O or imports trio, sockets, LMDB or pysyncobj: it takes bytes
and events and returns bytes and events, so tests, fuzzers, benchmarks and other transports
can drive it directly.
"""

from mqttring.protocol.codec import PacketDecoder, decode, encode, encode_publish
from mqttring.protocol.codec5 import PacketDecoder5, decode5, encode5
from mqttring.protocol.connection import ConnState, ServerConnection
from mqttring.protocol.errors import (
    InvalidTopic,
    MalformedPacket,
    MQTTError,
    PacketTooLarge,
    ProtocolViolation,
)
from mqttring.protocol.message import Message
from mqttring.protocol.properties import Properties, PropertyId, ReasonCode
from mqttring.protocol.session import Session, SessionLimits
from mqttring.protocol.topics import (
    TopicIndex,
    TopicTrie,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)

__all__ = [
    "ConnState",
    "InvalidTopic",
    "MQTTError",
    "MalformedPacket",
    "Message",
    "PacketDecoder",
    "PacketDecoder5",
    "PacketTooLarge",
    "Properties",
    "PropertyId",
    "ProtocolViolation",
    "ReasonCode",
    "ServerConnection",
    "Session",
    "SessionLimits",
    "TopicIndex",
    "TopicTrie",
    "decode",
    "decode5",
    "encode",
    "encode5",
    "encode_publish",
    "topic_matches",
    "validate_topic_filter",
    "validate_topic_name",
]
