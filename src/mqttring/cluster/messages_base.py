"""The base of every cluster link message type, and the field types they share.

Apart from ``mqttring.cluster.messages`` only so that the message families can live in
modules of their own (``messages_sessions``) without a cycle: ``messages`` imports each
family to build the ``LinkMessage`` union and the ``Frame`` codec, and each family needs
this base.  Nothing here has a tag, so nothing here is on the wire by itself; the codec
options (``array_like``, ``gc=False``) are set once, on ``WireMessage``.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec

QoS = Annotated[int, msgspec.Meta(ge=0, le=2)]
#: A route as the route table keys it: (topic filter, target: a node id or ``s:<shard>``).
RouteKey: TypeAlias = tuple[str, str]
#: The MQTT 5 properties of a message (``session5.PublishProps.to_wire()``): forwarded
#: property bytes, message expiry deadline (wall-clock UNIX seconds, 0: none), publisher's
#: client id (No Local).  None for a 3.1.1 message (one msgpack nil on the wire: msgspec
#: does not omit defaults of array-like structs).
Props: TypeAlias = tuple[bytes, float, str]


class WireMessage(msgspec.Struct, array_like=True, gc=False):
    """Base of every link message: the codec options live here, once.

    ``gc=False``: messages hold only strings, bytes, numbers and lists of them, never a
    reference back, so the cycle collector need not track the thousands per second the
    links carry.
    """


class FrozenMessage(WireMessage, frozen=True):
    """A message never changed after it is built (all but ``Batch``)."""


__all__ = ["FrozenMessage", "Props", "QoS", "RouteKey", "WireMessage"]
