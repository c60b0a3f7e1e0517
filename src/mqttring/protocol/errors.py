"""One error family for everything a peer can get wrong.

Who is at fault decides what happens: an ``MQTTError`` always means *the peer* sent something
invalid, so the connection adapter closes that one connection (logging at debug) and the node
keeps serving.  A bug in our own code raises ordinary Python exceptions, which tests surface.

Every message starts with the conformance statement it violates, e.g.
``MalformedPacket("MQTT-3.3.2-2", "topic name must not contain wildcards: 'a/+'")`` prints as
``[MQTT-3.3.2-2] topic name must not contain wildcards: 'a/+'``.  Where the specification
states a rule without a numbered statement, the rule id is its section (``MQTT-2.2.3`` for
the remaining length encoding, ``MQTT-2.2.1`` for reserved packet types).
"""

from __future__ import annotations


class MQTTError(Exception):
    """A peer violated MQTT; ``rule`` names the normative statement.

    ``reason_code`` is the MQTT 5.0 reason code the specification assigns to this kind of
    fault (section 2.4): a v5 connection sends it in a DISCONNECT before closing (a 3.1.1
    connection just closes).  Each subclass has its default; a raise site that knows a
    more precise one (0x94 topic alias invalid, 0x93 receive maximum exceeded) passes it.
    """

    default_reason_code = 0x80  # unspecified error

    def __init__(self, rule: str, message: str, reason_code: int | None = None) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule
        self.detail = message
        self.reason_code = self.default_reason_code if reason_code is None else reason_code


class MalformedPacket(MQTTError):
    """The bytes do not form a valid packet (codec level)."""

    default_reason_code = 0x81


class PacketTooLarge(MalformedPacket):
    """Remaining length exceeds the configured maximum packet size."""

    default_reason_code = 0x95


class ProtocolViolation(MQTTError):
    """A well-formed packet arrived where the session state forbids it."""

    default_reason_code = 0x82


class InvalidTopic(MalformedPacket):
    """A topic name or topic filter breaks the rules of section 4.7."""
