"""The application message as routers, sessions and the cluster pass it around.

Apart from ``session.py`` (the session state machine) because everything that routes
imports it, and it is one idea: a PUBLISH's content, with its encodings cached.
"""

from __future__ import annotations

from random import getrandbits

from mqttring.protocol.codec import encode_publish
from mqttring.protocol.session5 import NO_LOCAL, PublishProps


def new_mid() -> int:
    """A fresh ``Message.mid``: 62 random bits, never 0 (no identity) nor 1 (what the
    session store writes for an inbound QoS 2 id that was acknowledged)."""
    return getrandbits(62) | 2


class Message:
    """An application message as routers pass it around.

    Not frozen on purpose: it caches its UTF-8 topic and its QoS 0 encodings, so a fan-out to
    many subscribers encodes the topic once and a QoS 0 PUBLISH once (pre-encoded fan-out).
    The two encodings are two slots, not a dict: a message is built for every publish, and
    a dict per message was a measurable share of a cluster hop.
    """

    __slots__ = ("_qos0", "_qos0_retained", "_topic_bytes", "mid", "payload", "props", "qos",
                 "retain", "topic")

    def __init__(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                 props: PublishProps | None = None, mid: int = 0) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        #: The identity of a QoS 2 publish (0: none), the same on every hop, in every copy a
        #: retry makes and in the publisher's resend of it, so a session takes it once
        #: (``Session.deliver``).  Given by the publisher's session when the PUBLISH comes
        #: (``Session.begin_inbound_qos2``), by a cluster edge for other QoS 2 messages.
        self.mid = mid
        #: MQTT 5.0 properties carried end to end (``session5.PublishProps``); None for a
        #: 3.1.1 message, and ignored by the 3.1.1 encoders (properties stripped).
        self.props = props
        self._topic_bytes: bytes | None = None
        self._qos0: bytes | None = None
        self._qos0_retained: bytes | None = None

    @property
    def topic_bytes(self) -> bytes:
        tb = self._topic_bytes
        if tb is None:
            tb = self._topic_bytes = self.topic.encode("utf-8")
        return tb

    def encode_qos0(self, retain: bool) -> bytes:
        """The QoS 0 PUBLISH, encoded at most once per retain flag."""
        if retain:
            data = self._qos0_retained
            if data is None:
                data = self._qos0_retained = encode_publish(
                    self.topic_bytes, self.payload, 0, True, False, None
                )
            return data
        data = self._qos0
        if data is None:
            data = self._qos0 = encode_publish(
                self.topic_bytes, self.payload, 0, False, False, None
            )
        return data

    def encode(self, qos: int, retain: bool, dup: bool, packet_id: int | None) -> bytes:
        if qos == 0:
            return self.encode_qos0(retain)
        return encode_publish(self.topic_bytes, self.payload, qos, retain, dup, packet_id)

    def __repr__(self) -> str:
        extra = "" if self.props is None else f", props={self.props!r}"
        return (f"Message({self.topic!r}, {self.payload[:32]!r}, qos={self.qos}, "
                f"retain={self.retain}{extra})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return (self.topic, self.payload, self.qos, self.retain, self.props) == (
            other.topic,
            other.payload,
            other.qos,
            other.retain,
            other.props,
        )

    __hash__ = None  # type: ignore[assignment]


def with_origin(messages: list[Message], client_id: str, options: dict[str, int]
                ) -> list[Message]:
    """The 3.1.1 publishes of a client whose session kept v5 options, tagged with its id
    when any option says No Local: v5 messages always carry it, 3.1.1 ones do not (their
    ``props`` stays None so they cost nothing), yet No Local must know the client's own
    messages [MQTT-3.8.3-3].  Untouched otherwise."""
    if not any(bits & NO_LOCAL for bits in options.values()):
        return messages
    origin = PublishProps(b"", 0.0, client_id)
    return [m if m.props is not None
            else Message(m.topic, m.payload, m.qos, m.retain, origin, m.mid)
            for m in messages]
