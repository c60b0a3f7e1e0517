"""A message on its way to one session's client, and where it is in its handshake.

Apart from ``session.py`` because both the session's rules (``Session``, ``QoS2Handshakes``)
and the store that writes these records (``broker.session_store``) speak of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from mqttring.protocol.message import Message


class OutState(IntEnum):
    """Where an outbound QoS 1/2 message is in its handshake."""

    QUEUED = 0
    AWAIT_PUBACK = 1
    AWAIT_PUBREC = 2
    AWAIT_PUBCOMP = 3


@dataclass(slots=True)
class Outbound:
    """One message on its way to this session's client, at the QoS it will be delivered."""

    seq: int
    message: Message
    qos: int
    retain: bool = False
    packet_id: int | None = None
    state: OutState = OutState.QUEUED
    #: Wall-clock deadline (UNIX seconds) after which a still-queued copy is dropped; 0 = never.
    expires_at: float = 0.0
