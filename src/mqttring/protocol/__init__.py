"""Sans-IO MQTT 3.1.1: packets, codec, topics and the per-connection session machine.

Nothing in this package does I/O or imports trio, sockets, LMDB or pysyncobj: it takes bytes
and events and returns bytes and events, so tests, fuzzers, benchmarks and other transports
can drive it directly.
"""

from mqttring.protocol.codec import PacketDecoder, decode, encode, encode_publish
from mqttring.protocol.connection import ConnState, ServerConnection
from mqttring.protocol.errors import (
    InvalidTopic,
    MalformedPacket,
    MQTTError,
    PacketTooLarge,
    ProtocolViolation,
)
from mqttring.protocol.session import Message, Session, SessionLimits
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
    "PacketTooLarge",
    "ProtocolViolation",
    "ServerConnection",
    "Session",
    "SessionLimits",
    "TopicIndex",
    "TopicTrie",
    "decode",
    "encode",
    "encode_publish",
    "topic_matches",
    "validate_topic_filter",
    "validate_topic_name",
]
