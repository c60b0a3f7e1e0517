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
    #: Never a message's state in memory: the state of the row a completed QoS 2 message
    #: leaves in the store for a while (``Completed``).
    COMPLETED = 4


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


@dataclass(slots=True, frozen=True)
class Completed:
    """What a QoS 2 message its client completed leaves in its session's record, for as
    long as a cluster's retry of it can still come (``SessionLimits.qos2_dedup_seconds``):
    its identity (``Message.mid``) and when it completed (wall clock, UNIX seconds).

    A session remembers the QoS 2 identities it got (``Session.recent_qos2``), but only in
    memory; a session loaded on another node knew only the ones it still held.  One
    completed and then moved (its home cut off, the shard handed back after a heal) took
    the retry's copy for a new message: a second delivery at QoS 2 (the 5-node partition
    of the fault suite, ``docs/faults.md``).  Stored in place of the message's row, it
    tells the next home too.
    """

    mid: int
    at: float
