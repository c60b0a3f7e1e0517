"""MQTT 5.0 Reason Strings (property 0x1F): what a failure says to a human, without I/O.

Why a module of its own: the same rules apply wherever a v5 acknowledgement or refusal is
encoded (``ServerConnection`` at the edge, ``V5Session.encode_ack`` at a cluster home):

* A Reason String is for diagnostics only; a client must not parse it (section 3.2.2.3.16).
  Ours are short and fixed per reason code (``REASON_TEXT``), except for a protocol error,
  whose DISCONNECT says which rule the client broke (the ``MQTTError`` text, cut short).
* CONNACK and DISCONNECT may always carry one.  Any other packet only when the client's
  Request Problem Information is not 0 [MQTT-3.1.2-29], and only on a failure code here
  (success needs no explanation).
* Never past the client's Maximum Packet Size: the string is left out instead
  [MQTT-3.1.2-25, MQTT-3.2.2-19, MQTT-3.14.2-3 and the like for each packet].
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mqttring.protocol.codec5 import encode5
from mqttring.protocol.errors import MalformedPacket
from mqttring.protocol.packets5 import (
    ConnAck5,
    Disconnect5,
    PubAck5,
    PubRec5,
    SubAck5,
    UnsubAck5,
)
from mqttring.protocol.properties import Properties, PropertyId

#: Longest reason string sent (characters): a diagnostic line, not a report.
MAX_REASON = 120

#: A short text per failure reason code this broker sends (Table 2-6, reworded).
REASON_TEXT: dict[int, str] = {
    0x80: "unspecified error",
    0x81: "malformed packet",
    0x82: "protocol error",
    0x83: "implementation specific error",
    0x84: "unsupported protocol version",
    0x85: "client identifier not valid",
    0x86: "bad user name or password",
    0x87: "not authorized",
    0x88: "server unavailable",
    0x89: "server busy: the cluster cannot accept this now, reconnect",
    0x8B: "server shutting down",
    0x8C: "no enhanced authentication method is supported",
    0x8D: "keep alive timeout",
    0x8E: "session taken over by another connection",
    0x8F: "topic filter invalid",
    0x90: "topic name invalid",
    0x93: "receive maximum exceeded",
    0x94: "topic alias invalid",
    0x95: "packet too large",
    0x97: "quota exceeded",
    0x98: "disconnected by an administrator",
    0x99: "payload format invalid",
    0x9C: "this node is cut off from its cluster: use another server",
    0x9E: "shared subscriptions not supported",
    0xA1: "subscription identifiers not supported",
    0xA2: "wildcard subscriptions not supported",
}


def reason_text(code: int, detail: str | None = None) -> str:
    """The reason string for ``code``; ``detail`` (a protocol error's text) wins."""
    text = detail or REASON_TEXT.get(code, f"reason code {code:#04x}")
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 3] + "..."


def _failures(packet: Any) -> list[int]:
    kind = type(packet)
    if kind is SubAck5 or kind is UnsubAck5:
        return [c for c in packet.reason_codes if c >= 0x80]
    return [packet.reason_code] if packet.reason_code >= 0x80 else []


def encode_with_reason(packet: ConnAck5 | Disconnect5 | PubAck5 | PubRec5 | SubAck5
                       | UnsubAck5, problem_info: bool, max_packet_size: int,
                       detail: str | None = None) -> bytes:
    """``packet`` encoded, with a Reason String added when the rules above allow it.

    ``problem_info``: the client's Request Problem Information (ignored for CONNACK and
    DISCONNECT); ``max_packet_size``: the client's Maximum Packet Size (0: none).
    """
    failures = _failures(packet)
    always = type(packet) is ConnAck5 or type(packet) is Disconnect5
    if not failures or not (always or problem_info):
        return encode5(packet)
    # One string per packet: a SUBACK failing for two reasons names both.
    texts = dict.fromkeys(reason_text(code, detail) for code in failures)
    text = reason_text(0, "; ".join(texts))
    props = Properties((*packet.properties.items, (PropertyId.REASON_STRING, text)))
    try:
        data = encode5(replace(packet, properties=props))  # type: ignore[type-var]
    except MalformedPacket:
        return encode5(packet)  # a detail quoting what the peer sent may not be valid UTF-8
    if max_packet_size and len(data) > max_packet_size:
        return encode5(packet)
    return data
