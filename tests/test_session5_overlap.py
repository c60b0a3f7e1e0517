"""``session5`` rules for overlapping subscriptions and an expiry of 0, as pure objects (the
end-to-end cases are ``test_e2e_mqtt5_options_overlap.py`` and
``test_e2e_mqtt5_expiry_zero.py``)."""

from __future__ import annotations

from mqttring.broker.subscribing import RetainedReplay
from mqttring.protocol.codec5 import PacketDecoder5
from mqttring.protocol.message import Message
from mqttring.protocol.properties import Properties, PropertyId
from mqttring.protocol.session import Session
from mqttring.protocol.session5 import NO_LOCAL, PublishProps, V5Session, own_grant

P = PropertyId
NOW = 1_800_000_000.0


def _packets(out: bytearray) -> list[object]:
    decoder = PacketDecoder5()
    decoder.feed(bytes(out))
    return list(decoder)


def _zero(origin: str = "other") -> PublishProps:
    return PublishProps.from_properties(Properties([(P.MESSAGE_EXPIRY_INTERVAL, 0)]), origin,
                                        NOW)


def test_expiry_counts_whole_seconds() -> None:
    """Less than a second past the deadline: sent with an interval of 0; then dropped."""
    for later, sent in ((0.0, True), (0.4, True), (0.999, True), (1.0, False), (5.0, False)):
        v5 = V5Session("me", clock=lambda later=later: NOW + later)  # type: ignore[misc]
        out = bytearray()
        assert v5.send(out, Message("a", b"x", 1, props=_zero()), 1, False, False, 1) is sent
        if sent:
            [publish] = _packets(out)
            assert publish.properties.get(P.MESSAGE_EXPIRY_INTERVAL) == 0  # type: ignore[attr-defined]
        else:
            assert out == b""


def test_a_stored_copy_with_expiry_0_has_expired() -> None:
    assert _zero().expired(NOW)
    session = Session("me", False)
    session.deliver(Message("a", b"x", 1, props=_zero()), 1, now=NOW)
    out = bytearray()
    session.attach(out, NOW + 0.1)
    assert out == b"" and not session.queue


def test_own_grant_leaves_out_no_local_subscriptions() -> None:
    subs = {"a/#": 2, "a/b": 0, "a/+": 1}
    assert own_grant(None, subs, "a/b", 2) == 2
    assert own_grant({"a/#": 0x100}, subs, "a/b", 2) == 2  # an identifier, no No Local
    assert own_grant({"a/#": NO_LOCAL}, subs, "a/b", 2) == 1
    assert own_grant({"a/#": NO_LOCAL, "a/+": NO_LOCAL}, subs, "a/b", 2) == 0
    assert own_grant({f: NO_LOCAL for f in subs}, subs, "a/b", 2) == -1


def test_identifiers_of_no_local_subscriptions_only_for_others_messages() -> None:
    v5 = V5Session("me", clock=lambda: NOW)
    v5.set_options("a/#", NO_LOCAL, 1)
    v5.set_options("a/b", 0, 2)
    for origin, ids in (("me", [2]), ("other", [1, 2])):
        out = bytearray()
        v5.send(out, Message("a/b", b"x", 0, props=PublishProps(origin=origin)), 0, False,
                False, None)
        [publish] = _packets(out)
        assert publish.properties.get_all(P.SUBSCRIPTION_IDENTIFIER) == ids  # type: ignore[attr-defined]


def test_a_retained_replay_carries_its_subscribes_identifiers() -> None:
    v5 = V5Session("me", clock=lambda: NOW)
    v5.set_options("a/#", 0, 1)
    v5.set_options("a/b", 0, 2)
    out = bytearray()
    v5.send(out, RetainedReplay(Message("a/b", b"x", 0, True), ("a/b",)), 0, True, False,
            None)
    [publish] = _packets(out)
    assert publish.properties.get_all(P.SUBSCRIPTION_IDENTIFIER) == [2]  # type: ignore[attr-defined]
