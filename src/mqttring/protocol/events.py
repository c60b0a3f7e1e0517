"""Events a ``ServerConnection`` hands to the broker, and its states (both protocol
versions).

Their own module so that the 3.1.1 machine (``connection``) and its v5 half
(``connection5``) build the same events without importing each other in a cycle;
``connection`` re-exports them, the import every caller uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import NamedTuple

from mqttring.protocol.message import Message
from mqttring.protocol.packets import Connect
from mqttring.protocol.packets5 import Connect5

__all__ = ["ConnState", "ConnectRequested", "DisconnectRequested", "Event", "PingRequested",
           "PublishReceived", "SubscribeRequested", "UnsubscribeRequested"]


class ConnState(Enum):
    """Where a connection is: CONNECT awaited, being decided, connected, closed."""

    AWAIT_CONNECT = auto()
    CONNECTING = auto()
    CONNECTED = auto()
    CLOSED = auto()


# -- events handed to the broker ------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ConnectRequested:
    packet: Connect | Connect5


class PublishReceived(NamedTuple):
    """A message to route; QoS 1/2 need ``ack_publish(packet_id, qos)`` once accepted.

    A named tuple, not a frozen dataclass like the other events: one is built per PUBLISH,
    and a frozen dataclass's ``__init__`` costs several times a tuple's."""

    message: Message
    packet_id: int | None


@dataclass(slots=True, frozen=True)
class SubscribeRequested:
    packet_id: int
    topics: tuple[tuple[str, int], ...]
    #: MQTT 5: the subscription options byte of each filter (QoS, No Local, Retain As
    #: Published, Retain Handling), in ``topics`` order; None for a 3.1.1 SUBSCRIBE.
    options: tuple[int, ...] | None = None
    #: MQTT 5: the Subscription Identifier (0: none).
    subscription_id: int = 0


@dataclass(slots=True, frozen=True)
class UnsubscribeRequested:
    packet_id: int
    topics: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class DisconnectRequested:
    """A DISCONNECT: the will must be discarded [MQTT-3.14.4-3], unless a v5 client says
    reason 0x04 "disconnect with will message" (section 3.14.2.1)."""

    reason_code: int = 0
    #: MQTT 5: a new Session Expiry Interval for the session (section 3.14.2.2.2).
    session_expiry: int | None = None


@dataclass(slots=True, eq=False)
class PingRequested:
    """A PINGREQ.  The broker answers it (``ServerConnection.send_pingresp``) once the
    packets read before it are answered, so its PINGRESP follows their answers as from one
    broker; an adapter may answer it sooner (a bound on the wait), and ``answered`` keeps
    that to one PINGRESP."""

    answered: bool = False


Event = (
    ConnectRequested
    | PublishReceived
    | SubscribeRequested
    | UnsubscribeRequested
    | DisconnectRequested
    | PingRequested
)
